// The CPU backend for x86-64-v4 (AVX-512 F/BW/DQ/VL: Skylake-SP, Ice Lake, Zen 4 and later); chosen at run time where the CPU has it.
#include "cpu/backend_cpu.h"

#if GPT2CORE_CPU_DISPATCH
#define GPT2CORE_CPU_ISA x86_64_v4
#define GPT2CORE_CPU_AVX2 1  // cpu/ops_infer.h: 256-bit FMA + F16C intrinsics
#define GPT2CORE_CPU_TARGET "arch=x86-64-v4"
#include "cpu/backend_cpu_impl.h"
#endif
