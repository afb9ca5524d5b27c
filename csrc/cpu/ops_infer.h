// CPU ops of KV-cache inference (model/backend.h: encoder_forward_at, attention_kv_forward, gather_rows) and the
// matmul for few rows (decode: one row per sequence), where a GEMM library's blocking does not pay and the time
// is the read of the weights: a GEMV that streams each weight row once for all input rows, split over the
// OpenMP threads by output rows. Compiled per instruction-set variant like ops.h (GPT2CORE_CPU_AVX2: the
// x86-64-v3 / v4 variants, 256-bit FMA intrinsics; elsewhere plain loops the compiler vectorises).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "model/dtypes.h"

#ifndef GPT2CORE_CPU_ISA
#error "cpu/ops_infer.h is included by cpu/backend_cpu_impl.h, which names the variant's namespace"
#endif

namespace gpt2::cpu::GPT2CORE_CPU_ISA {

// Rows of input at most for which matmul_forward takes the GEMV path (a decode batch of up to 8 sequences: the
// weights are read from memory once for all rows, where BLAS's GEMM would pack them first).
constexpr int kGemvMaxRows = 8;
// Input rows per GEMV call of the 16/8-bit weights' matmuls, which take the GEMV for any row count (a prefill's
// too): a block's inputs stay in L2 while the weights stream once per block.
constexpr int kGemvChunkRows = 32;

// 8-bit weights: each row of a matrix (rows, C) in blocks of kQ8Block inputs (the last one shorter when C is not a
// multiple), one fp32 scale per block (see quantize_q8).
constexpr int kQ8Block = 32;

#if defined(GPT2CORE_CPU_AVX2)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weight loaders: the 8 weights of row `row` from input i on, widened to fp32 (fp32 as is; bf16 bits shifted into
// the high half; fp16 by F16C; int8 times its block's scale, the value the fp32 params hold); addr: their address
// (for prefetches; computed as an integer: an address past the matrix's end is no fault and no UB).
template <typename W>
struct LoadBase {
  const W* w;
  int C;
  const char* addr(size_t row, int i) const {
    return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w) + (row * C + i) * sizeof(W));
  }
};
struct LoadF32 : LoadBase<float> {
  __m256 load8(size_t row, int i) const { return _mm256_loadu_ps(w + row * C + i); }
};
struct LoadBF16 : LoadBase<uint16_t> {
  __m256 load8(size_t row, int i) const {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + row * C + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
struct LoadF16 : LoadBase<uint16_t> {
  __m256 load8(size_t row, int i) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + row * C + i)));
  }
};
struct LoadQ8 : LoadBase<int8_t> {
  const float* scales;  // (rows, nb): quantize_q8's layout
  int nb;
  __m256 load8(size_t row, int i) const {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + row * C + i));
    const __m256 s = _mm256_broadcast_ss(scales + row * nb + i / kQ8Block);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
  }
};

// out[n, o] = dot(inp[n, :], w[o, :]) (+ bias) for n < NB (NB <= 3), C % 8 == 0: weight row o read front to back
// once (a sequential stream) and each loaded weight vector used by the NB input rows. Each dot product in four
// accumulators (inputs i with i / 8 % 4 == k into accumulator k, a last part of C % 32 into the first), then
// ((a0 + a1) + (a2 + a3)) summed across lanes, + bias: the same arithmetic for a row whatever NB is and whatever
// rows a call has (a seeded request's text does not depend on its batch). On this machine's Zen cores (2 threads,
// d12's decode matrices, huge pages), one row read this way against four weight rows interleaved with one
// accumulator each: 16-bit weights 14.8 -> 12.1 ms (bf16), 13.9 -> 12.2 ms (fp16); fp32 within noise (22-23 ms).
// NB = 3 at most: 12 accumulators, a weight vector and an input vector fit AVX2's 16 registers.
template <int NB, typename Ld>
inline void gemv_rowgroup_avx2(float* out, const float* inp, const Ld& ld, const float* bias, int C, int OC, int o) {
  __m256 a[NB][4];
  for (int n = 0; n < NB; n++)
    for (int k = 0; k < 4; k++) a[n][k] = _mm256_setzero_ps();
  int i = 0;
  for (; i + 32 <= C; i += 32)
    for (int k = 0; k < 4; k++) {
      const __m256 w = ld.load8(o, i + 8 * k);
      for (int n = 0; n < NB; n++)
        a[n][k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(inp + size_t(n) * C + i + 8 * k), a[n][k]);
    }
  for (; i < C; i += 8) {
    const __m256 w = ld.load8(o, i);
    for (int n = 0; n < NB; n++) a[n][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(inp + size_t(n) * C + i), a[n][0]);
  }
  for (int n = 0; n < NB; n++)
    out[size_t(n) * OC + o] = hsum256(_mm256_add_ps(_mm256_add_ps(a[n][0], a[n][1]), _mm256_add_ps(a[n][2], a[n][3]))) +
                              (bias ? bias[o] : 0.0f);
}

