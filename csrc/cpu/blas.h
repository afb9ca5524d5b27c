// The one place the CPU backend calls BLAS. Row-major GEMM for float and double:
//   C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) + beta * C
// With scipy-openblas32 every symbol carries the prefix "scipy_" (GPT2CORE_BLAS_PREFIX).
//
// Threading: OpenBLAS runs single-threaded and we split C's rows over the OpenMP threads, so only one
// thread pool exists. Two pools (OpenMP's and OpenBLAS's) that both spin-wait between calls took
// ~45% of a d12 step on 2 cores in a profile (blas_thread_server / inner_thread / libgomp spinning).
#pragma once
#include <cblas.h>

#define GPT2CORE_CAT2(a, b) a##b
#define GPT2CORE_CAT(a, b) GPT2CORE_CAT2(a, b)
#define GPT2CORE_BLAS(name) GPT2CORE_CAT(GPT2CORE_BLAS_PREFIX, name)

namespace gpt2::cpu {

void gemm(bool transA, bool transB, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc);
void gemm(bool transA, bool transB, int M, int N, int K, double alpha, const double* A, int lda,
          const double* B, int ldb, double beta, double* C, int ldc);

// gemm on the calling thread alone, never split (work already split over threads: one matrix per thread).
void gemm_serial(bool transA, bool transB, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc);
void gemm_serial(bool transA, bool transB, int M, int N, int K, double alpha, const double* A, int lda,
                 const double* B, int ldb, double beta, double* C, int ldc);

// Pin BLAS to one thread per caller (done once when the module loads).
void blas_init();

}  // namespace gpt2::cpu
