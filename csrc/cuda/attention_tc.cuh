// Causal multi-head self-attention, forward and backward, on tensor cores, FlashAttention-2 style, for 16-bit storage
// (__nv_bfloat16 on sm_80+; the same code serves __half). Layouts and contract as attention.cuh: qkv (B, T, 3C),
// out (B, T, C), lse (B, NH, T) = logsumexp over keys t2 <= t of s = scale q.k;
//   out_t = sum_{t2 <= t} exp(s_{t,t2} - lse_t) v_t2.
// One block of 4 warps per (64-query tile, head, batch); warp w owns query rows 16w .. 16w + 15 of the tile.
// S = Q K^T and O += P V run as mma.sync m16n8k16 (16-bit inputs, fp32 accumulate, cuda/mma.cuh) with operands
// from shared memory through ldmatrix (K rows as B^T: no transpose; V rows: .trans). The online softmax runs on
// the S fragments in registers (each lane holds rows g, g + 8 of its warp's 16, a quad of lanes shares a row:
// row max by two xor-shuffles); P is rounded to the storage type for the P V product (as FlashAttention-2), the
// row sum l stays fp32. Tiles are single-buffered (two barriers per tile): with loads that go through registers a
// second buffer hides little, and the smaller footprint lets more blocks share an SM (sm_75's 64 KiB, A100's
// 164 KiB), which hides the loads instead. Shared rows are padded by 8 elements (16 bytes) so that ldmatrix's eight
// row reads hit eight different bank groups. Head sizes up to HS (64 or 128) run zero-padded.
// Backward (FlashAttention-2's products, made deterministic without float atomics), with D = rowsum(dout * out)
// from attention.cuh's dot kernel:
//   dkdv kernel, one block per 64-key tile (warp w: keys 16w ..), looping over the query tiles at or after it:
//     S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - D); dV += P^T dO, dK += dS^T Q;
//     and dS^T, rounded to the storage type (as for its dK product), is stored to a scratch tile per (query tile,
//     key tile) pair;
//   dq kernel, one block per 64-query tile, summing over the key tiles up to the diagonal in order: dQ += dS K,
//     dS read back from the scratch (the value the dK product used, so nothing is recomputed).
// Five T x T x hs products (4 + 1), with the forward's two 7 L C T-equivalent causal FLOPs, FlashAttention-2's
// count, with bit-reproducible gradients under any schedule: each dQ row is one block's sum in a fixed order.
// The price is HBM traffic instead of FLOPs: the dS scratch is written once and read once, 2 bytes per causal
// (query, key) pair (tile-granular: n (n + 1) / 2 tiles of 64 x 64, n = ceil(T / 64)) each way; for hs = 64
// that is half of the per-tile fp32 dQ partials a partial-sum scheme would move, and at hs = 64 it costs less
// than recomputing S and dP in the dq kernel (the 9 L C T scheme this replaced; scripts/gpu_model.py models both).
// P and dS are rounded to the storage type for their products (as FlashAttention-2); everything else, lse and D
// included, stays fp32. dK, dV, dQ are added into dqkv once, in fp32, rounded once.
#pragma once
#include "cuda/attention.cuh"  // dispatch_head_size, attention_backward_dot
#include "cuda/attention_common.cuh"
#include "cuda/mma.cuh"

#include <algorithm>

namespace gpt2::cuda {

constexpr int kTcRows = 64;      // query rows per block (16 per warp) = key rows per tile
constexpr int kTcThreads = 128;  // 4 warps
constexpr int kTcSlab = 32;      // query rows the dkdv kernel loads at a time (half a tile: two blocks fit sm_75)
// Backward blocks per SM that the register budget is sized for: head size 64 fits 128 registers a thread (4 blocks
// of 4 warps, a quarter of the SM's warp slots); 128 cannot (its dK, dV accumulators alone take 128).
template <int HS>
constexpr int kTcBwdMinBlocks = HS > 64 ? 1 : 4;

template <int HS>
constexpr int kTcStride = HS + 8;  // shared row stride (elements)
template <int HS>
constexpr size_t tc_tile_elems = size_t(kTcRows) * kTcStride<HS>;
// False where this compilation's architecture never runs the kernels for head size HS, which then compile to a trap:
// below sm_75 none (no ldmatrix, no fp16 m16n8k8), below sm_80 only HS = 64 (attention_tc_fits).
template <int HS>
__device__ constexpr bool tc_arch_runs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
  return false;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  return HS <= 64;
#else
  return true;
#endif
}

