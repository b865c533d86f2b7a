// Shared helpers for the CUDA op tests (tests/tensor/test_*_cuda.cpp), which check each op on
// the GPU against the CPU reference: the skip-without-a-device macro, the devices, random
// inputs made on the CPU (so host and device see the very same numbers), the same tensor on
// both devices, dtype lists and tolerances, and the GPU-vs-CPU comparisons. The comparisons
// differ on purpose (how the error is normalised, how NaN and infinities count); each is
// named for what it measures, and a test picks the one whose rules it was written against.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "memory/memory.h"
#include "testing/gradcheck.h"

// Skips the current test when no CUDA device is present.
#define REQUIRE_GPU()                                                                 \
  do {                                                                                \
    if (!::tally::memory::cuda_available()) GTEST_SKIP() << "no CUDA device present"; \
  } while (0)

namespace tally::testing {

inline const Device kGpu = Device::cuda(0);
inline const Device kCpu = Device::cpu();

// The floating dtypes the CUDA kernels take.
inline constexpr DType kFloatDtypes[] = {DType::float32, DType::float64, DType::float16,
                                         DType::bfloat16};

// The usual tolerance for results computed element by element (or with short reductions):
// float32 1e-5, float64 1e-12, 16-bit 1e-2.
inline double pointwise_tol(DType d) {
  return d == DType::float32 ? 1e-5 : d == DType::float64 ? 1e-12 : 1e-2;
}

// A copy of t on the GPU, same dtype.
inline Tensor to_gpu(const Tensor& t) {
  return ops::to(t, kGpu, t.dtype());
}

// Uniform values in [lo, hi) of dtype d on the CPU: drawn in float64, then rounded to d.
inline Tensor rand_tensor(const Shape& s, DType d, uint64_t seed, double lo = -2, double hi = 2) {
  Generator g(seed);
  return ops::to(ops::affine(ops::rand(s, DType::float64, kCpu, &g), hi - lo, lo), d);
}

// The same values on the CPU and on the GPU.
struct Pair {
  Tensor cpu, gpu;
};

// The same random tensor (rand_tensor) on both devices; noncontig: both are permuted views
// (reversed dims) of a contiguous base of the reversed shape, so neither is contiguous.
inline Pair both(const Shape& s, DType d, uint64_t seed, bool noncontig = false, double lo = -2,
                 double hi = 2) {
  if (!noncontig) {
    Tensor c = rand_tensor(s, d, seed, lo, hi);
    return {c, ops::to(c, kGpu, d)};
  }
  const Shape rev(s.rbegin(), s.rend());
  Shape perm;
  for (int64_t i = static_cast<int64_t>(s.size()) - 1; i >= 0; --i) perm.push_back(i);
  const Tensor base = rand_tensor(rev, d, seed, lo, hi);
  return {ops::permute(base, perm), ops::permute(ops::to(base, kGpu, d), perm)};
}

// ------------------------------------------------------------------ comparisons
//
// "pointwise": the error of an element is |got - ref| / max(1, |ref|), the worst one counts.
// "scaled": the error is max |got - ref| / max |ref| over the whole tensor.

// max |t| (0 for an undefined or empty tensor).
inline double max_abs(const Tensor& t) {
  double m = 0;
  if (t.defined())
    for (double v : ops::to_vector(t)) m = std::max(m, std::abs(v));
  return m;
}

// "[2, 3] float16": a tensor's shape and dtype, for failure messages.
inline std::string shape_dtype(const Tensor& t) {
  return t.shape_string() + " " + dtype_name(t.dtype());
}

// Scaled, with a floor and a label (the normalization tests' comparison): gpu (on the device)
// against cpu, both defined or both undefined, the same shape and dtype, NaN and infinities at
// the same elements, and max |gpu - cpu| <= tol * max(max |cpu|, floor) over the finite ones.
// The failure names `what` and the worst element.
inline ::testing::AssertionResult close_to_cpu(const Tensor& gpu, const Tensor& cpu, double tol,
                                               const std::string& what, double floor = 0) {
  if (gpu.defined() != cpu.defined())
    return ::testing::AssertionFailure()
           << what << ": defined on gpu " << gpu.defined() << ", on cpu " << cpu.defined();
  if (!gpu.defined()) return ::testing::AssertionSuccess();
  if (!gpu.is_cuda())
    return ::testing::AssertionFailure() << what << ": result is on " << gpu.device().str();
  if (gpu.sizes() != cpu.sizes() || gpu.dtype() != cpu.dtype())
    return ::testing::AssertionFailure()
           << what << ": gpu " << shape_dtype(gpu) << " vs cpu " << shape_dtype(cpu);
  const std::vector<double> a = ops::to_vector(gpu), b = ops::to_vector(cpu);
  double max_ref = 0, max_diff = 0;
  size_t worst = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i]) || std::isinf(a[i]) != std::isinf(b[i]))
      return ::testing::AssertionFailure() << what << ": element " << i << " gpu " << a[i]
                                           << " cpu " << b[i] << " (" << shape_dtype(cpu) << ")";
    if (std::isnan(b[i]) || std::isinf(b[i])) continue;
    max_ref = std::max(max_ref, std::abs(b[i]));
    const double diff = std::abs(a[i] - b[i]);
    if (diff > max_diff) {
      max_diff = diff;
      worst = i;
    }
  }
  const double denom = std::max(max_ref, floor);
  const double rel = denom > 0 ? max_diff / denom : max_diff;
  if (rel <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": relative error " << rel << " > " << tol << " (" << shape_dtype(cpu)
         << ", max|ref| " << max_ref << ", floor " << floor << ", worst at flat index " << worst
         << ": gpu " << a[worst] << " vs cpu " << b[worst] << ")";
}

