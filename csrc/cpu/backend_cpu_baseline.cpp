// The CPU backend for the compiler's default target (x86-64: SSE2); every CPU runs it.
#include "cpu/backend_cpu.h"

#define GPT2CORE_CPU_ISA baseline
#include "cpu/backend_cpu_impl.h"
