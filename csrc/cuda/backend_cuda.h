// The CUDA backend's entry points, for the backend factory (csrc/model/backend_factory.h).
// Plain C++: no CUDA headers, so the bindings compile with the host compiler.
#pragma once
#include <memory>
#include <string>

#include "model/backend.h"

namespace gpt2::cuda {

// "" when a CUDA device is usable, otherwise why not (no driver, no device, ...). With device >= 0 it also
// checks that this index exists and that the build has kernels for that GPU (which makes it current and
// creates its context); with -1 it creates no context.
std::string device_status(int device = -1);

// device: "cuda" or "cuda:<index>". Throws std::runtime_error when no usable device exists.
// TF32 matmuls when the environment has GPT2CORE_CUDA_TF32=1 (fp32 otherwise).
std::unique_ptr<Backend<float>> make_backend(const std::string& device);

}  // namespace gpt2::cuda
