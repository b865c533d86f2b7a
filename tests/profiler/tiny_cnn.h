// A tiny CNN from raw differentiable ops for the profiler tests: conv1 -> relu -> max_pool
// -> fc1 -> relu -> fc2 -> cross_entropy, each layer inside a memory::ModuleScope, the
// passes inside torch.profiler's recipe ranges (profiler::annotated_training_step), a
// hand-written SGD update under PhaseScope("optimizer"). Parameters are allocated as `parameter`,
// the batch as `input`.
#pragma once

#include "autograd/ops.h"
#include "memory/context.h"
#include "profiler/profiler.h"
#include "profiler/training_step.h"

namespace tally::testing {

struct TinyCnn {
  static constexpr int64_t kBatch = 4, kClasses = 3;
  Tensor cw, cb, w1, b1, w2, b2;
  Tensor x, y;

  TinyCnn() {
    manual_seed(0);
    {
      memory::CategoryScope cat(memory::Category::parameter);
      cw = mul(randn({4, 1, 3, 3}), 0.3).detach();
      cb = zeros({4});
      w1 = mul(randn({16, 64}), 0.1).detach();
      b1 = zeros({16});
      w2 = mul(randn({kClasses, 16}), 0.1).detach();
      b2 = zeros({kClasses});
    }
    for (Tensor* p : params()) p->requires_grad_(true);
    memory::CategoryScope cat(memory::Category::input);
    x = randn({kBatch, 1, 8, 8});
    y = from_vector({0, 1, 2, 1}, {kBatch}, TensorOptions{}.with_dtype(DType::int64));
  }

  std::vector<Tensor*> params() { return {&cw, &cb, &w1, &b1, &w2, &b2}; }

  Tensor forward() {
    memory::PhaseScope phase("forward");
    memory::ModuleScope net("net");
    Tensor h;
    {
      memory::ModuleScope m("conv1");
      h = max_pool2d(relu(conv2d(x, cw, cb, 1, 1)), 2);
    }
    h = h.reshape({kBatch, 64});
    {
      memory::ModuleScope m("fc1");
      h = relu(linear(h, w1, b1));
    }
    {
      memory::ModuleScope m("fc2");
      h = linear(h, w2, b2);
    }
    return cross_entropy(h, y);
  }

  double train_step() {
    for (Tensor* p : params()) p->set_grad(Tensor());
    profiler::annotated_training_step([&] { return forward(); },
                                      [&] {
                                        for (Tensor* p : params()) ops::add_(*p, p->grad(), -0.1);
                                      });
    return 0;
  }
};

}  // namespace tally::testing
