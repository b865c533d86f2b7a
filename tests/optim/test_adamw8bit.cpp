// AdamW8bit on the CPU: the dynamic code books, the block-wise quantization's round-trip
// error, the first step against AdamW (bit for bit), 200 steps of a least-squares fit against
// float32 AdamW, the state's bytes (<= 26% of AdamW's), a state_dict round trip through a
// safetensors file (the next step bit for bit), the errors for bad options, and a dry run on
// the meta device allocating what the CPU run allocates.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>

#include "memory/estimate.h"
#include "memory/memory.h"
#include "nn/serialize.h"
#include "optim/adamw8bit.h"
#include "optim/multi_tensor.h"
#include "optim_testing.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

namespace fs = std::filesystem;
using memory::Category;
using optim::AdamOptions;
using optim::AdamW;
using optim::AdamW8bit;
using optim::AdamW8bitOptions;
using testing::param;

// Uniform values in [lo, hi) (float32, CPU) from a seeded generator.
Tensor uniform(const Shape& s, uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return ops::affine(ops::rand(s, DType::float32, Device::cpu(), &g), hi - lo, lo);
}

Tensor leaf(const Tensor& values) {
  Tensor t = ops::clone(values);
  t.requires_grad_(true);
  return t;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.sizes() == b.sizes() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

int64_t state_bytes() {
  return memory::get_allocator(Device::cpu()).stats().cat_bytes(Category::optimizer_state).current;
}

// Half the widest gap between neighbouring codes (and, signed, between -1 and the lowest
// code): the worst round-trip error of a value in [-1, 1] ([0, 1] unsigned).
double half_widest_gap(const std::array<float, 256>& map, bool is_signed) {
  double worst = is_signed ? 2 * (1.0 + map[0]) : 0;  // -1 rounds up to map[0]
  for (size_t i = 0; i + 1 < map.size(); ++i)
    worst = std::max(worst, static_cast<double>(map[i + 1]) - map[i]);
  return worst / 2;
}

TEST(AdamW8bit, DynamicMapsAreBitsandbytesCodeBooks) {
  const std::array<float, 256> s = optim::create_dynamic_map(true);
  const std::array<float, 256> u = optim::create_dynamic_map(false);
  for (size_t i = 0; i + 1 < 256; ++i) {
    EXPECT_LT(s[i], s[i + 1]) << i;  // sorted, no repeats
    EXPECT_LT(u[i], u[i + 1]) << i;
  }
  // Signed: 127 negative codes, 0, 127 positive ones ending at 1; the lowest is
  // -(0.1 + 0.9 * 63.5 / 64), the smallest positive 1e-6 * (0.1 + 0.9 / 2).
  EXPECT_EQ(s[127], 0.0f);
  EXPECT_EQ(s[255], 1.0f);
  EXPECT_FLOAT_EQ(s[0], -(0.1f + 0.9f * 63.5f / 64));
  EXPECT_FLOAT_EQ(s[128], 5.5e-7f);
  EXPECT_FLOAT_EQ(s[126], -5.5e-7f);
  // Unsigned: 0, then 2, 4, ..., 128 fractions per decade (the sign bit is one more bit).
  EXPECT_EQ(u[0], 0.0f);
  EXPECT_EQ(u[255], 1.0f);
  EXPECT_FLOAT_EQ(u[1], 1e-6f * (0.1f + 0.9f / 4));
  EXPECT_FLOAT_EQ(u[254], 0.1f + 0.9f * 127.5f / 128);
  // The worst round trip: 0.7% of the block's absmax signed, 0.36% unsigned.
  EXPECT_LT(half_widest_gap(s, true), 0.00704);
  EXPECT_LT(half_widest_gap(u, false), 0.00352);
  const optim::DynamicMaps& m = optim::dynamic_maps();
  EXPECT_EQ(std::memcmp(m.signed_map, s.data(), sizeof(m.signed_map)), 0);
  EXPECT_EQ(std::memcmp(m.unsigned_map, u.data(), sizeof(m.unsigned_map)), 0);
}

TEST(AdamW8bit, BlockwiseRoundTripErrorIsBoundedByTheBlockAbsmax) {
  const double bound_s = half_widest_gap(optim::create_dynamic_map(true), true);
  const double bound_u = half_widest_gap(optim::create_dynamic_map(false), false);
  for (const int64_t bs : {64, 256, 4096}) {
    // 10000 values (a short last block), each block on its own scale (1e-4 to 1e2), with a
    // block of zeros.
    const int64_t n = 10000;
    Tensor x = uniform({n}, 7 + static_cast<uint64_t>(bs));
    const Tensor scales = uniform({n / 64 + 1}, 99, -4, 2);
    float* xv = x.data<float>();
    for (int64_t i = 0; i < n; ++i) xv[i] *= std::pow(10.0f, scales.data<float>()[i / 64]);
    for (int64_t i = bs; i < std::min(n, 2 * bs); ++i) xv[i] = 0.f;
    for (const bool is_signed : {true, false}) {
      Tensor in = is_signed ? x : ops::mul(x, x);  // the second moment's values are >= 0
      const optim::QuantizedBlocks q = optim::quantize_blockwise(in, is_signed, bs);
      EXPECT_EQ(q.codes.dtype(), DType::uint8);
      EXPECT_EQ(q.codes.sizes(), Shape{n});
      EXPECT_EQ(q.absmax.sizes(), Shape{(n + bs - 1) / bs});
      const Tensor back = optim::dequantize_blockwise(q, is_signed, bs);
      const float* a = in.data<float>();
      const float* d = back.data<float>();
      const double bound = is_signed ? bound_s : bound_u;
      double worst = 0;  // the largest error relative to its block's absmax
      for (int64_t b = 0; b * bs < n; ++b) {
        float amax = 0;
        for (int64_t i = b * bs; i < std::min(n, (b + 1) * bs); ++i)
          amax = std::max(amax, std::abs(a[i]));
        ASSERT_EQ(q.absmax.data<float>()[b], amax) << "block " << b;
        for (int64_t i = b * bs; i < std::min(n, (b + 1) * bs); ++i) {
          const double err = std::abs(static_cast<double>(d[i]) - a[i]);
          if (amax == 0) {
            ASSERT_EQ(d[i], 0.f);
            continue;
          }
          worst = std::max(worst, err / amax);
          ASSERT_LE(err, (bound + 1e-6) * amax)
              << "block size " << bs << (is_signed ? " signed" : " unsigned") << " element " << i
              << ": " << a[i] << " -> " << d[i] << " (absmax " << amax << ")";
        }
      }
      EXPECT_GT(worst, bound / 4);  // the bound is not loose
    }
  }
}

TEST(AdamW8bit, FirstStepIsAdamWsAndTheStateDequantizesToItsMoments) {
  // From zero state the dequantized moments are exactly 0, so the first update is AdamW's to
  // the bit; the stored moments are AdamW's within the quantization bound.
  const Tensor p0 = uniform({5000}, 1), g = uniform({5000}, 2, -0.1, 0.1);
  const AdamOptions o{.lr = 0.01, .weight_decay = 0.1};
  Tensor a = leaf(p0), b = leaf(p0);
  AdamW ref({a}, o);
  AdamW8bit opt({b}, o);
  a.set_grad(ops::clone(g));
  b.set_grad(ops::clone(g));
  ref.step();
  opt.step();
  EXPECT_TRUE(bitwise_equal(a, b));
  const auto& st = opt.state(0).tensors;
  ASSERT_EQ(st.size(), 4u);
  EXPECT_EQ(st.at("exp_avg").dtype(), DType::uint8);
  EXPECT_EQ(st.at("exp_avg_sq").dtype(), DType::uint8);
  EXPECT_EQ(st.at("exp_avg_absmax").sizes(), Shape{20});  // ceil(5000 / 256)
  EXPECT_EQ(st.at("exp_avg_sq_absmax").dtype(), DType::float32);
  for (const auto& [name, t] : st)
    EXPECT_EQ(t.storage().category(), Category::optimizer_state) << name;
  const bool is_signed[] = {true, false};
  const char* names[] = {"exp_avg", "exp_avg_sq"};
  for (int k = 0; k < 2; ++k) {
    const Tensor got = optim::dequantize_blockwise(
        {st.at(names[k]), st.at(std::string(names[k]) + "_absmax")}, is_signed[k]);
    const std::vector<double> want = ops::to_vector(ref.state(0).tensors.at(names[k]));
    const std::vector<double> have = ops::to_vector(got);
    const std::vector<double> amax = ops::to_vector(st.at(std::string(names[k]) + "_absmax"));
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_LE(std::abs(have[i] - want[i]), 0.00705 * amax[i / 256]) << names[k] << " " << i;
  }
}

// Least squares: minimise mean((X W + bias - Y)^2) over W [128, 64] (8192 elements: 8-bit
// state) and bias [64] (float32 state, below min_8bit_size); Y from a known W*, bias* and noise.
struct Fit {
  Tensor x, y;
  Fit() {
    x = uniform({256, 128}, 11);
    const Tensor w_true = uniform({128, 64}, 12, -0.5, 0.5);
    const Tensor b_true = uniform({64}, 13);
    y = ops::add(ops::add(ops::matmul(x, w_true), b_true), ops::mul(uniform({256, 64}, 14), 0.2));
  }
  Tensor loss(const Tensor& w, const Tensor& b) const {
    const Tensor r = tally::sub(tally::add(tally::matmul(x, w), b), y);
    return tally::mean(tally::mul(r, r));
  }
  // `steps` steps of `opt` over w, b; returns the loss after them.
  double train(optim::Optimizer& opt, const Tensor& w, const Tensor& b, int steps) const {
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      loss(w, b).backward();
      opt.step();
    }
    NoGradGuard no_grad;
    return loss(w, b).item();
  }
};

