// Branch-free float <-> IEEE binary16 conversions, Half's own (tensor/dtype.h): round to
// nearest even, overflow to inf, NaN to sign | 0x7e00, NaN payloads kept on widening; inline
// and without data-dependent branches, so a loop over a run of elements vectorizes. The technique
// is that of the FP16 library (Maratyszcza), which PyTorch's c10/util/Half.h also uses: the float
// unit does the rounding.
#pragma once

#include <cstdint>
#include <cstring>

namespace tally::cpu {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// binary16 bits -> float.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;  // exponent and mantissa, sign shifted out
  // Normal: move exponent and mantissa into place, rebias by a multiply (exact).
  const float normal = float_of((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
  // Subnormal: the mantissa as the low bits of 0.5's significand, minus 0.5 (exact).
  const float subnormal = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
  // inf and NaN: exponent all ones, the mantissa moved as it is (the multiply above would
  // quiet a signalling NaN; Half's conversion keeps it).
  const uint32_t special = 0x7f800000u | ((two_w >> 4) & 0x007fe000u);
  const uint32_t v = two_w >= 0xf8000000u ? special
                     : two_w < (1u << 27) ? bits_of(subnormal)
                                          : bits_of(normal);
  return float_of(sign | v);
}

// float -> binary16 bits, rounded to nearest even.
inline uint16_t float_to_half_bits(float f) {
  const uint32_t w = bits_of(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  // Scale |f| so that adding 2^(e + 13) - ish rounds it at binary16's precision: the add
  // below leaves the rounded result's exponent and mantissa in the low bits.
  float base = (float_of(shl1_w >> 1) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;  // subnormal results: a fixed rounding point
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits_of(base);
  const uint32_t exp_bits = (b >> 13) & 0x00007c00u;
  const uint32_t mantissa_bits = b & 0x00000fffu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

}  // namespace tally::cpu
