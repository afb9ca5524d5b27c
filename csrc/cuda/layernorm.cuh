// LayerNorm over the last dimension (C), eps 1e-5, as csrc/cpu/ops.h:
//   forward:  mean = sum x / C, var = sum (x - mean)^2 / C, rstd = 1 / sqrt(var + eps),
//             out = (x - mean) * rstd * w + b; mean and rstd saved per row.
//   backward: norm = (x - mean) * rstd, dnorm = w * dout,
//             dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd      (accumulates)
//             dw += sum_rows norm * dout, db += sum_rows dout                         (accumulates)
// One warp per row for the row-wise parts; parameter gradients reduced deterministically in two passes
// (reduce.cuh), no float atomics.
#pragma once
#include "cuda/common.cuh"
#include "cuda/reduce.cuh"

namespace gpt2::cuda {

// ----------------------------------------------------------------------------------------- kernels
// vec (C % 4 == 0 and 16-byte aligned pointers): lanes move float4; otherwise one float per access.
__global__ void layernorm_forward_kernel(float* __restrict__ out,        // (N, C)
                                         float* __restrict__ mean,       // (N)
                                         float* __restrict__ rstd,       // (N)
                                         const float* __restrict__ inp,  // (N, C)
                                         const float* __restrict__ w,    // (C)
                                         const float* __restrict__ b,    // (C)
                                         int N, int C, bool vec) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;  // the whole warp leaves together
  const float* x = inp + size_t(row) * C;
  float* o = out + size_t(row) * C;
  const int C4 = vec ? C / 4 : 0;  // float4 part; the scalar loops below cover [4 * C4, C)
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float s = 0.0f;
  for (int i = lane; i < C4; i += 32) {
    const float4 v = x4[i];
    s += (v.x + v.y) + (v.z + v.w);
  }
  for (int i = 4 * C4 + lane; i < C; i += 32) s += x[i];
  const float m = warp_sum(s) / C;
  float v = 0.0f;
  for (int i = lane; i < C4; i += 32) {
    const float4 a = x4[i];
    const float d0 = a.x - m, d1 = a.y - m, d2 = a.z - m, d3 = a.w - m;
    v += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
  }
  for (int i = 4 * C4 + lane; i < C; i += 32) {
    const float d = x[i] - m;
    v += d * d;
  }
  const float r = 1.0f / sqrtf(warp_sum(v) / C + 1e-5f);
  for (int i = lane; i < C4; i += 32) {
    const float4 a = x4[i], ww = reinterpret_cast<const float4*>(w)[i], bb = reinterpret_cast<const float4*>(b)[i];
    reinterpret_cast<float4*>(o)[i] = make_float4((a.x - m) * r * ww.x + bb.x, (a.y - m) * r * ww.y + bb.y,
                                                  (a.z - m) * r * ww.z + bb.z, (a.w - m) * r * ww.w + bb.w);
  }
  for (int i = 4 * C4 + lane; i < C; i += 32) o[i] = (x[i] - m) * r * w[i] + b[i];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

__global__ void layernorm_backward_input_kernel(float* __restrict__ dinp,        // (N, C), accumulated into
                                                const float* __restrict__ dout,  // (N, C)
                                                const float* __restrict__ inp,   // (N, C)
                                                const float* __restrict__ w,     // (C)
                                                const float* __restrict__ mean,  // (N)
                                                const float* __restrict__ rstd,  // (N)
                                                int N, int C, bool vec) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const float* dy = dout + size_t(row) * C;
  const float* x = inp + size_t(row) * C;
  float* dx = dinp + size_t(row) * C;
  const float m = mean[row], s = rstd[row];
  const int C4 = vec ? C / 4 : 0;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* dy4 = reinterpret_cast<const float4*>(dy);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float dmean = 0.0f, dnmean = 0.0f;
  for (int i = lane; i < C4; i += 32) {
    const float4 a = x4[i], g = dy4[i], ww = w4[i];
    const float n0 = ww.x * g.x, n1 = ww.y * g.y, n2 = ww.z * g.z, n3 = ww.w * g.w;
    dmean += (n0 + n1) + (n2 + n3);
    dnmean += (n0 * (a.x - m) * s + n1 * (a.y - m) * s) + (n2 * (a.z - m) * s + n3 * (a.w - m) * s);
  }
  for (int i = 4 * C4 + lane; i < C; i += 32) {
    const float dnorm = w[i] * dy[i];
    dmean += dnorm;
    dnmean += dnorm * (x[i] - m) * s;
  }
  dmean = warp_sum(dmean) / C;
  dnmean = warp_sum(dnmean) / C;
  for (int i = lane; i < C4; i += 32) {
    const float4 a = x4[i], g = dy4[i], ww = w4[i];
    float4 d = reinterpret_cast<float4*>(dx)[i];
    d.x += (ww.x * g.x - dmean - (a.x - m) * s * dnmean) * s;
    d.y += (ww.y * g.y - dmean - (a.y - m) * s * dnmean) * s;
    d.z += (ww.z * g.z - dmean - (a.z - m) * s * dnmean) * s;
    d.w += (ww.w * g.w - dmean - (a.w - m) * s * dnmean) * s;
    reinterpret_cast<float4*>(dx)[i] = d;
  }
  for (int i = 4 * C4 + lane; i < C; i += 32) {
    const float norm = (x[i] - m) * s;
    const float dnorm = w[i] * dy[i];
    dx[i] += (dnorm - dmean - norm * dnmean) * s;
  }
}

