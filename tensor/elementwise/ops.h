// Raw elementwise ops and the core every family builds on (namespace tally::ops, no
// autograd): factories and random fills, copies and conversion, views, elementwise maps
// (broadcasting, type promotion), sum/mean. Each enters the one dispatch point and runs the
// device's kernel. The differentiable versions live in tensor/elementwise/autograd.h; users
// include the umbrella tensor/ops.h.
#pragma once

#include <optional>

#include "tensor/random.h"
#include "tensor/tensor.h"

namespace tally::ops {

// ---- factories ----
Tensor empty(const Shape& shape, DType dtype = DType::float32, Device device = Device::cpu());
Tensor zeros(const Shape& shape, DType dtype = DType::float32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = DType::float32, Device device = Device::cpu());
Tensor full(const Shape& shape, double value, DType dtype = DType::float32,
            Device device = Device::cpu());
Tensor arange(double start, double end, double step = 1.0, DType dtype = DType::int64,
              Device device = Device::cpu());
// Uniform [0,1), standard normal, integers in [low, high): Philox from `gen` (default).
Tensor rand(const Shape& shape, DType dtype = DType::float32, Device device = Device::cpu(),
            Generator* gen = nullptr);
Tensor randn(const Shape& shape, DType dtype = DType::float32, Device device = Device::cpu(),
             Generator* gen = nullptr);
Tensor randint(int64_t low, int64_t high, const Shape& shape, DType dtype = DType::int64,
               Device device = Device::cpu(), Generator* gen = nullptr);
// Copies `values` (row-major) into a new tensor of `shape` and `dtype` on `device`.
Tensor from_vector(const std::vector<double>& values, const Shape& shape,
                   DType dtype = DType::float32, Device device = Device::cpu());
// Wraps memory Tally does not own (never freed by Tally).
Tensor from_blob(void* data, const Shape& shape, DType dtype = DType::float32,
                 Device device = Device::cpu());
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);

// ---- copies and conversion ----
// dst <- src, broadcasting src to dst's shape, converting dtype, across devices.
void copy_(const Tensor& dst, const Tensor& src);
// torch._foreach_copy_: dsts[i] <- srcs[i] for every i (converting dtype), as one pass: on
// CUDA one launch for up to 80 contiguous float32/float16/bfloat16 pairs whose both sides are
// 16-byte aligned (autocast's weight casts, autocast::cache_casts); any other pair is copied
// as copy_ would. Each pair has one shape (no broadcasting); every tensor is on one device;
// the dsts share one dtype and the srcs another; no dst overlaps its src. Errors
// (std::invalid_argument naming _foreach_copy_, the pair and the shapes) before anything is
// written.
void foreach_copy_(const TensorList& dsts, const TensorList& srcs);
void fill_(const Tensor& dst, double value);
void zero_(const Tensor& dst);
Tensor contiguous(const Tensor& t);  // returns t itself when already contiguous
// t laid out as `f` (t itself when it already is); channels_last needs a 4-D tensor.
Tensor contiguous(const Tensor& t, MemoryFormat f);
// Always a new tensor: channels_last when t is (Tensor::suggest_memory_format), else
// contiguous.
Tensor clone(const Tensor& t);
// To `device`/`dtype`; returns t itself when nothing changes, unless `copy`. A channels_last
// t gives a channels_last result on its own device (PyTorch's preserve_format), a row-major
// one on another device.
Tensor to(const Tensor& t, Device device, DType dtype, bool copy = false);
Tensor to(const Tensor& t, DType dtype);
double item(const Tensor& t);
std::vector<double> to_vector(const Tensor& t);  // all elements, row-major, as double

// ---- views: layout only, never allocate ----
Tensor as_strided(const Tensor& t, const Shape& sizes, const Shape& strides, int64_t offset);
Tensor view(const Tensor& t, Shape shape);     // -1 allowed once; needs a compatible layout
Tensor reshape(const Tensor& t, Shape shape);  // view when possible, else a copy
Tensor permute(const Tensor& t, const Shape& dims);
Tensor transpose(const Tensor& t, int64_t d0, int64_t d1);
Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& t, int64_t dim, int64_t index);
Tensor expand(const Tensor& t, const Shape& shape);  // -1 keeps a size
Tensor squeeze(const Tensor& t);
Tensor squeeze(const Tensor& t, int64_t dim);
Tensor unsqueeze(const Tensor& t, int64_t dim);
Tensor flatten(const Tensor& t, int64_t start_dim = 0, int64_t end_dim = -1);

int64_t wrap_dim(int64_t dim, int64_t rank, const char* op);
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

