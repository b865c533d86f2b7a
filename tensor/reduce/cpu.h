// CPU iteration helpers of the "reduce over some dims" kernels, shared by the reduce and
// softmax families' CPU kernels (tensor/reduce/cpu.cpp, tensor/softmax/cpu.cpp):
// for_each_kept walks the positions of the kept dims, ReducedBlock walks the elements of the
// reduced dims under one such position. The reduce kernels themselves are declared once, in
// tensor/reduce/kernels.h.
#pragma once

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "tensor/cpu/loops.h"
#include "tensor/tensor.h"

namespace tally::cpu {

// Calls fn(offsets) once per position of the dims of `sizes` that are not reduced
// (reduced dims held at index 0): offsets[k] is operand k's element offset there, from
// strides[k] (one per dim of `sizes`; a reduced dim's stride is never used) and
// base_offsets[k].
template <size_t N, typename Fn>
void for_each_kept(const Shape& sizes, const std::vector<bool>& reduce,
                   const std::array<const int64_t*, N>& strides,
                   const std::array<int64_t, N>& base_offsets, Fn&& fn) {
  Shape kept = sizes;
  for (size_t d = 0; d < kept.size(); ++d)
    if (reduce[d]) kept[d] = 1;
  strided_runs<N>(kept, strides, base_offsets,
                  [&](std::array<int64_t, N> o, int64_t n, std::array<int64_t, N> st) {
                    for (int64_t i = 0; i < n; ++i) {
                      fn(o);
                      for (size_t k = 0; k < N; ++k) o[k] += st[k];
                    }
                  });
}

// The same over tensors of one shape: the kept positions of operands[0]'s sizes, offsets[k]
// from operands[k]'s strides and storage offset.
template <size_t N, typename Fn>
void for_each_kept(const std::vector<bool>& reduce, const std::array<const Tensor*, N>& operands,
                   Fn&& fn) {
  std::array<const int64_t*, N> strides;
  std::array<int64_t, N> offsets;
  for (size_t k = 0; k < N; ++k) {
    strides[k] = operands[k]->strides().data();
    offsets[k] = operands[k]->storage_offset();
  }
  for_each_kept<N>(operands[0]->sizes(), reduce, strides, offsets, std::forward<Fn>(fn));
}

// The reduced dims of a tensor (sizes/strides, with the dims in `reduce`), merged where
// they are contiguous; for_each visits their elements in row-major order.
class ReducedBlock {
 public:
  ReducedBlock(const Shape& sizes, const Shape& strides, const std::vector<bool>& reduce) {
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (!reduce[d]) continue;
      numel_ *= sizes[d];
      if (sizes[d] == 1) continue;
      if (!sz_.empty() && st_.back() == strides[d] * sizes[d]) {
        sz_.back() *= sizes[d];
        st_.back() = strides[d];
      } else {
        sz_.push_back(sizes[d]);
        st_.push_back(strides[d]);
      }
    }
    idx_.assign(sz_.size(), 0);
  }
  int64_t numel() const { return numel_; }

  // f(offset) for each element, offset = base + the element's offset in the block.
  template <typename F>
  void for_each(int64_t base, F&& f) const {
    if (numel_ == 0) return;
    const size_t r = sz_.size();
    if (r == 0) {
      f(base);
      return;
    }
    const int64_t n = sz_[r - 1], s = st_[r - 1];
    std::fill(idx_.begin(), idx_.end(), 0);
    int64_t off = base;
    while (true) {
      for (int64_t i = 0; i < n; ++i) f(off + i * s);
      size_t d = r - 1;
      while (true) {
        if (d == 0) return;
        --d;
        off += st_[d];
        if (++idx_[d] < sz_[d]) break;
        off -= st_[d] * sz_[d];
        idx_[d] = 0;
      }
    }
  }

 private:
  std::vector<int64_t> sz_, st_;
  mutable std::vector<int64_t> idx_;
  int64_t numel_ = 1;
};

}  // namespace tally::cpu
