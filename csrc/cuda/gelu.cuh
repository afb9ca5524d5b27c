// GELU, tanh approximation (GPT-2):  gelu(x) = 0.5 x (1 + tanh(s (x + 0.044715 x^3))), s = sqrt(2/pi)
//   backward: dinp += gelu'(x) * dout   (accumulates)
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2 / pi)

__device__ inline float gelu(float x) { return 0.5f * x * (1.0f + tanhf(kGeluS * (x + 0.044715f * x * x * x))); }
__device__ inline float gelu_grad(float x) {
  const float th = tanhf(kGeluS * (x + 0.044715f * x * x * x));
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluS * (1.0f + 3.0f * 0.044715f * x * x);
}

// vec: thread i handles values 4i..4i+3 as one float4 (pointers 16-byte aligned), the last thread the tail.
__global__ void gelu_forward_kernel(float* __restrict__ out, const float* __restrict__ inp, size_t N, bool vec) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < N) out[i] = gelu(inp[i]);
    return;
  }
  const size_t i4 = 4 * i;
  if (i4 + 4 <= N) {
    const float4 x = *reinterpret_cast<const float4*>(inp + i4);
    *reinterpret_cast<float4*>(out + i4) = make_float4(gelu(x.x), gelu(x.y), gelu(x.z), gelu(x.w));
  } else {
    for (size_t k = i4; k < N; k++) out[k] = gelu(inp[k]);
  }
}

__global__ void gelu_backward_kernel(float* __restrict__ dinp, const float* __restrict__ inp,
                                     const float* __restrict__ dout, size_t N, bool vec) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < N) dinp[i] += gelu_grad(inp[i]) * dout[i];
    return;
  }
  const size_t i4 = 4 * i;
  if (i4 + 4 <= N) {
    const float4 x = *reinterpret_cast<const float4*>(inp + i4);
    const float4 d = *reinterpret_cast<const float4*>(dout + i4);
    float4 g = *reinterpret_cast<const float4*>(dinp + i4);
    g.x += gelu_grad(x.x) * d.x;
    g.y += gelu_grad(x.y) * d.y;
    g.z += gelu_grad(x.z) * d.z;
    g.w += gelu_grad(x.w) * d.w;
    *reinterpret_cast<float4*>(dinp + i4) = g;
  } else {
    for (size_t k = i4; k < N; k++) dinp[k] += gelu_grad(inp[k]) * dout[k];
  }
}

inline void gelu_forward(float* out, const float* inp, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  const bool vec = aligned16(out, inp);
  LAUNCH(gelu_forward_kernel, ceil_div(vec ? (N + 3) / 4 : N, 256), 256, 0, stream, out, inp, N, vec);
  CUDA_CHECK_LAUNCH();
}

inline void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  const bool vec = aligned16(dinp, inp, dout);
  LAUNCH(gelu_backward_kernel, ceil_div(vec ? (N + 3) / 4 : N, 256), 256, 0, stream, dinp, inp, dout, N, vec);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
