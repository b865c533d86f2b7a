// The launch shapes of the CUDA norm kernels that decide their scratch: host-only integer
// arithmetic, shared by tensor/norm/cuda.cu (which launches with them) and
// tensor/norm/meta.cpp (which replays the scratch they size), so the two cannot drift.
#pragma once

#include <algorithm>
#include <cstdint>

namespace tally::norm_launch {

inline constexpr int kRowMaxThreads = 512;
inline constexpr int kBnThreads = 256;
inline constexpr int64_t kMaxPartElems = int64_t{16} << 20;  // layer_norm partials (elements)

// Threads of a row kernel (layer_norm / rms_norm): 4 columns a thread, whole warps.
inline int row_threads(int64_t cols) {
  int64_t t = (cols + 3) / 4;
  t = (t + 31) / 32 * 32;
  return static_cast<int>(std::clamp<int64_t>(t, 32, kRowMaxThreads));
}

// Blocks of layer_norm_backward when it computes dweight/dbias: one [2][cols] partial row
// each (the scratch is parts * 2 * cols statistics-dtype elements).
inline int64_t layer_norm_backward_parts(int64_t rows, int64_t cols, int sm_count) {
  const int64_t per_sm = std::clamp<int64_t>(2048 / row_threads(cols), 1, 8);
  const int64_t cap = std::max<int64_t>(1, kMaxPartElems / (2 * cols));
  return std::min({rows, static_cast<int64_t>(sm_count) * per_sm, cap});
}

// Blocks a batch_norm channel's N * S elements are split over: enough blocks in all to fill
// the device (8 per SM), at least 8 elements a thread, at most 65535 (the scratch is
// c * splits * 2 doubles).
inline int bn_splits(int64_t c, int64_t count, int sm_count) {
  const int64_t target = static_cast<int64_t>(sm_count) * 8;
  int64_t splits = (target + c - 1) / c;
  splits = std::min(splits, std::max<int64_t>(1, count / (kBnThreads * 8)));
  return static_cast<int>(std::clamp<int64_t>(splits, 1, 65535));
}

// Blocks a channels_last batch_norm's rows are split over (the layout [rows = N * H * W, C]:
// a block a tile of up to kBnThreads * 4 channels and a share of the rows): enough blocks in
// all to fill the device (8 per SM), at least 64 rows a block, at most 65535 (the scratch is
// c * splits * 2 doubles, as for the NCHW kernels).
inline int bn_splits_nhwc(int64_t c, int64_t rows, int sm_count) {
  const int64_t tiles = std::max<int64_t>(1, (c + 4 * kBnThreads - 1) / (4 * kBnThreads));
  const int64_t target = static_cast<int64_t>(sm_count) * 8;
  int64_t splits = (target + tiles - 1) / tiles;
  splits = std::min(splits, std::max<int64_t>(1, rows / 64));
  return static_cast<int>(std::clamp<int64_t>(splits, 1, 65535));
}

// group_norm_backward's per-(sample, channel) partial sums of dy * x and dy, when it computes
// dweight or dbias: [n][c][2] statistics-dtype elements (summed over the samples by a second
// kernel).
inline int64_t group_norm_backward_partials(int64_t n, int64_t c) {
  return n * c * 2;
}

}  // namespace tally::norm_launch
