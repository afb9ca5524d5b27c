// KV-cache inference kernels (model/backend.h: encoder_forward_at, attention_kv_forward, gather_rows, sample_tokens),
// storage type floatX (float, bf16 or fp16; arithmetic in fp32, one rounding per stored value):
//   encoder_forward_at: out[b,t,:] = wte[inp[b,t],:] + wpe[pos[b]+t,:]   (each sequence at its own position)
//   kv_write:           the K and V of qkv's rows into slot slot[b] of the caches at positions pos[b]+t
//   attention_kv:       one block per (head, query t, sequence b): the query against its slot's positions
//                       0 .. pos[b]+t (decode: Tq = 1, one query per sequence, each with its own length). The work is a
//                       GEMV over the cache (2 * n * hs values read per head for 4 * n * hs flops): memory-bound.
//                       Scores in dynamic shared memory (maxT floats), softmax in two passes as the CPU's.
//   attention_kv_split + attention_kv_combine (split-key decode, "flash-decoding"): when the one-block grid
//                       (NH * Tq * B blocks) leaves SMs idle and the cache is long (decode_splits), each (head,
//                       query, sequence) is split over `splits` blocks, block s taking its share of the positions
//                       (ceil(n / splits) each, n = pos[b] + t + 1 read on the device, so the same launch serves every
//                       step and length: a CUDA graph replays it). Each writes a partial (its max m_s, its sum
//                       l_s of exp(score - m_s), its unnormalised sum of exp(score - m_s) * v) to a float workspace;
//                       the combine merges them (log-sum-exp: M = max m_s, out = sum e^(m_s - M) o_s / sum e^(m_s
//                       - M) l_s). A block whose share is empty writes m = -inf, l = 0. Each warp keeps
//                       kSplitKeysPerWarp key rows in flight (their loads issued before the shuffle sums).
//   gather_rows:        out[i,:] = inp[rows[i],:]
//   sample:             one block per row of logits: the token model/sampling.h defines, drawn on the device; only
//                       the ids (and a flag per row) go back to the host.
// Sampling on the device, model/sampling.h's rule with the same uniform number u (computed on the host by
// sample_uniform from seed, stream and step): the tokens are ordered by a 64-bit key (the logit's bits made
// monotone, then the complement of the id, so ties go to the lower id as on the CPU); greedy takes the largest key;
// with nothing cut (top_k 0 and top_p 1) the inverse CDF runs in id order over per-thread chunks; otherwise the top
// m keys (m = top_k, at most kSampleCap) are found by an 8-pass radix select (integer histograms: deterministic),
// sorted in shared memory (bitonic) and walked in that order as the CPU walks its sorted vector. The nucleus of
// top_p with top_k 0 (or top_k > kSampleCap) must lie inside the kSampleCap most likely tokens; when it does not
// (a nearly flat distribution), or top_k > kSampleCap with top_p off, the row is flagged and the backend samples it
// on the host from its logits (sample_row), so every setting gets model/sampling.h's rule.
// The probabilities are double as on the CPU; the sums run in another order (parallel partial sums), so an id can
// differ from the CPU's only when u * total falls within a few ulps of a cumulative boundary (probability ~1e-15).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kInferRowBlock = 256;  // encoder_forward_at, kv_write, gather_rows: one row per block
constexpr int kDecodeBlock = 128;    // attention_kv: 4 warps per (head, query)
constexpr int kDecodeWarps = kDecodeBlock / 32;
constexpr int kDecodeMaxHs = 128;  // head sizes up to this (4 values per lane)
// Split-key decode (decode_splits): one block per (head, query, sequence) when that grid already has
// kSplitBlocksPerSm blocks per SM (half the warp slots of an SM at 4-warp blocks: enough loads in flight to hide the
// DRAM latency) or the cache holds fewer than kSplitMinKeys = 2 * kSplitMinChunk positions (no two shares of
// kSplitMinChunk: below, a split's shares are so short that the combine kernel's launch and round trips are most of
// what it saves); otherwise about kSplitBlocksPerSm blocks per SM, each with at least kSplitMinChunk positions of a
// full cache, at most kDecodeMaxSplits per (head, query, sequence). scripts/gpu_model.py --decode models both paths.
constexpr int kSplitMinKeys = 128;
constexpr int kSplitMinChunk = 64;
constexpr int kSplitBlocksPerSm = 8;
constexpr int kDecodeMaxSplits = 64;
constexpr int kSplitKeysPerWarp = 4;  // key rows in flight per warp in attention_kv_split_kernel
constexpr int kSampleBlock = 512;   // sample: one block per row of logits
constexpr int kSampleCap = 1024;    // candidates sorted in shared memory (two per thread)

