// Linear layers through the library seam gpt2core::seams::matmul (cuBLASLt on the GPU, the CPU
// implementation in csrc/emu/seams_cpu.cpp under emulation). Row-major, weights (OC, C) as nn.Linear:
//   forward:  out (N, OC) = inp (N, C) @ w^T + bias           (bias epilogue; bias may be null)
//   backward: dinp (N, C) += dout @ w (accumulate, beta = 1), or dinp = dout @ w (beta = 0: the caller's
//             accumulate = false, dinp's old contents never read);
//             dw (OC, C) += dout^T @ inp (always accumulated); dbias (OC) += sum_n dout (the dW GEMM's bias-gradient epilogue, or reduce.cuh)
// With the GELU epilogues (the MLP; gelu is the tanh form of gelu.cuh, see "GELU epilogues" below):
//   matmul_gelu_forward:  pre = inp @ w^T + bias; out = gelu(pre)   (one matmul writes both)
//   gelu_matmul_backward: the backward of out = gelu(pre) @ w^T + bias:
//             dpre (N, C) = (dout @ w) * gelu'(pre)   (WRITTEN, not accumulated: cuBLASLt's DGELU cannot add
//             into D); dw and dbias accumulate as in matmul_backward
// Storage type floatX (float, bf16 or fp16) for inp, w, bias, out, dout and dinp (dinp += is accumulated in fp32
// and rounded once to floatX); dw and dbias are fp32 for either floatX. Products accumulate in fp32 (seams.h).
// mode: the caller's options (BackendOptions), carried into every call's seam params (MatmulMode below).
#pragma once
#include <array>
#include <atomic>
#include <cstdio>
#include <set>

#include "cuda/common.cuh"
#include "cuda/reduce.cuh"
#include "cuda/seams.h"
#if !GPT2CORE_EMU
#include "cuda/seams_cublaslt.h"
#endif

namespace gpt2::cuda {

// The (m, n, k) shapes of dW GEMMs whose bias-gradient epilogue (BGRADB) the library refused, for one backend:
// never asked again (each refusal costs a heuristic query, and with tuning up to 8 failing timed calls), said
// once per shape on stderr, and counted process-wide (bgradb_counts) for build_info() and the doctor.
struct BgradbMemo {
  std::set<std::array<int, 3>> refused;
};
struct BgradbCounts {
  std::atomic<long long> shapes{0};     // shapes refused (per backend: two models may each meet the same one)
  std::atomic<long long> fallbacks{0};  // dW GEMMs whose dbias came from the column-sum kernels instead
};
inline BgradbCounts& bgradb_counts() {
  static BgradbCounts c;
  return c;
}

// How the seam computes a matmul: the caller's options, carried into every call's MatmulParams.
struct MatmulMode {
  bool tf32 = false;  // fp32 inputs on TF32 tensor cores
  bool tune = false;  // time the library's candidate algorithms once per shape and keep the fastest
  BgradbMemo* bgradb = nullptr;  // the caller's refused BGRADB shapes (null: none remembered)
};

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
  return kIsBF16<floatX> ? gpt2core::seams::DType::BF16
         : kIsF16<floatX> ? gpt2core::seams::DType::F16 : gpt2core::seams::DType::F32;
}

// The seam's parameters of out (N, OC) = inp (N, C) @ w^T + bias, all in floatX.
template <class floatX>
gpt2core::seams::MatmulParams linear_params(floatX* out, const floatX* inp, const floatX* w, const floatX* bias, int N,
                                            int C, int OC, MatmulMode mode, cudaStream_t stream) {
  constexpr gpt2core::seams::DType X = seam_dtype<floatX>();
  gpt2core::seams::MatmulParams p;
  p.d = out; p.ldd = OC; p.d_type = X;
  p.a = inp; p.lda = C; p.a_type = X;
  p.b = w; p.ldb = C; p.trans_b = true; p.b_type = X;
  p.m = N; p.n = OC; p.k = C;
  p.bias = bias;
  p.tf32 = mode.tf32;
  p.tune = mode.tune;
  p.stream = stream;
  return p;
}

template <class floatX>
void matmul_forward(floatX* out,          // (N, OC)
                    const floatX* inp,    // (N, C)
                    const floatX* w,      // (OC, C)
                    const floatX* bias,   // (OC) or null
                    int N, int C, int OC, MatmulMode mode, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  MATMUL_CHECK(gpt2core::seams::matmul(linear_params(out, inp, w, bias, N, C, OC, mode, stream)), "forward");
}

