// Causal multi-head self-attention, flash-attention style (online softmax; the T x T matrix is never
// stored). Layouts as llm.c: qkv (B, T, 3, NH, hs) = (B, T, 3C) with [q | k | v]; out (B, T, NH, hs);
// lse (B, NH, T) = logsumexp over keys t2 <= t of the scaled scores s = scale * q.k, scale = 1/sqrt(hs).
//   forward:  out_t = sum_{t2 <= t} exp(s_{t,t2} - lse_t) v_t2
//   backward: P = exp(S - lse); D_t = dout_t . out_t; dP = dout V^T; dS = P * (dP - D);
//             dq += scale dS K;  dk += scale dS^T Q;  dv += P^T dout                      (accumulates)
// Storage: qkv, out, dout, dqkv in floatX (float or __nv_bfloat16), lse and D in float. Compute is fp32
// (converted on load into registers and shared memory); each result is rounded once to floatX on store, and
// the dqkv accumulation reads floatX, adds in fp32 and rounds once.
// Work split: a group of kGroup = 4 threads owns one query (or key) row, each thread a quarter of the
// head dimension as float4 chunks. A 16-byte pack of floatX (4 floats, 8 bf16: one vector load or store
// when the head size and alignment allow, see attn::packs_fit) covers CPP = 1 or 2 chunks; pack p of a row
// belongs to thread p % 4 (att_chunk), so for fp32 chunk c belongs to thread c % 4 and a group reads 16
// consecutive floats from shared memory: no bank conflicts, broadcast across groups. Dot products finish
// with two xor-shuffles inside the group. Tiles of kTile = 32 rows; 128 threads per block.
// Backward is deterministic without atomics: one kernel per key tile computes dk, dv; a second, per
// query tile, computes dq (recomputing P), after a small kernel computes D.
// HS (template) is the head size rounded up to 64 or 128; the padding dims are zeros in shared memory and
// registers.
#pragma once
#include "cuda/attention_common.cuh"
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kAttTile = 32;                  // query rows / key rows per tile
constexpr int kAttGroup = 4;                  // threads per row
constexpr int kAttThreads = kAttTile * kAttGroup;
constexpr int kDotThreads = 256;             // attention_backward_dot

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

// Float4 chunks per 16-byte pack of floatX, and the chunk index (in the row) of thread g's e-th chunk.
template <class floatX>
constexpr int kAttCPP = attn::Pack<floatX>::N / 4;
template <class floatX>
__device__ inline int att_chunk(int e, int g) {
  constexpr int CPP = kAttCPP<floatX>;
  return ((e / CPP) * kAttGroup + g) * CPP + e % CPP;
}

// Rows of one head in a (B * T, stride) matrix of floatX: element (t, d) at p[t * stride + d], d < hs.
template <class floatX>
struct AttRows {
  const floatX* p;
  int stride;
};

// The views of block (b, h) = (blockIdx.z, blockIdx.y): q, k, v of qkv (B, T, 3C), dout (B, T, C) (when
// given), and the offset of (b, h) in the (B, NH, T) statistics lse and D.
template <class floatX>
struct AttHead {
  AttRows<floatX> q, k, v, dout;
  size_t stats;
};
template <class floatX>
__device__ inline AttHead<floatX> att_head(const floatX* qkv, const floatX* dout, int T, int NH, int hs) {
  const int b = blockIdx.z, h = blockIdx.y, C = NH * hs;
  const floatX* base = qkv + size_t(b) * T * 3 * C + size_t(h) * hs;
  AttHead<floatX> v;
  v.q = {base, 3 * C};
  v.k = {base + C, 3 * C};
  v.v = {base + 2 * C, 3 * C};
  v.dout = {dout ? dout + size_t(b) * T * C + size_t(h) * hs : nullptr, C};
  v.stats = (size_t(b) * NH + h) * T;
  return v;
}