// The settings of one row for the sampling kernel (device memory).
struct SampleArgs {
  double u;           // sample_uniform(seed, stream, step)
  float temperature;  // 0: greedy
  int32_t top_k;      // 0: all
  float top_p;        // >= 1: off
  int32_t pad;
};

// ----------------------------------------------------------------------------------------- kernels
template <class floatX>
__global__ void __launch_bounds__(kInferRowBlock) encoder_forward_at_kernel(floatX* __restrict__ out,  // (B, Tn, C)
                                                   const int32_t* __restrict__ inp,   // (B, Tn)
                                                   const floatX* __restrict__ wte,    // (Vp, C)
                                                   const floatX* __restrict__ wpe,    // (maxT, C) or null
                                                   const int32_t* __restrict__ pos,   // (B)
                                                   int Tn, int C) {
  const int row = blockIdx.x, b = row / Tn, t = row % Tn;
  const floatX* we = wte + size_t(inp[row]) * C;
  floatX* o = out + size_t(row) * C;
  if (wpe) {
    const floatX* pe = wpe + size_t(pos[b] + t) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = store_t<floatX>(load_f(we[c]) + load_f(pe[c]));
  } else {
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = we[c];
  }
}

template <class floatX>
__global__ void __launch_bounds__(kInferRowBlock) kv_write_kernel(floatX* __restrict__ kcache,  // (S, maxT, C)
                                         floatX* __restrict__ vcache,        // (S, maxT, C)
                                         const floatX* __restrict__ qkv,     // (B, Tq, 3C)
                                         const int32_t* __restrict__ slot,   // (B)
                                         const int32_t* __restrict__ pos,    // (B)
                                         int Tq, int C, int maxT) {
  const int row = blockIdx.x, b = row / Tq, t = row % Tq;
  const size_t dst = (size_t(slot[b]) * maxT + pos[b] + t) * C;
  const floatX* src = qkv + size_t(row) * 3 * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    kcache[dst + c] = src[C + c];
    vcache[dst + c] = src[2 * C + c];
  }
}

// The softmax numerators of one block's scores score[0 .. n), each warp's running max of the scores it wrote in
// mx: returns the block's max M, leaves score[k] = e^(score[k] - M) and each warp's sum of them in wsum[warp] (all
// threads past a __syncthreads: the caller may read every warp's sum).
__device__ inline float block_softmax_numerators(float* score, int n, float mx, float* wmax, float* wsum) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) wmax[warp] = mx;
  __syncthreads();
  mx = wmax[0];
  for (int w = 1; w < kDecodeWarps; w++) mx = fmaxf(mx, wmax[w]);
  float sum = 0.0f;
  for (int key = threadIdx.x; key < n; key += blockDim.x) {
    const float p = expf(score[key] - mx);
    score[key] = p;
    sum += p;
  }
  sum = warp_sum(sum);
  if (lane == 0) wsum[warp] = sum;
  __syncthreads();
  return mx;
}

// acc (lane's dims lane, lane + 32, ...) += p * v, v a cache row of the head's hs values.
template <class floatX>
__device__ inline void add_pv(float (&acc)[kDecodeMaxHs / 32], const floatX* vp, float p, int lane, int hs) {
#pragma unroll
  for (int k = 0; k < kDecodeMaxHs / 32; k++)
    if (lane + 32 * k < hs) acc[k] += p * load_f(vp[lane + 32 * k]);
}

