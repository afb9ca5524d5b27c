// Extras of the cuDNN implementation of gpt2core::seams::attention_forward / attention_backward
// (csrc/cuda/seams_cudnn.cu), GPU build only. Plain C++ (no CUDA or cuDNN headers needed).
#pragma once
#include <string>

namespace gpt2core::seams {

// The cuDNN / cuDNN frontend message behind the last failed attention call on this thread ("" if none).
std::string last_attention_error();
// Frees the workspace attention calls on `stream` (a cudaStream_t) used; call before destroying the stream, whose
// work must have finished. Never throws.
void release_attention_stream(void* stream);

}  // namespace gpt2core::seams
