// ReLU squared (Primer; modded-nanogpt's MLP activation):  relu2(x) = max(x, 0)^2
//   backward: dinp += 2 max(x, 0) * dout   (accumulates; or, accumulate = false, dinp = 2 max(x, 0) * dout without
//             reading dinp, which may then alias dout: the MLP backward turns dL/d act into dL/d pre in place)
// cuBLASLt has no ReLU^2 epilogue (its activation epilogues are RELU, GELU and their AUX / backward forms), so the
// MLP runs the matmul (bias epilogue) and this kernel: forward writes act from pre, backward dpre from dact.
// Storage type floatX (float, bf16 or fp16): values are widened to fp32, computed, and rounded once to floatX.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

__device__ inline float relu2(float x) { return x > 0.0f ? x * x : 0.0f; }
__device__ inline float relu2_grad(float x) { return x > 0.0f ? 2.0f * x : 0.0f; }

// vec: thread i handles values K*i .. K*i+K-1 (K = kVec<floatX>, 16 bytes) as one Vec (pointers 16-byte
// aligned), the last thread the tail; otherwise one value per thread.
constexpr int kRelu2Block = 256;  // threads per block of this file's kernels (launch bounds)
template <class floatX>
__global__ void __launch_bounds__(kRelu2Block) relu2_forward_kernel(floatX* __restrict__ out,        // (N)
                                     const floatX* __restrict__ inp,  // (N)
                                     size_t N, bool vec) {
  using V = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < N) out[i] = store_t<floatX>(relu2(load_f(inp[i])));
    return;
  }
  const size_t iv = K * i;
  if (iv + K <= N) {
    const V x = V::load(inp + iv);
    V y;
#pragma unroll
    for (int k = 0; k < K; k++) y.set(k, relu2(x.f(k)));
    y.store(out + iv);
  } else {
    for (size_t k = iv; k < N; k++) out[k] = store_t<floatX>(relu2(load_f(inp[k])));
  }
}

// dinp may alias dout (each value read by the thread that writes it, before it writes it)
template <class floatX>
__global__ void __launch_bounds__(kRelu2Block) relu2_backward_kernel(floatX* dinp,                    // (N), += (add) or written
                                      const floatX* __restrict__ inp,  // (N)
                                      const floatX* dout,              // (N)
                                      size_t N, bool vec, bool add) {
  using V = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < N) {
      const float g = relu2_grad(load_f(inp[i])) * load_f(dout[i]);
      dinp[i] = store_t<floatX>(add ? load_f(dinp[i]) + g : g);
    }
    return;
  }
  const size_t iv = K * i;
  if (iv + K <= N) {
    const V x = V::load(inp + iv), d = V::load(dout + iv);
    V g;
    if (add) g = V::load(dinp + iv);
#pragma unroll
    for (int k = 0; k < K; k++) g.set(k, (add ? g.f(k) : 0.0f) + relu2_grad(x.f(k)) * d.f(k));
    g.store(dinp + iv);
  } else {
    for (size_t k = iv; k < N; k++) {
      const float g = relu2_grad(load_f(inp[k])) * load_f(dout[k]);
      dinp[k] = store_t<floatX>(add ? load_f(dinp[k]) + g : g);
    }
  }
}

template <class floatX>
void relu2_forward(floatX* out, const floatX* inp, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  constexpr int K = kVec<floatX>;
  const bool vec = aligned16(out, inp);
  LAUNCH(relu2_forward_kernel<floatX>, ceil_div(vec ? (N + K - 1) / K : N, kRelu2Block), kRelu2Block, 0, stream, out, inp, N, vec);
  CUDA_CHECK_LAUNCH();
}

template <class floatX>
void relu2_backward(floatX* dinp, const floatX* inp, const floatX* dout, size_t N, bool accumulate,
                    cudaStream_t stream) {
  if (N == 0) return;
  constexpr int K = kVec<floatX>;
  const bool vec = aligned16(dinp, inp, dout);
  LAUNCH(relu2_backward_kernel<floatX>, ceil_div(vec ? (N + K - 1) / K : N, kRelu2Block), kRelu2Block, 0, stream, dinp, inp, dout, N,
         vec, accumulate);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