// A warp's accumulated output into its row of shared memory, then the block waits for every warp's.
__device__ inline void store_warp_part(float* part, const float (&acc)[kDecodeMaxHs / 32], int lane, int hs) {
#pragma unroll
  for (int k = 0; k < kDecodeMaxHs / 32; k++)
    if (lane + 32 * k < hs) part[lane + 32 * k] = acc[k];
  __syncthreads();
}

// grid (NH, Tq, B). Warp w scores keys w, w + 4, ... (lanes over the head's dims, a warp-shuffle sum), the block
// takes the max and the sum of exp, then warp w accumulates p * v over the same keys and the warps' partial outputs
// are summed.
template <class floatX>
__global__ void __launch_bounds__(kDecodeBlock) attention_kv_kernel(floatX* __restrict__ out,  // (B, Tq, C)
                                           const floatX* __restrict__ kcache,   // (S, maxT, C)
                                           const floatX* __restrict__ vcache,   // (S, maxT, C)
                                           const floatX* __restrict__ qkv,      // (B, Tq, 3C)
                                           const int32_t* __restrict__ slot,    // (B)
                                           const int32_t* __restrict__ pos,     // (B)
                                           int Tq, int C, int NH, int maxT) {
  DYNAMIC_SMEM(float, score);  // (maxT): the scores, then the probabilities (unnormalised)
  __shared__ float q[kDecodeMaxHs];
  __shared__ float part[kDecodeWarps][kDecodeMaxHs];
  __shared__ float wmax[kDecodeWarps], wsum[kDecodeWarps];
  const int h = blockIdx.x, t = blockIdx.y, b = blockIdx.z;
  const int hs = C / NH, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int n = pos[b] + t + 1;  // keys 0 .. pos[b] + t
  const size_t row = size_t(b) * Tq + t;
  const floatX* qp = qkv + row * 3 * C + size_t(h) * hs;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) q[d] = load_f(qp[d]);
  __syncthreads();
  const size_t base = size_t(slot[b]) * maxT * C + size_t(h) * hs;
  const float scale = 1.0f / sqrtf(float(hs));
  float mx = -INFINITY;
  for (int key = warp; key < n; key += kDecodeWarps) {
    const floatX* kp = kcache + base + size_t(key) * C;
    float s = 0.0f;
    for (int d = lane; d < hs; d += 32) s += q[d] * load_f(kp[d]);
    s = warp_sum(s) * scale;
    if (lane == 0) score[key] = s;
    mx = fmaxf(mx, s);
  }
  mx = block_softmax_numerators(score, n, mx, wmax, wsum);
  float sum = 0.0f;
  for (int w = 0; w < kDecodeWarps; w++) sum += wsum[w];
  float acc[kDecodeMaxHs / 32];
#pragma unroll
  for (int k = 0; k < kDecodeMaxHs / 32; k++) acc[k] = 0.0f;
  for (int key = warp; key < n; key += kDecodeWarps) {
    add_pv(acc, vcache + base + size_t(key) * C, score[key], lane, hs);
  }
  store_warp_part(part[warp], acc, lane, hs);
  const float inv = 1.0f / sum;
  floatX* o = out + row * C + size_t(h) * hs;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float s = 0.0f;
    for (int w = 0; w < kDecodeWarps; w++) s += part[w][d];
    o[d] = store_t<floatX>(s * inv);
  }
}

