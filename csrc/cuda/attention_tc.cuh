// Causal multi-head self-attention, forward and backward, on tensor cores, with FlashAttention-2's structure, for
// 16-bit storage (__nv_bfloat16 on sm_80+; the same code serves __half, and sm_75's fp16 m16n8k8). Layouts and
// contract as attention.cuh: qkv (B, T, 3C), out (B, T, C), lse (B, NH, T) = logsumexp over keys t2 <= t of
// s = scale q.k;   out_t = sum_{t2 <= t} exp(s_{t,t2} - lse_t) v_t2.
// Products are mma.sync m16n8k16 (16-bit inputs, fp32 accumulate, cuda/mma.cuh) with operands from shared memory
// through ldmatrix (K rows as B^T: no transpose; V rows: .trans); fragments: g = lane / 4, t = lane % 4, a lane holds
// rows g, g + 8 of its 16 and columns 2t, 2t + 1 of each 8.
//
// Forward (split-Q: each warp owns its query rows, no reduction across warps): one block of 4 warps per (query tile,
// head, batch), 128 queries for head size 64 (32 rows a warp: each K / V fragment feeds two mma) or 64 for 128
// (16 rows a warp: its O accumulator is twice as large). K and V come in 64-key tiles through 16-byte cp.async
// (cuda/cp_async.cuh) into swizzled shared memory (tc_sw: no padding, no bank conflicts for ldmatrix or the
// copies), double-buffered on sm_80+: tile j + 1's K and V are in flight while tile j multiplies (one barrier per
// tile). The online softmax runs on the S fragments in registers in base 2 (exp2, scale log2(e) folded into one
// multiply); P is rounded to the storage type and used in registers as the A operand of P V (as FlashAttention-2),
// the row sums stay fp32, and O is normalised once at the end; lse is stored (base e) for the backward. Causal:
// only a tile that reaches past a warp's first row is masked, a warp skips the tiles wholly after its rows, and
// the tiles after the block's last row are never loaded.
//
// Backward (FlashAttention-2's products, made deterministic without float atomics), with D = rowsum(dout * out)
// from attention.cuh's dot kernel in its own pass:
//   dkdv kernel, one block per 64-key tile (warp w: keys 16w ..), the key-tile outer loop: the query rows at or after
//     the tile stream through in slabs of 32 (Q, dO, and their lse and D), double-buffered with cp.async like the
//     forward's K / V; per slab
//     S^T = K Q^T, P^T = exp2(scale log2(e) S^T - log2(e) lse), dP^T = V dO^T, dS^T = P^T (dP^T - D);
//     dV += P^T dO, dK += dS^T Q; and dS^T, rounded to the storage type (as for its dK product), is stored to a
//     scratch tile per (query tile, key tile) pair;
//   dq kernel, one block per 64-query tile, summing over the key tiles up to the diagonal in order: dQ += dS K,
//     dS read back from the scratch (the value the dK product used, so nothing is recomputed), the dS and K tiles
//     double-buffered with cp.async.
// Five T x T x hs products (4 + 1), FlashAttention-2's count, with bit-reproducible gradients under any schedule:
// each dQ row is one block's sum in a fixed order (deterministic=True needs nothing else; an atomic dQ would save
// the scratch's 2 bytes per causal (query, key) pair each way, and is not built). Everything but P and dS, lse and D
// included, stays fp32; dK, dV, dQ are added into dqkv once, in fp32, rounded once.
// Head sizes up to HS (64 or 128) run zero-padded. Below sm_80 (no cp.async) every kernel keeps one buffer of each
// tile (kStages = 1): the same code with plain loads, and more blocks per SM in sm_75's 64 KiB of shared memory.
#pragma once
#include "cuda/attention.cuh"  // dispatch_head_size, attention_backward_dot
#include "cuda/attention_common.cuh"
#include "cuda/cp_async.cuh"
#include "cuda/mma.cuh"

#include <algorithm>