// out[n, o] for o in [o0, o1), any N: each weight row against the input rows in groups of up to 3 (read from
// memory once, then from L1 for the next group).
template <typename Ld>
inline void gemv_rows_avx2(float* out, const float* inp, const Ld& ld, const float* bias, int N, int C, int OC, int o0,
                           int o1) {
  for (int o = o0; o < o1; o++)
    for (int n0 = 0; n0 < N; n0 += 3) {
      float* y = out + size_t(n0) * OC;
      const float* x = inp + size_t(n0) * C;
      switch (std::min(3, N - n0)) {
        case 1: gemv_rowgroup_avx2<1>(y, x, ld, bias, C, OC, o); break;
        case 2: gemv_rowgroup_avx2<2>(y, x, ld, bias, C, OC, o); break;
        default: gemv_rowgroup_avx2<3>(y, x, ld, bias, C, OC, o); break;
      }
    }
}

// The integer-dot form (llama.cpp's Q8_0 x Q8_0): the input rows quantised like the weights (xq, xs: one scale
// per block), each block's dot product exact in int32 -- |w| (u8) times x * sign(w) (i8) by maddubs into 16 pairs,
// madd into 8 int32 lanes -- then widened to fp32 and multiplied by the two scales. 7 instructions per 32 weights
// and input row, where dequantising takes 4 per 8. out[n, o] for n < NB (NB <= 4): int8 weight row o read front to
// back once (one sequential stream per thread), its |w| used by the NB input rows; two accumulators per row over
// alternate blocks, then (a0 + a1) summed across lanes, + bias: the same arithmetic for a row whatever NB is and
// whatever rows a call has. C % 32 == 0.
template <int NB>
inline void gemv_rowgroup_q8i_avx2(float* out, const int8_t* xq, const float* xs, const int8_t* q, const float* scales,
                                   const float* bias, int C, int OC, int o) {
  const int nb = C / kQ8Block;
  const int8_t* wr = q + size_t(o) * C;
  const float* sr = scales + size_t(o) * nb;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a[NB][2];
  for (int n = 0; n < NB; n++) a[n][0] = a[n][1] = _mm256_setzero_ps();
  auto block = [&](int b, int k) {  // block b into accumulator k
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * kQ8Block));
    const __m256i aw = _mm256_sign_epi8(wv, wv);  // |w| <= 127: an unsigned byte
    for (int n = 0; n < NB; n++) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + size_t(n) * C + b * kQ8Block));
      // |w| * (x * sign(w)) = w * x, pairs summed in int16 (|.| <= 2 * 127 * 127 < 2^15), then in int32
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
      a[n][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sr[b] * xs[size_t(n) * nb + b]), a[n][k]);
    }
  };
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    block(b, 0);
    block(b + 1, 1);
  }
  if (b < nb) block(b, 0);
  for (int n = 0; n < NB; n++)
    out[size_t(n) * OC + o] = hsum256(_mm256_add_ps(a[n][0], a[n][1])) + (bias ? bias[o] : 0.0f);
}
#endif

// A weight as T: fp32 / fp64 as stored; 16-bit bits as bf16 (bf16 = true) or fp16.
template <typename T>
inline T weight_as(const T* w, size_t i, bool /*bf16*/) { return w[i]; }
template <typename T>
inline T weight_as(const uint16_t* w, size_t i, bool bf16) {
  return T(bf16 ? bf16_to_float(gpt2::bf16{w[i]}) : f16_to_float(gpt2::f16{w[i]}));
}

