// A two-layer network built from raw differentiable ops, trained with a hand-written SGD
// update on a synthetic problem it cannot solve by chance: three interleaved spirals.
#include <cmath>

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

}  // namespace
}  // namespace tally
