// The CUDA backend's CudaPlugin table (cuda/plugin.cpp; model/cuda_plugin.h says how the CPU core uses it).
#pragma once
#include "model/cuda_plugin.h"

namespace gpt2::cuda {

const CudaPlugin* plugin();

}  // namespace gpt2::cuda
