// The CUDA backend as the CPU core sees it: a table of entry points. gpt2core._C (the model, the CPU backend,
// Gloo) links no CUDA library; the CUDA backend and the NCCL communicator live in gpt2core._C_cuda, which
// Python imports on the first device="cuda" (after loading NVIDIA's libraries: gpt2core/_cuda.py) and whose
// plugin() capsule hands this table to _C.set_cuda_plugin(). The test-only emulated module links its CUDA
// backend and sets the table itself. Both extension modules come from one build (same compiler and standard
// library), so the table carries plain C++ types; kCudaPluginAbi refuses a table from another build.
#pragma once
#include <memory>
#include <string>

#include "comm/comm.h"
#include "model/backend.h"
#include "model/backend_options.h"

typedef struct CUstream_st* cudaStream_t;

namespace gpt2 {

constexpr int kCudaPluginAbi = 4;  // bump whenever CudaPlugin, or a type it passes, changes

struct CudaPlugin {
  int abi;
  std::string (*status)();                // "" when a CUDA device is usable, else why not (cuda::device_status)
  int (*capability)(int device);          // major * 10 + minor, -1 without one
  std::string (*device_name)(int device);
  std::unique_ptr<Backend<float>> (*make_f32)(const std::string& device, const BackendOptions& options);
  std::unique_ptr<Backend<bf16>> (*make_bf16)(const std::string& device, const BackendOptions& options);
  std::unique_ptr<Backend<f16>> (*make_f16)(const std::string& device, const BackendOptions& options);
  // the NCCL communicator (comm/comm_nccl.h); nullptr in a build without NCCL
  std::unique_ptr<dist::Comm> (*make_nccl_comm)(const dist::RendezvousOptions& opts, int device, cudaStream_t stream);
  // refused bias-gradient epilogues so far in this process (cuda::bgradb_refusals)
  void (*bgradb_refusals)(long long* shapes, long long* fallbacks);
  // free and total bytes of a device's memory (cudaMemGetInfo); throws std::runtime_error without that device
  void (*mem_info)(int device, size_t* free_bytes, size_t* total_bytes);
};

// The table in use: nullptr until the CUDA module (or the emulated build) set it.
inline const CudaPlugin*& cuda_plugin() {
  static const CudaPlugin* plugin = nullptr;
  return plugin;
}

}  // namespace gpt2