template <int HS>
constexpr size_t tc_smem_bytes() {  // forward: Q, K, V tiles of 16-bit elements
  return 3 * tc_tile_elems<HS> * 2;
}
template <int HS>
constexpr size_t tc_bwd_smem_bytes() {  // dkdv: K, V tiles, Q, dO slabs + lse and D of the slab's rows
  return (2 * tc_tile_elems<HS> + 2 * kTcSlab * kTcStride<HS>) * 2 + 2 * kTcSlab * sizeof(float);
}
template <int HS>
constexpr size_t tc_dq_smem_bytes() {  // dq: a dS^T tile (64 x 64), a K tile
  return (tc_tile_elems<64> + tc_tile_elems<HS>) * 2;
}
// dS^T tiles of the backward: one 64 x 64 tile of floatX per (query tile i, key tile j <= i) of each (b, h), at
// tile index i (i + 1) / 2 + j.
__host__ __device__ inline size_t tc_ds_tiles(int T) {
  const size_t n = (size_t(T) + kTcRows - 1) / kTcRows;
  return n * (n + 1) / 2;
}

// Rows r0 .. r0 + ROWS - 1 of src (dims 0 .. HS - 1; 0 outside [0, T) x [0, hs)) into a shared tile.
template <int HS, int ROWS = kTcRows, class floatX>
__device__ inline void tc_load_tile(floatX* tile, const floatX* src, int stride, int r0, int T, int hs, bool vec) {
  constexpr int S = kTcStride<HS>, N = attn::Pack<floatX>::N;
  if (vec) {
    for (int idx = threadIdx.x; idx < ROWS * HS / N; idx += blockDim.x) {
      const int r = idx / (HS / N), d0 = idx % (HS / N) * N, row = r0 + r;
      attn::Pack<floatX> x;
      if (row < T && d0 < hs) {
        x = attn::load_pack(src + size_t(row) * stride + d0);
      } else {
#pragma unroll
        for (int k = 0; k < N; k++) x.v[k] = attn::from_float<floatX>(0.0f);
      }
      attn::store_pack(tile + r * S + d0, x);
    }
  } else {
    for (int idx = threadIdx.x; idx < ROWS * HS; idx += blockDim.x) {
      const int r = idx / HS, d = idx % HS, row = r0 + r;
      tile[r * S + d] = (row < T && d < hs) ? src[size_t(row) * stride + d] : attn::from_float<floatX>(0.0f);
    }
  }
}

// acc (16 x N) += A B^T over the head dims: A = the warp's 16 rows at A (shared, row stride kTcStride), B = the
// N rows at Bs (shared; as B^T: no transpose). Element e of acc[nt] is (row g + 8 (e / 2), column
// 8 nt + 2t + e % 2), g = lane / 4, t = lane % 4.
template <int HS, int N, class floatX>
__device__ inline void tc_mma_abt(float (&acc)[N / 8][4], const floatX* A, const floatX* Bs, int lane) {
  constexpr int S = kTcStride<HS>;
#pragma unroll
  for (int ks = 0; ks < HS / 16; ks++) {
    uint32_t a[4];
    ldmatrix_x4(a, A + (lane % 16) * S + ks * 16 + lane / 16 * 8);
#pragma unroll
    for (int np = 0; np < N / 16; np++) {  // columns 16 np ..: matrices {rows lo, hi} x {dims lo, hi}
      uint32_t r[4];
      ldmatrix_x4(r, Bs + (np * 16 + lane / 16 * 8 + lane % 8) * S + ks * 16 + (lane / 8) % 2 * 8);
      const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
      mma_m16n8k16<floatX>(acc[2 * np], a, b0);
      mma_m16n8k16<floatX>(acc[2 * np + 1], a, b1);
    }
  }
}

