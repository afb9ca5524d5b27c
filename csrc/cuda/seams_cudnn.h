// Extras of the cuDNN implementation of gpt2core::seams::attention_forward / attention_backward
// (csrc/cuda/seams_cudnn.cu), GPU build only. Plain C++ (no CUDA or cuDNN headers needed).
#pragma once
#include <string>

namespace gpt2core::seams {

// The cuDNN / cuDNN frontend message behind the last failed attention call on this thread ("" if none).
std::string last_attention_error();

}  // namespace gpt2core::seams
