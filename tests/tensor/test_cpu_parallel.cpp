// The CPU kernels' parallel loops (tensor/cpu/parallel.h) at sizes above the parallel grain:
// every op gives the same bits with 1, 2 and 3 threads (maps, and outputs split between
// threads, compute each element as the serial loop does; a full sum adds fixed blocks in
// order), sums agree with a float64 reference, an exception thrown inside a parallel loop
// reaches the caller, and the bulk float16 conversions agree with Half's scalar ones on
// every input. Without OpenMP (a TSan build) the thread counts are all 1 and the same
// checks hold trivially.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tensor/cpu/parallel.h"  // kParallelGrain
#include "tensor/cpu/threads.h"
#include "tensor/norm/ops.h"
#include "tensor/ops.h"
#include "tensor/pool/ops.h"
#include "tensor/reduce/ops.h"
#include "tensor/softmax/ops.h"

namespace tally {
namespace {

// Elements enough for several parallel ranges of the grain.
constexpr int64_t kLarge = 5 * cpu::kParallelGrain + 1234;

std::vector<uint8_t> bits(const Tensor& t) {
  const Tensor c = ops::contiguous(t);
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.numel() * static_cast<int64_t>(dtype_size(c.dtype())));
}

// Runs f with 1, 2 and 3 threads; every tensor it returns must have the same bits each time.
void expect_same_bits_for_any_thread_count(const std::string& what,
                                           const std::function<std::vector<Tensor>()>& f) {
  const int before = cpu::num_threads();
  std::vector<std::vector<uint8_t>> serial;
  for (int threads : {1, 2, 3}) {
    cpu::set_num_threads(threads);
    const std::vector<Tensor> got = f();
    if (threads == 1) {
      for (const Tensor& t : got) serial.push_back(bits(t));
      continue;
    }
    ASSERT_EQ(got.size(), serial.size()) << what;
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(bits(got[i]) == serial[i])
          << what << ": output " << i << " differs between 1 and " << threads << " threads";
  }
  cpu::set_num_threads(before);
}

Tensor randn(const Shape& shape, DType dtype = DType::float32, uint64_t seed = 1) {
  Generator g(seed);
  return ops::to(ops::randn(shape, DType::float32, Device::cpu(), &g), dtype);
}

TEST(CpuParallel, ElementwiseMapsGiveTheSameBitsOnAnyThreadCount) {
  for (DType dt : {DType::float32, DType::bfloat16, DType::float16, DType::float64}) {
    const Tensor x = randn({kLarge / 64, 64}, dt, 1), y = randn({kLarge / 64, 64}, dt, 2);
    const Tensor row = randn({64}, dt, 3);
    const Tensor xt = ops::transpose(randn({64, kLarge / 64}, dt, 4), 0, 1);  // strided runs
    expect_same_bits_for_any_thread_count(std::string("maps ") + dtype_name(dt), [&] {
      return std::vector<Tensor>{
          ops::unary(ops::UnaryOp::relu, x),
          ops::unary(ops::UnaryOp::exp, x),
          ops::unary(ops::UnaryOp::relu, xt),
          ops::add(x, y),
          ops::mul(x, row),  // broadcast
          ops::sub(xt, y),
          ops::div(x, y),
          ops::binary(ops::BinaryOp::relu_backward, x, y),
          ops::binary(ops::BinaryOp::maximum, x, y),
          ops::binary(ops::BinaryOp::gt, x, y),
          ops::add(x, 0.5),
          ops::clamp(x, -0.5, 0.5),
          ops::where(ops::binary(ops::BinaryOp::gt, x, y), x, y),
          ops::to(x, DType::float32),
          ops::to(x, DType::bfloat16),
          ops::to(x, DType::float16),
          ops::to(xt, DType::float64),
          ops::full({kLarge}, 0.25, dt),
      };
    });
  }
  // Random fills: element i from Philox block i / 4 whatever range a thread starts at.
  expect_same_bits_for_any_thread_count("random", [] {
    Generator g(7);
    return std::vector<Tensor>{ops::rand({kLarge}, DType::float32, Device::cpu(), &g),
                               ops::randn({kLarge + 3}, DType::bfloat16, Device::cpu(), &g)};
  });
}

TEST(CpuParallel, SumsAreDeterministicAndMatchAFloat64Sum) {
  const int64_t rows = 4099, cols = 257;  // > kLarge elements, odd sizes
  for (DType dt : {DType::float32, DType::bfloat16}) {
    const Tensor x = ops::add(randn({rows, cols}, dt, 5), 0.25);  // a mean away from 0
    const Tensor xt = ops::transpose(randn({cols, rows}, dt, 6), 0, 1);
    expect_same_bits_for_any_thread_count(std::string("sums ") + dtype_name(dt), [&] {
      return std::vector<Tensor>{ops::sum(x),          ops::sum(x, {0}),
                                 ops::sum(x, {1}),     ops::sum(xt),
                                 ops::sum(xt, {0}),    ops::sum(xt, {1}),
                                 ops::mean(x, {0, 1}), ops::sum(ops::to(x, DType::int64))};
    });
    // Against float64 sums of the same (rounded) values.
    const std::vector<double> v = ops::to_vector(x);
    double total = 0.0, total_abs = 0.0;
    std::vector<double> col(static_cast<size_t>(cols), 0.0);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const double e = v[static_cast<size_t>(i * cols + j)];
        total += e;
        total_abs += std::fabs(e);
        col[static_cast<size_t>(j)] += e;
      }
    for (int threads : {1, 2}) {
      cpu::set_num_threads(threads);
      const Tensor s = ops::to(ops::sum(ops::to(x, DType::float32)), DType::float64);
      EXPECT_NEAR(ops::to_vector(s)[0], total, 1e-7 * total_abs) << dtype_name(dt);
      const std::vector<double> sc = ops::to_vector(ops::sum(ops::to(x, DType::float32), {0}));
      for (int64_t j = 0; j < cols; ++j)
        EXPECT_NEAR(sc[static_cast<size_t>(j)], col[static_cast<size_t>(j)],
                    1e-6 * (1.0 + std::fabs(col[static_cast<size_t>(j)])));
    }
  }
  cpu::set_num_threads(2);
}

