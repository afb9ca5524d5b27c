// Linear layers through the library seam gpt2core::seams::matmul (cuBLASLt on the GPU, the CPU
// implementation in csrc/emu/seams_cpu.cpp under emulation). Row-major, weights (OC, C) as nn.Linear:
//   forward:  out (N, OC) = inp (N, C) @ w^T + bias           (bias epilogue; bias may be null)
//   backward: dinp (N, C) += dout @ w;  dw (OC, C) += dout^T @ inp   (accumulate, beta = 1)
//             dbias (OC) += sum_n dout                         (reduce.cuh: deterministic, no atomics)
// Storage type floatX (float or bf16) for inp, w, bias, out, dout and dinp (dinp += is accumulated in fp32
// and rounded once to floatX); dw and dbias are fp32 for either floatX. Products accumulate in fp32 (seams.h).
#pragma once
#include "cuda/common.cuh"
#include "cuda/reduce.cuh"
#include "emu/seams.h"
#if !GPT2CORE_EMU
#include "cuda/seams_cublaslt.h"
#endif

namespace gpt2::cuda {

inline void check_matmul(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return;
  std::string detail;
#if !GPT2CORE_EMU
  detail = gpt2core::seams::last_matmul_error();
#endif
  throw std::runtime_error(std::string("matmul (") + what + ") failed at " + file + ":" + std::to_string(line) + ": " +
                           cudaGetErrorString(e) + (detail.empty() ? "" : " (" + detail + ")"));
}
#define MATMUL_CHECK(call, what) ::gpt2::cuda::check_matmul((call), what, __FILE__, __LINE__)

// The seam's element type of a storage type.
template <class floatX>
constexpr gpt2core::seams::DType seam_dtype() {
  return kIsBF16<floatX> ? gpt2core::seams::DType::BF16 : gpt2core::seams::DType::F32;
}

template <class floatX>
void matmul_forward(floatX* out,          // (N, OC)
                    const floatX* inp,    // (N, C)
                    const floatX* w,      // (OC, C)
                    const floatX* bias,   // (OC) or null
                    int N, int C, int OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  constexpr gpt2core::seams::DType X = seam_dtype<floatX>();
  gpt2core::seams::MatmulParams p;
  p.d = out; p.ldd = OC; p.d_type = X;
  p.a = inp; p.lda = C; p.a_type = X;
  p.b = w; p.ldb = C; p.trans_b = true; p.b_type = X;
  p.m = N; p.n = OC; p.k = C;
  p.bias = bias;
  p.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(p), "forward");
}

// scratch: column_chunks(N) * OC floats (only when dbias is given).
template <class floatX>
void matmul_backward(floatX* dinp,         // (N, C), accumulated into
                     float* dw,            // (OC, C), accumulated into
                     float* dbias,         // (OC) or null, accumulated into
                     const floatX* dout,   // (N, OC)
                     const floatX* inp,    // (N, C)
                     const floatX* w,      // (OC, C)
                     float* scratch, int N, int C, int OC, cudaStream_t stream) {
  if (N <= 0 || C <= 0 || OC <= 0) return;
  constexpr gpt2core::seams::DType X = seam_dtype<floatX>();
  gpt2core::seams::MatmulParams p;  // dinp (N, C) += dout (N, OC) @ w (OC, C)
  p.d = dinp; p.ldd = C; p.d_type = X;
  p.a = dout; p.lda = OC; p.a_type = X;
  p.b = w; p.ldb = C; p.b_type = X;
  p.m = N; p.n = C; p.k = OC;
  p.accumulate = true;
  p.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(p), "backward dinp");
  gpt2core::seams::MatmulParams q;  // dw (OC, C) += dout^T (OC, N) @ inp (N, C)
  q.d = dw; q.ldd = C; q.d_type = gpt2core::seams::DType::F32;
  q.a = dout; q.lda = OC; q.trans_a = true; q.a_type = X;
  q.b = inp; q.ldb = C; q.b_type = X;
  q.m = OC; q.n = C; q.k = N;
  q.accumulate = true;
  q.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(q), "backward dweight");
  if (dbias) column_sum_accumulate(dbias, dout, scratch, N, OC, stream);
}

}  // namespace gpt2::cuda
