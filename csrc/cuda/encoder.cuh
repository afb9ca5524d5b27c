// Token + position embedding, storage type floatX (float, bf16 or fp16; sums in fp32, one rounding to floatX):
//   forward:  out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]   (wpe null: no position embedding, as with rotary)
//   backward: dwpe[t,:] += sum_b dout[b,t,:] (unless dwpe is null);  dwte[v,:] += sum over positions (b,t) with inp[b,t] == v of dout[b,t,:]
//             (dwte, dwpe fp32 for either floatX)
// Backward is deterministic without float atomics: the positions are bucketed by token id on the host when the
// batch is uploaded (stable order; encoder_buckets), and one thread owns each (token, channel) output and sums its
// bucket in that order. The bucket count lives in device memory and the grid is fixed by B*T alone, so backward
// needs nothing from the host and a CUDA graph can replay it for any batch of the same shape.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kEncoderThreads = 256;    // encoder_forward and the wpe gradient: one element (or Vec) per thread
constexpr int kEncoderWteThreads = 64;  // the wte gradient: 64 columns of one bucket per block

// ----------------------------------------------------------------------------------------- kernels
// vec (C % kVec<floatX> == 0, pointers 16-byte aligned): each thread writes kVec<floatX> channels (16 bytes).
template <class floatX>
__global__ void __launch_bounds__(kEncoderThreads) encoder_forward_kernel(floatX* __restrict__ out,        // (B, T, C)
                                       const int* __restrict__ inp,     // (B, T)
                                       const floatX* __restrict__ wte,  // (Vp, C)
                                       const floatX* __restrict__ wpe,  // (maxT, C) or null
                                       int BT, int T, int C, bool vec) {
  const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    const int CV = C / kVec<floatX>;
    if (idx >= size_t(BT) * CV) return;
    const int bt = int(idx / CV), c = int(idx % CV) * kVec<floatX>, t = bt % T;
    const Vec<floatX> a = Vec<floatX>::load(wte + size_t(inp[bt]) * C + c);
    if (!wpe) {
      a.store(out + size_t(bt) * C + c);
      return;
    }
    const Vec<floatX> b = Vec<floatX>::load(wpe + size_t(t) * C + c);
    Vec<floatX> o;
#pragma unroll
    for (int k = 0; k < kVec<floatX>; k++) o.set(k, a.f(k) + b.f(k));
    o.store(out + size_t(bt) * C + c);
    return;
  }
  if (idx >= size_t(BT) * C) return;
  const int bt = int(idx / C), c = int(idx % C), t = bt % T;
  const floatX e = wte[size_t(inp[bt]) * C + c];
  out[idx] = wpe ? store_t<floatX>(load_f(e) + load_f(wpe[size_t(t) * C + c])) : e;
}

// dwpe[t, c] += sum_b dout[b, t, c], b in order (fp32).
template <class floatX>
__global__ void __launch_bounds__(kEncoderThreads) encoder_backward_wpe_kernel(float* __restrict__ dwpe,         // (maxT, C)
                                            const floatX* __restrict__ dout,  // (B, T, C)
                                            int B, int T, int C) {
  const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= size_t(T) * C) return;
  float s = 0.0f;
  for (int b = 0; b < B; b++) s += load_f(dout[size_t(b) * T * C + idx]);
  dwpe[idx] += s;
}

// buckets: [U | order (BT): positions sorted by token | token (U) | start (U + 1)], see encoder_buckets. Bucket u
// covers positions order[start[u] .. start[u+1]) of token token[u]; blocks stride over the buckets.
template <class floatX>
__global__ void __launch_bounds__(kEncoderWteThreads) encoder_backward_wte_kernel(float* __restrict__ dwte,         // (Vp, C)
                                            const floatX* __restrict__ dout,  // (B*T, C)
                                            const int* __restrict__ buckets, int BT, int C) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int U = buckets[0];
  const int* order = buckets + 1;
  const int* token = order + BT;
  const int* start = token + U;
  for (int u = blockIdx.x; u < U; u += gridDim.x) {
    float s = 0.0f;
    for (int i = start[u]; i < start[u + 1]; i++) s += load_f(dout[size_t(order[i]) * C + c]);
    dwte[size_t(token[u]) * C + c] += s;
  }
}

// ----------------------------------------------------------------------------------------- launchers
template <class floatX>
void encoder_forward(floatX* out, const int* inp, const floatX* wte, const floatX* wpe, int B, int T, int C,
                     cudaStream_t stream) {
  const size_t n = size_t(B) * T * C;
  if (n == 0) return;
  const int block = kEncoderThreads;
  const bool vec = C % kVec<floatX> == 0 && aligned16(out, wte, wpe);  // a null wpe counts as aligned
  LAUNCH(encoder_forward_kernel<floatX>, ceil_div(vec ? n / kVec<floatX> : n, block), block, 0, stream, out, inp, wte,
         wpe, B * T, T, C, vec);
  CUDA_CHECK_LAUNCH();
}

// Ints of the bucket layout for BT positions (at most: U <= BT).
inline size_t encoder_buckets_size(int BT) { return 3 * size_t(BT) + 2; }

// Fills out (encoder_buckets_size(BT) ints, host memory) with the positions of inp (BT token ids) bucketed by
// token id: a stable counting sort. Returns the number of ints used: 2 + BT + 2U.
inline size_t encoder_buckets(const int32_t* inp, int BT, int* out) {
  int max_id = 0;
  for (int i = 0; i < BT; i++) max_id = std::max(max_id, int(inp[i]));
  std::vector<int> count(size_t(max_id) + 2, 0);
  for (int i = 0; i < BT; i++) count[size_t(inp[i]) + 1]++;
  int* order = out + 1;
  int* token = order + BT;
  int U = 0;
  for (int v = 0; v <= max_id; v++) {
    if (count[size_t(v) + 1] > 0) token[U++] = v;
    count[size_t(v) + 1] += count[v];  // count[v] becomes the first slot of token v
  }
  for (int i = 0; i < BT; i++) order[count[inp[i]]++] = i;
  // after the scatter, count[v] is the end of token v's slots: start[u] = end of the previous token
  int* start = token + U;
  start[0] = 0;
  for (int u = 0; u < U; u++) start[u + 1] = count[token[u]];
  out[0] = U;
  return 2 + size_t(BT) + 2 * size_t(U);
}

// buckets_dev: encoder_buckets of the batch's token ids, in device memory. Enqueues only kernels.
template <class floatX>
void encoder_backward(float* dwte, float* dwpe, const floatX* dout, const int* buckets_dev, int B, int T, int C,
                      cudaStream_t stream) {
  const int BT = B * T;
  if (BT == 0 || C == 0) return;
  const int block = kEncoderThreads;
  if (dwpe) {
    LAUNCH(encoder_backward_wpe_kernel<floatX>, ceil_div(size_t(T) * C, block), block, 0, stream, dwpe, dout, B, T, C);
    CUDA_CHECK_LAUNCH();
  }
  const int cblock = kEncoderWteThreads;
  dim3 grid(std::min(BT, 2048), ceil_div(C, cblock));  // at most BT buckets; 2048 x C/64 blocks fill any GPU
  LAUNCH(encoder_backward_wte_kernel<floatX>, grid, cblock, 0, stream, dwte, dout, buckets_dev, BT, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
