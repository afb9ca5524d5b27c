// The CPU backend: host memory, OpenMP + BLAS ops from cpu/ops.h (the class: cpu/backend_cpu_impl.h).
//
// One build runs on any x86-64 CPU and still uses the vector units it has: the backend is compiled in several
// instruction-set variants, each in its own namespace, and make_backend() picks one when a model is created.
//   x86-64-v4  AVX-512 F/BW/DQ/VL (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4)   backend_cpu_x86_64_v4.cpp
//   x86-64-v3  AVX2 + FMA (Haswell, Zen 1 and later)                               backend_cpu_x86_64_v3.cpp
//   baseline   what the compiler targets by default (x86-64: SSE2)                 backend_cpu_baseline.cpp
// The best one this CPU runs is the default (cpuid through __builtin_cpu_supports). The variants exist with GCC
// on x86-64; elsewhere, and in a GPT2CORE_NATIVE build (-march=native, named "native"), only the baseline does.
// BLAS (OpenBLAS) does its own run-time dispatch.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/backend.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(GPT2CORE_CPU_NATIVE)
#define GPT2CORE_CPU_DISPATCH 1
#else
#define GPT2CORE_CPU_DISPATCH 0
#endif

namespace gpt2::cpu {

// The variants compiled into this build that this CPU can run, best first (the last is the baseline).
std::vector<std::string> isas();

// The variant that CPU backends created from now on use; set_isa() picks another of isas() (tests and benchmarks
// compare them) and throws std::invalid_argument, naming the choices, for a name not in isas().
std::string isa();
void set_isa(const std::string& name);

template <typename T>
std::unique_ptr<Backend<T>> make_backend();

}  // namespace gpt2::cpu