// Pass 1 of the parameter gradients: partial_dw[r, c] = sum over rows of chunk r of norm * dout,
// partial_db[r, c] = sum of dout (see reduce.cuh for the layout).
__global__ void layernorm_param_partial_kernel(float* __restrict__ partial_dw,   // (R, C)
                                               float* __restrict__ partial_db,   // (R, C)
                                               const float* __restrict__ dout,   // (N, C)
                                               const float* __restrict__ inp,    // (N, C)
                                               const float* __restrict__ mean,   // (N)
                                               const float* __restrict__ rstd,   // (N)
                                               int N, int C, int rows_per_chunk) {
  __shared__ float shw[kColRows][kColTile + 1];
  __shared__ float shb[kColRows][kColTile + 1];
  const int c = blockIdx.x * kColTile + threadIdx.x;
  const int r0 = blockIdx.y * rows_per_chunk;
  const int r1 = min(N, r0 + rows_per_chunk);
  float sw = 0.0f, sb = 0.0f;
  if (c < C)
    for (int n = r0 + threadIdx.y; n < r1; n += kColRows) {
      const float dy = dout[size_t(n) * C + c];
      sw += (inp[size_t(n) * C + c] - mean[n]) * rstd[n] * dy;
      sb += dy;
    }
  shw[threadIdx.y][threadIdx.x] = sw;
  shb[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float tw = 0.0f, tb = 0.0f;
    for (int y = 0; y < kColRows; y++) {
      tw += shw[y][threadIdx.x];
      tb += shb[y][threadIdx.x];
    }
    partial_dw[size_t(blockIdx.y) * C + c] = tw;
    partial_db[size_t(blockIdx.y) * C + c] = tb;
  }
}

// ----------------------------------------------------------------------------------------- launchers
inline void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                              int N, int C, cudaStream_t stream) {
  if (N <= 0) return;
  const int block = 256, rows_per_block = block / 32;
  const bool vec = C % 4 == 0 && aligned16(out, inp, w, b);
  LAUNCH(layernorm_forward_kernel, ceil_div(N, rows_per_block), block, 0, stream, out, mean, rstd, inp, w, b, N, C,
         vec);
  CUDA_CHECK_LAUNCH();
}

// scratch: at least 2 * column_chunks(N) * C floats.
inline void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                               const float* mean, const float* rstd, float* scratch, int N, int C,
                               cudaStream_t stream) {
  if (N <= 0) return;
  const int block = 256, rows_per_block = block / 32;
  const bool vec = C % 4 == 0 && aligned16(dinp, dout, inp, w);
  LAUNCH(layernorm_backward_input_kernel, ceil_div(N, rows_per_block), block, 0, stream, dinp, dout, inp, w, mean,
         rstd, N, C, vec);
  CUDA_CHECK_LAUNCH();
  const int R = column_chunks(N);
  float* pdw = scratch;
  float* pdb = scratch + size_t(R) * C;
  dim3 grid(ceil_div(C, kColTile), R), pblock(kColTile, kColRows);
  LAUNCH(layernorm_param_partial_kernel, grid, pblock, 0, stream, pdw, pdb, dout, inp, mean, rstd, N, C,
         column_chunk_rows(N));
  CUDA_CHECK_LAUNCH();
  LAUNCH(column_reduce_kernel, ceil_div(C, 256), 256, 0, stream, dw, pdw, R, C);
  CUDA_CHECK_LAUNCH();
  LAUNCH(column_reduce_kernel, ceil_div(C, 256), 256, 0, stream, db, pdb, R, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