// The portable form (double models, other ISAs, C not a multiple of 8).
template <typename T, typename W>
inline void gemv_rows_plain(T* out, const T* inp, const W* w, const T* bias, int N, int C, int OC, int o0, int o1,
                            bool bf16) {
  for (int o = o0; o < o1; o++) {
    const W* wr = w + size_t(o) * C;
    for (int n = 0; n < N; n++) {
      const T* x = inp + size_t(n) * C;
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < C; i++) s += weight_as<T>(wr, i, bf16) * x[i];
      out[size_t(n) * OC + o] = s + (bias ? bias[o] : T(0));
    }
  }
}

// out (N, OC) = inp (N, C) @ w^T + bias for few rows (fp32 decode: N <= kGemvMaxRows from matmul_forward; 16/8-bit
// weights: any N, in blocks of kGemvChunkRows), the output rows split over the threads in blocks of 16 (each thread
// reads its own part of w once). Each output is computed by one thread in an order that depends on neither N nor
// the thread count: a row's result is the same bits in a call of any row count. w: T, or 16-bit bits
// (W = uint16_t: bf16 = true for bf16, else fp16) widened to fp32 in registers.
template <typename T, typename W>
void gemv_forward(T* out, const T* inp, const W* w, const T* bias, int N, int C, int OC, bool bf16 = false) {
  const int blocks = (OC + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < blocks; blk++) {
    const int o0 = blk * 16, o1 = std::min(OC, o0 + 16);
#if defined(GPT2CORE_CPU_AVX2)
    if constexpr (std::is_same_v<T, float>) {
      if (C % 8 == 0) {
        if constexpr (std::is_same_v<W, float>) gemv_rows_avx2(out, inp, LoadF32{{w, C}}, bias, N, C, OC, o0, o1);
        else if (bf16) gemv_rows_avx2(out, inp, LoadBF16{{w, C}}, bias, N, C, OC, o0, o1);
        else gemv_rows_avx2(out, inp, LoadF16{{w, C}}, bias, N, C, OC, o0, o1);
        continue;
      }
    }
#endif
    gemv_rows_plain(out, inp, w, bias, N, C, OC, o0, o1, bf16);
  }
}

// One block of n <= kQ8Block values: q = x / s rounded to nearest (ties to even), in [-127, 127], s = max|x| / 127
// (as float; s = 0: q = 0). Returns s. (A NaN gives -127 rather than an undefined conversion; its block is garbage
// either way.)
template <typename T>
inline float quantize_block_q8(int8_t* q, const T* x, int n) {
  T amax = 0;
  for (int i = 0; i < n; i++) amax = std::max(amax, T(std::abs(x[i])));
  const float s = float(amax / T(127));
  for (int i = 0; i < n; i++) {
    const T v = s > 0 ? std::nearbyint(x[i] / T(s)) : T(0);
    q[i] = int8_t(std::min(T(127), std::max(T(-127), v)));
  }
  return s;
}

// Backend::quantize_q8: w (rows, C) -> q (rows, C) int8 and scales (rows, nb = ceil(C / kQ8Block)) fp32, per block
// of kQ8Block inputs of a row: s = max|w| / 127 (as float), q = w / s rounded to nearest (ties to even), in
// [-127, 127] (s = 0: q = 0); then w = q * s, so that the fp32 weights (the forward's) are the ones decode reads.
template <typename T>
void quantize_q8(int8_t* q, float* scales, T* w, long rows, int C) {
  const int nb = (C + kQ8Block - 1) / kQ8Block;
#pragma omp parallel for schedule(static)
  for (long r = 0; r < rows; r++) {
    T* wr = w + size_t(r) * C;
    int8_t* qr = q + size_t(r) * C;
    for (int b = 0; b < nb; b++) {
      const int i0 = b * kQ8Block, i1 = std::min(C, i0 + kQ8Block);
      const float s = quantize_block_q8(qr + i0, wr + i0, i1 - i0);
      scales[size_t(r) * nb + b] = s;
      for (int i = i0; i < i1; i++) wr[i] = T(qr[i]) * T(s);
    }
  }
}