// Loads this thread's chunks of row `row` of src, times mul; 0 outside [0, T) x [0, hs).
template <int HS, class floatX>
__device__ inline void load_row_chunks(float4* dst, AttRows<floatX> src, int row, int T, int hs, int g, float mul,
                                       bool vec) {
  constexpr int CPT = HS / 4 / kAttGroup, CPP = kAttCPP<floatX>, N = 4 * CPP;
#pragma unroll
  for (int e = 0; e < CPT; e += CPP) {
    const int d0 = att_chunk<floatX>(e, g) * 4;  // first dim of this pack
    float v[N];
    if (vec) {
      if (row < T && d0 < hs) {  // hs is a multiple of the pack: the whole pack is in range
        const attn::Pack<floatX> x = attn::load_pack(src.p + size_t(row) * src.stride + d0);
#pragma unroll
        for (int k = 0; k < N; k++) v[k] = attn::to_float(x.v[k]) * mul;
      } else {
#pragma unroll
        for (int k = 0; k < N; k++) v[k] = 0.0f;
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; k++)
        v[k] = (row < T && d0 + k < hs) ? attn::to_float(src.p[size_t(row) * src.stride + d0 + k]) * mul : 0.0f;
    }
#pragma unroll
    for (int c = 0; c < CPP; c++) dst[e + c] = make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
  }
}

// Writes (Accumulate: adds) acc * mul to this thread's chunks of dst (one row), rounding once to floatX;
// dims >= hs are skipped.
template <bool Accumulate, int HS, class floatX>
__device__ inline void store_row_chunks(floatX* dst, const float4* acc, float mul, int hs, int g, bool vec) {
  constexpr int CPT = HS / 4 / kAttGroup, CPP = kAttCPP<floatX>, N = 4 * CPP;
#pragma unroll
  for (int e = 0; e < CPT; e += CPP) {
    const int d0 = att_chunk<floatX>(e, g) * 4;
    float a[N];
#pragma unroll
    for (int c = 0; c < CPP; c++) {
      a[4 * c] = acc[e + c].x * mul;
      a[4 * c + 1] = acc[e + c].y * mul;
      a[4 * c + 2] = acc[e + c].z * mul;
      a[4 * c + 3] = acc[e + c].w * mul;
    }
    if (vec) {
      if (d0 < hs) {
        attn::Pack<floatX> x;
        if constexpr (Accumulate) x = attn::load_pack(dst + d0);
#pragma unroll
        for (int k = 0; k < N; k++) x.v[k] = attn::from_float<floatX>(Accumulate ? attn::to_float(x.v[k]) + a[k] : a[k]);
        attn::store_pack(dst + d0, x);
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; k++)
        if (d0 + k < hs) dst[d0 + k] = attn::from_float<floatX>(Accumulate ? attn::to_float(dst[d0 + k]) + a[k] : a[k]);
    }
  }
}

// Cooperative load of rows r0 .. r0 + kAttTile - 1 of src (dims 0..HS-1, zero-padded) into a float tile.
template <int HS, class floatX>
__device__ inline void load_tile(float4 (*tile)[HS / 4], AttRows<floatX> src, int r0, int T, int hs, bool vec) {
  float* t = reinterpret_cast<float*>(tile);
  if (vec) {
    constexpr int N = attn::Pack<floatX>::N, PPR = HS / N;  // packs per row
#pragma unroll 1
    for (int idx = threadIdx.x; idx < kAttTile * PPR; idx += blockDim.x) {
      const int r = idx / PPR, d0 = (idx % PPR) * N, row = r0 + r;
      float v[N];
      if (row < T && d0 < hs) {
        const attn::Pack<floatX> x = attn::load_pack(src.p + size_t(row) * src.stride + d0);
#pragma unroll
        for (int k = 0; k < N; k++) v[k] = attn::to_float(x.v[k]);
      } else {
#pragma unroll
        for (int k = 0; k < N; k++) v[k] = 0.0f;
      }
      float4* dst = reinterpret_cast<float4*>(t + r * HS + d0);
#pragma unroll
      for (int c = 0; c < N / 4; c++) dst[c] = make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
    }
  } else {
    for (int idx = threadIdx.x; idx < kAttTile * HS; idx += blockDim.x) {
      const int r = idx / HS, d = idx % HS, row = r0 + r;
      t[idx] = (row < T && d < hs) ? attn::to_float(src.p[size_t(row) * src.stride + d]) : 0.0f;
    }
  }
}

