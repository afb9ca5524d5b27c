// GPT2CORE_HOST_DEVICE: marks a plain C++ function of csrc/model that CUDA kernels call too (the clip rule and the
// loss scaler's step, model/optimizer.h). The only nvcc-only line of csrc/model: under nvcc the function compiles
// for host and device, under g++ (the CPU backend, and the CUDA backend built against the emulator, csrc/emu) for
// the host. The function bodies are one code path for both: <cmath>'s std:: functions (std::isfinite, std::sqrt,
// std::fma, ...), which nvcc provides in device code with IEEE semantics (sqrt correctly rounded in double, as the
// host's), so the emulator compiles the expressions nvcc compiles; never ::isfinite or an #if __CUDACC__ branch.
// tests/csrc/cuda/test_one_code_path.py lists every nvcc-only line and fails on a new one.
#pragma once

#if defined(__CUDACC__)
#define GPT2CORE_HOST_DEVICE __host__ __device__
#else
#define GPT2CORE_HOST_DEVICE
#endif
