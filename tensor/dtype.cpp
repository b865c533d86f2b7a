#include "tensor/dtype.h"

#include <fmt/format.h>

namespace tally {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::float32:
      return 4;
    case DType::float16:
      return 2;
    case DType::bfloat16:
      return 2;
    case DType::float64:
      return 8;
    case DType::int32:
      return 4;
    case DType::int64:
      return 8;
    case DType::bool_:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::float32:
      return "float32";
    case DType::float16:
      return "float16";
    case DType::bfloat16:
      return "bfloat16";
    case DType::float64:
      return "float64";
    case DType::int32:
      return "int32";
    case DType::int64:
      return "int64";
    case DType::bool_:
      return "bool";
  }
  return "?";
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  auto rank = [](DType t) {
    switch (t) {
      case DType::bool_:
        return 0;
      case DType::int32:
        return 1;
      case DType::int64:
        return 2;
      case DType::float16:
        return 3;
      case DType::bfloat16:
        return 3;
      case DType::float32:
        return 4;
      case DType::float64:
        return 5;
    }
    return 0;
  };
  // float16 with bfloat16 promotes to float32, as in PyTorch.
  if ((a == DType::float16 && b == DType::bfloat16) ||
      (a == DType::bfloat16 && b == DType::float16))
    return DType::float32;
  return rank(a) >= rank(b) ? a : b;
}

Half::Half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN
    bits = static_cast<uint16_t>(sign | 0x7e00u);
    return;
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
    bits = static_cast<uint16_t>(sign | 0x7c00u);
    return;
  }
  if (abs < 0x38800000u) {  // subnormal half (or zero)
    // Shift the float's value into the 10-bit subnormal field, round to nearest even.
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 113 - static_cast<int>(abs >> 23) + 13;  // 126 - exp + 13
    if (shift > 24) {
      bits = static_cast<uint16_t>(sign);
      return;
    }
    uint32_t v = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (v & 1u))) ++v;
    bits = static_cast<uint16_t>(sign | v);
    return;
  }
  uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15 (in the float layout)
  const uint32_t rem = v & 0x1fffu;
  v >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (v & 1u))) ++v;
  bits = static_cast<uint16_t>(sign | v);
}

Half::operator float() const {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exp = (bits >> 10) & 0x1fu;
  uint32_t mant = bits & 0x3ffu;
  uint32_t out;
  if (exp == 0x1f) {
    out = sign | 0x7f800000u | (mant << 13);
  } else if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while (!(mant & 0x400u));
      out = sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else {
    out = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}

void unsupported_dtype(const char* op, DType t) {
  throw std::invalid_argument(fmt::format("{}: dtype {} is not supported", op, dtype_name(t)));
}

}  // namespace tally