// The portable 8-bit GEMV (double models, other ISAs, C not a multiple of 8): w = T(q) * T(s) as quantize_q8 wrote.
template <typename T>
inline void gemv_rows_q8_plain(T* out, const T* inp, const int8_t* q, const float* scales, const T* bias, int N, int C,
                               int OC, int o0, int o1) {
  const int nb = (C + kQ8Block - 1) / kQ8Block;
  for (int o = o0; o < o1; o++) {
    const int8_t* wr = q + size_t(o) * C;
    const float* sr = scales + size_t(o) * nb;
    for (int n = 0; n < N; n++) {
      const T* x = inp + size_t(n) * C;
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < C; i++) s += (T(wr[i]) * T(sr[i / kQ8Block])) * x[i];
      out[size_t(n) * OC + o] = s + (bias ? bias[o] : T(0));
    }
  }
}

// gemv_forward with 8-bit weights: q (OC, C) int8, scales (OC, ceil(C / kQ8Block)) (quantize_q8's layout).
template <typename T>
void gemv_forward_q8(T* out, const T* inp, const int8_t* q, const float* scales, const T* bias, int N, int C, int OC) {
  const int blocks = (OC + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < blocks; blk++) {
    const int o0 = blk * 16, o1 = std::min(OC, o0 + 16);
#if defined(GPT2CORE_CPU_AVX2)
    if constexpr (std::is_same_v<T, float>) {
      if (C % 8 == 0) {
        // the weights widened in registers: each 8 times its block's scale, the value the fp32 params hold, so
        // that out is the fp32 GEMV on those params exactly (the same FMAs in the same order)
        gemv_rows_avx2(out, inp, LoadQ8{{q, C}, scales, (C + kQ8Block - 1) / kQ8Block}, bias, N, C, OC, o0, o1);
        continue;
      }
    }
#endif
    gemv_rows_q8_plain(out, inp, q, scales, bias, N, C, OC, o0, o1);
  }
}

// Rows of activations quantised as quantize_q8 quantises weights (x itself unchanged): xq (N, C), xs (N, nb).
template <typename T>
inline void quantize_rows_q8(int8_t* xq, float* xs, const T* x, int N, int C) {
  const int nb = (C + kQ8Block - 1) / kQ8Block;
#pragma omp for collapse(2) schedule(static)
  for (int n = 0; n < N; n++)
    for (int b = 0; b < nb; b++) {
      const int i0 = b * kQ8Block, i1 = std::min(C, i0 + kQ8Block);
      xs[size_t(n) * nb + b] = quantize_block_q8(xq + size_t(n) * C + i0, x + size_t(n) * C + i0, i1 - i0);
    }
}

// The portable integer-dot GEMV: per block the exact int32 sum of q_w * q_x, then acc += sum * (s_w * s_x).
template <typename T>
inline void gemv_rows_q8i_plain(T* out, const int8_t* xq, const float* xs, const int8_t* q, const float* scales,
                                const T* bias, int N, int C, int OC, int o0, int o1) {
  const int nb = (C + kQ8Block - 1) / kQ8Block;
  for (int o = o0; o < o1; o++) {
    const int8_t* wr = q + size_t(o) * C;
    const float* sr = scales + size_t(o) * nb;
    for (int n = 0; n < N; n++) {
      const int8_t* x = xq + size_t(n) * C;
      T acc = 0;
      for (int b = 0; b < nb; b++) {
        const int i0 = b * kQ8Block, i1 = std::min(C, i0 + kQ8Block);
        int32_t si = 0;
#pragma omp simd reduction(+ : si)
        for (int i = i0; i < i1; i++) si += int32_t(wr[i]) * int32_t(x[i]);
        acc += T(si) * (T(sr[b]) * T(xs[size_t(n) * nb + b]));
      }
      out[size_t(n) * OC + o] = acc + (bias ? bias[o] : T(0));
    }
  }
}

