// The fused (flash) attention on CUDA against the CPU reference kernel (label gpu: skipped
// without a device), both CUDA routes of bfloat16/float16 (cuDNN's fused kernels where cuDNN
// takes the problem, and Tally's own FlashAttention-2 kernels): forward output and
// log-sum-exp, backward dQ, dK, dV, in bfloat16 and float16 (compared in float32 against the
// reference run in float32 on the same rounded values), causal and not, sequence lengths that are
// not multiples of the tiles (128 query rows forward, 64 keys backward), L != S (causal too), head
// dims 64, 128 and padded 8, 40, 120, long sequences with large scores, many (batch, head) pairs,
// GPT's strided split-head views; scaled_dot_product_attention's routing to the fused path; and the
// memory: no T x T matrix during a causal forward + backward.
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "tensor/attention/autograd.h"
#include "tensor/attention/cuda.h"
#include "tensor/attention/ops.h"
#include "tensor/cuda/runtime.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using testing::close_scaled;
using testing::kCpu;
using testing::kGpu;
using testing::rand_tensor;
using testing::saved_by;
using testing::to_gpu;

struct Case {
  int64_t B, H, L, S, E;
  bool causal;
};

const Case kCases[] = {
    {2, 3, 64, 64, 64, false},    // one tile
    {2, 3, 130, 130, 64, true},   // T not a multiple of 64
    {1, 2, 77, 77, 128, false},   // head dim 128, partial tile
    {1, 2, 200, 200, 128, true},  // causal, head dim 128
    {2, 2, 50, 190, 64, false},   // L != S
    {1, 3, 100, 100, 40, true},   // head dim padded to 64
    {8, 24, 64, 64, 64, true},    // B * H many
    {1, 1, 1, 1, 64, true},       // a single row
    // Several 128-row forward tiles and 64-key backward tiles, none of them full.
    {1, 2, 300, 300, 64, true},    // causal: skipped, diagonal and partial tiles
    {2, 1, 257, 257, 128, true},   // head dim 128, one row past a 128-row tile
    {1, 2, 70, 333, 128, false},   // L < S, partial key tiles
    {1, 1, 333, 70, 64, false},    // L > S: warps past the last key tile
    {1, 2, 200, 90, 64, true},     // causal with L > S (top-left mask)
    {1, 2, 90, 200, 64, true},     // causal with L < S: keys no query sees
    {1, 2, 96, 96, 8, true},       // the smallest head dim
    {1, 1, 129, 129, 120, false},  // head dim 120 padded to 128
};

// Low-precision inputs on the GPU and the same values in float32 on the CPU.
struct Inputs {
  Tensor q, k, v, qf, kf, vf;
};

Inputs make_inputs(const Case& c, DType d, uint64_t seed) {
  Inputs in;
  const Tensor q = rand_tensor({c.B, c.H, c.L, c.E}, d, seed, -2, 2);
  const Tensor k = rand_tensor({c.B, c.H, c.S, c.E}, d, seed + 1, -2, 2);
  const Tensor v = rand_tensor({c.B, c.H, c.S, c.E}, d, seed + 2, -2, 2);
  in.q = to_gpu(q);
  in.k = to_gpu(k);
  in.v = to_gpu(v);
  in.qf = ops::to(q, DType::float32);
  in.kf = ops::to(k, DType::float32);
  in.vf = ops::to(v, DType::float32);
  return in;
}

std::string describe(const Case& c, DType d) {
  return fmt::format("[{}, {}, {}/{}, {}] causal {} {}", c.B, c.H, c.L, c.S, c.E, c.causal,
                     dtype_name(d));
}

Tensor f32_cpu(const Tensor& t) {
  return ops::to(t, kCpu, DType::float32);
}

// Selects the bfloat16/float16 route for a scope (cuDNN's kernels or Tally's own).
class Route {
 public:
  explicit Route(bool cudnn) : saved_(cuda::cudnn_sdp_enabled()) {
    cuda::set_cudnn_sdp_enabled(cudnn);
  }
  ~Route() { cuda::set_cudnn_sdp_enabled(saved_); }
  Route(const Route&) = delete;
  Route& operator=(const Route&) = delete;