TEST(AdamW8bit, LeastSquaresTracksFloat32AdamW) {
  const Fit fit;
  const Tensor w0 = uniform({128, 64}, 21, -0.1, 0.1), b0 = ops::zeros({64});
  const AdamOptions o{.lr = 0.01, .weight_decay = 1e-4};
  Tensor w32 = leaf(w0), b32 = leaf(b0), w8 = leaf(w0), b8 = leaf(b0);
  AdamW ref({w32, b32}, o);
  AdamW8bit opt({w8, b8}, o);
  double start = 0;
  {
    NoGradGuard no_grad;
    start = fit.loss(w0, b0).item();
  }
  const double l32 = fit.train(ref, w32, b32, 200), l8 = fit.train(opt, w8, b8, 200);
  std::printf("least squares: loss %.5f at the start, after 200 steps AdamW %.6f, AdamW8bit %.6f\n",
              start, l32, l8);
  EXPECT_LT(l32, start / 20);  // the fit converged (to near the noise's 0.0133)
  EXPECT_NEAR(l8, l32, 0.03 * l32);
  // W: 8-bit (uint8 codes), bias: float32 state.
  EXPECT_EQ(opt.state(0).tensors.at("exp_avg").dtype(), DType::uint8);
  EXPECT_EQ(opt.state(1).tensors.at("exp_avg").dtype(), DType::float32);
  EXPECT_EQ(opt.state(0).step, 200);
  const std::vector<double> a = ops::to_vector(w32), b = ops::to_vector(w8);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(a[i]));
  }
  std::printf("least squares: max |W8 - W32| = %.5f (max |W32| = %.3f)\n", worst, scale);
  EXPECT_LT(worst, 0.03 * scale);
  EXPECT_TRUE(testing::near_rel(b8, ops::to_vector(b32), 0.02));
}

