// Design rule 2, checked: at the end of a forward pass the bytes tagged `activation` are
// exactly the bytes held by saved tensors; after backward they are zero and `gradient`
// equals the parameters' size; nothing is `unknown` at the peak.
#include <unordered_set>

#include "tensor/conv/autograd.h"
#include "tensor/norm/autograd.h"
#include "tensor/pool/autograd.h"
#include "tensor/softmax/autograd.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using memory::Category;

memory::CachingAllocator& cpu_alloc() {
  return memory::get_allocator(Device::cpu());
}
int64_t bytes(Category c) {
  return cpu_alloc().stats().cat_bytes(c).current;
}

// Sum of the allocator blocks held by the saved tensors of the graph behind `root`,
// counting each storage once and leaving out parameters and inputs (they are not
// activations even when saved).
int64_t saved_activation_bytes(const Tensor& root) {
  std::unordered_set<const void*> storages;
  std::unordered_set<autograd::Node*> seen;
  std::vector<autograd::Node*> stack{root.autograd_meta()->grad_fn.get()};
  int64_t total = 0;
  while (!stack.empty()) {
    autograd::Node* n = stack.back();
    stack.pop_back();
    if (!n || !seen.insert(n).second) continue;
    for (const SavedTensor* s : n->saved_tensors()) {
      const Tensor& t = s->held();
      if (!t.defined() || !storages.insert(t.storage().key()).second) continue;
      const Category c = t.storage().category();
      if (c == Category::parameter || c == Category::input) continue;
      EXPECT_EQ(c, Category::activation)
          << n->name() << " saved a " << memory::category_name(c) << " block";
      total += static_cast<int64_t>(t.storage().block_bytes());
    }
    for (const autograd::Edge& e : n->next_edges) stack.push_back(e.fn.get());
  }
  return total;
}

Tensor param(const Shape& shape, uint64_t seed, double scale) {
  memory::CategoryScope c(Category::parameter);
  Generator g(seed);
  Tensor t = ops::mul(ops::randn(shape, DType::float32, Device::cpu(), &g), scale);
  t.requires_grad_(true);
  return t;
}

int64_t block_bytes(const TensorList& ts) {
  int64_t n = 0;
  for (const Tensor& t : ts) n += static_cast<int64_t>(t.storage().block_bytes());
  return n;
}

void check_step(const TensorList& params, const std::function<Tensor()>& forward) {
  const int64_t act0 = bytes(Category::activation), grad0 = bytes(Category::gradient);
  cpu_alloc().reset_peak_memory_stats();
  Tensor loss = forward();
  const int64_t act = bytes(Category::activation) - act0;
  EXPECT_GT(act, 0);
  EXPECT_EQ(act, saved_activation_bytes(loss)) << "activation bytes == bytes held by saved tensors";
  loss.backward();
  EXPECT_EQ(bytes(Category::activation), act0) << "no activation left after backward";
  EXPECT_EQ(bytes(Category::gradient) - grad0, block_bytes(params)) << "gradient == parameters";
  for (const Tensor& p : params) EXPECT_EQ(p.grad().storage().category(), Category::gradient);
  const auto& s = cpu_alloc().stats();
  EXPECT_EQ(s.category_at_peak[static_cast<size_t>(Category::unknown)], 0) << "unknown at the peak";
  EXPECT_GT(s.category_at_peak[static_cast<size_t>(Category::activation)], 0);
}

TEST(MemoryInvariants, Mlp) {
  const TensorList params = {param({64, 32}, 1, 0.2), param({64}, 2, 0.1), param({10, 64}, 3, 0.2),
                             param({10}, 4, 0.1)};
  Tensor x, y;
  {
    memory::CategoryScope c(Category::input);
    x = ops::randn({16, 32});
    y = ops::randint(0, 10, {16});
  }
  check_step(params, [&] {
    memory::PhaseScope ph("forward");
    const Tensor h = gelu(linear(x, params[0], params[1]));
    const Tensor h2 = dropout(h, 0.1);
    return cross_entropy(linear(h2, params[2], params[3]), y);
  });
}

TEST(MemoryInvariants, Cnn) {
  const TensorList params = {param({8, 3, 3, 3}, 5, 0.3), param({8}, 6, 0.1),
                             param({8}, 7, 0.1),          param({16, 8, 3, 3}, 8, 0.2),
                             param({10, 16}, 9, 0.2),     param({10}, 10, 0.1)};
  Tensor running_mean = ops::zeros({8}), running_var = ops::ones({8});
  Tensor x, y;
  {
    memory::CategoryScope c(Category::input);
    x = ops::randn({4, 3, 16, 16});
    y = ops::randint(0, 10, {4});
  }
  check_step(params, [&] {
    Tensor h = conv2d(x, params[0], {}, {1, 1}, {1, 1});
    h = relu(batch_norm(h, running_mean, running_var, params[1], params[2], /*training=*/true));
    h = max_pool2d(h, 2);
    h = relu(conv2d(h, params[3], {}, {2, 2}, {1, 1}));
    h = adaptive_avg_pool2d(h, {1, 1}).flatten(1);
    return cross_entropy(linear(h, params[4], params[5]), y);
  });
}

}  // namespace
}  // namespace tally
