// Deterministic synthetic datasets for tests, benchmarks and memory studies: the same
// (seed, index) always gives the same example, with no files. Values come from Philox
// (tensor/random.h) keyed by the seed and counted by example and element.
#pragma once

#include "nn/data/dataset.h"

namespace tally::data {

// n images of `shape` (e.g. {3, 32, 32}) with labels in [0, classes): label i is uniform,
// the image is a fixed per-class pattern (+-1 per element) plus N(0, 1) noise, so a model
// can learn it. input float32 `shape`, target int64 scalar.
class SyntheticImages : public Dataset {
 public:
  SyntheticImages(int64_t n, Shape shape, int64_t classes, uint64_t seed = 0);

  int64_t size() const override { return n_; }
  Example get(int64_t index) const override;
  Example get_batch(const std::vector<int64_t>& indices, bool pinned = false) const override;
  int64_t label(int64_t index) const;

 private:
  void fill(const std::vector<int64_t>& indices, float* input, int64_t* target) const;

  int64_t n_;
  Shape shape_;
  int64_t classes_;
  uint64_t seed_;
};

// n token sequences for a language model: input int64 `shape` (e.g. {T}) of tokens in
// [0, vocab), target the same sequence one token later (the last dimension shifted by one).
class SyntheticTokens : public Dataset {
 public:
  SyntheticTokens(int64_t n, int64_t vocab, Shape shape, uint64_t seed = 0);

  int64_t size() const override { return n_; }
  Example get(int64_t index) const override;
  Example get_batch(const std::vector<int64_t>& indices, bool pinned = false) const override;

 private:
  void fill(const std::vector<int64_t>& indices, int64_t* input, int64_t* target) const;

  int64_t n_, vocab_;
  Shape shape_;
  uint64_t seed_;
};

}  // namespace tally::data
