// Residual add: out = a + b (elementwise over N values).
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

// vec: thread i adds values 4i..4i+3 as float4 (pointers 16-byte aligned), the last thread the tail.
__global__ void residual_forward_kernel(float* __restrict__ out, const float* __restrict__ a,
                                        const float* __restrict__ b, size_t N, bool vec) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < N) out[i] = a[i] + b[i];
    return;
  }
  const size_t i4 = 4 * i;
  if (i4 + 4 <= N) {
    const float4 x = *reinterpret_cast<const float4*>(a + i4);
    const float4 y = *reinterpret_cast<const float4*>(b + i4);
    *reinterpret_cast<float4*>(out + i4) = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
  } else {
    for (size_t k = i4; k < N; k++) out[k] = a[k] + b[k];
  }
}

inline void residual_forward(float* out, const float* a, const float* b, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  const bool vec = aligned16(out, a, b);
  LAUNCH(residual_forward_kernel, ceil_div(vec ? (N + 3) / 4 : N, 256), 256, 0, stream, out, a, b, N, vec);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
