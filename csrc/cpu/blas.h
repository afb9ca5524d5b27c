// The one place the CPU backend calls BLAS. Row-major GEMM for float and double:
//   C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) + beta * C
// With scipy-openblas32 every symbol carries the prefix "scipy_" (GPT2CORE_BLAS_PREFIX).
#pragma once
#include <cblas.h>

#define GPT2CORE_CAT2(a, b) a##b
#define GPT2CORE_CAT(a, b) GPT2CORE_CAT2(a, b)
#define GPT2CORE_BLAS(name) GPT2CORE_CAT(GPT2CORE_BLAS_PREFIX, name)

namespace gpt2::cpu {

inline void gemm(bool transA, bool transB, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc) {
  GPT2CORE_BLAS(cblas_sgemm)(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
                             transB ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

inline void gemm(bool transA, bool transB, int M, int N, int K, double alpha, const double* A, int lda,
                 const double* B, int ldb, double beta, double* C, int ldc) {
  GPT2CORE_BLAS(cblas_dgemm)(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
                             transB ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void blas_set_num_threads(int n);

}  // namespace gpt2::cpu