 private:
  bool saved_;
};

// Both routes, or only Tally's kernels when the process starts with TALLY_CUDNN_SDP=0 (the
// racecheck run: it checks Tally's kernels, not cuDNN's).
std::vector<bool> routes() {
  if (!cuda::cudnn_sdp_enabled()) return {false};
  return {true, false};
}

const char* route_name(bool cudnn) {
  return cudnn ? "cuDNN route" : "Tally kernels";
}

TEST(CudaFlashAttention, ForwardMatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (const bool cudnn : routes()) {
    const Route route(cudnn);
    SCOPED_TRACE(route_name(cudnn));
    for (const Case& c : kCases) {
      for (const DType d : {DType::bfloat16, DType::float16}) {
        const Inputs in = make_inputs(c, d, seed += 3);
        const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
        const ops::FlashAttentionOutput g =
            ops::flash_attention_forward(in.q, in.k, in.v, c.causal, scale);
        const ops::FlashAttentionOutput r =
            ops::flash_attention_forward(in.qf, in.kf, in.vf, c.causal, scale);
        EXPECT_EQ(g.out.device(), kGpu);
        EXPECT_EQ(g.out.dtype(), d);
        EXPECT_EQ(g.out.sizes(), r.out.sizes());
        EXPECT_EQ(g.lse.dtype(), DType::float32);
        EXPECT_TRUE(close_scaled(f32_cpu(g.out), r.out, 1e-2)) << describe(c, d);
        // lse is a float32 sum of exponentials of scores from 16-bit inputs: 1e-3 relative.
        EXPECT_TRUE(close_scaled(f32_cpu(g.lse), r.lse, 1e-3)) << describe(c, d);
      }
    }
  }
}

TEST(CudaFlashAttention, BackwardMatchesTheCpu) {
  REQUIRE_GPU();
  uint64_t seed = 200;
  for (const bool cudnn : routes()) {
    const Route route(cudnn);
    SCOPED_TRACE(route_name(cudnn));
    for (const Case& c : kCases) {
      for (const DType d : {DType::bfloat16, DType::float16}) {
        const Inputs in = make_inputs(c, d, seed += 4);
        const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
        const Tensor dout = rand_tensor({c.B, c.H, c.L, c.E}, d, seed + 3, -1, 1);
        const ops::FlashAttentionOutput g =
            ops::flash_attention_forward(in.q, in.k, in.v, c.causal, scale);
        // The reference backward from the GPU's own (rounded) output and lse, so that only the
        // backward kernel is under test.
        const ops::FlashAttentionGrads gg = ops::flash_attention_backward(
            to_gpu(dout), in.q, in.k, in.v, g.out, g.lse, c.causal, scale);
        const ops::FlashAttentionGrads rr =
            ops::flash_attention_backward(ops::to(dout, DType::float32), in.qf, in.kf, in.vf,
                                          f32_cpu(g.out), f32_cpu(g.lse), c.causal, scale);
        EXPECT_EQ(gg.dq.dtype(), d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dq), rr.dq, 2e-2)) << "dq " << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dk), rr.dk, 2e-2)) << "dk " << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dv), rr.dv, 2e-2)) << "dv " << describe(c, d);
      }
    }
  }
}

