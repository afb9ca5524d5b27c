// Residual add: out = a + b (elementwise over N values), storage type floatX (float, bf16 or fp16): the sum is
// computed in fp32 and rounded once to floatX. out may be a or b (in-place accumulation: each value is read
// before the same thread writes it). (layernorm.cuh has the fused residual + layernorm.)
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kResidualThreads = 256;

// vec: thread i adds values K*i .. K*i+K-1 (K = kVec<floatX>, 16 bytes) as one Vec (pointers 16-byte
// aligned), the last thread the tail; otherwise one value per thread.
template <class floatX>
__global__ void __launch_bounds__(kResidualThreads) residual_forward_kernel(floatX* out,      // (N), may alias a or b
                                        const floatX* a,  // (N)
                                        const floatX* b,  // (N)
                                        size_t N, bool vec) {
  using V = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < N) out[i] = store_t<floatX>(load_f(a[i]) + load_f(b[i]));
    return;
  }
  const size_t iv = K * i;
  if (iv + K <= N) {
    const V x = V::load(a + iv), y = V::load(b + iv);
    V o;
#pragma unroll
    for (int k = 0; k < K; k++) o.set(k, x.f(k) + y.f(k));
    o.store(out + iv);
  } else {
    for (size_t k = iv; k < N; k++) out[k] = store_t<floatX>(load_f(a[k]) + load_f(b[k]));
  }
}

template <class floatX>
void residual_forward(floatX* out, const floatX* a, const floatX* b, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  constexpr int K = kVec<floatX>;
  const bool vec = aligned16(out, a, b);
  LAUNCH(residual_forward_kernel<floatX>, ceil_div(vec ? (N + K - 1) / K : N, kResidualThreads), kResidualThreads, 0, stream, out,
         a, b, N,
         vec);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
