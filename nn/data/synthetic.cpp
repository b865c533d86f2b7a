#include "nn/data/synthetic.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "tensor/cpu/parallel.h"
#include "tensor/random.h"

namespace tally::data {
namespace {

// Independent 32-bit streams: (stream, a, b) -> Philox word.
uint32_t bits(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b) {
  return philox4x32(a, (stream << 48) ^ b, seed)[0];
}

float uniform(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b) {
  return (static_cast<float>(bits(seed, stream, a, b) >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

}  // namespace

void check_synthetic_shape(const char* what, const Shape& shape) {
  for (int64_t d : shape)
    if (d < 1) throw std::invalid_argument(fmt::format("{}: bad shape {}", what, shape_str(shape)));
}

// ---------------------------------------------------------------- SyntheticImages

SyntheticImages::SyntheticImages(int64_t n, Shape shape, int64_t classes, uint64_t seed)
    : Synthetic("SyntheticImages", n, std::move(shape), {}, seed), classes_(classes) {
  if (n < 0 || classes < 1)
    throw std::invalid_argument(fmt::format(
        "SyntheticImages: need n >= 0 and classes >= 1, got n {} classes {}", n, classes));
}

int64_t SyntheticImages::label(int64_t index) const {
  check_index("SyntheticImages", index, n_);
  return static_cast<int64_t>(bits(seed_, 1, static_cast<uint64_t>(index), 0) %
                              static_cast<uint64_t>(classes_));
}

void SyntheticImages::fill(const std::vector<int64_t>& indices, float* input,
                           int64_t* target) const {
  const int64_t numel = shape_numel(shape_);
  for (size_t b = 0; b < indices.size(); ++b) target[b] = label(indices[b]);
  // Every element is a function of (seed, example, element) alone, so the batch is filled over
  // every core with the same values as one thread gives: three Philox words, a log, a square
  // root and a cosine per element make a 64 x 3 x 224 x 224 batch cost about half a second on
  // one core, longer than a GPU training step.
  const int64_t total = static_cast<int64_t>(indices.size()) * numel;
  cpu::parallel_for(total, 4096, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t b = e / numel, k = e % numel;
      const auto i = static_cast<uint64_t>(indices[static_cast<size_t>(b)]);
      const auto y = static_cast<uint64_t>(target[b]);
      const auto uk = static_cast<uint64_t>(k);
      const float pattern = (bits(seed_, 2, y, uk) & 1u) ? 1.0f : -1.0f;
      // Box-Muller from two uniforms of this (example, element).
      const float u1 = uniform(seed_, 3, i, uk);
      const float u2 = uniform(seed_, 4, i, uk);
      const float noise = std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
      input[e] = pattern + noise;
    }
  });
}

// ---------------------------------------------------------------- SyntheticTokens

SyntheticTokens::SyntheticTokens(int64_t n, int64_t vocab, Shape shape, uint64_t seed)
    : Synthetic("SyntheticTokens", n, shape, shape, seed), vocab_(vocab) {
  if (shape_.empty())
    throw std::invalid_argument(
        "SyntheticTokens: shape needs at least one dimension (the sequence)");
  if (n < 0 || vocab < 1)
    throw std::invalid_argument(
        fmt::format("SyntheticTokens: need n >= 0 and vocab >= 1, got n {} vocab {}", n, vocab));
}

void SyntheticTokens::fill(const std::vector<int64_t>& indices, int64_t* input,
                           int64_t* target) const {
  const int64_t numel = shape_numel(shape_);
  const int64_t seq = shape_.back();
  const int64_t rows = numel / seq;
  for (size_t b = 0; b < indices.size(); ++b) {
    const int64_t i = indices[b];
    check_index("SyntheticTokens", i, n_);
    int64_t* x = input + static_cast<int64_t>(b) * numel;
    int64_t* y = target + static_cast<int64_t>(b) * numel;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t <= seq; ++t) {
        // Token t of row r of example i: a stream of seq + 1 tokens, x its first seq, y its last.
        const auto pos = static_cast<uint64_t>(r * (seq + 1) + t);
        const auto tok = static_cast<int64_t>(bits(seed_, 5, static_cast<uint64_t>(i), pos) %
                                              static_cast<uint64_t>(vocab_));
        if (t < seq) x[r * seq + t] = tok;
        if (t > 0) y[r * seq + t - 1] = tok;
      }
  }
}

}  // namespace tally::data