// acc (16 x HS) += A B over keys 16 kk .. 16 kk + 15: a = the A fragment of those 16 columns, B = rows at Bs (shared,
// row stride kTcStride<HS>, loaded .trans). Element e of acc[dt] is (row g + 8 (e / 2), dim 8 dt + 2t + e % 2).
template <int HS, class floatX>
__device__ inline void tc_mma_ab_k16(float (&acc)[HS / 8][4], const uint32_t (&a)[4], const floatX* Bs, int kk,
                                     int lane) {
  constexpr int S = kTcStride<HS>;
#pragma unroll
  for (int dp = 0; dp < HS / 16; dp++) {  // dims 16 dp ..: matrices {rows lo, hi} x {dims lo, hi}, transposed
    uint32_t r[4];
    ldmatrix_x4_trans(r, Bs + (kk * 16 + (lane / 8) % 2 * 8 + lane % 8) * S + dp * 16 + lane / 16 * 8);
    const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
    mma_m16n8k16<floatX>(acc[2 * dp], a, b0);
    mma_m16n8k16<floatX>(acc[2 * dp + 1], a, b1);
  }
}

// acc (16 x HS) += P B: P (16 x N) in tc_mma_abt's accumulator layout, rounded to floatX (the C fragments of
// column tiles 2kk, 2kk + 1 are the A fragment of columns 16kk ..); B = the N rows x HS at Bs (shared, .trans).
template <int HS, int N, class floatX>
__device__ inline void tc_mma_pb(float (&acc)[HS / 8][4], const float (&p)[N / 8][4], const floatX* Bs, int lane) {
#pragma unroll
  for (int kk = 0; kk < N / 16; kk++) {
    const uint32_t pa[4] = {pack2<floatX>(p[2 * kk][0], p[2 * kk][1]), pack2<floatX>(p[2 * kk][2], p[2 * kk][3]),
                            pack2<floatX>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                            pack2<floatX>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
    tc_mma_ab_k16<HS>(acc, pa, Bs, kk, lane);
  }
}

// dst[(r0 + g + 8h) stride + d] = (Accumulate: dst +) mul[h] acc, this lane's elements of a tc_mma_pb accumulator
// (rows < T, dims < hs), added in fp32 and rounded once to floatX.
template <bool Accumulate, int HS, class floatX>
__device__ inline void tc_store_rows(floatX* dst, int stride, const float (&acc)[HS / 8][4], const float (&mul)[2],
                                     int r0, int T, int hs, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int row = r0 + g + 8 * h;
    if (row >= T) continue;
    floatX* p = dst + size_t(row) * stride;
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++)
#pragma unroll
      for (int c = 0; c < 2; c++) {
        const int d = dt * 8 + 2 * t + c;
        if (d >= hs) continue;
        float v = acc[dt][2 * h + c] * mul[h];
        if constexpr (Accumulate) v += attn::to_float(p[d]);
        p[d] = attn::from_float<floatX>(v);
      }
  }
}