// The normalization kernels' tolerances relative to max |reference|: elementwise-ish results
// (out, dx, per-row or per-channel statistics) and reductions over many rows (dweight, dbias).
struct NormTol {
  double elem, red;
};
inline NormTol norm_tol(DType d) {
  switch (d) {
    case DType::float32:
      return {1e-5, 1e-4};
    case DType::float64:
      return {1e-12, 1e-11};
    default:
      return {2e-2, 2e-2};
  }
}

// The size of a normalization dx's terms: max |dy| * max |weight| (1 without) * max |rstd or
// invstd| (dx can cancel, so its error is measured against this floor).
inline double norm_dx_floor(const Tensor& dy, const Tensor& w, const Tensor& rstd) {
  return max_abs(dy) * (w.defined() ? max_abs(w) : 1.0) * max_abs(rstd);
}

// "batch_norm [2, 3, 4, 4] float16<extra>": a case's name for failure messages.
inline std::string case_label(const char* op, const Shape& s, DType d, const char* extra = "") {
  std::ostringstream o;
  o << op << " " << shape_str(s) << " " << dtype_name(d) << extra;
  return o.str();
}

// The two memory formats, short, and a tensor laid out channels_last (a new tensor unless it
// already is).
inline constexpr MemoryFormat kCL = MemoryFormat::channels_last;
inline constexpr MemoryFormat kRM = MemoryFormat::contiguous;
inline Tensor cl(const Tensor& t) {
  return ops::contiguous(t, kCL);
}

// The memory-format predicates, with the sizes and strides in the failure message:
// suggest_memory_format() == channels_last, and row-major contiguous (is_contiguous() and
// suggest_memory_format() == contiguous).
inline ::testing::AssertionResult is_channels_last(const Tensor& t) {
  if (!t.defined()) return ::testing::AssertionFailure() << "undefined tensor";
  if (t.suggest_memory_format() == MemoryFormat::channels_last)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "not channels_last: sizes " << t.shape_string()
                                       << " strides " << shape_str(t.strides());
}
inline ::testing::AssertionResult is_row_major(const Tensor& t) {
  if (!t.defined()) return ::testing::AssertionFailure() << "undefined tensor";
  if (t.is_contiguous() && t.suggest_memory_format() == MemoryFormat::contiguous)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "not row-major contiguous: sizes " << t.shape_string()
                                       << " strides " << shape_str(t.strides());
}

