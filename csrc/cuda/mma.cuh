// Warp-level tensor-core matrix instructions, portable: inline PTX under nvcc, the C++ implementation of
// csrc/emu/mma_emu.h under the emulator (which force-includes it; the same fragment layouts, from the PTX ISA's
// "Matrix fragments for mma.m16n8k16 / m16n8k8" and "ldmatrix" sections). Every lane of the warp must call them
// together.
//
//   mma_m16n8k16<T>(d, a, b):  D (16x8, fp32) += A (16x16, T) B (16x8, T), T = __nv_bfloat16 (sm_80+) or __half
//   mma_m16n8k8_f16(d, a, b):  D (16x8, fp32) += A (16x8, half) B (8x8, half)                       (sm_75+)
//   mma_m16n8k16_by_k8(d, a, b): the fp16 m16n8k16 as two m16n8k8 (columns 0-7: a[0], a[1], b[0]; 8-15: a[2],
//     a[3], b[1]: the k16 fragments are the two k8 ones side by side). mma_m16n8k16<__half> is this below sm_80.
//   ldmatrix_x4(r, row) / ldmatrix_x4_trans(r, row): four 8x8 16-bit matrices from shared memory; lane i gives
//     the address of row i % 8 of matrix i / 8 (16 contiguous bytes, 16-byte aligned).
// Fragments, with g = lane / 4 and t = lane % 4 (two 16-bit elements per 32-bit register, the lower one first):
//   A 16x16: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   B 16x8:  b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C/D 16x8 fp32: d[0] = D[g][2t], d[1] = D[g][2t+1], d[2] = D[g+8][2t], d[3] = D[g+8][2t+1]
//   m16n8k8: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..]; b = B[2t..2t+1][g]
//   ldmatrix: r[j] = matrix j [g][2t..2t+1]; trans: r[j] = (matrix j [2t][g], matrix j [2t+1][g])
#pragma once
#include "cuda/portable.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace gpt2::cuda {

// Two 16-bit values in one register, lo first (the fragments' element order).
template <class T>
__device__ inline uint32_t pack2(float lo, float hi);
template <>
__device__ inline uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
template <>
__device__ inline uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

#if GPT2CORE_EMU

__device__ inline void mma_m16n8k8_f16(float (&d)[4], const uint32_t (&a)[2], uint32_t b) {
  gpt2emu::mma_m16n8k8_f16(d, a, b);
}
template <class T>
__device__ inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  gpt2emu::mma_m16n8k16<T>(d, a, b);
}
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { gpt2emu::ldmatrix_x4(r, row, false); }
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { gpt2emu::ldmatrix_x4(r, row, true); }

#else

// ldmatrix and mma m16n8k8 need sm_75: below (sm_70, which CUDA 12 still builds) the wrappers compile to a trap, and
// the backend never launches their kernels there (attention_tc_fits).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
#define GPT2_SM75 0
#else
#define GPT2_SM75 1
#endif

__device__ inline void mma_m16n8k8_f16(float (&d)[4], const uint32_t (&a)[2], uint32_t b) {
#if GPT2_SM75
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(b));
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}
__device__ inline void mma_m16n8k16_by_k8(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <class T>
__device__ inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  // m16n8k16 needs sm_80. sm_75 (Turing) has fp16 m16n8k8; bf16 kernels still compile for sm_75 (one build for T4
  // to H100) but the backend never launches them there (bf16 is refused below sm_80).
  if constexpr (std::is_same_v<T, __half>) {
    mma_m16n8k16_by_k8(d, a, b);
  } else {
    (void)d, (void)a, (void)b;
    __trap();
  }
#else
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if GPT2_SM75
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0;
  __trap();
#endif
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if GPT2_SM75
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0;
  __trap();
#endif
}

#undef GPT2_SM75
#endif

__device__ inline void mma_m16n8k16_by_k8(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const uint32_t lo[2] = {a[0], a[1]}, hi[2] = {a[2], a[3]};
  mma_m16n8k8_f16(d, lo, b[0]);
  mma_m16n8k8_f16(d, hi, b[1]);
}

}  // namespace gpt2::cuda