// Replaces the block's shared tiles As, Bs with rows r0 .. r0 + kAttTile - 1 of a and b between two barriers
// (every thread is done with the previous tiles before they are overwritten; the new ones are complete before
// use). extra() runs between the barriers too: the dk/dv kernel loads its per-row statistics there.
template <int HS, class floatX, class Extra>
__device__ inline void refill_tiles(float4 (*As)[HS / 4], AttRows<floatX> a, float4 (*Bs)[HS / 4], AttRows<floatX> b,
                                    int r0, int T, int hs, bool vec, Extra&& extra) {
  __syncthreads();
  load_tile<HS>(As, a, r0, T, hs, vec);
  load_tile<HS>(Bs, b, r0, T, hs, vec);
  extra();
  __syncthreads();
}
template <int HS, class floatX>
__device__ inline void refill_tiles(float4 (*As)[HS / 4], AttRows<floatX> a, float4 (*Bs)[HS / 4], AttRows<floatX> b,
                                    int r0, int T, int hs, bool vec) {
  refill_tiles<HS>(As, a, Bs, b, r0, T, hs, vec, [] {});
}

// x . tile_row over the head dims, summed over the group (x: this thread's chunks of a row).
template <int HS, class floatX>
__device__ inline float row_dot(const float4* x, const float4* tile_row, int g) {
  constexpr int CPT = HS / 4 / kAttGroup;
  float p = 0.0f;
#pragma unroll
  for (int e = 0; e < CPT; e++) p += dot4(x[e], tile_row[att_chunk<floatX>(e, g)]);
  return group_sum(p);
}

// Both backward kernels' pair of dot products in one sweep: sp = x . xs_row, dp = y . ys_row (group sums).
template <int HS, class floatX>
__device__ inline void row_dots(float& sp, float& dp, const float4* x, const float4* xs_row, const float4* y,
                                const float4* ys_row, int g) {
  constexpr int CPT = HS / 4 / kAttGroup;
  sp = 0.0f;
  dp = 0.0f;
#pragma unroll
  for (int e = 0; e < CPT; e++) {
    const int c = att_chunk<floatX>(e, g);
    sp += dot4(x[e], xs_row[c]);
    dp += dot4(y[e], ys_row[c]);
  }
  sp = group_sum(sp);
  dp = group_sum(dp);
}

// y += a * tile_row on this thread's chunks.
template <int HS, class floatX>
__device__ inline void row_axpy(float4* y, float a, const float4* tile_row, int g) {
  constexpr int CPT = HS / 4 / kAttGroup;
#pragma unroll
  for (int e = 0; e < CPT; e++) axpy4(y[e], a, tile_row[att_chunk<floatX>(e, g)]);
}

