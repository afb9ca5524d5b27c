// seams.h: the narrow interfaces through which CUDA backend code reaches the vendor libraries that
// cannot be emulated (cuBLASLt, cuDNN, NCCL).
//
//   GPU build:       implemented in csrc/cuda/ over cuBLASLt (seams_cublaslt.cu) and cuDNN (seams_cudnn.cu).
//   emulated build:  implemented in csrc/emu/seams_cpu.cpp on the host, with the same numerics contract,
//                    so the whole CUDA training step runs in CI.
//
// All calls are stream-ordered (synchronous in the emulation), take device pointers, return a
// cudaError_t (cudaErrorInvalidValue for bad shapes, cudaErrorNotSupported for what a build lacks)
// and never throw. Callers check with their CUDA_CHECK; kernels and host launchers stay unaware of
// which implementation is linked.
//
// Numerics contract (both implementations):
//   - inputs are read in their dtype and widened to fp32; products are accumulated in fp32 (order
//     unspecified, so results agree to fp32 rounding, not bit for bit);
//   - epilogues (alpha, bias, GELU, GELU backward, accumulation into D) are applied to the fp32 value;
//   - every stored output is rounded once to its dtype (round to nearest even for bf16 and fp16).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace gpt2core::seams {

// F16: IEEE half precision (__half); E4M3, E5M2: the FP8 formats of csrc/model/fp8.h (matmul inputs only)
enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4 };

inline bool is_fp8(DType t) { return t == DType::E4M3 || t == DType::E5M2; }
inline size_t dtype_size(DType t) { return t == DType::F32 ? 4 : is_fp8(t) ? 1 : 2; }

// ---------------------------------------------------------------------------------------- matmul
enum class Epilogue : int {
  None = 0,      // v = alpha * acc (+ bias if given)
  Gelu = 1,      // pre = alpha * acc (+ bias); v = gelu(pre); pre_gelu (if given) receives pre
  GeluBackward = 2,  // v = alpha * acc * gelu'(pre_gelu)            (pre_gelu required)
};

// D (m, n) = epilogue(op(A) @ op(B)), all matrices row-major with leading dimensions in elements.
//   op(A) is (m, k): A is stored (m, k), or (k, m) when trans_a;
//   op(B) is (k, n): B is stored (k, n), or (n, k) when trans_b (a Linear weight (out, in) gives
//   x @ W^T with trans_b = true, n = out, k = in).
// accumulate: D = D + v (beta = 1) instead of D = v, with Epilogue::None only: cuBLASLt applies its GELU
// epilogues to alpha AB + beta C (gelu(AB + C + bias), not D + gelu(AB + bias)), and DGELU cannot accumulate,
// so GELU epilogues with accumulate are cudaErrorNotSupported. batch > 1 repeats the product with the strides.
// bias: (n) in d_type, broadcast over rows. pre_gelu: (m, n) in d_type with leading dimension ldd.
// bias_grad: (m) in d_type, WRITTEN (never accumulated) with the row sums of op(A): bias_grad[i] = sum_k op(A)[i, k]
// (a weight gradient dW = dout^T @ inp, op(A) = dout^T, gets dbias = column sums of dout); cuBLASLt's BGRADB
// epilogue. Only with Epilogue::None, no bias and batch 1 (cudaErrorInvalidValue otherwise); D may accumulate.
// The cuBLASLt implementation maps this row-major product onto column-major D^T = op(B)^T op(A)^T.
//
// FP8 (a_type and b_type E4M3 / E5M2, not both E5M2; sm_89 / sm_90): D = alpha * (*a_scale) * (*b_scale) *
// (op(A) @ op(B)) (+ bias) (+ D), each fp8 value widened exactly, products accumulated in fp32 (cuBLASLt's fast
// accumulation off), D in F32, BF16 or F16. a_scale / b_scale: device pointers to one float each, the
// dequantisation factors of A and B (null: 1), read when the matmul runs. cuBLASLt's FP8 kernels take the "TN"
// layout only, which in this row-major seam is trans_a = false, trans_b = true (both operands contiguous along
// k); they also need k, lda and ldb multiples of 16, ldd a multiple of 16 bytes and A, B, D 16-byte aligned.
// Anything else with FP8 inputs is cudaErrorInvalidValue; a GELU epilogue, bias_grad, batch > 1, or a bias with an
// F32 D (cuBLASLt's FP8 kernels then take a bf16 bias) are cudaErrorNotSupported. Scale pointers without FP8
// inputs, or an FP8 D, are cudaErrorInvalidValue.
struct MatmulParams {
  void* d = nullptr;
  DType d_type = DType::F32;
  int ldd = 0;
  const void* a = nullptr;
  DType a_type = DType::F32;
  int lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  DType b_type = DType::F32;
  int ldb = 0;
  bool trans_b = false;
  int m = 0, n = 0, k = 0;
  float alpha = 1.0f;
  bool accumulate = false;
  Epilogue epilogue = Epilogue::None;
  const void* bias = nullptr;
  void* pre_gelu = nullptr;
  void* bias_grad = nullptr;
  int batch = 1;
  long long stride_a = 0, stride_b = 0, stride_d = 0;  // elements between batch entries
  // batch > 1: each entry's D bitwise what the same call with batch 1 at that entry's pointers gives, so that a
  // result does not depend on the batch it is computed in (Muon's Newton-Schulz: data-parallel ranks batch
  // different shares of the matrices). cuBLASLt runs the batch-of-one's algorithm over the whole batch when every
  // alignment is its 256-byte maximum and cuBLASLt accepts that algorithm for the batched layout, else one call
  // per entry; the CPU implementation has one algorithm and ignores it
  bool batch_invariant = false;
  // all-fp32 products may use TF32 tensor cores (inputs rounded to a 10-bit mantissa; cuBLASLt's
  // CUBLAS_COMPUTE_32F_FAST_TF32); the CPU implementation computes in fp32 either way
  bool tf32 = false;
  // time the library's candidate algorithms once per problem and keep the fastest (else its heuristic's first);
  // the CPU implementation has one algorithm and ignores it
  bool tune = false;
  const float* a_scale = nullptr;  // FP8 only: A's dequantisation factor (device memory; null: 1)
  const float* b_scale = nullptr;  // FP8 only: B's
  cudaStream_t stream = nullptr;
};
cudaError_t matmul(const MatmulParams& p);

