// Extras of the cuBLASLt implementation of gpt2core::seams::matmul (csrc/cuda/seams_cublaslt.cu),
// GPU build only. Plain C++ (no CUDA headers needed).
#pragma once
#include <string>

namespace gpt2core::seams {

// The cuBLASLt message behind the last failed matmul on this thread ("" if none).
std::string last_matmul_error();

}  // namespace gpt2core::seams
