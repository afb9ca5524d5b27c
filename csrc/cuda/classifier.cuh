// Fused classifier: softmax cross-entropy over the first V of Vp columns of each row of logits (N, Vp).
//   forward:  lse[n] = logsumexp(logits[n, :V]); losses[n] = lse[n] - logits[n, target[n]], or 0 where
//             the target is -1 (ignored) or targets is null; counts the non-ignored rows (integer atomics).
//   backward (in place): logits[n, i] becomes (softmax - onehot(target)) * dloss for i < V of valid rows,
//             0 in the padded columns V..Vp-1 and in ignored rows.
// One block per row; forward reads the row once (online max/sum), backward reads and writes it once;
// softmax statistics in fp32 with a fixed-order block reduction. logits have the storage type floatX (float
// or bf16; widened to fp32 on load, the gradient rounded once to floatX on store); losses and lse are fp32.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kClassifierBlock = 512;

template <class floatX>
__global__ void crossentropy_forward_kernel(float* __restrict__ losses,         // (N)
                                            float* __restrict__ lse,            // (N)
                                            int* __restrict__ valid,            // (1), incremented
                                            const floatX* __restrict__ logits,  // (N, Vp)
                                            const int* __restrict__ targets,   // (N) or null
                                            int V, int Vp) {
  __shared__ float scratch[32];
  const int n = blockIdx.x;
  const floatX* row = logits + size_t(n) * Vp;
  // one pass over the row: each thread keeps a running max and the sum of exp(x - max), rescaled when
  // the max grows (online softmax); then the block combines the pairs
  float tm = -INFINITY, ts = 0.0f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float x = load_f(row[i]);
    if (x > tm) {
      ts = ts * expf(tm - x) + 1.0f;
      tm = x;
    } else {
      ts += expf(x - tm);
    }
  }
  const float m = block_max(tm, scratch);
  const float s = block_sum(tm == -INFINITY ? 0.0f : ts * expf(tm - m), scratch);
  if (threadIdx.x == 0) {
    const float l = m + logf(s);
    lse[n] = l;
    const int t = targets ? targets[n] : -1;
    if (t >= 0) {
      losses[n] = l - load_f(row[t]);
      atomicAdd(valid, 1);
    } else {
      losses[n] = 0.0f;
    }
  }
}

template <class floatX>
__global__ void crossentropy_backward_kernel(floatX* __restrict__ logits,       // (N, Vp), in place
                                             const float* __restrict__ lse,     // (N)
                                             const int* __restrict__ targets,   // (N)
                                             float dloss, int V, int Vp) {
  const int n = blockIdx.x;
  floatX* row = logits + size_t(n) * Vp;
  const int t = targets[n];
  const float l = lse[n];
  for (int i = threadIdx.x; i < Vp; i += blockDim.x) {
    float d = 0.0f;
    if (t >= 0 && i < V) {
      d = expf(load_f(row[i]) - l) * dloss;
      if (i == t) d -= dloss;
    }
    row[i] = store_t<floatX>(d);
  }
}

// valid_dev: one device int (scratch). Returns the number of non-ignored rows.
template <class floatX>
long crossentropy_forward(float* losses, float* lse, const floatX* logits, const int* targets, int* valid_dev, int N,
                          int V, int Vp, cudaStream_t stream) {
  if (N <= 0) return 0;
  CUDA_CHECK(cudaMemsetAsync(valid_dev, 0, sizeof(int), stream));
  LAUNCH(crossentropy_forward_kernel<floatX>, N, kClassifierBlock, 0, stream, losses, lse, valid_dev, logits, targets,
         V, Vp);
  CUDA_CHECK_LAUNCH();
  int valid = 0;
  CUDA_CHECK(cudaMemcpyAsync(&valid, valid_dev, sizeof(int), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return valid;
}

template <class floatX>
void crossentropy_backward_inplace(floatX* logits, const float* lse, const int* targets, float dloss, int N, int V,
                                   int Vp, cudaStream_t stream) {
  if (N <= 0) return;
  LAUNCH(crossentropy_backward_kernel<floatX>, N, kClassifierBlock, 0, stream, logits, lse, targets, dloss, V, Vp);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
