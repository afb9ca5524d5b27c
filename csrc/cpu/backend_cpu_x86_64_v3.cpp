// The CPU backend for x86-64-v3 (AVX2 + FMA: Haswell, Zen 1 and later); chosen at run time where the CPU has it.
#include "cpu/backend_cpu.h"

#if GPT2CORE_CPU_DISPATCH
#define GPT2CORE_CPU_ISA x86_64_v3
#define GPT2CORE_CPU_AVX2 1  // cpu/ops_infer.h: 256-bit FMA + F16C intrinsics
#define GPT2CORE_CPU_TARGET "arch=x86-64-v3"
#include "cpu/backend_cpu_impl.h"
#endif
