// Sum of squares of n values (for the global gradient norm), accumulated in double, deterministic:
// a fixed grid (independent of the GPU) of per-block partial sums, then one block sums them in order.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kNormBlocks = 256;
constexpr int kNormThreads = 256;

__global__ void __launch_bounds__(kNormThreads) sum_squares_partial_kernel(double* __restrict__ partial,  // (kNormBlocks)
                                           const float* __restrict__ p, size_t n) {
  __shared__ double scratch[32];
  double s = 0.0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const double x = p[i];
    s += x * x;
  }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kNormThreads) sum_squares_final_kernel(double* __restrict__ out, const double* __restrict__ partial, int nparts) {
  __shared__ double scratch[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) s += partial[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) *out = s;
}

// *out (device memory) = the sum of squares; enqueues only kernels. work: kNormBlocks doubles of device memory.
inline void sum_squares_into(double* out, const float* p, size_t n, double* work, cudaStream_t stream) {
  if (n == 0) {
    CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream));
    return;
  }
  LAUNCH(sum_squares_partial_kernel, kNormBlocks, kNormThreads, 0, stream, work, p, n);
  CUDA_CHECK_LAUNCH();
  LAUNCH(sum_squares_final_kernel, 1, kNormThreads, 0, stream, out, work, kNormBlocks);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
