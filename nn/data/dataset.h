// The dataset interface of tally::data: a random-access collection of examples
// {input, target}, with a batched fast path that writes a whole batch straight into one
// pair of contiguous host tensors (pinned when the loader feeds a GPU). Datasets keep
// their data in tensors from the CPU allocator, tagged `input` when they are loaded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace tally::data {

// One example, or a batch of them stacked along a new first dimension.
struct Example {
  Tensor input;
  Tensor target;
};

class Dataset {
 public:
  virtual ~Dataset() = default;

  virtual int64_t size() const = 0;
  // Example `index` (0 <= index < size()) as CPU tensors; throws std::out_of_range.
  virtual Example get(int64_t index) const = 0;
  // The examples at `indices` stacked along a new first dimension, as contiguous CPU
  // tensors allocated under the caller's allocation context, in pinned host memory when
  // `pinned`. The default stacks get(i); datasets override it to fill the batch directly.
  // Must be safe to call from another thread than the one that built the dataset.
  virtual Example get_batch(const std::vector<int64_t>& indices, bool pinned = false) const;
};

// A contiguous CPU tensor for batch data: pinned host memory when `pinned`, else the CPU
// allocator, under the current allocation context.
Tensor empty_host(const Shape& shape, DType dtype, bool pinned);
// get() and get_batch() of a dataset whose fill(indices, input, target) writes examples
// straight into host tensors: fresh tensors of `input_shape` (the fill's input type) and
// `target_shape` (int64), allocated in that order, filled for `indices`.
template <typename D, typename In>
Example fill_example(const D& dataset,
                     void (D::*fill)(const std::vector<int64_t>&, In*, int64_t*) const,
                     const std::vector<int64_t>& indices, const Shape& input_shape,
                     const Shape& target_shape, bool pinned) {
  Example ex;
  ex.input = empty_host(input_shape, dtype_of<In>(), pinned);
  ex.target = empty_host(target_shape, DType::int64, pinned);
  (dataset.*fill)(indices, ex.input.data<In>(), ex.target.data<int64_t>());
  return ex;
}

// Throws std::out_of_range "<dataset>: index i out of range for a dataset of n examples".
void check_index(const char* dataset, int64_t index, int64_t size);

}  // namespace tally::data
