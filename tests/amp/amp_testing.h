// What the CPU tests of autocast and checkpointing share: float32 parameters and data drawn
// from a fixed seed, so both files train the same kind of small nets from known values.
#pragma once

#include "autograd/ops.h"
#include "memory/memory.h"

namespace tally::amp_testing {

inline const Device kCpu = Device::cpu();

// A float32 leaf requiring grad: N(0, scale^2) values from `seed`.
inline Tensor param(const Shape& shape, double scale, uint64_t seed) {
  Generator g(seed);
  Tensor t = ops::mul(ops::randn(shape, DType::float32, kCpu, &g), scale);
  t.requires_grad_(true);
  return t;
}

// float32 N(0, 1) data from `seed`.
inline Tensor data(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return ops::randn(shape, DType::float32, kCpu, &g);
}

}  // namespace tally::amp_testing