// dw (OC, C) += dout^T @ inp; dbias (OC) += sum_n dout when dbias is given.
// dbias: the GEMM's bias-gradient epilogue (BGRADB, seams.h's bias_grad) writes sum_n dout into scratch, which
// one column_reduce pass adds into dbias (the epilogue overwrites; dbias accumulates over micro-steps). Where
// cuBLASLt refuses the epilogue (or scratch is not 16-byte aligned), the GEMM runs plain and
// column_sum_accumulate reads dout again.
// scratch: column_chunks(N, OC) * OC floats (only when dbias is given; the epilogue uses the first OC).
template <class floatX>
void matmul_backward_weights(float* dw,            // (OC, C), accumulated into
                             float* dbias,         // (OC) or null, accumulated into
                             const floatX* dout,   // (N, OC)
                             const floatX* inp,    // (N, C)
                             float* scratch, int N, int C, int OC, MatmulMode mode, cudaStream_t stream) {
  if (N <= 0 || C <= 0 || OC <= 0) return;
  constexpr gpt2core::seams::DType X = seam_dtype<floatX>();
  gpt2core::seams::MatmulParams q;  // dw (OC, C) += dout^T (OC, N) @ inp (N, C)
  q.d = dw; q.ldd = C; q.d_type = gpt2core::seams::DType::F32;
  q.a = dout; q.lda = OC; q.trans_a = true; q.a_type = X;
  q.b = inp; q.ldb = C; q.b_type = X;
  q.m = OC; q.n = C; q.k = N;
  q.accumulate = true;
  const std::array<int, 3> shape{OC, C, N};
  bool fused = dbias && aligned16(scratch) && !(mode.bgradb && mode.bgradb->refused.count(shape));
  q.bias_grad = fused ? scratch : nullptr;
  q.tf32 = mode.tf32;
  q.tune = mode.tune;
  q.stream = stream;
  cudaError_t e = gpt2core::seams::matmul(q);
  if (fused && e == cudaErrorNotSupported) {  // refused, nothing written: the plain GEMM, then the column sums
    q.bias_grad = nullptr, fused = false;
    if (mode.bgradb && mode.bgradb->refused.insert(shape).second) {
      bgradb_counts().shapes++;
      std::string detail;
#if !GPT2CORE_EMU
      detail = gpt2core::seams::last_matmul_error();
#endif
      fprintf(stderr,
              "gpt2core: the matmul library refused the bias-gradient epilogue (BGRADB) of the dW GEMM m=%d n=%d "
              "k=%d (%s); this shape sums dbias with the column-sum kernels from now on (counted in build_info())\n",
              OC, C, N, detail.empty() ? "cudaErrorNotSupported" : detail.c_str());
    }
    e = gpt2core::seams::matmul(q);
  }
  MATMUL_CHECK(e, "backward dweight");
  if (fused) {
    column_reduce(dbias, scratch, 1, OC, stream);  // dbias += the epilogue's sums
  } else if (dbias) {
    if (aligned16(scratch)) bgradb_counts().fallbacks++;
    column_sum_accumulate(dbias, dout, scratch, N, OC, stream);
  }
}

// scratch: column_chunks(N, OC) * OC floats (only when dbias is given).
template <class floatX>
void matmul_backward(floatX* dinp,         // (N, C), accumulated into (accumulate) or written
                     float* dw,            // (OC, C), accumulated into
                     float* dbias,         // (OC) or null, accumulated into
                     const floatX* dout,   // (N, OC)
                     const floatX* inp,    // (N, C)
                     const floatX* w,      // (OC, C)
                     float* scratch, int N, int C, int OC, bool accumulate, MatmulMode mode, cudaStream_t stream) {
  if (N <= 0 || C <= 0 || OC <= 0) return;
  constexpr gpt2core::seams::DType X = seam_dtype<floatX>();
  gpt2core::seams::MatmulParams p;  // dinp (N, C) (+)= dout (N, OC) @ w (OC, C)
  p.d = dinp; p.ldd = C; p.d_type = X;
  p.a = dout; p.lda = OC; p.a_type = X;
  p.b = w; p.ldb = C; p.b_type = X;
  p.m = N; p.n = C; p.k = OC;
  p.accumulate = accumulate;
  p.tf32 = mode.tf32;
  p.tune = mode.tune;
  p.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(p), "backward dinp");
  matmul_backward_weights(dw, dbias, dout, inp, scratch, N, C, OC, mode, stream);
}

