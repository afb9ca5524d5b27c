// bf16 GEMM (cpu/gemm_bf16.h): pack op(A) and op(B) as bf16, then an 8 x 32 register tile of VDPBF16PS.
//
// Packed layouts (zero padded, so the kernel has no edge cases inside; the edges are masked at the store):
//   Ap: (Mp, Kp) bf16, row i = op(A)[i, :]                        Mp = M rounded up to 8, Kp = K rounded up to 2
//   Bp: per panel of 16 columns, (Kp / 2, 16, 2) bf16: the pair (op(B)[2p, j], op(B)[2p + 1, j]) of column j in
//       one 32-bit lane, so one 512-bit load is a k-pair of 16 columns     Np = N rounded up to 32
// The kernel broadcasts A's k-pair of a row to all 16 lanes and VDPBF16PS adds a0 * b0 + a1 * b1 into each lane.
#include "cpu/gemm_bf16.h"

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/blas.h"
#include "model/dtypes.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GPT2CORE_BF16_KERNEL 1
#include <immintrin.h>
#else
#define GPT2CORE_BF16_KERNEL 0
#endif

namespace gpt2::cpu {

namespace {

constexpr int kMr = 8;   // rows of C per register tile
constexpr int kNr = 32;  // columns of C per register tile (two 16-lane panels)

inline uint16_t to_bf16(float f) { return float_to_bf16(f).bits; }

// n floats into bf16 (nearest even): 32 at a time by VCVTNE2PS2BF16 where the CPU has it
#if GPT2CORE_BF16_KERNEL
namespace x86_64_v4 {  // AVX-512 code lives in the dispatched variants' namespace (test_cpu_dispatch)
__attribute__((target("avx512f,avx512bf16"))) void row_to_bf16_avx512(uint16_t* dst, const float* src, int n) {
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)v);
  }
  for (; i < n; i++) dst[i] = to_bf16(src[i]);
}
}  // namespace x86_64_v4
#endif
void row_to_bf16(uint16_t* dst, const float* src, int n) {
#if GPT2CORE_BF16_KERNEL
  if (has_avx512_bf16()) return x86_64_v4::row_to_bf16_avx512(dst, src, n);
#endif
  for (int i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
}

// op(A) (M, K) into Ap (Mp, Kp)
void pack_a(std::vector<uint16_t>& Ap, bool ta, int M, int K, const float* A, int lda, int Mp, int Kp) {
  Ap.assign(size_t(Mp) * Kp, 0);
  for (int i = 0; i < M; i++) {
    uint16_t* row = Ap.data() + size_t(i) * Kp;
    if (!ta) row_to_bf16(row, A + size_t(i) * lda, K);
    else
      for (int p = 0; p < K; p++) row[p] = to_bf16(A[size_t(p) * lda + i]);
  }
}

// op(B) (K, N) into Bp: panel q of columns 16q..16q+15 at q * (Kp / 2) * 32, as 32-bit pairs (k even, k odd)
void pack_b(std::vector<uint16_t>& Bp, bool tb, int K, int N, const float* B, int ldb, int Np, int Kp) {
  Bp.assign(size_t(Np) * Kp, 0);
  const size_t Kh = size_t(Kp) / 2;
  uint32_t* out = reinterpret_cast<uint32_t*>(Bp.data());
  thread_local std::vector<uint16_t> r0, r1;
  if (tb) {  // column j of op(B) is row j of B: one contiguous row of pairs
    r0.assign(size_t(Kp), 0);
    for (int j = 0; j < N; j++) {
      row_to_bf16(r0.data(), B + size_t(j) * ldb, K);
      uint32_t* o = out + size_t(j / 16) * Kh * 16 + (j % 16);
      for (size_t pp = 0; pp < Kh; pp++) o[pp * 16] = uint32_t(r0[2 * pp]) | uint32_t(r0[2 * pp + 1]) << 16;
    }
    return;
  }
  r0.resize(size_t(N));
  r1.assign(size_t(N), 0);
  for (int p = 0; p < K; p += 2) {  // rows p and p + 1 of B: the pairs of every column
    row_to_bf16(r0.data(), B + size_t(p) * ldb, N);
    if (p + 1 < K) row_to_bf16(r1.data(), B + size_t(p + 1) * ldb, N);
    else std::fill(r1.begin(), r1.end(), uint16_t(0));
    for (int j = 0; j < N; j++)
      out[(size_t(j / 16) * Kh + p / 2) * 16 + (j % 16)] = uint32_t(r0[j]) | uint32_t(r1[j]) << 16;
  }
}

#if GPT2CORE_BF16_KERNEL
namespace x86_64_v4 {
__attribute__((target("avx512f,avx512bf16"))) void kernel_avx512_bf16(
    const uint16_t* Ap, const uint16_t* Bp, int M, int N, int Mp, int Np, int Kp, float alpha, float beta, float* C,
    int ldc) {
  const size_t Kh = size_t(Kp) / 2;
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int jb = 0; jb < Np; jb += kNr) {
    const uint16_t* b0 = Bp + size_t(jb / 16) * Kh * 32;
    const uint16_t* b1 = b0 + Kh * 32;
    for (int ib = 0; ib < Mp; ib += kMr) {
      __m512 acc[kMr][2];
      for (int r = 0; r < kMr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      const int32_t* a = reinterpret_cast<const int32_t*>(Ap + size_t(ib) * Kp);  // k-pairs of row ib
      for (size_t pp = 0; pp < Kh; pp++) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(b0 + pp * 32);
        const __m512bh x1 = (__m512bh)_mm512_loadu_si512(b1 + pp * 32);
#pragma GCC unroll 8
        for (int r = 0; r < kMr; r++) {
          const __m512bh ar = (__m512bh)_mm512_set1_epi32(a[r * Kh + pp]);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, x0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, x1);
        }
      }
      for (int r = 0; r < kMr && ib + r < M; r++)
        for (int h = 0; h < 2; h++) {
          const int j = jb + 16 * h;
          if (j >= N) break;
          const __mmask16 m = N - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - j)) - 1);
          float* c = C + size_t(ib + r) * ldc + j;
          __m512 out = _mm512_mul_ps(va, acc[r][h]);
          if (beta != 0.0f) out = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, c), out);
          _mm512_mask_storeu_ps(c, m, out);
        }
    }
  }
}
}  // namespace x86_64_v4
#endif

