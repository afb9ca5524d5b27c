// The composition root: device string -> Backend, the one place that knows which backends this build has
// (the bindings include it; the model layer only knows the Backend interface).
// "cuda" / "cuda:<index>" come from the CUDA plugin (model/cuda_plugin.h) once it is set: the real CUDA backend
// from gpt2core._C_cuda, the emulated one in the test-only module.
#pragma once
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "cpu/backend_cpu.h"
#include "model/backend.h"
#include "model/backend_options.h"
#include "model/cuda_plugin.h"

namespace gpt2 {

inline const char* compiled_backends() { return cuda_plugin() ? "cpu, cuda" : "cpu"; }

inline bool is_cuda_device(const std::string& device) { return device == "cuda" || device.rfind("cuda:", 0) == 0; }

// "" when device="cuda" can be used (the CUDA backend is loaded and a GPU is visible), else why not.
inline std::string cuda_status() {
  return cuda_plugin() ? cuda_plugin()->status() : "this build of gpt2core has no CUDA backend";
}

// Compute capability (major * 10 + minor) of CUDA device `index`, -1 without a usable one.
inline int cuda_capability(int index) { return cuda_status().empty() ? cuda_plugin()->capability(index) : -1; }

// Name of CUDA device `index` ("" without one).
inline std::string cuda_device_name(int index) { return cuda_status().empty() ? cuda_plugin()->device_name(index) : ""; }

// (free, total) bytes of CUDA device `index`'s memory; throws std::runtime_error without a usable one.
inline std::pair<size_t, size_t> cuda_mem_info(int index) {
  if (const std::string why = cuda_status(); !why.empty()) throw std::runtime_error(why);
  size_t free_b = 0, total_b = 0;
  cuda_plugin()->mem_info(index, &free_b, &total_b);
  return {free_b, total_b};
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
    if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
      throw std::invalid_argument(std::string(std::is_same_v<T, bf16> ? "bf16" : "fp16") +
                                  " mixed precision needs device='cuda'; the CPU backend computes in fp32");
    else
      return cpu::make_backend<T>();  // the instruction-set variant this CPU runs best (cpu/backend_cpu.h)
  }
  if (is_cuda_device(device) && cuda_plugin()) {
    if constexpr (std::is_same_v<T, float>) return cuda_plugin()->make_f32(device, options);
    else if constexpr (std::is_same_v<T, bf16>) return cuda_plugin()->make_bf16(device, options);
    else if constexpr (std::is_same_v<T, f16>) return cuda_plugin()->make_f16(device, options);
    else throw std::invalid_argument("device '" + device + "' supports float32, bf16 and fp16 models only");
  }
  throw std::invalid_argument("device '" + device + "' is not available in this build of gpt2core._C (compiled backends: " +
                              compiled_backends() + ")");
}

}  // namespace gpt2
