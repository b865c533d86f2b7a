// The kernel table of the core ops (copy, fill, random fills, binary/unary maps, affine,
// clamp, where, lerp, sum): each kernel's signature, once. The CPU kernels (tensor/elementwise/
// cpu.cpp: simple, exactly right, float64 capable, the reference for every other backend)
// and the CUDA kernels (tensor/elementwise/cuda.cu) each define one ElementwiseKernels;
// tensor/backends.cpp registers them.
//
// Called only through the dispatch point (tensor/elementwise/ops.cpp), which checks the
// arguments, allocates the result and broadcasts/converts the operands first. Each CUDA
// launcher enqueues on Tally's stream for the tensor's device, opens an NVTX range and checks
// the launch; none synchronises with the host (but a device->host copy, see copy).
#pragma once

#include <cstdint>
#include <optional>

#include "tensor/dispatch.h"
#include "tensor/elementwise/ops.h"

namespace tally {

namespace ops {
// Whether the binary kernel takes a `b` of dtype b beside an `a` and out of dtype a for `op`
// (besides b == a): float32 with a float16 or bfloat16 b for add, sub and mul, b read widened,
// so a float32 residual plus a 16-bit autocast branch makes no float32 copy of the branch.
inline bool binary_widens(BinaryOp op, DType a, DType b) {
  return (op == BinaryOp::add || op == BinaryOp::sub || op == BinaryOp::mul) &&
         a == DType::float32 && (b == DType::float16 || b == DType::bfloat16);
}

// The binary kernels' mixed-dtype case: false where b has a's dtype; otherwise checks that
// binary_widens allows the pair and calls widened(Bf16{}) for a bfloat16 b, widened(F16{}) for
// a float16 one (Bf16, F16: the backend's 16-bit types), and returns true.
template <typename Bf16, typename F16, typename Widened>
bool binary_mixed(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b,
                  Widened&& widened) {
  if (b.dtype() == a.dtype()) return false;
  if (!binary_widens(op, a.dtype(), b.dtype()) || out.dtype() != a.dtype())
    unsupported_dtype(binary_op_name(op), b.dtype());
  if (b.dtype() == DType::bfloat16)
    widened(Bf16{});
  else
    widened(F16{});
  return true;
}
}  // namespace ops

struct ElementwiseKernels {
  // dst = src, same shape (src pre-broadcast), any dtypes, any strides. CUDA: same-device copy
  // with dtype conversion; or host<->device (the host side must be contiguous after
  // conversion; a device->host copy waits for the stream, since the caller reads the host
  // memory next).
  void (*copy)(const Tensor& dst, const Tensor& src);
  // dsts[i] = srcs[i] for every pair (ops::foreach_copy_: same shapes, one device, one dtype
  // per side). CPU: copy, pair by pair. CUDA: contiguous float-family pairs aligned to 16
  // bytes in one launch per 80 (the pointers in the kernel's parameters), the rest by copy.
  void (*copy_many)(const TensorList& dsts, const TensorList& srcs);
  void (*fill)(const Tensor& dst, double value);
  void (*rand_uniform)(const Tensor& dst, PhiloxState state);
  void (*rand_normal)(const Tensor& dst, PhiloxState state);
  void (*rand_int)(const Tensor& dst, int64_t low, int64_t high, PhiloxState state);
  // out = a (op) b; a, b already broadcast to out's shape and converted to the compute dtype,
  // except that b may be float16 or bfloat16 beside a float32 a and out for add, sub and mul
  // (ops::binary_widens), read widened.
  void (*binary)(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
  void (*binary_scalar)(ops::BinaryOp op, const Tensor& out, const Tensor& a, double b,
                        bool reverse);
  void (*unary)(ops::UnaryOp op, const Tensor& out, const Tensor& a);
  void (*affine)(const Tensor& out, const Tensor& x, double a, double b);
  void (*clamp)(const Tensor& out, const Tensor& a, std::optional<double> lo,
                std::optional<double> hi);
  void (*where)(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
  // out = lerp(a, b, w) (math::lerp_value), floating dtypes; a, b and w (when defined) already
  // broadcast to out's shape in out's dtype; an undefined w means the scalar w_scalar.
  void (*lerp)(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& w,
               double w_scalar);
  // out has t's rank with reduced dims of size 1.
  void (*sum)(const Tensor& out, const Tensor& t);
};

// cpu::elementwise_kernels (tensor/elementwise/cpu.cpp), cuda::elementwise_kernels
// (tensor/elementwise/cuda.cu), elementwise_backends (tensor/backends.cpp).
TALLY_DECLARE_KERNELS(ElementwiseKernels, elementwise_kernels, elementwise_backends);

// The table's entries in member order, each the backend's kernel of the member's name: each
// backend defines its table as `const ElementwiseKernels
// elementwise_kernels{TALLY_ELEMENTWISE_KERNELS};`, so the list of kernels is written once.
#define TALLY_ELEMENTWISE_KERNELS                                                       \
  .copy = &copy, .copy_many = &copy_many, .fill = &fill, .rand_uniform = &rand_uniform, \
  .rand_normal = &rand_normal, .rand_int = &rand_int, .binary = &binary,                \
  .binary_scalar = &binary_scalar, .unary = &unary, .affine = &affine, .clamp = &clamp, \
  .where = &where, .lerp = &lerp, .sum = &sum

}  // namespace tally
