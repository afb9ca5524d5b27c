// The CUDA backend's entry points as a CudaPlugin table (model/cuda_plugin.h), for gpt2core._C_cuda to hand to
// the CPU core and for the emulated test module to set directly.
#include "cuda/plugin.h"

#include "cuda/backend_cuda.h"
#if GPT2CORE_DIST_NCCL
#include "comm/comm_nccl.h"
#endif

namespace gpt2::cuda {

const CudaPlugin* plugin() {
  static const CudaPlugin table = {
      kCudaPluginAbi,
      [] { return device_status(); },
      device_capability,
      device_name,
      make_backend,
      make_backend_bf16,
      make_backend_f16,
#if GPT2CORE_DIST_NCCL
      dist::make_nccl_comm,
#else
      nullptr,
#endif
      bgradb_refusals,
      device_mem_info,
  };
  return &table;
}

}  // namespace gpt2::cuda
