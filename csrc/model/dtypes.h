// Storage types of the model, seen from plain C++ (no CUDA headers).
//
// A model is GPT2Model<T>: T is the type the ops read and write (parameters as the ops see them, activations),
// Master<T> the type of everything that must not lose precision: master weights, gradients, AdamW moments and
// per-row statistics (layernorm mean/rstd, attention logsumexp, losses).
//   float   (fp32 / tf32): Master = float, and the parameters are their own master copy;
//   double  (CPU, tests):  Master = double, likewise;
//   bf16    (CUDA):        Master = float: fp32 master weights, gradients and optimizer state, with a bf16
//                          copy of the weights (rewritten by every optimizer step) and bf16 activations.
//   f16     (CUDA):        the same with IEEE half precision (fp16) for the copy and the activations.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace gpt2 {

// The bits of a float and back (std::bit_cast before C++20).
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bfloat16 as 16 raw bits: the top half of an IEEE float. The CUDA backend reinterprets it as __nv_bfloat16.
struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 must be 2 bytes");

inline float bf16_to_float(bf16 x) { return bits_float(uint32_t(x.bits) << 16); }

// Round to nearest, ties to even; NaN stays NaN (quiet).
inline bf16 float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

// IEEE 754 binary16 (fp16) as 16 raw bits: sign, 5 exponent bits (bias 15), 10 fraction bits; largest finite
// value 65504, smallest normal 2^-14, subnormals down to 2^-24. The CUDA backend reinterprets it as __half.
struct f16 {
  uint16_t bits;
};
static_assert(sizeof(f16) == 2, "f16 must be 2 bytes");

// Exact: every fp16 value is a float.
inline float f16_to_float(f16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16, exp = (x.bits >> 10) & 0x1fu, frac = x.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (frac << 13));  // Inf, or NaN keeping its payload
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (frac << 13));  // rebias 15 -> 127
  // subnormal (or zero): frac * 2^-24, exact in float
  return bits_float(sign | float_bits(float(frac) * (1.0f / 16777216.0f)));
}

// Round to nearest, ties to even, subnormals included; |f| >= 65520 (halfway from 65504 to 2^16) becomes Inf;
// NaN stays NaN (quiet, the top payload bits kept).
inline f16 float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u | (a >> 13))};
  if (a >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};
  if (a >= 0x38800000u) {  // normal in fp16 (>= 2^-14): rebias the exponent, round away 13 fraction bits
    uint32_t r = a - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);  // a carry into the exponent is the right result (up to 65504)
    return f16{uint16_t(sign | (r >> 13))};
  }
  if (a <= 0x33000000u) return f16{sign};  // at most 2^-25, half the smallest subnormal: ties to even, to 0
  // subnormal: the value is m * 2^(e - 150), in units of 2^-24 that is m >> (126 - e), rounded
  const uint32_t m = (a & 0x7fffffu) | 0x800000u, s = 126u - (a >> 23);  // s in [14, 24]
  uint32_t r = m >> s;
  const uint32_t rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
  if (rem > half || (rem == half && (r & 1u))) r++;  // r = 0x400 is the smallest normal, correctly encoded
  return f16{uint16_t(sign | r)};
}

// A 16-bit storage value widened to float (exact).
inline float widen(bf16 x) { return bf16_to_float(x); }
inline float widen(f16 x) { return f16_to_float(x); }

template <typename T>
struct MasterOf {
  using type = T;
};
template <>
struct MasterOf<bf16> {
  using type = float;
};
template <>
struct MasterOf<f16> {
  using type = float;
};
template <typename T>
using Master = typename MasterOf<T>::type;

// true when the ops' parameters are a rounded copy of separate master weights
template <typename T>
inline constexpr bool kHasMasterCopy = !std::is_same_v<T, Master<T>>;

}  // namespace gpt2