// The argument checks every matmul implementation shares (shapes, pointers, leading dimensions, GELU
// backward needs pre_gelu, bias_grad alone, no GELU epilogue with accumulate, the FP8 rules above). The empty
// product (m == 0 or n == 0) is valid.
inline cudaError_t validate_fp8_matmul(const MatmulParams& p) {
  const bool a8 = is_fp8(p.a_type), b8 = is_fp8(p.b_type);
  if (is_fp8(p.d_type)) return cudaErrorInvalidValue;
  if (!a8 && !b8) return p.a_scale || p.b_scale ? cudaErrorInvalidValue : cudaSuccess;
  if (a8 != b8 || (p.a_type == DType::E5M2 && p.b_type == DType::E5M2)) return cudaErrorInvalidValue;
  if (p.trans_a || !p.trans_b || p.k % 16 || p.lda % 16 || p.ldb % 16 || (p.ldd * dtype_size(p.d_type)) % 16)
    return cudaErrorInvalidValue;
  auto misaligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 != 0; };
  if (misaligned(p.a) || misaligned(p.b) || misaligned(p.d)) return cudaErrorInvalidValue;
  if (p.epilogue != Epilogue::None || p.bias_grad || p.batch > 1 || (p.bias && p.d_type == DType::F32))
    return cudaErrorNotSupported;
  return cudaSuccess;
}

inline cudaError_t validate_matmul(const MatmulParams& p) {
  if (p.m < 0 || p.n < 0 || p.k < 0 || p.batch < 1) return cudaErrorInvalidValue;
  if (const cudaError_t e = validate_fp8_matmul(p); e != cudaSuccess) return e;
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  const int a_cols = p.trans_a ? p.m : p.k, b_cols = p.trans_b ? p.k : p.n;
  if (!p.d || p.ldd < p.n || (p.k > 0 && (!p.a || !p.b || p.lda < a_cols || p.ldb < b_cols)))
    return cudaErrorInvalidValue;
  if (p.epilogue == Epilogue::GeluBackward && !p.pre_gelu) return cudaErrorInvalidValue;
  if (p.bias_grad && (p.epilogue != Epilogue::None || p.bias || p.batch > 1)) return cudaErrorInvalidValue;
  if (p.epilogue != Epilogue::None && p.accumulate) return cudaErrorNotSupported;
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------- attention
// Causal multi-head self-attention as cuDNN's fused SDPA computes it, in llm.c's layouts:
//   qkv (B, T, 3, NH, HS) in dtype; out (B, T, NH, HS) in dtype; stats (B, NH, T) fp32 logsumexp of
//   the scaled scores per query row (saved by forward, read by backward).
// scale is usually 1 / sqrt(HS). Backward writes dqkv (B, T, 3, NH, HS) (overwrites, no +=); deterministic: the
// same bits for the same inputs (cuDNN: set_deterministic_algorithm(true), no atomic dQ accumulation; the CPU
// implementation always is).
struct AttentionForwardParams {
  void* out = nullptr;
  float* stats = nullptr;
  const void* qkv = nullptr;
  DType dtype = DType::F32;
  int B = 0, T = 0, NH = 0, HS = 0;
  float scale = 0.0f;
  cudaStream_t stream = nullptr;
};
cudaError_t attention_forward(const AttentionForwardParams& p);

struct AttentionBackwardParams {
  void* dqkv = nullptr;
  const void* dout = nullptr;
  const void* qkv = nullptr;
  const void* out = nullptr;
  const float* stats = nullptr;
  DType dtype = DType::F32;
  int B = 0, T = 0, NH = 0, HS = 0;
  float scale = 0.0f;
  bool deterministic = true;
  cudaStream_t stream = nullptr;
};
cudaError_t attention_backward(const AttentionBackwardParams& p);

// ---------------------------------------------------------------------------------------- collectives
// A communicator over the ranks of one training run (NCCL in the GPU build). The emulation supports
// a single rank, for which every collective is a copy (or nothing, in place).
struct Comm;
enum class ReduceOp : int { Sum = 0, Avg = 1 };

// unique_id: the bytes rank 0 created with comm_unique_id and shared out of band (ignored when world == 1).
cudaError_t comm_unique_id(void* id, size_t size);
cudaError_t comm_init(Comm** comm, int rank, int world, const void* unique_id, size_t id_size);
cudaError_t comm_destroy(Comm* comm);
int comm_rank(const Comm* comm);
int comm_world(const Comm* comm);

// out (count) = op over ranks of in (count); out == in allowed.
cudaError_t all_reduce(Comm* comm, void* out, const void* in, size_t count, DType dtype, ReduceOp op,
                       cudaStream_t stream);
// out (count) = op over ranks of in[rank * count : (rank + 1) * count]; in has world * count elements.
cudaError_t reduce_scatter(Comm* comm, void* out, const void* in, size_t count, DType dtype, ReduceOp op,
                           cudaStream_t stream);
// out (world * count) = concatenation over ranks of in (count).
cudaError_t all_gather(Comm* comm, void* out, const void* in, size_t count, DType dtype, cudaStream_t stream);

}  // namespace gpt2core::seams
