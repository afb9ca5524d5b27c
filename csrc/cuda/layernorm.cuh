// LayerNorm over the last dimension (C), eps 1e-5, as csrc/cpu/ops.h, storage type floatX (float, bf16 or fp16):
//   forward:  mean = sum x / C, var = sum (x - mean)^2 / C, rstd = 1 / sqrt(var + eps),
//             out = (x - mean) * rstd * w + b (b may be null: no bias); mean and rstd (fp32) saved per row.
//   residual_layernorm_forward (fused): residual = a + b rounded to floatX, then the forward above on the
//             ROUNDED residual: bit for bit residual_forward followed by layernorm_forward.
//   backward: norm = (x - mean) * rstd, dnorm = w * dout,
//             dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd      (accumulates, in floatX;
//             or, accumulate = false, dinp = ... without reading dinp)
//             dw += sum_rows norm * dout, db += sum_rows dout (db null: no bias)      (accumulates, fp32)
// All arithmetic in fp32 registers; floatX values are rounded once when stored.
// One warp per row for the row-wise parts; parameter gradients reduced deterministically in two passes
// (reduce.cuh), no float atomics; the backward's one kernel computes dinp and pass 1 of dw, db together.
#pragma once
#include "cuda/common.cuh"
#include "cuda/reduce.cuh"