// Many tiles with large scores (inputs in [-4, 4] and a scale of 1: the online softmax
// rescales often), forward and backward against the CPU in float32.
TEST(CudaFlashAttention, LongSequencesWithLargeScores) {
  REQUIRE_GPU();
  const Case cases[] = {{1, 2, 1024, 1024, 64, true}, {1, 1, 640, 640, 128, false}};
  uint64_t seed = 500;
  for (const bool cudnn : routes()) {
    const Route route(cudnn);
    SCOPED_TRACE(route_name(cudnn));
    for (const Case& c : cases) {
      for (const DType d : {DType::bfloat16, DType::float16}) {
        const Tensor q = rand_tensor({c.B, c.H, c.L, c.E}, d, seed += 5, -4, 4);
        const Tensor k = rand_tensor({c.B, c.H, c.S, c.E}, d, seed + 1, -4, 4);
        const Tensor v = rand_tensor({c.B, c.H, c.S, c.E}, d, seed + 2, -2, 2);
        const Tensor dout = rand_tensor({c.B, c.H, c.L, c.E}, d, seed + 3, -1, 1);
        const double scale = 1.0 / 4;
        const ops::FlashAttentionOutput g =
            ops::flash_attention_forward(to_gpu(q), to_gpu(k), to_gpu(v), c.causal, scale);
        const Tensor qf = ops::to(q, DType::float32), kf = ops::to(k, DType::float32),
                     vf = ops::to(v, DType::float32);
        const ops::FlashAttentionOutput r =
            ops::flash_attention_forward(qf, kf, vf, c.causal, scale);
        EXPECT_TRUE(close_scaled(f32_cpu(g.out), r.out, 1e-2)) << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(g.lse), r.lse, 1e-3)) << describe(c, d);
        const ops::FlashAttentionGrads gg = ops::flash_attention_backward(
            to_gpu(dout), to_gpu(q), to_gpu(k), to_gpu(v), g.out, g.lse, c.causal, scale);
        const ops::FlashAttentionGrads rr =
            ops::flash_attention_backward(ops::to(dout, DType::float32), qf, kf, vf, f32_cpu(g.out),
                                          f32_cpu(g.lse), c.causal, scale);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dq), rr.dq, 3e-2)) << "dq " << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dk), rr.dk, 3e-2)) << "dk " << describe(c, d);
        EXPECT_TRUE(close_scaled(f32_cpu(gg.dv), rr.dv, 2e-2)) << "dv " << describe(c, d);
      }
    }
  }
}

TEST(CudaFlashAttention, SplitHeadViewsAndSdpaRouting) {
  REQUIRE_GPU();
  // GPT's layout: [B, T, H, D] viewed as [B, H, T, D], read in place through the strides.
  const int64_t B = 2, T = 100, H = 4, D = 64;
  const DType d = DType::bfloat16;
  const Tensor qb = rand_tensor({B, T, H, D}, d, 301), kb = rand_tensor({B, T, H, D}, d, 302),
               vb = rand_tensor({B, T, H, D}, d, 303);
  Tensor qg = ops::transpose(to_gpu(qb), 1, 2), kg = ops::transpose(to_gpu(kb), 1, 2),
         vg = ops::transpose(to_gpu(vb), 1, 2);
  ASSERT_FALSE(qg.is_contiguous());
  qg.requires_grad_();
  kg.requires_grad_();
  vg.requires_grad_();
  const Tensor out = scaled_dot_product_attention(qg, kg, vg, {}, 0.0, true);
  // The fused path saves q, k, v, out and the float32 lse only.
  const std::vector<Tensor> saved = saved_by(out);
  ASSERT_EQ(saved.size(), 5u);
  EXPECT_EQ(saved[4].dtype(), DType::float32);
  EXPECT_EQ(saved[4].sizes(), (Shape{B, H, T}));
  // Against the float32 composite on the CPU, gradients included.
  Tensor qc = ops::to(ops::transpose(qb, 1, 2), DType::float32),
         kc = ops::to(ops::transpose(kb, 1, 2), DType::float32),
         vc = ops::to(ops::transpose(vb, 1, 2), DType::float32);
  qc.requires_grad_();
  kc.requires_grad_();
  vc.requires_grad_();
  const Tensor ref = scaled_dot_product_attention(qc, kc, vc, {}, 0.0, true);
  EXPECT_TRUE(close_scaled(f32_cpu(out), ref, 1e-2));
  const Tensor w = rand_tensor({B, H, T, D}, DType::float32, 304, -1, 1);
  tally::sum(tally::mul(out.to(DType::float32), to_gpu(w))).backward();
  tally::sum(tally::mul(ref, w)).backward();
  EXPECT_TRUE(close_scaled(f32_cpu(qg.grad()), qc.grad(), 2e-2));
  EXPECT_TRUE(close_scaled(f32_cpu(kg.grad()), kc.grad(), 2e-2));
  EXPECT_TRUE(close_scaled(f32_cpu(vg.grad()), vc.grad(), 2e-2));
  // With a mask (or dropout) it stays on the composite (which saves more).
  const Tensor plain = scaled_dot_product_attention(
      qg.to(DType::float32), kg.to(DType::float32), vg.to(DType::float32),
      ops::zeros({T, T}, DType::float32, kGpu), 0.0, false);
  EXPECT_NE(saved_by(plain).size(), 5u);
}

