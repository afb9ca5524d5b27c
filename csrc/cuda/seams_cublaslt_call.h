// The cuBLASLt call behind one gpt2core::seams::matmul (csrc/cuda/seams_cublaslt.cu), split from running it so
// the translation can be checked without a GPU: cuBLASLt's descriptor calls (cublasLtMatmulDescCreate,
// cublasLtMatrixLayoutCreate, cublasLtMatmulPreferenceCreate and their Set/GetAttribute) need neither a handle
// nor a driver; only cublasLtCreate, the heuristic and cublasLtMatmul do. GPU build and its tests only.
#pragma once
#include <cublasLt.h>

#include "cuda/seams.h"

namespace gpt2core::seams {

// Everything cublasLtMatmul(handle, op, &alpha, A, a, B, b, &beta, C, c, D, d, algo, ...) receives for one
// matmul, and the preference its algorithm is chosen with. Owns the descriptors.
struct CublasLtCall {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  const void* A = nullptr;
  const void* B = nullptr;
  const void* C = nullptr;
  void* D = nullptr;
  float alpha = 1.0f, beta = 0.0f;
  CublasLtCall() = default;
  CublasLtCall(const CublasLtCall&) = delete;
  CublasLtCall& operator=(const CublasLtCall&) = delete;
  ~CublasLtCall();
};

// Builds the call for p (validated: validate_matmul(p) == cudaSuccess, m, n > 0): the row-major product as
// cuBLASLt's column-major one, TF32 compute for fp32 inputs when p.tf32, the heuristic preference with
// workspace_bytes and the actual alignment of every matrix. Throws std::runtime_error on a cuBLASLt error.
void describe_matmul(const MatmulParams& p, size_t workspace_bytes, CublasLtCall& call);

// Largest power of two (at most 256, cuBLASLt's default assumption) dividing the address and every byte
// offset from it that the matrix uses (leading dimension, batch stride): what MIN_ALIGNMENT_*_BYTES may promise.
uint32_t alignment_bytes(const void* p, long long ld_bytes, long long batch_stride_bytes);

}  // namespace gpt2core::seams
