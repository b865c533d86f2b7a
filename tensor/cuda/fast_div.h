// Division of unsigned 32-bit numerators below 2^31 by a divisor fixed at launch time, as one
// multiply-high, an add and a shift (the round-up reciprocal method: m = floor(2^32 (2^s - d) / d)
// + 1 with s = ceil(log2 d); then n / d = (umulhi(n, m) + n) >> s, and umulhi(n, m) + n < 2^32
// while n < 2^31). Kernels that turn a flat index into (plane, row, column) use it instead of
// 64-bit `/` and `%`, which compile to a long instruction sequence each. Plain C++ on the host, so
// the CPU tests check it exhaustively near the edges.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define TALLY_HD __host__ __device__ __forceinline__
#else
#define TALLY_HD inline
#endif

namespace tally::cuda {

struct FastDiv {
  static constexpr uint32_t kMaxNumerator = 0x7fffffffu;  // numerators must stay below 2^31

  uint32_t divisor = 1, multiplier = 1, shift = 0;

  FastDiv() = default;
  explicit FastDiv(int64_t d) {
    if (d < 1 || d > kMaxNumerator)
      throw std::invalid_argument("FastDiv: divisor must be in [1, 2^31), got " +
                                  std::to_string(d));
    divisor = static_cast<uint32_t>(d);
    shift = 0;
    while ((uint64_t{1} << shift) < divisor) ++shift;
    multiplier = static_cast<uint32_t>(
        ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
  }

  TALLY_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, multiplier);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * multiplier) >> 32);
#endif
    return (hi + n) >> shift;
  }
  // n / divisor and n % divisor.
  TALLY_HD void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

}  // namespace tally::cuda

#undef TALLY_HD
