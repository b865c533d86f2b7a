// The cuDNN route of nn::LSTM and nn::GRU on CUDA (tensor/rnn/cuda.h): output, h_n, c_n and
// the gradients of the input, the initial states and every parameter against the
// per-timestep path on the CPU in float64, over LSTM and GRU, 1 and 2 layers, batch_first,
// bidirectional, with and without (h_0, c_0), and unbatched input; float32 at 1e-5 (the suite
// runs with cuDNN's TF32 off, tests/exact_float32.cpp), float16 and bfloat16 loosely. Each
// case checks through the counters that cuDNN ran the forward and the backward; the cases it
// must not take (route off, proj_size, dropout while training, CUDA autocast) leave them. The
// op itself (cudnn_rnn) passes a float64 finite-difference gradient check on cuDNN, and a dry
// run replaying this GPU allocates what the run does.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#include "autograd/autocast.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "memory/caching_allocator.h"
#include "memory/meta.h"
#include "nn/layers.h"
#include "nn/rnn.h"
#include "tensor/rnn/autograd.h"
#include "tensor/rnn/cuda.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

namespace tally::nn {
namespace {

using testing::rand_tensor;

struct Case {
  bool lstm = true;
  int64_t layers = 1;
  bool batch_first = false, bidirectional = false, with_state = false, batched = true;
  std::string name() const {
    return fmt::format("{} layers={} batch_first={} bidirectional={} h0={} batched={}",
                       lstm ? "LSTM" : "GRU", layers, batch_first, bidirectional, with_state,
                       batched);
  }
};

constexpr int64_t kI = 5, kH = 6, kT = 4, kB = 3;

std::shared_ptr<RNNBase> make(const Case& c, uint64_t seed, int64_t proj = 0,
                              double dropout = 0.0) {
  static thread_local std::optional<Generator> gen;
  gen.emplace(seed);
  if (c.lstm)
    return std::make_shared<LSTM>(kI, kH, c.layers, true, c.batch_first, dropout, c.bidirectional,
                                  proj, &*gen);
  return std::make_shared<GRU>(kI, kH, c.layers, true, c.batch_first, dropout, c.bidirectional,
                               &*gen);
}

// Everything a case compares: output, h_n, (c_n), then the gradients of x, h_0, (c_0) and of
// every parameter, as float64 on the CPU.
TensorList run(RNNBase& m, const Case& c, const Tensor& x, const Tensor& h0, const Tensor& c0,
               const TensorList& upstream) {
  Tensor xi = x.detach(), hi = h0.detach(), ci = c0.detach();
  xi.requires_grad_(true);
  if (c.with_state) {
    hi.requires_grad_(true);
    if (c.lstm) ci.requires_grad_(true);
  }
  TensorList outs;
  if (c.lstm) {
    auto& lstm = static_cast<LSTM&>(m);
    auto [o, hc] = c.with_state ? lstm(xi, std::make_pair(hi, ci)) : lstm(xi);
    outs = {o, hc.first, hc.second};
  } else {
    auto& gru = static_cast<GRU&>(m);
    auto [o, h] = gru(xi, c.with_state ? hi : Tensor());
    outs = {o, h};
  }
  Tensor loss;
  for (size_t i = 0; i < outs.size(); ++i) {
    const Tensor term = sum(mul(outs[i].to(DType::float64), upstream[i].to(outs[i].device())));
    loss = loss.defined() ? add(loss, term) : term;
  }
  loss.backward();
  TensorList got;
  for (const Tensor& o : outs) got.push_back(o.detach());
  got.push_back(xi.grad());
  if (c.with_state) {
    got.push_back(hi.grad());
    if (c.lstm) got.push_back(ci.grad());
  }
  for (const Tensor& p : m.parameters()) got.push_back(p.grad());
  for (Tensor& t : got) t = t.defined() ? t.to(Device::cpu()).to(DType::float64) : t;
  return got;
}

// Runs case c on CUDA in `dtype` and on the CPU in float64 (the same rounded parameters and
// inputs) and compares every result at |got - want| <= tol * (1 + |want|).
void check_case(const Case& c, DType dtype, double tol) {
  SCOPED_TRACE(c.name() + " " + std::string(dtype_name(dtype)));
  auto dev = make(c, 11);
  auto ref = make(c, 11);
  dev->to(dtype);
  dev->to(testing::kGpu);
  ref->to(dtype);  // the device's rounding of the parameters, then exact float64
  ref->to(DType::float64);
  const int64_t D = c.bidirectional ? 2 : 1;
  const Shape xs = !c.batched      ? Shape{kT, kI}
                   : c.batch_first ? Shape{kB, kT, kI}
                                   : Shape{kT, kB, kI};
  const Shape hs = c.batched ? Shape{c.layers * D, kB, kH} : Shape{c.layers * D, kH};
  const Tensor x = rand_tensor(xs, dtype, 1, -1, 1);
  const Tensor h0 = rand_tensor(hs, dtype, 2, -1, 1), c0 = rand_tensor(hs, dtype, 3, -1, 1);
  const Shape os = !c.batched      ? Shape{kT, D * kH}
                   : c.batch_first ? Shape{kB, kT, D * kH}
                                   : Shape{kT, kB, D * kH};
  const TensorList upstream = {rand_tensor(os, DType::float64, 4, -1, 1),
                               rand_tensor(hs, DType::float64, 5, -1, 1),
                               rand_tensor(hs, DType::float64, 6, -1, 1)};
  const cuda::CudnnRnnCounts before = cuda::cudnn_rnn_counts();
  const TensorList got =
      run(*dev, c, testing::to_gpu(x), testing::to_gpu(h0), testing::to_gpu(c0), upstream);
  const cuda::CudnnRnnCounts after = cuda::cudnn_rnn_counts();
  EXPECT_EQ(after.forward - before.forward, 1) << "the forward ran on cuDNN";
  EXPECT_EQ(after.backward - before.backward, 1) << "the backward ran on cuDNN";
  EXPECT_EQ(after.fallbacks, before.fallbacks);
  const TensorList want =
      run(*ref, c, x.to(DType::float64), h0.to(DType::float64), c0.to(DType::float64), upstream);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].defined() && want[i].defined()) << "result " << i;
    ASSERT_EQ(got[i].sizes(), want[i].sizes()) << "result " << i;
    const std::vector<double> a = ops::to_vector(got[i]), b = ops::to_vector(want[i]);
    double worst = 0;
    for (size_t k = 0; k < a.size(); ++k)
      worst = std::max(worst, std::abs(a[k] - b[k]) / (1 + std::abs(b[k])));
    EXPECT_LE(worst, tol) << "result " << i << " (output, h_n, [c_n], dx, [dh0, [dc0]], "
                          << "then the parameters in registration order)";
  }
}