namespace gpt2::cuda {

constexpr int kTcRows = 64;      // keys per tile; queries per dS^T tile and per dq block
constexpr int kTcThreads = 128;  // 4 warps
constexpr int kTcSlab = 32;      // query rows the dkdv kernel streams at a time
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
// Backward blocks per SM that the register budget is sized for (__launch_bounds__): head size 64 fits 128 registers
// a thread (4 blocks of 4 warps) on sm_80+; 128 gets 255 (2 blocks: its dK, dV accumulators alone take 128), and so
// does sm_75 (its fp16 m16n8k16 is two m16n8k8, which needs more than 128 without spilling; 64K registers, 64 KiB of
// shared memory: 2 blocks either way).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kTcSm75 = true;
#else
constexpr bool kTcSm75 = false;
#endif
template <int HS>
constexpr int kTcBwdMinBlocks = HS > 64 || kTcSm75 ? 2 : 4;
// occupancy(attention_tc_backward_dkdv_kernel): >= 8 warps/SM on sm_80 sm_90 with 66048 B dynamic smem (HS = 128)
// occupancy(attention_tc_backward_dq_kernel): >= 8 warps/SM on sm_80 sm_90 with 49152 B dynamic smem (HS = 128)

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

// dS^T tiles of the backward: one 64 x 64 tile of floatX per (query tile i, key tile j <= i) of each (b, h), at
// tile index i (i + 1) / 2 + j.
__host__ __device__ inline size_t tc_ds_tiles(int T) {
  const size_t n = (size_t(T) + kTcRows - 1) / kTcRows;
  return n * (n + 1) / 2;
}

// ---------------------------------------------------------------------------------- forward (FlashAttention-2)
// Geometry: 4 warps; each warp owns kMFrags 16-row MMA fragments of queries (32 rows for HS = 64: every K / V
// fragment loaded from shared memory feeds two mma; 16 for HS = 128, whose O accumulator is twice as large), so a
// block takes 128 (HS = 64) or 64 (HS = 128) queries, against 64-key tiles.
template <int HS>
struct TcFwd {
  static constexpr int kMFrags = HS > 64 ? 1 : 2;
  static constexpr int kRows = 4 * 16 * kMFrags;  // query rows per block
  static constexpr int kKeys = 64;                // keys per K / V tile
};
// Shared memory: the Q tile, then kStages (K tile, V tile) pairs, all swizzled (tc_sw), no padding.
template <int HS, int kStages>
constexpr size_t tc_fwd_smem_bytes() {
  return size_t(TcFwd<HS>::kRows + 2 * kStages * TcFwd<HS>::kKeys) * HS * 2;
}
// Blocks per SM the forward's register budget is sized for (__launch_bounds__): 2 (8 warps, 255 registers a thread
// at most); shared memory allows 2 or more on sm_80 / sm_90 (48 KiB for HS = 64, 80 KiB for HS = 128).
constexpr int kTcFwdMinBlocks = 2;
// occupancy(attention_tc_forward_kernel): >= 8 warps/SM on sm_80 sm_90 with 81920 B dynamic smem (HS = 128)

// Element offset of dims 8c .. 8c + 7 of row r in a swizzled tile of HS-element rows: the 16-byte chunk c of row r
// sits at chunk c ^ (r % 8) of the row. The 8 rows an ldmatrix reads at one logical chunk, and the 8 chunks a
// quarter-warp's cp.async writes, then fall in 8 different 16-byte bank groups, without padding (HS >= 64: 8 chunks
// or more per row).
template <int HS>
__host__ __device__ constexpr int tc_sw(int r, int c) {
  return r * HS + ((c ^ (r & 7)) << 3);
}

// Issues the copy of rows r0 .. r0 + ROWS - 1 of src (row stride `stride` elements; dims < hs, rows < T, zeros
// elsewhere) into a swizzled tile: cp.async 16-byte chunks when vec (attn::packs_fit: hs a multiple of 8, 16-byte
// aligned buffers), else plain element copies (which are complete when this returns). The caller commits.
template <int HS, int ROWS, class floatX>
__device__ inline void tc_tile_async(floatX* tile, const floatX* src, int stride, int r0, int T, int hs, bool vec) {
  constexpr int CH = HS / 8;
  if (vec) {
#pragma unroll
    for (int i = 0; i < ROWS * CH / kTcThreads; i++) {
      const int idx = threadIdx.x + i * kTcThreads, r = idx / CH, c = idx % CH, row = r0 + r;
      const bool ok = row < T && c * 8 < hs;
      cp_async_16(tile + tc_sw<HS>(r, c), ok ? src + size_t(row) * stride + c * 8 : src, ok);
    }
  } else {
    for (int idx = threadIdx.x; idx < ROWS * HS; idx += kTcThreads) {
      const int r = idx / HS, d = idx % HS, row = r0 + r;
      tile[tc_sw<HS>(r, d / 8) + d % 8] =
          (row < T && d < hs) ? src[size_t(row) * stride + d] : attn::from_float<floatX>(0.0f);
    }
  }
}

// grid (ceil(T / TcFwd<HS>::kRows), NH, B), block kTcThreads, dynamic shared memory tc_fwd_smem_bytes<HS, kStages>().
// Query tiles run last first (the causal ones with the most key tiles start earliest). scale_log2 = scale log2(e):
// the softmax runs in base 2 (exp2), lse is stored in base e. vec: attn::packs_fit(hs, out, qkv).
// kStages = 2 (sm_80+): K and V of tile j + 1 are issued right after the barrier that opens tile j, into the other
// buffer, so both loads are in flight during all of tile j's products (one barrier per tile). kStages = 1 (sm_75:
// 64 KiB of shared memory per SM, and no cp.async, so a second buffer would only cost blocks per SM): the next
// tile's load follows a second barrier.
template <int HS, int kStages, class floatX>
__global__ void __launch_bounds__(kTcThreads, kTcFwdMinBlocks)
attention_tc_forward_kernel(floatX* __restrict__ out,        // (B, T, C)
                            float* __restrict__ lse,         // (B, NH, T)
                            const floatX* __restrict__ qkv,  // (B, T, 3C)
                            int T, int NH, int hs, float scale_log2, bool vec) {
  static_assert(sizeof(floatX) == 2, "tensor-core attention takes 16-bit storage");
  using G = TcFwd<HS>;
  constexpr int MF = G::kMFrags, BQ = G::kRows, BK = G::kKeys, NT = BK / 8, DT = HS / 8;
  DYNAMIC_SMEM(floatX, smem);
  if (!tc_arch_runs<HS>()) return __trap();
  floatX* Qs = smem;
  floatX* KV = smem + BQ * HS;  // stage s: K at KV + 2 s BK HS, V after it
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4, wr = warp * 16 * MF, row0 = q0 + wr;  // the warp's first row (tile, global)
  const int C = NH * hs;
  const floatX* base = qkv + size_t(blockIdx.z) * T * 3 * C + size_t(blockIdx.y) * hs;
  const int nkt = (min(T, q0 + BQ) - 1) / BK + 1;  // key tiles at or before the block's last row: none above it
  tc_tile_async<HS, BQ>(Qs, base, 3 * C, q0, T, hs, vec);
  tc_tile_async<HS, BK>(KV, base + C, 3 * C, 0, T, hs, vec);
  tc_tile_async<HS, BK>(KV + BK * HS, base + 2 * C, 3 * C, 0, T, hs, vec);
  cp_async_commit();
  float o[MF][DT][4] = {};
  float m[MF][2], l[MF][2];  // rows g, g + 8 of each fragment: running max (base 2, scaled), this lane's partial sum
#pragma unroll
  for (int mf = 0; mf < MF; mf++) m[mf][0] = m[mf][1] = -INFINITY, l[mf][0] = l[mf][1] = 0.0f;
  for (int j = 0; j < nkt; j++) {
    const int k0 = j * BK;
    const floatX* Ks = KV + (j % kStages) * 2 * BK * HS;
    const floatX* Vs = Ks + BK * HS;
    if constexpr (kStages == 1) {
      if (j) {
        __syncthreads();  // every warp is done with tile j - 1
        tc_tile_async<HS, BK>(KV, base + C, 3 * C, k0, T, hs, vec);
        tc_tile_async<HS, BK>(KV + BK * HS, base + 2 * C, 3 * C, k0, T, hs, vec);
        cp_async_commit();
      }
    }
    cp_async_wait<0>();  // this thread's copies of tile j (and Q) landed
    __syncthreads();     // everyone's did; every warp is done with tile j - 1, whose buffer the next copy reuses
    if constexpr (kStages == 2) {
      if (j + 1 < nkt) {
        floatX* nxt = KV + ((j + 1) % 2) * 2 * BK * HS;
        tc_tile_async<HS, BK>(nxt, base + C, 3 * C, k0 + BK, T, hs, vec);
        tc_tile_async<HS, BK>(nxt + BK * HS, base + 2 * C, 3 * C, k0 + BK, T, hs, vec);
        cp_async_commit();
      }
    }
    if (k0 > row0 + 16 * MF - 1) continue;  // causal: every key of the tile is after every row of this warp
    // S = Q K^T: element e of s[mf][nt] is (row row0 + 16 mf + g + 8 (e / 2), key k0 + 8 nt + 2t + e % 2)
    float s[MF][NT][4] = {};
#pragma unroll
    for (int ks = 0; ks < HS / 16; ks++) {
      // Q's A fragments come from shared memory for each tile (as FlashAttention-2 does by default): keeping all of
      // them in registers would take 32 more a thread, over the 2-blocks-per-SM budget on sm_80
      uint32_t qa[MF][4];
#pragma unroll
      for (int mf = 0; mf < MF; mf++) ldmatrix_x4(qa[mf], Qs + tc_sw<HS>(wr + mf * 16 + lane % 16, ks * 2 + lane / 16));
#pragma unroll
      for (int np = 0; np < NT / 2; np++) {  // keys 16 np ..: matrices {keys lo, hi} x {dims lo, hi}
        uint32_t r[4];
        ldmatrix_x4(r, Ks + tc_sw<HS>(np * 16 + lane / 16 * 8 + lane % 8, ks * 2 + (lane / 8) % 2));
        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
        for (int mf = 0; mf < MF; mf++) {
          mma_m16n8k16<floatX>(s[mf][2 * np], qa[mf], b0);
          mma_m16n8k16<floatX>(s[mf][2 * np + 1], qa[mf], b1);
        }
      }
    }
    // online softmax in base 2; only a tile that reaches past the warp's first row is masked (the diagonal)
    const bool diag = k0 + BK - 1 > row0;
#pragma unroll
    for (int mf = 0; mf < MF; mf++) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float v = s[mf][nt][e] * scale_log2;
          if (diag && k0 + nt * 8 + 2 * t + e % 2 > row0 + mf * 16 + g + 8 * (e / 2)) v = -INFINITY;
          s[mf][nt][e] = v;
          mx[e / 2] = fmaxf(mx[e / 2], v);
        }
#pragma unroll
      for (int h = 0; h < 2; h++) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFullMask, mx[h], 2));
        // finite: every row sees key 0 in tile 0 (rows past T included: their keys are zero-filled), so the max
        // is finite from the first tile on, and exp2(-inf - m) = 0 rescales the empty start
        const float mnew = fmaxf(m[mf][h], mx[h]), corr = exp2f(m[mf][h] - mnew);
        l[mf][h] *= corr;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) o[mf][dt][2 * h] *= corr, o[mf][dt][2 * h + 1] *= corr;
        m[mf][h] = mnew;
      }
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          s[mf][nt][e] = exp2f(s[mf][nt][e] - m[mf][e / 2]);  // masked: exp2(-inf) = 0
          l[mf][e / 2] += s[mf][nt][e];
        }
    }
    // O += P V: P (rounded to floatX) stays in registers as the A operand; V through ldmatrix.trans
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
      uint32_t pa[MF][4];
