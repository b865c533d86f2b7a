// cuda::FastDiv (the multiply-high division CUDA kernels use for index arithmetic) on the host,
// against the hardware's `/` and `%`: every numerator near the edges that break such schemes
// (multiples of the divisor and their neighbours, powers of two, 2^31 - 1) for many divisors.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "tensor/cuda/fast_div.h"

namespace tally::cuda {
namespace {

void expect_matches(const FastDiv& f, uint32_t n) {
  uint32_t q = 0, r = 0;
  f.divmod(n, q, r);
  ASSERT_EQ(q, n / f.divisor) << n << " / " << f.divisor;
  ASSERT_EQ(r, n % f.divisor) << n << " % " << f.divisor;
}

std::vector<uint32_t> divisors() {
  std::vector<uint32_t> d;
  for (uint32_t i = 1; i <= 1100; ++i) d.push_back(i);
  for (uint32_t s = 11; s < 31; ++s)
    for (int64_t delta : {-3, -1, 0, 1, 3})
      d.push_back(static_cast<uint32_t>((int64_t{1} << s) + delta));
  for (uint32_t v :
       {3136u, 12544u, 50176u, 802816u, 65535u, 65537u, 1000003u, 0x7fffffffu, 0x7ffffffeu})
    d.push_back(v);
  return d;
}

TEST(FastDiv, MatchesDivisionAtTheEdgesOfEveryDivisor) {
  const uint32_t kMax = FastDiv::kMaxNumerator;
  for (uint32_t d : divisors()) {
    const FastDiv f(d);
    for (uint32_t n = 0; n < 4096; ++n) expect_matches(f, n);
    // around multiples of d, spread over the range
    for (uint64_t k = 1; k <= 64; ++k) {
      const uint64_t m =
          static_cast<uint64_t>(d) * (kMax / d / 64 * k + (k == 64 ? kMax / d % 64 : 0));
      for (int64_t delta = -2; delta <= 2; ++delta) {
        const int64_t n = static_cast<int64_t>(m) + delta;
        if (n >= 0 && n <= kMax) expect_matches(f, static_cast<uint32_t>(n));
      }
    }
    for (uint32_t n = kMax - 4096; n < kMax; ++n) expect_matches(f, n);
    expect_matches(f, kMax);
    if (HasFatalFailure()) return;
  }
}

TEST(FastDiv, MatchesDivisionOnRandomNumerators) {
  std::mt19937_64 rng(31);
  for (uint32_t d : divisors()) {
    const FastDiv f(d);
    for (int i = 0; i < 2000; ++i)
      expect_matches(f, static_cast<uint32_t>(rng() & FastDiv::kMaxNumerator));
    if (HasFatalFailure()) return;
  }
}

TEST(FastDiv, RejectsDivisorsOutsideItsRange) {
  EXPECT_THROW(FastDiv(0), std::invalid_argument);
  EXPECT_THROW(FastDiv(-5), std::invalid_argument);
  EXPECT_THROW(FastDiv(int64_t{1} << 31), std::invalid_argument);
  try {
    FastDiv bad(0);
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("FastDiv"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tally::cuda
