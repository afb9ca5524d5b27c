// Residual add: out = a + b (elementwise over N values).
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

__global__ void residual_forward_kernel(float* __restrict__ out, const float* __restrict__ a,
                                        const float* __restrict__ b, size_t N) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N) out[i] = a[i] + b[i];
}

inline void residual_forward(float* out, const float* a, const float* b, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  LAUNCH(residual_forward_kernel, ceil_div(N, 256), 256, 0, stream, out, a, b, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
