// Causal multi-head self-attention, flash-attention style (online softmax; the T x T matrix is never
// stored). Layouts as llm.c: qkv (B, T, 3, NH, hs) = (B, T, 3C) with [q | k | v]; out (B, T, NH, hs);
// lse (B, NH, T) = logsumexp over keys t2 <= t of the scaled scores s = scale * q.k, scale = 1/sqrt(hs).
//   forward:  out_t = sum_{t2 <= t} exp(s_{t,t2} - lse_t) v_t2
//   backward: P = exp(S - lse); D_t = dout_t . out_t; dP = dout V^T; dS = P * (dP - D);
//             dq += scale dS K;  dk += scale dS^T Q;  dv += P^T dout                      (accumulates)
// Work split: a group of kGroup = 4 threads owns one query (or key) row, each thread a quarter of the
// head dimension as float4 chunks (chunk c belongs to thread c % 4, so a group reads 16 consecutive
// floats from shared memory: no bank conflicts, broadcast across groups). Dot products finish with two
// xor-shuffles inside the group. Tiles of kTile = 32 rows; 128 threads per block.
// Backward is deterministic without atomics: one kernel per key tile computes dk, dv; a second, per
// query tile, computes dq (recomputing P), after a small kernel computes D.
// HS (template) is the head size rounded up to 64 or 128; the padding dims are zeros in shared memory and
// registers.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kAttTile = 32;                  // query rows / key rows per tile
constexpr int kAttGroup = 4;                  // threads per row
constexpr int kAttThreads = kAttTile * kAttGroup;

__device__ inline float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
__device__ inline void axpy4(float4& y, float a, float4 x) {
  y.x += a * x.x;
  y.y += a * x.y;
  y.z += a * x.z;
  y.w += a * x.w;
}
__device__ inline float group_sum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 1);
  v += __shfl_xor_sync(kFullMask, v, 2);
  return v;
}

// Loads this thread's chunks of row `row` (of T) of a (B*T, C3)-strided matrix, 0 outside [0,T) x [0,hs).
template <int HS>
__device__ inline void load_row_chunks(float4* dst, const float* base, int row, int T, int C3, int hs, int g,
                                       float mul) {
  constexpr int CPT = HS / 4 / kAttGroup;
#pragma unroll
  for (int e = 0; e < CPT; e++) {
    const int d0 = (e * kAttGroup + g) * 4;
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; k++) v[k] = (row < T && d0 + k < hs) ? base[size_t(row) * C3 + d0 + k] * mul : 0.0f;
    dst[e] = make_float4(v[0], v[1], v[2], v[3]);
  }
}

// Cooperative load of rows r0 .. r0 + kAttTile - 1 (dims 0..HS-1, zero-padded) into a float tile.
template <int HS>
__device__ inline void load_tile(float* tile, const float* base, int r0, int T, int C3, int hs) {
  for (int idx = threadIdx.x; idx < kAttTile * HS; idx += blockDim.x) {
    const int r = idx / HS, d = idx % HS, row = r0 + r;
    tile[idx] = (row < T && d < hs) ? base[size_t(row) * C3 + d] : 0.0f;
  }
}