#pragma unroll
      for (int mf = 0; mf < MF; mf++) {
        pa[mf][0] = pack2<floatX>(s[mf][2 * kk][0], s[mf][2 * kk][1]);
        pa[mf][1] = pack2<floatX>(s[mf][2 * kk][2], s[mf][2 * kk][3]);
        pa[mf][2] = pack2<floatX>(s[mf][2 * kk + 1][0], s[mf][2 * kk + 1][1]);
        pa[mf][3] = pack2<floatX>(s[mf][2 * kk + 1][2], s[mf][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < HS / 16; dp++) {  // dims 16 dp ..: matrices {keys lo, hi} x {dims lo, hi}, transposed
        uint32_t r[4];
        ldmatrix_x4_trans(r, Vs + tc_sw<HS>(kk * 16 + (lane / 8) % 2 * 8 + lane % 8, dp * 2 + lane / 16));
        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
        for (int mf = 0; mf < MF; mf++) {
          mma_m16n8k16<floatX>(o[mf][2 * dp], pa[mf], b0);
          mma_m16n8k16<floatX>(o[mf][2 * dp + 1], pa[mf], b1);
        }
      }
    }
  }
  // normalise once, store lse (base e: m ln 2 + ln l) and O
  floatX* obase = out + size_t(blockIdx.z) * T * C + size_t(blockIdx.y) * hs;
