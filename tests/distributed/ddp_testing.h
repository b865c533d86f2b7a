// What the DDP tests share: a small MLP (no batch norm) built from a seed, a deterministic
// classification batch, and a few SGD steps with or without the wrapper.
#pragma once

#include <memory>
#include <vector>

#include "distributed/ddp.h"
#include "nn/container.h"
#include "nn/layers.h"
#include "optim/sgd.h"
#include "tensor/softmax/autograd.h"

namespace tally::testing {

inline std::shared_ptr<nn::Sequential> make_mlp(uint64_t seed, Device dev, int64_t in = 8,
                                                int64_t hidden = 32, int64_t out = 5) {
  Generator gen(seed);
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(in, hidden, true, &gen));
  m->push_back(std::make_shared<nn::ReLU>());
  m->push_back(std::make_shared<nn::Linear>(hidden, hidden, true, &gen));
  m->push_back(std::make_shared<nn::ReLU>());
  m->push_back(std::make_shared<nn::Linear>(hidden, out, true, &gen));
  m->to(dev);
  return m;
}

struct Batch {
  Tensor x, y;
};

// Batch `step` of `n` examples (the same on every call), on `dev`.
inline Batch make_batch(int64_t step, int64_t n, Device dev, int64_t in = 8, int64_t classes = 5) {
  Generator gen(1000 + static_cast<uint64_t>(step));
  Tensor x = ops::randn({n, in}, DType::float32, Device::cpu(), &gen);
  Tensor y = ops::randint(0, classes, {n}, DType::int64, Device::cpu(), &gen);
  return {ops::to(x, dev, DType::float32), ops::to(y, dev, DType::int64)};
}

struct Curve {
  std::vector<double> losses;
  std::vector<std::vector<double>> grads;  // per step: every parameter's grad, concatenated
};

// `steps` SGD steps of `model` (through `ddp` when given).
inline Curve train(nn::Module& model, distributed::DistributedDataParallel* ddp, int steps,
                   Device dev) {
  optim::SGD opt(model.parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  Curve c;
  for (int s = 0; s < steps; ++s) {
    const Batch b = make_batch(s, 16, dev);
    opt.zero_grad(true);
    const Tensor logits = ddp ? (*ddp)(b.x) : model(b.x);
    const Tensor loss = cross_entropy(logits, b.y);
    loss.backward();
    c.losses.push_back(loss.item());
    std::vector<double> g;
    for (const Tensor& p : model.parameters()) {
      const std::vector<double> v = p.grad().tolist();
      g.insert(g.end(), v.begin(), v.end());
    }
    c.grads.push_back(std::move(g));
    opt.step();
  }
  return c;
}

}  // namespace tally::testing