// The fallback: op(A) and op(B) rounded to bf16 (as floats), then sgemm
void gemm_rounded_sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                        int ldb, float beta, float* C, int ldc) {
  thread_local std::vector<float> a, b;
  a.resize(size_t(M) * K);
  b.resize(size_t(K) * N);
  for (int i = 0; i < M; i++)
    for (int p = 0; p < K; p++)
      a[size_t(i) * K + p] = bf16_to_float(float_to_bf16(ta ? A[size_t(p) * lda + i] : A[size_t(i) * lda + p]));
  for (int p = 0; p < K; p++)
    for (int j = 0; j < N; j++)
      b[size_t(p) * N + j] = bf16_to_float(float_to_bf16(tb ? B[size_t(j) * ldb + p] : B[size_t(p) * ldb + j]));
  gemm_serial(false, false, M, N, K, alpha, a.data(), K, b.data(), N, beta, C, ldc);
}

}  // namespace

bool has_avx512_bf16() {
#if GPT2CORE_BF16_KERNEL
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

void gemm_bf16(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
               float beta, float* C, int ldc) {
  if (M <= 0 || N <= 0) return;
#if GPT2CORE_BF16_KERNEL
  if (has_avx512_bf16()) {
    const int Mp = (M + kMr - 1) / kMr * kMr, Np = (N + kNr - 1) / kNr * kNr, Kp = (K + 1) / 2 * 2;
    thread_local std::vector<uint16_t> Ap, Bp;
    pack_a(Ap, ta, M, K, A, lda, Mp, Kp);
    pack_b(Bp, tb, K, N, B, ldb, Np, Kp);
    x86_64_v4::kernel_avx512_bf16(Ap.data(), Bp.data(), M, N, Mp, Np, Kp, alpha, beta, C, ldc);
    return;
  }
#endif
  gemm_rounded_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace gpt2::cpu
