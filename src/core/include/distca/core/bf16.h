// bfloat16 storage type: the top 16 bits of an IEEE float. Arithmetic is always done in float;
// this type only stores. Conversion from float rounds to nearest, ties to even; NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>

namespace distca {

struct bf16 {
  uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float x) : bits(round_bits(x)) {}
  explicit operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }

  static uint16_t round_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};
static_assert(sizeof(bf16) == 2);

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }

// from_float<T>(x): float to a storage type (identity for float, rounding for bf16).
template <typename T>
T from_float(float x) {
  return T(x);
}

}  // namespace distca
