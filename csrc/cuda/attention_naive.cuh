// Causal multi-head attention with the T x T probabilities materialised (the "no flash attention" rung, for
// reference and debugging; select with the backend option attention='naive'). Same math and layouts as
// attention.cuh and csrc/cpu/ops.h: qkv (B, T, 3C) = [q | k | v], out (B, T, C), att (B, NH, T, T) holds
// P = softmax(scale q.k) per query row (0 above the diagonal), as the CPU backend's att.
//   backward: dv_j += sum_t P[t,j] dout_t;  dS = P * (dout.v - sum_j P dout.v);  dq_t += scale sum_j dS[t,j] k_j;
//             dk_j += scale sum_t dS[t,j] q_t    (accumulates; every output owned by one warp: deterministic)
// One warp per (b, h, row); lanes over keys for scores and over head dims for the weighted sums.
// Storage: qkv, out, dout, dqkv in floatX (float or __nv_bfloat16); att and the dS scratch in float; compute in
// fp32, each result rounded once to floatX (dqkv: read, add in fp32, round once). vec: the per-lane dot
// products over a whole head row read 16-byte packs (attn::packs_fit), in the same order.
#pragma once
#include "cuda/attention_common.cuh"
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kNaiveThreads = 256;  // every kernel here: one warp per (b, h, query row), 8 rows per block

// Row index r over (b, h, t) as att's layout; returns false for warps past the end.
__device__ inline bool naive_row(int B, int NH, int T, int& b, int& h, int& t) {
  const size_t r = size_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= size_t(B) * NH * T) return false;
  t = int(r % T);
  h = int((r / T) % NH);
  b = int(r / (size_t(T) * NH));
  return true;
}

template <class floatX>
__global__ void __launch_bounds__(kNaiveThreads, 1) attention_naive_softmax_kernel(float* __restrict__ att,         // (B, NH, T, T)
                                               const floatX* __restrict__ qkv,  // (B, T, 3C)
                                               int B, int T, int NH, int hs, float scale, bool vec) {
  int b, h, t;
  if (!naive_row(B, NH, T, b, h, t)) return;
  const int lane = threadIdx.x % 32, C = NH * hs, C3 = 3 * C;
  const floatX* q = qkv + (size_t(b) * T + t) * C3 + size_t(h) * hs;
  float* p = att + ((size_t(b) * NH + h) * T + t) * T;
  float m = -INFINITY;
  for (int j = lane; j <= t; j += 32) {
    const floatX* k = qkv + (size_t(b) * T + j) * C3 + C + size_t(h) * hs;
    const float s = attn::dot_seq(q, k, hs, vec) * scale;
    p[j] = s;
    m = fmaxf(m, s);
  }
  m = warp_max(m);
  float sum = 0.0f;
  for (int j = lane; j <= t; j += 32) {
    const float e = expf(p[j] - m);
    p[j] = e;
    sum += e;
  }
  const float inv = 1.0f / warp_sum(sum);
  for (int j = lane; j < T; j += 32) p[j] = j <= t ? p[j] * inv : 0.0f;
}

template <class floatX>
__global__ void __launch_bounds__(kNaiveThreads, 1) attention_naive_out_kernel(floatX* __restrict__ out,        // (B, T, C)
                                           const float* __restrict__ att,   // (B, NH, T, T)
                                           const floatX* __restrict__ qkv,  // (B, T, 3C)
                                           int B, int T, int NH, int hs) {
  int b, h, t;
  if (!naive_row(B, NH, T, b, h, t)) return;
  const int lane = threadIdx.x % 32, C = NH * hs, C3 = 3 * C;
  const float* p = att + ((size_t(b) * NH + h) * T + t) * T;
  for (int d = lane; d < hs; d += 32) {
    float o = 0.0f;
    for (int j = 0; j <= t; j++) o += p[j] * attn::to_float(qkv[(size_t(b) * T + j) * C3 + 2 * C + size_t(h) * hs + d]);
    out[(size_t(b) * T + t) * C + size_t(h) * hs + d] = attn::from_float<floatX>(o);
  }
}

