// Linear layers through the library seam gpt2core::seams::matmul (cuBLASLt on the GPU, the CPU
// implementation in csrc/emu/seams_cpu.cpp under emulation). Row-major, weights (OC, C) as nn.Linear:
//   forward:  out (N, OC) = inp (N, C) @ w^T + bias           (bias epilogue; bias may be null)
//   backward: dinp (N, C) += dout @ w;  dw (OC, C) += dout^T @ inp   (accumulate, beta = 1)
//             dbias (OC) += sum_n dout                         (reduce.cuh: deterministic, no atomics)
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

inline void matmul_forward(float* out, const float* inp, const float* w, const float* bias, int N, int C, int OC,
                           cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  gpt2core::seams::MatmulParams p;
  p.d = out; p.ldd = OC;
  p.a = inp; p.lda = C;
  p.b = w; p.ldb = C; p.trans_b = true;
  p.m = N; p.n = OC; p.k = C;
  p.bias = bias;
  p.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(p), "forward");
}

// scratch: column_chunks(N) * OC floats (only when dbias is given).
inline void matmul_backward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w,
                            float* scratch, int N, int C, int OC, cudaStream_t stream) {
  if (N <= 0 || C <= 0 || OC <= 0) return;
  gpt2core::seams::MatmulParams p;  // dinp (N, C) += dout (N, OC) @ w (OC, C)
  p.d = dinp; p.ldd = C;
  p.a = dout; p.lda = OC;
  p.b = w; p.ldb = C;
  p.m = N; p.n = C; p.k = OC;
  p.accumulate = true;
  p.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(p), "backward dinp");
  gpt2core::seams::MatmulParams q;  // dw (OC, C) += dout^T (OC, N) @ inp (N, C)
  q.d = dw; q.ldd = C;
  q.a = dout; q.lda = OC; q.trans_a = true;
  q.b = inp; q.ldb = C;
  q.m = OC; q.n = C; q.k = N;
  q.accumulate = true;
  q.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(q), "backward dweight");
  if (dbias) column_sum_accumulate(dbias, dout, scratch, N, OC, stream);
}

}  // namespace gpt2::cuda