// grid (ceil(T / 64), NH, B), block kTcThreads, dynamic shared memory tc_smem_bytes<HS>().
// vec: attn::packs_fit(hs, out, qkv).
template <int HS, class floatX>
__global__ void __launch_bounds__(kTcThreads)
attention_tc_forward_kernel(floatX* __restrict__ out,        // (B, T, C)
                            float* __restrict__ lse,         // (B, NH, T)
                            const floatX* __restrict__ qkv,  // (B, T, 3C)
                            int T, int NH, int hs, float scale, bool vec) {
  static_assert(sizeof(floatX) == 2, "tensor-core attention takes 16-bit storage");
  constexpr int S = kTcStride<HS>, NT = kTcRows / 8;  // 8-key tiles
  constexpr size_t TILE = tc_tile_elems<HS>;
  DYNAMIC_SMEM(floatX, smem);
  if (!tc_arch_runs<HS>()) return __trap();
  floatX* Qs = smem;
  floatX* Ks = smem + TILE;
  floatX* Vs = smem + 2 * TILE;
  const int q0 = blockIdx.x * kTcRows, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int C = NH * hs;
  const floatX* base = qkv + size_t(blockIdx.z) * T * 3 * C + size_t(blockIdx.y) * hs;
  tc_load_tile<HS>(Qs, base, 3 * C, q0, T, hs, vec);
  float o[HS / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8: running max, this lane's sum
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const int ntiles = (min(T - 1, q0 + kTcRows - 1)) / kTcRows + 1;
  for (int j = 0; j < ntiles; j++) {
    const int k0 = j * kTcRows;
    if (j) __syncthreads();  // every warp is done with tile j - 1
    tc_load_tile<HS>(Ks, base + C, 3 * C, k0, T, hs, vec);
    tc_load_tile<HS>(Vs, base + 2 * C, 3 * C, k0, T, hs, vec);
    __syncthreads();
    float s[NT][4] = {};
    tc_mma_abt<HS, kTcRows>(s, Qs + warp * 16 * S, Ks, lane);
    // online softmax: element e of tile nt is (row[e / 2], key k0 + 8 nt + 2t + e % 2)
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int key = k0 + nt * 8 + 2 * t + e % 2;
        s[nt][e] = (key <= row[e / 2] && key < T) ? s[nt][e] * scale : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
      }
    float mref[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 2));
      const float mnew = fmaxf(m[h], mx[h]);
      mref[h] = mnew == -INFINITY ? 0.0f : mnew;  // no valid key yet: everything stays 0
      const float corr = expf(m[h] - mref[h]);
      l[h] *= corr;
#pragma unroll
      for (int dt = 0; dt < HS / 8; dt++) {
        o[dt][2 * h] *= corr;
        o[dt][2 * h + 1] *= corr;
      }
      m[h] = mnew;
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        s[nt][e] = expf(s[nt][e] - mref[e / 2]);  // exp(-inf) = 0 for masked keys
        l[e / 2] += s[nt][e];
      }
    tc_mma_pb<HS, kTcRows>(o, s, Vs, lane);
  }
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
    inv[h] = 1.0f / l[h];
    if (t == 0 && row[h] < T) lse[(size_t(blockIdx.z) * NH + blockIdx.y) * T + row[h]] = m[h] + logf(l[h]);
  }
  tc_store_rows<false, HS>(out + size_t(blockIdx.z) * T * C + size_t(blockIdx.y) * hs, C, o, inv,
                           q0 + warp * 16, T, hs, lane);
}

