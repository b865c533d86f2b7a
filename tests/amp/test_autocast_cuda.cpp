// Autocast and checkpointing on CUDA (label gpu: skipped without a device), float16 and
// bfloat16: the per-op dtypes, the same network's loss and float32 gradients on the GPU
// against the CPU run under the same autocast settings and against float32, the weight
// cache in the CUDA allocator's `autocast_cache` category, and checkpointed gradients equal
// to plain ones on the GPU (to 1e-3: cuDNN/cuBLAS may pick non-deterministic algorithms;
// the CPU test checks bitwise equality).
#include <cmath>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "memory/memory.h"
#include "nn/checkpoint.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using memory::Category;
using testing::close_scaled;
using testing::kGpu;

constexpr DType kAmpDtypes[] = {DType::float16, DType::bfloat16};

Tensor rnd(const Shape& s, double scale, uint64_t seed, Device d, bool grad = false) {
  Generator g(seed);
  Tensor t =
      ops::to(ops::mul(ops::randn(s, DType::float32, Device::cpu(), &g), scale), d, DType::float32);
  if (grad) t.requires_grad_(true);
  return t;
}

struct Net {
  TensorList ps;
  Net(Device d) {
    ps = {rnd({6, 3, 3, 3}, 0.3, 1, d, true), rnd({6}, 0.1, 2, d, true),
          rnd({6 * 4 * 4}, 1.0, 3, d, true),  rnd({32, 6 * 4 * 4}, 0.1, 4, d, true),
          rnd({32}, 0.1, 5, d, true),         rnd({5, 32}, 0.2, 6, d, true)};
  }
  Tensor features(const Tensor& x) const {
    Tensor h = relu(conv2d(x, ps[0], ps[1], {1, 1}, {1, 1}));
    // Average pooling: under bf16 rounding, max pooling has tied maxima that the CPU and CUDA
    // kernels may route to different (equally valid) inputs; this test is about autocast.
    h = avg_pool2d(h, {2, 2});
    return layer_norm(h.flatten(1), {6 * 4 * 4}, ps[2]);  // every parameter gets a gradient
  }
  Tensor loss(const Tensor& x, const Tensor& y, bool ckpt = false) const {
    Tensor h =
        ckpt ? nn::checkpoint([this](const Tensor& t) { return features(t); }, x) : features(x);
    h = gelu(linear(h, ps[3], ps[4]));
    return cross_entropy(linear(h, ps[5]), y);
  }
};

TEST(AutocastCuda, OpDtypes) {
  REQUIRE_GPU();
  for (DType dt : kAmpDtypes) {
    AutocastGuard guard(DeviceType::cuda, dt);
    EXPECT_FALSE(is_autocast_enabled(DeviceType::cpu));
    const Tensor x = rnd({4, 8}, 1.0, 1, kGpu), w = rnd({6, 8}, 0.3, 2, kGpu, true);
    const Tensor h = linear(x, w);
    EXPECT_EQ(h.dtype(), dt);
    EXPECT_EQ(matmul(x, w.t()).dtype(), dt);
    EXPECT_EQ(conv2d(rnd({1, 3, 5, 5}, 1.0, 3, kGpu), rnd({2, 3, 3, 3}, 0.3, 4, kGpu)).dtype(), dt);
    EXPECT_EQ(scaled_dot_product_attention(rnd({2, 4, 8}, 1, 5, kGpu), rnd({2, 4, 8}, 1, 6, kGpu),
                                           rnd({2, 4, 8}, 1, 7, kGpu), Tensor(), 0.0, true)
                  .dtype(),
              dt);
    EXPECT_EQ(softmax(h, -1).dtype(), DType::float32);
    EXPECT_EQ(layer_norm(h, {6}).dtype(), DType::float32);
    EXPECT_EQ(sum(h).dtype(), DType::float32);
    // CPU tensors are not affected by a CUDA region.
    EXPECT_EQ(
        linear(ops::to(x, Device::cpu(), DType::float32), ops::to(w, Device::cpu(), DType::float32))
            .dtype(),
        DType::float32);
  }
}

