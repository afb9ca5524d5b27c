// Shared helpers of the CUDA backend: error macros that throw, ceil_div, warp and block reductions, and the
// storage-type helpers of the bf16 contract (stated here):
//   the storage type (T in the contract, the template parameter floatX in the kernel files) is float,
//   __nv_bfloat16 or __half (fp16); compute is fp32 in registers:
//     load_f(x) = float(x);  store_t<T>(v) = v rounded to T (round to nearest even for bf16 and fp16; fp16
//     overflows to +-Inf above 65504, which the loss scaler's finiteness check catches)
//   Pack<T, K>: K values of T moved as one aligned access; Vec<T> = Pack<T, 16 / sizeof(T)>, the 16-byte
//   vector of the memory-bound kernels (4 floats or 8 bf16 / fp16).
//   stochastic_round_bf16(x, seed, idx): fp32 bit pattern + a 16-bit hash of (seed, idx), truncated to bf16
//   (rounds away from zero with probability equal to the dropped fraction of an ulp, so E[result] = x);
//   seed 0 = round to nearest even. The fp16 weight copy is rounded to nearest even (round_param): the fp32
//   master keeps every update, and fp16's 11-bit significand makes the copy's rounding error 8x smaller than
//   bf16's, where stochastic rounding keeps the copy unbiased.
// Included by every kernel file; compiles with nvcc and, through cuda/portable.h, with g++ against
// the CUDA-on-CPU emulator (csrc/emu).
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/portable.h"

namespace gpt2::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(e) + " at " + file + ":" +
                           std::to_string(line) + " (" + call + "): " + cudaGetErrorString(e));
}

}  // namespace gpt2::cuda

// Throws std::runtime_error naming the call, file, line and CUDA's message (pybind11 turns it into a
// Python RuntimeError). Never exits.
#define CUDA_CHECK(call)                                                            \
  do {                                                                              \
    cudaError_t gpt2_err_ = (call);                                                 \
    if (gpt2_err_ != cudaSuccess) {                                                 \
      (void)cudaGetLastError(); /* clear a sticky launch error */                   \
      ::gpt2::cuda::throw_cuda_error(gpt2_err_, #call, __FILE__, __LINE__);         \
    }                                                                               \
  } while (0)

// After a LAUNCH: configuration errors (and, in the emulation, kernel failures) surface here.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace gpt2::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

inline int ceil_div(size_t a, size_t b) { return static_cast<int>((a + b - 1) / b); }

// True when every pointer is A-byte aligned.
template <size_t A, class... P>
inline bool aligned_to(const P*... p) {
  return ((reinterpret_cast<uintptr_t>(p) % A == 0) && ...);
}
// True when every pointer is 16-byte aligned: the memory-bound kernels then move one Vec<T> (16 bytes:
// 4 floats or 8 bf16) per access and finish the ragged tail one value at a time; otherwise they fall back
// to one value per thread.
template <class... P>
inline bool aligned16(const P*... p) {
  return aligned_to<16>(p...);
}

// ----------------------------------------------------------------------------------------- storage types
using bf16 = __nv_bfloat16;

using f16 = __half;

template <class T>
constexpr bool kIsBF16 = std::is_same<T, bf16>::value;
template <class T>
constexpr bool kIsF16 = std::is_same<T, f16>::value;
// a 16-bit storage type: the parameters the ops read are a rounded copy of fp32 master weights
template <class T>
constexpr bool kIs16Bit = kIsBF16<T> || kIsF16<T>;

// T -> float (exact) and float -> T (round to nearest even).
__host__ __device__ inline float load_f(float x) { return x; }
__host__ __device__ inline float load_f(bf16 x) { return __bfloat162float(x); }
__host__ __device__ inline float load_f(f16 x) { return __half2float(x); }
template <class T>
__host__ __device__ inline T store_t(float v);
template <>
__host__ __device__ inline float store_t<float>(float v) {
  return v;
}
template <>
__host__ __device__ inline bf16 store_t<bf16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__host__ __device__ inline f16 store_t<f16>(float v) {
  return __float2half_rn(v);
}

// K values of T as one aligned access (K * sizeof(T) bytes: 8 or 16). Loaded and stored whole through
// the pointer casts below, so the compiler emits one vector instruction.
template <class T, int K>
struct alignas(K * sizeof(T)) Pack {
  static constexpr int kSize = K;
  T x[K];
  __device__ static Pack load(const T* p) { return *reinterpret_cast<const Pack*>(p); }
  __device__ void store(T* p) const { *reinterpret_cast<Pack*>(p) = *this; }
  __device__ float f(int i) const { return load_f(x[i]); }
  __device__ void set(int i, float v) { x[i] = store_t<T>(v); }
};
template <class T>
using Vec = Pack<T, 16 / sizeof(T)>;
template <class T>
constexpr int kVec = 16 / sizeof(T);  // values per 16-byte vector

// ----------------------------------------------------------------------------------------- stochastic rounding
// 64-bit xorshift-multiply mixer (the constants are the odd multipliers of Stafford's "Mix13" finaliser,
// used by SplitMix64): every input bit affects every output bit.
__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// 16 random bits, a pure function of (seed, idx): two mixing rounds so that neighbouring indices and
// neighbouring seeds give unrelated values.
__host__ __device__ inline uint32_t sr_bits16(uint32_t seed, uint64_t idx) {
  const uint64_t z = mix64(idx * 0x9e3779b97f4a7c15ull + seed);
  return uint32_t(mix64(z ^ (uint64_t(seed) << 32)) >> 48);
}
// x rounded to one of its two neighbouring bf16 values, up with probability (dropped low 16 bits) / 2^16,
// so the expected result is x. Sign-magnitude: adding to the magnitude's low bits rounds away from zero for
// either sign. Inf / NaN go through __float2bfloat16_rn (Inf stays Inf, NaN stays NaN); seed 0 = nearest even.
__host__ __device__ inline bf16 stochastic_round_bf16(float x, uint32_t seed, uint64_t idx) {
  if (seed == 0) return __float2bfloat16_rn(x);
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return __float2bfloat16_rn(x);
  u += sr_bits16(seed, idx);  // a carry out of the low half moves to the next bf16 value (or to Inf)
  __nv_bfloat16_raw r;
  r.x = static_cast<unsigned short>(u >> 16);
  return bf16(r);
}
// The parameter write of AdamW and cast_params: T = float keeps the fp32 value.
template <class T>
__host__ __device__ inline T round_param(float x, uint32_t seed, uint64_t idx);
template <>
__host__ __device__ inline float round_param<float>(float x, uint32_t, uint64_t) {
  return x;
}
template <>
__host__ __device__ inline bf16 round_param<bf16>(float x, uint32_t seed, uint64_t idx) {
  return stochastic_round_bf16(x, seed, idx);
}
template <>
__host__ __device__ inline f16 round_param<f16>(float x, uint32_t, uint64_t) {
  return __float2half_rn(x);  // round to nearest even, whatever the seed (see the contract above)
}

template <class T>
__device__ inline T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ inline float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// scratch: 32 values of __shared__ memory. Fixed reduction order, so deterministic.
template <class T>
__device__ inline T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : T(0);
  return warp_sum(v);
}

__device__ inline float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

}  // namespace gpt2::cuda
