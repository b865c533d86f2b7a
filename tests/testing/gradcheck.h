// The op-test harness: float64 finite-difference gradient checks and value checks. One
// line per op case; the CUDA issue runs the same cases on the GPU against the CPU. Also
// the small helpers the op tests share: dtype options, error-message checks and what a
// node saved for backward.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "testing/files.h"

namespace tally::testing {

using Fn = std::function<Tensor(const TensorList&)>;

// A float64 leaf of `shape` with values in [lo, hi), requiring grad.
inline Tensor rand_input(const Shape& shape, double lo = -1.0, double hi = 1.0, uint64_t seed = 1) {
  Generator g(seed);
  Tensor t = ops::affine(ops::rand(shape, DType::float64, Device::cpu(), &g), hi - lo, lo);
  t.requires_grad_(true);
  return t;
}

// A float64 leaf whose *layout* is non-contiguous (a transposed copy), requiring grad.
inline Tensor rand_input_noncontig(const Shape& shape, uint64_t seed = 1) {
  Shape rev(shape.rbegin(), shape.rend());
  Generator g(seed);
  Tensor base = ops::affine(ops::rand(rev, DType::float64, Device::cpu(), &g), 2.0, -1.0);
  Shape perm;
  for (int64_t i = static_cast<int64_t>(shape.size()) - 1; i >= 0; --i) perm.push_back(i);
  Tensor t = ops::permute(base, perm);  // shares base's storage, non-contiguous
  t.requires_grad_(true);
  return t;
}

// Checks d(sum(fn(inputs) * w))/d(inputs) against central differences in float64.
// Every floating input that requires grad is checked, element by element.
inline ::testing::AssertionResult gradcheck(const Fn& fn, const TensorList& inputs,
                                            double eps = 1e-6, double atol = 1e-6,
                                            double rtol = 1e-4) {
  Tensor out = fn(inputs);
  if (!out.requires_grad()) return ::testing::AssertionFailure() << "output does not require grad";
  Generator g(99);
  const Tensor w = ops::randn(out.sizes(), DType::float64, Device::cpu(), &g);
  for (const Tensor& in : inputs)
    if (in.defined() && in.requires_grad()) in.set_grad(Tensor());
  tally::sum(tally::mul(out.to(DType::float64), w)).backward();

  auto f = [&]() {
    NoGradGuard ng;
    const Tensor o = ops::to(fn(inputs), DType::float64);
    return ops::item(ops::sum(ops::mul(o, w)));
  };
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& in = inputs[k];
    if (!in.defined() || !in.requires_grad()) continue;
    const Tensor grad = in.grad();
    if (!grad.defined())
      return ::testing::AssertionFailure() << "input " << k << " got no gradient";
    if (grad.sizes() != in.sizes())
      return ::testing::AssertionFailure() << "input " << k << " gradient shape "
                                           << grad.shape_string() << " != " << in.shape_string();
    const std::vector<double> analytic = ops::to_vector(grad);
    // Walk the elements through the input's own layout.
    const Tensor flat_idx =
        ops::reshape(ops::arange(0, static_cast<double>(in.numel()), 1, DType::int64), in.sizes());
    double* base = static_cast<double*>(in.storage().data());
    std::vector<int64_t> offsets;
    {
      // element offset of each logical element (row-major order)
      std::vector<int64_t> idx(static_cast<size_t>(in.dim()), 0);
      for (int64_t e = 0; e < in.numel(); ++e) {
        int64_t off = in.storage_offset();
        for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * in.strides()[d];
        offsets.push_back(off);
        for (size_t d = idx.size(); d-- > 0;) {
          if (++idx[d] < in.sizes()[d]) break;
          idx[d] = 0;
        }
      }
    }
    for (int64_t e = 0; e < in.numel(); ++e) {
      double& x = base[offsets[static_cast<size_t>(e)]];
      const double saved = x;
      x = saved + eps;
      const double fp = f();
      x = saved - eps;
      const double fm = f();
      x = saved;
      const double numeric = (fp - fm) / (2 * eps);
      const double a = analytic[static_cast<size_t>(e)];
      if (!(std::abs(a - numeric) <= atol + rtol * std::abs(numeric)))
        return ::testing::AssertionFailure() << "input " << k << " element " << e << ": analytic "
                                             << a << " vs numeric " << numeric;
    }
  }
  return ::testing::AssertionSuccess();
}

// Values of t equal `expected` (row-major) within tol.
inline ::testing::AssertionResult values_near(const Tensor& t, const std::vector<double>& expected,
                                              double tol = 1e-6) {
  const std::vector<double> v = ops::to_vector(t);
  if (v.size() != expected.size())
    return ::testing::AssertionFailure() << v.size() << " values, expected " << expected.size();
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] == expected[i]) continue;  // also infinities
    if (std::isnan(expected[i]) ? !std::isnan(v[i]) : !(std::abs(v[i] - expected[i]) <= tol))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << v[i] << " vs " << expected[i];
  }
  return ::testing::AssertionSuccess();
}

// max |a - b| over two tensors of the same number of elements (EXPECTed), any devices, read
// as float64 in row-major order.
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = ops::to_vector(a), y = ops::to_vector(b);
  EXPECT_EQ(x.size(), y.size());
  double m = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

// Options for float64 and int64 tensors, and float64 leaves that require grad.
inline const TensorOptions f64 = TensorOptions{}.with_dtype(DType::float64);
inline const TensorOptions i64 = TensorOptions{}.with_dtype(DType::int64);
inline const TensorOptions f64_grad =
    TensorOptions{}.with_dtype(DType::float64).with_requires_grad();

// start, start + 1, ..., start + n - 1.
inline std::vector<double> iota_values(int64_t n, double start = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = start + static_cast<double>(i);
  return v;
}

// The message of the E that `f` throws, or "<no exception>" when it throws none.
template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no exception>";
}

// Expects `f` to throw E whose message contains every one of `parts`.
template <typename E, typename F>
void expect_error(F&& f, std::initializer_list<const char*> parts) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    for (const char* p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

// The defined tensors the node that produced `out` saved for backward.
inline std::vector<Tensor> saved_by(const Tensor& out) {
  std::vector<Tensor> r;
  for (const SavedTensor* s : out.autograd_meta()->grad_fn->saved_tensors())
    if (s->defined()) r.push_back(s->held());
  return r;
}

// Whether `got` (float16 or bfloat16) is the float32 result `ref` rounded once to got's dtype:
// within one unit in its last place (float32 sums blocked differently round differently),
// plus 1e-6 of max |ref| for results that cancel to near 0. Results accumulated in 16 bits,
// or rounded twice, miss by far more at the sizes the CPU's 16-bit tests use.
inline ::testing::AssertionResult rounded_once_from(const Tensor& got, const Tensor& ref) {
  const double mant = got.dtype() == DType::bfloat16 ? 0x1p-7 : 0x1p-10;
  const std::vector<double> g = ops::to_vector(got), r = ops::to_vector(ref);
  double max_abs = 0;
  for (double v : r) max_abs = std::max(max_abs, std::fabs(v));
  if (g.size() != r.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < g.size(); ++i) {
    const double ulp = std::exp2(std::floor(std::log2(std::max(std::fabs(r[i]), 1e-30)))) * mant;
    if (std::fabs(g[i] - r[i]) > ulp + 1e-6 * max_abs)
      return ::testing::AssertionFailure() << "element " << i << ": " << g[i] << ", float32 "
                                           << r[i] << " (" << dtype_name(got.dtype()) << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace tally::testing