// ----------------------------------------------------------------------------------------- kernels
// grid (ceil(T / kAttTile), NH, B), block kAttThreads.
template <int HS>
__global__ void __launch_bounds__(kAttThreads)
attention_forward_kernel(float* __restrict__ out,        // (B, T, C)
                         float* __restrict__ lse,        // (B, NH, T)
                         const float* __restrict__ qkv,  // (B, T, 3C)
                         int T, int NH, int hs, float scale) {
  constexpr int NCH = HS / 4, CPT = NCH / kAttGroup;
  __shared__ float4 Ks[kAttTile][NCH];
  __shared__ float4 Vs[kAttTile][NCH];
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * kAttTile;
  const int r = threadIdx.x / kAttGroup, g = threadIdx.x % kAttGroup, i = q0 + r;
  const int C = NH * hs, C3 = 3 * C;
  const float* base = qkv + size_t(b) * T * C3 + size_t(h) * hs;
  float4 q[CPT], o[CPT];
  load_row_chunks<HS>(q, base, i, T, C3, hs, g, scale);
#pragma unroll
  for (int e = 0; e < CPT; e++) o[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  float m = -INFINITY, l = 0.0f;
  const int last = min(T - 1, q0 + kAttTile - 1);
  for (int k0 = 0; k0 <= last; k0 += kAttTile) {
    __syncthreads();  // previous tile fully consumed
    load_tile<HS>(reinterpret_cast<float*>(Ks), base + C, k0, T, C3, hs);
    load_tile<HS>(reinterpret_cast<float*>(Vs), base + 2 * C, k0, T, C3, hs);
    __syncthreads();
    float s[kAttTile];
    float tmax = -INFINITY;
#pragma unroll
    for (int j = 0; j < kAttTile; j++) {
      float p = 0.0f;
#pragma unroll
      for (int e = 0; e < CPT; e++) p += dot4(q[e], Ks[j][e * kAttGroup + g]);
      p = group_sum(p);
      const int key = k0 + j;
      s[j] = (key <= i && key < T) ? p : -INFINITY;
      tmax = fmaxf(tmax, s[j]);
    }
    const float mnew = fmaxf(m, tmax);
    const float mref = mnew == -INFINITY ? 0.0f : mnew;  // no valid key yet (rows past T): everything stays 0
    const float corr = expf(m - mref);
    l *= corr;
#pragma unroll
    for (int e = 0; e < CPT; e++) {
      o[e].x *= corr; o[e].y *= corr; o[e].z *= corr; o[e].w *= corr;
    }
#pragma unroll
    for (int j = 0; j < kAttTile; j++) {
      const float p = expf(s[j] - mref);
      l += p;
#pragma unroll
      for (int e = 0; e < CPT; e++) axpy4(o[e], p, Vs[j][e * kAttGroup + g]);
    }
    m = mnew;
  }
  if (i >= T) return;
  const float inv = 1.0f / l;
  float* orow = out + (size_t(b) * T + i) * C + size_t(h) * hs;
#pragma unroll
  for (int e = 0; e < CPT; e++) {
    const int d0 = (e * kAttGroup + g) * 4;
    const float v[4] = {o[e].x, o[e].y, o[e].z, o[e].w};
#pragma unroll
    for (int k = 0; k < 4; k++)
      if (d0 + k < hs) orow[d0 + k] = v[k] * inv;
  }
  if (g == 0) lse[(size_t(b) * NH + h) * T + i] = m + logf(l);
}

// D[b, h, t] = dout[b, t, h, :] . out[b, t, h, :]; one thread per (b, t, h).
__global__ void attention_backward_dot_kernel(float* __restrict__ Dout,        // (B, NH, T)
                                              const float* __restrict__ dout,  // (B, T, C)
                                              const float* __restrict__ out,   // (B, T, C)
                                              int B, int T, int NH, int hs) {
  const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;  // over (b, t, h)
  if (idx >= size_t(B) * T * NH) return;
  const int h = int(idx % NH);
  const size_t bt = idx / NH;
  const int t = int(bt % T), b = int(bt / T);
  const float* dy = dout + idx * hs;
  const float* y = out + idx * hs;
  float s = 0.0f;
  for (int d = 0; d < hs; d++) s += dy[d] * y[d];
  Dout[(size_t(b) * NH + h) * T + t] = s;
}

// dk, dv for one tile of keys: grid (ceil(T / kAttTile), NH, B), block kAttThreads.
template <int HS>
__global__ void __launch_bounds__(kAttThreads)
attention_backward_dkdv_kernel(float* __restrict__ dqkv,       // (B, T, 3C), accumulated into
                               const float* __restrict__ dout, // (B, T, C)
                               const float* __restrict__ qkv,  // (B, T, 3C)
                               const float* __restrict__ lse,  // (B, NH, T)
                               const float* __restrict__ Dd,   // (B, NH, T)
                               int T, int NH, int hs, float scale) {
  constexpr int NCH = HS / 4, CPT = NCH / kAttGroup;
  __shared__ float4 Qs[kAttTile][NCH];
  __shared__ float4 dOs[kAttTile][NCH];
  __shared__ float Ls[kAttTile], Ds[kAttTile];
  const int b = blockIdx.z, h = blockIdx.y, k0 = blockIdx.x * kAttTile;
  const int r = threadIdx.x / kAttGroup, g = threadIdx.x % kAttGroup, j = k0 + r;
  const int C = NH * hs, C3 = 3 * C;
  const float* base = qkv + size_t(b) * T * C3 + size_t(h) * hs;
  const float* dbase = dout + size_t(b) * T * C + size_t(h) * hs;
  const size_t sbase = (size_t(b) * NH + h) * T;
  float4 k[CPT], v[CPT], dk[CPT], dv[CPT];
  load_row_chunks<HS>(k, base + C, j, T, C3, hs, g, 1.0f);
  load_row_chunks<HS>(v, base + 2 * C, j, T, C3, hs, g, 1.0f);
#pragma unroll
  for (int e = 0; e < CPT; e++) dk[e] = dv[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int q0 = k0; q0 < T; q0 += kAttTile) {  // queries before k0 do not see these keys
    __syncthreads();
    load_tile<HS>(reinterpret_cast<float*>(Qs), base, q0, T, C3, hs);
    load_tile<HS>(reinterpret_cast<float*>(dOs), dbase, q0, T, C, hs);
    for (int ii = threadIdx.x; ii < kAttTile; ii += blockDim.x) {
      const bool ok = q0 + ii < T;
      Ls[ii] = ok ? lse[sbase + q0 + ii] : 0.0f;
      Ds[ii] = ok ? Dd[sbase + q0 + ii] : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int ii = 0; ii < kAttTile; ii++) {
      float sp = 0.0f, dp = 0.0f;
#pragma unroll
      for (int e = 0; e < CPT; e++) {
        sp += dot4(Qs[ii][e * kAttGroup + g], k[e]);
        dp += dot4(dOs[ii][e * kAttGroup + g], v[e]);
      }
      sp = group_sum(sp);
      dp = group_sum(dp);
      const int qi = q0 + ii;
      const float p = (qi < T && qi >= j) ? expf(sp * scale - Ls[ii]) : 0.0f;
      const float ds = p * (dp - Ds[ii]);
#pragma unroll
      for (int e = 0; e < CPT; e++) {
        axpy4(dv[e], p, dOs[ii][e * kAttGroup + g]);
        axpy4(dk[e], ds, Qs[ii][e * kAttGroup + g]);
      }
    }
  }
  if (j >= T) return;
  float* dkrow = dqkv + (size_t(b) * T + j) * C3 + C + size_t(h) * hs;
  float* dvrow = dkrow + C;
#pragma unroll
  for (int e = 0; e < CPT; e++) {
    const int d0 = (e * kAttGroup + g) * 4;
    const float a[4] = {dk[e].x, dk[e].y, dk[e].z, dk[e].w};
    const float c[4] = {dv[e].x, dv[e].y, dv[e].z, dv[e].w};
#pragma unroll
    for (int x = 0; x < 4; x++)
      if (d0 + x < hs) {
        dkrow[d0 + x] += a[x] * scale;
        dvrow[d0 + x] += c[x];
      }
  }
}

// dq for one tile of queries: grid (ceil(T / kAttTile), NH, B), block kAttThreads.
template <int HS>
__global__ void __launch_bounds__(kAttThreads)
attention_backward_dq_kernel(float* __restrict__ dqkv,       // (B, T, 3C), accumulated into
                             const float* __restrict__ dout, // (B, T, C)
                             const float* __restrict__ qkv,  // (B, T, 3C)
                             const float* __restrict__ lse,  // (B, NH, T)
                             const float* __restrict__ Dd,   // (B, NH, T)
                             int T, int NH, int hs, float scale) {
  constexpr int NCH = HS / 4, CPT = NCH / kAttGroup;
  __shared__ float4 Ks[kAttTile][NCH];
  __shared__ float4 Vs[kAttTile][NCH];
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * kAttTile;
  const int r = threadIdx.x / kAttGroup, g = threadIdx.x % kAttGroup, i = q0 + r;
  const int C = NH * hs, C3 = 3 * C;
  const float* base = qkv + size_t(b) * T * C3 + size_t(h) * hs;
  const float* dbase = dout + size_t(b) * T * C + size_t(h) * hs;
  const size_t sbase = (size_t(b) * NH + h) * T;
  float4 q[CPT], dO[CPT], dq[CPT];
  load_row_chunks<HS>(q, base, i, T, C3, hs, g, 1.0f);
  load_row_chunks<HS>(dO, dbase, i, T, C, hs, g, 1.0f);
#pragma unroll
  for (int e = 0; e < CPT; e++) dq[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  const float L = i < T ? lse[sbase + i] : 0.0f;
  const float Di = i < T ? Dd[sbase + i] : 0.0f;
  const int last = min(T - 1, q0 + kAttTile - 1);
  for (int k0 = 0; k0 <= last; k0 += kAttTile) {
    __syncthreads();
    load_tile<HS>(reinterpret_cast<float*>(Ks), base + C, k0, T, C3, hs);
    load_tile<HS>(reinterpret_cast<float*>(Vs), base + 2 * C, k0, T, C3, hs);
    __syncthreads();
#pragma unroll 4
    for (int jj = 0; jj < kAttTile; jj++) {
      float sp = 0.0f, dp = 0.0f;
#pragma unroll
      for (int e = 0; e < CPT; e++) {
        sp += dot4(q[e], Ks[jj][e * kAttGroup + g]);
        dp += dot4(dO[e], Vs[jj][e * kAttGroup + g]);
      }
      sp = group_sum(sp);
      dp = group_sum(dp);
      const int key = k0 + jj;
      const float p = (i < T && key <= i) ? expf(sp * scale - L) : 0.0f;
      const float ds = p * (dp - Di);
#pragma unroll
      for (int e = 0; e < CPT; e++) axpy4(dq[e], ds, Ks[jj][e * kAttGroup + g]);
    }
  }
  if (i >= T) return;
  float* dqrow = dqkv + (size_t(b) * T + i) * C3 + size_t(h) * hs;
#pragma unroll
  for (int e = 0; e < CPT; e++) {
    const int d0 = (e * kAttGroup + g) * 4;
    const float a[4] = {dq[e].x, dq[e].y, dq[e].z, dq[e].w};
#pragma unroll
    for (int x = 0; x < 4; x++)
      if (d0 + x < hs) dqrow[d0 + x] += a[x] * scale;
  }
}

// ----------------------------------------------------------------------------------------- launchers
// Calls f(std::integral_constant<int, HS>) with HS = hs rounded up to 64 or 128 (GPT-2's heads are 64 wide;
// smaller heads run zero-padded in the 64 kernels).
template <class F>
inline void dispatch_head_size(int hs, F&& f) {
  if (hs <= 64) f(std::integral_constant<int, 64>());
  else if (hs <= 128) f(std::integral_constant<int, 128>());
  else throw std::invalid_argument("CUDA attention: head size " + std::to_string(hs) + " > 128 is not supported");
}

inline void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                              cudaStream_t stream) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  dim3 grid(ceil_div(T, kAttTile), NH, B);
  dispatch_head_size(hs, [&](auto HSc) {
    constexpr int HS = decltype(HSc)::value;
    LAUNCH((attention_forward_kernel<HS>), grid, kAttThreads, 0, stream, out, lse, qkv, T, NH, hs, scale);
  });
  CUDA_CHECK_LAUNCH();
}

// out, lse: what attention_forward produced for this qkv. Dscratch: B * NH * T floats.
inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                               float* Dscratch, int B, int T, int C, int NH, cudaStream_t stream) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  const size_t rows = size_t(B) * T * NH;
  LAUNCH(attention_backward_dot_kernel, ceil_div(rows, 256), 256, 0, stream, Dscratch, dout, out, B, T, NH, hs);
  CUDA_CHECK_LAUNCH();
  dim3 grid(ceil_div(T, kAttTile), NH, B);
  dispatch_head_size(hs, [&](auto HSc) {
    constexpr int HS = decltype(HSc)::value;
    LAUNCH((attention_backward_dkdv_kernel<HS>), grid, kAttThreads, 0, stream, dqkv, dout, qkv, lse, Dscratch, T, NH,
           hs, scale);
    CUDA_CHECK_LAUNCH();
    LAUNCH((attention_backward_dq_kernel<HS>), grid, kAttThreads, 0, stream, dqkv, dout, qkv, lse, Dscratch, T, NH,
           hs, scale);
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
