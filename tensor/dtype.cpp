#include "tensor/dtype.h"

#include <fmt/format.h>

#include <iterator>

namespace tally {

namespace {

// What Tally knows of each dtype, in DType's order.
struct DTypeInfo {
  size_t size;       // bytes per element
  const char* name;  // PyTorch's name
  int rank;          // PyTorch's promotion order (float16 and bfloat16 tie)
};
constexpr DTypeInfo kDTypes[] = {
    {4, "float32", 5}, {2, "float16", 4}, {2, "bfloat16", 4}, {8, "float64", 6},
    {4, "int32", 2},   {8, "int64", 3},   {1, "bool", 0},     {1, "uint8", 1},
};
static_assert(std::size(kDTypes) == static_cast<size_t>(DType::uint8) + 1);

// The entry of t; nullptr for a value outside the enum.
const DTypeInfo* info(DType t) {
  const auto i = static_cast<size_t>(t);
  return i < std::size(kDTypes) ? &kDTypes[i] : nullptr;
}

}  // namespace

size_t dtype_size(DType t) {
  const DTypeInfo* d = info(t);
  return d ? d->size : 0;
}

const char* dtype_name(DType t) {
  const DTypeInfo* d = info(t);
  return d ? d->name : "?";
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  auto rank = [](DType t) {
    const DTypeInfo* d = info(t);
    return d ? d->rank : 0;
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
