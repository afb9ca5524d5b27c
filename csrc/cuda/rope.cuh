// Rotary position embeddings (RoFormer; Llama's rotate-half layout) on the q and k heads of the attention input
// qkv (B, T, 3C), in place; v untouched. Head size HS = C / NH, h = HS / 2; the pair (i, i + h) of a head at
// position p = pos0 + t is rotated by the angle p * base^(-2i / HS), i < h:
//   forward:  y_i = x_i cos - x_{i+h} sin,   y_{i+h} = x_{i+h} cos + x_i sin
//   backward: the transpose (the inverse rotation) of the gradient, in place on dqkv's q and k parts:
//             dx_i = dy_i cos + dy_{i+h} sin,   dx_{i+h} = dy_{i+h} cos - dy_i sin   (written, not accumulated)
// The angles' cos and sin come from a table (rope_table: maxT rows of h cos values then h sin values, fp32),
// computed once in double precision and rounded once: fp32 angles p * f lose up to p * 2^-24 radians (6e-5 at
// p = 1024), which would be most of the error budget of an fp32 model.
// Storage type floatX (float, bf16 or fp16); rotations in fp32 registers, each value rounded once when stored.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

// ----------------------------------------------------------------------------------------- kernels
// One thread per (position, i) of the table.
constexpr int kRopeBlock = 256;  // threads per block of this file's kernels (launch bounds)
__global__ void __launch_bounds__(kRopeBlock) rope_table_kernel(float* __restrict__ table,  // (maxT, 2, h): cos then sin per position
                                  int maxT, int h, double base) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= maxT * h) return;
  const int p = idx / h, i = idx % h;
  const double angle = double(p) * pow(base, -double(i) / double(h));  // base^(-2i / HS), HS = 2h
  table[size_t(p) * 2 * h + i] = float(cos(angle));
  table[size_t(p) * 2 * h + h + i] = float(sin(angle));
}

// vec (h % kVec<floatX> == 0, qkv 16-byte aligned): one thread rotates K pairs (i .. i + K - 1 with their
// partners), moving Vec<floatX>; otherwise one pair per thread. Threads in order of (b, t, head of q then k, i).
// sign: +1 forward, -1 backward (the inverse rotation).
template <class floatX>
__global__ void __launch_bounds__(kRopeBlock) rope_kernel(floatX* qkv,                        // (B, T, 3C), q and k parts in place
                            const float* __restrict__ table,    // (maxT, 2, h)
                            int BT, int T, int C, int NH, int pos0, float sign, bool vec,
                            const int32_t* __restrict__ pos = nullptr) {  // (B): row (b, t) at pos[b] + t (KV decode)
  constexpr int K = kVec<floatX>;
  const int HS = C / NH, h = HS / 2;
  const int per_head = vec ? h / K : h;  // threads per head
  const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= size_t(BT) * 2 * NH * per_head) return;
  const int j = int(idx % per_head);
  const size_t rest = idx / per_head;
  const int head = int(rest % (2 * NH));  // q's heads, then k's (k starts at C, right after q)
  const size_t bt = rest / (2 * NH);
  const int p = (pos ? pos[bt / T] : pos0) + int(bt % T);
  floatX* x = qkv + bt * 3 * C + size_t(head) * HS;
  const float* cs = table + size_t(p) * 2 * h;
  const float* sn = cs + h;
  if (vec) {
    using V = Vec<floatX>;
    const int i = j * K;
    V a = V::load(x + i), b = V::load(x + h + i);
#pragma unroll
    for (int k = 0; k < K; k++) {
      const float c = cs[i + k], s = sign * sn[i + k], x1 = a.f(k), x2 = b.f(k);
      a.set(k, x1 * c - x2 * s);
      b.set(k, x2 * c + x1 * s);
    }
    a.store(x + i);
    b.store(x + h + i);
  } else {
    const float c = cs[j], s = sign * sn[j], x1 = load_f(x[j]), x2 = load_f(x[h + j]);
    x[j] = store_t<floatX>(x1 * c - x2 * s);
    x[h + j] = store_t<floatX>(x2 * c + x1 * s);
  }
}

// ----------------------------------------------------------------------------------------- launchers
// Floats of the table for maxT positions of head size HS.
inline size_t rope_table_floats(int maxT, int HS) { return size_t(maxT) * size_t(HS / 2) * 2; }

inline void rope_table(float* table, int maxT, int HS, double base, cudaStream_t stream) {
  const int h = HS / 2;
  if (maxT <= 0 || h <= 0) return;
  LAUNCH(rope_table_kernel, ceil_div(size_t(maxT) * h, kRopeBlock), kRopeBlock, 0, stream, table, maxT, h, base);
  CUDA_CHECK_LAUNCH();
}

// positions pos0 .. pos0 + T - 1 (pos0 + T <= the table's maxT); HS = C / NH even
template <class floatX>
void rope_apply(floatX* qkv, const float* table, int B, int T, int C, int NH, int pos0, bool backward,
                cudaStream_t stream, const int32_t* pos = nullptr) {
  const int BT = B * T, h = C / NH / 2;
  if (BT <= 0 || h <= 0) return;
  const bool vec = h % kVec<floatX> == 0 && aligned16(qkv);
  const size_t n = size_t(BT) * 2 * NH * (vec ? h / kVec<floatX> : h);
  LAUNCH(rope_kernel<floatX>, ceil_div(n, kRopeBlock), kRopeBlock, 0, stream, qkv, table, BT, T, C, NH, pos0,
         backward ? -1.0f : 1.0f, vec, pos);
  CUDA_CHECK_LAUNCH();
}

template <class floatX>
void rope_forward(floatX* qkv,          // (B, T, 3C), q and k rotated in place
                  const float* table,   // rope_table
                  int B, int T, int C, int NH, int pos0, cudaStream_t stream) {
  rope_apply(qkv, table, B, T, C, NH, pos0, false, stream);
}

// KV-cache decode: row (b, t) at position pos[b] + t (pos: B ints in device memory; the table covers them)
template <class floatX>
void rope_forward_at(floatX* qkv, const float* table, const int32_t* pos, int B, int T, int C, int NH,
                     cudaStream_t stream) {
  rope_apply(qkv, table, B, T, C, NH, 0, false, stream, pos);
}

template <class floatX>
void rope_backward(floatX* dqkv,         // (B, T, 3C), q and k parts rotated back in place
                   const float* table,   // rope_table
                   int B, int T, int C, int NH, int pos0, cudaStream_t stream) {
  rope_apply(dqkv, table, B, T, C, NH, pos0, true, stream);
}

}  // namespace gpt2::cuda
