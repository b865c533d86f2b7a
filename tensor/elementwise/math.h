// The scalar math of the elementwise ops, written once for both backends: the CPU reference
// (tensor/elementwise/cpu.cpp, compiled by the host compiler) and the CUDA kernels
// (tensor/elementwise/cuda.cu, where these run in device code). Each function takes values
// already loaded into the accumulation type A (float for the 16-bit types) and returns the
// result in A; loads, stores and loops stay with each backend.
//
// The math library calls are unqualified and resolve to the functions named below: on the host
// the std:: overloads (float for float, as std::exp(float)), in device code CUDA's global
// overloads (expf for float), as the kernels called them before; naming them here keeps a
// tally:: function of the same name (the differentiable tally::exp(Tensor), ...) from hiding
// them. Where the backends differ on purpose, the branch on __CUDA_ARCH__ says why;
// every other formula is the same operations in the same order on both.
//
// Other families' math.h build on this one (the macros and the std:: functions).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tensor/elementwise/ops.h"
#include "tensor/random.h"

// TALLY_HOST_DEVICE (tensor/random.h): __host__ __device__ under nvcc, nothing for the host
// compiler. TALLY_FORCE_INLINE: the device functions were __forceinline__ before they were
// shared, and kernels whose op is a runtime value rely on the switch being inlined.
#if defined(__CUDACC__)
#define TALLY_FORCE_INLINE __forceinline__
#else
#define TALLY_FORCE_INLINE inline
#endif