TEST(CpuParallel, NormsPoolsSoftmaxAndReductionsGiveTheSameBitsOnAnyThreadCount) {
  for (DType dt : {DType::float32, DType::bfloat16}) {
    const Tensor x = randn({kLarge / 256, 256}, dt, 8), g = randn({kLarge / 256, 256}, dt, 9);
    const Tensor w = randn({256}, DType::float32, 10), b = randn({256}, DType::float32, 11);
    const Tensor img = randn({4, 16, 40, 40}, dt, 12), gimg = randn({4, 16, 20, 20}, dt, 13);
    const Tensor rm = ops::zeros({16}), rv = ops::ones({16});
    expect_same_bits_for_any_thread_count(std::string("norms ") + dtype_name(dt), [&] {
      std::vector<Tensor> out;
      auto [y, mean, rstd] = ops::layer_norm(x, {256}, w, b);
      auto [dx, dw, db] = ops::layer_norm_backward(g, x, {256}, mean, rstd, w, {true, true, true});
      out.insert(out.end(), {y, mean, rstd, dx, dw, db});
      const Tensor img32 = ops::to(img, DType::float32);
      auto [bn, bmean, binvstd] = ops::batch_norm(img32, rm, rv, Tensor(), Tensor(), true);
      auto [bdx, bdw, bdb] =
          ops::batch_norm_backward(ops::to(img, DType::float32), img32, bmean, binvstd, Tensor(),
                                   true, {true, false, false});
      out.insert(out.end(), {bn, bmean, binvstd, bdx});
      auto [pooled, idx] = ops::max_pool2d_with_indices(img, Int2{3, 3}, Int2{2, 2}, Int2{1, 1});
      out.insert(out.end(), {pooled, idx,
                             ops::max_pool2d_backward(gimg, idx, img.sizes(), Int2{3, 3},
                                                      Int2{2, 2}, Int2{1, 1})});
      out.push_back(ops::avg_pool2d(img, Int2{2, 2}));
      out.push_back(ops::avg_pool2d_backward(gimg, img.sizes(), Int2{2, 2}));
      out.push_back(ops::adaptive_avg_pool2d(img, Int2{3, 3}));
      const Tensor sm = ops::softmax(x, 1);
      out.insert(out.end(), {sm, ops::log_softmax(x, 0), ops::softmax_backward(g, sm, 1)});
      auto [mx, mi] = ops::max(x, 1);
      out.insert(out.end(), {mx, mi, ops::amax(x, {0}), ops::var(x, {1}), ops::logsumexp(x, {1}),
                             ops::amin(ops::transpose(x, 0, 1), {1})});
      return out;
    });
  }
}

