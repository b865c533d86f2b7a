// The launch shape of the grid-stride kernels: kThreads threads a block and blocks_for(n)
// blocks, the loop striding past what the grid covers.
#pragma once

#include <algorithm>
#include <cstdint>

namespace tally::cuda {

inline constexpr int kThreads = 256;

// Blocks for n elements (or rows) of per_block a block: at least one, at most 8 * 65535.
inline int blocks_for(int64_t n, int64_t per_block = kThreads) {
  const int64_t b = (n + per_block - 1) / per_block;
  return static_cast<int>(std::clamp<int64_t>(b, 1, 65535 * 8));
}

}  // namespace tally::cuda