TEST(AutocastCuda, GpuMatchesCpuUnderTheSameAutocast) {
  REQUIRE_GPU();
  const Tensor xc = rnd({8, 3, 8, 8}, 1.0, 10, Device::cpu());
  const Tensor yc =
      from_vector({0, 1, 2, 3, 4, 0, 1, 2}, {8}, TensorOptions{}.with_dtype(DType::int64));
  for (DType dt : kAmpDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    Net cpu(Device::cpu()), gpu(kGpu), ref(Device::cpu());
    Tensor lc, lg, lr;
    {
      AutocastGuard g1(DeviceType::cpu, dt);
      lc = cpu.loss(xc, yc);
    }
    {
      AutocastGuard g2(DeviceType::cuda, dt);
      lg = gpu.loss(testing::to_gpu(xc), testing::to_gpu(yc));
    }
    lr = ref.loss(xc, yc);
    lc.backward();
    lg.backward();
    lr.backward();
    EXPECT_TRUE(close_scaled(lg, lc, 2e-2));
    EXPECT_TRUE(close_scaled(lg, lr, 3e-2));
    for (size_t i = 0; i < gpu.ps.size(); ++i) {
      SCOPED_TRACE(i);
      ASSERT_EQ(gpu.ps[i].grad().dtype(), DType::float32);
      EXPECT_TRUE(close_scaled(gpu.ps[i].grad(), cpu.ps[i].grad(), 5e-2));
      EXPECT_TRUE(close_scaled(gpu.ps[i].grad(), ref.ps[i].grad(), 5e-2));
    }
  }
}

TEST(AutocastCuda, WeightCacheInTheCudaAllocator) {
  REQUIRE_GPU();
  memory::CachingAllocator& a = memory::get_allocator(kGpu);
  const Tensor w = rnd({256, 256}, 0.05, 1, kGpu, true), x = rnd({4, 256}, 1.0, 2, kGpu);
  const int64_t before =
      a.stats().category_blocks[static_cast<size_t>(Category::autocast_cache)].allocated;
  {
    AutocastGuard guard(DeviceType::cuda, DType::float16);
    Tensor h = linear(relu(linear(x, w)), w);
    EXPECT_EQ(
        a.stats().category_blocks[static_cast<size_t>(Category::autocast_cache)].allocated - before,
        1);
    EXPECT_GE(a.stats().cat_bytes(Category::autocast_cache).current, 256 * 256 * 2);
  }
  EXPECT_EQ(a.stats().cat_bytes(Category::autocast_cache).current, 0);
}

TEST(AutocastCuda, CheckpointMatchesPlainUnderAutocast) {
  REQUIRE_GPU();
  const Tensor x = rnd({8, 3, 8, 8}, 1.0, 10, kGpu);
  const Tensor y = testing::to_gpu(
      from_vector({0, 1, 2, 3, 4, 0, 1, 2}, {8}, TensorOptions{}.with_dtype(DType::int64)));
  for (DType dt : kAmpDtypes) {
    Net net(kGpu);
    TensorList grads[2];
    for (int ckpt = 0; ckpt < 2; ++ckpt) {
      for (const Tensor& p : net.ps) p.set_grad(Tensor());
      Tensor l;
      {
        AutocastGuard guard(DeviceType::cuda, dt);
        l = net.loss(x, y, ckpt == 1);
      }
      l.backward();
      for (const Tensor& p : net.ps) grads[ckpt].push_back(p.grad());
    }
    for (size_t i = 0; i < grads[0].size(); ++i)
      EXPECT_TRUE(close_scaled(grads[1][i], grads[0][i], 1e-3)) << dtype_name(dt) << " param " << i;
  }
}

// linear's weight gradient under autocast comes from the GEMM in float32 (the cached cast
// declares a float32 gradient): cuBLAS's mixed GEMM of the 16-bit operands, the CPU's product
// of the same operands to float32 precision, not rounded to 16 bits. The prefilled casts
// (autocast::cache_casts: one launch) give the lazy casts' gradients to the bit.
TEST(AutocastCuda, WeightGradientsAreFloat32Products) {
  REQUIRE_GPU();
  for (DType d : kAmpDtypes) {
    SCOPED_TRACE(dtype_name(d));
    TensorList grads;
    for (bool prefill : {false, true}) {
      const Tensor w = rnd({48, 64}, 0.1, 11, kGpu, true), b = rnd({48}, 0.1, 12, kGpu, true);
      const Tensor x = rnd({512, 64}, 1.0, 13, kGpu), g = rnd({512, 48}, 1.0, 14, kGpu);
      {
        AutocastGuard guard(DeviceType::cuda, d);
        if (prefill) autocast::cache_casts({w, b});
        sum(mul(linear(x, w, b), g)).backward();
      }
      ASSERT_EQ(w.grad().dtype(), DType::float32);
      // The reference: the 16-bit operands' product in float64 on the CPU.
      const Tensor g16 = ops::to(ops::to(g, d), Device::cpu(), DType::float64);
      const Tensor x16 = ops::to(ops::to(x, d), Device::cpu(), DType::float64);
      const Tensor ref = ops::mm(ops::transpose(g16, 0, 1), x16);
      EXPECT_TRUE(close_scaled(w.grad(), ref, 1e-5));
      grads.push_back(ops::to(w.grad(), Device::cpu(), DType::float32));
    }
    EXPECT_EQ(ops::to_vector(grads[0]), ops::to_vector(grads[1]));
  }
}

}  // namespace
}  // namespace tally
