// CPU iteration over strided tensors: the odometer loop every elementwise and reduction
// kernel uses. The innermost dimension runs as a plain strided loop; the outer ones step
// like an odometer, so no element costs a division (a range that starts mid-tensor, one
// thread's share, costs one division per dim at its start).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "tensor/cpu/parallel.h"
#include "tensor/tensor.h"

namespace tally::cpu {

// The iteration space of N operands over `sizes`: size-1 dims dropped and dims that are
// contiguous for every operand merged, so that row-major order over it is row-major order
// over `sizes`. runs() walks any range of its elements as innermost runs.
template <size_t N>
class StridedLoop {
 public:
  // strides[k] is operand k's stride for each dimension of `sizes`.
  StridedLoop(const Shape& sizes, const std::array<const int64_t*, N>& strides) {
    for (int64_t s : sizes) numel_ *= s;
    if (numel_ == 0) return;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] == 1) continue;
      std::array<int64_t, N> s{};
      for (size_t k = 0; k < N; ++k) s[k] = strides[k][d];
      if (!sz_.empty()) {
        bool merge = true;
        for (size_t k = 0; k < N; ++k) merge = merge && st_.back()[k] == s[k] * sizes[d];
        if (merge) {
          sz_.back() *= sizes[d];
          st_.back() = s;
          continue;
        }
      }
      sz_.push_back(sizes[d]);
      st_.push_back(s);
    }
  }
  int64_t numel() const { return numel_; }

  // Calls fn(offsets, n, inner_strides) for each innermost run of elements [begin, end) (in
  // row-major order): `offsets[k]` is operand k's element offset at the run's start, from
  // `base[k]`; the run has `n` elements, operand k advancing by inner_strides[k]. A range
  // may start or end inside a run; only its first element costs divisions.
  template <typename Fn>
  void runs(int64_t begin, int64_t end, std::array<int64_t, N> base, Fn&& fn) const {
    if (begin >= end) return;
    if (sz_.empty()) {  // one element
      std::array<int64_t, N> zero{};
      fn(base, int64_t{1}, zero);
      return;
    }
    const size_t r = sz_.size();
    const int64_t inner = sz_[r - 1];
    const std::array<int64_t, N> inner_st = st_[r - 1];
    // The odometer at element `begin`.
    std::vector<int64_t> idx(r, 0);
    int64_t rest = begin;
    for (size_t d = r; d-- > 0;) {
      idx[d] = rest % sz_[d];
      rest /= sz_[d];
      for (size_t k = 0; k < N; ++k) base[k] += idx[d] * st_[d][k];
    }
    int64_t left = end - begin;
    while (true) {
      const int64_t n = std::min(inner - idx[r - 1], left);
      fn(base, n, inner_st);
      left -= n;
      if (left == 0) return;
      // Back to the start of the inner run, then step the outer dims.
      for (size_t k = 0; k < N; ++k) base[k] -= idx[r - 1] * inner_st[k];
      idx[r - 1] = 0;
      size_t d = r - 1;
      while (true) {
        --d;  // left > 0: the odometer has not run out
        ++idx[d];
        for (size_t k = 0; k < N; ++k) base[k] += st_[d][k];
        if (idx[d] < sz_[d]) break;
        for (size_t k = 0; k < N; ++k) base[k] -= st_[d][k] * sz_[d];
        idx[d] = 0;
      }
    }
  }

 private:
  std::vector<int64_t> sz_;
  std::vector<std::array<int64_t, N>> st_;
  int64_t numel_ = 1;
};

// Calls fn(offsets, n, inner_strides) for each innermost run over `sizes` (StridedLoop::runs
// over every element): strides[k] is operand k's stride for each dimension of `sizes`,
// offsets[k] its offset at the first element.
template <size_t N, typename Fn>
void strided_runs(const Shape& sizes, const std::array<const int64_t*, N>& strides,
                  std::array<int64_t, N> offsets, Fn&& fn) {
  const StridedLoop<N> loop(sizes, strides);
  loop.runs(0, loop.numel(), offsets, fn);
}

// The same in parallel (tensor/cpu/parallel.h) over ranges of at least kParallelGrain
// elements: fn must only touch what its run's elements own (an elementwise map, each output
// element written once).
template <size_t N, typename Fn>
void parallel_strided_runs(const Shape& sizes, const std::array<const int64_t*, N>& strides,
                           std::array<int64_t, N> offsets, Fn&& fn) {
  const StridedLoop<N> loop(sizes, strides);
  parallel_for(loop.numel(), kParallelGrain,
               [&](int64_t begin, int64_t end) { loop.runs(begin, end, offsets, fn); });
}

// Strides of `t` broadcast to `shape` (0 for broadcast dimensions), aligned right.
Shape broadcast_strides(const Tensor& t, const Shape& shape);

}  // namespace tally::cpu
