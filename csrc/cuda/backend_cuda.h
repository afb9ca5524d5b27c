// The CUDA backend's entry points, for the backend factory (csrc/model/backend_factory.h).
// Plain C++: no CUDA headers, so the bindings compile with the host compiler.
#pragma once
#include <memory>
#include <string>

#include "model/backend.h"

namespace gpt2::cuda {

// "" when a CUDA device is usable, otherwise why not (no driver, no device, ...).
std::string device_status();

// device: "cuda" or "cuda:<index>". Throws std::runtime_error when no usable device exists.
// TF32 matmuls when the environment has GPT2CORE_CUDA_TF32=1 (fp32 otherwise).
std::unique_ptr<Backend<float>> make_backend(const std::string& device);

}  // namespace gpt2::cuda