// grid (NH * splits, Tq, B): block s of head h takes positions [s * chunk, (s + 1) * chunk) of 0 .. n - 1, chunk =
// ceil(n / splits). Warp w scores keys w * 4 .. w * 4 + 3, then w * 4 + 16 .. (kSplitKeysPerWarp rows loaded before
// their shuffle sums), then the block's max and sum of exp, then p * v over the same keys, the warps' outputs summed.
// Partials (B, Tq, NH, splits): part_o hs floats each (unnormalised), part_ml (max, sum of exp).
template <class floatX>
__global__ void __launch_bounds__(kDecodeBlock) attention_kv_split_kernel(float* __restrict__ part_o,
                                                 float* __restrict__ part_ml,
                                                 const floatX* __restrict__ kcache,   // (S, maxT, C)
                                                 const floatX* __restrict__ vcache,   // (S, maxT, C)
                                                 const floatX* __restrict__ qkv,      // (B, Tq, 3C)
                                                 const int32_t* __restrict__ slot,    // (B)
                                                 const int32_t* __restrict__ pos,     // (B)
                                                 int Tq, int C, int NH, int maxT, int splits) {
  DYNAMIC_SMEM(float, score);  // (ceil(maxT / splits)): this block's scores, then its probabilities
  __shared__ float q[kDecodeMaxHs];
  __shared__ float part[kDecodeWarps][kDecodeMaxHs];
  __shared__ float wmax[kDecodeWarps], wsum[kDecodeWarps];
  const int h = blockIdx.x / splits, s = blockIdx.x % splits, t = blockIdx.y, b = blockIdx.z;
  const int hs = C / NH, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int n = pos[b] + t + 1;  // keys 0 .. pos[b] + t
  const int chunk = (n + splits - 1) / splits;
  const int k0 = min(n, s * chunk), nk = min(n, k0 + chunk) - k0;
  const size_t row = size_t(b) * Tq + t;
  const size_t pidx = (row * NH + h) * splits + s;
  float* po = part_o + pidx * hs;
  if (nk <= 0) {  // an empty share (n < splits): nothing to add
    for (int d = threadIdx.x; d < hs; d += blockDim.x) po[d] = 0.0f;
    if (threadIdx.x == 0) {
      part_ml[2 * pidx] = -INFINITY;
      part_ml[2 * pidx + 1] = 0.0f;
    }
    return;
  }
  const floatX* qp = qkv + row * 3 * C + size_t(h) * hs;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) q[d] = load_f(qp[d]);
  __syncthreads();
  const size_t base = (size_t(slot[b]) * maxT + k0) * C + size_t(h) * hs;
  const float scale = 1.0f / sqrtf(float(hs));
  constexpr int G = kSplitKeysPerWarp, stride = kDecodeWarps * kSplitKeysPerWarp;
  float mx = -INFINITY;
  for (int key0 = warp * G; key0 < nk; key0 += stride) {
    float sc[G];
#pragma unroll
    for (int j = 0; j < G; j++) {
      sc[j] = 0.0f;
      if (key0 + j < nk) {
        const floatX* kp = kcache + base + size_t(key0 + j) * C;
#pragma unroll
        for (int k = 0; k < kDecodeMaxHs / 32; k++)
          if (lane + 32 * k < hs) sc[j] += q[lane + 32 * k] * load_f(kp[lane + 32 * k]);
      }
    }
#pragma unroll
    for (int j = 0; j < G; j++) {
      if (key0 + j < nk) {  // the same for the whole warp
        const float v = warp_sum(sc[j]) * scale;
        if (lane == 0) score[key0 + j] = v;
        mx = fmaxf(mx, v);
      }
    }
  }
  mx = block_softmax_numerators(score, nk, mx, wmax, wsum);
  float acc[kDecodeMaxHs / 32];
#pragma unroll
  for (int k = 0; k < kDecodeMaxHs / 32; k++) acc[k] = 0.0f;
  for (int key0 = warp * G; key0 < nk; key0 += stride) {
#pragma unroll
    for (int j = 0; j < G; j++) {
      if (key0 + j < nk) {
        add_pv(acc, vcache + base + size_t(key0 + j) * C, score[key0 + j], lane, hs);
      }
    }
  }
  store_warp_part(part[warp], acc, lane, hs);
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float v = 0.0f;
    for (int w = 0; w < kDecodeWarps; w++) v += part[w][d];
    po[d] = v;
  }
  if (threadIdx.x == 0) {
    float l = 0.0f;
    for (int w = 0; w < kDecodeWarps; w++) l += wsum[w];
    part_ml[2 * pidx] = mx;
    part_ml[2 * pidx + 1] = l;
  }
}