// ------------------------------------------------------------------------------------------ GELU epilogues
// cuBLASLt's GELU / DGELU epilogues compute the tanh approximation of GELU, the form GPT-2 uses and gelu.cuh
// and csrc/emu/seams_cpu.cpp implement. NVIDIA's header (cublasLt.h) only says "GELU"; the form is documented
// by its users: PyTorch's _addmm_activation runs its GELU through this epilogue and switched its other GPU
// paths to the tanh form to agree with it (pytorch/pytorch#104061: "cuBLASLt-based fused GELU epilogue ...
// uses tanh approximation"), and a measurement against F.gelu gives 5.5e-6 max difference in fp32 for the
// tanh form vs 4.7e-4 for the erf form (sgl-project/sglang#28164). On a GPU, tests/csrc/cuda/test_cuda_gpu.py checks the
// CUDA model (fused by default) against the CPU backend to 1e-5, which an erf GELU (~1e-3 apart) would fail.
//
// cuBLASLt requires the GELU input ("aux") matrix's leading dimension to be divisible by 8; the backend
// uses these launchers only when gelu_epilogue_ok(ld, ...) holds and the separate kernels otherwise. cuBLASLt may
// still refuse a fused epilogue at run time (no kernel for the combination): the launchers then return false
// having written nothing, and the caller runs the separate kernels.
template <class... P>
inline bool gelu_epilogue_ok(int ld, const P*... p) {
  return ld % 8 == 0 && aligned16(p...);
}

template <class floatX>
[[nodiscard]] bool matmul_gelu_forward(floatX* pre,         // (N, OC): inp @ w^T + bias, kept for backward
                         floatX* out,         // (N, OC): gelu(pre)
                         const floatX* inp,   // (N, C)
                         const floatX* w,     // (OC, C)
                         const floatX* bias,  // (OC) or null
                         int N, int C, int OC, MatmulMode mode, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return true;
  gpt2core::seams::MatmulParams p = linear_params(out, inp, w, bias, N, C, OC, mode, stream);
  p.epilogue = gpt2core::seams::Epilogue::Gelu;
  p.pre_gelu = pre;
  const cudaError_t e = gpt2core::seams::matmul(p);
  if (e == cudaErrorNotSupported) return false;
  MATMUL_CHECK(e, "forward + GELU");
  return true;
}

// The backward of out (N, OC) = gelu(pre) @ w^T + bias, with act = gelu(pre) (N, C) the matmul's input.
// scratch: column_chunks(N, OC) * OC floats (only when dbias is given).
template <class floatX>
[[nodiscard]] bool gelu_matmul_backward(floatX* dpre,         // (N, C), written
                          float* dw,            // (OC, C), accumulated into
                          float* dbias,         // (OC) or null, accumulated into
                          const floatX* dout,   // (N, OC)
                          const floatX* pre,    // (N, C)
                          const floatX* act,    // (N, C): gelu(pre)
                          const floatX* w,      // (OC, C)
                          float* scratch, int N, int C, int OC, MatmulMode mode, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return true;
  constexpr gpt2core::seams::DType X = seam_dtype<floatX>();
  gpt2core::seams::MatmulParams p;  // dpre (N, C) = (dout (N, OC) @ w (OC, C)) * gelu'(pre)
  p.d = dpre; p.ldd = C; p.d_type = X;
  p.a = dout; p.lda = OC; p.a_type = X;
  p.b = w; p.ldb = C; p.b_type = X;
  p.m = N; p.n = C; p.k = OC;
  p.epilogue = gpt2core::seams::Epilogue::GeluBackward;
  p.pre_gelu = const_cast<floatX*>(pre);  // read only by the GELU backward epilogue
  p.tf32 = mode.tf32;
  p.tune = mode.tune;
  p.stream = stream;
  const cudaError_t e = gpt2core::seams::matmul(p);
  if (e == cudaErrorNotSupported) return false;
  MATMUL_CHECK(e, "backward dinp + GELU backward");
  matmul_backward_weights(dw, dbias, dout, act, scratch, N, C, OC, mode, stream);
  return true;
}

