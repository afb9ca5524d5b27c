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

__device__ inline void adamw_one(float& w, float grad, float& m, float& v, const AdamWParams& p) {
  const float g = grad * p.grad_scale;
  const float mi = p.beta1 * m + (1.0f - p.beta1) * g;
  const float vi = p.beta2 * v + (1.0f - p.beta2) * g * g;
  m = mi;
  v = vi;
  const float mhat = mi / p.bc1, vhat = vi / p.bc2;
  w = w - p.lr * (mhat / (sqrtf(vhat) + p.eps) + p.decay * w);
}

// vec: thread i updates values 4i..4i+3 with float4 loads/stores (pointers 16-byte aligned), the last
// thread the tail; otherwise one value per thread.
__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, size_t n, AdamWParams p, bool vec) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < n) adamw_one(param[i], grad[i], m[i], v[i], p);
    return;
  }
  const size_t i4 = 4 * i;
  if (i4 + 4 <= n) {
    float4 w = *reinterpret_cast<const float4*>(param + i4);
    const float4 g = *reinterpret_cast<const float4*>(grad + i4);
    float4 mm = *reinterpret_cast<const float4*>(m + i4);
    float4 vv = *reinterpret_cast<const float4*>(v + i4);
    adamw_one(w.x, g.x, mm.x, vv.x, p);
    adamw_one(w.y, g.y, mm.y, vv.y, p);
    adamw_one(w.z, g.z, mm.z, vv.z, p);
    adamw_one(w.w, g.w, mm.w, vv.w, p);
    *reinterpret_cast<float4*>(param + i4) = w;
    *reinterpret_cast<float4*>(m + i4) = mm;
    *reinterpret_cast<float4*>(v + i4) = vv;
  } else {
    for (size_t k = i4; k < n; k++) adamw_one(param[k], grad[k], m[k], v[k], p);
  }
}

inline void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, const AdamWParams& p,
                         cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = aligned16(param, grad, m, v);
  LAUNCH(adamw_kernel, ceil_div(vec ? (n + 3) / 4 : n, 256), 256, 0, stream, param, grad, m, v, n, p, vec);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