// GPT-2's attention (heads of a [B, T, 3C] projection, causal, head dim 64) runs on cuDNN's
// fused kernels on sm_80+, reading q, k, v in place and writing the gradients into one
// packed buffer; it agrees with Tally's own kernels on the same inputs. The counters prove
// which route ran.
TEST(CudaFlashAttention, CudnnRunsGptAttentionAndMatchesTallysKernels) {
  REQUIRE_GPU();
  const int64_t B = 2, T = 512, H = 12, D = 64, C = H * D;
  const double scale = 1.0 / 8;
  for (const DType d : {DType::bfloat16, DType::float16}) {
    SCOPED_TRACE(dtype_name(d));
    const Tensor x = to_gpu(rand_tensor({B, T, 3 * C}, d, 700, -2, 2));
    const Tensor dout = to_gpu(rand_tensor({B, H, T, D}, d, 701, -1, 1));
    const TensorList parts = ops::split(x, C, 2);
    Tensor qkv[3];
    for (int i = 0; i < 3; ++i)
      qkv[i] = ops::transpose(ops::view(parts[static_cast<size_t>(i)], {B, T, H, D}), 1, 2);
    std::string why;
    ASSERT_TRUE(cuda::cudnn_sdp_supported(qkv[0], qkv[1], qkv[2], true, scale, &why)) << why;

    ops::FlashAttentionOutput f[2];
    ops::FlashAttentionGrads g[2];
    for (const bool cudnn : {true, false}) {
      const Route route(cudnn);
      const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
      f[cudnn] = ops::flash_attention_forward(qkv[0], qkv[1], qkv[2], true, scale);
      g[cudnn] = ops::flash_attention_backward(dout, qkv[0], qkv[1], qkv[2], f[cudnn].out,
                                               f[cudnn].lse, true, scale);
      const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
      EXPECT_EQ(after.forward - before.forward, cudnn ? 1 : 0);
      EXPECT_EQ(after.backward - before.backward, cudnn ? 1 : 0);
      EXPECT_EQ(after.fallbacks, before.fallbacks);
      // The gradients are the three parts of one [B, T, 3C] buffer.
      EXPECT_TRUE(g[cudnn].dq.storage().is_same(g[cudnn].dv.storage()));
      EXPECT_EQ(g[cudnn].dk.storage_offset() - g[cudnn].dq.storage_offset(), C);
    }
    EXPECT_TRUE(close_scaled(f32_cpu(f[1].out), f32_cpu(f[0].out), 1e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(f[1].lse), f32_cpu(f[0].lse), 1e-4));
    EXPECT_TRUE(close_scaled(f32_cpu(g[1].dq), f32_cpu(g[0].dq), 2e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(g[1].dk), f32_cpu(g[0].dk), 2e-2));
    EXPECT_TRUE(close_scaled(f32_cpu(g[1].dv), f32_cpu(g[0].dv), 2e-2));
    // Each route's backward takes the other's forward (same log-sum-exp convention).
    {
      const Route route(true);
      const ops::FlashAttentionGrads mixed = ops::flash_attention_backward(
          dout, qkv[0], qkv[1], qkv[2], f[0].out, f[0].lse, true, scale);
      EXPECT_TRUE(close_scaled(f32_cpu(mixed.dq), f32_cpu(g[0].dq), 2e-2));
      EXPECT_TRUE(close_scaled(f32_cpu(mixed.dk), f32_cpu(g[0].dk), 2e-2));
    }
  }
}