TEST(AdamW8bit, StateIsAQuarterOfAdamWs) {
  const Tensor p0 = uniform({1 << 20}, 3), g = uniform({1 << 20}, 4);
  auto bytes_of = [&](auto make) {
    Tensor p = leaf(p0);
    p.set_grad(ops::clone(g));
    const int64_t before = state_bytes();
    auto opt = make(p);
    opt->step();
    const int64_t used = state_bytes() - before;
    int64_t blocks = 0;
    for (const auto& [name, t] : opt->state(0).tensors)
      blocks += static_cast<int64_t>(t.storage().block_bytes());
    EXPECT_EQ(used, blocks);
    return used;
  };
  const int64_t full = bytes_of([](Tensor p) {
    return std::make_unique<AdamW>(std::vector<Tensor>{p}, AdamOptions{.lr = 1e-3});
  });
  const int64_t q8 = bytes_of([](Tensor p) {
    return std::make_unique<AdamW8bit>(std::vector<Tensor>{p}, AdamOptions{.lr = 1e-3});
  });
  const double ratio = static_cast<double>(q8) / static_cast<double>(full);
  std::printf("optimizer_state for 1M float32 elements: AdamW %lld B, AdamW8bit %lld B (%.2f%%)\n",
              static_cast<long long>(full), static_cast<long long>(q8), 100 * ratio);
  EXPECT_EQ(full, 2 * 4 * (1 << 20));
  // Two 1 MiB code arrays and two 4096-float scale arrays.
  EXPECT_EQ(q8, 2 * (1 << 20) + 2 * 4 * 4096);
  EXPECT_LE(ratio, 0.26);
}