template <int N>
__device__ inline void zero_chunks(float4 (&x)[N]) {
#pragma unroll
  for (int e = 0; e < N; e++) x[e] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// ----------------------------------------------------------------------------------------- kernels
// grid (ceil(T / kAttTile), NH, B), block kAttThreads. vec: attn::packs_fit(hs, qkv, out).
template <int HS, class floatX>
__global__ void __launch_bounds__(kAttThreads)
attention_forward_kernel(floatX* __restrict__ out,        // (B, T, C)
                         float* __restrict__ lse,         // (B, NH, T)
                         const floatX* __restrict__ qkv,  // (B, T, 3C)
                         int T, int NH, int hs, float scale, bool vec) {
  constexpr int NCH = HS / 4, CPT = NCH / kAttGroup;
  __shared__ float4 Ks[kAttTile][NCH];
  __shared__ float4 Vs[kAttTile][NCH];
  const int q0 = blockIdx.x * kAttTile;
  const int r = threadIdx.x / kAttGroup, g = threadIdx.x % kAttGroup, i = q0 + r;
  const AttHead<floatX> hd = att_head<floatX>(qkv, nullptr, T, NH, hs);
  float4 q[CPT], o[CPT];
  load_row_chunks<HS>(q, hd.q, i, T, hs, g, scale, vec);
  zero_chunks(o);
  float m = -INFINITY, l = 0.0f;
  const int last = min(T - 1, q0 + kAttTile - 1);
  for (int k0 = 0; k0 <= last; k0 += kAttTile) {
    refill_tiles<HS>(Ks, hd.k, Vs, hd.v, k0, T, hs, vec);
    float s[kAttTile];
    float tmax = -INFINITY;
#pragma unroll
    for (int j = 0; j < kAttTile; j++) {
      const float p = row_dot<HS, floatX>(q, Ks[j], g);
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
      row_axpy<HS, floatX>(o, p, Vs[j], g);
    }
    m = mnew;
  }
  if (i >= T) return;
  const int C = NH * hs;
  store_row_chunks<false, HS>(out + (size_t(blockIdx.z) * T + i) * C + size_t(blockIdx.y) * hs, o, 1.0f / l, hs, g,
                              vec);
  if (g == 0) lse[hd.stats + i] = m + logf(l);
}

// D[b, h, t] = dout[b, t, h, :] . out[b, t, h, :]. kDotLanes consecutive lanes per (b, t, h) row, lane g over the
// row's 16-byte packs (vec: attn::packs_fit(hs, dout, out)) or values g, g + kDotLanes, ..., the lanes' sums
// combined by shuffles in a fixed order: each warp load reads 4 whole rows of hs = 64 bf16 (512 contiguous
// bytes), where one thread per row touched 32 rows' cache lines per load.
constexpr int kDotLanes = 8;
template <class floatX>
__global__ void __launch_bounds__(kDotThreads) attention_backward_dot_kernel(float* __restrict__ Dout,         // (B, NH, T)
                                              const floatX* __restrict__ dout,  // (B, T, C)
                                              const floatX* __restrict__ out,   // (B, T, C)
                                              int B, int T, int NH, int hs, bool vec) {
  const size_t idx = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) / kDotLanes;  // over (b, t, h)
  const int g = threadIdx.x % kDotLanes;
  const bool live = idx < size_t(B) * T * NH;
  float s = 0.0f;
  if (live) {
    const floatX* a = dout + idx * hs;
    const floatX* b = out + idx * hs;
    if (vec) {
      constexpr int N = attn::Pack<floatX>::N;
      for (int d = g * N; d < hs; d += kDotLanes * N) {
        const attn::Pack<floatX> x = attn::load_pack(a + d), y = attn::load_pack(b + d);
#pragma unroll
        for (int k = 0; k < N; k++) s += attn::to_float(x.v[k]) * attn::to_float(y.v[k]);
      }
    } else {
      for (int d = g; d < hs; d += kDotLanes) s += attn::to_float(a[d]) * attn::to_float(b[d]);
    }
  }
#pragma unroll
  for (int o = kDotLanes / 2; o > 0; o >>= 1) s += __shfl_xor_sync(kFullMask, s, o);  // every lane takes part
  if (live && g == 0) {
    const int h = int(idx % NH);
    const size_t bt = idx / NH;
    Dout[(bt / T * NH + h) * T + bt % T] = s;
  }
}