// The 0/1 environment switches (TALLY_CUDNN_SDP, TALLY_CUDNN_CONV_LEGACY) read through
// cuda::env_switch: unset or empty gives the default, anything but 0 or 1 is an error naming the
// variable and its value. Host-only: runs without a GPU too.
TEST(CudaRuntime, EnvSwitchTakesZeroOrOneAndNamesABadValue) {
  const char* name = "TALLY_TEST_ENV_SWITCH";
  ::unsetenv(name);
  EXPECT_TRUE(cuda::env_switch(name, true));
  EXPECT_FALSE(cuda::env_switch(name, false));
  ::setenv(name, "", 1);
  EXPECT_TRUE(cuda::env_switch(name, true));
  ::setenv(name, "0", 1);
  EXPECT_FALSE(cuda::env_switch(name, true));
  ::setenv(name, "1", 1);
  EXPECT_TRUE(cuda::env_switch(name, false));
  for (const char* bad : {"off", "true", "2", "0 "}) {
    ::setenv(name, bad, 1);
    try {
      cuda::env_switch(name, true);
      ADD_FAILURE() << "no error for '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  ::unsetenv(name);
}

// A problem cuDNN declines falls back to Tally's kernels with the right answer, and is
// counted; float32 never asks for cuDNN.
TEST(CudaFlashAttention, CudnnDeclinedProblemsFallBack) {
  REQUIRE_GPU();
  const Route route(true);
  const Tensor q = to_gpu(rand_tensor({1, 2, 64, 64}, DType::float32, 710, -1, 1));
  std::string why;
  EXPECT_FALSE(cuda::cudnn_sdp_supported(q, q, q, true, 0.125, &why));
  EXPECT_FALSE(why.empty());
  const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
  ops::flash_attention_forward(q, q, q, true, 0.125);
  const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
  EXPECT_EQ(after.forward, before.forward);
  EXPECT_EQ(after.fallbacks, before.fallbacks) << "float32 is not a cuDNN problem at all";
}

TEST(CudaFlashAttention, NoTxTMatrixDuringForwardAndBackward) {
  REQUIRE_GPU();
  const int64_t B = 4, H = 8, T = 1024, D = 64;
  const DType d = DType::bfloat16;
  Tensor q = ops::to(ops::randn({B, H, T, D}, DType::float32, kGpu), d);
  Tensor k = ops::to(ops::randn({B, H, T, D}, DType::float32, kGpu), d);
  Tensor v = ops::to(ops::randn({B, H, T, D}, DType::float32, kGpu), d);
  const Tensor dout = ops::to(ops::randn({B, H, T, D}, DType::float32, kGpu), d);
  q.requires_grad_();
  k.requires_grad_();
  v.requires_grad_();
  const size_t before = memory::memory_allocated(kGpu);
  memory::reset_peak_memory_stats(kGpu);
  {
    const Tensor out = scaled_dot_product_attention(q, k, v, {}, 0.0, true);
    out.backward(dout);
  }
  const size_t peak = memory::max_memory_allocated(kGpu) - before;
  const double txt = static_cast<double>(B * H * T * T * 2);
  // Above the inputs: out, lse, the float32 dQ accumulator and the three gradients,
  // about 12 bytes per element of q (0.4 MB per head here) against 2 MB per head for one
  // bfloat16 T x T matrix.
  EXPECT_LT(static_cast<double>(peak), 0.6 * txt) << "peak " << peak << " bytes";
  EXPECT_TRUE(q.grad().defined() && k.grad().defined() && v.grad().defined());
}

// ------------------------------------------------------------------ float32 (attention_fp32.cu)
//
// The float32 kernels against the float64 CPU reference run on the very same (float32)
// values: 1e-5 relative (max |got - ref| / max |ref|), the tolerance growing with sqrt(T)
// past one 64-row tile, as float32 sums of T terms do.

const Case kFp32Cases[] = {
    {2, 3, 64, 64, 64, false},    // one tile
    {2, 3, 130, 130, 64, true},   // T not a multiple of 64
    {1, 2, 300, 300, 64, true},   // several tiles, causal
    {1, 2, 77, 77, 128, false},   // head dim 128, partial tile
    {1, 2, 200, 200, 128, true},  // causal, head dim 128
    {2, 2, 50, 190, 64, false},   // L < S
    {2, 2, 190, 50, 64, true},    // L > S, causal (rows past S see every key)
    {1, 3, 100, 100, 40, true},   // head dim 40 (padded to 64 inside)
    {2, 2, 90, 90, 32, true},     // head dim 32
    {1, 2, 70, 70, 33, false},    // head dim 33: unaligned rows, scalar loads
    {8, 24, 64, 64, 64, true},    // B * H many
    {1, 1, 1, 1, 64, true},       // a single row
};

double fp32_tol(const Case& c, double base) {
  return base * std::max(1.0, std::sqrt(static_cast<double>(std::max(c.L, c.S)) / 64.0));
}

// float32 inputs on the GPU and the same values in float64 on the CPU.
Inputs make_fp32_inputs(const Case& c, uint64_t seed) {
  Inputs in;
  const Tensor q = rand_tensor({c.B, c.H, c.L, c.E}, DType::float32, seed, -2, 2);
  const Tensor k = rand_tensor({c.B, c.H, c.S, c.E}, DType::float32, seed + 1, -2, 2);
  const Tensor v = rand_tensor({c.B, c.H, c.S, c.E}, DType::float32, seed + 2, -2, 2);
  in.q = to_gpu(q);
  in.k = to_gpu(k);
  in.v = to_gpu(v);
  in.qf = ops::to(q, DType::float64);
  in.kf = ops::to(k, DType::float64);
  in.vf = ops::to(v, DType::float64);
  return in;
}

Tensor f64_cpu(const Tensor& t) {
  return ops::to(t, kCpu, DType::float64);
}

TEST(CudaFlashAttentionFp32, ForwardMatchesTheFloat64Cpu) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  for (const Case& c : kFp32Cases) {
    const Inputs in = make_fp32_inputs(c, seed += 3);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
    ASSERT_TRUE(ops::flash_attention_supported(in.q, in.k, in.v)) << describe(c, DType::float32);
    const ops::FlashAttentionOutput g =
        ops::flash_attention_forward(in.q, in.k, in.v, c.causal, scale);
    const ops::FlashAttentionOutput r =
        ops::flash_attention_forward(in.qf, in.kf, in.vf, c.causal, scale);
    EXPECT_EQ(g.out.device(), kGpu);
    EXPECT_EQ(g.out.dtype(), DType::float32);
    EXPECT_EQ(g.lse.dtype(), DType::float32);
    EXPECT_EQ(g.out.sizes(), r.out.sizes());
    EXPECT_TRUE(close_scaled(f64_cpu(g.out), r.out, fp32_tol(c, 1e-5)))
        << describe(c, DType::float32);
    EXPECT_TRUE(close_scaled(f64_cpu(g.lse), r.lse, fp32_tol(c, 1e-5)))
        << "lse " << describe(c, DType::float32);
  }
}

TEST(CudaFlashAttentionFp32, BackwardMatchesTheFloat64Cpu) {
  REQUIRE_GPU();
  uint64_t seed = 600;
  for (const Case& c : kFp32Cases) {
    const Inputs in = make_fp32_inputs(c, seed += 4);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
    const Tensor dout = rand_tensor({c.B, c.H, c.L, c.E}, DType::float32, seed + 3, -1, 1);
    const ops::FlashAttentionOutput g =
        ops::flash_attention_forward(in.q, in.k, in.v, c.causal, scale);
    const ops::FlashAttentionGrads gg = ops::flash_attention_backward(
        to_gpu(dout), in.q, in.k, in.v, g.out, g.lse, c.causal, scale);
    // The whole chain in float64 on the CPU from the same float32 values.
    const ops::FlashAttentionOutput r =
        ops::flash_attention_forward(in.qf, in.kf, in.vf, c.causal, scale);
    const ops::FlashAttentionGrads rr = ops::flash_attention_backward(
        ops::to(dout, DType::float64), in.qf, in.kf, in.vf, r.out, r.lse, c.causal, scale);
    EXPECT_EQ(gg.dq.dtype(), DType::float32);
    EXPECT_EQ(gg.dk.sizes(), rr.dk.sizes());
    const double tol = fp32_tol(c, 2e-5);
    EXPECT_TRUE(close_scaled(f64_cpu(gg.dq), rr.dq, tol)) << "dq " << describe(c, DType::float32);
    EXPECT_TRUE(close_scaled(f64_cpu(gg.dk), rr.dk, tol)) << "dk " << describe(c, DType::float32);
    EXPECT_TRUE(close_scaled(f64_cpu(gg.dv), rr.dv, tol)) << "dv " << describe(c, DType::float32);
  }
}

TEST(CudaFlashAttentionFp32, UnalignedAndStridedInputs) {
  REQUIRE_GPU();
  // q, k, v views at an odd element offset (copied to aligned memory by the op) and a
  // [B, T, H, D] split-head view read in place; both against the float64 reference.
  const int64_t B = 2, T = 96, H = 3, D = 64;
  const Tensor base = rand_tensor({3 * B * H * T * D + 1}, DType::float32, 701);
  const Tensor flat = to_gpu(base);
  auto piece = [&](const Tensor& t, int i) {
    return ops::reshape(ops::narrow(t, 0, 1 + i * B * H * T * D, B * H * T * D), {B, H, T, D});
  };
  const Tensor q = piece(flat, 0), k = piece(flat, 1), v = piece(flat, 2);
  const Tensor q64 = ops::to(piece(base, 0), DType::float64),
               k64 = ops::to(piece(base, 1), DType::float64),
               v64 = ops::to(piece(base, 2), DType::float64);
  const Case c{B, H, T, T, D, true};
  const ops::FlashAttentionOutput g = ops::flash_attention_forward(q, k, v, true, 0.125);
  const ops::FlashAttentionOutput r = ops::flash_attention_forward(q64, k64, v64, true, 0.125);
  EXPECT_TRUE(close_scaled(f64_cpu(g.out), r.out, fp32_tol(c, 1e-5)));
  const Tensor qs = ops::transpose(to_gpu(ops::transpose(piece(base, 0), 1, 2).contiguous()), 1, 2);
  ASSERT_FALSE(qs.is_contiguous());
  const ops::FlashAttentionOutput gs = ops::flash_attention_forward(qs, k, v, true, 0.125);
  EXPECT_TRUE(close_scaled(f64_cpu(gs.out), r.out, fp32_tol(c, 1e-5)));
  const Tensor dout = rand_tensor({B, H, T, D}, DType::float32, 702, -1, 1);
  const ops::FlashAttentionGrads gg =
      ops::flash_attention_backward(to_gpu(dout), qs, k, v, gs.out, gs.lse, true, 0.125);
  const ops::FlashAttentionGrads rr = ops::flash_attention_backward(
      ops::to(dout, DType::float64), q64, k64, v64, r.out, r.lse, true, 0.125);
  EXPECT_TRUE(close_scaled(f64_cpu(gg.dq), rr.dq, fp32_tol(c, 2e-5)));
  EXPECT_TRUE(close_scaled(f64_cpu(gg.dk), rr.dk, fp32_tol(c, 2e-5)));
  EXPECT_TRUE(close_scaled(f64_cpu(gg.dv), rr.dv, fp32_tol(c, 2e-5)));
  // What the float32 kernel does not take: E != Ev, E > 128.
  EXPECT_FALSE(ops::flash_attention_supported(q, k, ops::narrow(v, 3, 0, 32)));
  const Tensor wide = ops::zeros({1, 1, 4, 136}, DType::float32, kGpu);
  EXPECT_FALSE(ops::flash_attention_supported(wide, wide, wide));
}

TEST(CudaFlashAttentionFp32, SdpaTakesTheFusedPathWithTheCompositesGradients) {
  REQUIRE_GPU();
  // GPT's layout: [B, T, H, D] viewed as [B, H, T, D]. The fused float32 path against the
  // composite (matmul, mask, softmax, matmul) in float64 on the CPU, gradients included.
  const int64_t B = 2, T = 150, H = 4, D = 64;
  for (const bool causal : {true, false}) {
    const uint64_t seed = causal ? 800 : 810;
    const Tensor qb = rand_tensor({B, T, H, D}, DType::float32, seed),
                 kb = rand_tensor({B, T, H, D}, DType::float32, seed + 1),
                 vb = rand_tensor({B, T, H, D}, DType::float32, seed + 2);
    Tensor qg = ops::transpose(to_gpu(qb), 1, 2), kg = ops::transpose(to_gpu(kb), 1, 2),
           vg = ops::transpose(to_gpu(vb), 1, 2);
    qg.requires_grad_();
    kg.requires_grad_();
    vg.requires_grad_();
    const Tensor out = scaled_dot_product_attention(qg, kg, vg, {}, 0.0, causal);
    EXPECT_EQ(out.dtype(), DType::float32);
    const std::vector<Tensor> saved = saved_by(out);
    ASSERT_EQ(saved.size(), 5u) << "float32 on CUDA should take the fused path";
    EXPECT_EQ(saved[4].dtype(), DType::float32);
    EXPECT_EQ(saved[4].sizes(), (Shape{B, H, T}));
    Tensor qc = ops::to(ops::transpose(qb, 1, 2), DType::float64),
           kc = ops::to(ops::transpose(kb, 1, 2), DType::float64),
           vc = ops::to(ops::transpose(vb, 1, 2), DType::float64);
    qc.requires_grad_();
    kc.requires_grad_();
    vc.requires_grad_();
    const Tensor ref = scaled_dot_product_attention(qc, kc, vc, {}, 0.0, causal);
    ASSERT_NE(saved_by(ref).size(), 5u);  // the CPU runs the composite
    const Case c{B, H, T, T, D, causal};
    EXPECT_TRUE(close_scaled(f64_cpu(out), ref, fp32_tol(c, 1e-5))) << "causal " << causal;
    const Tensor w = rand_tensor({B, H, T, D}, DType::float32, seed + 3, -1, 1);
    tally::sum(tally::mul(out, to_gpu(w))).backward();
    tally::sum(tally::mul(ref, ops::to(w, DType::float64))).backward();
    const double tol = fp32_tol(c, 2e-5);
    EXPECT_TRUE(close_scaled(f64_cpu(qg.grad()), qc.grad(), tol)) << "dq causal " << causal;
    EXPECT_TRUE(close_scaled(f64_cpu(kg.grad()), kc.grad(), tol)) << "dk causal " << causal;
    EXPECT_TRUE(close_scaled(f64_cpu(vg.grad()), vc.grad(), tol)) << "dv causal " << causal;
  }
}

TEST(CudaFlashAttentionFp32, NoTxTMatrixDuringForwardAndBackward) {
  REQUIRE_GPU();
  const int64_t B = 4, H = 8, T = 1024, D = 64;
  Tensor q = ops::randn({B, H, T, D}, DType::float32, kGpu);
  Tensor k = ops::randn({B, H, T, D}, DType::float32, kGpu);
  Tensor v = ops::randn({B, H, T, D}, DType::float32, kGpu);
  const Tensor dout = ops::randn({B, H, T, D}, DType::float32, kGpu);
  q.requires_grad_();
  k.requires_grad_();
  v.requires_grad_();
  const size_t before = memory::memory_allocated(kGpu);
  memory::reset_peak_memory_stats(kGpu);
  {
    const Tensor out = scaled_dot_product_attention(q, k, v, {}, 0.0, true);
    out.backward(dout);
  }
  const size_t peak = memory::max_memory_allocated(kGpu) - before;
  const double txt = static_cast<double>(B * H * T * T * 4);
  // Above the inputs: out, lse, D and the three gradients, about 16 bytes per element of q
  // (1 MB per head here) against 4 MB per head for one float32 T x T matrix.
  EXPECT_LT(static_cast<double>(peak), 0.5 * txt) << "peak " << peak << " bytes";
  EXPECT_TRUE(q.grad().defined() && k.grad().defined() && v.grad().defined());
}

}  // namespace
}  // namespace tally
