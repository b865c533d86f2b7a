// Deterministic synthetic datasets for tests, benchmarks and memory studies: the same
// (seed, index) always gives the same example, with no files. Values come from Philox
// (tensor/random.h) keyed by the seed and counted by example and element.
#pragma once

#include <utility>
#include <vector>

#include "nn/data/dataset.h"

namespace tally::data {

// Throws std::invalid_argument "<what>: bad shape [...]" where a dimension is < 1.
void check_synthetic_shape(const char* what, const Shape& shape);

// What the synthetic datasets share: n examples of an input `shape` from `seed`, checked at
// construction, and get()/get_batch() through Derived's fill(indices, In* input, int64_t*
// target), one example's target having shape target_shape_ (a batch's: [b] + it).
template <typename Derived, typename In>
class Synthetic : public Dataset {
 public:
  int64_t size() const override { return n_; }
  Example get(int64_t index) const override {
    return fill_example(self(), &Derived::fill, {index}, shape_, target_shape_, false);
  }
  Example get_batch(const std::vector<int64_t>& indices, bool pinned = false) const override {
    const auto b = static_cast<int64_t>(indices.size());
    return fill_example(self(), &Derived::fill, indices, batched(b, shape_),
                        batched(b, target_shape_), pinned);
  }

 protected:
  // Throws "<name>: bad shape [...]" where a dimension of `shape` is < 1.
  Synthetic(const char* name, int64_t n, Shape shape, Shape target_shape, uint64_t seed)
      : n_(n), shape_(std::move(shape)), target_shape_(std::move(target_shape)), seed_(seed) {
    check_synthetic_shape(name, shape_);
  }

  int64_t n_;
  Shape shape_, target_shape_;
  uint64_t seed_;

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
  static Shape batched(int64_t b, const Shape& s) {
    Shape out{b};
    out.insert(out.end(), s.begin(), s.end());
    return out;
  }
};

// n images of `shape` (e.g. {3, 32, 32}) with labels in [0, classes): label i is uniform,
// the image is a fixed per-class pattern (+-1 per element) plus N(0, 1) noise, so a model
// can learn it. input float32 `shape`, target int64 scalar.
class SyntheticImages : public Synthetic<SyntheticImages, float> {
 public:
  SyntheticImages(int64_t n, Shape shape, int64_t classes, uint64_t seed = 0);

  int64_t label(int64_t index) const;

 private:
  friend class Synthetic<SyntheticImages, float>;
  void fill(const std::vector<int64_t>& indices, float* input, int64_t* target) const;

  int64_t classes_;
};

// n token sequences for a language model: input int64 `shape` (e.g. {T}) of tokens in
// [0, vocab), target the same sequence one token later (the last dimension shifted by one).
class SyntheticTokens : public Synthetic<SyntheticTokens, int64_t> {
 public:
  SyntheticTokens(int64_t n, int64_t vocab, Shape shape, uint64_t seed = 0);

 private:
  friend class Synthetic<SyntheticTokens, int64_t>;
  void fill(const std::vector<int64_t>& indices, int64_t* input, int64_t* target) const;

  int64_t vocab_;
};

}  // namespace tally::data