#pragma unroll
  for (int mf = 0; mf < MF; mf++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      float sum = l[mf][h];
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      const int row = row0 + mf * 16 + g + 8 * h;
      if (row >= T) continue;
      if (t == 0) lse[(size_t(blockIdx.z) * NH + blockIdx.y) * T + row] = m[mf][h] * kLn2 + logf(sum);
      const float inv = 1.0f / sum;
      floatX* p = obase + size_t(row) * C;
#pragma unroll
      for (int dt = 0; dt < DT; dt++) {
        const int d = dt * 8 + 2 * t;
        if (d >= hs) continue;
        const float v0 = o[mf][dt][2 * h] * inv, v1 = o[mf][dt][2 * h + 1] * inv;
        if (vec) {
          *reinterpret_cast<uint32_t*>(p + d) = pack2<floatX>(v0, v1);
        } else {
          p[d] = attn::from_float<floatX>(v0);
          if (d + 1 < hs) p[d + 1] = attn::from_float<floatX>(v1);
        }
      }
    }
}

// ---------------------------------------------------------------------------------- backward
// acc (16 x N) += A B^T over the head dims: A = rows ra .. ra + 15 of the swizzled tile As, B = rows
// rb .. rb + N - 1 of the swizzled tile Bs (as B^T: no transpose). Element e of acc[nt] is (row g + 8 (e / 2),
// column 8 nt + 2t + e % 2).
template <int HS, int N, class floatX>
__device__ inline void tc_mma_abt(float (&acc)[N / 8][4], const floatX* As, int ra, const floatX* Bs, int rb,
                                  int lane) {
#pragma unroll
  for (int ks = 0; ks < HS / 16; ks++) {
    uint32_t a[4];
    ldmatrix_x4(a, As + tc_sw<HS>(ra + lane % 16, ks * 2 + lane / 16));
#pragma unroll
    for (int np = 0; np < N / 16; np++) {  // columns 16 np ..: matrices {rows lo, hi} x {dims lo, hi}
      uint32_t r[4];
      ldmatrix_x4(r, Bs + tc_sw<HS>(rb + np * 16 + lane / 16 * 8 + lane % 8, ks * 2 + (lane / 8) % 2));
      const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
      mma_m16n8k16<floatX>(acc[2 * np], a, b0);
      mma_m16n8k16<floatX>(acc[2 * np + 1], a, b1);
    }
  }
}

