// The composition root: device string -> Backend, the one place that knows which backends this build has
// (the bindings include it; the model layer only knows the Backend interface).
// GPT2CORE_BACKEND_CUDA (set by the build on targets that link csrc/cuda) adds "cuda" / "cuda:<index>":
// the real CUDA backend in gpt2core._C, the emulated one in the test-only module.
#pragma once
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cpu/backend_cpu.h"
#include "model/backend.h"
#include "model/backend_options.h"

#ifndef GPT2CORE_BACKEND_CUDA
#define GPT2CORE_BACKEND_CUDA 0
#endif
#if GPT2CORE_BACKEND_CUDA
#include "cuda/backend_cuda.h"
#endif

namespace gpt2 {

inline const char* compiled_backends() { return GPT2CORE_BACKEND_CUDA ? "cpu, cuda" : "cpu"; }

inline bool is_cuda_device(const std::string& device) { return device == "cuda" || device.rfind("cuda:", 0) == 0; }

// "" when device="cuda" can be used (a CUDA backend is compiled and a GPU is visible), else why not.
inline std::string cuda_status() {
#if GPT2CORE_BACKEND_CUDA
  return cuda::device_status();
#else
  return "this build of gpt2core has no CUDA backend";
#endif
}

// Compute capability (major * 10 + minor) of CUDA device `index`, -1 without a usable one.
inline int cuda_capability(int index) {
#if GPT2CORE_BACKEND_CUDA
  return cuda_status().empty() ? cuda::device_capability(index) : -1;
#else
  (void)index;
  return -1;
#endif
}

// Name of CUDA device `index` ("" without one).
inline std::string cuda_device_name(int index) {
#if GPT2CORE_BACKEND_CUDA
  return cuda_status().empty() ? cuda::device_name(index) : "";
#else
  (void)index;
  return "";
#endif
}

// Throws std::invalid_argument for a device this build does not have (or a dtype or option it does not support),
// std::runtime_error when the device exists in the build but not on this machine.
template <class T>
std::unique_ptr<Backend<T>> make_backend(const std::string& device, const BackendOptions& options = {}) {
  if (device == "cpu") {
    using A = BackendOptions::Attention;
    if (options.tf32 || options.attention == A::Flash || options.attention == A::Cudnn)
      throw std::invalid_argument(std::string("the CPU backend computes in fp32 with materialised attention: tf32=") +
                                  (options.tf32 ? "True" : "False") + ", attention='" +
                                  attention_name(options.attention) + "' need device='cuda'");
    if constexpr (std::is_same_v<T, bf16>)
      throw std::invalid_argument("bf16 mixed precision needs device='cuda'; the CPU backend computes in fp32");
    else
      return std::make_unique<cpu::CpuBackend<T>>();
  }
#if GPT2CORE_BACKEND_CUDA
  if (is_cuda_device(device)) {
    if constexpr (std::is_same_v<T, float>) return cuda::make_backend(device, options);
    else if constexpr (std::is_same_v<T, bf16>) return cuda::make_backend_bf16(device, options);
    else throw std::invalid_argument("device '" + device + "' supports float32 and bf16 models only");
  }
#endif
  throw std::invalid_argument("device '" + device + "' is not available in this build of gpt2core._C (compiled backends: " +
                              compiled_backends() + ")");
}

}  // namespace gpt2
