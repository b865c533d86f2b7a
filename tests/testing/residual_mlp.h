// A user's residual MLP, built from Tally's layers but of module types of its own that declare
// no checkpoint blocks: MyBlock (x + down(gelu(up(norm(x))))) and MyNet (stem, `blocks` of
// MyBlocks, head). The planner's tests (tests/nn/test_plan_any_model.cpp) and its ranking
// bench (bench/bench_plan_rank.cpp) plan for it as for any model Tally does not know.
#pragma once

#include <memory>
#include <vector>

#include "autograd/ops.h"
#include "memory/context.h"
#include "nn/container.h"
#include "nn/layers.h"
#include "nn/norm.h"

namespace tally::testing {

class MyBlock : public nn::Module {
 public:
  explicit MyBlock(int64_t d) : Module("MyBlock") {
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(d));
    up = register_module("up", std::make_shared<nn::Linear>(d, 4 * d));
    down = register_module("down", std::make_shared<nn::Linear>(4 * d, d));
  }
  Tensor forward(const Tensor& x) override { return add(x, (*down)(gelu((*up)((*norm)(x))))); }
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<nn::Linear> up, down;
};

class MyNet : public nn::Module {
 public:
  MyNet(int64_t in, int64_t d, int64_t n_blocks, int64_t classes) : Module("MyNet") {
    stem = register_module("stem", std::make_shared<nn::Linear>(in, d));
    blocks = register_module("blocks", std::make_shared<nn::Sequential>());
    for (int64_t i = 0; i < n_blocks; ++i) blocks->push_back(std::make_shared<MyBlock>(d));
    head = register_module("head", std::make_shared<nn::Linear>(d, classes));
  }
  Tensor forward(const Tensor& x) override { return (*head)((*blocks)((*stem)(x))); }
  std::shared_ptr<nn::Linear> stem, head;
  std::shared_ptr<nn::Sequential> blocks;
};

// MyNet seeded as the planner's tests build it (seed 0), a batch of `rows` for it (seed 1:
// inputs tagged `input`, class targets) and its loss.
inline std::shared_ptr<MyNet> seeded_my_net(int64_t in, int64_t d, int64_t n_blocks,
                                            int64_t classes) {
  manual_seed(0);
  return std::make_shared<MyNet>(in, d, n_blocks, classes);
}
inline std::vector<Tensor> my_batch(int64_t rows, int64_t in, int64_t classes) {
  manual_seed(1);
  memory::CategoryScope input(memory::Category::input);
  return {randn({rows, in}), randint(0, classes, {rows})};
}
inline Tensor my_loss(nn::Module& m, const std::vector<Tensor>& b) {
  return cross_entropy(m(b[0]), b[1]);
}

}  // namespace tally::testing
