// A two-layer network built from raw differentiable ops, trained with a hand-written SGD
// update on a synthetic problem it cannot solve by chance: three interleaved spirals. And the
// out-of-memory path of training on a capped allocator (also run under ASan by .ci/run).
#include <cmath>

#include "memory/memory.h"
#include "tensor/reduce/autograd.h"
#include "tensor/softmax/autograd.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

TEST(Training, TwoLayerNetworkLearnsSpirals) {
  constexpr int kClasses = 3, kPerClass = 60, kHidden = 64;
  std::vector<double> xs, ys;
  for (int c = 0; c < kClasses; ++c) {
    for (int i = 0; i < kPerClass; ++i) {
      const double r = static_cast<double>(i) / kPerClass;
      const double t = c * 4.0 + 4.0 * r + 0.2 * std::sin(i * 12.9898);  // deterministic jitter
      xs.push_back(r * std::sin(t));
      xs.push_back(r * std::cos(t));
      ys.push_back(c);
    }
  }
  const int64_t n = kClasses * kPerClass;
  const Tensor x = from_vector(xs, {n, 2});
  const Tensor y = from_vector(ys, {n}, TensorOptions{}.with_dtype(DType::int64));

  manual_seed(0);
  Tensor w1 = mul(randn({kHidden, 2}), 1.0).detach(), b1 = zeros({kHidden});
  Tensor w2 = mul(randn({kClasses, kHidden}), 0.1).detach(), b2 = zeros({kClasses});
  TensorList params = {w1, b1, w2, b2};
  for (Tensor& p : params) p.requires_grad_(true);

  auto loss_fn = [&] { return cross_entropy(linear(relu(linear(x, w1, b1)), w2, b2), y); };
  const double initial = loss_fn().item();
  EXPECT_NEAR(initial, std::log(3.0), 0.3);  // chance level
  const double lr = 1.0;
  double loss = initial;
  for (int step = 0; step < 400; ++step) {
    for (Tensor& p : params) p.set_grad(Tensor());
    Tensor l = loss_fn();
    l.backward();
    loss = l.item();
    NoGradGuard ng;
    for (Tensor& p : params) ops::add_(p, p.grad(), -lr);  // p -= lr * grad
  }
  EXPECT_LT(loss, 0.25) << "initial " << initial;
  NoGradGuard ng;
  const Tensor pred = argmax(linear(relu(linear(x, w1, b1)), w2, b2), 1);
  const double acc = ops::item(ops::mean(ops::to(eq(pred, y), DType::float32)));
  EXPECT_GT(acc, 0.9);
}

// A step too large for a memory cap fails with OutOfMemoryError and leaves the allocator
// usable: every byte of the failed step is returned, and training goes on at a smaller batch.
TEST(Training, OutOfMemoryOnACapThenASmallerBatchTrains) {
  constexpr int64_t kIn = 16, kHidden = 256, kClasses = 2;
  const Device cpu = Device::cpu();
  manual_seed(1);
  Tensor w1 = mul(randn({kHidden, kIn}), 0.25).detach(), b1 = zeros({kHidden});
  Tensor w2 = mul(randn({kClasses, kHidden}), 0.05).detach(), b2 = zeros({kClasses});
  TensorList params = {w1, b1, w2, b2};
  for (Tensor& p : params) p.requires_grad_(true);
  auto batch = [](int64_t b) {  // the class is whether x0 + x1 > 0
    const Tensor x = randn({b, kIn});
    const std::vector<double> v = ops::to_vector(x);
    std::vector<double> labels(static_cast<size_t>(b));
    for (size_t i = 0; i < labels.size(); ++i) labels[i] = v[i * kIn] + v[i * kIn + 1] > 0;
    return std::pair{x, from_vector(labels, {b}, TensorOptions{}.with_dtype(DType::int64))};
  };
  auto step = [&](int64_t b) {
    const auto [x, y] = batch(b);
    for (Tensor& p : params) p.set_grad(Tensor());
    Tensor l = cross_entropy(linear(relu(linear(x, w1, b1)), w2, b2), y);
    l.backward();
    NoGradGuard ng;
    for (Tensor& p : params) ops::add_(p, p.grad(), -0.2);
    return l.item();
  };
  step(64);
  for (Tensor& p : params) p.set_grad(Tensor());
  memory::CachingAllocator& alloc = memory::get_allocator(cpu);
  const size_t baseline = memory::memory_allocated(cpu);
  const double total = static_cast<double>(alloc.provider().total_memory());
  const size_t cap = memory::memory_reserved(cpu) + (size_t{16} << 20);
  memory::set_per_process_memory_fraction(static_cast<double>(cap) / total, cpu);
  memory::reset_peak_memory_stats(cpu);
  // Batch 65536: each [65536, 256] activation is 64 MiB, over the cap by itself.
  try {
    step(65536);
    ADD_FAILURE() << "a 64 MiB activation fit under a 16 MiB cap";
  } catch (const memory::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
  for (Tensor& p : params) p.set_grad(Tensor());
  EXPECT_EQ(memory::memory_allocated(cpu), baseline) << "the failed step's tensors are freed";
  EXPECT_GE(alloc.stats().num_ooms, 1);
  const double first = step(256);
  double last = first;
  for (int i = 0; i < 60; ++i) last = step(256);
  EXPECT_LT(last, 0.6 * first) << "training goes on after the out-of-memory error";
  EXPECT_LE(memory::max_memory_reserved(cpu), cap + (size_t{1} << 20)) << "the cap held";
  memory::set_per_process_memory_fraction(1.0, cpu);
}

}  // namespace
}  // namespace tally