// acc (16 x HS) += A B over the 16 rows rb .. rb + 15 of the swizzled tile Bs (loaded .trans): a = the A fragment of
// those 16 columns. Element e of acc[dt] is (row g + 8 (e / 2), dim 8 dt + 2t + e % 2).
template <int HS, class floatX>
__device__ inline void tc_mma_ab_k16(float (&acc)[HS / 8][4], const uint32_t (&a)[4], const floatX* Bs, int rb,
                                     int lane) {
#pragma unroll
  for (int dp = 0; dp < HS / 16; dp++) {  // dims 16 dp ..: matrices {rows lo, hi} x {dims lo, hi}, transposed
    uint32_t r[4];
    ldmatrix_x4_trans(r, Bs + tc_sw<HS>(rb + (lane / 8) % 2 * 8 + lane % 8, dp * 2 + lane / 16));
    const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
    mma_m16n8k16<floatX>(acc[2 * dp], a, b0);
    mma_m16n8k16<floatX>(acc[2 * dp + 1], a, b1);
  }
}

// acc (16 x HS) += P B: P (16 x N) in tc_mma_abt's accumulator layout, rounded to floatX (the C fragments of
// column tiles 2kk, 2kk + 1 are the A fragment of columns 16kk ..); B = rows rb .. rb + N - 1 of the swizzled Bs.
template <int HS, int N, class floatX>
__device__ inline void tc_mma_pb(float (&acc)[HS / 8][4], const float (&p)[N / 8][4], const floatX* Bs, int rb,
                                 int lane) {
#pragma unroll
  for (int kk = 0; kk < N / 16; kk++) {
    const uint32_t pa[4] = {pack2<floatX>(p[2 * kk][0], p[2 * kk][1]), pack2<floatX>(p[2 * kk][2], p[2 * kk][3]),
                            pack2<floatX>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                            pack2<floatX>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
    tc_mma_ab_k16<HS>(acc, pa, Bs, rb + kk * 16, lane);
  }
}

// dst[(r0 + g + 8h) stride + d] = (Accumulate: dst +) mul acc, this lane's elements of a tc_mma_pb accumulator
// (rows < T, dims < hs), added in fp32 and rounded once to floatX.
template <bool Accumulate, int HS, class floatX>
__device__ inline void tc_store_rows(floatX* dst, int stride, const float (&acc)[HS / 8][4], float mul, int r0, int T,
                                     int hs, int lane) {
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
        float v = acc[dt][2 * h + c] * mul;
        if constexpr (Accumulate) v += attn::to_float(p[d]);
        p[d] = attn::from_float<floatX>(v);
      }
  }
}

// Shared memory of the dkdv kernel: the K and V tiles, then per stage the Q and dO slabs (swizzled) and the slab's
// lse and D.
template <int HS>
__host__ __device__ constexpr size_t tc_bwd_stage_bytes() {
  return size_t(2 * kTcSlab * HS) * 2 + 2 * kTcSlab * sizeof(float);
}
template <int HS, int kStages>
constexpr size_t tc_bwd_smem_bytes() {
  return size_t(2 * kTcRows * HS) * 2 + kStages * tc_bwd_stage_bytes<HS>();
}
// The dq kernel: per stage a dS^T tile (64 x 64) and a K tile (64 x HS), swizzled.
template <int HS, int kStages>
constexpr size_t tc_dq_smem_bytes() {
  return size_t(kStages) * kTcRows * (64 + HS) * 2;
}

// Issues the copies of the slab of query rows q0 .. q0 + kTcSlab - 1: Q and dO rows (tc_tile_async), lse and D
// (4-byte cp.async, zeros past T).
template <int HS, class floatX>
__device__ inline void tc_bwd_slab_async(unsigned char* stage, const floatX* qbase, const floatX* dobase,
                                         const float* lse, const float* Dd, int C, int q0, int T, int hs, bool vec) {
  floatX* Qs = reinterpret_cast<floatX*>(stage);
  tc_tile_async<HS, kTcSlab>(Qs, qbase, 3 * C, q0, T, hs, vec);
  tc_tile_async<HS, kTcSlab>(Qs + kTcSlab * HS, dobase, C, q0, T, hs, vec);
  float* Ls = reinterpret_cast<float*>(Qs + 2 * kTcSlab * HS);
  if (threadIdx.x < 2 * kTcSlab) {
    const int i = threadIdx.x % kTcSlab;
    const bool ok = q0 + i < T;
    const float* src = threadIdx.x < kTcSlab ? lse : Dd;
    cp_async_4(Ls + threadIdx.x, ok ? src + q0 + i : src, ok);
  }
}