// grid (NH, Tq, B), thread d: out = sum_s e^(m_s - M) o_s[d] / sum_s e^(m_s - M) l_s, M = max_s m_s (finite: share 0
// is never empty).
template <class floatX>
__global__ void __launch_bounds__(kDecodeBlock) attention_kv_combine_kernel(floatX* __restrict__ out,  // (B, Tq, C)
                                                   const float* __restrict__ part_o,
                                                   const float* __restrict__ part_ml,
                                                   int Tq, int C, int NH, int splits) {
  const int h = blockIdx.x, t = blockIdx.y, b = blockIdx.z;
  const int hs = C / NH;
  const size_t row = size_t(b) * Tq + t;
  const size_t p0 = (row * NH + h) * splits;
  float M = -INFINITY;
  for (int s = 0; s < splits; s++) M = fmaxf(M, part_ml[2 * (p0 + s)]);
  float l = 0.0f;
  for (int s = 0; s < splits; s++) l += expf(part_ml[2 * (p0 + s)] - M) * part_ml[2 * (p0 + s) + 1];
  const float inv = 1.0f / l;
  floatX* o = out + row * C + size_t(h) * hs;
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float v = 0.0f;
    for (int s = 0; s < splits; s++) v += expf(part_ml[2 * (p0 + s)] - M) * part_o[(p0 + s) * hs + d];
    o[d] = store_t<floatX>(v * inv);
  }
}

template <class floatX>
__global__ void __launch_bounds__(kInferRowBlock) gather_rows_kernel(floatX* __restrict__ out,  // (n, C)
                                            const floatX* __restrict__ inp,        // (rows, C)
                                            const int32_t* __restrict__ rows,      // (n)
                                            int C) {
  const floatX* src = inp + size_t(rows[blockIdx.x]) * C;
  floatX* o = out + size_t(blockIdx.x) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = src[c];
}

// ---- sampling
// The order key of token i with logit z: larger key = earlier in model/sampling.h's order (higher logit, then lower id).
__device__ inline uint64_t sample_key(float z, int i) {
  const uint32_t u = __float_as_uint(z);
  const uint32_t o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(o) << 32) | uint64_t(0xffffffffu - uint32_t(i));
}
__device__ inline float key_logit(uint64_t key) {
  const uint32_t o = uint32_t(key >> 32);
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
__device__ inline int key_id(uint64_t key) { return int(0xffffffffu - uint32_t(key & 0xffffffffu)); }

// The largest of the block's values, returned to every thread; buf: 32 values of shared memory.
__device__ inline uint64_t block_max_key(uint64_t v, uint64_t* buf) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t w = __shfl_xor_sync(kFullMask, v, o);
    v = w > v ? w : v;
  }
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  v = buf[0];
  for (int w = 1; w < nwarps; w++) v = buf[w] > v ? buf[w] : v;
  __syncthreads();  // buf may be reused
  return v;
}

// The sum of the block's values in a fixed order (deterministic), returned to every thread; buf: 32 values.
__device__ inline double block_sum_double(double v, double* buf) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  v = 0.0;
  for (int w = 0; w < nwarps; w++) v += buf[w];
  __syncthreads();
  return v;
}

// The m-th largest key of the row (1 <= m <= V; keys are unique): a radix select, 8 bits per pass from the top.
template <class floatX>
__device__ __forceinline__ uint64_t select_key(const floatX* z, int V, int m, unsigned* hist, uint64_t* shared_prefix, int* shared_m) {
  uint64_t prefix = 0, mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const uint64_t key = sample_key(load_f(z[i]), i);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned cum = 0;
      int bin = 255;
      for (; bin > 0; bin--) {
        if (cum + hist[bin] >= unsigned(m)) break;
        cum += hist[bin];
      }
      *shared_prefix = prefix | (uint64_t(bin) << shift);
      *shared_m = m - int(cum);
    }
    __syncthreads();
    prefix = *shared_prefix;
    m = *shared_m;
    mask |= uint64_t(255) << shift;
    __syncthreads();  // the shared values and hist are rewritten by the next pass
  }
  return prefix;
}

