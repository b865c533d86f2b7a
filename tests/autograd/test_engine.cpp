// The autograd engine: gradient accumulation, retain_graph and freeing of saved tensors,
// hooks and autograd::grad, the saved-tensor version check, the activation tag of saved
// tensors, and saved-tensor pack/unpack hooks (what offloading builds on).
#include "testing/gradcheck.h"

namespace tally {
namespace {

using namespace testing;

TEST(Autograd, AccumulatesRetainsAndFrees) {
  const Tensor w = from_vector({1, 2, 3}, {3}, TensorOptions{}.with_requires_grad());
  Tensor y = (w * w).sum();
  y.backward({}, /*retain_graph=*/true);
  EXPECT_TRUE(values_near(w.grad(), {2, 4, 6}));
  y.backward();  // accumulates
  EXPECT_TRUE(values_near(w.grad(), {4, 8, 12}));
  EXPECT_THROW(y.backward(), std::runtime_error);  // saved tensors freed
  EXPECT_TRUE(w.is_leaf());
  EXPECT_FALSE(y.is_leaf());
  {
    NoGradGuard ng;
    EXPECT_FALSE((w * 2.0).requires_grad());
    EnableGradGuard eg;
    EXPECT_TRUE((w * 2.0).requires_grad());
  }
  EXPECT_FALSE(w.detach().requires_grad());
  EXPECT_THROW(zeros({2}).sum().backward(), std::runtime_error);
  EXPECT_THROW((w * 2.0).backward(), std::runtime_error);  // non-scalar
}

TEST(Autograd, HooksAndAutogradGrad) {
  const Tensor x = from_vector({1, 2}, {2}, TensorOptions{}.with_requires_grad());
  const Tensor h = x * 3.0;
  h.register_hook([](const Tensor& g) { return ops::mul(g, 10.0); });
  x.register_hook([](const Tensor& g) { return ops::add(g, 1.0); });
  (h * h).sum().backward();
  // d/dx (3x)^2 = 18x, times 10 from the hook on h, plus 1 from the hook on x
  EXPECT_TRUE(values_near(x.grad(), {181, 361}));
  const Tensor z = from_vector({2, 3}, {2}, TensorOptions{}.with_requires_grad());
  const TensorList g = autograd::grad({(z * z * z).sum()}, {z});
  EXPECT_TRUE(values_near(g[0], {12, 27}));
  EXPECT_FALSE(z.grad().defined());  // autograd::grad leaves .grad alone
}

TEST(Autograd, InPlaceModificationOfSavedTensorIsAnError) {
  const Tensor x = from_vector({1, 2}, {2}, TensorOptions{}.with_requires_grad());
  Tensor e = exp(x);  // saves its output
  Tensor y = (e * 1.0).sum();
  ops::fill_(e, 0.0);  // modifies what ExpBackward saved
  try {
    y.backward();
    FAIL();
  } catch (const std::runtime_error& err) {
    EXPECT_NE(std::string(err.what()).find("modified by an in-place operation"), std::string::npos)
        << err.what();
  }
}

TEST(Autograd, SavedTensorsAreTaggedActivationAndReleased) {
  auto& alloc = memory::get_allocator(Device::cpu());
  auto cat = [&](memory::Category c) { return alloc.stats().cat_bytes(c).current; };
  const int64_t act0 = cat(memory::Category::activation);
  const Tensor w = rand_input({256, 256}, -1, 1, 3);
  Tensor h = tanh(w * 2.0);     // tanh saves its output: 512 KiB
  Tensor loss = (h * h).sum();  // mul saves h (the same block)
  EXPECT_EQ(cat(memory::Category::activation) - act0, 256 * 256 * 8);
  EXPECT_EQ(h.storage().category(), memory::Category::activation);
  loss.backward();
  EXPECT_EQ(cat(memory::Category::activation), act0);  // released after backward
  EXPECT_EQ(h.storage().category(), memory::Category::temporary);
  EXPECT_EQ(w.grad().storage().category(), memory::Category::gradient);
}

// A leaf's gradient is `gradient` from the moment its producer returns it, though its
// AccumulateGrad runs last (issue 54: a peak inside backward showed gradient 0); a gradient
// that autograd::grad returns to its caller stays `temporary`.
TEST(Autograd, LeafGradientIsTaggedGradientDuringBackward) {
  auto& alloc = memory::get_allocator(Device::cpu());
  auto cat = [&](memory::Category c) { return alloc.stats().cat_bytes(c).current; };
  const Tensor p = rand_input({64}, -1, 1, 6), w = rand_input({64}, -1, 1, 7);
  const Tensor q = p * 3.0;  // its node runs after the one that computes w's gradient
  int64_t during = -1;
  q.register_hook([&](const Tensor& g) {
    during = cat(memory::Category::gradient);
    return g;
  });
  const int64_t grad0 = cat(memory::Category::gradient);
  (q * w).sum().backward();
  EXPECT_GE(during - grad0, 64 * 8);  // w's gradient, not yet in w.grad()
  EXPECT_EQ(w.grad().storage().category(), memory::Category::gradient);
  EXPECT_EQ(p.grad().storage().category(), memory::Category::gradient);
  EXPECT_TRUE(values_near(w.grad(), q.detach().tolist(), 1e-12));

  const TensorList g = autograd::grad({(q.detach() * w).sum()}, {w});
  EXPECT_EQ(g[0].storage().category(), memory::Category::temporary);
}

// A backward that hands one gradient to two leaves (add's, add_relu's) gives each its own
// .grad: were the two one buffer, a second backward would accumulate into both twice.
TEST(Autograd, OneGradientForTwoLeavesIsTwoGrads) {
  for (const bool fused : {false, true}) {
    const Tensor a = rand_input({3}, 0.5, 1, 4), b = rand_input({3}, 0.5, 1, 5);
    for (int pass = 0; pass < 2; ++pass) (fused ? add_relu(a, b) : add(a, b)).sum().backward();
    EXPECT_NE(a.grad().data_ptr(), b.grad().data_ptr()) << (fused ? "add_relu" : "add");
    EXPECT_EQ(a.grad().tolist(), std::vector<double>(3, 2.0)) << (fused ? "add_relu" : "add");
    EXPECT_EQ(b.grad().tolist(), std::vector<double>(3, 2.0)) << (fused ? "add_relu" : "add");
  }
}

TEST(SavedTensorHooks, PackAndUnpackReplaceWhatIsKept) {
  // Offload-style hooks: pack keeps a float64 host copy, unpack returns it. Nothing is
  // tagged activation, and backward still gets the right values.
  int packed = 0, unpacked = 0;
  const Tensor x = testing::rand_input({32, 32}, -1, 1, 21);
  auto& alloc = memory::get_allocator(Device::cpu());
  const int64_t act0 = alloc.stats().cat_bytes(memory::Category::activation).current;
  Tensor y;
  {
    SavedTensorHooksScope hooks({[&](const Tensor& t) -> std::any {
                                   ++packed;
                                   return ops::clone(t);
                                 },
                                 [&](const std::any& a) -> Tensor {
                                   ++unpacked;
                                   return std::any_cast<Tensor>(a);
                                 }});
    y = tanh(x * 3.0).sum();  // tanh saves its output through the hooks
  }
  EXPECT_EQ(packed, 1);
  EXPECT_EQ(alloc.stats().cat_bytes(memory::Category::activation).current, act0);
  y.backward();
  EXPECT_EQ(unpacked, 1);
  const Tensor ref = testing::rand_input({32, 32}, -1, 1, 21);
  tanh(ref * 3.0).sum().backward();
  EXPECT_TRUE(testing::values_near(x.grad(), ref.grad().tolist(), 1e-12));
}

TEST(SavedTensorHooks, NestedScopesUseTheInnermost) {
  int outer = 0, inner = 0;
  auto make = [](int& n) {
    return SavedTensorHooks{[&n](const Tensor& t) -> std::any {
                              ++n;
                              return t;
                            },
                            [](const std::any& a) { return std::any_cast<Tensor>(a); }};
  };
  const Tensor x = testing::rand_input({4}, -1, 1, 22);
  SavedTensorHooksScope a(make(outer));
  {
    SavedTensorHooksScope b(make(inner));
    (void)exp(x);
  }
  (void)exp(x);
  EXPECT_EQ(inner, 1);
  EXPECT_EQ(outer, 1);
}

}  // namespace
}  // namespace tally
