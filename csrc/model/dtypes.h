// Storage types of the model, seen from plain C++ (no CUDA headers).
//
// A model is GPT2Model<T>: T is the type the ops read and write (parameters as the ops see them, activations),
// Master<T> the type of everything that must not lose precision: master weights, gradients, AdamW moments and
// per-row statistics (layernorm mean/rstd, attention logsumexp, losses).
//   float   (fp32 / tf32): Master = float, and the parameters are their own master copy;
//   double  (CPU, tests):  Master = double, likewise;
//   bf16    (CUDA):        Master = float: fp32 master weights, gradients and optimizer state, with a bf16
//                          copy of the weights (rewritten by every optimizer step) and bf16 activations.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace gpt2 {

// bfloat16 as 16 raw bits: the top half of an IEEE float. The CUDA backend reinterprets it as __nv_bfloat16.
struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 must be 2 bytes");

inline float bf16_to_float(bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest, ties to even; NaN stays NaN (quiet).
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

template <typename T>
struct MasterOf {
  using type = T;
};
template <>
struct MasterOf<bf16> {
  using type = float;
};
template <typename T>
using Master = typename MasterOf<T>::type;

// true when the ops' parameters are a rounded copy of separate master weights
template <typename T>
inline constexpr bool kHasMasterCopy = !std::is_same_v<T, Master<T>>;

}  // namespace gpt2