// dK, dV of one 64-key tile, and its dS^T tiles: grid (ceil(T / 64), NH, B), block kTcThreads, dynamic shared
// memory tc_bwd_smem_bytes<HS>(). K and V stay in shared memory; Q and dO (with their rows' lse and D) come in
// slabs of kTcSlab rows, taken NQ queries at a time (S^T and dP^T of 16 x NQ per warp: 64 would not fit the
// register budget). vec: attn::packs_fit(hs, dout, qkv). kAccumulate: dK, dV added into dqkv, else stored.
template <int HS, bool kAccumulate, class floatX>
__global__ void __launch_bounds__(kTcThreads, kTcBwdMinBlocks<HS>)
attention_tc_backward_dkdv_kernel(floatX* __restrict__ dqkv,       // (B, T, 3C), accumulated into or written
                                  floatX* __restrict__ dS,         // (B, NH, tc_ds_tiles(T), 64 keys, 64 queries)
                                  const floatX* __restrict__ dout, // (B, T, C)
                                  const floatX* __restrict__ qkv,  // (B, T, 3C)
                                  const float* __restrict__ lse,   // (B, NH, T)
                                  const float* __restrict__ Dd,    // (B, NH, T)
                                  int T, int NH, int hs, float scale, bool vec) {
  constexpr int S = kTcStride<HS>, NQ = HS > 64 ? 32 : 16, NT = NQ / 8;  // 8-query tiles
  constexpr size_t TILE = tc_tile_elems<HS>;
  DYNAMIC_SMEM(floatX, smem);
  if (!tc_arch_runs<HS>()) return __trap();
  floatX* Ks = smem;
  floatX* Vs = smem + TILE;
  floatX* Qs = smem + 2 * TILE;                                      // kTcSlab rows
  floatX* dOs = Qs + kTcSlab * S;                                    // kTcSlab rows
  float* Ls = reinterpret_cast<float*>(dOs + kTcSlab * S);           // [kTcSlab]
  float* Ds = Ls + kTcSlab;                                          // [kTcSlab]
  const int k0 = blockIdx.x * kTcRows, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int C = NH * hs;
  const floatX* base = qkv + size_t(blockIdx.z) * T * 3 * C + size_t(blockIdx.y) * hs;
  const floatX* dbase = dout + size_t(blockIdx.z) * T * C + size_t(blockIdx.y) * hs;
  const size_t stats = (size_t(blockIdx.z) * NH + blockIdx.y) * T;
  tc_load_tile<HS>(Ks, base + C, 3 * C, k0, T, hs, vec);
  tc_load_tile<HS>(Vs, base + 2 * C, 3 * C, k0, T, hs, vec);
  float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  const int ntiles = (T - 1 - k0) / kTcRows + 1;  // query tiles k0, k0 + 64, ...: earlier ones see none of these keys
  floatX* dsb = dS + (size_t(blockIdx.z) * NH + blockIdx.y) * tc_ds_tiles(T) * kTcRows * kTcRows;
  for (int j = 0; j < ntiles; j++) {
    const int qt = blockIdx.x + j;
    // this lane's first element of the tile's dS^T: row (key) 16 warp + g, column (query) 2t
    floatX* dst =
        dsb + (size_t(qt) * (qt + 1) / 2 + blockIdx.x) * kTcRows * kTcRows + (warp * 16 + g) * kTcRows + 2 * t;
#pragma unroll 1
    for (int s0 = 0; s0 < kTcRows; s0 += kTcSlab) {  // queries q0 .. q0 + kTcSlab - 1 of the tile
      const int q0 = qt * kTcRows + s0;
      if (j || s0) __syncthreads();  // every warp is done with the previous slab
      tc_load_tile<HS, kTcSlab>(Qs, base, 3 * C, q0, T, hs, vec);
      tc_load_tile<HS, kTcSlab>(dOs, dbase, C, q0, T, hs, vec);
      for (int i = threadIdx.x; i < kTcSlab; i += blockDim.x) {
        const bool ok = q0 + i < T;
        Ls[i] = ok ? lse[stats + q0 + i] : 0.0f;
        Ds[i] = ok ? Dd[stats + q0 + i] : 0.0f;
      }
      __syncthreads();
#pragma unroll 1
      for (int c0 = 0; c0 < kTcSlab; c0 += NQ) {  // queries q0 + c0 .. q0 + c0 + NQ - 1
        const floatX* Qc = Qs + c0 * S;
        const floatX* dOc = dOs + c0 * S;
        float p[NT][4] = {}, ds[NT][4] = {};
        tc_mma_abt<HS, NQ>(p, Ks + warp * 16 * S, Qc, lane);    // S^T
        tc_mma_abt<HS, NQ>(ds, Vs + warp * 16 * S, dOc, lane);  // dP^T
        // element e of tile nt is (key[e / 2], query q0 + c0 + 8 nt + 2t + e % 2)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            const int qi = c0 + nt * 8 + 2 * t + e % 2, q = q0 + qi;
            p[nt][e] = (q < T && key[e / 2] <= q) ? expf(p[nt][e] * scale - Ls[qi]) : 0.0f;
            ds[nt][e] = p[nt][e] * (ds[nt][e] - Ds[qi]);
          }
        tc_mma_pb<HS, NQ>(dv, p, dOc, lane);  // dV += P^T dO
        tc_mma_pb<HS, NQ>(dk, ds, Qc, lane);  // dK += dS^T Q
#pragma unroll
        for (int nt = 0; nt < NT; nt++)  // dS^T[key][query], the pairs of queries this lane holds
#pragma unroll
          for (int h = 0; h < 2; h++)
            *reinterpret_cast<uint32_t*>(dst + 8 * h * kTcRows + s0 + c0 + nt * 8) =
                pack2<floatX>(ds[nt][2 * h], ds[nt][2 * h + 1]);
      }
    }
  }
  floatX* dkbase = dqkv + size_t(blockIdx.z) * T * 3 * C + C + size_t(blockIdx.y) * hs;
  const float kmul[2] = {scale, scale}, vmul[2] = {1.0f, 1.0f};
  tc_store_rows<kAccumulate, HS>(dkbase, 3 * C, dk, kmul, k0 + warp * 16, T, hs, lane);
  tc_store_rows<kAccumulate, HS>(dkbase + C, 3 * C, dv, vmul, k0 + warp * 16, T, hs, lane);
}