// dk, dv for one tile of keys: grid (ceil(T / kAttTile), NH, B), block kAttThreads.
// vec: attn::packs_fit(hs, dqkv, dout, qkv).
template <int HS, class floatX>
__global__ void __launch_bounds__(kAttThreads)
attention_backward_dkdv_kernel(floatX* __restrict__ dqkv,       // (B, T, 3C), accumulated into
                               const floatX* __restrict__ dout, // (B, T, C)
                               const floatX* __restrict__ qkv,  // (B, T, 3C)
                               const float* __restrict__ lse,   // (B, NH, T)
                               const float* __restrict__ Dd,    // (B, NH, T)
                               int T, int NH, int hs, float scale, bool vec) {
  constexpr int NCH = HS / 4, CPT = NCH / kAttGroup;
  __shared__ float4 Qs[kAttTile][NCH];
  __shared__ float4 dOs[kAttTile][NCH];
  __shared__ float Ls[kAttTile], Ds[kAttTile];
  const int k0 = blockIdx.x * kAttTile;
  const int r = threadIdx.x / kAttGroup, g = threadIdx.x % kAttGroup, j = k0 + r;
  const AttHead<floatX> hd = att_head(qkv, dout, T, NH, hs);
  float4 k[CPT], v[CPT], dk[CPT], dv[CPT];
  load_row_chunks<HS>(k, hd.k, j, T, hs, g, 1.0f, vec);
  load_row_chunks<HS>(v, hd.v, j, T, hs, g, 1.0f, vec);
  zero_chunks(dk);
  zero_chunks(dv);
  for (int q0 = k0; q0 < T; q0 += kAttTile) {  // queries before k0 do not see these keys
    refill_tiles<HS>(Qs, hd.q, dOs, hd.dout, q0, T, hs, vec, [&] {
      for (int ii = threadIdx.x; ii < kAttTile; ii += blockDim.x) {
        const bool ok = q0 + ii < T;
        Ls[ii] = ok ? lse[hd.stats + q0 + ii] : 0.0f;
        Ds[ii] = ok ? Dd[hd.stats + q0 + ii] : 0.0f;
      }
    });
    // unrolled less for HS = 128: k, v, dk, dv alone hold 128 registers, and 4 rows at a time spill
#pragma unroll(HS > 64 ? 2 : 4)
    for (int ii = 0; ii < kAttTile; ii++) {
      float sp, dp;
      row_dots<HS, floatX>(sp, dp, k, Qs[ii], v, dOs[ii], g);
      const int qi = q0 + ii;
      const float p = (qi < T && qi >= j) ? expf(sp * scale - Ls[ii]) : 0.0f;
      const float ds = p * (dp - Ds[ii]);
      row_axpy<HS, floatX>(dv, p, dOs[ii], g);
      row_axpy<HS, floatX>(dk, ds, Qs[ii], g);
    }
  }
  if (j >= T) return;
  const int C = NH * hs;
  floatX* dkrow = dqkv + (size_t(blockIdx.z) * T + j) * 3 * C + C + size_t(blockIdx.y) * hs;
  store_row_chunks<true, HS>(dkrow, dk, scale, hs, g, vec);
  store_row_chunks<true, HS>(dkrow + C, dv, 1.0f, hs, g, vec);
}