TEST(CpuParallel, AnExceptionInsideAParallelLoopReachesTheCaller) {
  cpu::set_num_threads(2);
  const Tensor img = randn({8, 16, 32, 32});
  auto [pooled, idx] = ops::max_pool2d_with_indices(img, Int2{2, 2});
  Tensor bad = ops::clone(idx);
  bad.data<int64_t>()[bad.numel() - 1] = 1 << 20;  // in the last thread's range
  EXPECT_THROW(ops::max_pool2d_backward(ops::ones_like(pooled), bad, img.sizes(), Int2{2, 2}),
               std::out_of_range);
}

// An independent reference for binary16: the field-by-field conversions (rebias, shift,
// round to nearest even by the remainder) that Half used before its branch-free ones.
uint16_t reference_float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // to inf
  if (abs < 0x38800000u) {  // a subnormal half (or zero)
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 113 - static_cast<int>(abs >> 23) + 13;
    if (shift > 24) return static_cast<uint16_t>(sign);
    uint32_t v = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (v & 1u))) ++v;
    return static_cast<uint16_t>(sign | v);
  }
  uint32_t v = abs - 0x38000000u;
  const uint32_t rem = v & 0x1fffu;
  v >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) ++v;
  return static_cast<uint16_t>(sign | v);
}

uint32_t reference_half_to_float_bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return sign | 0x7f800000u | (mant << 13);
  if (exp != 0) return sign | ((exp + 112u) << 23) | (mant << 13);
  if (mant == 0) return sign;
  int e = -1;  // a subnormal: normalise
  do {
    ++e;
    mant <<= 1;
  } while (!(mant & 0x400u));
  return sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3ffu) << 13);
}

TEST(CpuParallel, Float16ConversionsMatchTheReferenceOnEveryInput) {
  // Every binary16 value (NaNs with their payloads, infinities, subnormals) to float32...
  Tensor h = ops::empty({65536}, DType::float16);
  for (uint32_t i = 0; i < 65536; ++i) h.data<Half>()[i].bits = static_cast<uint16_t>(i);
  const Tensor f = ops::to(h, DType::float32);
  for (uint32_t i = 0; i < 65536; ++i) {
    const float scalar = static_cast<float>(h.data<Half>()[i]);
    uint32_t a, b;
    std::memcpy(&a, &scalar, 4);
    std::memcpy(&b, &f.data<float>()[i], 4);
    ASSERT_EQ(a, reference_half_to_float_bits(static_cast<uint16_t>(i))) << "half bits " << i;
    ASSERT_EQ(b, a) << "half bits " << i;
  }
  // ... and float32 values around every binary16 rounding boundary back, with ties, overflow
  // and underflow, and NaN.
  std::vector<float> v;
  for (uint32_t e = 0x30000000u; e < 0x48000000u; e += 0x1000u)
    for (uint32_t d : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x0fffu, 0x2000u})
      for (uint32_t sign : {0u, 0x80000000u}) {
        const uint32_t u = (e + d) | sign;
        float x;
        std::memcpy(&x, &u, 4);
        v.push_back(x);
      }
  v.insert(v.end(), {INFINITY, -INFINITY, NAN, -NAN, 65504.f, 65519.f, 65520.f, 1e-8f, 0.f, -0.f});
  Tensor x = ops::empty({static_cast<int64_t>(v.size())});
  std::memcpy(x.data<float>(), v.data(), v.size() * 4);
  const Tensor back = ops::to(x, DType::float16);
  for (size_t i = 0; i < v.size(); ++i)
    ASSERT_EQ(back.data<Half>()[i].bits, reference_float_to_half(v[i])) << "float " << v[i];
}

}  // namespace
}  // namespace tally
