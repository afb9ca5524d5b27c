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

// Rows of input at most for which matmul_forward takes the GEMV path.
constexpr int kGemvMaxRows = 4;

#if defined(GPT2CORE_CPU_AVX2)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weight loaders: 8 weights widened to fp32 (fp32 as is; bf16 bits shifted into the high half; fp16 by F16C).
struct LoadF32 {
  using W = float;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
};
struct LoadBF16 {
  using W = uint16_t;
  static __m256 load8(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
struct LoadF16 {
  using W = uint16_t;
  static __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

// out[n, o] = dot(inp[n, :], w[o, :]) (+ bias[o]) for o in [o0, o1), n < N (N <= kGemvMaxRows), C % 8 == 0:
// four weight rows at a time, each loaded vector used by every input row.
template <int N, typename Ld>
inline void gemv_rows_avx2(float* out, const float* inp, const typename Ld::W* w, const float* bias, int C, int OC,
                           int o0, int o1) {
  int o = o0;
  for (; o + 4 <= o1; o += 4) {
    __m256 acc[N][4];
    for (int n = 0; n < N; n++)
      for (int r = 0; r < 4; r++) acc[n][r] = _mm256_setzero_ps();
    const typename Ld::W* w0 = w + size_t(o) * C;
    for (int i = 0; i < C; i += 8) {
      const __m256 a0 = Ld::load8(w0 + i), a1 = Ld::load8(w0 + C + i), a2 = Ld::load8(w0 + 2 * C + i),
                   a3 = Ld::load8(w0 + 3 * C + i);
      for (int n = 0; n < N; n++) {
        const __m256 x = _mm256_loadu_ps(inp + size_t(n) * C + i);
        acc[n][0] = _mm256_fmadd_ps(a0, x, acc[n][0]);
        acc[n][1] = _mm256_fmadd_ps(a1, x, acc[n][1]);
        acc[n][2] = _mm256_fmadd_ps(a2, x, acc[n][2]);
        acc[n][3] = _mm256_fmadd_ps(a3, x, acc[n][3]);
      }
    }
    for (int n = 0; n < N; n++)
      for (int r = 0; r < 4; r++) out[size_t(n) * OC + o + r] = hsum256(acc[n][r]) + (bias ? bias[o + r] : 0.0f);
  }
  for (; o < o1; o++) {
    const typename Ld::W* wr = w + size_t(o) * C;
    for (int n = 0; n < N; n++) {
      __m256 acc = _mm256_setzero_ps();
      for (int i = 0; i < C; i += 8) acc = _mm256_fmadd_ps(Ld::load8(wr + i), _mm256_loadu_ps(inp + size_t(n) * C + i), acc);
      out[size_t(n) * OC + o] = hsum256(acc) + (bias ? bias[o] : 0.0f);
    }
  }
}

template <typename Ld>
inline bool gemv_avx2(float* out, const float* inp, const typename Ld::W* w, const float* bias, int N, int C, int OC,
                      int o0, int o1) {
  if (C % 8 != 0) return false;
  switch (N) {
    case 1: gemv_rows_avx2<1, Ld>(out, inp, w, bias, C, OC, o0, o1); return true;
    case 2: gemv_rows_avx2<2, Ld>(out, inp, w, bias, C, OC, o0, o1); return true;
    case 3: gemv_rows_avx2<3, Ld>(out, inp, w, bias, C, OC, o0, o1); return true;
    case 4: gemv_rows_avx2<4, Ld>(out, inp, w, bias, C, OC, o0, o1); return true;
    default: return false;
  }
}
#endif

// The portable form (double models, other ISAs, C not a multiple of 8).
template <typename T>
inline void gemv_rows_plain(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC, int o0, int o1) {
  for (int o = o0; o < o1; o++) {
    const T* wr = w + size_t(o) * C;
    for (int n = 0; n < N; n++) {
      const T* x = inp + size_t(n) * C;
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < C; i++) s += wr[i] * x[i];
      out[size_t(n) * OC + o] = s + (bias ? bias[o] : T(0));
    }
  }
}

// out (N, OC) = inp (N, C) @ w^T + bias for N <= kGemvMaxRows, the output rows split over the threads in blocks of
// 16 (each thread reads its own part of w once).
template <typename T>
void gemv_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) {
  const int blocks = (OC + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < blocks; blk++) {
    const int o0 = blk * 16, o1 = std::min(OC, o0 + 16);
#if defined(GPT2CORE_CPU_AVX2)
    if constexpr (std::is_same_v<T, float>) {
      if (gemv_avx2<LoadF32>(out, inp, w, bias, N, C, OC, o0, o1)) continue;
    }
#endif
    gemv_rows_plain(out, inp, w, bias, N, C, OC, o0, o1);
  }
}

// gemv_forward with w as bf16 (bf16 = true) or fp16 bits, widened to fp32 in registers (any N; the vector kernel
// for N <= kGemvMaxRows, C % 8 == 0 on x86-64-v3 / v4, a scalar loop elsewhere).
template <typename T>
void gemv_forward_w16(T* out, const T* inp, const uint16_t* w, const T* bias, int N, int C, int OC, bool bf16) {
  const int blocks = (OC + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < blocks; blk++) {
    const int o0 = blk * 16, o1 = std::min(OC, o0 + 16);
#if defined(GPT2CORE_CPU_AVX2)
    if constexpr (std::is_same_v<T, float>) {
      if (bf16 ? gemv_avx2<LoadBF16>(out, inp, w, bias, N, C, OC, o0, o1)
               : gemv_avx2<LoadF16>(out, inp, w, bias, N, C, OC, o0, o1))
        continue;
    }
#endif
    for (int o = o0; o < o1; o++) {
      const uint16_t* wr = w + size_t(o) * C;
      for (int n = 0; n < N; n++) {
        const T* x = inp + size_t(n) * C;
        T s = 0;
        for (int i = 0; i < C; i++) s += T(bf16 ? bf16_to_float(gpt2::bf16{wr[i]}) : f16_to_float(gpt2::f16{wr[i]})) * x[i];
        out[size_t(n) * OC + o] = s + (bias ? bias[o] : T(0));
      }
    }
  }
}

// out[b,t,:] = wte[inp[b,t],:] + wpe[pos[b]+t,:]
template <typename T>
void encoder_forward_at(T* out, const int32_t* inp, const T* wte, const T* wpe, const int32_t* pos, int B, int Tn,
                        int C) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++)
    for (int t = 0; t < Tn; t++) {
      T* o = out + ((size_t)b * Tn + t) * C;
      const T* we = wte + (size_t)inp[b * Tn + t] * C;
      const T* pe = wpe + (size_t)(pos[b] + t) * C;
      for (int i = 0; i < C; i++) o[i] = we[i] + pe[i];
    }
}

template <typename T>
void gather_rows(T* out, const T* inp, const int32_t* rows, int n, int C) {
  for (int i = 0; i < n; i++) std::memcpy(out + (size_t)i * C, inp + (size_t)rows[i] * C, sizeof(T) * C);
}

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
          T* o = out + ((size_t)b * Tq + t) * C + h * hs;
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