TEST(AdamW8bit, StateDictRoundTripsThroughSafetensorsBitForBit) {
  // An 8-bit parameter with a short last block, and a small one with float32 state.
  const Tensor pa = uniform({5000}, 5), pb = uniform({10}, 6);
  Tensor a = leaf(pa), b = leaf(pb);
  const AdamOptions o{.lr = 0.01, .weight_decay = 0.01};
  AdamW8bit opt({a, b}, o);
  auto grads = [](const Tensor& x, const Tensor& y, int s) {
    x.set_grad(uniform(x.sizes(), 100 + static_cast<uint64_t>(s)));
    y.set_grad(uniform(y.sizes(), 200 + static_cast<uint64_t>(s)));
  };
  for (int s = 0; s < 3; ++s) {
    grads(a, b, s);
    opt.step();
  }
  const optim::OptimizerStateDict sd = opt.state_dict();
  EXPECT_EQ(sd.tensors.size(), 6u);
  EXPECT_EQ(sd.tensors.at("state.0.exp_avg").dtype(), DType::uint8);
  EXPECT_EQ(sd.tensors.at("state.1.exp_avg").dtype(), DType::float32);
  EXPECT_EQ(sd.scalars.at("state.0.step"), 3);

  // Through a file: the codes are U8 tensors, the scalars metadata.
  const fs::path file = fs::temp_directory_path() /
                        ("tally_adamw8bit_" + std::to_string(::getpid()) + ".safetensors");
  nn::NamedTensors named(sd.tensors.begin(), sd.tensors.end());
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : sd.scalars) meta[k] = fmt::format("{}", v);
  nn::save_safetensors(file.string(), named, meta);
  std::map<std::string, std::string> meta_back;
  const nn::NamedTensors loaded = nn::load_safetensors(file.string(), &meta_back);
  fs::remove(file);
  optim::OptimizerStateDict sd2;
  for (const auto& [k, t] : loaded) sd2.tensors[k] = t;
  for (const auto& [k, v] : meta_back) sd2.scalars[k] = std::stod(v);
  ASSERT_EQ(sd2.tensors.size(), sd.tensors.size());
  for (const auto& [k, t] : sd.tensors) EXPECT_TRUE(bitwise_equal(sd2.tensors.at(k), t)) << k;

  Tensor a2 = leaf(a.detach()), b2 = leaf(b.detach());
  AdamW8bit opt2({a2, b2}, AdamOptions{});
  opt2.load_state_dict(sd2);
  EXPECT_DOUBLE_EQ(opt2.get_lr(), 0.01);
  EXPECT_EQ(opt2.state(0).step, 3);
  for (const auto& [name, t] : opt2.state(0).tensors)
    EXPECT_EQ(t.storage().category(), Category::optimizer_state) << name;
  grads(a, b, 3);
  grads(a2, b2, 3);
  opt.step();
  opt2.step();
  EXPECT_TRUE(bitwise_equal(a2, a));
  EXPECT_TRUE(bitwise_equal(b2, b));
  for (size_t i = 0; i < 2; ++i)
    for (const auto& [name, t] : opt.state(i).tensors)
      EXPECT_TRUE(bitwise_equal(opt2.state(i).tensors.at(name), t)) << i << " " << name;

  // A state dict that does not fit: another block size, float32 codes, a missing scale.
  Tensor a3 = leaf(pa), b3 = leaf(pb);
  AdamW8bit other({a3, b3}, o, AdamW8bitOptions{.block_size = 512});
  testing::expect_error<std::invalid_argument>(
      [&] { other.load_state_dict(sd); },
      {"AdamW8bit.load_state_dict", "state.0.exp_avg_absmax", "[20]", "[10]"});
  AdamW8bit same({a3, b3}, o);
  optim::OptimizerStateDict bad = sd;
  bad.tensors["state.0.exp_avg"] = ops::zeros({5000});
  testing::expect_error<std::invalid_argument>([&] { same.load_state_dict(bad); },
                                               {"state.0.exp_avg", "float32", "uint8"});
  bad = sd;
  bad.tensors.erase("state.0.exp_avg_sq_absmax");
  testing::expect_error<std::invalid_argument>([&] { same.load_state_dict(bad); },
                                               {"parameter 0", "exp_avg_sq_absmax", "missing"});
  bad = sd;
  bad.tensors["state.1.exp_avg_absmax"] = ops::zeros({1});
  testing::expect_error<std::invalid_argument>([&] { same.load_state_dict(bad); },
                                               {"unexpected tensor", "state.1.exp_avg_absmax"});
  EXPECT_EQ(same.state(0).step, 0);  // nothing changed
}