// dQ of one 64-query tile from the dS^T tiles of the dkdv kernel: grid (ceil(T / 64), NH, B), block kTcThreads,
// dynamic shared memory tc_dq_smem_bytes<HS>(); the tiles run last (most keys) first. Warp w sums its 16 query rows
// over the key tiles 0 .. i in order. vec: attn::packs_fit(hs, qkv). kAccumulate: dQ added into dqkv, else stored.
template <int HS, bool kAccumulate, class floatX>
__global__ void __launch_bounds__(kTcThreads)
attention_tc_backward_dq_kernel(floatX* __restrict__ dqkv,       // (B, T, 3C), accumulated into or written
                                const floatX* __restrict__ dS,   // (B, NH, tc_ds_tiles(T), 64 keys, 64 queries)
                                const floatX* __restrict__ qkv,  // (B, T, 3C)
                                int T, int NH, int hs, float scale, bool vec) {
  constexpr int SD = kTcStride<64>;
  constexpr size_t DTILE = tc_tile_elems<64>;
  DYNAMIC_SMEM(floatX, smem);
  if (!tc_arch_runs<HS>()) return __trap();
  floatX* dSs = smem;
  floatX* Ks = smem + DTILE;
  const int qt = gridDim.x - 1 - blockIdx.x, q0 = qt * kTcRows, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int C = NH * hs;
  const floatX* kbase = qkv + size_t(blockIdx.z) * T * 3 * C + C + size_t(blockIdx.y) * hs;
  const floatX* dsrow = dS + ((size_t(blockIdx.z) * NH + blockIdx.y) * tc_ds_tiles(T) + size_t(qt) * (qt + 1) / 2) *
                                 kTcRows * kTcRows;  // the tiles (qt, 0), (qt, 1), ..., (qt, qt)
  float dq[HS / 8][4] = {};
  for (int j = 0; j <= qt; j++) {
    if (j) __syncthreads();  // every warp is done with key tile j - 1
    tc_load_tile<64>(dSs, dsrow + size_t(j) * kTcRows * kTcRows, kTcRows, 0, kTcRows, kTcRows, true);
    tc_load_tile<HS>(Ks, kbase, 3 * C, j * kTcRows, T, hs, vec);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTcRows / 16; kk++) {
      // A = dS (the warp's 16 queries x keys 16 kk ..) from dS^T rows: .trans, matrices {keys lo, hi} x {queries
      // lo, hi} in the order a[0..3] wants (queries lo keys lo, queries hi keys lo, queries lo keys hi, ...)
      uint32_t a[4];
      ldmatrix_x4_trans(a, dSs + (kk * 16 + lane / 16 * 8 + lane % 8) * SD + warp * 16 + (lane / 8) % 2 * 8);
      tc_mma_ab_k16<HS>(dq, a, Ks, kk, lane);  // dQ += dS K
    }
  }
  const float qmul[2] = {scale, scale};
  tc_store_rows<kAccumulate, HS>(dqkv + size_t(blockIdx.z) * T * 3 * C + size_t(blockIdx.y) * hs, 3 * C, dq, qmul,
                          q0 + warp * 16, T, hs, lane);
}

// Opts kernel in to smem bytes of dynamic shared memory when that is over the default 48 KiB.
template <class Kernel>
inline void tc_allow_smem(Kernel* kernel, size_t smem) {
  if (smem > 48 * 1024) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
}

