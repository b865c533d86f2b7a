// A byte-level text corpus for language-model training (vocab 256: a token is a byte):
// Debian's fortunes file by default. The text is split into train (first part) and val
// (last val_fraction); get_batch draws random windows like nanoGPT's get_batch, and
// windows()/sequential() walk non-overlapping windows in order (evaluation).
#pragma once

#include <string>
#include <string_view>

#include "nn/data/dataset.h"
#include "tensor/random.h"

namespace tally::data {

enum class Split { train, val };

// Non-overlapping windows of seq_len tokens over a token range, as a Dataset: example i is
// x = tokens[i*T, i*T+T), y = tokens[i*T+1, i*T+T+1) (int64 [T] each).
class TextWindows : public Dataset {
 public:
  TextWindows(Storage bytes, int64_t offset, int64_t count, int64_t seq_len);

  int64_t size() const override { return windows_; }
  int64_t seq_len() const { return seq_len_; }
  Example get(int64_t index) const override;
  Example get_batch(const std::vector<int64_t>& indices, bool pinned = false) const override;

 private:
  void fill(const std::vector<int64_t>& indices, int64_t* x, int64_t* y) const;

  Storage bytes_;
  int64_t offset_, count_, seq_len_, windows_;
};

// Batches of `batch` consecutive windows, in order (the last may be smaller): a range.
class SequentialBatches {
 public:
  SequentialBatches(TextWindows windows, int64_t batch);

  int64_t size() const {  // ceil(windows / batch), without windows + batch - 1
    return windows_.size() == 0 ? 0 : (windows_.size() - 1) / batch_ + 1;
  }
  Example operator[](int64_t k) const;

  class Iterator {
   public:
    Iterator(const SequentialBatches* s, int64_t k) : s_(s), k_(k) {}
    Example operator*() const { return (*s_)[k_]; }
    Iterator& operator++() {
      ++k_;
      return *this;
    }
    bool operator==(const Iterator& o) const { return k_ == o.k_; }

   private:
    const SequentialBatches* s_;
    int64_t k_;
  };
  Iterator begin() const { return {this, 0}; }
  Iterator end() const { return {this, size()}; }

 private:
  TextWindows windows_;
  int64_t batch_;
};

class TextCorpus {
 public:
  static constexpr const char* kDefaultPath = "/usr/share/games/fortunes/fortunes";
  static constexpr int64_t kVocabSize = 256;

  // Reads the whole file (bytes are tokens); the last `val_fraction` is the val split.
  explicit TextCorpus(const std::string& path = kDefaultPath, double val_fraction = 0.1);

  int64_t vocab_size() const { return kVocabSize; }
  const std::string& path() const { return path_; }
  int64_t num_tokens() const { return total_; }
  int64_t num_tokens(Split split) const;
  // The tokens of a split as int64 [n].
  Tensor tokens(Split split) const;

  // `batch` random windows of the split: x int64 [batch, seq_len] starting at uniform random
  // offsets (drawn with `gen`, torch.randint-style) and y = the same windows one token later.
  Example get_batch(int64_t batch, int64_t seq_len, Generator& gen, Split split = Split::train,
                    bool pinned = false) const;

  TextWindows windows(Split split, int64_t seq_len) const;
  SequentialBatches sequential(Split split, int64_t batch, int64_t seq_len) const {
    return SequentialBatches(windows(split, seq_len), batch);
  }

  // Bytes <-> tokens.
  static Tensor encode(std::string_view text);
  static std::string decode(const Tensor& tokens);

 private:
  int64_t split_offset(Split split) const { return split == Split::train ? 0 : train_; }

  std::string path_;
  Storage bytes_;
  int64_t total_ = 0, train_ = 0;
};

}  // namespace tally::data