// dK, dV of one 64-key tile, and its dS^T tiles: grid (ceil(T / 64), NH, B), block kTcThreads, dynamic shared
// memory tc_bwd_smem_bytes<HS, kStages>(). The query rows k0 .. T - 1 stream through in slabs of kTcSlab rows,
// taken NQ queries at a time (S^T and dP^T of 16 x NQ per warp: 64 would not fit the register budget). kStages = 2:
// the next slab's copies are issued right after the barrier that opens this one. vec: attn::packs_fit(hs, dout, qkv).
// kAccumulate: dK, dV added into dqkv, else stored.
template <int HS, bool kAccumulate, int kStages, class floatX>
__global__ void __launch_bounds__(kTcThreads, kTcBwdMinBlocks<HS>)
attention_tc_backward_dkdv_kernel(floatX* __restrict__ dqkv,       // (B, T, 3C), accumulated into or written
                                  floatX* __restrict__ dS,         // (B, NH, tc_ds_tiles(T), 64 keys, 64 queries)
                                  const floatX* __restrict__ dout, // (B, T, C)
                                  const floatX* __restrict__ qkv,  // (B, T, 3C)
                                  const float* __restrict__ lse,   // (B, NH, T)
                                  const float* __restrict__ Dd,    // (B, NH, T)
                                  int T, int NH, int hs, float scale, bool vec) {
  constexpr int NQ = HS > 64 ? 32 : 16, NT = NQ / 8;  // 8-query tiles
  DYNAMIC_SMEM(floatX, smem);
  if (!tc_arch_runs<HS>()) return __trap();
  floatX* Ks = smem;
  floatX* Vs = smem + kTcRows * HS;
  unsigned char* stages = reinterpret_cast<unsigned char*>(Vs + kTcRows * HS);
  const int k0 = blockIdx.x * kTcRows, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int C = NH * hs;
  const floatX* base = qkv + size_t(blockIdx.z) * T * 3 * C + size_t(blockIdx.y) * hs;
  const floatX* dbase = dout + size_t(blockIdx.z) * T * C + size_t(blockIdx.y) * hs;
  const size_t stats = (size_t(blockIdx.z) * NH + blockIdx.y) * T;
  const float scale_log2 = scale * kLog2e;
  tc_tile_async<HS, kTcRows>(Ks, base + C, 3 * C, k0, T, hs, vec);
  tc_tile_async<HS, kTcRows>(Vs, base + 2 * C, 3 * C, k0, T, hs, vec);
  tc_bwd_slab_async<HS>(stages, base, dbase, lse + stats, Dd + stats, C, k0, T, hs, vec);
  cp_async_commit();
  float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  const int nsl = (T - k0 + kTcSlab - 1) / kTcSlab;  // query rows k0 ..: earlier ones see none of these keys
  floatX* dsb = dS + (size_t(blockIdx.z) * NH + blockIdx.y) * tc_ds_tiles(T) * kTcRows * kTcRows;
  for (int sl = 0; sl < nsl; sl++) {
    const int q0 = k0 + sl * kTcSlab, qt = q0 / kTcRows, s0 = q0 % kTcRows;
    if constexpr (kStages == 1) {
      if (sl) {
        __syncthreads();  // every warp is done with the previous slab
        tc_bwd_slab_async<HS>(stages, base, dbase, lse + stats, Dd + stats, C, q0, T, hs, vec);
        cp_async_commit();
      }
    }
    cp_async_wait<0>();  // this thread's copies of the slab (and of K, V) landed
    __syncthreads();     // everyone's did; every warp is done with the slab before, whose buffer the next reuses
    if constexpr (kStages == 2) {
      if (sl + 1 < nsl) {
        tc_bwd_slab_async<HS>(stages + (sl + 1) % 2 * tc_bwd_stage_bytes<HS>(), base, dbase, lse + stats, Dd + stats,
                              C, q0 + kTcSlab, T, hs, vec);
        cp_async_commit();
      }
    }
    const unsigned char* stage = stages + sl % kStages * tc_bwd_stage_bytes<HS>();
    const floatX* Qs = reinterpret_cast<const floatX*>(stage);
    const floatX* dOs = Qs + kTcSlab * HS;
    const float* Ls = reinterpret_cast<const float*>(dOs + kTcSlab * HS);
    const float* Ds = Ls + kTcSlab;
    // only a slab that starts inside this key tile (the diagonal) or runs past T is masked
    const bool mask = q0 < k0 + kTcRows || q0 + kTcSlab > T;
    // this lane's first element of the tile's dS^T: row (key) 16 warp + g, column (query) 2t
    floatX* dst =
        dsb + (size_t(qt) * (qt + 1) / 2 + blockIdx.x) * kTcRows * kTcRows + (warp * 16 + g) * kTcRows + 2 * t;
#pragma unroll 1
    for (int c0 = 0; c0 < kTcSlab; c0 += NQ) {  // queries q0 + c0 .. q0 + c0 + NQ - 1
      float p[NT][4] = {}, ds[NT][4] = {};
      tc_mma_abt<HS, NQ>(p, Ks, warp * 16, Qs, c0, lane);    // S^T
      tc_mma_abt<HS, NQ>(ds, Vs, warp * 16, dOs, c0, lane);  // dP^T
      // element e of tile nt is (key[e / 2], query q0 + c0 + 8 nt + 2t + e % 2)
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int qi = c0 + nt * 8 + 2 * t + e % 2, q = q0 + qi;
          float pv = exp2f(p[nt][e] * scale_log2 - Ls[qi] * kLog2e);
          if (mask && (q >= T || key[e / 2] > q)) pv = 0.0f;
          p[nt][e] = pv;
          ds[nt][e] = pv * (ds[nt][e] - Ds[qi]);
        }
      tc_mma_pb<HS, NQ>(dv, p, dOs, c0, lane);  // dV += P^T dO
      tc_mma_pb<HS, NQ>(dk, ds, Qs, c0, lane);  // dK += dS^T Q
#pragma unroll
      for (int nt = 0; nt < NT; nt++)  // dS^T[key][query], the pairs of queries this lane holds
#pragma unroll
        for (int h = 0; h < 2; h++)
          *reinterpret_cast<uint32_t*>(dst + 8 * h * kTcRows + s0 + c0 + nt * 8) =
              pack2<floatX>(ds[nt][2 * h], ds[nt][2 * h + 1]);
    }
  }
  floatX* dkbase = dqkv + size_t(blockIdx.z) * T * 3 * C + C + size_t(blockIdx.y) * hs;
  tc_store_rows<kAccumulate, HS>(dkbase, 3 * C, dk, scale, k0 + warp * 16, T, hs, lane);
  tc_store_rows<kAccumulate, HS>(dkbase + C, 3 * C, dv, 1.0f, k0 + warp * 16, T, hs, lane);
}

