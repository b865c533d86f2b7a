// Element types: the eight dtypes Tally tensors hold, the 16-bit float storage types,
// and the switch that turns a runtime dtype into a C++ type for a kernel.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "tensor/cpu/convert.h"

namespace tally {

// uint8 comes last (added after the others: the enum's values are written in files and tables
// by this order); it holds bytes such as AdamW8bit's quantization codes.
enum class DType : uint8_t { float32, float16, bfloat16, float64, int32, int64, bool_, uint8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "float32", ...
inline bool is_floating(DType t) {
  return t == DType::float32 || t == DType::float16 || t == DType::bfloat16 || t == DType::float64;
}
// The dtype of an op over a and b (PyTorch's promotion among these types).
DType promote_types(DType a, DType b);

// IEEE binary16, stored; arithmetic happens in float. The conversions are inline and
// branch-free (tensor/cpu/convert.h), so the CPU kernels' loops over float16 vectorize.
struct Half {
  uint16_t bits = 0;
  Half() = default;
  // Round to nearest even; overflow to inf; NaN to sign | 0x7e00.
  Half(float f) : bits(cpu::float_to_half_bits(f)) {}
  operator float() const { return cpu::half_bits_to_float(bits); }
};

// bfloat16, stored; arithmetic happens in float.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  BFloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// The type arithmetic runs in for storage type T: float for the 16-bit floats, T itself
// otherwise.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;

// The DType of C++ type T (the inverse of TALLY_DISPATCH's scalar_t).
template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>)
    return DType::float32;
  else if constexpr (std::is_same_v<T, double>)
    return DType::float64;
  else if constexpr (std::is_same_v<T, Half>)
    return DType::float16;
  else if constexpr (std::is_same_v<T, BFloat16>)
    return DType::bfloat16;
  else if constexpr (std::is_same_v<T, int32_t>)
    return DType::int32;
  else if constexpr (std::is_same_v<T, int64_t>)
    return DType::int64;
  else if constexpr (std::is_same_v<T, bool>)
    return DType::bool_;
  else if constexpr (std::is_same_v<T, uint8_t>)
    return DType::uint8;
  else
    static_assert(sizeof(T) == 0, "dtype_of: no DType for this type");
}

[[noreturn]] void unsupported_dtype(const char* op, DType t);

// A library's code for a floating dtype (cuDNN's or cuBLAS's data type), from its codes for
// float32, float16, bfloat16, float64 (DType's order); unsupported_dtype(op, t) for the others.
template <typename Code>
Code floating_code(DType t, const Code (&codes)[4], const char* op) {
  static_assert(static_cast<int>(DType::float64) == 3, "the floating dtypes come first");
  if (!is_floating(t)) unsupported_dtype(op, t);
  return codes[static_cast<size_t>(t)];
}

}  // namespace tally

// Run BODY with `scalar_t` bound to the C++ type of DTYPE. The _FLOAT form covers the four
// floating types; the _ALL form all eight (the floating ones, then the integers and bool).
#define TALLY_DISPATCH_CASE(ENUM, TYPE, ...) \
  case ::tally::DType::ENUM: {               \
    using scalar_t = TYPE;                   \
    __VA_ARGS__();                           \
    break;                                   \
  }
// The switch over DTYPE with the given cases; any other dtype is unsupported_dtype(OPNAME).
#define TALLY_DISPATCH_SWITCH(DTYPE, OPNAME, ...)  \
  [&] {                                            \
    switch (DTYPE) {                               \
      __VA_ARGS__                                  \
      default:                                     \
        ::tally::unsupported_dtype(OPNAME, DTYPE); \
    }                                              \
  }()
#define TALLY_DISPATCH_FLOAT_CASES(...)                    \
  TALLY_DISPATCH_CASE(float32, float, __VA_ARGS__)         \
  TALLY_DISPATCH_CASE(float64, double, __VA_ARGS__)        \
  TALLY_DISPATCH_CASE(float16, ::tally::Half, __VA_ARGS__) \
  TALLY_DISPATCH_CASE(bfloat16, ::tally::BFloat16, __VA_ARGS__)
#define TALLY_DISPATCH_FLOAT(DTYPE, OPNAME, ...) \
  TALLY_DISPATCH_SWITCH(DTYPE, OPNAME, TALLY_DISPATCH_FLOAT_CASES(__VA_ARGS__))
#define TALLY_DISPATCH_INT_CASES(...)              \
  TALLY_DISPATCH_CASE(int32, int32_t, __VA_ARGS__) \
  TALLY_DISPATCH_CASE(int64, int64_t, __VA_ARGS__) \
  TALLY_DISPATCH_CASE(bool_, bool, __VA_ARGS__)    \
  TALLY_DISPATCH_CASE(uint8, uint8_t, __VA_ARGS__)
#define TALLY_DISPATCH_ALL(DTYPE, OPNAME, ...)                  \
  TALLY_DISPATCH_SWITCH(DTYPE, OPNAME,                          \
                        TALLY_DISPATCH_FLOAT_CASES(__VA_ARGS__) \
                            TALLY_DISPATCH_INT_CASES(__VA_ARGS__))