namespace tally::math {

#if !defined(__CUDA_ARCH__)
using std::cos;
using std::erf;
using std::exp;
using std::expm1;
using std::fabs;
using std::isnan;
using std::log;
using std::log1p;
using std::max;
using std::min;
using std::pow;
using std::sin;
using std::sqrt;
using std::tanh;
#else
using ::cos;
using ::erf;
using ::exp;
using ::expm1;
using ::fabs;
using ::isnan;
using ::log;
using ::log1p;
using ::max;
using ::min;
using ::pow;
using ::sin;
using ::sqrt;
using ::tanh;
#endif

// 1 / sqrt(2 pi), sqrt(2 / pi), and the cubic coefficient of the tanh GELU.
inline constexpr double kInvSqrt2Pi = 0.3989422804014327;
inline constexpr double kSqrt2OverPi = 0.7978845608028654;
inline constexpr double kGeluTanhCubic = 0.044715;

// Comparison ops (BinaryOp::eq and after) produce bool from both operands read as double.
TALLY_HOST_DEVICE TALLY_FORCE_INLINE bool is_compare(ops::BinaryOp op) {
  return op >= ops::BinaryOp::eq;
}

TALLY_HOST_DEVICE TALLY_FORCE_INLINE bool compare_value(ops::BinaryOp op, double x, double y) {
  using ops::BinaryOp;
  switch (op) {
    case BinaryOp::eq:
      return x == y;
    case BinaryOp::ne:
      return x != y;
    case BinaryOp::lt:
      return x < y;
    case BinaryOp::le:
      return x <= y;
    case BinaryOp::gt:
      return x > y;
    case BinaryOp::ge:
      return x >= y;
    default:
      return false;
  }
}

// The NaN maximum / minimum return when an operand is NaN.
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A nan_of(A x, A y) {
#if defined(__CUDA_ARCH__)
  return x + y;  // one add, no NaN constant to materialise; NaN whichever operand was
#else
  (void)x, (void)y;
  return NAN;
#endif
}

// x (op) y for the arithmetic ops (bool: logical, as PyTorch's bool arithmetic).
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A binary_value(ops::BinaryOp op, A x, A y) {
  using ops::BinaryOp;
  if constexpr (std::is_same_v<A, bool>) {
    switch (op) {
      case BinaryOp::add:
      case BinaryOp::add_relu:
      case BinaryOp::maximum:
        return x || y;
      case BinaryOp::mul:
      case BinaryOp::minimum:
        return x && y;
      case BinaryOp::sub:
        return x != y;
      case BinaryOp::pow:
        return x || !y;
      default:
        return x && y;
    }
  } else {
    switch (op) {
      case BinaryOp::add:
        return x + y;
      case BinaryOp::sub:
        return x - y;
      case BinaryOp::mul:
        return x * y;
      case BinaryOp::div:
        if constexpr (std::is_integral_v<A>)
          return y == 0 ? A(0) : static_cast<A>(x / y);
        else
          return x / y;
      case BinaryOp::pow:
#if defined(__CUDA_ARCH__)
        // The GPU raises in double for every A (float pow rounds once, from the double result).
        return static_cast<A>(pow(static_cast<double>(x), static_cast<double>(y)));
#else
        // The reference calls std::pow on A (powf for float).
        return static_cast<A>(pow(x, y));
#endif
      case BinaryOp::maximum:
        if constexpr (std::is_floating_point_v<A>) {
          if (isnan(x) || isnan(y)) return nan_of(x, y);
        }
        return x > y ? x : y;
      case BinaryOp::minimum:
        if constexpr (std::is_floating_point_v<A>) {
          if (isnan(x) || isnan(y)) return nan_of(x, y);
        }
        return x < y ? x : y;
      case BinaryOp::relu_backward:
        return y <= A(0) ? A(0) : x;
      case BinaryOp::add_relu: {
        const A s = x + y;  // as UnaryOp::relu: NaN stays NaN
        if constexpr (std::is_floating_point_v<A>) {
          if (isnan(s)) return s;
        }
        return s > A(0) ? s : A(0);
      }
      case BinaryOp::gelu_backward:
        if constexpr (std::is_floating_point_v<A>) {
          const A cdf = A(0.5) * (A(1) + erf(y * static_cast<A>(M_SQRT1_2)));
          const A pdf = exp(A(-0.5) * y * y) * static_cast<A>(kInvSqrt2Pi);
          return x * (cdf + y * pdf);
        } else {
          return A{};
        }
      case BinaryOp::gelu_tanh_backward:
        if constexpr (std::is_floating_point_v<A>) {
          const A k = static_cast<A>(kSqrt2OverPi), c = static_cast<A>(kGeluTanhCubic);
          const A y2 = y * y;
          const A t = tanh(k * y * (A(1) + c * y2));
          return x *
                 (A(0.5) * (A(1) + t) + A(0.5) * y * (A(1) - t * t) * k * (A(1) + A(3) * c * y2));
        } else {
          return A{};
        }
      case BinaryOp::silu_backward:
        if constexpr (std::is_floating_point_v<A>) {
          const A sig = A(1) / (A(1) + exp(-y));
          return x * (sig * (A(1) + y * (A(1) - sig)));
        } else {
          return A{};
        }
      case BinaryOp::sigmoid_backward:
        return x * (A(1) - y) * y;
      case BinaryOp::tanh_backward:
        return x * (A(1) - y * y);
      case BinaryOp::silu_mul:
        if constexpr (std::is_floating_point_v<A>) {
          return x / (A(1) + exp(-x)) * y;
        } else {
          return A{};
        }
      default:
        return A{};
    }
  }
}

// op(x) for the unary ops (floating A only).
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A unary_value(ops::UnaryOp op, A x) {
  using ops::UnaryOp;
  switch (op) {
    case UnaryOp::neg:
      return -x;
    case UnaryOp::exp:
      return exp(x);
    case UnaryOp::log:
      return log(x);
    case UnaryOp::sqrt:
      return sqrt(x);
    case UnaryOp::rsqrt:
      return A(1) / sqrt(x);
    case UnaryOp::abs:
      return fabs(x);
    case UnaryOp::sign:
      return static_cast<A>((x > A(0)) - (x < A(0)));
    case UnaryOp::relu:
      return x > A(0) ? x : (isnan(x) ? x : A(0));
    case UnaryOp::sigmoid:
      return A(1) / (A(1) + exp(-x));
    case UnaryOp::tanh:
      return tanh(x);
    case UnaryOp::silu:
      return x / (A(1) + exp(-x));
    case UnaryOp::gelu:
      return A(0.5) * x * (A(1) + erf(x * static_cast<A>(M_SQRT1_2)));
    case UnaryOp::gelu_tanh:
      return A(0.5) * x *
             (A(1) + tanh(static_cast<A>(kSqrt2OverPi) *
                          (x + static_cast<A>(kGeluTanhCubic) * x * x * x)));
    case UnaryOp::reciprocal:
      return A(1) / x;
    case UnaryOp::square:
      return x * x;
    case UnaryOp::sin:
      return sin(x);
    case UnaryOp::cos:
      return cos(x);
    case UnaryOp::log1p:
      return log1p(x);
    case UnaryOp::expm1:
      return expm1(x);
    case UnaryOp::erf:
      return erf(x);
  }
  return x;
}

// torch.lerp's value: a + w * (b - a), computed from the nearer end (b - (b - a) * (1 - w)
// when |w| >= 0.5) as PyTorch does, so w = 1 gives b exactly.
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A lerp_value(A a, A b, A w) {
  const A d = b - a;
  return (w < A(0.5) && w > A(-0.5)) ? a + w * d : b - d * (A(1) - w);
}

// x * a + b in A.
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A affine_value(A x, double a, double b) {
  return x * static_cast<A>(a) + static_cast<A>(b);
}

// v clamped to [lo, hi] where given (a NaN v is the caller's: it keeps the input unchanged).
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A clamp_value(A v, bool has_lo, double lo, bool has_hi,
                                                   double hi) {
  if (has_lo && v < static_cast<A>(lo)) v = static_cast<A>(lo);
  if (has_hi && v > static_cast<A>(hi)) v = static_cast<A>(hi);
  return v;
}

// Element j (0..3) of a Philox block r as a standard normal: Box-Muller on lanes (0,1) and
// (2,3), cos for even j, sin for odd, in double.
TALLY_HOST_DEVICE TALLY_FORCE_INLINE double normal_from_philox(const Philox4& r, int j) {
  const int p = j & 2;
  const double u1 = 1.0 - static_cast<double>(uniform_from_bits(r[p]));  // (0, 1]
  const double u2 = static_cast<double>(uniform_from_bits(r[p + 1]));
  const double rad = sqrt(-2.0 * log(u1));
  const double th = 2.0 * M_PI * u2;
  return (j & 1) ? rad * sin(th) : rad * cos(th);
}

}  // namespace tally::math
