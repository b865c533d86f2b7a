// Activation offload on the GPU (autograd/offload.h): a GPT-tiny and a ResNet-tiny step with
// every block offloaded give the gradients of the step without it; the saved activations
// leave the device (the device's activation bytes after the forward fall, pinned host memory
// holds them as `offloaded`), backward prefetches, and pageable memory works too. Skips
// without a device.
#include <gtest/gtest.h>

#include <cmath>

#include "autograd/offload.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "nn/offload.h"
#include "tensor/pinned.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using memory::Category;
using testing::kGpu;

double rel_err(const Tensor& a, const Tensor& b) {
  const auto x = ops::to_vector(ops::to(a, Device::cpu(), DType::float64));
  const auto y = ops::to_vector(ops::to(b, Device::cpu(), DType::float64));
  if (x.size() != y.size()) return INFINITY;
  double d = 0, n = 0;
  for (size_t i = 0; i < x.size(); ++i) d += (x[i] - y[i]) * (x[i] - y[i]), n += y[i] * y[i];
  return n > 0 ? std::sqrt(d / n) : std::sqrt(d);
}

int64_t now(memory::CachingAllocator& a, Category c) {
  return a.stats().category_bytes[static_cast<size_t>(c)].current;
}

struct StepResult {
  std::vector<Tensor> grads;
  int64_t device_activation_after_forward = 0;
  int64_t pinned_offloaded_after_forward = 0;
  OffloadStats stats;
};

StepResult step(const std::string& model, const std::string& offload, bool pin = true,
                size_t max_inflight = OffloadOptions{}.max_inflight_bytes) {
  manual_seed(0);
  std::shared_ptr<nn::Module> m;
  std::shared_ptr<nn::GPT> gpt;
  if (model == "gpt") {
    gpt = std::make_shared<nn::GPT>(nn::GPTConfig::preset("tiny"));
    m = gpt;
  } else {
    m = nn::resnet_tiny({.num_classes = 10});
  }
  m->to(kGpu);
  auto off = nn::offload_activations(
      *m, nn::parse_offload_spec(offload),
      OffloadOptions{.pin_memory = pin, .max_inflight_bytes = max_inflight});
  memory::CachingAllocator& dev = memory::get_allocator(kGpu);
  memory::CachingAllocator& host = memory::get_pinned_allocator();
  const int64_t act0 = now(dev, Category::activation);
  const int64_t off0 = now(host, Category::offloaded);
  Tensor loss;
  if (gpt) {
    const Tensor x = ops::randint(0, 256, {4, 64}, DType::int64, kGpu);
    loss = (*gpt)(x, x).second;
  } else {
    const Tensor x = ops::randn({8, 3, 32, 32}, DType::float32, kGpu);
    const Tensor y = ops::randint(0, 10, {8}, DType::int64, kGpu);
    loss = cross_entropy((*m)(x), y);
  }
  StepResult r;
  r.device_activation_after_forward = now(dev, Category::activation) - act0;
  r.pinned_offloaded_after_forward = now(host, Category::offloaded) - off0;
  loss.backward();
  memory::synchronize(kGpu);
  if (off) r.stats = off->stats();
  for (const Tensor& p : m->parameters()) r.grads.push_back(p.grad().clone());
  return r;
}

class OffloadCuda : public ::testing::TestWithParam<std::string> {};

TEST_P(OffloadCuda, SameGradientsActivationsLeaveTheDeviceAndArePrefetched) {
  REQUIRE_GPU();
  ASSERT_TRUE(memory::pinned_memory_available());
  const StepResult base = step(GetParam(), "none");
  const StepResult off = step(GetParam(), "activations");
  ASSERT_EQ(off.grads.size(), base.grads.size());
  // GPT's kernels are deterministic; cuDNN may time and pick another convolution algorithm
  // (TF32) for the second run when other processes load the GPU.
  const double tol = GetParam() == "gpt" ? 1e-6 : 5e-3;
  for (size_t i = 0; i < base.grads.size(); ++i)
    EXPECT_LE(rel_err(off.grads[i], base.grads[i]), tol) << "parameter " << i;
  EXPECT_GT(base.device_activation_after_forward, 0);
  EXPECT_LT(off.device_activation_after_forward, base.device_activation_after_forward / 4)
      << off.device_activation_after_forward << " vs " << base.device_activation_after_forward;
  EXPECT_GT(off.pinned_offloaded_after_forward, 0);
  EXPECT_EQ(off.pinned_offloaded_after_forward % 512, 0);
  EXPECT_GT(off.stats.tensors_prefetched, 0);
  EXPECT_EQ(off.stats.tensors_prefetched + off.stats.tensors_fetched, off.stats.tensors_offloaded);
}

INSTANTIATE_TEST_SUITE_P(Models, OffloadCuda, ::testing::Values("gpt", "resnet"));

// Copies in flight are bounded: with a bound of one byte the forward waits for every copy
// but the newest, and the step computes the same gradients; a tiny model's step stays under
// the default bound (1 GiB) and never waits.
TEST(OffloadCudaBound, TheForwardWaitsForCopiesPastTheBound) {
  REQUIRE_GPU();
  const StepResult base = step("gpt", "none");
  const StepResult bounded = step("gpt", "activations", true, 1);
  const StepResult free_run = step("gpt", "activations");
  for (size_t i = 0; i < base.grads.size(); ++i)
    EXPECT_LE(rel_err(bounded.grads[i], base.grads[i]), 1e-6) << "parameter " << i;
  EXPECT_EQ(bounded.stats.copy_waits, bounded.stats.tensors_offloaded - 1);
  EXPECT_EQ(free_run.stats.copy_waits, 0);
}

TEST(OffloadCudaPageable, PageableHostMemoryGivesTheSameGradients) {
  REQUIRE_GPU();
  const StepResult base = step("gpt", "none");
  const StepResult off = step("gpt", "activations", /*pin=*/false);
  for (size_t i = 0; i < base.grads.size(); ++i)
    EXPECT_LE(rel_err(off.grads[i], base.grads[i]), 1e-6) << "parameter " << i;
  EXPECT_EQ(off.pinned_offloaded_after_forward, 0);  // pageable: the CPU allocator holds them
  EXPECT_GT(off.stats.bytes_offloaded, 0);
}

TEST(OffloadCudaCopies, HostRoundTripThroughTheCopyStreamKeepsValues) {
  REQUIRE_GPU();
  const Tensor x = ops::randn({1 << 20}, DType::float32, kGpu);
  const Tensor h = ops::to_host_async(x, Category::offloaded);
  EXPECT_TRUE(ops::is_pinned(h));
  const Tensor back = ops::to_device_on_copy_stream(h, kGpu, Category::activation);
  ops::CopyFence::record(kGpu).wait();
  EXPECT_EQ(rel_err(back, x), 0.0);
}

}  // namespace
}  // namespace tally
