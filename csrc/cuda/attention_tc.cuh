// Causal multi-head self-attention forward on tensor cores, FlashAttention-2 style, for 16-bit storage
// (__nv_bfloat16 on sm_80+; the same code serves __half). Layouts and contract as attention.cuh: qkv (B, T, 3C),
// out (B, T, C), lse (B, NH, T) = logsumexp over keys t2 <= t of s = scale q.k;
//   out_t = sum_{t2 <= t} exp(s_{t,t2} - lse_t) v_t2.
// One block of 4 warps per (64-query tile, head, batch); warp w owns query rows 16w .. 16w + 15 of the tile.
// S = Q K^T and O += P V run as mma.sync m16n8k16 (16-bit inputs, fp32 accumulate, cuda/mma.cuh) with operands
// from shared memory through ldmatrix (K rows as B^T: no transpose; V rows: .trans). The online softmax runs on
// the S fragments in registers (each lane holds rows g, g + 8 of its warp's 16, a quad of lanes shares a row:
// row max by two xor-shuffles); P is rounded to the storage type for the P V product (as FlashAttention-2), the
// row sum l stays fp32. K and V tiles are double-buffered: tile j + 1 is loaded while tile j is computed, one
// barrier per tile. Shared rows are padded by 8 elements (16 bytes) so that ldmatrix's eight row reads hit eight
// different bank groups. Head sizes up to HS (64 or 128) run zero-padded.
// The backward stays attention.cuh's (it reads this lse; D from the stored out).
#pragma once
#include "cuda/attention.cuh"  // dispatch_head_size, the backward
#include "cuda/attention_common.cuh"
#include "cuda/mma.cuh"

namespace gpt2::cuda {

constexpr int kTcRows = 64;      // query rows per block (16 per warp) = key rows per tile
constexpr int kTcThreads = 128;  // 4 warps

template <int HS>
constexpr int kTcStride = HS + 8;  // shared row stride (elements)
template <int HS>
constexpr size_t tc_smem_bytes() {  // Q, 2 K, 2 V tiles of 16-bit elements
  return size_t(5) * kTcRows * kTcStride<HS> * 2;
}

// Rows r0 .. r0 + 63 of src (dims 0 .. HS - 1; 0 outside [0, T) x [0, hs)) into a shared tile.
template <int HS, class floatX>
__device__ inline void tc_load_tile(floatX* tile, const floatX* src, int stride, int r0, int T, int hs, bool vec) {
  constexpr int S = kTcStride<HS>, N = attn::Pack<floatX>::N;
  if (vec) {
    for (int idx = threadIdx.x; idx < kTcRows * HS / N; idx += blockDim.x) {
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
    for (int idx = threadIdx.x; idx < kTcRows * HS; idx += blockDim.x) {
      const int r = idx / HS, d = idx % HS, row = r0 + r;
      tile[r * S + d] = (row < T && d < hs) ? src[size_t(row) * stride + d] : attn::from_float<floatX>(0.0f);
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
  constexpr int S = kTcStride<HS>, KT = HS / 16, NT = kTcRows / 8;  // k-steps over dims, 8-key tiles
  DYNAMIC_SMEM(floatX, smem);
  floatX* Qs = smem;
  floatX* Ks[2] = {smem + kTcRows * S, smem + 2 * kTcRows * S};
  floatX* Vs[2] = {smem + 3 * kTcRows * S, smem + 4 * kTcRows * S};
  const int q0 = blockIdx.x * kTcRows, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int C = NH * hs;
  const floatX* base = qkv + size_t(blockIdx.z) * T * 3 * C + size_t(blockIdx.y) * hs;
  tc_load_tile<HS>(Qs, base, 3 * C, q0, T, hs, vec);
  tc_load_tile<HS>(Ks[0], base + C, 3 * C, 0, T, hs, vec);
  tc_load_tile<HS>(Vs[0], base + 2 * C, 3 * C, 0, T, hs, vec);
  __syncthreads();
  uint32_t qf[KT][4];  // this warp's 16 query rows as A fragments, one per 16 dims
#pragma unroll
  for (int ks = 0; ks < KT; ks++) ldmatrix_x4(qf[ks], Qs + (warp * 16 + lane % 16) * S + ks * 16 + lane / 16 * 8);
  float o[HS / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8: running max, this lane's sum
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const int ntiles = (min(T - 1, q0 + kTcRows - 1)) / kTcRows + 1;
  for (int j = 0; j < ntiles; j++) {
    const int buf = j & 1, k0 = j * kTcRows;
    if (j + 1 < ntiles) {  // the other buffer was released by the barrier ending the previous tile
      tc_load_tile<HS>(Ks[buf ^ 1], base + C, 3 * C, k0 + kTcRows, T, hs, vec);
      tc_load_tile<HS>(Vs[buf ^ 1], base + 2 * C, 3 * C, k0 + kTcRows, T, hs, vec);
    }
    float s[NT][4] = {};
#pragma unroll
    for (int ks = 0; ks < KT; ks++)
#pragma unroll
      for (int np = 0; np < NT / 2; np++) {  // keys 16 np .. 16 np + 15: matrices {keys lo, hi} x {dims lo, hi}
        uint32_t r[4];
        ldmatrix_x4(r, Ks[buf] + (np * 16 + lane / 16 * 8 + lane % 8) * S + ks * 16 + (lane / 8) % 2 * 8);
        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        mma_m16n8k16<floatX>(s[2 * np], qf[ks], b0);
        mma_m16n8k16<floatX>(s[2 * np + 1], qf[ks], b1);
      }
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
    // O += P V: P's C fragments of key tiles 2kk, 2kk + 1 are the A fragment of keys 16kk .. 16kk + 15
#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
      const uint32_t pa[4] = {pack2<floatX>(s[2 * kk][0], s[2 * kk][1]), pack2<floatX>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<floatX>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<floatX>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < HS / 16; dp++) {  // dims 16 dp ..: matrices {keys lo, hi} x {dims lo, hi}, transposed
        uint32_t r[4];
        ldmatrix_x4_trans(r, Vs[buf] + (kk * 16 + (lane / 8) % 2 * 8 + lane % 8) * S + dp * 16 + lane / 16 * 8);
        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        mma_m16n8k16<floatX>(o[2 * dp], pa, b0);
        mma_m16n8k16<floatX>(o[2 * dp + 1], pa, b1);
      }
    }
    __syncthreads();  // every warp is done with buffer buf (refilled next tile) and tile j + 1 is complete
  }
  floatX* obase = out + size_t(blockIdx.z) * T * C + size_t(blockIdx.y) * hs;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
    if (row[h] >= T) continue;
    const float inv = 1.0f / l[h];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++)
#pragma unroll
      for (int c = 0; c < 2; c++) {
        const int d = dt * 8 + 2 * t + c;
        if (d < hs) obase[size_t(row[h]) * C + d] = attn::from_float<floatX>(o[dt][2 * h + c] * inv);
      }
    if (t == 0) lse[(size_t(blockIdx.z) * NH + blockIdx.y) * T + row[h]] = m[h] + logf(l[h]);
  }
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
    auto* kernel = attention_tc_forward_kernel<HS, floatX>;
    if (smem > 48 * 1024) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    LAUNCH((attention_tc_forward_kernel<HS, floatX>), grid, kTcThreads, smem, stream, out, lse, qkv, T, NH, hs, scale,
           vec);
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