class CudnnRnn : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = cuda::cudnn_rnn_enabled();
    cuda::set_cudnn_rnn_enabled(true);
  }
  void TearDown() override { cuda::set_cudnn_rnn_enabled(saved_); }
  bool saved_ = true;
};

TEST_F(CudnnRnn, Float32MatchesTheCpuInFloat64) {
  for (bool lstm : {true, false})
    for (int64_t layers : {1, 2})
      for (bool bf : {false, true})
        for (bool bidir : {false, true})
          for (bool state : {false, true}) {
            Case c;
            c.lstm = lstm;
            c.layers = layers;
            c.batch_first = bf;
            c.bidirectional = bidir;
            c.with_state = state;
            check_case(c, DType::float32, 1e-5);
          }
}

TEST_F(CudnnRnn, UnbatchedInput) {
  for (bool lstm : {true, false}) {
    Case c;
    c.lstm = lstm;
    c.layers = 2;
    c.bidirectional = true;
    c.with_state = true;
    c.batched = false;
    check_case(c, DType::float32, 1e-5);
  }
}

TEST_F(CudnnRnn, SixteenBitMatchesTheCpuLoosely) {
  for (DType dt : {DType::float16, DType::bfloat16})
    for (bool lstm : {true, false}) {
      Case c;
      c.lstm = lstm;
      c.layers = 2;
      c.batch_first = true;
      c.bidirectional = true;
      c.with_state = true;
      check_case(c, dt, dt == DType::bfloat16 ? 6e-2 : 1e-2);
    }
}

