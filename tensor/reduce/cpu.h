// CPU iteration helpers of the "reduce over some dims" kernels, shared by the reduce and
// softmax families' CPU kernels (tensor/reduce/cpu.cpp, tensor/softmax/cpu.cpp):
// for_each_kept walks the positions of the kept dims (parallel_for_each_kept over several
// threads), ReducedBlock walks the elements of the reduced dims under one such position. The reduce
// kernels themselves are declared once, in tensor/reduce/kernels.h.
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

// Each operand's strides and storage offset.
template <size_t N>
std::pair<std::array<const int64_t*, N>, std::array<int64_t, N>> strides_and_offsets(
    const std::array<const Tensor*, N>& operands) {
  std::array<const int64_t*, N> strides;
  std::array<int64_t, N> offsets;
  for (size_t k = 0; k < N; ++k) {
    strides[k] = operands[k]->strides().data();
    offsets[k] = operands[k]->storage_offset();
  }
  return {strides, offsets};
}

// The same over tensors of one shape: the kept positions of operands[0]'s sizes, offsets[k]
// from operands[k]'s strides and storage offset.
template <size_t N, typename Fn>
void for_each_kept(const std::vector<bool>& reduce, const std::array<const Tensor*, N>& operands,
                   Fn&& fn) {
  const auto [strides, offsets] = strides_and_offsets(operands);
  for_each_kept<N>(operands[0]->sizes(), reduce, strides, offsets, std::forward<Fn>(fn));
}

// for_each_kept in parallel over large tensors (tensor/cpu/parallel.h): `per_position` is
// the work (elements) under one kept position, so that small tensors stay serial. fn is
// called from several threads at once: it may only write what its position owns (its
// outputs, its row of a gradient).
template <size_t N, typename Fn>
void parallel_for_each_kept(const std::vector<bool>& reduce,
                            const std::array<const Tensor*, N>& operands, int64_t per_position,
                            Fn&& fn) {
  // Not a structured binding: clang 14 cannot capture one in the lambda below.
  const auto strides_offsets = strides_and_offsets(operands);
  const auto& strides = strides_offsets.first;
  const auto& offsets = strides_offsets.second;
  Shape kept = operands[0]->sizes();
  for (size_t d = 0; d < kept.size(); ++d)
    if (reduce[d]) kept[d] = 1;
  const StridedLoop<N> loop(kept, strides);
  parallel_for(loop.numel(), grain_of(per_position), [&](int64_t begin, int64_t end) {
    loop.runs(begin, end, offsets,
              [&](std::array<int64_t, N> o, int64_t n, std::array<int64_t, N> st) {
                for (int64_t i = 0; i < n; ++i) {
                  fn(o);
                  for (size_t k = 0; k < N; ++k) o[k] += st[k];
                }
              });
  });
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
    // The odometer is the caller's (for_each runs on several threads at once): on the stack
    // for up to 8 merged dims.
    int64_t small[8] = {};
    std::vector<int64_t> large(r > 8 ? r : 0, 0);
    int64_t* idx = r > 8 ? large.data() : small;
    int64_t off = base;
    while (true) {
      for (int64_t i = 0; i < n; ++i) f(off + i * s);
      size_t d = r - 1;
      while (true) {
        if (d == 0) return;
        --d;
        off += st_[d];
        if (++idx[d] < sz_[d]) break;
        off -= st_[d] * sz_[d];
        idx[d] = 0;
      }
    }
  }

 private:
  std::vector<int64_t> sz_, st_;
  int64_t numel_ = 1;
};

}  // namespace tally::cpu
