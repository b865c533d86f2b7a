// Checked size arithmetic: the one helper every element count, byte size, allocator rounding
// and file-header dimension goes through (issue 22). Each function returns the exact result or
// throws, and the message starts with the caller's `what` (the op, the allocator call, or the
// file and byte offset), then says which numbers overflowed:
//
//   checked_mul, checked_add, checked_round_up   std::overflow_error when the result does not
//                                                fit in T (both operands of one type T)
//   checked_numel(dims, what)                    the product of a shape's dimensions, int64;
//   checked_nbytes(dims, element_size, what)     that times element_size, at most 2^63 - 1:
//                                                std::invalid_argument for a negative
//                                                dimension, std::length_error when too large
//   try_numel, try_nbytes                        the same without throwing (false), for hot
//                                                paths whose context is costly to build
// When a shape is too large, and the cost: docs/notes.md §29.
#pragma once

#include <concepts>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace tally::base {

inline constexpr int64_t kMaxElements = std::numeric_limits<int64_t>::max();
inline constexpr uint64_t kMaxBytes = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

namespace detail {

template <std::integral T>
std::string type_name() {
  return std::string(std::is_signed_v<T> ? "a signed " : "an unsigned ") +
         std::to_string(8 * sizeof(T)) + "-bit integer";
}

template <std::integral T>
[[noreturn, gnu::cold, gnu::noinline]] void overflow(std::string_view what, T a, const char* op,
                                                     T b) {
  throw std::overflow_error(std::string(what) + ": " + std::to_string(a) + " " + op + " " +
                            std::to_string(b) + " overflows " + type_name<T>());
}

template <class Range>
std::string dims_str(const Range& dims) {
  std::string s = "[";
  bool first = true;
  for (auto d : dims) {
    s += (first ? "" : ", ") + std::to_string(d);
    first = false;
  }
  return s + "]";
}

template <class Range>
[[noreturn, gnu::cold, gnu::noinline]] void negative_dim(std::string_view what, const Range& dims) {
  throw std::invalid_argument(std::string(what) + ": negative dimension in shape " +
                              dims_str(dims));
}

template <class Range>
[[noreturn, gnu::cold, gnu::noinline]] void too_many_elements(std::string_view what,
                                                              const Range& dims) {
  throw std::length_error(std::string(what) + ": shape " + dims_str(dims) +
                          " has more than 2^63 - 1 elements");
}

template <class Range>
[[noreturn, gnu::cold, gnu::noinline]] void too_many_bytes(std::string_view what, const Range& dims,
                                                           uint64_t elem) {
  throw std::length_error(std::string(what) + ": a tensor of shape " + dims_str(dims) + " with " +
                          std::to_string(elem) + "-byte elements is larger than 2^63 - 1 bytes");
}

// a Op b for Op '*' or '+', or std::overflow_error "<what>: a Op b overflows ...".
template <char Op, std::integral T>
[[nodiscard]] T checked_arith(T a, T b, std::string_view what) {
  static_assert(Op == '*' || Op == '+');
  constexpr char op_str[] = {Op, '\0'};
  T r;
  bool overflowed;
  if constexpr (Op == '*')
    overflowed = __builtin_mul_overflow(a, b, &r);
  else
    overflowed = __builtin_add_overflow(a, b, &r);
  if (overflowed) [[unlikely]]
    overflow(what, a, op_str, b);
  return r;
}

}  // namespace detail

// a * b, or std::overflow_error "<what>: a * b overflows ...".
template <std::integral T>
[[nodiscard]] T checked_mul(T a, T b, std::string_view what) {
  return detail::checked_arith<'*'>(a, b, what);
}

// a + b, or std::overflow_error "<what>: a + b overflows ...".
template <std::integral T>
[[nodiscard]] T checked_add(T a, T b, std::string_view what) {
  return detail::checked_arith<'+'>(a, b, what);
}

// n rounded up to a multiple of step (> 0), or std::overflow_error when that does not fit.
template <std::unsigned_integral T>
[[nodiscard]] T checked_round_up(T n, T step, std::string_view what) {
  if (step == 0) [[unlikely]]
    throw std::invalid_argument(std::string(what) + ": rounding " + std::to_string(n) +
                                " up to a multiple of 0");
  const T rem = n % step;
  if (rem == 0) return n;
  T r;
  if (__builtin_add_overflow(n, step - rem, &r)) [[unlikely]]
    detail::overflow(what, n, "rounded up to a multiple of", step);
  return r;
}

// The number of elements of a shape (any range of integers) in *out; false, leaving *out
// unspecified, for a negative dimension or a shape too large as described above. For callers
// that build their error context only when it is needed (then call checked_numel).
template <class Range>
[[nodiscard]] bool try_numel(const Range& dims, int64_t* out) {
  int64_t n = 1;
  bool zero = false;
  for (auto d : dims) {
    if constexpr (std::is_unsigned_v<decltype(d)>) {
      if (d > static_cast<uint64_t>(kMaxElements)) return false;
    }
    const auto v = static_cast<int64_t>(d);
    if (v < 0 || __builtin_mul_overflow(n, v == 0 ? 1 : v, &n)) return false;
    zero |= v == 0;
  }
  *out = zero ? 0 : n;
  return true;
}

// The bytes of a contiguous tensor of that shape in *out: try_numel * element_size, at most
// 2^63 - 1; false when it does not fit.
template <class Range>
[[nodiscard]] bool try_nbytes(const Range& dims, uint64_t element_size, uint64_t* out) {
  int64_t n;
  return try_numel(dims, &n) &&
         !__builtin_mul_overflow(static_cast<uint64_t>(n), element_size, out) && *out <= kMaxBytes;
}

// try_numel, or std::invalid_argument (a negative dimension) / std::length_error naming `what`
// and the shape.
template <class Range>
[[nodiscard]] int64_t checked_numel(const Range& dims, std::string_view what) {
  int64_t n;
  if (try_numel(dims, &n)) [[likely]]
    return n;
  for (auto d : dims)
    if constexpr (std::is_signed_v<decltype(d)>)
      if (d < 0) detail::negative_dim(what, dims);
  detail::too_many_elements(what, dims);
}

// try_nbytes, or the errors of checked_numel, or std::length_error naming `what`, the shape
// and the element size when the bytes exceed 2^63 - 1.
template <class Range>
[[nodiscard]] uint64_t checked_nbytes(const Range& dims, uint64_t element_size,
                                      std::string_view what) {
  uint64_t bytes;
  if (try_nbytes(dims, element_size, &bytes)) [[likely]]
    return bytes;
  (void)checked_numel(dims, what);  // throws for a bad shape
  detail::too_many_bytes(what, dims, element_size);
}

}  // namespace tally::base