namespace gpt2::cuda {

// ----------------------------------------------------------------------------------------- kernels
// Sum of the values of one Vec in a fixed pairwise order ((x0 + x1) + (x2 + x3)) + ...
template <class P>
__device__ inline float pairwise_sum(const float (&v)[P::kSize]) {
  float t[P::kSize];
#pragma unroll
  for (int k = 0; k < P::kSize; k++) t[k] = v[k];
#pragma unroll
  for (int w = 1; w < P::kSize; w *= 2)
#pragma unroll
    for (int k = 0; k < P::kSize; k += 2 * w) t[k] += t[k + w];
  return t[0];
}

// Floats of the row kept in registers per lane by the cached forward variant: rows of up to 32 * 32 = 1024
// channels are read from memory once (the residual inputs a and b once, not once per pass). 32, not 64: the
// 64-float variant needs 94 registers (ptxas, sm_80/sm_90), which leaves 2 blocks of 256 threads per SM, a
// quarter of its warps, too few to hide DRAM latency for a memory-bound kernel; wider rows re-read (L1/L2).
constexpr int kLnCacheFloats = 32;

// vec (C % kVec<floatX> == 0 and 16-byte aligned pointers): lanes move Vec<floatX> (16 bytes); otherwise one
// value per access. Lane l handles vectors l, l + 32, l + 64, ... in that order in every pass.
// kCache > 0 (vec only, C <= 32 * kCache * kVec): the lane's kCache vectors stay in registers after pass 1,
// so passes 2 and 3 do not re-read the row; kCache = 0 re-reads it (from cache) in each pass. Both variants
// do the same arithmetic in the same order, so they give the same bits.
// kResidual: the row x is first formed as a + b (rounded to floatX) and written to residual; the statistics
// and out are computed from the rounded values.
constexpr int kLnForwardThreads = 256;  // one warp per row, 8 rows per block
template <class floatX, bool kResidual, int kCache>
__global__ void __launch_bounds__(kLnForwardThreads) layernorm_forward_kernel(floatX* __restrict__ residual,    // (N, C) written when kResidual
                                         floatX* __restrict__ out,         // (N, C)
                                         float* __restrict__ mean,         // (N)
                                         float* __restrict__ rstd,         // (N)
                                         const floatX* __restrict__ inp,   // (N, C) (kResidual: a)
                                         const floatX* __restrict__ inp2,  // (N, C) b when kResidual, else null
                                         const floatX* __restrict__ w,     // (C)
                                         const floatX* __restrict__ b,     // (C) or null (no bias)
                                         int N, int C, bool vec) {
  using V = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;  // the whole warp leaves together
  const floatX* x = inp + size_t(row) * C;
  const floatX* x2 = kResidual ? inp2 + size_t(row) * C : nullptr;
  floatX* res = kResidual ? residual + size_t(row) * C : nullptr;
  floatX* o = out + size_t(row) * C;
  (void)x2;
  (void)res;
  const int CV = vec ? C / K : 0;  // vector part; the scalar loops below cover [K * CV, C)
  // The row as floats, rounded to floatX (the fused residual is rounded before anything reads it).
  auto load_vec = [&](int i, float (&v)[K]) {
    const V a = V::load(x + size_t(i) * K);
    if constexpr (kResidual) {
      const V bb = V::load(x2 + size_t(i) * K);
      V r;
#pragma unroll
      for (int k = 0; k < K; k++) r.set(k, a.f(k) + bb.f(k));
#pragma unroll
      for (int k = 0; k < K; k++) v[k] = r.f(k);
    } else {
#pragma unroll
      for (int k = 0; k < K; k++) v[k] = a.f(k);
    }
  };
  auto load_one = [&](int i) {
    if constexpr (kResidual) return load_f(store_t<floatX>(load_f(x[i]) + load_f(x2[i])));
    else return load_f(x[i]);
  };
  // f(j, i) for the lane's vectors i = lane + 32 j in order (j < kCache: a register slot when cached)
  auto for_each_vec = [&](auto&& f) {
    if constexpr (kCache > 0) {
#pragma unroll
      for (int j = 0; j < kCache; j++)
        if (lane + 32 * j < CV) f(j, lane + 32 * j);
    } else {
      for (int i = lane; i < CV; i += 32) f(0, i);
    }
  };
  float cache[kCache > 0 ? kCache : 1][K];
  auto fetch = [&](int j, int i, float (&v)[K]) {
    if constexpr (kCache > 0) {
#pragma unroll
      for (int k = 0; k < K; k++) v[k] = cache[j][k];
    } else {
      load_vec(i, v);
    }
  };
  // pass 1: sum (and, fused, the residual write)
  float s = 0.0f;
  for_each_vec([&](int j, int i) {
    float v[K];
    load_vec(i, v);
    if constexpr (kResidual) {
      V r;
#pragma unroll
      for (int k = 0; k < K; k++) r.set(k, v[k]);
      r.store(res + size_t(i) * K);
    }
    if constexpr (kCache > 0) {
#pragma unroll
      for (int k = 0; k < K; k++) cache[j][k] = v[k];
    }
    s += pairwise_sum<V>(v);
  });
  for (int i = K * CV + lane; i < C; i += 32) {
    const float v = load_one(i);
    if constexpr (kResidual) res[i] = store_t<floatX>(v);
    s += v;
  }
  const float m = warp_sum(s) / C;
  // pass 2: variance about the mean
  float var = 0.0f;
  for_each_vec([&](int j, int i) {
    float v[K];
    fetch(j, i, v);
#pragma unroll
    for (int k = 0; k < K; k++) v[k] = (v[k] - m) * (v[k] - m);
    var += pairwise_sum<V>(v);
  });
  for (int i = K * CV + lane; i < C; i += 32) {
    const float d = load_one(i) - m;
    var += d * d;
  }
  const float r = 1.0f / sqrtf(warp_sum(var) / C + 1e-5f);
  // pass 3: normalise, scale, shift
  for_each_vec([&](int j, int i) {
    float v[K];
    fetch(j, i, v);
    const V ww = V::load(w + size_t(i) * K);
    V y;
    if (b) {
      const V bb = V::load(b + size_t(i) * K);
#pragma unroll
      for (int k = 0; k < K; k++) y.set(k, (v[k] - m) * r * ww.f(k) + bb.f(k));
    } else {
#pragma unroll
      for (int k = 0; k < K; k++) y.set(k, (v[k] - m) * r * ww.f(k));
    }
    y.store(o + size_t(i) * K);
  });
  for (int i = K * CV + lane; i < C; i += 32)
    o[i] = store_t<floatX>((load_one(i) - m) * r * load_f(w[i]) + (b ? load_f(b[i]) : 0.0f));
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// dinp of one row, by one warp (lane = its lane): two passes over the row (the second hits L1), mean(dnorm) and
// mean(dnorm * norm) summed per lane in order, then across the warp.
template <class floatX>
__device__ void layernorm_backward_row(floatX* __restrict__ dx,         // (C), += (add) or written
                                       const floatX* __restrict__ dy,   // (C)
                                       const floatX* __restrict__ x,    // (C)
                                       const floatX* __restrict__ w,    // (C)
                                       float m, float s, int C, bool vec, bool add, int lane) {
  using V = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const int CV = vec ? C / K : 0;
  float dmean = 0.0f, dnmean = 0.0f;
  for (int i = lane; i < CV; i += 32) {
    const V a = V::load(x + size_t(i) * K), g = V::load(dy + size_t(i) * K), ww = V::load(w + size_t(i) * K);
    float dn[K], dnn[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
      dn[k] = ww.f(k) * g.f(k);
      dnn[k] = dn[k] * (a.f(k) - m) * s;
    }
    dmean += pairwise_sum<V>(dn);
    dnmean += pairwise_sum<V>(dnn);
  }
  for (int i = K * CV + lane; i < C; i += 32) {
    const float dnorm = load_f(w[i]) * load_f(dy[i]);
    dmean += dnorm;
    dnmean += dnorm * (load_f(x[i]) - m) * s;
  }
  dmean = warp_sum(dmean) / C;
  dnmean = warp_sum(dnmean) / C;
  for (int i = lane; i < CV; i += 32) {
    const V a = V::load(x + size_t(i) * K), g = V::load(dy + size_t(i) * K), ww = V::load(w + size_t(i) * K);
    V d;
    if (add) d = V::load(dx + size_t(i) * K);
#pragma unroll
    for (int k = 0; k < K; k++)
      d.set(k, (add ? d.f(k) : 0.0f) + (ww.f(k) * g.f(k) - dmean - (a.f(k) - m) * s * dnmean) * s);
    d.store(dx + size_t(i) * K);
  }
  for (int i = K * CV + lane; i < C; i += 32) {
    const float norm = (load_f(x[i]) - m) * s;
    const float dnorm = load_f(w[i]) * load_f(dy[i]);
    dx[i] = store_t<floatX>((add ? load_f(dx[i]) : 0.0f) + (dnorm - dmean - norm * dnmean) * s);
  }
}

// One block per chunk of rows (reduce.cuh's chunking: block r covers rows [r * rows_per_chunk, ...)), its warps
// taking the chunk's rows a group of (warps) rows at a time:
//   - each warp writes dinp of its row of the group (layernorm_backward_row);
//   - then each thread adds the group's rows, in order, to its columns' sums of norm * dout and of dout, kept in
//     dynamic shared memory (2 C floats: thread t owns columns t, t + blockDim.x, ..., so no thread reads another's
//     and no barrier is needed); this second read of the group's rows hits L1 / L2, so HBM sees dout and inp once;
//   - finally the sums are the chunk's partial_dw / partial_db row (pass 2: column_reduce).
// Launch shape: kLnBackwardThreads threads, at least kLnBackwardMinBlocks blocks per SM (ptxas then keeps it at 48
// registers on sm_80 / sm_90, no spills). Every column's sums add the chunk's rows in order whatever the block
// size, so the shape changes speed, never bits.
// occupancy(layernorm_backward_kernel): >= 40 warps/SM on sm_80 sm_90 with 6144 B dynamic smem (C = 768)
// (the 512-thread blocks before held 2 per SM, 32 warps, and d12's ~340 chunks took 1.3 waves of 264 slots on an
// H100; 5 x 256 gives 660 slots, one wave)
constexpr int kLnBackwardThreads = 256;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int kLnBackwardMinBlocks = 4;  // sm_75 holds 1024 threads per SM
#else
constexpr int kLnBackwardMinBlocks = 5;
#endif
template <class floatX>
__global__ void __launch_bounds__(kLnBackwardThreads, kLnBackwardMinBlocks) layernorm_backward_kernel(floatX* __restrict__ dinp,        // (N, C), += (add) or written
                                          float* __restrict__ partial_dw,   // (R, C)
                                          float* __restrict__ partial_db,   // (R, C)
                                          const floatX* __restrict__ dout,  // (N, C)
                                          const floatX* __restrict__ inp,   // (N, C)
                                          const floatX* __restrict__ w,     // (C)
                                          const float* __restrict__ mean,   // (N)
                                          const float* __restrict__ rstd,   // (N)
                                          int N, int C, int rows_per_chunk, bool vec, bool add) {
  DYNAMIC_SMEM(float, sums);  // (2, C): sums of norm * dout, then of dout
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r0 = blockIdx.x * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
  for (int c = threadIdx.x; c < C; c += blockDim.x) sums[c] = sums[C + c] = 0.0f;
  for (int g = r0; g < r1; g += warps) {
    const int row = g + warp;
    if (row < r1)
      layernorm_backward_row(dinp + size_t(row) * C, dout + size_t(row) * C, inp + size_t(row) * C, w, mean[row],
                             rstd[row], C, vec, add, lane);
    const int g1 = min(r1, g + warps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float sw = sums[c], sb = sums[C + c];
      for (int n = g; n < g1; n++) {
        const float dy = load_f(dout[size_t(n) * C + c]);
        sw += (load_f(inp[size_t(n) * C + c]) - mean[n]) * rstd[n] * dy;
        sb += dy;
      }
      sums[c] = sw, sums[C + c] = sb;
    }
  }
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    partial_dw[size_t(blockIdx.x) * C + c] = sums[c];
    partial_db[size_t(blockIdx.x) * C + c] = sums[C + c];
  }
}

// ----------------------------------------------------------------------------------------- launchers
// Shared by layernorm_forward (residual and b2 null) and residual_layernorm_forward: the register-cached
// kernel when the row fits, else the re-reading one.
template <class floatX, bool kResidual>
void launch_layernorm_forward(floatX* residual, floatX* out, float* mean, float* rstd, const floatX* a,
                              const floatX* b2, const floatX* w, const floatX* bias, int N, int C, bool vec,
                              cudaStream_t stream) {
  constexpr int K = kVec<floatX>, kCache = kLnCacheFloats / K;
  const int block = kLnForwardThreads, rows_per_block = block / 32;
  if (vec && C <= 32 * kCache * K)
    LAUNCH((layernorm_forward_kernel<floatX, kResidual, kCache>), ceil_div(N, rows_per_block), block, 0, stream,
           residual, out, mean, rstd, a, b2, w, bias, N, C, vec);
  else
    LAUNCH((layernorm_forward_kernel<floatX, kResidual, 0>), ceil_div(N, rows_per_block), block, 0, stream,
           residual, out, mean, rstd, a, b2, w, bias, N, C, vec);
  CUDA_CHECK_LAUNCH();
}

template <class floatX>
void layernorm_forward(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* w, const floatX* b,
                       int N, int C, cudaStream_t stream) {
  if (N <= 0) return;
  const bool vec = C % kVec<floatX> == 0 && aligned16(out, inp, w, b);
  launch_layernorm_forward<floatX, false>(nullptr, out, mean, rstd, inp, nullptr, w, b, N, C, vec, stream);
}

// residual = a + b (rounded to floatX); out, mean, rstd = layernorm of the rounded residual. a and b are read
// once and residual and out written once when the row fits the register cache (C <= 1024, aligned); wider or
// misaligned rows re-read a and b in each of the three passes.
template <class floatX>
void residual_layernorm_forward(floatX* residual, floatX* out, float* mean, float* rstd, const floatX* a,
                                const floatX* b, const floatX* w, const floatX* bias, int N, int C,
                                cudaStream_t stream) {
  if (N <= 0) return;
  const bool vec = C % kVec<floatX> == 0 && aligned16(residual, out, a, b, w, bias);
  launch_layernorm_forward<floatX, true>(residual, out, mean, rstd, a, b, w, bias, N, C, vec, stream);
}

// scratch: at least 2 * column_chunks(N, C) * C floats. accumulate: dinp += (else dinp is written, never read).
// One kernel reads dout and inp (layernorm_backward_kernel), then column_reduce adds the chunks' sums into dw, db.
template <class floatX>
void layernorm_backward(floatX* dinp, float* dw, float* db, const floatX* dout, const floatX* inp, const floatX* w,
                        const float* mean, const float* rstd, float* scratch, int N, int C, bool accumulate,
                        cudaStream_t stream) {
  if (N <= 0) return;
  const int block = kLnBackwardThreads;  // 8 rows in flight per block, 5 blocks per SM (see the kernel)
  const bool vec = C % kVec<floatX> == 0 && aligned16(dinp, dout, inp, w);
  const int R = column_chunks(N, C);
  float* pdw = scratch;
  float* pdb = scratch + size_t(R) * C;
  const size_t smem = 2 * size_t(C) * sizeof(float);
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_kernel<floatX>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(smem)));
  LAUNCH(layernorm_backward_kernel<floatX>, R, block, smem, stream, dinp, pdw, pdb, dout, inp, w, mean, rstd, N, C,
         column_chunk_rows(N, C), vec, accumulate);
  CUDA_CHECK_LAUNCH();
  column_reduce(dw, pdw, R, C, stream);
  if (db) column_reduce(db, pdb, R, C, stream);  // null: a layernorm without bias
}

}  // namespace gpt2::cuda
