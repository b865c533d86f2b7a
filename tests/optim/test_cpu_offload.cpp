// CpuOffload (optim/cpu_offload.h) with the CPU playing the device: its steps equal AdamW's and
// AdamW8bit's bit for bit (an MLP, a tiny GPT, channels_last-free dense parameters, gradient
// clipping between backward and step), its host update equals the CPU backend's fused kernels
// at any thread count, its state is tagged optimizer_state on the host, and a dry run for a GPU
// keeps that state on the host (meta:0), not on the device.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/ops.h"
#include "inspect/unpickle.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "memory/meta.h"
#include "nn/container.h"
#include "nn/layers.h"
#include "nn/models/gpt.h"
#include "optim/adam.h"
#include "optim/adamw8bit.h"
#include "optim/clip_grad.h"
#include "optim/cpu_adam.h"
#include "optim/cpu_offload.h"
#include "tensor/cpu/threads.h"
#include "tensor/meta/cost.h"
#include "tensor/pinned.h"
#include "testing/gradcheck.h"
#include "testing/mlp.h"

namespace tally {
namespace {

using testing::mlp_loss;
using testing::mlp_params;
using testing::values;
constexpr int64_t kHidden = 128, kBatch = 16;  // the MLP's sizes here

// `plain` and `offloaded` over two copies of the MLP, `steps` steps each, compared bitwise
// after every step (float32 values are exact in double).
template <typename Plain, typename Offloaded>
void expect_steps_equal(Plain make_plain, Offloaded make_offloaded, double clip = 0) {
  std::vector<Tensor> a = mlp_params(kHidden), b = mlp_params(kHidden);
  auto oa = make_plain(a);
  auto ob = make_offloaded(b);
  for (int s = 0; s < 3; ++s) {
    const std::pair<std::vector<Tensor>*, optim::Optimizer*> runs[] = {{&a, oa.get()},
                                                                       {&b, ob.get()}};
    for (const auto& [params, opt] : runs) {
      opt->zero_grad();
      mlp_loss(*params, s, kBatch).backward();
      if (clip > 0) optim::clip_grad_norm_(*params, clip);
      opt->step();
    }
    ASSERT_EQ(values(a), values(b)) << "step " << s;
  }
}

TEST(CpuOffload, EqualsAdamWStepForStep) {
  const optim::AdamOptions o{.lr = 1e-2, .weight_decay = 0.1};
  expect_steps_equal([&](auto& p) { return std::make_unique<optim::AdamW>(p, o); },
                     [&](auto& p) { return std::make_unique<optim::CpuOffload>(p, o); });
}

TEST(CpuOffload, EqualsAdamWWithAmsgradMaximizeAndClipping) {
  const optim::AdamOptions o{
      .lr = 1e-2, .beta1 = 0.3, .weight_decay = 0.01, .amsgrad = true, .maximize = true};
  expect_steps_equal([&](auto& p) { return std::make_unique<optim::AdamW>(p, o); },
                     [&](auto& p) { return std::make_unique<optim::CpuOffload>(p, o); }, 0.5);
}

TEST(CpuOffload, EqualsAdamW8bitStepForStep) {
  const optim::AdamOptions o{.lr = 1e-2, .weight_decay = 0.1};
  const optim::AdamW8bitOptions q{.block_size = 64, .min_8bit_size = 1024};
  expect_steps_equal([&](auto& p) { return std::make_unique<optim::AdamW8bit>(p, o, q); },
                     [&](auto& p) {
                       return std::make_unique<optim::CpuOffload>(
                           p, o, optim::CpuOffloadOptions{.adamw8bit = true, .quant = q});
                     });
}

TEST(CpuOffload, TinyGptEqualsAdamW) {
  auto run = [](bool offload) {
    manual_seed(0);
    nn::GPT gpt(nn::GPTConfig::preset("tiny"));
    std::unique_ptr<optim::Optimizer> opt;
    if (offload)
      opt = std::make_unique<optim::CpuOffload>(gpt.parameters(), optim::AdamOptions{.lr = 1e-3});
    else
      opt = std::make_unique<optim::AdamW>(gpt.parameters(), optim::AdamOptions{.lr = 1e-3});
    for (int s = 0; s < 2; ++s) {
      const Tensor x = ops::randint(0, 256, {2, 16}, DType::int64);
      opt->zero_grad();
      gpt(x, x).second.backward();
      opt->step();
    }
    return values(gpt.parameters());
  };
  EXPECT_EQ(run(true), run(false));
}

TEST(CpuOffload, StateIsOptimizerStateOnTheHost) {
  std::vector<Tensor> p = mlp_params(kHidden);
  optim::CpuOffload opt(p);
  auto& cpu = memory::get_allocator(Device::cpu());
  const int64_t before = cpu.stats().cat_bytes(memory::Category::optimizer_state).current;
  mlp_loss(p, 0, kBatch).backward();
  opt.step();
  const int64_t numel = 128 * 64 + 128 + 10 * 128;
  const int64_t state = cpu.stats().cat_bytes(memory::Category::optimizer_state).current - before;
  EXPECT_GE(state, 3 * 4 * numel);            // master, exp_avg, exp_avg_sq
  EXPECT_LE(state, 3 * 4 * numel + 9 * 512);  // each of 9 blocks rounded up
  const optim::OptimizerStateDict sd = opt.state_dict();
  EXPECT_EQ(sd.tensors.at("state.0.master").sizes(), (Shape{128 * 64}));
  EXPECT_EQ(sd.tensors.at("state.2.exp_avg_sq").device(), Device::cpu());
}

// A 16-bit model: master weights in float32 on the host, the device weights their rounding.
TEST(CpuOffload, Bfloat16WeightsKeepAFloat32Master) {
  manual_seed(3);
  Tensor w = ops::to(ops::randn({64, 32}), Device::cpu(), DType::bfloat16).requires_grad_();
  optim::CpuOffload opt(std::vector<Tensor>{w}, optim::AdamOptions{.lr = 1e-2});
  for (int s = 0; s < 2; ++s) {
    opt.zero_grad();
    sum(mul(w, w)).backward();
    opt.step();
  }
  const Tensor master = opt.state(0).tensors.at("master");
  EXPECT_EQ(master.dtype(), DType::float32);
  EXPECT_EQ(ops::to_vector(ops::to(master.view({64, 32}), Device::cpu(), DType::bfloat16)),
            ops::to_vector(w));
  EXPECT_THROW(optim::CpuOffload(std::vector<Tensor>{ops::randn({3}).requires_grad_()},
                                 optim::AdamOptions{.capturable = true}),
               std::invalid_argument);
}

// A cheap generator of values in [-1, 1), the same sequence for the same seed; its state also
// makes the tests' 8-bit codes.
struct Lcg {
  uint32_t state;
  float operator()() {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
  }
};

// The host update over several threads equals the CPU backend's serial kernels bit for bit.
TEST(CpuOffload, ParallelHostUpdateEqualsTheCpuKernels) {
  const int64_t sizes[] = {1, 17, 66000};  // 66000 crosses a 64K-element run
  Lcg next{1};
  const int threads_before = tally::cpu::num_threads();
  tally::cpu::set_num_threads(2);
  for (const bool amsgrad : {false, true})
    for (const double beta1 : {0.9, 0.3})
      for (const auto& [wd, decoupled] : {std::pair{0.0, true}, {0.05, true}, {0.05, false}}) {
        optim::AdamHyper h{.lr = 1e-2,
                           .beta1 = beta1,
                           .weight_decay = wd,
                           .decoupled = decoupled,
                           .amsgrad = amsgrad,
                           .maximize = beta1 < 0.5,
                           .step = 3};
        const int depth = amsgrad ? 5 : 4;
        std::vector<std::vector<float>> ref, par;
        for (const int64_t n : sizes)
          for (int k = 0; k < depth; ++k) {
            std::vector<float> x(static_cast<size_t>(n));
            for (float& e : x) e = k == 3 || k == 4 ? std::abs(next()) : next();
            ref.push_back(x);
            par.push_back(x);
          }
        auto lists = [&](std::vector<std::vector<float>>& d) {
          optim::TensorLists l(Device::cpu(), DType::float32, depth);
          for (size_t t = 0; t < 3; ++t) {
            auto at = [&](int k) { return d[t * depth + k].data(); };
            if (amsgrad)
              l.add({at(0), at(1), at(2), at(3), at(4)}, sizes[t]);
            else
              l.add({at(0), at(1), at(2), at(3)}, sizes[t]);
          }
          return l;
        };
        optim::cpu::serial_multi_tensor_kernels.adam(lists(ref), h);
        optim::parallel_adam_(lists(par), h);
        for (size_t i = 0; i < ref.size(); ++i)
          ASSERT_EQ(std::memcmp(ref[i].data(), par[i].data(), ref[i].size() * 4), 0)
              << "amsgrad " << amsgrad << " beta1 " << beta1 << " wd " << wd << " list " << i;
      }
  tally::cpu::set_num_threads(threads_before);
}

// The 16-bit path (bfloat16/float16 gradients read as they are, the new weights rounded into
// the gradient's buffer) equals widening, the float32 kernel and a cast, bit for bit.
TEST(CpuOffload, SixteenBitHostUpdateEqualsWidenUpdateRound) {
  const int64_t sizes[] = {1, 2049, 66000};  // across the 2048-element blocks and a 64K run
  Lcg next{7};
  for (const DType g16 : {DType::bfloat16, DType::float16}) {
    const optim::AdamHyper h{.lr = 1e-2, .weight_decay = 0.01, .decoupled = true, .step = 2};
    std::vector<Tensor> ref, fused;  // per tensor: p, g (16-bit), m, v
    for (const int64_t n : sizes)
      for (int k = 0; k < 4; ++k) {
        std::vector<float> x(static_cast<size_t>(n));
        for (float& e : x) e = k == 3 ? std::abs(next()) : next();
        Tensor t = ops::from_vector(std::vector<double>(x.begin(), x.end()), {n});
        if (k == 1) t = ops::to(t, Device::cpu(), g16);
        ref.push_back(t);
        fused.push_back(ops::clone(t));
      }
    optim::TensorLists lr(Device::cpu(), DType::float32, 4), lf = lr;
    std::vector<Tensor> wide, rounded;
    std::vector<void*> out;
    for (size_t t = 0; t < 3; ++t) {
      wide.push_back(ops::to(ref[t * 4 + 1], Device::cpu(), DType::float32));
      lr.add({ref[t * 4].data_ptr(), wide.back().data_ptr(), ref[t * 4 + 2].data_ptr(),
              ref[t * 4 + 3].data_ptr()},
             sizes[t]);
      lf.add({fused[t * 4].data_ptr(), fused[t * 4 + 1].data_ptr(), fused[t * 4 + 2].data_ptr(),
              fused[t * 4 + 3].data_ptr()},
             sizes[t]);
      out.push_back(fused[t * 4 + 1].data_ptr());  // into the gradient's own buffer
    }
    optim::parallel_adam_(lr, h);
    optim::parallel_adam_16_(lf, h, g16, out);
    for (size_t t = 0; t < 3; ++t) {
      for (int k : {0, 2, 3})
        EXPECT_EQ(ops::to_vector(ref[t * 4 + k]), ops::to_vector(fused[t * 4 + k]))
            << dtype_name(g16) << " tensor " << t << " list " << k;
      EXPECT_EQ(ops::to_vector(ops::to(ref[t * 4], Device::cpu(), g16)),
                ops::to_vector(fused[t * 4 + 1]))
          << dtype_name(g16) << " tensor " << t << ": the rounded weights";
    }
  }
  optim::TensorLists bad(Device::cpu(), DType::float32, 4);
  EXPECT_THROW(optim::parallel_adam_16_(bad, optim::AdamHyper{}, DType::float32, {}),
               std::invalid_argument);
}

// AdamW8bit's state of one tensor for the host update's tests: float32 masters, 16-bit
// gradients, codes and block scales.
template <typename G>
struct State8 {
  std::vector<float> p;
  std::vector<G> g;
  std::vector<uint8_t> qm, qv;
  std::vector<float> am, av;
};

// Two float32 or 16-bit values equal: the same bits, or both NaN (a vector instruction may pick
// the other NaN operand of a commutative operation).
template <typename T>
bool same_value(T a, T b) {
  const float x = static_cast<float>(a), y = static_cast<float>(b);
  return std::memcmp(&a, &b, sizeof(T)) == 0 || (std::isnan(x) && std::isnan(y));
}

// The code-book loops a test runs (set_host_simd_cap): AVX-512's, AVX2's and GCC's, each where
// the CPU has it; the cap goes back when the scope ends.
class SimdCap {
 public:
  explicit SimdCap(int cap) : before_(optim::detail::set_host_simd_cap(cap)) {}
  ~SimdCap() { optim::detail::set_host_simd_cap(before_); }
  SimdCap(const SimdCap&) = delete;
  SimdCap& operator=(const SimdCap&) = delete;