// e^x in double for x <= 0 (the sampler's exp(z - zmax) / T), within ~2 ulp of exp; 0 below -745. Written out
// because CUDA's exp(double) keeps a slow path behind a call whose saved registers count as spills: range reduction
// by ln 2 (Cody-Waite, two parts), a degree-13 Taylor polynomial on |r| <= ln2 / 2, then 2^k.
__device__ __forceinline__ double exp_nonpositive(double x) {
  if (!(x > -745.0)) return 0.0;
  const double k = rint(x * 1.4426950408889634);
  const double r = fma(k, -1.90821492927058770002e-10, fma(k, -6.93147180369123816490e-01, x));
  double p = 1.0 / 6227020800.0;  // 1/13!
  const double inv_fact[13] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0,
                               1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
#pragma unroll
  for (int i = 0; i < 13; i++) p = fma(p, r, inv_fact[i]);
  return ldexp(p, int(k));
}

// grid (n rows), block kSampleBlock. ids[r]: the token; host[r] = 1 where the row must be sampled on the host.
template <class floatX>
__global__ void __launch_bounds__(kSampleBlock) sample_kernel(int32_t* __restrict__ ids,   // (n)
                                     int32_t* __restrict__ host,                  // (n)
                                     const floatX* __restrict__ logits,           // (n, Vp)
                                     const SampleArgs* __restrict__ args,         // (n)
                                     int V, int Vp) {
  __shared__ uint64_t cand[kSampleCap];
  __shared__ double prob[kSampleCap];
  __shared__ unsigned hist[256];
  __shared__ uint64_t kbuf[32];
  __shared__ double dbuf[32];
  __shared__ uint64_t s_prefix;
  __shared__ double s_before, s_target;
  __shared__ int s_m;
  __shared__ unsigned s_count;
  const int r = blockIdx.x, tid = threadIdx.x;
  const floatX* z = logits + size_t(r) * Vp;
  const SampleArgs a = args[r];
  uint64_t best = 0;
  for (int i = tid; i < V; i += blockDim.x) {
    const uint64_t key = sample_key(load_f(z[i]), i);
    best = key > best ? key : best;
  }
  best = block_max_key(best, kbuf);
  if (a.temperature == 0.0f || a.top_k == 1) {  // greedy: the arg max, lowest id on ties
    if (tid == 0) {
      ids[r] = key_id(best);
      host[r] = 0;
    }
    return;
  }
  const double zmax = double(key_logit(best)), inv_t = 1.0 / double(a.temperature);
  const int m = (a.top_k > 0 && a.top_k < V) ? a.top_k : V;
  const bool nucleus = a.top_p < 1.0f;
  if (m == V && !nucleus) {  // nothing cut: the inverse CDF in id order, each thread over one chunk of ids
    const int per = (V + int(blockDim.x) - 1) / int(blockDim.x);
    const int i0 = min(V, tid * per), i1 = min(V, i0 + per);
    double local = 0.0;
    for (int i = i0; i < i1; i++) local += exp_nonpositive((double(load_f(z[i])) - zmax) * inv_t);
    prob[tid] = local;
    __syncthreads();
    if (tid == 0) {  // the chunks' sums in order: the total, and the chunk where u * total falls
      double total = 0.0;
      for (int w = 0; w < int(blockDim.x); w++) total += prob[w];
      const double target = a.u * total;
      double c = 0.0, before = 0.0;
      int owner = 0;
      for (int w = 0; w < int(blockDim.x); w++) {
        if (prob[w] > 0.0) {
          owner = w;
          before = c;
          if (c + prob[w] > target) break;
        }
        c += prob[w];
      }
      s_m = owner;
      s_before = before;
      s_target = target;
    }
    __syncthreads();
    if (tid == s_m) {  // the owner walks its chunk from the mass before it
      double c = s_before;
      int id = -1, last = i0;
      for (int i = i0; i < i1; i++) {
        const double p = exp_nonpositive((double(load_f(z[i])) - zmax) * inv_t);
        if (p > 0.0) last = i;
        c += p;
        if (c > s_target) {
          id = i;
          break;
        }
      }
      ids[r] = id >= 0 ? id : last;
      host[r] = 0;
    }
    return;
  }
  // cut: the top m keys sorted (m <= kSampleCap), or the kSampleCap largest for a nucleus of a larger kept set
  double kept_total = 0.0;
  int count = m;
  if (m > kSampleCap) {
    if (!nucleus) {  // top_k beyond what shared memory sorts: the host samples this row
      if (tid == 0) host[r] = 1;
      return;
    }
    const uint64_t thr_m = m == V ? 0 : select_key(z, V, m, hist, &s_prefix, &s_m);
    double local = 0.0;
    for (int i = tid; i < V; i += blockDim.x) {
      const float zi = load_f(z[i]);
      if (sample_key(zi, i) >= thr_m) local += exp_nonpositive((double(zi) - zmax) * inv_t);
    }
    kept_total = block_sum_double(local, dbuf);
    count = kSampleCap;
  }
  const uint64_t thr = select_key(z, V, count, hist, &s_prefix, &s_m);
  if (tid == 0) s_count = 0;
  __syncthreads();
  for (int i = tid; i < V; i += blockDim.x) {
    const uint64_t key = sample_key(load_f(z[i]), i);
    if (key >= thr) cand[atomicAdd(&s_count, 1u)] = key;
  }
  int P = 1;
  while (P < count) P <<= 1;
  for (int i = count + tid; i < P; i += blockDim.x) cand[i] = 0;  // padding sorts last
  __syncthreads();
  for (int k = 2; k <= P; k <<= 1) {  // bitonic sort, descending
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < P; i += blockDim.x) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const uint64_t x = cand[i], y = cand[ixj];
          if ((i & k) == 0 ? x < y : x > y) {
            cand[i] = y;
            cand[ixj] = x;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int j = tid; j < count; j += blockDim.x) prob[j] = exp_nonpositive((double(key_logit(cand[j])) - zmax) * inv_t);
  __syncthreads();
  if (tid == 0) {  // model/sampling.h's walk over the sorted candidates
    double total = kept_total;
    if (m <= kSampleCap) {
      total = 0.0;
      for (int j = 0; j < count; j++) total += prob[j];
    }
    int mm = count;
    if (nucleus) {
      const double want = double(a.top_p) * total;
      double c = 0.0;
      bool found = false;
      for (int j = 0; j < count; j++) {
        c += prob[j];
        if (c >= want) {
          mm = j + 1;
          found = true;
          break;
        }
      }
      if (!found && m > kSampleCap) {  // the nucleus reaches past the sorted candidates
        host[r] = 1;
        return;
      }
      total = 0.0;
      for (int j = 0; j < mm; j++) total += prob[j];
    }
    const double target = a.u * total;
    double c = 0.0;
    int id = key_id(cand[mm - 1]);
    for (int j = 0; j < mm; j++) {
      c += prob[j];
      if (c > target) {
        id = key_id(cand[j]);
        break;
      }
    }
    ids[r] = id;
    host[r] = 0;
  }
}