// Pointwise, lenient: elements equal (equal infinities too) or both NaN count 0; an element
// whose error comes out NaN (a NaN against a number, anything but the same infinity against
// an infinite reference) is passed over. Sizes are EXPECTed equal.
inline double max_pointwise_error_lenient(const Tensor& got, const Tensor& ref) {
  const std::vector<double> a = ops::to_vector(got), b = ops::to_vector(ref);
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (a[i] == b[i]) continue;
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1.0, std::abs(b[i])));
  }
  return worst;
}

// Pointwise, strict: NaN only against NaN, an infinity only against the same infinity;
// gpu and cpu must also agree in shape and dtype, and gpu must be on the GPU. On failure:
// how many elements are off, the worst element, its index and both values.
inline ::testing::AssertionResult close_pointwise(const Tensor& gpu, const Tensor& cpu,
                                                  double tol) {
  if (gpu.sizes() != cpu.sizes())
    return ::testing::AssertionFailure()
           << "shape " << gpu.shape_string() << " (gpu) vs " << cpu.shape_string() << " (cpu)";
  if (gpu.dtype() != cpu.dtype())
    return ::testing::AssertionFailure() << "dtype " << dtype_name(gpu.dtype()) << " (gpu) vs "
                                         << dtype_name(cpu.dtype()) << " (cpu)";
  if (!gpu.is_cuda()) return ::testing::AssertionFailure() << "result is not on the GPU";
  const std::vector<double> a = ops::to_vector(gpu), b = ops::to_vector(cpu);
  double worst = 0;
  size_t at = 0;
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double e = 0;
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      e = std::isnan(a[i]) && std::isnan(b[i]) ? 0 : std::numeric_limits<double>::infinity();
    } else if (a[i] != b[i]) {
      e = (std::isinf(a[i]) || std::isinf(b[i]))
              ? std::numeric_limits<double>::infinity()
              : std::abs(a[i] - b[i]) / std::max(1.0, std::abs(b[i]));
    }
    if (e > tol) ++bad;
    if (e > worst) {
      worst = e;
      at = i;
    }
  }
  if (worst <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << a.size() << " elements off; worst at flat index " << at << ": gpu "
         << a[at] << " vs cpu " << b[at] << " (error " << worst << " > tol " << tol << ", shape "
         << cpu.shape_string() << ", " << dtype_name(cpu.dtype()) << ")";
}

// Scaled, strict on NaN: a NaN where the reference has none (or the other way round), or an
// infinity against an infinity, counts as an infinite error; both NaN count 0. max |ref|
// (over the non-NaN values) is taken as 1 when it is 0. On failure: the worst element.
inline ::testing::AssertionResult close_scaled(const Tensor& got, const Tensor& ref, double tol) {
  if (got.sizes() != ref.sizes())
    return ::testing::AssertionFailure()
           << "shape " << got.shape_string() << " vs reference " << ref.shape_string();
  const std::vector<double> a = ops::to_vector(got), b = ops::to_vector(ref);
  double scale = 0;
  for (double v : b)
    if (!std::isnan(v)) scale = std::max(scale, std::abs(v));
  if (scale == 0) scale = 1;
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double e = std::abs(a[i] - b[i]);
    if (std::isnan(e))
      e = std::isnan(a[i]) && std::isnan(b[i]) ? 0.0 : std::numeric_limits<double>::infinity();
    if (e > worst) {
      worst = e;
      at = i;
    }
  }
  const double rel = worst / scale;
  if (rel <= tol) return ::testing::AssertionSuccess() << "relative error " << rel;
  return ::testing::AssertionFailure()
         << "max|got - ref| / max|ref| = " << rel << " > " << tol << " (worst at flat index " << at
         << ": got " << a[at] << ", ref " << b[at] << "; max|ref| " << scale << "; shape "
         << got.shape_string() << ", " << got.numel() << " elements)";
}

