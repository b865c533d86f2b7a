#include "nn/data/dataset.h"

#include <fmt/format.h>

#include <cstring>
#include <stdexcept>

#include "base/checked.h"
#include "tensor/ops.h"
#include "tensor/pinned.h"

namespace tally::data {

Tensor empty_host(const Shape& shape, DType dtype, bool pinned) {
  if (pinned) return ops::empty_pinned(shape, dtype);
  const size_t bytes = base::checked_nbytes(shape, dtype_size(dtype), "empty_host");
  return Tensor::make(Storage::allocate(bytes, Device::cpu()), shape, contiguous_strides(shape), 0,
                      dtype);
}

void check_index(const char* dataset, int64_t index, int64_t size) {
  if (index < 0 || index >= size)
    throw std::out_of_range(fmt::format("{}: index {} out of range for a dataset of {} examples",
                                        dataset, index, size));
}

namespace {

// Copies the contiguous CPU bytes of `t` into slot `i` of `batch`.
void put(const Tensor& batch, int64_t i, const Tensor& t, int64_t index, const char* what) {
  Shape expect(batch.sizes().begin() + 1, batch.sizes().end());
  if (t.sizes() != expect || t.dtype() != batch.dtype())
    throw std::invalid_argument(fmt::format(
        "Dataset::get_batch: example {} has {} of shape {} ({}), the batch's first has {} ({})",
        index, what, t.shape_string(), dtype_name(t.dtype()), shape_str(expect),
        dtype_name(batch.dtype())));
  Tensor src = t;
  if (src.is_cuda()) src = ops::to(src, Device::cpu(), src.dtype());
  src = ops::contiguous(src);
  const size_t n = src.nbytes();
  std::memcpy(static_cast<char*>(batch.data_ptr()) + static_cast<size_t>(i) * n, src.data_ptr(), n);
}

}  // namespace

Example Dataset::get_batch(const std::vector<int64_t>& indices, bool pinned) const {
  Example out;
  const int64_t b = static_cast<int64_t>(indices.size());
  for (int64_t i = 0; i < b; ++i) {
    Example ex = get(indices[static_cast<size_t>(i)]);
    if (i == 0) {
      Shape in_shape{b}, tg_shape{b};
      in_shape.insert(in_shape.end(), ex.input.sizes().begin(), ex.input.sizes().end());
      tg_shape.insert(tg_shape.end(), ex.target.sizes().begin(), ex.target.sizes().end());
      out.input = empty_host(in_shape, ex.input.dtype(), pinned);
      out.target = empty_host(tg_shape, ex.target.dtype(), pinned);
    }
    put(out.input, i, ex.input, indices[static_cast<size_t>(i)], "an input");
    put(out.target, i, ex.target, indices[static_cast<size_t>(i)], "a target");
  }
  return out;
}

}  // namespace tally::data
