// CPU kernels: simple, exactly right, float64 capable (the reference for every other
// backend). Called only through the dispatch point in tensor/*.cpp.
#pragma once

#include <optional>

#include "tensor/ops.h"

namespace tally::cpu {

void copy(const Tensor& dst, const Tensor& src);  // same shape (src pre-broadcast), any dtypes
void fill(const Tensor& dst, double value);
void rand_uniform(const Tensor& dst, PhiloxState state);
void rand_normal(const Tensor& dst, PhiloxState state);
void rand_int(const Tensor& dst, int64_t low, int64_t high, PhiloxState state);
// out = a (op) b; a, b already broadcast to out's shape and converted to the compute dtype.
void binary(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
void binary_scalar(ops::BinaryOp op, const Tensor& out, const Tensor& a, double b, bool reverse);
void unary(ops::UnaryOp op, const Tensor& out, const Tensor& a);
void affine(const Tensor& out, const Tensor& x, double a, double b);
void clamp(const Tensor& out, const Tensor& a, std::optional<double> lo, std::optional<double> hi);
void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
// out has t's rank with reduced dims of size 1.
void sum(const Tensor& out, const Tensor& t);

}  // namespace tally::cpu
