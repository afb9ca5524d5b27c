// GELU, tanh approximation (GPT-2):  gelu(x) = 0.5 x (1 + tanh(s (x + 0.044715 x^3))), s = sqrt(2/pi)
//   backward: dinp += gelu'(x) * dout   (accumulates)
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2 / pi)

__global__ void gelu_forward_kernel(float* __restrict__ out, const float* __restrict__ inp, size_t N) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const float x = inp[i];
  out[i] = 0.5f * x * (1.0f + tanhf(kGeluS * (x + 0.044715f * x * x * x)));
}

__global__ void gelu_backward_kernel(float* __restrict__ dinp, const float* __restrict__ inp,
                                     const float* __restrict__ dout, size_t N) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const float x = inp[i];
  const float th = tanhf(kGeluS * (x + 0.044715f * x * x * x));
  const float sech2 = 1.0f - th * th;
  const float grad = 0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluS * (1.0f + 3.0f * 0.044715f * x * x);
  dinp[i] += grad * dout[i];
}

inline void gelu_forward(float* out, const float* inp, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  LAUNCH(gelu_forward_kernel, ceil_div(N, 256), 256, 0, stream, out, inp, N);
  CUDA_CHECK_LAUNCH();
}

inline void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  LAUNCH(gelu_backward_kernel, ceil_div(N, 256), 256, 0, stream, dinp, inp, dout, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