// ----------------------------------------------------------------------------------------- launchers
template <class floatX>
void encoder_forward_at(floatX* out, const int32_t* inp, const floatX* wte, const floatX* wpe, const int32_t* pos,
                        int B, int Tn, int C, cudaStream_t stream) {
  if (B * Tn == 0) return;
  LAUNCH(encoder_forward_at_kernel<floatX>, B * Tn, kInferRowBlock, 0, stream, out, inp, wte, wpe, pos, Tn, C);
  CUDA_CHECK_LAUNCH();
}

// The largest maxT whose scores fit the default 48 KiB of dynamic shared memory.
constexpr int kDecodeMaxT = 48 * 1024 / 4;

// How many blocks share each (head, query, sequence)'s positions (1: attention_kv_kernel alone); sms: the GPU's SM
// count. Decided from sizes the host knows (maxT, the cache's capacity, not the sequences' lengths, which are on the
// device), so a captured decode step stays right for every later step.
inline int decode_splits(int B, int Tq, int NH, int maxT, int sms) {
  const long blocks = long(NH) * Tq * B;
  if (maxT < kSplitMinKeys || blocks >= long(kSplitBlocksPerSm) * sms) return 1;
  const long want = (long(kSplitBlocksPerSm) * sms + blocks - 1) / blocks;
  const long most = maxT / kSplitMinChunk;
  const long n = want < most ? want : most;
  return int(n < 1 ? 1 : n > kDecodeMaxSplits ? kDecodeMaxSplits : n);
}
// The workspace of a split launch, in floats: (B, Tq, NH, splits) partials of hs + 2 floats.
inline size_t decode_workspace_floats(int B, int Tq, int C, int NH, int splits) {
  return splits > 1 ? size_t(B) * Tq * NH * splits * (C / NH + 2) : 0;
}

