// The CUDA backend's entry points, for the composition root (csrc/backends.h).
// Plain C++: no CUDA headers, so the bindings compile with the host compiler.
#pragma once
#include <memory>
#include <string>

#include "model/backend.h"
#include "model/backend_options.h"

namespace gpt2::cuda {

// "" when a CUDA device is usable, otherwise why not (no driver, no device, ...). With device >= 0 it also
// checks that this index exists and that the build has kernels for that GPU (which makes it current and
// creates its context); with -1 it creates no context.
std::string device_status(int device = -1);

// Compute capability of a visible device as major * 10 + minor (80 for A100, 90 for H100), or -1 if none.
int device_capability(int device);
// The device's name as the driver reports it ("NVIDIA H100 80GB HBM3"), "" if none.
std::string device_name(int device);

// Process-wide counts of the bias-gradient epilogue (BGRADB) the matmul library refused: dW shapes refused (each
// said once on stderr and not asked again by that backend) and dW GEMMs whose dbias the column-sum kernels made.
void bgradb_refusals(long long* shapes, long long* fallbacks);

// Free and total bytes of the device's memory (cudaMemGetInfo with that device current; the caller's current device
// is restored). Throws std::runtime_error for a device that does not exist.
void device_mem_info(int device, size_t* free_bytes, size_t* total_bytes);

// device: "cuda" or "cuda:<index>". Throws std::runtime_error when no usable device exists (or attention=Cudnn
// is asked for and cuDNN's attention is not usable).
std::unique_ptr<Backend<float>> make_backend(const std::string& device, const BackendOptions& options);
// The bf16 mixed-precision backend: bf16 parameters copy and activations, fp32 master weights, gradients,
// AdamW state and statistics (options.tf32 has no effect: its matmuls take bf16 inputs).
std::unique_ptr<Backend<::gpt2::bf16>> make_backend_bf16(const std::string& device, const BackendOptions& options);
// The fp16 mixed-precision backend: the same contract with IEEE half precision (for sm_70 / sm_75 GPUs, which
// have fp16 tensor cores and no bf16); its weight copy is rounded to nearest even, not stochastically.
std::unique_ptr<Backend<::gpt2::f16>> make_backend_f16(const std::string& device, const BackendOptions& options);

}  // namespace gpt2::cuda