// dq for one tile of queries: grid (ceil(T / kAttTile), NH, B), block kAttThreads.
// vec: attn::packs_fit(hs, dqkv, dout, qkv).
template <int HS, class floatX>
__global__ void __launch_bounds__(kAttThreads)
attention_backward_dq_kernel(floatX* __restrict__ dqkv,       // (B, T, 3C), accumulated into
                             const floatX* __restrict__ dout, // (B, T, C)
                             const floatX* __restrict__ qkv,  // (B, T, 3C)
                             const float* __restrict__ lse,   // (B, NH, T)
                             const float* __restrict__ Dd,    // (B, NH, T)
                             int T, int NH, int hs, float scale, bool vec) {
  constexpr int NCH = HS / 4, CPT = NCH / kAttGroup;
  __shared__ float4 Ks[kAttTile][NCH];
  __shared__ float4 Vs[kAttTile][NCH];
  const int q0 = blockIdx.x * kAttTile;
  const int r = threadIdx.x / kAttGroup, g = threadIdx.x % kAttGroup, i = q0 + r;
  const AttHead<floatX> hd = att_head(qkv, dout, T, NH, hs);
  float4 q[CPT], dO[CPT], dq[CPT];
  load_row_chunks<HS>(q, hd.q, i, T, hs, g, 1.0f, vec);
  load_row_chunks<HS>(dO, hd.dout, i, T, hs, g, 1.0f, vec);
  zero_chunks(dq);
  const float L = i < T ? lse[hd.stats + i] : 0.0f;
  const float Di = i < T ? Dd[hd.stats + i] : 0.0f;
  const int last = min(T - 1, q0 + kAttTile - 1);
  for (int k0 = 0; k0 <= last; k0 += kAttTile) {
    refill_tiles<HS>(Ks, hd.k, Vs, hd.v, k0, T, hs, vec);
#pragma unroll 4
    for (int jj = 0; jj < kAttTile; jj++) {
      float sp, dp;
      row_dots<HS, floatX>(sp, dp, q, Ks[jj], dO, Vs[jj], g);
      const int key = k0 + jj;
      const float p = (i < T && key <= i) ? expf(sp * scale - L) : 0.0f;
      const float ds = p * (dp - Di);
      row_axpy<HS, floatX>(dq, ds, Ks[jj], g);
    }
  }
  if (i >= T) return;
  const int C = NH * hs;
  store_row_chunks<true, HS>(dqkv + (size_t(blockIdx.z) * T + i) * 3 * C + size_t(blockIdx.y) * hs, dq, scale, hs, g,
                             vec);
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

template <class floatX>
inline void attention_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int C, int NH,
                              cudaStream_t stream) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  const bool vec = attn::packs_fit<floatX>(hs, out, qkv);
  dim3 grid(ceil_div(T, kAttTile), NH, B);
  dispatch_head_size(hs, [&](auto HSc) {
    constexpr int HS = decltype(HSc)::value;
    LAUNCH((attention_forward_kernel<HS, floatX>), grid, kAttThreads, 0, stream, out, lse, qkv, T, NH, hs, scale, vec);
  });
  CUDA_CHECK_LAUNCH();
}

// D (B, NH, T) = rowsum(dout * out) per head, the backward's softmax correction (both flash backwards).
template <class floatX>
inline void attention_backward_dot(float* D, const floatX* dout, const floatX* out, int B, int T, int C, int NH,
                                   cudaStream_t stream) {
  const int hs = C / NH;
  const size_t rows = size_t(B) * T * NH;
  LAUNCH(attention_backward_dot_kernel<floatX>, ceil_div(rows * kDotLanes, kDotThreads), kDotThreads, 0, stream, D, dout, out, B, T,
         NH, hs, attn::packs_fit<floatX>(hs, dout, out));
  CUDA_CHECK_LAUNCH();
}

// out, lse: what attention_forward produced for this qkv. Dscratch: B * NH * T floats.
template <class floatX>
inline void attention_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out, const float* lse,
                               float* Dscratch, int B, int T, int C, int NH, cudaStream_t stream) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  attention_backward_dot(Dscratch, dout, out, B, T, C, NH, stream);
  const bool vec = attn::packs_fit<floatX>(hs, dqkv, dout, qkv);
  dim3 grid(ceil_div(T, kAttTile), NH, B);
  dispatch_head_size(hs, [&](auto HSc) {
    constexpr int HS = decltype(HSc)::value;
    LAUNCH((attention_backward_dkdv_kernel<HS, floatX>), grid, kAttThreads, 0, stream, dqkv, dout, qkv, lse, Dscratch,
           T, NH, hs, scale, vec);
    CUDA_CHECK_LAUNCH();
    LAUNCH((attention_backward_dq_kernel<HS, floatX>), grid, kAttThreads, 0, stream, dqkv, dout, qkv, lse, Dscratch, T,
           NH, hs, scale, vec);
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
