#include "nn/data/text.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "base/check_arg.h"
#include "base/checked.h"
#include "base/path_kind.h"
#include "memory/caching_allocator.h"
#include "memory/context.h"
#include "tensor/ops.h"

namespace tally::data {

// ---------------------------------------------------------------- TextWindows

TextWindows::TextWindows(Storage bytes, int64_t offset, int64_t count, int64_t seq_len)
    : bytes_(std::move(bytes)), offset_(offset), count_(count), seq_len_(seq_len) {
  base::check_at_least(seq_len, 1, "TextWindows: seq_len");
  windows_ = count > 0 ? (count - 1) / seq_len : 0;
}

void TextWindows::fill(const std::vector<int64_t>& indices, int64_t* x, int64_t* y) const {
  const auto* p = static_cast<const uint8_t*>(bytes_.data()) + offset_;
  for (size_t b = 0; b < indices.size(); ++b) {
    check_index("TextWindows", indices[b], windows_);
    const uint8_t* w = p + indices[b] * seq_len_;
    int64_t* xb = x + static_cast<int64_t>(b) * seq_len_;
    int64_t* yb = y + static_cast<int64_t>(b) * seq_len_;
    for (int64_t t = 0; t < seq_len_; ++t) {
      xb[t] = w[t];
      yb[t] = w[t + 1];
    }
  }
}

Example TextWindows::get(int64_t index) const {
  Example ex;
  ex.input = empty_host({seq_len_}, DType::int64, false);
  ex.target = empty_host({seq_len_}, DType::int64, false);
  fill({index}, ex.input.data<int64_t>(), ex.target.data<int64_t>());
  return ex;
}

Example TextWindows::get_batch(const std::vector<int64_t>& indices, bool pinned) const {
  const auto b = static_cast<int64_t>(indices.size());
  Example ex;
  ex.input = empty_host({b, seq_len_}, DType::int64, pinned);
  ex.target = empty_host({b, seq_len_}, DType::int64, pinned);
  fill(indices, ex.input.data<int64_t>(), ex.target.data<int64_t>());
  return ex;
}

// ---------------------------------------------------------------- SequentialBatches

SequentialBatches::SequentialBatches(TextWindows windows, int64_t batch)
    : windows_(std::move(windows)), batch_(batch) {
  base::check_at_least(batch, 1, "TextCorpus::sequential: batch");
}

Example SequentialBatches::operator[](int64_t k) const {
  if (k < 0 || k >= size())
    throw std::out_of_range(
        fmt::format("TextCorpus::sequential: batch {} out of range ({} batches)", k, size()));
  std::vector<int64_t> idx;
  for (int64_t i = k * batch_; i < std::min(windows_.size(), (k + 1) * batch_); ++i)
    idx.push_back(i);
  return windows_.get_batch(idx);
}

// ---------------------------------------------------------------- TextCorpus

TextCorpus::TextCorpus(const std::string& path, double val_fraction) : path_(path) {
  namespace fs = std::filesystem;
  if (!(val_fraction >= 0 && val_fraction < 1))
    throw std::invalid_argument(
        fmt::format("TextCorpus: val_fraction must be in [0, 1), got {}", val_fraction));
  base::refuse_directory(path, "TextCorpus");
  if (!fs::is_regular_file(path))
    throw std::runtime_error(fmt::format(
        "TextCorpus: '{}' does not exist or is not a file{}", path,
        path == kDefaultPath ? " (Debian/Ubuntu: install the package fortunes-min)" : ""));
  const uintmax_t file_bytes = fs::file_size(path);
  if (file_bytes > static_cast<uintmax_t>(base::kMaxElements))
    throw std::runtime_error(
        fmt::format("TextCorpus: '{}' has {} bytes, more than 2^63 - 1", path, file_bytes));
  total_ = static_cast<int64_t>(file_bytes);
  if (total_ < 2)
    throw std::runtime_error(
        fmt::format("TextCorpus: '{}' has {} bytes, need at least 2", path, total_));
  memory::CategoryScope scope(memory::Category::input);
  try {
    bytes_ = Storage::allocate(static_cast<size_t>(total_), Device::cpu());
  } catch (const memory::OutOfMemoryError& e) {
    throw memory::OutOfMemoryError(
        fmt::format("TextCorpus: '{}' ({} bytes from byte offset 0): {}", path, total_, e.what()),
        e.requested());
  }
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(bytes_.data()), total_);
  if (!in)
    throw std::runtime_error(
        fmt::format("TextCorpus: '{}' is truncated at byte offset {}: expected "
                    "{} bytes",
                    path, in.gcount(), total_));
  train_ = total_ - static_cast<int64_t>(static_cast<double>(total_) * val_fraction);
}

int64_t TextCorpus::num_tokens(Split split) const {
  return split == Split::train ? train_ : total_ - train_;
}

Tensor TextCorpus::tokens(Split split) const {
  const int64_t n = num_tokens(split);
  Tensor t = empty_host({n}, DType::int64, false);
  const auto* p = static_cast<const uint8_t*>(bytes_.data()) + split_offset(split);
  int64_t* d = t.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) d[i] = p[i];
  return t;
}

Example TextCorpus::get_batch(int64_t batch, int64_t seq_len, Generator& gen, Split split,
                              bool pinned) const {
  const int64_t n = num_tokens(split);
  if (batch < 1 || seq_len < 1 || seq_len >= n)
    throw std::invalid_argument(fmt::format(
        "TextCorpus::get_batch: batch {} x seq_len {} from the {} split of '{}' ({} tokens): need "
        "batch >= 1 and 1 <= seq_len < {}",
        batch, seq_len, split == Split::train ? "train" : "val", path_, n, n));
  uint64_t batch_bytes;  // (the error names the corpus before empty_host would throw)
  if (!base::try_nbytes(Shape{batch, seq_len}, sizeof(int64_t), &batch_bytes))
    (void)base::checked_nbytes(Shape{batch, seq_len}, sizeof(int64_t),
                               fmt::format("TextCorpus::get_batch: '{}'", path_));
  const Tensor starts = ops::randint(0, n - seq_len, {batch}, DType::int64, Device::cpu(), &gen);
  const int64_t* s = starts.data<int64_t>();
  const auto* p = static_cast<const uint8_t*>(bytes_.data()) + split_offset(split);
  Example ex;
  ex.input = empty_host({batch, seq_len}, DType::int64, pinned);
  ex.target = empty_host({batch, seq_len}, DType::int64, pinned);
  int64_t* x = ex.input.data<int64_t>();
  int64_t* y = ex.target.data<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq_len; ++t) {
      x[b * seq_len + t] = p[s[b] + t];
      y[b * seq_len + t] = p[s[b] + t + 1];
    }
  return ex;
}

TextWindows TextCorpus::windows(Split split, int64_t seq_len) const {
  return TextWindows(bytes_, split_offset(split), num_tokens(split), seq_len);
}

Tensor TextCorpus::encode(std::string_view text) {
  const auto n = static_cast<int64_t>(text.size());
  Tensor t = empty_host({n}, DType::int64, false);
  int64_t* d = t.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint8_t>(text[static_cast<size_t>(i)]);
  return t;
}

std::string TextCorpus::decode(const Tensor& tokens) {
  std::string out;
  for (double v : ops::to_vector(tokens)) {
    if (v < 0 || v >= kVocabSize)
      throw std::invalid_argument(
          fmt::format("TextCorpus::decode: token {} out of range [0, 256)", v));
    out.push_back(static_cast<char>(static_cast<uint8_t>(v)));
  }
  return out;
}

}  // namespace tally::data