// gemv_forward with 8-bit weights and 8-bit activations (integer dot products): the input rows are quantised per
// block first (quantize_rows_q8), then out = sum over blocks of (s_w s_x) * int32 dot + bias.
template <typename T>
void gemv_forward_q8i(T* out, const T* inp, const int8_t* q, const float* scales, const T* bias, int N, int C, int OC) {
  const int nb = (C + kQ8Block - 1) / kQ8Block;
  std::vector<int8_t> xq(size_t(N) * C);
  std::vector<float> xs(size_t(N) * nb);
  const int blocks = (OC + 15) / 16;
#pragma omp parallel
  {
    quantize_rows_q8(xq.data(), xs.data(), inp, N, C);  // (an omp for: its barrier ends it before the GEMV)
#pragma omp for schedule(static)
    for (int blk = 0; blk < blocks; blk++) {
      const int o0 = blk * 16, o1 = std::min(OC, o0 + 16);
#if defined(GPT2CORE_CPU_AVX2)
      if constexpr (std::is_same_v<T, float>) {
        if (C % kQ8Block == 0) {
          for (int o = o0; o < o1; o++)
            for (int n0 = 0; n0 < N; n0 += 4) {
              float* y = out + size_t(n0) * OC;
              const int8_t* x = xq.data() + size_t(n0) * C;
              const float* sx = xs.data() + size_t(n0) * nb;
              switch (std::min(4, N - n0)) {
                case 1: gemv_rowgroup_q8i_avx2<1>(y, x, sx, q, scales, bias, C, OC, o); break;
                case 2: gemv_rowgroup_q8i_avx2<2>(y, x, sx, q, scales, bias, C, OC, o); break;
                case 3: gemv_rowgroup_q8i_avx2<3>(y, x, sx, q, scales, bias, C, OC, o); break;
                default: gemv_rowgroup_q8i_avx2<4>(y, x, sx, q, scales, bias, C, OC, o); break;
              }
            }
          continue;
        }
      }
#endif
      gemv_rows_q8i_plain(out, xq.data(), xs.data(), q, scales, bias, N, C, OC, o0, o1);
    }
  }
}

// out[b,t,:] = wte[inp[b,t],:] + wpe[pos[b]+t,:] (wpe null: rotary positions, out = wte[inp[b,t],:])
template <typename T>
void encoder_forward_at(T* out, const int32_t* inp, const T* wte, const T* wpe, const int32_t* pos, int B, int Tn,
                        int C) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++)
    for (int t = 0; t < Tn; t++) {
      T* o = out + ((size_t)b * Tn + t) * C;
      const T* we = wte + (size_t)inp[b * Tn + t] * C;
      if (wpe) {
        const T* pe = wpe + (size_t)(pos[b] + t) * C;
        for (int i = 0; i < C; i++) o[i] = we[i] + pe[i];
      } else {
        for (int i = 0; i < C; i++) o[i] = we[i];
      }
    }
}

// Backend::rope_forward_at: rope_apply's rotation (sign +1) with row (b, t) of qkv (B, Tn, 3C) at position
// pos[b] + t (each sequence at its own position in the cache), the cos / sin of each row by rope_table_row.
template <typename T>
void rope_apply_at(T* qkv, const int32_t* pos, int B, int Tn, int C, int NH, double base) {
  const int hs = C / NH;
#pragma omp parallel
  {
    std::vector<T> cs(hs / 2), sn(hs / 2);
#pragma omp for collapse(2)
    for (int b = 0; b < B; b++)
      for (int t = 0; t < Tn; t++) {
        rope_table_row(cs.data(), sn.data(), long(pos[b]) + t, hs, base, +1);
        rope_rotate_row(qkv + ((size_t)b * Tn + t) * 3 * C, cs.data(), sn.data(), NH, hs);
      }
  }
}

template <typename T>
void gather_rows(T* out, const T* inp, const int32_t* rows, int n, int C) {
  for (int i = 0; i < n; i++) std::memcpy(out + (size_t)i * C, inp + (size_t)rows[i] * C, sizeof(T) * C);
}