// ---- elementwise (broadcasting, type promotion) ----
// The *_backward ops are activation gradients fused into one pass, a = the incoming
// gradient, b = what the forward saved: relu_backward(g, y) = y > 0 ? g : 0 (PyTorch's
// threshold_backward on the output), gelu_backward(g, x) = g * gelu'(x) (erf form),
// gelu_tanh_backward(g, x) = g * gelu'(x) (tanh approximation), silu_backward(g, x) =
// g * silu'(x), sigmoid_backward(g, y) = g * y * (1 - y) and tanh_backward(g, y) = g * (1 - y^2)
// (both on the output, as PyTorch's). add_relu(a, b) = relu(a + b) in one pass (PyTorch's
// aten::_add_relu: a residual block's sum and activation); silu_mul(a, b) = silu(a) * b (a
// SwiGLU's gate times its up projection, no silu(a) written or kept).
enum class BinaryOp : uint8_t {
  add,
  sub,
  mul,
  div,
  pow,
  maximum,
  minimum,
  relu_backward,
  gelu_backward,
  gelu_tanh_backward,
  add_relu,
  silu_backward,
  sigmoid_backward,
  tanh_backward,
  silu_mul,
  eq,
  ne,
  lt,
  le,
  gt,
  ge,  // comparisons last (is_compare: op >= eq)
};
enum class UnaryOp : uint8_t {
  neg,
  exp,
  log,
  sqrt,
  rsqrt,
  abs,
  sign,
  relu,
  sigmoid,
  tanh,
  silu,
  gelu,
  gelu_tanh,
  reciprocal,
  square,
  sin,
  cos,
  log1p,
  expm1,
  erf,
};
const char* binary_op_name(BinaryOp op);
const char* unary_op_name(UnaryOp op);

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);
// a (op) b written over a's buffer when the caller gives `a` up and nothing else holds it
// (donated_output: PyTorch's in-place `out += identity`, without in-place autograd); a new
// buffer otherwise. Either way a's values must not be read afterwards.
Tensor binary_over(BinaryOp op, Tensor&& a, const Tensor& b);
Tensor binary_scalar(BinaryOp op, const Tensor& a, double b);  // a (op) b
Tensor scalar_binary(BinaryOp op, double a, const Tensor& b);  // a (op) b
Tensor unary(UnaryOp op, const Tensor& a);

inline Tensor add(const Tensor& a, const Tensor& b) {
  return binary(BinaryOp::add, a, b);
}
inline Tensor sub(const Tensor& a, const Tensor& b) {
  return binary(BinaryOp::sub, a, b);
}
inline Tensor mul(const Tensor& a, const Tensor& b) {
  return binary(BinaryOp::mul, a, b);
}
inline Tensor div(const Tensor& a, const Tensor& b) {
  return binary(BinaryOp::div, a, b);
}
inline Tensor add(const Tensor& a, double b) {
  return binary_scalar(BinaryOp::add, a, b);
}
inline Tensor mul(const Tensor& a, double b) {
  return binary_scalar(BinaryOp::mul, a, b);
}
inline Tensor add_relu(const Tensor& a, const Tensor& b) {
  return binary(BinaryOp::add_relu, a, b);
}
inline Tensor add_relu(Tensor&& a, const Tensor& b) {
  return binary_over(BinaryOp::add_relu, std::move(a), b);
}
inline Tensor neg(const Tensor& a) {
  return unary(UnaryOp::neg, a);
}
// a += b (b broadcast to a), in place; bumps a's version.
void add_(const Tensor& a, const Tensor& b, double alpha = 1.0);
// a += b, a *= b (b a scalar), in place, one kernel; bump a's version. An integer a takes an
// integral b only (a bool a none).
void add_(const Tensor& a, double b);
void mul_(const Tensor& a, double b);

// (x * a + b) elementwise with scalars, in one pass.
Tensor affine(const Tensor& x, double a, double b);
Tensor clamp(const Tensor& a, std::optional<double> lo, std::optional<double> hi);
// where(cond, a, b): cond is bool; a and b broadcast.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor masked_fill(const Tensor& a, const Tensor& mask, double value);
// torch.lerp: input + weight * (end - input), the three broadcast together. input, end and a
// tensor weight share one floating dtype and one device (std::invalid_argument naming lerp,
// the dtypes or shapes otherwise).
Tensor lerp(const Tensor& input, const Tensor& end, const Tensor& weight);
Tensor lerp(const Tensor& input, const Tensor& end, double weight);

// ---- reductions ----
// Sum over `dims` (empty = all) in a wide accumulator; result in t's dtype (int64 for an
// integral t), or in `dtype`, as torch.sum(t, dims, keepdim, dtype=dtype): the input taken
// as that dtype. A floating input with a floating dtype is read widened by the kernel (a
// bfloat16 gradient summed into a float32 bias gradient: no float32 copy, no cast after).
Tensor sum(const Tensor& t, const Shape& dims = {}, bool keepdim = false,
           std::optional<DType> dtype = std::nullopt);
Tensor mean(const Tensor& t, const Shape& dims = {}, bool keepdim = false);
// Reduce a broadcast gradient back to `shape` (sums the broadcast dimensions).
Tensor sum_to(const Tensor& t, const Shape& shape);

}  // namespace tally::ops