TEST(AdamW8bit, RejectsBadOptionsNamingThem) {
  Tensor a = param(std::vector<double>(8, 1.0));
  for (const int64_t bs : {0, -256, 32, 100, 8192})
    testing::expect_error<std::invalid_argument>(
        [&] { AdamW8bit({a}, AdamOptions{}, AdamW8bitOptions{.block_size = bs}); },
        {"AdamW8bit", "block_size", std::to_string(bs).c_str()});
  testing::expect_error<std::invalid_argument>(
      [&] { AdamW8bit({a}, AdamOptions{}, AdamW8bitOptions{.min_8bit_size = -1}); },
      {"AdamW8bit", "min_8bit_size", "-1"});
  testing::expect_error<std::invalid_argument>(
      [&] { AdamW8bit({a}, AdamOptions{.amsgrad = true}); }, {"AdamW8bit", "amsgrad"});
  for (const double bad : {-0.1, std::nan("")}) {
    testing::expect_error<std::invalid_argument>([&] { AdamW8bit({a}, AdamOptions{.lr = bad}); },
                                                 {"AdamW8bit", "learning rate"});
    testing::expect_error<std::invalid_argument>(
        [&] { AdamW8bit({a}, AdamOptions{.weight_decay = bad}); }, {"AdamW8bit", "weight_decay"});
    testing::expect_error<std::invalid_argument>([&] { AdamW8bit({a}, AdamOptions{.eps = bad}); },
                                                 {"AdamW8bit", "epsilon"});
  }
  testing::expect_error<std::invalid_argument>([&] { AdamW8bit({a}, AdamOptions{.beta2 = 1.0}); },
                                               {"AdamW8bit", "beta2", "1"});
  Tensor d = param({1.0, 2.0}, DType::float64);
  testing::expect_error<std::invalid_argument>(
      [&] {
        AdamW8bit({a, d});
      },
      {"AdamW8bit", "parameter 1", "float64"});
  AdamW8bit opt({a});
  testing::expect_error<std::invalid_argument>(
      [&] {
        opt.add_param_group({{d}, {}});
        a.set_grad(ops::zeros({8}));
        d.set_grad(ops::zeros({2}, DType::float64));
        opt.step();
      },
      {"AdamW8bit", "parameter 1", "float64"});
  EXPECT_STREQ(opt.name(), "AdamW8bit");
  testing::expect_error<std::invalid_argument>(
      [&] { optim::quantize_blockwise(ops::zeros({4}), true, 48); }, {"quantize_blockwise", "48"});
}

// Two steps of AdamW8bit over an 8-bit and a float32-state parameter on `d`.
void two_steps(Device d) {
  Tensor big = ops::zeros({300000}, DType::float32, d),
         small = ops::zeros({100}, DType::float32, d);
  big.requires_grad_(true);
  small.requires_grad_(true);
  AdamW8bit opt({big, small}, AdamOptions{.lr = 1e-3});
  for (int s = 0; s < 2; ++s) {
    big.set_grad(ops::full({300000}, 0.5, DType::float32, d));
    small.set_grad(ops::full({100}, -0.5, DType::float32, d));
    opt.step();
  }
}

TEST(AdamW8bit, MetaDryRunAllocatesTheCpuRunsState) {
  auto& cpu = memory::get_allocator(Device::cpu());
  const int64_t base = state_bytes();
  memory::reset_peak_memory_stats(Device::cpu());
  two_steps(Device::cpu());
  const int64_t real = cpu.stats().cat_bytes(Category::optimizer_state).peak - base;
  // 300000 codes twice, 1172 scales twice; 100 floats twice (each rounded up to 512 bytes).
  auto r512 = [](int64_t n) { return (n + 511) / 512 * 512; };
  EXPECT_EQ(real, 2 * r512(300000) + 2 * r512(1172 * 4) + 2 * r512(400)) << "CPU run";
  for (const char* target : {"cpu", "h200"}) {
    memory::DryRun dry({.target = target});
    two_steps(dry.device());
    const memory::DeviceStats st = memory::get_allocator(dry.device()).stats();
    EXPECT_EQ(st.cat_bytes(Category::optimizer_state).peak, real) << target;
    EXPECT_EQ(st.cat_bytes(Category::temporary).current, 0) << target;
    // On the CUDA target each fused launch held its chunk table: 5 chunks and 1 entry.
    if (std::string(target) == "h200") {
      EXPECT_GT(st.cat_bytes(Category::temporary).peak, 0);
    }
    const memory::Estimate e = dry.finish();
    EXPECT_TRUE(e.unreplayed.empty()) << target;
  }
}

}  // namespace
}  // namespace tally
