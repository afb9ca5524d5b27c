// Token + position embedding.
//   forward:  out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]
//   backward: dwpe[t,:] += sum_b dout[b,t,:];  dwte[v,:] += sum over positions (b,t) with inp[b,t] == v of dout[b,t,:]
// Backward is deterministic without float atomics: the positions are bucketed by token id on the host
// (stable order), and one thread owns each (token, channel) output and sums its bucket in that order.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/common.cuh"

namespace gpt2::cuda {

// ----------------------------------------------------------------------------------------- kernels
// vec (C % 4 == 0, pointers 16-byte aligned): each thread writes 4 channels as one float4.
__global__ void encoder_forward_kernel(float* __restrict__ out,        // (B, T, C)
                                       const int* __restrict__ inp,    // (B, T)
                                       const float* __restrict__ wte,  // (Vp, C)
                                       const float* __restrict__ wpe,  // (maxT, C)
                                       int BT, int T, int C, bool vec) {
  const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    const int C4 = C / 4;
    if (idx >= size_t(BT) * C4) return;
    const int bt = int(idx / C4), c = int(idx % C4) * 4, t = bt % T;
    const float4 a = *reinterpret_cast<const float4*>(wte + size_t(inp[bt]) * C + c);
    const float4 b = *reinterpret_cast<const float4*>(wpe + size_t(t) * C + c);
    *reinterpret_cast<float4*>(out + size_t(bt) * C + c) = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    return;
  }
  if (idx >= size_t(BT) * C) return;
  const int bt = int(idx / C), c = int(idx % C), t = bt % T;
  out[idx] = wte[size_t(inp[bt]) * C + c] + wpe[size_t(t) * C + c];
}

// dwpe[t, c] += sum_b dout[b, t, c], b in order.
__global__ void encoder_backward_wpe_kernel(float* __restrict__ dwpe,        // (maxT, C)
                                            const float* __restrict__ dout,  // (B, T, C)
                                            int B, int T, int C) {
  const size_t idx = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= size_t(T) * C) return;
  float s = 0.0f;
  for (int b = 0; b < B; b++) s += dout[size_t(b) * T * C + idx];
  dwpe[idx] += s;
}

// Bucket u (blockIdx.x) covers positions order[start[u] .. start[u+1]) of token token[u].
__global__ void encoder_backward_wte_kernel(float* __restrict__ dwte,          // (Vp, C)
                                            const float* __restrict__ dout,    // (B*T, C)
                                            const int* __restrict__ token,     // (U)
                                            const int* __restrict__ start,     // (U + 1)
                                            const int* __restrict__ order,     // (B*T) positions by token
                                            int C) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const int u = blockIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int i = start[u]; i < start[u + 1]; i++) s += dout[size_t(order[i]) * C + c];
  dwte[size_t(token[u]) * C + c] += s;
}

// ----------------------------------------------------------------------------------------- launchers
inline void encoder_forward(float* out, const int* inp, const float* wte, const float* wpe, int B, int T, int C,
                            cudaStream_t stream) {
  const size_t n = size_t(B) * T * C;
  if (n == 0) return;
  const int block = 256;
  const bool vec = C % 4 == 0 && aligned16(out, wte, wpe);
  LAUNCH(encoder_forward_kernel, ceil_div(vec ? n / 4 : n, block), block, 0, stream, out, inp, wte, wpe, B * T, T, C,
         vec);
  CUDA_CHECK_LAUNCH();
}

// inp_host: the same token ids as inp, on the host. work_dev: device int scratch of at least
// 3 * B * T + 1 ints.
inline void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp_host, int* work_dev,
                             int B, int T, int C, cudaStream_t stream) {
  const int BT = B * T;
  if (BT == 0 || C == 0) return;
  const int block = 256;
  LAUNCH(encoder_backward_wpe_kernel, ceil_div(size_t(T) * C, block), block, 0, stream, dwpe, dout, B, T, C);
  CUDA_CHECK_LAUNCH();
  // stable counting sort of positions by token id: buckets in increasing token order
  std::vector<int> order(BT);
  for (int i = 0; i < BT; i++) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return inp_host[a] < inp_host[b]; });
  std::vector<int> host(3 * size_t(BT) + 1);  // [order (BT) | token (U) | start (U + 1)]
  std::copy(order.begin(), order.end(), host.begin());
  int U = 0;
  std::vector<int> token, start;
  for (int i = 0; i < BT; i++) {
    if (i == 0 || inp_host[order[i]] != inp_host[order[i - 1]]) {
      token.push_back(inp_host[order[i]]);
      start.push_back(i);
      U++;
    }
  }
  start.push_back(BT);
  std::copy(token.begin(), token.end(), host.begin() + BT);
  std::copy(start.begin(), start.end(), host.begin() + BT + U);
  CUDA_CHECK(cudaMemcpyAsync(work_dev, host.data(), (size_t(BT) + 2 * U + 1) * sizeof(int), cudaMemcpyHostToDevice,
                             stream));
  const int cblock = 64;
  dim3 grid(U, ceil_div(C, cblock));
  LAUNCH(encoder_backward_wte_kernel, grid, cblock, 0, stream, dwte, dout, work_dev + BT, work_dev + BT + U,
         work_dev, C);
  CUDA_CHECK_LAUNCH();
  // `host` must outlive the (possibly asynchronous) copy above
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace gpt2::cuda
