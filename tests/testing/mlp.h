// A two-layer MLP as a plain list of parameters, for optimizer tests that step two copies of
// it and compare them bitwise: the same seeded weights every call, a seeded batch per step.
#pragma once

#include <vector>

#include "autograd/ops.h"

namespace tally::testing {

// fc1 weight [hidden, 64] and bias [hidden], fc2 weight [10, hidden], drawn from seed 5.
inline std::vector<Tensor> mlp_params(int64_t hidden) {
  manual_seed(5);
  return {ops::randn({hidden, 64}).requires_grad_(), ops::randn({hidden}).requires_grad_(),
          ops::randn({10, hidden}).requires_grad_()};
}

// mean((relu(x fc1) fc2)^2) over a batch [batch, 64] drawn from seed 100 + step.
inline Tensor mlp_loss(const std::vector<Tensor>& p, int step, int64_t batch) {
  manual_seed(100 + step);
  const Tensor x = ops::randn({batch, 64});
  return mean(pow(matmul(relu(linear(x, p[0], p[1])), p[2].t()), 2.0));
}

// Every tensor's values (float32 values are exact in double).
inline std::vector<std::vector<double>> values(const std::vector<Tensor>& ps) {
  std::vector<std::vector<double>> v;
  for (const Tensor& p : ps) v.push_back(ops::to_vector(p));
  return v;
}

}  // namespace tally::testing
