// Internal to the attention family's CUDA kernels (tensor/attention/cuda.cu, cuda_fp32.cu):
// how they address a [B, H, T, E] tensor.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace tally::cuda {

// A [B, H, T, E] tensor as the attention kernels address it: base pointer (storage offset
// applied) and the element strides of b, h and t. T is const-qualified for inputs.
template <typename T>
struct BhtRows {
  T* p;
  int64_t sb, sh, st;
  // The first row of the (b, h) = (bh / H, bh % H) slice.
  __device__ __forceinline__ T* rows(int bh, int H) const {
    return p + static_cast<int64_t>(bh / H) * sb + static_cast<int64_t>(bh % H) * sh;
  }
};

template <typename T>
BhtRows<T> bht_rows(const Tensor& t) {
  return {static_cast<T*>(t.storage().data()) + t.storage_offset(), t.strides()[0], t.strides()[1],
          t.strides()[2]};
}

}  // namespace tally::cuda
