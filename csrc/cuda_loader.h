// load_cuda_backend(), shared by the bindings of gpt2core._C (bindings.cpp, bindings_dist.cpp) so that neither
// calls into the other: bindings.cpp -> bindings_dist.cpp (bind_dist) is the one direction between them.
// GPT2CORE_CUDA_MODULE=1 in the package's _C: a CUDA module (this build's gpt2core._C_cuda, or the _C_cuda of
// the plugin gpt2core-cuda12 / gpt2core-cuda13) is imported on first use.
#pragma once
#include <pybind11/pybind11.h>

#include "model/cuda_plugin.h"

#ifndef GPT2CORE_CUDA_MODULE
#define GPT2CORE_CUDA_MODULE 0
#endif

// The CUDA backend on first use: gpt2core._cuda.load() loads NVIDIA's libraries and the CUDA module, then
// hands its entry points to set_cuda_plugin. Python's exception (naming a missing library) propagates.
inline void load_cuda_backend() {
  if (GPT2CORE_CUDA_MODULE && !gpt2::cuda_plugin()) pybind11::module_::import("gpt2core._cuda").attr("load")();
}