// Scaled, with no NaN rules at all (for finite results): max |got - ref| / max |ref|, max |ref|
// taken as 1 when it is 0.
inline double max_scaled_error(const Tensor& got, const Tensor& ref) {
  const std::vector<double> a = ops::to_vector(got), b = ops::to_vector(ref);
  double scale = 0, worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    scale = std::max(scale, std::abs(b[i]));
    worst = std::max(worst, std::abs(a[i] - b[i]));
  }
  return worst / (scale > 0 ? scale : 1.0);
}

// The worst difference between got and ref, with where it happens, for a failure message;
// made by diff_scaled or diff_pointwise (err is that function's error measure).
struct Diff {
  bool scaled = false;  // made by diff_scaled (else diff_pointwise)
  double err = 0, ref_max = 0, got = 0, want = 0;
  size_t at = 0, n = 0, mismatches = 0;  // mismatches: elements whose error is not 0
  bool shape_ok = true;
  std::string str() const {
    if (!shape_ok) return "shape mismatch";
    std::ostringstream o;
    if (scaled)
      o << "max |diff| / max |ref| = " << err << " (worst at flat index " << at << " of " << n
        << ": got " << got << ", want " << want << "; max |ref| = " << ref_max << ")";
    else
      o << "max rel err " << err << " at flat index " << at << " of " << n << " (got " << got
        << ", want " << want << "); " << mismatches << " elements differ";
    return o.str();
  }
};

// The worst element of `got` against `ref` under err(a, b), with where it is and how many
// elements have a non-zero error. Different shapes give an infinite error.
template <class Err>
Diff worst_element(const Tensor& got, const Tensor& ref, bool scaled, Err err) {
  Diff d;
  d.scaled = scaled;
  if (got.sizes() != ref.sizes()) {
    d.shape_ok = false;
    d.err = INFINITY;
    return d;
  }
  const std::vector<double> a = ops::to_vector(got), b = ops::to_vector(ref);
  d.n = a.size();
  double worst = -1;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = err(a[i], b[i]);
    if (e != 0) ++d.mismatches;
    if (e > worst) worst = e, d.at = i, d.got = a[i], d.want = b[i];
  }
  d.err = std::max(worst, 0.0);
  return d;
}

// Scaled: max |got - ref| / max |ref| (max |ref| at least 1e-30); a NaN against a number
// counts as infinite, NaN against NaN as 0. Different shapes give an infinite error.
inline Diff diff_scaled(const Tensor& got, const Tensor& ref) {
  Diff d = worst_element(got, ref, /*scaled=*/true, [](double a, double b) {
    if (std::isnan(a) != std::isnan(b)) return static_cast<double>(INFINITY);
    return std::isnan(a) ? 0.0 : std::abs(a - b);
  });
  if (!d.shape_ok) return d;
  for (double v : ops::to_vector(ref)) d.ref_max = std::max(d.ref_max, std::abs(v));
  d.err = d.err <= 0 ? 0 : d.err / std::max(d.ref_max, 1e-30);
  return d;
}

// Pointwise: NaN must meet NaN (else infinite), equal values (equal infinities too) count 0;
// also counts the elements that differ at all. Different shapes give an infinite error.
inline Diff diff_pointwise(const Tensor& got, const Tensor& ref) {
  return worst_element(got, ref, /*scaled=*/false, [](double a, double b) {
    if (std::isnan(a) || std::isnan(b))
      return std::isnan(a) && std::isnan(b) ? 0.0 : static_cast<double>(INFINITY);
    if (a == b) return 0.0;  // also equal infinities
    return std::abs(a - b) / std::max(1.0, std::abs(b));
  });
}

}  // namespace tally::testing