// ------------------------------------------------------------------------------------------ FP8 Linear
// The FP8 matmuls of an FP8 Linear layer (precision fp8, Backend::fp8_linear_*), on tensors fp8.cuh quantised
// (q, its transpose qt, meta = [1 / s, amax]; the seam reads meta[0] as the operand's dequantisation factor):
//   forward:  out (N, OC) = deq(inp) (N, C) @ deq(w)^T + bias          inp q (N, C) e4m3, w q (OC, C) e4m3
//   backward: dinp (N, C) (+)= deq(dout) (N, OC) @ deq(w)              dout q (N, OC) e5m2, w qt (C, OC)
//             dw (OC, C) += deq(dout)^T @ deq(inp)                     dout qt (OC, N) e5m2, inp qt (C, N)
// Every product is "TN" (seams.h: both operands contiguous along k), which is why backward takes the transposes.
// out, dinp, bias in floatX (bf16: cuBLASLt's FP8 kernels take a bf16 bias); dw fp32. Products accumulate in fp32.
template <class floatX>
void fp8_linear_forward(floatX* out,           // (N, OC)
                        const uint8_t* inp_q,  // (N, C) e4m3
                        const float* inp_meta, // (2)
                        const uint8_t* w_q,    // (OC, C) e4m3
                        const float* w_meta,   // (2)
                        const floatX* bias,    // (OC) or null
                        int N, int C, int OC, MatmulMode mode, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  gpt2core::seams::MatmulParams p;
  p.d = out; p.ldd = OC; p.d_type = seam_dtype<floatX>();
  p.a = inp_q; p.lda = C; p.a_type = gpt2core::seams::DType::E4M3;
  p.b = w_q; p.ldb = C; p.trans_b = true; p.b_type = gpt2core::seams::DType::E4M3;
  p.m = N; p.n = OC; p.k = C;
  p.bias = bias;
  p.a_scale = inp_meta; p.b_scale = w_meta;
  p.tune = mode.tune;
  p.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(p), "fp8 forward");
}

template <class floatX>
void fp8_linear_backward(floatX* dinp,             // (N, C), accumulated into (accumulate) or written
                         float* dw,                // (OC, C), accumulated into
                         const uint8_t* dout_q,    // (N, OC) e5m2
                         const uint8_t* dout_qt,   // (OC, N) e5m2
                         const float* dout_meta,   // (2)
                         const uint8_t* inp_qt,    // (C, N) e4m3
                         const float* inp_meta,    // (2)
                         const uint8_t* w_qt,      // (C, OC) e4m3
                         const float* w_meta,      // (2)
                         int N, int C, int OC, bool accumulate, MatmulMode mode, cudaStream_t stream) {
  if (N <= 0 || C <= 0 || OC <= 0) return;
  using gpt2core::seams::DType;
  gpt2core::seams::MatmulParams p;  // dinp (N, C) (+)= dout (N, OC) @ w (OC, C), w as its transpose (C, OC)
  p.d = dinp; p.ldd = C; p.d_type = seam_dtype<floatX>();
  p.a = dout_q; p.lda = OC; p.a_type = DType::E5M2;
  p.b = w_qt; p.ldb = OC; p.trans_b = true; p.b_type = DType::E4M3;
  p.m = N; p.n = C; p.k = OC;
  p.accumulate = accumulate;
  p.a_scale = dout_meta; p.b_scale = w_meta;
  p.tune = mode.tune;
  p.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(p), "fp8 backward dinp");
  gpt2core::seams::MatmulParams q;  // dw (OC, C) += dout^T (OC, N) @ inp (N, C), inp as its transpose (C, N)
  q.d = dw; q.ldd = C; q.d_type = DType::F32;
  q.a = dout_qt; q.lda = N; q.a_type = DType::E5M2;
  q.b = inp_qt; q.ldb = N; q.trans_b = true; q.b_type = DType::E4M3;
  q.m = OC; q.n = C; q.k = N;
  q.accumulate = true;
  q.a_scale = dout_meta; q.b_scale = inp_meta;
  q.tune = mode.tune;
  q.stream = stream;
  MATMUL_CHECK(gpt2core::seams::matmul(q), "fp8 backward dweight");
}

}  // namespace gpt2::cuda