// dQ of one 64-query tile from the dS^T tiles of the dkdv kernel: grid (ceil(T / 64), NH, B), block kTcThreads,
// dynamic shared memory tc_dq_smem_bytes<HS, kStages>(); the tiles run last (most keys) first. Warp w sums its 16
// query rows over the key tiles 0 .. i in order; the dS^T and K tiles of key tile j + 1 are in flight while tile j
// multiplies (kStages = 2). vec: attn::packs_fit(hs, qkv). kAccumulate: dQ added into dqkv, else stored.
template <int HS, bool kAccumulate, int kStages, class floatX>
__global__ void __launch_bounds__(kTcThreads, kTcBwdMinBlocks<HS>)
attention_tc_backward_dq_kernel(floatX* __restrict__ dqkv,       // (B, T, 3C), accumulated into or written
                                const floatX* __restrict__ dS,   // (B, NH, tc_ds_tiles(T), 64 keys, 64 queries)
                                const floatX* __restrict__ qkv,  // (B, T, 3C)
                                int T, int NH, int hs, float scale, bool vec) {
  constexpr int STAGE = kTcRows * (64 + HS);  // elements: a dS^T tile, then a K tile
  DYNAMIC_SMEM(floatX, smem);
  if (!tc_arch_runs<HS>()) return __trap();
  const int qt = gridDim.x - 1 - blockIdx.x, q0 = qt * kTcRows, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int C = NH * hs;
  const floatX* kbase = qkv + size_t(blockIdx.z) * T * 3 * C + C + size_t(blockIdx.y) * hs;
  const floatX* dsrow = dS + ((size_t(blockIdx.z) * NH + blockIdx.y) * tc_ds_tiles(T) + size_t(qt) * (qt + 1) / 2) *
                                 kTcRows * kTcRows;  // the tiles (qt, 0), (qt, 1), ..., (qt, qt)
  const auto issue = [&](int j, floatX* st) {
    tc_tile_async<64, kTcRows>(st, dsrow + size_t(j) * kTcRows * kTcRows, kTcRows, 0, kTcRows, kTcRows, true);
    tc_tile_async<HS, kTcRows>(st + kTcRows * 64, kbase, 3 * C, j * kTcRows, T, hs, vec);
    cp_async_commit();
  };
  issue(0, smem);
  float dq[HS / 8][4] = {};
  for (int j = 0; j <= qt; j++) {
    if constexpr (kStages == 1) {
      if (j) {
        __syncthreads();  // every warp is done with key tile j - 1
        issue(j, smem);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (kStages == 2) {
      if (j < qt) issue(j + 1, smem + (j + 1) % 2 * STAGE);
    }
    const floatX* dSs = smem + j % kStages * STAGE;
    const floatX* Ks = dSs + kTcRows * 64;
#pragma unroll
    for (int kk = 0; kk < kTcRows / 16; kk++) {
      // A = dS (the warp's 16 queries x keys 16 kk ..) from dS^T rows: .trans, matrices {keys lo, hi} x {queries
      // lo, hi} in the order a[0..3] wants (queries lo keys lo, queries hi keys lo, queries lo keys hi, ...)
      uint32_t a[4];
      ldmatrix_x4_trans(a, dSs + tc_sw<64>(kk * 16 + lane / 16 * 8 + lane % 8, warp * 2 + (lane / 8) % 2));
      tc_mma_ab_k16<HS>(dq, a, Ks, kk * 16, lane);  // dQ += dS K
    }
  }
  tc_store_rows<kAccumulate, HS>(dqkv + size_t(blockIdx.z) * T * 3 * C + size_t(blockIdx.y) * hs, 3 * C, dq, scale,
                                 q0 + warp * 16, T, hs, lane);
}

// Opts kernel in to smem bytes of dynamic shared memory when that is over the default 48 KiB.
template <class Kernel>
inline void tc_allow_smem(Kernel* kernel, size_t smem) {
  if (smem > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
}

// Compute capability of the current device (major * 10 + minor).
inline int tc_compute_capability() {
  int device = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major * 10 + minor;
}
// Tile buffers of every kernel on a GPU of this capability: 2 where cp.async overlaps the next tile's load
// (sm_80+), else 1.
inline int tc_stages(int cc) { return cc >= 80 ? 2 : 1; }
// Calls f(std::integral_constant<int, kStages>) for this GPU.
template <class F>
inline void dispatch_stages(int cc, F&& f) {
  if (tc_stages(cc) == 2) f(std::integral_constant<int, 2>());
  else f(std::integral_constant<int, 1>());
}

// True when this GPU runs the tensor-core kernels for head size hs: sm_75 or newer (ldmatrix, fp16 mma; sm_70 takes
// the CUDA-core kernels), and the tiles within its shared memory per block (sm_75: 64 KiB). sm_75 runs only
// HS = 64 (tc_arch_runs: HS = 128's dkdv kernel needs more than sm_75's 255 registers a thread and spills).
inline bool attention_tc_fits(int hs) {
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int cc = tc_compute_capability();
  if (cc < 75 || (cc < 80 && hs > 64)) return false;  // as tc_arch_runs compiles
  size_t need = 0;
  dispatch_head_size(hs, [&](auto HSc) {
    constexpr int HS = decltype(HSc)::value;
    dispatch_stages(cc, [&](auto StagesC) {
      constexpr int kStages = decltype(StagesC)::value;
      need = std::max({tc_fwd_smem_bytes<HS, kStages>(), tc_bwd_smem_bytes<HS, kStages>(),
                       tc_dq_smem_bytes<HS, kStages>()});
    });
  });
  return need <= size_t(optin);
}

template <class floatX>
inline void attention_tc_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int C, int NH,
                                 cudaStream_t stream) {
  if (B <= 0 || T <= 0) return;
  const int hs = C / NH;
  const float scale_log2 = 1.0f / sqrtf(float(hs)) * kLog2e;
  const bool vec = attn::packs_fit<floatX>(hs, out, qkv);
  const int cc = tc_compute_capability();
  dispatch_head_size(hs, [&](auto HSc) {
    constexpr int HS = decltype(HSc)::value;
    const dim3 grid(ceil_div(T, TcFwd<HS>::kRows), NH, B);
    dispatch_stages(cc, [&](auto StagesC) {
      constexpr int kStages = decltype(StagesC)::value;
      constexpr size_t smem = tc_fwd_smem_bytes<HS, kStages>();
      tc_allow_smem(attention_tc_forward_kernel<HS, kStages, floatX>, smem);
      LAUNCH((attention_tc_forward_kernel<HS, kStages, floatX>), grid, kTcThreads, smem, stream, out, lse, qkv, T, NH,
             hs, scale_log2, vec);
    });
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
  const int cc = tc_compute_capability();
  auto launch = [&](auto HSc, auto AccC, auto StagesC) {
    constexpr int HS = decltype(HSc)::value, kStages = decltype(StagesC)::value;
    constexpr bool kAcc = decltype(AccC)::value;
    constexpr size_t bwd_smem = tc_bwd_smem_bytes<HS, kStages>(), dq_smem = tc_dq_smem_bytes<HS, kStages>();
    tc_allow_smem(attention_tc_backward_dkdv_kernel<HS, kAcc, kStages, floatX>, bwd_smem);
    tc_allow_smem(attention_tc_backward_dq_kernel<HS, kAcc, kStages, floatX>, dq_smem);
    LAUNCH((attention_tc_backward_dkdv_kernel<HS, kAcc, kStages, floatX>), grid, kTcThreads, bwd_smem, stream, dqkv,
           dS, dout, qkv, lse, D, T, NH, hs, scale, attn::packs_fit<floatX>(hs, dout, qkv));
    CUDA_CHECK_LAUNCH();
    LAUNCH((attention_tc_backward_dq_kernel<HS, kAcc, kStages, floatX>), grid, kTcThreads, dq_smem, stream, dqkv, dS,
           qkv, T, NH, hs, scale, attn::packs_fit<floatX>(hs, qkv));
    CUDA_CHECK_LAUNCH();
  };
  dispatch_head_size(hs, [&](auto HSc) {
    dispatch_stages(cc, [&](auto StagesC) {
      if (accumulate) launch(HSc, std::true_type(), StagesC);
      else launch(HSc, std::false_type(), StagesC);
    });
  });
}

}  // namespace gpt2::cuda