#if defined(GPT2CORE_CPU_AVX2)
// One query of head size 8 * H8 against keys 0 .. n-1 of its slot (rows `ldk` floats apart), fp32: the query and
// the output accumulate in registers (H8 vectors each), where the portable loop below reads and writes o per key.
// The scores go through p (n floats) between the two passes, as there.
template <int H8>
inline void attend_one_avx2(float* o, const float* q, const float* K, const float* V, int n, size_t ldk, float scale,
                            float* p) {
  __m256 qv[H8];
  for (int j = 0; j < H8; j++) qv[j] = _mm256_loadu_ps(q + 8 * j);
  float maxv = -INFINITY;
  for (int t2 = 0; t2 < n; t2++) {
    const float* k = K + t2 * ldk;
    __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
    for (int j = 1; j < H8; j++) a = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), a);
    const float sc = hsum256(a) * scale;
    p[t2] = sc;
    maxv = sc > maxv ? sc : maxv;
  }
  float sum = 0;
  for (int t2 = 0; t2 < n; t2++) { p[t2] = fast_exp(p[t2] - maxv); sum += p[t2]; }
  __m256 acc[H8];
  for (int j = 0; j < H8; j++) acc[j] = _mm256_setzero_ps();
  for (int t2 = 0; t2 < n; t2++) {
    const float* v = V + t2 * ldk;
    const __m256 a = _mm256_set1_ps(p[t2]);
    for (int j = 0; j < H8; j++) acc[j] = _mm256_fmadd_ps(a, _mm256_loadu_ps(v + 8 * j), acc[j]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (int j = 0; j < H8; j++) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(acc[j], inv));
}
#endif

// Backend::attention_kv_forward: K, V of the new tokens into the cache, then each query against its slot's
// positions 0 .. pos[b] + t (the softmax as attention_forward: max-subtracted fast_exp, normalised after).
template <typename T>
void attention_kv_forward(T* out, T* kcache, T* vcache, const T* qkv, const int32_t* slot, const int32_t* pos, int B,
                          int Tq, int C, int NH, int maxT) {
  const int C3 = 3 * C, hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++)
    for (int t = 0; t < Tq; t++) {
      const T* src = qkv + ((size_t)b * Tq + t) * C3;
      const size_t row = (size_t)slot[b] * maxT + pos[b] + t;
      std::memcpy(kcache + row * C, src + C, sizeof(T) * C);
      std::memcpy(vcache + row * C, src + 2 * C, sizeof(T) * C);
    }
#pragma omp parallel
  {
    std::vector<T> p(maxT);
#pragma omp for collapse(3) schedule(dynamic, 4)
    for (int b = 0; b < B; b++)
      for (int t = 0; t < Tq; t++)
        for (int h = 0; h < NH; h++) {
          const T* q = qkv + ((size_t)b * Tq + t) * C3 + h * hs;
          const T* K = kcache + (size_t)slot[b] * maxT * C + h * hs;
          const T* V = vcache + (size_t)slot[b] * maxT * C + h * hs;
          const int n = pos[b] + t + 1;
          T* o = out + ((size_t)b * Tq + t) * C + h * hs;
#if defined(GPT2CORE_CPU_AVX2)
          // decode only (one query per sequence): a prefill (Tq > 1) runs the loop below, whose in-order sums
          // make an inference model's forward over a prompt equal to a training model's bitwise
          if constexpr (std::is_same_v<T, float>) {
            if (Tq == 1 && hs == 64) { attend_one_avx2<8>(o, q, K, V, n, size_t(C), scale, p.data()); continue; }
            if (Tq == 1 && hs == 128) { attend_one_avx2<16>(o, q, K, V, n, size_t(C), scale, p.data()); continue; }
            if (Tq == 1 && hs == 32) { attend_one_avx2<4>(o, q, K, V, n, size_t(C), scale, p.data()); continue; }
          }
#endif
          T maxv = -INFINITY;
          for (int t2 = 0; t2 < n; t2++) {
            const T* k = K + (size_t)t2 * C;
            T s = 0;  // in order, as attention_forward: an inference model's forward equals a training one's bitwise
            for (int i = 0; i < hs; i++) s += q[i] * k[i];
            s *= scale;
            p[t2] = s;
            maxv = s > maxv ? s : maxv;
          }
          T sum = 0;
          for (int t2 = 0; t2 < n; t2++) { p[t2] = fast_exp(p[t2] - maxv); sum += p[t2]; }
          const T inv = T(1) / sum;
          for (int i = 0; i < hs; i++) o[i] = 0;
          for (int t2 = 0; t2 < n; t2++) {
            const T* v = V + (size_t)t2 * C;
            const T a = p[t2] * inv;
#pragma omp simd
            for (int i = 0; i < hs; i++) o[i] += a * v[i];
          }
        }
  }
}

}  // namespace gpt2::cpu::GPT2CORE_CPU_ISA
