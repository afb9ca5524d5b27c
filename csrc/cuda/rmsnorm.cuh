// RMSNorm without a learnable gain (modded-nanogpt / nanochat's F.rms_norm(x, (C,))), over rows of C values,
// storage type floatX (float, bf16 or fp16):
//   forward:  rstd = 1 / sqrt(sum x^2 / C + eps), out = x * rstd; rstd (fp32) saved per row.
//   residual_rmsnorm_forward (fused): residual = a + b rounded to floatX, then the forward above on the ROUNDED
//             residual: bit for bit residual_forward followed by rmsnorm_forward.
//   backward: norm = x * rstd, dinp += rstd * (dout - norm * mean(dout * norm))    (accumulates, in floatX; or,
//             accumulate = false, dinp = ... without reading dinp). No parameters, so no parameter gradients.
//             kFromOut: the row given is the forward's OUTPUT norm (not x), as where the forward ran in place.
// The rows: row r starts at (r / group) * group_stride + (r % group) * C. A plain (N, C) matrix is group = 1,
// group_stride = C; QK-norm (qknorm_forward / qknorm_backward below) normalises each head of q and k in the
// attention input qkv (B, T, 3C') in place: C = HS, group = 2 NH (q's heads then k's), group_stride = 3C'.
// All arithmetic in fp32 registers; floatX values are rounded once when stored.
// One warp per row: pass 1 sums (squares) per lane in a fixed order then across the warp, pass 2 re-reads the row
// (the warp's own values, from L1) and writes. out may alias inp and dinp may alias dout (in-place QK-norm): each
// value is read by the lane that writes it, before it writes it.
#pragma once
#include "cuda/common.cuh"
#include "cuda/layernorm.cuh"  // pairwise_sum

