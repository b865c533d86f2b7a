// CUDA kernels of the core ops, twins of tensor/cpu/kernels.h with the same signatures.
// Each launcher enqueues on Tally's stream for the tensor's device, opens an NVTX range
// and checks the launch; none synchronises with the host.
#pragma once

#include <optional>

#include "tensor/ops.h"

namespace tally::cuda {

// Same-device copy with dtype conversion and any strides; or host<->device (the host side
// must be contiguous after conversion; a device->host copy waits for the stream, since the
// caller reads the host memory next).
void copy(const Tensor& dst, const Tensor& src);
void fill(const Tensor& dst, double value);
void rand_uniform(const Tensor& dst, PhiloxState state);
void rand_normal(const Tensor& dst, PhiloxState state);
void rand_int(const Tensor& dst, int64_t low, int64_t high, PhiloxState state);
void binary(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
void binary_scalar(ops::BinaryOp op, const Tensor& out, const Tensor& a, double b, bool reverse);
void unary(ops::UnaryOp op, const Tensor& out, const Tensor& a);
void affine(const Tensor& out, const Tensor& x, double a, double b);
void clamp(const Tensor& out, const Tensor& a, std::optional<double> lo, std::optional<double> hi);
void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
void sum(const Tensor& out, const Tensor& t);

}  // namespace tally::cuda