 private:
  int before_;
};
constexpr int kSimdCaps[] = {2, 1, 0};

// The one-pass 16-bit AdamW8bit update (parallel_adamw8bit_16_) equals widening the gradient,
// the serial float32 kernel and a cast, bit for bit: masters, codes, scales and rounded weights,
// for bfloat16 and float16, tails short of a block and of a vector, a run boundary (66000), a block
// of zeros (absmax 0: one code), an inf gradient, at 1 and 3 threads, with each set of code-book
// loops (`cap`).
template <typename G>
void expect_8bit_16_equal(int cap) {
  const SimdCap simd(cap);
  const int64_t sizes[] = {1, 77, 1000, 66000};
  Lcg next{11};
  const int threads_before = tally::cpu::num_threads();
  struct Case {
    int threads;
    int64_t bs;
    bool maximize;
  };
  for (const Case c : {Case{1, 64, false}, Case{3, 256, true}, Case{3, 64, false}}) {
    const int threads = c.threads;
    const int64_t bs = c.bs;
    const bool maximize = c.maximize;
    tally::cpu::set_num_threads(threads);
    const double beta1 = maximize ? 0.3 : 0.9;  // lerp's two forms
    const optim::AdamHyper h{.lr = 1e-2,
                             .beta1 = beta1,
                             .weight_decay = 0.01,
                             .decoupled = !maximize,
                             .maximize = maximize,
                             .step = 3};
    std::vector<State8<G>> ref, one;
    for (const int64_t n : sizes) {
      const int64_t blocks = (n + bs - 1) / bs;
      State8<G> st;
      for (int64_t i = 0; i < n; ++i) {
        st.p.push_back(next());
        st.g.push_back(G(next()));
        st.qm.push_back(static_cast<uint8_t>(next.state >> 13));
        st.qv.push_back(static_cast<uint8_t>(next.state >> 21));
      }
      for (int64_t b = 0; b < blocks; ++b) {
        st.am.push_back(std::abs(next()));
        st.av.push_back(std::abs(next()) * 1e-3f);
      }
      if (n == 1000) {  // the first block all zero; an inf gradient in the last
        st.am[0] = st.av[0] = 0;
        std::fill(st.g.begin(), st.g.begin() + bs, G(0.0f));
        st.g[n - 2] = G(std::numeric_limits<float>::infinity());
      }
      ref.push_back(st);
      one.push_back(st);
    }
    for (int step = 0; step < 2; ++step) {
      optim::TensorLists lr(Device::cpu(), DType::float32, 6), l1 = lr;
      std::vector<std::vector<float>> wide;
      std::vector<void*> out;
      for (size_t t = 0; t < ref.size(); ++t) {
        State8<G>& r = ref[t];
        State8<G>& o = one[t];
        wide.emplace_back(r.g.begin(), r.g.end());
        const int64_t n = sizes[t];
        lr.add({r.p.data(), wide.back().data(), r.qm.data(), r.qv.data(), r.am.data(), r.av.data()},
               n);
        l1.add({o.p.data(), o.g.data(), o.qm.data(), o.qv.data(), o.am.data(), o.av.data()}, n);
        out.push_back(t == 1 ? nullptr : o.g.data());  // into the gradient; none for one
      }
      optim::AdamHyper hs = h;
      hs.step = h.step + step;
      optim::cpu::serial_multi_tensor_kernels.adamw8bit(lr, {hs, bs});
      optim::parallel_adamw8bit_16_(l1, {hs, bs}, dtype_of<G>(), out);
      for (size_t t = 0; t < ref.size(); ++t) {
        const std::string where =
            fmt::format("{} cap {} threads {} block {} maximize {} step {} size {}",
                        dtype_name(dtype_of<G>()), cap, threads, bs, maximize, step, sizes[t]);
        const State8<G>& r = ref[t];
        State8<G>& o = one[t];
        for (size_t i = 0; i < r.p.size(); ++i)
          ASSERT_TRUE(same_value(r.p[i], o.p[i])) << where << " master " << i;
        ASSERT_EQ(r.qm, o.qm) << where;
        ASSERT_EQ(r.qv, o.qv) << where;
        ASSERT_EQ(r.am, o.am) << where;
        ASSERT_EQ(r.av, o.av) << where;
        if (t != 1) {
          for (size_t i = 0; i < r.p.size(); ++i)
            ASSERT_TRUE(same_value(G(r.p[i]), o.g[i])) << where << " weight " << i;
        } else {
          ASSERT_TRUE(std::equal(r.g.begin(), r.g.end(), o.g.begin(),
                                 [](G a, G b) { return a.bits == b.bits; }))
              << where << ": a null output leaves the gradient";
        }
        // The next step's gradient: the reference's 16-bit one again (o.g holds weights).
        for (size_t i = 0; i < r.g.size(); ++i) {
          ref[t].g[i] = G(next());
          o.g[i] = ref[t].g[i];
        }
      }
    }
  }
  tally::cpu::set_num_threads(threads_before);
}

// The threaded float32 AdamW8bit update (parallel_adamw8bit_: the vectorised blocks, the code
// book searched without a branch) equals the serial kernel bit for bit over two steps: masters,
// codes and scales, with tails short of a block and of a vector, a run boundary (66000), a
// block of zeros, an inf gradient, at 1 and 3 threads, with each set of code-book loops (`cap`);
// amsgrad takes the serial kernel itself.
void expect_parallel_8bit_equal(int cap) {
  const SimdCap simd(cap);
  const int64_t sizes[] = {1, 77, 1000, 66000};
  Lcg next{29};
  struct State {
    std::vector<float> p, g, am, av;
    std::vector<uint8_t> qm, qv;
  };
  const int threads_before = tally::cpu::num_threads();
  for (const auto& [threads, bs, maximize, amsgrad] :
       {std::tuple{1, int64_t{64}, false, false}, std::tuple{3, int64_t{256}, true, false},
        std::tuple{3, int64_t{64}, false, true}}) {
    tally::cpu::set_num_threads(threads);
    const optim::AdamHyper h{.lr = 1e-2,
                             .beta1 = maximize ? 0.3 : 0.9,
                             .weight_decay = 0.01,
                             .decoupled = !maximize,
                             .amsgrad = amsgrad,
                             .maximize = maximize,
                             .step = 3};
    std::vector<State> ref, par;
    for (const int64_t n : sizes) {
      State st;
      for (int64_t i = 0; i < n; ++i) {
        st.p.push_back(next());
        st.g.push_back(next() * 1e-2f);
        st.qm.push_back(static_cast<uint8_t>(next.state >> 13));
        st.qv.push_back(static_cast<uint8_t>(next.state >> 21));
      }
      for (int64_t b = 0; b < (n + bs - 1) / bs; ++b) {
        st.am.push_back(std::abs(next()) * 1e-2f);
        st.av.push_back(std::abs(next()) * 1e-4f);
      }
      if (n == 1000) {  // the first block all zero; an inf gradient in the last
        st.am[0] = st.av[0] = 0;
        std::fill(st.g.begin(), st.g.begin() + bs, 0.0f);
        st.g[static_cast<size_t>(n - 2)] = std::numeric_limits<float>::infinity();
      }
      ref.push_back(st);
      par.push_back(st);
    }
    for (int step = 0; step < 2; ++step) {
      optim::TensorLists lr(Device::cpu(), DType::float32, 6), lp = lr;
      for (size_t t = 0; t < ref.size(); ++t) {
        State& r = ref[t];
        State& q = par[t];
        lr.add({r.p.data(), r.g.data(), r.qm.data(), r.qv.data(), r.am.data(), r.av.data()},
               sizes[t]);
        lp.add({q.p.data(), q.g.data(), q.qm.data(), q.qv.data(), q.am.data(), q.av.data()},
               sizes[t]);
      }
      optim::AdamHyper hs = h;
      hs.step = h.step + step;
      optim::cpu::serial_multi_tensor_kernels.adamw8bit(lr, {hs, bs});
      optim::parallel_adamw8bit_(lp, {hs, bs});
      for (size_t t = 0; t < ref.size(); ++t) {
        const std::string where =
            fmt::format("cap {} threads {} block {} maximize {} amsgrad {} step {} size {}", cap,
                        threads, bs, maximize, amsgrad, step, sizes[t]);
        ASSERT_EQ(std::memcmp(ref[t].p.data(), par[t].p.data(), ref[t].p.size() * 4), 0) << where;
        ASSERT_EQ(ref[t].qm, par[t].qm) << where;
        ASSERT_EQ(ref[t].qv, par[t].qv) << where;
        ASSERT_EQ(std::memcmp(ref[t].am.data(), par[t].am.data(), ref[t].am.size() * 4), 0)
            << where;
        ASSERT_EQ(std::memcmp(ref[t].av.data(), par[t].av.data(), ref[t].av.size() * 4), 0)
            << where;
        for (size_t i = 0; i < ref[t].g.size(); ++i)  // the next step's gradient
          ref[t].g[i] = par[t].g[i] = next() * 1e-2f;
      }
    }
  }
  tally::cpu::set_num_threads(threads_before);
}

TEST(CpuOffload, ParallelEightBitUpdateEqualsTheSerialKernel) {
  for (const int cap : kSimdCaps) expect_parallel_8bit_equal(cap);
}

TEST(CpuOffload, EightBitSixteenBitHostUpdateEqualsWidenUpdateRound) {
  for (const int cap : kSimdCaps) {
    expect_8bit_16_equal<BFloat16>(cap);
    expect_8bit_16_equal<Half>(cap);
  }
  EXPECT_THROW(optim::detail::set_host_simd_cap(3), std::invalid_argument);
}

// Bad lists, dtypes, block sizes and options are refused before any work, naming the op.
TEST(CpuOffload, EightBitSixteenBitHostUpdateRefusesBadInput) {
  float p = 0, am = 0, av = 0;
  BFloat16 g;
  uint8_t qm = 0, qv = 0;
  optim::TensorLists good(Device::cpu(), DType::float32, 6);
  good.add({&p, &g, &qm, &qv, &am, &av}, 1);
  optim::TensorLists shallow(Device::cpu(), DType::float32, 4),
      wide(Device::cpu(), DType::float64, 6);
  const optim::AdamW8bitHyper h{{}, 256};
  auto refused = [](auto&& call, const char* what) {
    try {
      call();
      ADD_FAILURE() << "accepted: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("parallel_adamw8bit_16_"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused([&] { optim::parallel_adamw8bit_16_(shallow, h, DType::bfloat16, {}); }, "depth 4");
  refused([&] { optim::parallel_adamw8bit_16_(wide, h, DType::bfloat16, {}); }, "float64");
  refused([&] { optim::parallel_adamw8bit_16_(good, h, DType::float32, {}); },
          "gradients must be bfloat16 or float16, got float32");
  refused(
      [&] {
        optim::parallel_adamw8bit_16_(good, {{}, 100}, DType::bfloat16, {});
      },
      "block_size 100");
  refused(
      [&] {
        optim::parallel_adamw8bit_16_(good, h, DType::bfloat16, {&g, &g});
      },
      "2 output pointers for 1 tensors");
  refused(
      [&] {
        optim::parallel_adamw8bit_16_(good, {{.amsgrad = true}, 256}, DType::bfloat16, {});
      },
      "amsgrad");
  optim::TensorLists meta(Device::meta(), DType::float32, 6);
  refused([&] { optim::parallel_adamw8bit_16_(meta, h, DType::bfloat16, {}); }, "CPU tensors");
  EXPECT_EQ(p, 0.0f);  // nothing ran
}

// CpuOffload(AdamW8bit) of a bfloat16 model on the CPU: the gradients read as they are (no
// float32 copy), the result that of the widened update, the weights the master's rounding.
TEST(CpuOffload, EightBitBfloat16WeightsEqualTheWidenedUpdate) {
  manual_seed(5);
  const optim::AdamOptions o{.lr = 1e-2, .weight_decay = 0.1};
  const optim::AdamW8bitOptions q{.block_size = 64, .min_8bit_size = 256};
  Tensor w = ops::to(ops::randn({40, 30}), Device::cpu(), DType::bfloat16).requires_grad_();
  optim::CpuOffload opt(std::vector<Tensor>{w}, o, {.adamw8bit = true, .quant = q});
  opt.init_masters();
  // The reference: the same masters and 8-bit state, widened gradients, parallel_adamw8bit_.
  const int64_t n = w.numel(), blocks = (n + 63) / 64;
  auto floats = [](const Tensor& t) {
    const std::vector<double> d = ops::to_vector(t);
    return std::vector<float>(d.begin(), d.end());
  };
  std::vector<float> p = floats(w);
  std::vector<uint8_t> qm(static_cast<size_t>(n)), qv(static_cast<size_t>(n));
  std::vector<float> am(static_cast<size_t>(blocks)), av(static_cast<size_t>(blocks));
  for (int s = 1; s <= 2; ++s) {
    opt.zero_grad();
    sum(mul(mul(w, w), ops::full({40, 30}, 0.5 * s))).backward();
    std::vector<float> g = floats(w.grad());
    optim::TensorLists l(Device::cpu(), DType::float32, 6);
    l.add({p.data(), g.data(), qm.data(), qv.data(), am.data(), av.data()}, n);
    optim::parallel_adamw8bit_(
        l, {{.lr = 1e-2, .weight_decay = 0.1, .decoupled = true, .step = s}, 64});
    opt.step();
    const auto& st = opt.state(0).tensors;
    ASSERT_EQ(floats(st.at("master")), p) << "step " << s;
    ASSERT_EQ(ops::to_vector(st.at("exp_avg")), std::vector<double>(qm.begin(), qm.end()));
    ASSERT_EQ(ops::to_vector(st.at("exp_avg_sq")), std::vector<double>(qv.begin(), qv.end()));
    ASSERT_EQ(floats(st.at("exp_avg_absmax")), am) << "step " << s;
    ASSERT_EQ(floats(st.at("exp_avg_sq_absmax")), av) << "step " << s;
    EXPECT_EQ(ops::to_vector(ops::to(st.at("master"), Device::cpu(), DType::bfloat16)),
              ops::to_vector(w.view({n})));
  }
}

// A dry run for an H200: the device holds the weights and gradients, the host the state.
TEST(CpuOffload, ADryRunForAGpuKeepsTheStateOnTheHost) {
  memory::DryRun dry({.target = "h200"});
  const Device d = dry.device();
  const Tensor w = ops::empty({1024, 1024}, DType::float32, d).requires_grad_();
  optim::CpuOffload opt(std::vector<Tensor>{w});
  sum(mul(w, w)).backward();
  opt.step();
  EXPECT_EQ(opt.state(0).tensors.at("master").device(), Device::meta(0));
  EXPECT_EQ(opt.hooked_copies(), 1);
  const memory::Estimate e = dry.finish();
  EXPECT_EQ(e.at_peak[static_cast<size_t>(memory::Category::optimizer_state)], 0);
  EXPECT_GE(e.host_peak_allocated, 3 * 4 * 1024 * 1024);
}

// A dry run inside another (a planner's candidate inside `--estimate`) shares the host: each
// counts only its own host peak.
TEST(CpuOffload, NestedDryRunsEachCountTheirOwnHostPeak) {
  memory::DryRun outer({.target = "h200"});
  const Tensor kept = ops::empty_host({int64_t{2} << 20}, DType::float32, outer.device());  // 8 MiB
  memory::Estimate inner_estimate;
  {
    memory::DryRun inner({.target = "h200"});
    { const Tensor state = ops::empty_host({int64_t{16} << 20}, DType::float32, inner.device()); }
    inner_estimate = inner.finish();
  }
  const memory::Estimate e = outer.finish();
  EXPECT_EQ(inner_estimate.host_peak_allocated, int64_t{64} << 20);
  EXPECT_EQ(e.host_peak_allocated, int64_t{8} << 20);  // not 72 MiB
  EXPECT_LT(e.host_peak_reserved, int64_t{64} << 20);
}

// AdamW8bit over a bfloat16 model, a dry run for an H200: the host update reads the 16-bit
// gradients as they are, so the host's peak is the state and the gradients' buffer, with no
// float32 copy of a bucket's gradients (4 MiB more here).
TEST(CpuOffload, EightBitOverBfloat16HoldsNoFloat32GradientsOnTheHost) {
  memory::DryRun dry({.target = "h200"});
  const Tensor w = ops::empty({1024, 1024}, DType::bfloat16, dry.device()).requires_grad_();
  optim::CpuOffload opt(std::vector<Tensor>{w}, optim::AdamW::default_options(),
                        {.adamw8bit = true});
  for (int s = 0; s < 2; ++s) {
    opt.zero_grad();
    sum(mul(w, w)).backward();
    opt.step();
  }
  const memory::Estimate e = dry.finish();
  constexpr int64_t kMiB = 1 << 20;
  // master 4 MiB, codes 2 MiB, scales 32 KiB, the gradient's buffer 2 MiB
  EXPECT_GE(e.host_peak_allocated, 8 * kMiB);
  EXPECT_LT(e.host_peak_allocated, 9 * kMiB);
}

// Gradient accumulation: under no_sync() the hooks send nothing; the last backward sends the
// sum, which the step uses (a dry run for a GPU, where the hooks are installed).
TEST(CpuOffload, NoSyncSendsOnlyTheLastMicroBatchsGradients) {
  memory::DryRun dry({.target = "h200"});
  const Tensor w = ops::empty({256, 256}, DType::float32, dry.device()).requires_grad_();
  optim::CpuOffload opt(std::vector<Tensor>{w});
  {
    auto guard = opt.no_sync();
    sum(mul(w, w)).backward();
    EXPECT_EQ(opt.hooked_copies(), 0);
  }
  sum(mul(w, w)).backward();
  EXPECT_EQ(opt.hooked_copies(), 1);
  opt.step();
  EXPECT_EQ(opt.buckets_sent(), 1);  // the hook's bucket was fresh: step() sent nothing more
  dry.finish();
}

// The snapshot of a dry run for a GPU shows the host side as PyTorch's record_pinned_host_memory
// does: host_segments with the state's blocks, tagged optimizer_state, and host_traces; the
// summary has the host's table.
TEST(CpuOffload, SnapshotsAndTheSummaryShowTheHostSide) {
  memory::DryRun dry({.target = "h200"});
  const Tensor w = ops::empty({256, 256}, DType::float32, dry.device()).requires_grad_();
  optim::CpuOffload opt(std::vector<Tensor>{w});
  sum(mul(w, w)).backward();
  opt.step();
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("tally_cpu_offload_" + std::to_string(::getpid()) + ".pickle"))
                               .string();
  memory::dump_snapshot(path, dry.device());
  const inspect::PickleValue root = inspect::unpickle_file(path);
  std::filesystem::remove(path);
  const inspect::PickleValue* segments = root.as_dict().find("host_segments");
  ASSERT_NE(segments, nullptr);
  int64_t state_bytes = 0;
  for (const inspect::PickleValue& seg : segments->as_list())
    for (const inspect::PickleValue& b : seg.as_dict().find("blocks")->as_list()) {
      const auto& frames = b.as_dict().find("frames")->as_list();
      if (!frames.empty() &&
          frames.back().as_dict().find("filename")->as_string() == "category=optimizer_state")
        state_bytes += b.as_dict().find("size")->as_int();
    }
  EXPECT_GE(state_bytes, 3 * 4 * 256 * 256);
  ASSERT_NE(root.as_dict().find("host_traces"), nullptr);
  EXPECT_FALSE(root.as_dict().find("host_traces")->as_list().empty());
  EXPECT_NE(memory::memory_summary(dry.device()).find("Host memory of"), std::string::npos);
}

// A dry run charges the host's update time: a 1M-parameter step takes at least its bytes a
// parameter over the host update bandwidth longer than with that charge off (and the copies
// back, which wait for the update). AdamW moves 28 (the
// master read and written, the float32 gradient, two float32 moments read and written); AdamW8bit
// 16 (its moments a byte each), over its own, lower bandwidth.
double predicted_offloaded_step(bool charge_host, bool adamw8bit) {
  memory::DryRun dry({.target = "h200"});
  meta::Rates rates = meta::rates_for(memory::meta_target("h200"));
  if (!charge_host) rates.host_update_bandwidth = rates.host_update_8bit_bandwidth = 0;
  meta::set_rates(dry.device(), rates);
  const Tensor w = ops::empty({1024, 1024}, DType::float32, dry.device()).requires_grad_();
  optim::CpuOffload opt(std::vector<Tensor>{w}, optim::AdamW::default_options(),
                        optim::CpuOffloadOptions{.adamw8bit = adamw8bit});
  sum(mul(w, w)).backward();
  opt.step();
  return dry.finish().predicted_seconds;
}

TEST(CpuOffload, ADryRunChargesTheHostUpdate) {
  const meta::Rates r = meta::rates_for(memory::meta_target("h200"));
  ASSERT_GT(r.host_update_bandwidth, 0);
  ASSERT_GT(r.host_update_8bit_bandwidth, 0);
  const double adamw =
      predicted_offloaded_step(true, false) - predicted_offloaded_step(false, false);
  const double q8 = predicted_offloaded_step(true, true) - predicted_offloaded_step(false, true);
  const double n = 1024.0 * 1024;
  EXPECT_GE(adamw, 0.999 * 28.0 * n / r.host_update_bandwidth);
  EXPECT_GE(q8, 0.999 * 16.0 * n / r.host_update_8bit_bandwidth);
  // Beyond the update, each also waits for the same copies: the difference is the updates'.
  EXPECT_NEAR(q8 - adamw,
              16.0 * n / r.host_update_8bit_bandwidth - 28.0 * n / r.host_update_bandwidth,
              0.01 * 16.0 * n / r.host_update_8bit_bandwidth);
}

// The host check: a plan whose host peak exceeds the host's memory does not fit, and says so
// with the figures.
TEST(CpuOffload, TheHostCheckRefusesAPlanOverTheHostsMemory) {
  memory::DryRun dry({.target = "h200", .host_memory = size_t{4} << 20});
  const Tensor w = ops::empty({1024, 1024}, DType::float32, dry.device()).requires_grad_();
  optim::CpuOffload opt(std::vector<Tensor>{w});
  sum(mul(w, w)).backward();
  opt.step();
  const memory::Estimate e = dry.finish();
  EXPECT_TRUE(e.out_of_memory.empty());  // the device has room
  EXPECT_FALSE(e.fits());
  EXPECT_NE(e.host_out_of_memory.find("exceeds the host's memory, 4.0 MiB (4194304 B)"),
            std::string::npos)
      << e.host_out_of_memory;
  EXPECT_NE(e.report().find("DOES NOT FIT on the host"), std::string::npos) << e.report();
  EXPECT_EQ(memory::host_memory_error(100, 200), "");
  EXPECT_NE(memory::host_memory_error(300, 200).find("300 B"), std::string::npos);
  EXPECT_GT(memory::host_memory_total(), size_t{0});
}

// keep_16bit_weights: the masters keep the float32 values, the module's parameters (the same
// tensors the optimizer holds, frozen ones included) become bfloat16 in place.
TEST(CpuOffload, KeepSixteenBitWeightsKeepsFloat32Masters) {
  manual_seed(6);
  nn::Linear lin(8, 4);
  lin.bias.requires_grad_(false);  // frozen: converted, no master
  const std::vector<double> w0 = ops::to_vector(lin.weight);
  const std::vector<double> b16 = ops::to_vector(ops::to(lin.bias, DType::bfloat16));
  optim::CpuOffload opt(std::vector<Tensor>{lin.weight}, optim::AdamOptions{});
  EXPECT_THROW(
      {
        try {
          opt.keep_16bit_weights(lin, DType::float32);
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("float16 or bfloat16"), std::string::npos);
          throw;
        }
      },
      std::invalid_argument);
  opt.keep_16bit_weights(lin);
  EXPECT_EQ(lin.weight.dtype(), DType::bfloat16);
  EXPECT_EQ(lin.bias.dtype(), DType::bfloat16);
  EXPECT_EQ(opt.param_groups()[0].params[0].dtype(), DType::bfloat16);  // the same tensor
  EXPECT_EQ(ops::to_vector(opt.state(0).tensors.at("master")), w0);
  EXPECT_EQ(ops::to_vector(lin.bias), b16);
}

// A tiny GPT's four steps (losses, then weights) with clipping at 0.5 and the learning rate
// halved after each step (a deferred update uses its step's): AdamW on the CPU, or CpuOffload
// with small buckets, its weights bfloat16 (keep_16bit_weights) or not, its moments 8-bit or
// not, overlapped with the next forward or not, clipped by optim::clip_grad_norm_ or by its own
// clip_grad_norm_ (folded into the update).
struct TinyGptRun {
  bool offload = true, overlap = false, bf16 = false, q8 = false, fold = false;
};
std::pair<std::vector<double>, std::vector<double>> tiny_gpt_run(TinyGptRun r) {
  manual_seed(0);
  nn::GPT gpt(nn::GPTConfig::preset("tiny"));
  const optim::AdamOptions o{.lr = 1e-3, .weight_decay = 0.1};
  std::unique_ptr<optim::Optimizer> opt;
  optim::CpuOffload* host = nullptr;
  if (r.offload) {
    auto c = std::make_unique<optim::CpuOffload>(
        gpt.parameters(), o,
        optim::CpuOffloadOptions{.adamw8bit = r.q8,
                                 .quant = {.block_size = 64, .min_8bit_size = 1024},
                                 .bucket_bytes = 16 << 10});
    if (r.bf16) c->keep_16bit_weights(gpt);
    if (r.overlap) c->overlap_with_forward(gpt);
    host = c.get();
    opt = std::move(c);
  } else {
    opt = std::make_unique<optim::AdamW>(gpt.parameters(), o);
  }
  std::vector<double> losses;
  for (int s = 0; s < 4; ++s) {
    const Tensor x = ops::randint(0, 256, {2, 16}, DType::int64);
    opt->zero_grad();
    const Tensor loss = gpt(x, x).second;
    losses.push_back(ops::item(loss));
    if (r.overlap) {
      EXPECT_EQ(host->deferred_updates(), 0u) << "step " << s;  // the forward ran them all
      EXPECT_EQ(host->updates_in_forward() > 0, s > 0) << "step " << s;
    }
    loss.backward();
    const Tensor norm =
        r.fold ? host->clip_grad_norm_(0.5) : optim::clip_grad_norm_(gpt.parameters(), 0.5);
    EXPECT_GT(ops::item(norm), 0.5) << "step " << s;  // the clipping scales
    opt->step();
    if (r.overlap) {
      EXPECT_GT(host->deferred_updates(), 1u) << "step " << s;
    }
    opt->set_lr(opt->get_lr() * 0.5);
  }
  if (host) host->finish_updates();
  std::vector<double> weights;
  for (const Tensor& p : gpt.parameters())
    for (double v : ops::to_vector(p)) weights.push_back(v);
  return {losses, weights};
}

// overlap_with_forward: each step defers its buckets' updates until the next forward calls a
// module holding their parameters; losses and weights equal AdamW's bit for bit, and in
// bfloat16 those of the same optimizer without deferring.
TEST(CpuOffload, OverlapWithForwardEqualsAdamW) {
  const auto plain = tiny_gpt_run({.offload = false});
  const auto overlapped = tiny_gpt_run({.overlap = true});
  EXPECT_EQ(overlapped.first, plain.first);
  EXPECT_EQ(overlapped.second, plain.second);
}

TEST(CpuOffload, OverlapWithForwardEqualsTheUndeferredStepsInBfloat16) {
  const auto undeferred = tiny_gpt_run({.bf16 = true});
  const auto overlapped = tiny_gpt_run({.overlap = true, .bf16 = true});
  EXPECT_EQ(overlapped.first, undeferred.first);
  EXPECT_EQ(overlapped.second, undeferred.second);
}

// CpuOffload::clip_grad_norm_ folds the coefficient into the host update: the steps equal
// optim::clip_grad_norm_ then step() bit for bit, float32 against AdamW, and with bfloat16
// gradients (the product rounded to bfloat16 first, as clip_grad_norm_ stores it) against the
// same optimizer clipped by optim::clip_grad_norm_, with float32 and 8-bit moments, deferred or
// not. The AVX-512, AVX2 and GCC loops all take the scale (the caps loop).
TEST(CpuOffload, ClipGradNormFoldedIntoTheUpdateEqualsClippingTheGradients) {
  EXPECT_EQ(tiny_gpt_run({.fold = true}), tiny_gpt_run({.offload = false}));
  for (int cap : {2, 1, 0}) {
    SimdCap c(cap);
    for (bool q8 : {false, true}) {
      const auto clipped = tiny_gpt_run({.bf16 = true, .q8 = q8});
      EXPECT_EQ(tiny_gpt_run({.bf16 = true, .q8 = q8, .fold = true}), clipped)
          << "cap " << cap << ", 8-bit " << q8;
      EXPECT_EQ(tiny_gpt_run({.overlap = true, .bf16 = true, .q8 = q8, .fold = true}), clipped)
          << "cap " << cap << ", 8-bit " << q8 << ", overlapped";
    }
  }
}

// The fold leaves the device's gradients as they are (none is sent again at step()); a
// gradient changed between clip_grad_norm_ and step() is an error naming the parameter.
TEST(CpuOffload, ClipGradNormFoldedRefusesAGradientChangedSince) {
  std::vector<Tensor> p = mlp_params(kHidden);
  optim::CpuOffload opt(p);
  mlp_loss(p, 0, kBatch).backward();
  const std::vector<double> g0 = ops::to_vector(p[0].grad());
  EXPECT_GT(ops::item(opt.clip_grad_norm_(1e-3)), 1e-3);
  EXPECT_EQ(ops::to_vector(p[0].grad()), g0);
  {
    NoGradGuard ng;
    ops::mul_(p[1].grad(), 2.0);
  }
  testing::expect_error<std::invalid_argument>(
      [&] { opt.step(); }, {"parameter 1 (shape", "changed after clip_grad_norm_"});
}

// A module whose forward reads a child's weight without calling the child reads it before its
// deferred update: the gradient that follows is an error naming the parameter, not a silent
// stale step. A parameter outside the model, or a gradient already sent, is refused up front.
struct ReadsPastItsChild : nn::Module {
  std::shared_ptr<nn::Linear> inner;
  ReadsPastItsChild() : Module("ReadsPastItsChild") {
    inner = register_module("inner", std::make_shared<nn::Linear>(4, 4, /*bias=*/false));
  }
  Tensor forward(const Tensor& x) override { return matmul(x, inner->weight.t()); }
};

TEST(CpuOffload, OverlapWithForwardRefusesAWeightReadPastItsModule) {
  manual_seed(3);
  ReadsPastItsChild m;
  optim::CpuOffload opt(m.parameters());
  opt.overlap_with_forward(m);
  const Tensor x = ops::randn({2, 4});
  sum(m(x)).backward();
  opt.step();
  EXPECT_EQ(opt.deferred_updates(), 1u);
  opt.zero_grad();
  testing::expect_error<std::logic_error>(
      [&] { sum(m(x)).backward(); },
      {"parameter 0 (shape [4, 4]) has a new gradient while its deferred update is pending"});

  nn::Linear other(4, 4);
  optim::CpuOffload outside(std::vector<Tensor>{other.weight, m.inner->weight});
  testing::expect_error<std::invalid_argument>(
      [&] { outside.overlap_with_forward(m); },
      {"parameter 0 (shape [4, 4]) is not a parameter of any module of the model "
       "(ReadsPastItsChild)"});
}

// A dry run for a GPU replays the overlap: the host updates layer k while the device runs the
// forward of the layers before it. Eight 2048-wide layers on 8192 rows, whose host update (2.3 ms
// a layer) outlasts their forward (1.4 ms): each of the three forwards that follow a step hides
// all but its last layer behind the updates, 7/8 of its time less the copies back (the last
// layer waits for its own update; the updates go parameter by parameter, so a bucket that
// straddles two layers holds back neither), and the device's peak is the same.
struct DeferredStep {
  double seconds;  // three steps and a forward
  double forward;  // one forward alone
  int64_t peak;
};
DeferredStep predicted_deferred_step(bool overlap, bool fold = false) {
  memory::DryRun dry({.target = "h200"});
  nn::Sequential seq;
  {
    nn::BuildOnDevice on(dry.device());
    for (int k = 0; k < 8; ++k) seq.push_back(std::make_shared<nn::Linear>(2048, 2048));
  }
  optim::CpuOffload opt(seq.parameters(), optim::AdamW::default_options(),
                        optim::CpuOffloadOptions{.bucket_bytes = 8 << 20});
  if (overlap) opt.overlap_with_forward(seq);
  const Tensor x = ops::empty({8192, 2048}, DType::float32, dry.device());
  const double t0 = memory::meta_seconds(dry.device());
  {
    NoGradGuard ng;
    seq(x);
  }
  const double forward = memory::meta_seconds(dry.device()) - t0;
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    sum(seq(x)).backward();
    if (fold)
      opt.clip_grad_norm_(1.0);
    else
      optim::clip_grad_norm_(seq.parameters(), 1.0);
    opt.step();
  }
  {
    NoGradGuard ng;
    seq(x);  // the last step's updates
  }
  const memory::Estimate e = dry.finish();
  return {e.predicted_seconds - forward, forward, e.peak_allocated};
}

TEST(CpuOffload, ADryRunOverlapsDeferredUpdatesWithTheForward) {
  const DeferredStep plain = predicted_deferred_step(false);
  const DeferredStep overlapped = predicted_deferred_step(true);
  const double saved = plain.seconds - overlapped.seconds;
  EXPECT_GT(saved, 3 * 0.75 * plain.forward)
      << plain.seconds << " s against " << overlapped.seconds;
  EXPECT_LT(saved, 3 * 7.0 / 8 * plain.forward);
  EXPECT_EQ(overlapped.peak, plain.peak);
}

// The folded clipping sends no gradient twice: the hooks' copies overlap with backward and
// step() sends nothing, so its steps are predicted faster than clip_grad_norm_'s (which
// rewrites every gradient, so step() sends them all again), deferred or not.
TEST(CpuOffload, ADryRunOfTheFoldedClippingSendsEachGradientOnce) {
  const DeferredStep resent = predicted_deferred_step(false);
  const DeferredStep folded = predicted_deferred_step(false, true);
  const DeferredStep both = predicted_deferred_step(true, true);
  EXPECT_LT(folded.seconds, 0.99 * resent.seconds)
      << resent.seconds << " s against " << folded.seconds;
  EXPECT_LE(both.seconds, folded.seconds);
}

}  // namespace
}  // namespace tally