// True when this GPU runs the tensor-core kernels for head size hs: sm_75 or newer (ldmatrix, fp16 mma; sm_70 takes
// the CUDA-core kernels), and the tiles within its shared memory per block (sm_75: 64 KiB). HS = 64 takes 27 KiB
// forward, 27.25 KiB in the dkdv kernel, 18 KiB in the dq kernel; sm_75 runs only HS = 64 (tc_arch_runs: HS = 128's
// dkdv kernel needs more than sm_75's 255 registers a thread and spills).
inline bool attention_tc_fits(int hs) {
  int device = 0, optin = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const int cc = major * 10 + minor;
  if (cc < 75 || (cc < 80 && hs > 64)) return false;  // as tc_arch_runs compiles
  size_t need = 0;
  dispatch_head_size(hs, [&](auto HSc) {
    constexpr int HS = decltype(HSc)::value;
    need = std::max({tc_smem_bytes<HS>(), tc_bwd_smem_bytes<HS>(), tc_dq_smem_bytes<HS>()});
  });
  return need <= size_t(optin);
}

template <class floatX>
inline void attention_tc_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int C, int NH,
                                 cudaStream_t stream) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  const bool vec = attn::packs_fit<floatX>(hs, out, qkv);
  const dim3 grid(ceil_div(T, kTcRows), NH, B);
  dispatch_head_size(hs, [&](auto HSc) {
    constexpr int HS = decltype(HSc)::value;
    constexpr size_t smem = tc_smem_bytes<HS>();
    tc_allow_smem(attention_tc_forward_kernel<HS, floatX>, smem);
    LAUNCH((attention_tc_forward_kernel<HS, floatX>), grid, kTcThreads, smem, stream, out, lse, qkv, T, NH, hs, scale,
           vec);
  });
  CUDA_CHECK_LAUNCH();
}

// Floats of scratch attention_tc_backward takes: D (B NH T, rounded up to a 16-byte multiple), then the dS^T tiles
// (B NH tc_ds_tiles(T) 64 x 64 16-bit values).
inline size_t attention_tc_scratch_floats(int B, int T, int NH) {
  return (size_t(B) * NH * T + 3) / 4 * 4 + size_t(B) * NH * tc_ds_tiles(T) * kTcRows * kTcRows / 2;
}

// out, lse: what attention_tc_forward produced for this qkv. scratch: attention_tc_scratch_floats(B, T, NH) floats,
// 16-byte aligned. accumulate: dqkv += the gradient; else dqkv = the gradient (every element is written: no clear).
template <class floatX>
inline void attention_tc_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out,
                                  const float* lse, float* scratch, int B, int T, int C, int NH, bool accumulate,
                                  cudaStream_t stream) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(float(hs));
  float* D = scratch;
  floatX* dS = reinterpret_cast<floatX*>(scratch + (size_t(B) * NH * T + 3) / 4 * 4);
  attention_backward_dot(D, dout, out, B, T, C, NH, stream);
  const dim3 grid(ceil_div(T, kTcRows), NH, B);
  auto launch = [&](auto HSc, auto AccC) {
    constexpr int HS = decltype(HSc)::value;
    constexpr bool kAcc = decltype(AccC)::value;
    tc_allow_smem(attention_tc_backward_dkdv_kernel<HS, kAcc, floatX>, tc_bwd_smem_bytes<HS>());
    tc_allow_smem(attention_tc_backward_dq_kernel<HS, kAcc, floatX>, tc_dq_smem_bytes<HS>());
    LAUNCH((attention_tc_backward_dkdv_kernel<HS, kAcc, floatX>), grid, kTcThreads, tc_bwd_smem_bytes<HS>(), stream,
           dqkv, dS, dout, qkv, lse, D, T, NH, hs, scale, attn::packs_fit<floatX>(hs, dout, qkv));
    CUDA_CHECK_LAUNCH();
    LAUNCH((attention_tc_backward_dq_kernel<HS, kAcc, floatX>), grid, kTcThreads, tc_dq_smem_bytes<HS>(), stream,
           dqkv, dS, qkv, T, NH, hs, scale, attn::packs_fit<floatX>(hs, qkv));
    CUDA_CHECK_LAUNCH();
  };
  dispatch_head_size(hs, [&](auto HSc) {
    if (accumulate) launch(HSc, std::true_type());
    else launch(HSc, std::false_type());
  });
}

}  // namespace gpt2::cuda