// Per query row t: dS[t, :] into ds (B, NH, T, T), then dq_t += scale dS[t, :] K.
template <class floatX>
__global__ void __launch_bounds__(kNaiveThreads, 1) attention_naive_dq_kernel(floatX* __restrict__ dqkv,        // (B, T, 3C), accumulated into
                                          float* __restrict__ ds,           // (B, NH, T, T) scratch
                                          const floatX* __restrict__ dout,  // (B, T, C)
                                          const floatX* __restrict__ qkv,   // (B, T, 3C)
                                          const float* __restrict__ att,    // (B, NH, T, T)
                                          int B, int T, int NH, int hs, float scale, bool vec) {
  int b, h, t;
  if (!naive_row(B, NH, T, b, h, t)) return;
  const int lane = threadIdx.x % 32, C = NH * hs, C3 = 3 * C;
  const float* p = att + ((size_t(b) * NH + h) * T + t) * T;
  float* dsr = ds + ((size_t(b) * NH + h) * T + t) * T;
  const floatX* dy = dout + (size_t(b) * T + t) * C + size_t(h) * hs;
  float pdp = 0.0f;
  for (int j = lane; j <= t; j += 32) {
    const floatX* v = qkv + (size_t(b) * T + j) * C3 + 2 * C + size_t(h) * hs;
    const float dp = attn::dot_seq(dy, v, hs, vec);
    dsr[j] = dp;
    pdp += p[j] * dp;
  }
  pdp = warp_sum(pdp);
  for (int j = lane; j <= t; j += 32) dsr[j] = p[j] * (dsr[j] - pdp);
  __syncwarp();  // the row of dS is read across lanes below
  for (int d = lane; d < hs; d += 32) {
    float g = 0.0f;
    for (int j = 0; j <= t; j++) g += dsr[j] * attn::to_float(qkv[(size_t(b) * T + j) * C3 + C + size_t(h) * hs + d]);
    floatX* dq = dqkv + (size_t(b) * T + t) * C3 + size_t(h) * hs + d;
    *dq = attn::from_float<floatX>(attn::to_float(*dq) + scale * g);
  }
}

// Per key row j: dk_j += scale sum_{t >= j} dS[t, j] q_t and dv_j += sum_{t >= j} P[t, j] dout_t.
template <class floatX>
__global__ void __launch_bounds__(kNaiveThreads, 1) attention_naive_dkdv_kernel(floatX* __restrict__ dqkv,        // (B, T, 3C), accumulated into
                                            const float* __restrict__ ds,     // (B, NH, T, T)
                                            const floatX* __restrict__ dout,  // (B, T, C)
                                            const floatX* __restrict__ qkv,   // (B, T, 3C)
                                            const float* __restrict__ att,    // (B, NH, T, T)
                                            int B, int T, int NH, int hs, float scale) {
  int b, h, j;
  if (!naive_row(B, NH, T, b, h, j)) return;
  const int lane = threadIdx.x % 32, C = NH * hs, C3 = 3 * C;
  const size_t base = (size_t(b) * NH + h) * T * T;
  for (int d = lane; d < hs; d += 32) {
    float gk = 0.0f, gv = 0.0f;
    for (int t = j; t < T; t++) {
      const size_t at = base + size_t(t) * T + j;
      gk += ds[at] * attn::to_float(qkv[(size_t(b) * T + t) * C3 + size_t(h) * hs + d]);
      gv += att[at] * attn::to_float(dout[(size_t(b) * T + t) * C + size_t(h) * hs + d]);
    }
    floatX* row = dqkv + (size_t(b) * T + j) * C3 + size_t(h) * hs + d;
    row[C] = attn::from_float<floatX>(attn::to_float(row[C]) + scale * gk);
    row[2 * C] = attn::from_float<floatX>(attn::to_float(row[2 * C]) + gv);
  }
}

template <class floatX>
inline void attention_naive_forward(floatX* out, float* att, const floatX* qkv, int B, int T, int C, int NH,
                                    cudaStream_t stream) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  const int block = kNaiveThreads, rows = ceil_div(size_t(B) * NH * T, block / 32);
  LAUNCH(attention_naive_softmax_kernel<floatX>, rows, block, 0, stream, att, qkv, B, T, NH, hs, scale,
         attn::packs_fit<floatX>(hs, qkv));
  CUDA_CHECK_LAUNCH();
  LAUNCH(attention_naive_out_kernel<floatX>, rows, block, 0, stream, out, att, qkv, B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
}

// ds_scratch: B * NH * T * T floats.
template <class floatX>
inline void attention_naive_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* att,
                                     float* ds_scratch, int B, int T, int C, int NH, cudaStream_t stream) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  const int block = kNaiveThreads, rows = ceil_div(size_t(B) * NH * T, block / 32);
  LAUNCH(attention_naive_dq_kernel<floatX>, rows, block, 0, stream, dqkv, ds_scratch, dout, qkv, att, B, T, NH, hs,
         scale, attn::packs_fit<floatX>(hs, dout, qkv));
  CUDA_CHECK_LAUNCH();
  LAUNCH(attention_naive_dkdv_kernel<floatX>, rows, block, 0, stream, dqkv, ds_scratch, dout, qkv, att, B, T, NH, hs,
         scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
