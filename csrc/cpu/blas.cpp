#include "cpu/blas.h"

#include <omp.h>

#include <algorithm>

namespace gpt2::cpu {

namespace {

inline void blas_call(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
                      int ldb, float beta, float* C, int ldc) {
  GPT2CORE_BLAS(cblas_sgemm)(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
                             K, alpha, A, lda, B, ldb, beta, C, ldc);
}
inline void blas_call(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda,
                      const double* B, int ldb, double beta, double* C, int ldc) {
  GPT2CORE_BLAS(cblas_dgemm)(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
                             K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Split the larger of C's two dimensions into one block per thread (multiples of 16). Row blocks of C
// are rows of op(A); column blocks are columns of op(B). Each block is an independent GEMM.
template <typename T>
void gemm_parallel(bool ta, bool tb, int M, int N, int K, T alpha, const T* A, int lda, const T* B, int ldb,
                   T beta, T* C, int ldc) {
  const int nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool split_rows = M >= N;
  const int dim = split_rows ? M : N;
  int parts = std::min(nt, std::max(1, dim / 16));
  if (parts <= 1 || (long long)M * N * K < (1LL << 18)) {
    blas_call(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const int chunk = ((dim + parts - 1) / parts + 15) / 16 * 16;
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int p = 0; p < parts; p++) {
    const int lo = p * chunk, hi = std::min(dim, lo + chunk);
    if (lo >= hi) continue;
    if (split_rows) {
      const T* Ab = ta ? A + lo : A + (size_t)lo * lda;  // rows lo.. of op(A)
      blas_call(ta, tb, hi - lo, N, K, alpha, Ab, lda, B, ldb, beta, C + (size_t)lo * ldc, ldc);
    } else {
      const T* Bb = tb ? B + (size_t)lo * ldb : B + lo;  // columns lo.. of op(B)
      blas_call(ta, tb, M, hi - lo, K, alpha, A, lda, Bb, ldb, beta, C + lo, ldc);
    }
  }
}

}  // namespace

void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
          float beta, float* C, int ldc) {
  gemm_parallel(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void gemm(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda, const double* B, int ldb,
          double beta, double* C, int ldc) {
  gemm_parallel(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void gemm_serial(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) {
  blas_call(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void gemm_serial(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda, const double* B,
                 int ldb, double beta, double* C, int ldc) {
  blas_call(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void blas_init() { GPT2CORE_BLAS(openblas_set_num_threads)(1); }

}  // namespace gpt2::cpu