// splits: decode_splits's choice (or any 1 .. kDecodeMaxSplits); work: decode_workspace_floats of device memory
// when splits > 1 (its contents are overwritten).
template <class floatX>
void attention_kv_forward(floatX* out, floatX* kcache, floatX* vcache, const floatX* qkv, const int32_t* slot,
                          const int32_t* pos, int B, int Tq, int C, int NH, int maxT, int splits, float* work,
                          cudaStream_t stream) {
  if (B * Tq == 0) return;
  if (splits < 1 || splits > kDecodeMaxSplits || (splits > 1 && !work))
    throw std::invalid_argument("CUDA attention_kv_forward: splits " + std::to_string(splits) + " (1 to " +
                                std::to_string(kDecodeMaxSplits) + ", with a workspace above 1)");
  if (C % NH != 0 || C / NH > kDecodeMaxHs)
    throw std::invalid_argument("CUDA attention_kv_forward: head size " + std::to_string(C / NH) + " (at most " +
                                std::to_string(kDecodeMaxHs) + ")");
  if (maxT > kDecodeMaxT)
    throw std::invalid_argument("CUDA attention_kv_forward: a cache of " + std::to_string(maxT) +
                                " positions (at most " + std::to_string(kDecodeMaxT) + ")");
  LAUNCH(kv_write_kernel<floatX>, B * Tq, kInferRowBlock, 0, stream, kcache, vcache, qkv, slot, pos, Tq, C, maxT);
  CUDA_CHECK_LAUNCH();
  if (splits == 1) {
    const size_t smem = size_t(maxT) * sizeof(float);
    LAUNCH(attention_kv_kernel<floatX>, dim3(NH, Tq, B), kDecodeBlock, smem, stream, out, kcache, vcache, qkv, slot,
           pos, Tq, C, NH, maxT);
    CUDA_CHECK_LAUNCH();
    return;
  }
  float* part_o = work;
  float* part_ml = work + size_t(B) * Tq * NH * splits * (C / NH);
  const size_t smem = size_t((maxT + splits - 1) / splits) * sizeof(float);
  LAUNCH(attention_kv_split_kernel<floatX>, dim3(NH * splits, Tq, B), kDecodeBlock, smem, stream, part_o, part_ml,
         kcache, vcache, qkv, slot, pos, Tq, C, NH, maxT, splits);
  CUDA_CHECK_LAUNCH();
  LAUNCH(attention_kv_combine_kernel<floatX>, dim3(NH, Tq, B), kDecodeBlock, 0, stream, out, part_o, part_ml, Tq, C, NH,
         splits);
  CUDA_CHECK_LAUNCH();
}

template <class floatX>
void gather_rows(floatX* out, const floatX* inp, const int32_t* rows, int n, int C, cudaStream_t stream) {
  if (n == 0) return;
  LAUNCH(gather_rows_kernel<floatX>, n, kInferRowBlock, 0, stream, out, inp, rows, C);
  CUDA_CHECK_LAUNCH();
}

// args, ids_host: device memory of n SampleArgs and 2n int32 (ids, then the host flags)
template <class floatX>
void sample(int32_t* ids_flags, const floatX* logits, const SampleArgs* args, int n, int V, int Vp, cudaStream_t stream) {
  if (n == 0) return;
  LAUNCH(sample_kernel<floatX>, n, kSampleBlock, 0, stream, ids_flags, ids_flags + n, logits, args, V, Vp);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
