// FP8 (OCP 8-bit floating point) as the device converts it, in plain C++ that nvcc also compiles for the GPU:
//   e4m3 ("E4M3FN"): sign, 4 exponent bits (bias 7), 3 fraction bits; no infinity, NaN = S.1111.111; largest
//                    finite value 448, smallest normal 2^-6, subnormals down to 2^-9;
//   e5m2:            sign, 5 exponent bits (bias 15), 2 fraction bits; IEEE-like (infinity S.11111.00, NaN
//                    S.11111.xx); largest finite value 57344, smallest normal 2^-14, subnormals down to 2^-16.
// float -> fp8 is PTX's cvt.rn.satfinite: round to nearest, ties to even, subnormals kept; anything of magnitude
// above the largest finite value (infinity included) becomes +-that value; NaN stays NaN (sign | 0x7F); zero keeps
// its sign; magnitudes up to half the smallest subnormal round to +-0. fp8 -> float is exact.
//
// Per-tensor scaling (fp8_scale): the tensor x is stored as q = fp8(x * s) with s a power of two such that
// amax(x) * s <= the largest finite value (the largest such power, so amax * s lies in (max / 2, max]); its
// dequantisation factor is 1 / s, also a power of two, so scaling and unscaling are exact and the only rounding is
// the cast's. s = 1 when amax is 0 or not finite (a NaN or Inf tensor stays NaN / saturates: the loss shows it);
// s is kept within [2^-126, 2^126] so that s and 1 / s are normal floats.
#pragma once
#include <cstdint>
#include <cstring>

#include "model/host_device.h"

// One code path for host and device (model/host_device.h): memcpy for the bit casts, which nvcc compiles in device
// code as a register move.
#define GPT2_FP8_HD inline GPT2CORE_HOST_DEVICE

namespace gpt2 {

enum class Fp8Kind : int { E4M3 = 0, E5M2 = 1 };

GPT2_FP8_HD uint32_t fp8_float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
GPT2_FP8_HD float fp8_bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// The format's constants: fraction bits, exponent bias, the largest finite code and its value.
struct Fp8Format {
  int mbits, bias;
  uint32_t max_code;
  float max_value;
};
GPT2_FP8_HD Fp8Format fp8_format(Fp8Kind k) {
  return k == Fp8Kind::E4M3 ? Fp8Format{3, 7, 0x7Eu, 448.0f} : Fp8Format{2, 15, 0x7Bu, 57344.0f};
}
GPT2_FP8_HD float fp8_max(Fp8Kind k) { return fp8_format(k).max_value; }

// float -> fp8 bits: round to nearest even, saturating to the largest finite value (cvt.rn.satfinite).
GPT2_FP8_HD uint8_t float_to_fp8(float x, Fp8Kind k) {
  const Fp8Format f = fp8_format(k);
  const uint32_t u = fp8_float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | 0x7Fu);                      // NaN
  if (a >= fp8_float_bits(f.max_value)) return uint8_t(sign | f.max_code);  // saturate (Inf included)
  const uint32_t drop = uint32_t(23 - f.mbits);                           // fraction bits rounded away
  const uint32_t e32 = a >> 23;                                            // biased float exponent
  if (int(e32) - 127 >= 1 - f.bias) {  // normal in fp8: rebias the exponent, round away `drop` fraction bits
    uint32_t r = a - (uint32_t(127 - f.bias) << 23);
    r += ((1u << (drop - 1)) - 1u) + ((r >> drop) & 1u);  // a carry into the exponent is the right result
    return uint8_t(sign | (r >> drop));                   // below max_value: never past the largest code
  }
  // subnormal in fp8 (or zero): in units of the smallest subnormal 2^(1 - bias - mbits), the value is
  // m * 2^(e32 - 150 - (1 - bias - mbits)) = m >> sh, rounded to nearest even
  if (e32 == 0) return uint8_t(sign);  // float zero or subnormal: far below half the smallest fp8 subnormal
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const int sh = 150 + (1 - f.bias - f.mbits) - int(e32);  // >= 21 here
  if (sh > 25) return uint8_t(sign);                       // below half the smallest subnormal
  uint32_t r = m >> sh;
  const uint32_t rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1);
  if (rem > half || (rem == half && (r & 1u))) r++;  // r = 1 << mbits is the smallest normal, correctly encoded
  return uint8_t(sign | r);
}

// fp8 bits -> float (exact).
GPT2_FP8_HD float fp8_to_float(uint8_t b, Fp8Kind k) {
  const Fp8Format f = fp8_format(k);
  const uint32_t sign = uint32_t(b & 0x80u) << 24, mag = b & 0x7Fu;
  const uint32_t e = mag >> f.mbits, frac = mag & ((1u << f.mbits) - 1u);
  const uint32_t emax = (1u << (7 - f.mbits)) - 1u;
  if (k == Fp8Kind::E4M3 && mag == 0x7Fu) return fp8_bits_float(sign | 0x7fc00000u);  // NaN
  if (k == Fp8Kind::E5M2 && e == emax) return fp8_bits_float(sign | (frac ? 0x7fc00000u : 0x7f800000u));
  if (e != 0) return fp8_bits_float(sign | ((e - uint32_t(f.bias) + 127u) << 23) | (frac << (23 - f.mbits)));
  // subnormal: frac * 2^(1 - bias - mbits), exact in float
  const float v = float(frac) * fp8_bits_float(uint32_t(127 + 1 - f.bias - f.mbits) << 23);
  return fp8_bits_float(sign | fp8_float_bits(v));
}

// The per-tensor scale of a tensor of largest magnitude amax (see the header): the largest power of two s with
// amax * s <= fp8_max(k), within [2^-126, 2^126]; 1 for amax 0, Inf or NaN.
GPT2_FP8_HD float fp8_scale(float amax, Fp8Kind k) {
  const uint32_t a = fp8_float_bits(amax) & 0x7fffffffu;
  if (a == 0 || a >= 0x7f800000u) return 1.0f;
  const uint32_t mx = fp8_float_bits(fp8_max(k));
  // amax = ma * 2^ea, max = mm * 2^em (ma, mm in [1, 2)): amax * 2^e <= max iff e <= em - ea - (ma > mm)
  int ea, ma;
  if (a >= 0x00800000u) {
    ea = int(a >> 23) - 127, ma = int(a & 0x7fffffu);
  } else {  // subnormal amax: normalise its fraction
    int lz = 0;
    uint32_t fr = a;
    while (!(fr & 0x800000u)) fr <<= 1, lz++;
    ea = -126 - lz, ma = int(fr & 0x7fffffu);
  }
  const int em = int(mx >> 23) - 127, mm = int(mx & 0x7fffffu);
  int e = em - ea - (ma > mm ? 1 : 0);
  e = e < -126 ? -126 : e > 126 ? 126 : e;
  return fp8_bits_float(uint32_t(e + 127) << 23);
}

}  // namespace gpt2
