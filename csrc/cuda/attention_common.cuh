// Storage-type helpers of the attention kernels (attention.cuh, attention_naive.cuh). floatX, the storage type
// of qkv / out / dout / dqkv, is float, __nv_bfloat16 or __half (the 16-bit mixed-precision contract); compute is fp32:
// values are converted on load and rounded once (to nearest even) on store. Kept in their own namespace so
// they cannot collide with the general load/store helpers of common.cuh.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda::attn {

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float to_float(__half x) { return __half2float(x); }

template <class floatX>
__device__ inline floatX from_float(float x);
template <>
__device__ inline float from_float<float>(float x) { return x; }
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }

// 16 bytes of floatX: 4 floats or 8 bf16 / fp16, moved with one vector load / store.
template <class floatX>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(floatX);
  floatX v[N];
};
template <class floatX>
__device__ inline Pack<floatX> load_pack(const floatX* p) {
  return *reinterpret_cast<const Pack<floatX>*>(p);
}
template <class floatX>
__device__ inline void store_pack(floatX* p, const Pack<floatX>& x) {
  *reinterpret_cast<Pack<floatX>*>(p) = x;
}

// True when the attention kernels may use Pack loads / stores on every (row, head) of these buffers: the head
// size is a multiple of the pack and the buffers are 16-byte aligned (row strides 3C and C are then multiples
// of the pack too).
template <class floatX, class... P>
inline bool packs_fit(int hs, const P*... p) {
  return hs % Pack<floatX>::N == 0 && aligned16(p...);
}

// Sequential dot product a[0] b[0] + a[1] b[1] + ... in fp32 (the same order with or without packs).
template <class floatX>
__device__ inline float dot_seq(const floatX* a, const floatX* b, int n, bool vec) {
  float s = 0.0f;
  if (vec) {
    constexpr int N = Pack<floatX>::N;
    for (int d = 0; d < n; d += N) {
      const Pack<floatX> x = load_pack(a + d), y = load_pack(b + d);
#pragma unroll
      for (int k = 0; k < N; k++) s += to_float(x.v[k]) * to_float(y.v[k]);
    }
  } else {
    for (int d = 0; d < n; d++) s += to_float(a[d]) * to_float(b[d]);
  }
  return s;
}

}  // namespace gpt2::cuda::attn
