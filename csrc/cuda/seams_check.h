// CUDA_CHECK_THROW for the GPU-only seam implementations (seams_cublaslt.cu, seams_cudnn.cu): a failed CUDA
// runtime call throws std::runtime_error with file, line and CUDA's message, which the seam function catches
// and turns into its cudaError_t result (seams never throw; see csrc/emu/seams.h).
#pragma once
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#define CUDA_CHECK_THROW(call)                                                                              \
  do {                                                                                                      \
    cudaError_t e_ = (call);                                                                                \
    if (e_ != cudaSuccess)                                                                                  \
      throw std::runtime_error(std::string("CUDA error at ") + __FILE__ + ":" + std::to_string(__LINE__) + \
                               " (" #call "): " + cudaGetErrorString(e_));                                  \
  } while (0)
