// Shared helpers of the CUDA backend: error macros that throw, ceil_div, warp and block reductions.
// Included by every kernel file; compiles with nvcc and, through emu/cuda_portable.h, with g++ against
// the CUDA-on-CPU emulator (csrc/emu).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "emu/cuda_portable.h"

namespace gpt2::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(e) + " at " + file + ":" +
                           std::to_string(line) + " (" + call + "): " + cudaGetErrorString(e));
}

}  // namespace gpt2::cuda

// Throws std::runtime_error naming the call, file, line and CUDA's message (pybind11 turns it into a
// Python RuntimeError). Never exits.
#define CUDA_CHECK(call)                                                            \
  do {                                                                              \
    cudaError_t gpt2_err_ = (call);                                                 \
    if (gpt2_err_ != cudaSuccess) {                                                 \
      (void)cudaGetLastError(); /* clear a sticky launch error */                   \
      ::gpt2::cuda::throw_cuda_error(gpt2_err_, #call, __FILE__, __LINE__);         \
    }                                                                               \
  } while (0)

// After a LAUNCH: configuration errors (and, in the emulation, kernel failures) surface here.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace gpt2::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

inline int ceil_div(size_t a, size_t b) { return static_cast<int>((a + b - 1) / b); }

// True when every pointer is 16-byte aligned: the memory-bound kernels then move float4 (16 bytes) per
// thread and finish the last N % 4 values one by one; otherwise they fall back to one float per thread.
template <class... P>
inline bool aligned16(const P*... p) {
  return ((reinterpret_cast<uintptr_t>(p) % 16 == 0) && ...);
}

template <class T>
__device__ inline T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ inline float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// scratch: 32 values of __shared__ memory. Fixed reduction order, so deterministic.
template <class T>
__device__ inline T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : T(0);
  return warp_sum(v);
}

__device__ inline float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

}  // namespace gpt2::cuda
