// GELU, tanh approximation (GPT-2):  gelu(x) = 0.5 x (1 + tanh(s (x + 0.044715 x^3))), s = sqrt(2/pi)
//   backward: dinp += gelu'(x) * dout   (accumulates)
// Storage type floatX (float, bf16 or fp16): values are widened to fp32, computed, and rounded once to floatX
// (for the backward: the sum dinp + gelu'(x) * dout is rounded once).
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kGeluThreads = 256;

constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2 / pi)

__device__ inline float gelu(float x) { return 0.5f * x * (1.0f + tanhf(kGeluS * (x + 0.044715f * x * x * x))); }
__device__ inline float gelu_grad(float x) {
  const float th = tanhf(kGeluS * (x + 0.044715f * x * x * x));
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluS * (1.0f + 3.0f * 0.044715f * x * x);
}

// vec: thread i handles values K*i .. K*i+K-1 (K = kVec<floatX>, 16 bytes) as one Vec (pointers 16-byte
// aligned), the last thread the tail; otherwise one value per thread.
template <class floatX>
__global__ void __launch_bounds__(kGeluThreads) gelu_forward_kernel(floatX* __restrict__ out,        // (N)
                                    const floatX* __restrict__ inp,  // (N)
                                    size_t N, bool vec) {
  using V = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < N) out[i] = store_t<floatX>(gelu(load_f(inp[i])));
    return;
  }
  const size_t iv = K * i;
  if (iv + K <= N) {
    const V x = V::load(inp + iv);
    V y;
#pragma unroll
    for (int k = 0; k < K; k++) y.set(k, gelu(x.f(k)));
    y.store(out + iv);
  } else {
    for (size_t k = iv; k < N; k++) out[k] = store_t<floatX>(gelu(load_f(inp[k])));
  }
}

template <class floatX>
__global__ void __launch_bounds__(kGeluThreads) gelu_backward_kernel(floatX* __restrict__ dinp,        // (N), accumulated into
                                     const floatX* __restrict__ inp,   // (N)
                                     const floatX* __restrict__ dout,  // (N)
                                     size_t N, bool vec) {
  using V = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < N) dinp[i] = store_t<floatX>(load_f(dinp[i]) + gelu_grad(load_f(inp[i])) * load_f(dout[i]));
    return;
  }
  const size_t iv = K * i;
  if (iv + K <= N) {
    const V x = V::load(inp + iv), d = V::load(dout + iv);
    V g = V::load(dinp + iv);
#pragma unroll
    for (int k = 0; k < K; k++) g.set(k, g.f(k) + gelu_grad(x.f(k)) * d.f(k));
    g.store(dinp + iv);
  } else {
    for (size_t k = iv; k < N; k++)
      dinp[k] = store_t<floatX>(load_f(dinp[k]) + gelu_grad(load_f(inp[k])) * load_f(dout[k]));
  }
}

template <class floatX>
void gelu_forward(floatX* out, const floatX* inp, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  constexpr int K = kVec<floatX>;
  const bool vec = aligned16(out, inp);
  LAUNCH(gelu_forward_kernel<floatX>, ceil_div(vec ? (N + K - 1) / K : N, kGeluThreads), kGeluThreads, 0, stream, out, inp, N,
         vec);
  CUDA_CHECK_LAUNCH();
}

template <class floatX>
void gelu_backward(floatX* dinp, const floatX* inp, const floatX* dout, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  constexpr int K = kVec<floatX>;
  const bool vec = aligned16(dinp, inp, dout);
  LAUNCH(gelu_backward_kernel<floatX>, ceil_div(vec ? (N + K - 1) / K : N, kGeluThreads), kGeluThreads, 0, stream, dinp, inp,
         dout, N,
         vec);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
