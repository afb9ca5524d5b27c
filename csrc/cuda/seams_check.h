// Error handling shared by the GPU-only seam implementations (seams_cublaslt.cu, seams_cudnn.cu): inside, a
// failed call throws (CUDA_CHECK_THROW: file, line and CUDA's message); at the seam, run_guarded turns any
// exception or pending CUDA error into the cudaError_t result and keeps the message for the caller (seams never
// throw; see csrc/cuda/seams.h).
#pragma once
#include <cuda_runtime_api.h>

#include <exception>
#include <stdexcept>
#include <string>

#define CUDA_CHECK_THROW(call)                                                                              \
  do {                                                                                                      \
    cudaError_t e_ = (call);                                                                                \
    if (e_ != cudaSuccess)                                                                                  \
      throw std::runtime_error(std::string("CUDA error at ") + __FILE__ + ":" + std::to_string(__LINE__) + \
                               " (" #call "): " + cudaGetErrorString(e_));                                  \
  } while (0)

namespace gpt2core::seams {

// f() with exceptions and launch errors as a cudaError_t; their message goes to last_error.
template <class F>
cudaError_t run_guarded(std::string& last_error, F&& f) {
  try {
    f();
  } catch (const std::exception& ex) {
    last_error = ex.what();
    return cudaErrorUnknown;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) last_error = cudaGetErrorString(e);
  return e;
}

}  // namespace gpt2core::seams
