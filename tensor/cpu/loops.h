// CPU iteration over strided tensors: the odometer loop every elementwise and reduction
// kernel uses. The innermost dimension runs as a plain strided loop; the outer ones step
// like an odometer, so no element costs a division.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace tally::cpu {

// Calls fn(offsets, n, inner_strides) for each innermost run: `offsets[k]` is operand k's
// element offset at the run's start; the run has `n` elements, operand k advancing by
// inner_strides[k]. strides[k] is operand k's stride for each dimension of `sizes`.
template <size_t N, typename Fn>
void strided_runs(const Shape& sizes, const std::array<const int64_t*, N>& strides,
                  std::array<int64_t, N> offsets, Fn&& fn) {
  const size_t rank = sizes.size();
  for (int64_t s : sizes)
    if (s == 0) return;
  if (rank == 0) {
    std::array<int64_t, N> zero{};
    fn(offsets, int64_t{1}, zero);
    return;
  }
  // Drop size-1 dims and merge dims that are contiguous for every operand.
  std::vector<int64_t> sz;
  std::vector<std::array<int64_t, N>> st;
  for (size_t d = 0; d < rank; ++d) {
    if (sizes[d] == 1) continue;
    std::array<int64_t, N> s{};
    for (size_t k = 0; k < N; ++k) s[k] = strides[k][d];
    if (!sz.empty()) {
      bool merge = true;
      for (size_t k = 0; k < N; ++k) merge = merge && st.back()[k] == s[k] * sizes[d];
      if (merge) {
        sz.back() *= sizes[d];
        st.back() = s;
        continue;
      }
    }
    sz.push_back(sizes[d]);
    st.push_back(s);
  }
  if (sz.empty()) {
    std::array<int64_t, N> zero{};
    fn(offsets, int64_t{1}, zero);
    return;
  }
  const size_t r = sz.size();
  const int64_t inner = sz[r - 1];
  const std::array<int64_t, N> inner_st = st[r - 1];
  std::vector<int64_t> idx(r, 0);
  while (true) {
    fn(offsets, inner, inner_st);
    size_t d = r - 1;
    while (true) {
      if (d == 0) return;
      --d;
      ++idx[d];
      for (size_t k = 0; k < N; ++k) offsets[k] += st[d][k];
      if (idx[d] < sz[d]) break;
      for (size_t k = 0; k < N; ++k) offsets[k] -= st[d][k] * sz[d];
      idx[d] = 0;
    }
  }
}

// Strides of `t` broadcast to `shape` (0 for broadcast dimensions), aligned right.
Shape broadcast_strides(const Tensor& t, const Shape& shape);

}  // namespace tally::cpu
