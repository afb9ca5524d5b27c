// AdamW (PyTorch semantics) over one tensor of n values, one launch:
//   g = grad * grad_scale;  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   param -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + decay * param)
// grad_scale folds in gradient clipping; decay is 0 for 1-D tensors (the model's policy).
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

struct AdamWParams {
  float lr, beta1, beta2, eps, decay, grad_scale, bc1, bc2;
};

__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, size_t n, AdamWParams p) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = grad[i] * p.grad_scale;
  const float mi = p.beta1 * m[i] + (1.0f - p.beta1) * g;
  const float vi = p.beta2 * v[i] + (1.0f - p.beta2) * g * g;
  m[i] = mi;
  v[i] = vi;
  const float mhat = mi / p.bc1, vhat = vi / p.bc2;
  const float w = param[i];
  param[i] = w - p.lr * (mhat / (sqrtf(vhat) + p.eps) + p.decay * w);
}

inline void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, const AdamWParams& p,
                         cudaStream_t stream) {
  if (n == 0) return;
  LAUNCH(adamw_kernel, ceil_div(n, 256), 256, 0, stream, param, grad, m, v, n, p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