// The op itself (tensor/rnn/autograd.h: cudnn_rnn) in float64 on cuDNN: a finite-difference
// gradient check of x, h_0, c_0 and every weight (2 layers, bidirectional, batch-first).
TEST_F(CudnnRnn, Float64GradcheckOfTheOp) {
  for (bool lstm : {true, false}) {
    SCOPED_TRACE(lstm ? "LSTM" : "GRU");
    CudnnRnnSpec spec;
    spec.lstm = lstm;
    spec.input_size = 2;
    spec.hidden_size = 3;
    spec.num_layers = 2;
    spec.bidirectional = true;
    spec.batch_first = true;
    const int64_t G = lstm ? 4 : 3, H = 3, D = 2, B = 2, T = 3;
    TensorList in = {testing::rand_input({B, T, 2}, -1, 1, 1),
                     testing::rand_input({4, B, H}, -1, 1, 2)};
    if (lstm) in.push_back(testing::rand_input({4, B, H}, -1, 1, 3));
    const size_t first_weight = in.size();
    uint64_t seed = 10;
    for (int64_t cell = 0; cell < 4; ++cell) {
      const int64_t cols = cell < D ? 2 : D * H;
      in.push_back(testing::rand_input({G * H, cols}, -0.5, 0.5, seed++));
      in.push_back(testing::rand_input({G * H, H}, -0.5, 0.5, seed++));
      in.push_back(testing::rand_input({G * H}, -0.5, 0.5, seed++));
      in.push_back(testing::rand_input({G * H}, -0.5, 0.5, seed++));
    }
    const cuda::CudnnRnnCounts before = cuda::cudnn_rnn_counts();
    EXPECT_TRUE(testing::gradcheck_on(
        testing::kGpu,
        [&](const TensorList& t) {
          const TensorList w(t.begin() + static_cast<std::ptrdiff_t>(first_weight), t.end());
          auto r = cudnn_rnn(spec, t[0], t[1], lstm ? t[2] : Tensor(), w);
          if (!r) throw std::runtime_error("cuDNN did not take the float64 problem");
          TensorList parts = {std::get<0>(*r).reshape({-1}), std::get<1>(*r).reshape({-1})};
          if (lstm) parts.push_back(std::get<2>(*r).reshape({-1}));
          return cat(parts, 0);
        },
        in));
    EXPECT_GT(cuda::cudnn_rnn_counts().backward, before.backward);
  }
}

// A dry run on a meta device replaying this GPU (target "cuda") takes the cuDNN route too,
// with cuDNN's sizes: its activation (the reserve space), workspace and temporary peaks over
// one LSTM step equal the CUDA run's.
TEST_F(CudnnRnn, ADryRunForThisGpuAllocatesWhatTheRunDoes) {
  auto step_peaks = [](Device d) {
    BuildOnDevice on(d);
    LSTM lstm(5, 8, 2, true, true);
    Tensor x = zeros({4, 6, 5}, TensorOptions{}.with_device(d));
    x.requires_grad_(true);
    for (int i = 0; i < 2; ++i) {  // the first builds (and caches) cuDNN's plan
      lstm.zero_grad();
      x.set_grad(Tensor());
      memory::synchronize(d);
      memory::reset_peak_memory_stats(d);
      sum(lstm(x).first).backward();
    }
    const memory::DeviceStats st = memory::get_allocator(d).stats();
    return std::make_tuple(st.cat_bytes(memory::Category::activation).peak,
                           st.cat_bytes(memory::Category::workspace).peak,
                           st.cat_bytes(memory::Category::temporary).peak);
  };
  const cuda::CudnnRnnCounts before = cuda::cudnn_rnn_counts();
  const auto real = step_peaks(testing::kGpu);
  EXPECT_EQ(cuda::cudnn_rnn_counts().backward - before.backward, 2);
  const Device meta = memory::new_meta_device(memory::meta_target("cuda"));
  const auto dry = step_peaks(meta);
  EXPECT_TRUE(memory::unreplayed(meta).empty());
  EXPECT_EQ(std::get<0>(dry), std::get<0>(real)) << "activation peak";
  EXPECT_EQ(std::get<1>(dry), std::get<1>(real)) << "workspace peak";
  EXPECT_EQ(std::get<2>(dry), std::get<2>(real)) << "temporary peak";
  EXPECT_GT(std::get<0>(real), 0);
}

