// Helpers for the optimizer tests: float32 leaf parameters with given values, gradients
// set directly, and float64 reference implementations of PyTorch's update equations
// (torch.optim.SGD / Adam / AdamW pseudo-code) to compare against.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "autograd/ops.h"
#include "tensor/ops.h"

namespace tally::testing {

inline Tensor param(const std::vector<double>& v, DType d = DType::float32,
                    Device dev = Device::cpu()) {
  Tensor t = ops::from_vector(v, {static_cast<int64_t>(v.size())}, d, dev);
  t.requires_grad_(true);
  return t;
}

inline void set_grad(const Tensor& p, const std::vector<double>& g) {
  p.set_grad(ops::from_vector(g, p.sizes(), p.dtype(), p.device()));
}

struct RefSGD {
  double lr = 0, momentum = 0, dampening = 0, wd = 0;
  bool nesterov = false, maximize = false;
  std::vector<double> buf{};
  bool has_buf = false;
  void step(std::vector<double>& p, const std::vector<double>& g0) {
    std::vector<double> g = g0;
    if (buf.empty()) buf.resize(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      double d = maximize ? -g[i] : g[i];
      if (wd != 0) d += wd * p[i];
      if (momentum != 0) {
        buf[i] = has_buf ? momentum * buf[i] + (1 - dampening) * d : d;
        d = nesterov ? d + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
    has_buf = true;
  }
};

struct RefAdam {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0;
  bool decoupled = false, amsgrad = false, maximize = false;
  std::vector<double> m{}, v{}, vmax{};
  int step_count = 0;
  void step(std::vector<double>& p, const std::vector<double>& g0) {
    if (m.empty()) m.assign(p.size(), 0), v.assign(p.size(), 0), vmax.assign(p.size(), 0);
    ++step_count;
    const double bc1 = 1 - std::pow(beta1, step_count), bc2 = 1 - std::pow(beta2, step_count);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = maximize ? -g0[i] : g0[i];
      if (wd != 0) {
        if (decoupled)
          p[i] *= 1 - lr * wd;
        else
          g += wd * p[i];
      }
      m[i] = beta1 * m[i] + (1 - beta1) * g;
      v[i] = beta2 * v[i] + (1 - beta2) * g * g;
      double vv = v[i];
      if (amsgrad) vv = vmax[i] = std::max(vmax[i], v[i]);
      p[i] -= lr / bc1 * m[i] / (std::sqrt(vv) / std::sqrt(bc2) + eps);
    }
  }
};

// Elementwise |got - want| <= tol * max(1, |want|).
inline ::testing::AssertionResult near_rel(const Tensor& t, const std::vector<double>& want,
                                           double tol) {
  const std::vector<double> got = ops::to_vector(t);
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= tol * std::max(1.0, std::abs(want[i]))))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << got[i] << " vs " << want[i];
  return ::testing::AssertionSuccess();
}

}  // namespace tally::testing
