// base/checked.h: the checked size arithmetic every element count, byte size, allocator
// rounding and file-header dimension goes through. Exact results up to the edges, and an
// exception naming the caller's context and the numbers one past them. base/check_arg.h's
// check_at_least and its message.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "base/check_arg.h"
#include "base/checked.h"

namespace tally::memory {
namespace {

constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();

// Runs f, which must throw E whose message contains every part.
template <class E, class F>
void expect_throw(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

TEST(Checked, MulUnsignedEdges) {
  EXPECT_EQ(base::checked_mul(uint64_t{0}, kU64Max, "x"), 0u);
  EXPECT_EQ(base::checked_mul(kU64Max, uint64_t{1}, "x"), kU64Max);
  EXPECT_EQ(base::checked_mul(uint64_t{1} << 32, (uint64_t{1} << 32) - 1, "x"),
            kU64Max - (uint64_t{1} << 32) + 1);
  expect_throw<std::overflow_error>(
      [] { (void)base::checked_mul(uint64_t{1} << 32, uint64_t{1} << 32, "the op"); },
      {"the op: 4294967296 * 4294967296 overflows an unsigned 64-bit integer"});
  expect_throw<std::overflow_error>([] { (void)base::checked_mul(kU64Max, uint64_t{2}, "m"); },
                                    {"m: 18446744073709551615 * 2 overflows"});
}

TEST(Checked, MulSignedEdges) {
  EXPECT_EQ(base::checked_mul(kI64Max, int64_t{1}, "x"), kI64Max);
  EXPECT_EQ(base::checked_mul(kI64Min, int64_t{1}, "x"), kI64Min);
  EXPECT_EQ(base::checked_mul(int64_t{-3}, int64_t{4}, "x"), -12);
  EXPECT_EQ(base::checked_mul(int64_t{3037000499}, int64_t{3037000499}, "x"),
            int64_t{9223372030926249001});  // floor(sqrt(2^63 - 1)) squared
  expect_throw<std::overflow_error>(
      [] { (void)base::checked_mul(int64_t{3037000500}, int64_t{3037000500}, "sq"); },
      {"sq: 3037000500 * 3037000500 overflows a signed 64-bit integer"});
  expect_throw<std::overflow_error>([] { (void)base::checked_mul(kI64Min, int64_t{-1}, "neg"); },
                                    {"neg: -9223372036854775808 * -1 overflows"});
}

TEST(Checked, AddEdges) {
  EXPECT_EQ(base::checked_add(kU64Max - 1, uint64_t{1}, "x"), kU64Max);
  expect_throw<std::overflow_error>([] { (void)base::checked_add(kU64Max, uint64_t{1}, "a"); },
                                    {"a: 18446744073709551615 + 1 overflows"});
  EXPECT_EQ(base::checked_add(kI64Max, int64_t{-1}, "x"), kI64Max - 1);
  EXPECT_EQ(base::checked_add(kI64Min, int64_t{kI64Max}, "x"), -1);
  expect_throw<std::overflow_error>([] { (void)base::checked_add(kI64Max, int64_t{1}, "b"); },
                                    {"b: 9223372036854775807 + 1 overflows a signed"});
  expect_throw<std::overflow_error>([] { (void)base::checked_add(kI64Min, int64_t{-1}, "c"); },
                                    {"c: -9223372036854775808 + -1 overflows"});
}

TEST(Checked, RoundUpEdges) {
  EXPECT_EQ(base::checked_round_up(uint64_t{0}, uint64_t{512}, "r"), 0u);
  EXPECT_EQ(base::checked_round_up(uint64_t{1}, uint64_t{512}, "r"), 512u);
  EXPECT_EQ(base::checked_round_up(uint64_t{512}, uint64_t{512}, "r"), 512u);
  EXPECT_EQ(base::checked_round_up(uint64_t{1000}, uint64_t{3}, "r"),
            1002u);                    // any step, not only 2^k
  const uint64_t top = kU64Max - 511;  // the last multiple of 512
  EXPECT_EQ(base::checked_round_up(top, uint64_t{512}, "r"), top);
  EXPECT_EQ(base::checked_round_up(top - 1, uint64_t{512}, "r"), top);
  expect_throw<std::overflow_error>(
      [&] { (void)base::checked_round_up(top + 1, uint64_t{512}, "the rounding"); },
      {"the rounding: 18446744073709551105 rounded up to a multiple of 512 overflows"});
  // 2^64 - 2^20 to 2 MiB: the segment size of the issue's empty({2^62 - 2^18}, float32).
  const uint64_t request = kU64Max - (uint64_t{1} << 20) + 1;
  expect_throw<std::overflow_error>(
      [&] { (void)base::checked_round_up(request, uint64_t{2} << 20, "segment"); },
      {"segment: 18446744073708503040 rounded up to a multiple of 2097152 overflows"});
  expect_throw<std::invalid_argument>(
      [] { (void)base::checked_round_up(uint64_t{5}, uint64_t{0}, "z"); },
      {"z: rounding 5 up to a multiple of 0"});
}

TEST(Checked, NumelEdges) {
  EXPECT_EQ(base::checked_numel(std::vector<int64_t>{}, "n"), 1);  // a scalar
  EXPECT_EQ(base::checked_numel(std::vector<int64_t>{2, 3, 4}, "n"), 24);
  EXPECT_EQ(base::checked_numel(std::vector<int64_t>{kI64Max}, "n"), kI64Max);
  EXPECT_EQ(base::checked_numel(std::vector<int64_t>{3, 0, 5}, "n"), 0);
  EXPECT_EQ(base::checked_numel(std::vector<int64_t>{int64_t{1} << 31, int64_t{1} << 31, 0}, "n"),
            0);
  EXPECT_EQ(base::checked_numel(std::array<uint32_t, 2>{65536, 65536}, "n"), int64_t{1} << 32);
  expect_throw<std::length_error>(
      [] {
        (void)base::checked_numel(std::vector<int64_t>{int64_t{1} << 32, int64_t{1} << 32},
                                  "zeros");
      },
      {"zeros: shape [4294967296, 4294967296] has more than 2^63 - 1 elements"});
  // 2^63 exactly: one past the largest count.
  expect_throw<std::length_error>(
      [] {
        (void)base::checked_numel(std::vector<int64_t>{int64_t{1} << 62, 2}, "n");
      },
      {"shape [4611686018427387904, 2]"});
  // Zeros do not excuse the rest: the contiguous strides of [2^32, 2^32, 0] do not fit.
  expect_throw<std::length_error>(
      [] {
        (void)base::checked_numel(std::vector<int64_t>{int64_t{1} << 32, int64_t{1} << 32, 0}, "n");
      },
      {"[4294967296, 4294967296, 0]"});
  expect_throw<std::invalid_argument>(
      [] {
        (void)base::checked_numel(std::vector<int64_t>{2, -1, 3}, "view");
      },
      {"view: negative dimension in shape [2, -1, 3]"});
  // An unsigned dimension past 2^63 - 1 is too large, not negative.
  expect_throw<std::length_error>(
      [] { (void)base::checked_numel(std::vector<uint64_t>{uint64_t{1} << 63}, "u"); },
      {"u: shape [9223372036854775808] has more than"});
  int64_t n = -5;
  EXPECT_TRUE(base::try_numel(std::vector<int64_t>{7, 6}, &n));
  EXPECT_EQ(n, 42);
  EXPECT_FALSE(base::try_numel(std::vector<int64_t>{int64_t{1} << 32, int64_t{1} << 32}, &n));
  EXPECT_FALSE(base::try_numel(std::vector<int64_t>{-2}, &n));
}

TEST(Checked, NbytesEdges) {
  EXPECT_EQ(base::checked_nbytes(std::vector<int64_t>{2, 3}, 4, "b"), 24u);
  EXPECT_EQ(base::checked_nbytes(std::vector<int64_t>{0, 7}, 8, "b"), 0u);
  EXPECT_EQ(base::checked_nbytes(std::vector<int64_t>{kI64Max}, 1, "b"), base::kMaxBytes);
  // (2^62 - 2^18) floats: 2^64 - 2^20 bytes, which fit in 64 bits but not in 63.
  const std::vector<int64_t> issue{(int64_t{1} << 62) - (int64_t{1} << 18)};
  expect_throw<std::length_error>([&] { (void)base::checked_nbytes(issue, 4, "empty"); },
                                  {"empty: a tensor of shape [4611686018427125760] with 4-byte "
                                   "elements is larger than 2^63 - 1 bytes"});
  expect_throw<std::length_error>(
      [] { (void)base::checked_nbytes(std::vector<int64_t>{int64_t{1} << 61}, 8, "e"); },
      {"e: a tensor of shape [2305843009213693952] with 8-byte elements"});
  // A bad shape reports the shape's own error first.
  expect_throw<std::invalid_argument>(
      [] { (void)base::checked_nbytes(std::vector<int64_t>{-1}, 4, "e"); }, {"negative dimension"});
  uint64_t b = 0;
  EXPECT_TRUE(base::try_nbytes(std::vector<int64_t>{(int64_t{1} << 61) - 1}, 4, &b));
  EXPECT_EQ(b, (uint64_t{1} << 63) - 4);
  EXPECT_FALSE(base::try_nbytes(std::vector<int64_t>{int64_t{1} << 61}, 4, &b));  // exactly 2^63
}

TEST(CheckArg, AtLeastPassesTheMinimumAndNamesTheArgumentBelowIt) {
  base::check_at_least(1, 1, "DataLoader: batch_size");
  base::check_at_least(kI64Max, 0, "n");
  expect_throw<std::invalid_argument>([] { base::check_at_least(0, 1, "DataLoader: batch_size"); },
                                      {"DataLoader: batch_size must be >= 1, got 0"});
  expect_throw<std::invalid_argument>([] { base::check_at_least(kI64Min, 0, "randperm: n"); },
                                      {"randperm: n must be >= 0, got -9223372036854775808"});
}

}  // namespace
}  // namespace tally::memory