namespace gpt2::cuda {

// ----------------------------------------------------------------------------------------- kernels
// vec (C % kVec<floatX> == 0 and every row 16-byte aligned): lanes move Vec<floatX>; otherwise one value per access.
// kResidual: the row x is first formed as a + b (rounded to floatX) and written to residual; pass 2 reads it back.
constexpr int kRmsBlock = 256;  // 8 rows (warps) per block; the launch bound of this file's kernels
template <class floatX, bool kResidual>
__global__ void __launch_bounds__(kRmsBlock) rmsnorm_forward_kernel(floatX* residual,                 // (N, C) written when kResidual
                                       floatX* out,                      // rows, may alias inp
                                       float* __restrict__ rstd,         // (N)
                                       const floatX* inp,                // rows (kResidual: a, (N, C))
                                       const floatX* __restrict__ inp2,  // (N, C) b when kResidual, else null
                                       int N, int C, int group, size_t group_stride, float eps, bool vec) {
  using V = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;  // the whole warp leaves together
  const size_t off = size_t(row / group) * group_stride + size_t(row % group) * C;
  const floatX* x = inp + off;
  floatX* o = out + off;
  floatX* res = kResidual ? residual + off : nullptr;
  const floatX* x2 = kResidual ? inp2 + off : nullptr;
  const floatX* xr = kResidual ? res : x;  // what pass 2 reads: the rounded residual when fused
  const int CV = vec ? C / K : 0;          // vector part; the scalar loops cover [K * CV, C)
  // pass 1: sum of squares (and, fused, the residual write)
  float ss = 0.0f;
  for (int i = lane; i < CV; i += 32) {
    V a = V::load(x + size_t(i) * K);
    if constexpr (kResidual) {
      const V bb = V::load(x2 + size_t(i) * K);
#pragma unroll
      for (int k = 0; k < K; k++) a.set(k, a.f(k) + bb.f(k));
      a.store(res + size_t(i) * K);
    }
    float sq[K];
#pragma unroll
    for (int k = 0; k < K; k++) sq[k] = a.f(k) * a.f(k);
    ss += pairwise_sum<V>(sq);
  }
  for (int i = K * CV + lane; i < C; i += 32) {
    float v = load_f(x[i]);
    if constexpr (kResidual) {
      const floatX r = store_t<floatX>(v + load_f(x2[i]));
      res[i] = r;
      v = load_f(r);
    }
    ss += v * v;
  }
  const float r = 1.0f / sqrtf(warp_sum(ss) / C + eps);
  // pass 2: scale
  for (int i = lane; i < CV; i += 32) {
    const V a = V::load(xr + size_t(i) * K);
    V y;
#pragma unroll
    for (int k = 0; k < K; k++) y.set(k, a.f(k) * r);
    y.store(o + size_t(i) * K);
  }
  for (int i = K * CV + lane; i < C; i += 32) o[i] = store_t<floatX>(load_f(xr[i]) * r);
  if (lane == 0) rstd[row] = r;
}

// kFromOut: x holds the forward's output (norm), else its input (norm = x * rstd).
template <class floatX, bool kFromOut>
__global__ void __launch_bounds__(kRmsBlock) rmsnorm_backward_kernel(floatX* dinp,                    // rows, += (add) or written; may alias dout
                                        const floatX* dout,              // rows
                                        const floatX* __restrict__ x,    // rows: the forward's input (or output)
                                        const float* __restrict__ rstd,  // (N)
                                        int N, int C, int group, size_t group_stride, bool vec, bool add) {
  using V = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const size_t off = size_t(row / group) * group_stride + size_t(row % group) * C;
  const floatX* xx = x + off;
  const floatX* dy = dout + off;
  floatX* dx = dinp + off;
  const float s = rstd[row];
  const float ns = kFromOut ? 1.0f : s;  // norm = x * ns
  const int CV = vec ? C / K : 0;
  float dot = 0.0f;
  for (int i = lane; i < CV; i += 32) {
    const V a = V::load(xx + size_t(i) * K), g = V::load(dy + size_t(i) * K);
    float t[K];
#pragma unroll
    for (int k = 0; k < K; k++) t[k] = g.f(k) * (a.f(k) * ns);
    dot += pairwise_sum<V>(t);
  }
  for (int i = K * CV + lane; i < C; i += 32) dot += load_f(dy[i]) * (load_f(xx[i]) * ns);
  dot = warp_sum(dot) / C;
  for (int i = lane; i < CV; i += 32) {
    const V a = V::load(xx + size_t(i) * K), g = V::load(dy + size_t(i) * K);
    V d;
    if (add) d = V::load(dx + size_t(i) * K);
#pragma unroll
    for (int k = 0; k < K; k++) d.set(k, (add ? d.f(k) : 0.0f) + s * (g.f(k) - a.f(k) * ns * dot));
    d.store(dx + size_t(i) * K);
  }
  for (int i = K * CV + lane; i < C; i += 32)
    dx[i] = store_t<floatX>((add ? load_f(dx[i]) : 0.0f) + s * (load_f(dy[i]) - load_f(xx[i]) * ns * dot));
}

// ----------------------------------------------------------------------------------------- launchers

// vec needs every row 16-byte aligned: the row length and the group stride in whole vectors
template <class floatX>
inline bool rmsnorm_vec_ok(int C, size_t group_stride) {
  return C % kVec<floatX> == 0 && group_stride % kVec<floatX> == 0;
}

template <class floatX>
void rmsnorm_forward(floatX* out,        // (N, C)
                     float* rstd,        // (N)
                     const floatX* inp,  // (N, C)
                     int N, int C, float eps, cudaStream_t stream) {
  if (N <= 0) return;
  const bool vec = rmsnorm_vec_ok<floatX>(C, C) && aligned16(out, inp);
  LAUNCH((rmsnorm_forward_kernel<floatX, false>), ceil_div(N, kRmsBlock / 32), kRmsBlock, 0, stream, nullptr, out,
         rstd, inp, nullptr, N, C, 1, size_t(C), eps, vec);
  CUDA_CHECK_LAUNCH();
}

// residual = a + b (rounded to floatX); out, rstd = rmsnorm of the rounded residual
template <class floatX>
void residual_rmsnorm_forward(floatX* residual,  // (N, C)
                              floatX* out,       // (N, C)
                              float* rstd,       // (N)
                              const floatX* a,   // (N, C)
                              const floatX* b,   // (N, C)
                              int N, int C, float eps, cudaStream_t stream) {
  if (N <= 0) return;
  const bool vec = rmsnorm_vec_ok<floatX>(C, C) && aligned16(residual, out, a, b);
  LAUNCH((rmsnorm_forward_kernel<floatX, true>), ceil_div(N, kRmsBlock / 32), kRmsBlock, 0, stream, residual, out,
         rstd, a, b, N, C, 1, size_t(C), eps, vec);
  CUDA_CHECK_LAUNCH();
}

// accumulate: dinp += (else dinp is written, never read)
template <class floatX>
void rmsnorm_backward(floatX* dinp,        // (N, C)
                      const floatX* dout,  // (N, C)
                      const floatX* inp,   // (N, C): the forward's input
                      const float* rstd,   // (N)
                      int N, int C, bool accumulate, cudaStream_t stream) {
  if (N <= 0) return;
  const bool vec = rmsnorm_vec_ok<floatX>(C, C) && aligned16(dinp, dout, inp);
  LAUNCH((rmsnorm_backward_kernel<floatX, false>), ceil_div(N, kRmsBlock / 32), kRmsBlock, 0, stream, dinp, dout,
         inp, rstd, N, C, 1, size_t(C), vec, accumulate);
  CUDA_CHECK_LAUNCH();
}

// QK-norm, in place: each head's q and k (HS = C / NH values) of qkv (B, T, 3C) replaced by its RMSNorm; v untouched.
// rstd (B * T, 2 NH): q's heads then k's, per token.
template <class floatX>
void qknorm_forward(floatX* qkv,   // (B, T, 3C), in place
                    float* rstd,   // (B * T * 2 NH)
                    int BT, int C, int NH, float eps, cudaStream_t stream) {
  if (BT <= 0) return;
  const int HS = C / NH, N = BT * 2 * NH;
  const bool vec = rmsnorm_vec_ok<floatX>(HS, size_t(3) * C) && aligned16(qkv);
  LAUNCH((rmsnorm_forward_kernel<floatX, false>), ceil_div(N, kRmsBlock / 32), kRmsBlock, 0, stream, nullptr, qkv,
         rstd, qkv, nullptr, N, HS, 2 * NH, size_t(3) * C, eps, vec);
  CUDA_CHECK_LAUNCH();
}

// The backward of qknorm_forward, in place on the q and k parts of dqkv (the gradient with respect to the normed
// values becomes the gradient with respect to the values before the norm); qkv: the forward's OUTPUT (normed q, k).
template <class floatX>
void qknorm_backward(floatX* dqkv,        // (B, T, 3C), in place (q and k parts)
                     const floatX* qkv,   // (B, T, 3C): normed q and k, as attention read them
                     const float* rstd,   // (B * T * 2 NH)
                     int BT, int C, int NH, cudaStream_t stream) {
  if (BT <= 0) return;
  const int HS = C / NH, N = BT * 2 * NH;
  const bool vec = rmsnorm_vec_ok<floatX>(HS, size_t(3) * C) && aligned16(dqkv, qkv);
  LAUNCH((rmsnorm_backward_kernel<floatX, true>), ceil_div(N, kRmsBlock / 32), kRmsBlock, 0, stream, dqkv, dqkv,
         qkv, rstd, N, HS, 2 * NH, size_t(3) * C, vec, false);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
