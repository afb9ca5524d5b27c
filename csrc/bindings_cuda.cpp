// gpt2core._C_cuda: the CUDA backend and the NCCL communicator, the only module that links NVIDIA's libraries.
// gpt2core/_cuda.py loads those libraries (PyPI wheels, else a system toolkit), imports this module and passes
// plugin() to gpt2core._C.set_cuda_plugin(); everything else goes through _C.
#include <pybind11/pybind11.h>

#include "cuda/plugin.h"

namespace py = pybind11;

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "gpt2core CUDA backend (loaded by gpt2core._cuda on first use)";
  m.def("plugin", []() { return py::capsule(static_cast<const void*>(gpt2::cuda::plugin()), "gpt2core.cuda_plugin"); },
        "The CUDA backend's entry points for gpt2core._C.set_cuda_plugin().");
}