// Inference (no gradient needed) runs cuDNN's inference mode: a forward, no reserve space.
TEST_F(CudnnRnn, InferenceUnderNoGrad) {
  Case c;
  c.layers = 2;
  auto dev = make(c, 3);
  dev->to(testing::kGpu);
  auto ref = make(c, 3);
  ref->to(DType::float64);
  const Tensor x = rand_tensor({kT, kB, kI}, DType::float32, 7, -1, 1);
  const cuda::CudnnRnnCounts before = cuda::cudnn_rnn_counts();
  Tensor out;
  {
    NoGradGuard no_grad;
    out = static_cast<LSTM&>(*dev)(testing::to_gpu(x)).first;
  }
  const cuda::CudnnRnnCounts after = cuda::cudnn_rnn_counts();
  EXPECT_EQ(after.forward - before.forward, 1);
  EXPECT_FALSE(out.requires_grad());
  const Tensor want = static_cast<LSTM&>(*ref)(x.to(DType::float64)).first;
  EXPECT_TRUE(testing::values_near(out.to(Device::cpu()), ops::to_vector(want), 1e-5));
}

// Problems the route leaves to the per-timestep path: nothing counted.
TEST_F(CudnnRnn, OtherProblemsTakeThePerTimestepPath) {
  const Tensor x = testing::to_gpu(rand_tensor({kT, kB, kI}, DType::float32, 8, -1, 1));
  auto unchanged = [&](RNNBase& m, const char* what) {
    const cuda::CudnnRnnCounts before = cuda::cudnn_rnn_counts();
    m.to(testing::kGpu);
    Tensor out = m.forward(x);
    sum(out).backward();
    const cuda::CudnnRnnCounts after = cuda::cudnn_rnn_counts();
    EXPECT_EQ(after.forward, before.forward) << what;
    EXPECT_EQ(after.backward, before.backward) << what;
    EXPECT_EQ(after.fallbacks, before.fallbacks) << what;
  };
  Case c;
  c.layers = 2;
  auto proj = make(c, 1, 3);
  unchanged(*proj, "proj_size");
  auto dropped = make(c, 1, 0, 0.5);
  dropped->train();
  unchanged(*dropped, "dropout while training");
  cuda::set_cudnn_rnn_enabled(false);
  auto off = make(c, 1);
  unchanged(*off, "the route switched off");
  cuda::set_cudnn_rnn_enabled(true);
  {
    AutocastGuard autocast(DeviceType::cuda, DType::bfloat16);
    auto cast = make(c, 1);
    unchanged(*cast, "CUDA autocast");
  }
  // Dropout in eval mode is no dropout: the route applies.
  auto eval = make(c, 1, 0, 0.5);
  eval->eval();
  eval->to(testing::kGpu);
  const cuda::CudnnRnnCounts before = cuda::cudnn_rnn_counts();
  (void)eval->forward(x);
  EXPECT_EQ(cuda::cudnn_rnn_counts().forward - before.forward, 1);
}

}  // namespace
}  // namespace tally::nn
