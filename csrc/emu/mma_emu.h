// mma_emu.h: the warp-level matrix instructions (mma.sync, ldmatrix) for the emulator, from the fragment layouts
// of the PTX ISA (see csrc/cuda/mma.cuh, which calls these under GPT2CORE_EMU; emu/cuda_emu.h includes this). Each lane gathers the A rows
// and B columns of its four outputs from the lanes holding them with warp shuffles (so the warp-collective rules
// apply: every lane must take part) and accumulates D = C + sum_k A[r][k] B[k][c] in fp32, k in order. The
// 16-bit products are exact in fp32; the hardware's internal accumulation order and rounding are unspecified,
// so results agree with a GPU to fp32 rounding, not bit for bit.
#pragma once
#include "emu/cuda_emu.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace gpt2emu {

namespace detail {
inline int lane_id() {
  const ThreadState* s = GPT2EMU_THREAD;
  const unsigned tid = (s->thread_idx.z * s->block_dim.y + s->thread_idx.y) * s->block_dim.x + s->thread_idx.x;
  return static_cast<int>(tid % 32);
}
// The 16-bit element `half` (0: low, 1: high) of a register, as float.
template <class T>
inline float elem(uint32_t r, int half) {
  std::conditional_t<std::is_same_v<T, __half>, __half_raw, __nv_bfloat16_raw> raw;
  raw.x = static_cast<unsigned short>(half ? r >> 16 : r & 0xffff);
  return static_cast<float>(T(raw));
}
template <class T, int K>
inline void mma_rows_cols(float (&d)[4], const float (&A)[2][K], const float (&B)[2][K]) {
  for (int i = 0; i < 4; i++) {
    float acc = d[i];
    for (int k = 0; k < K; k++) acc += A[i / 2][k] * B[i % 2][k];
    d[i] = acc;
  }
}
}  // namespace detail

// D (16x8) += A (16x16) B (16x8), T = __nv_bfloat16 or __half.
template <class T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const int lane = detail::lane_id(), g = lane / 4, t = lane % 4;
  float A[2][16], B[2][16];  // A: rows g, g + 8; B: columns 2t, 2t + 1
  for (int s = 0; s < 4; s++) {  // lane 4g + s holds columns 2s, 2s + 1 (a[0], a[1]) and 2s + 8, 2s + 9 (a[2], a[3])
    const uint4 av = __shfl_sync(0xffffffffu, make_uint4(a[0], a[1], a[2], a[3]), 4 * g + s);
    const uint32_t regs[4] = {av.x, av.y, av.z, av.w};
    for (int r = 0; r < 4; r++)
      for (int h = 0; h < 2; h++) A[r % 2][2 * s + h + (r / 2) * 8] = detail::elem<T>(regs[r], h);
    for (int c = 0; c < 2; c++) {  // column 2t + c is held by lanes 4 (2t + c) + s: rows 2s.. (b[0]), 2s + 8.. (b[1])
      const uint2 bv = __shfl_sync(0xffffffffu, make_uint2(b[0], b[1]), 4 * (2 * t + c) + s);
      for (int h = 0; h < 2; h++) {
        B[c][2 * s + h] = detail::elem<T>(bv.x, h);
        B[c][2 * s + h + 8] = detail::elem<T>(bv.y, h);
      }
    }
  }
  detail::mma_rows_cols<T, 16>(d, A, B);
}

// D (16x8) += A (16x8) B (8x8) in fp16 (sm_75's shape).
inline void mma_m16n8k8_f16(float (&d)[4], const uint32_t (&a)[2], uint32_t b) {
  const int lane = detail::lane_id(), g = lane / 4, t = lane % 4;
  float A[2][8], B[2][8];
  for (int s = 0; s < 4; s++) {
    const uint2 av = __shfl_sync(0xffffffffu, make_uint2(a[0], a[1]), 4 * g + s);
    for (int h = 0; h < 2; h++) {
      A[0][2 * s + h] = detail::elem<__half>(av.x, h);
      A[1][2 * s + h] = detail::elem<__half>(av.y, h);
    }
    for (int c = 0; c < 2; c++) {
      const uint32_t bv = __shfl_sync(0xffffffffu, b, 4 * (2 * t + c) + s);
      for (int h = 0; h < 2; h++) B[c][2 * s + h] = detail::elem<__half>(bv, h);
    }
  }
  detail::mma_rows_cols<__half, 8>(d, A, B);
}

// ldmatrix .m8n8 .x4 (.trans) .b16: row = this lane's row address (row lane % 8 of matrix lane / 8).
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  const int lane = detail::lane_id(), g = lane / 4, t = lane % 4;
  for (int j = 0; j < 4; j++) {
    if (!trans) {
      const auto* p = static_cast<const unsigned char*>(__shfl_sync(0xffffffffu, row, 8 * j + g));
      memcpy(&r[j], p + 4 * t, 4);
    } else {  // elements [2t][g] and [2t + 1][g]
      const auto* p0 = static_cast<const uint16_t*>(__shfl_sync(0xffffffffu, row, 8 * j + 2 * t));
      const auto* p1 = static_cast<const uint16_t*>(__shfl_sync(0xffffffffu, row, 8 * j + 2 * t + 1));
      r[j] = uint32_t(p0[g]) | (uint32_t(p1[g]) << 16);
    }
  }
}

}  // namespace gpt2emu
