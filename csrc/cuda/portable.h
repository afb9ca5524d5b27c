// portable.h: the one header a kernel file (.cu / .cuh) includes to get CUDA.
//
// The same source compiles two ways:
//   - with nvcc: the real CUDA headers, LAUNCH is `kernel<<<grid, block, smem, stream>>>(args...)`;
//   - with g++ (no __CUDACC__), for the tests: against the CUDA-on-CPU emulator, which the emulated build
//     force-includes ahead of every CUDA source (csrc/emu/CMakeLists.txt, gpt2core_emu_cuda_sources). Production
//     code never includes csrc/emu: the emulator depends on this folder, not the reverse.
//
// The two project conventions kernel code must follow:
//   LAUNCH(kernel, grid, block, smem, stream, args...)   instead of <<<>>>. A template kernel with
//                                                        commas goes in parentheses: LAUNCH((k<T, 4>), ...)
//   DYNAMIC_SMEM(type, name);                            instead of `extern __shared__ type name[];`
//                                                        (name is a `type*` into the dynamic shared memory)
// Everything else (__shared__, __syncthreads, __shfl_*_sync, atomics, bf16/fp16, the cooperative groups
// subset listed in emu/cooperative_groups.h) is ordinary CUDA C++.
#pragma once

#if defined(__CUDACC__)

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

#define GPT2CORE_EMU 0

#define LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)

// One extern array of one type for the whole translation unit (nvcc rejects the same extern
// __shared__ name declared with two element types), viewed as `type*`.
#define DYNAMIC_SMEM(type, name)                                                 \
  extern __shared__ __align__(16) unsigned char gpt2core_dynamic_smem_[];       \
  type* const name = reinterpret_cast<type*>(gpt2core_dynamic_smem_)

#elif !defined(GPT2CORE_EMU)
#error "CUDA sources compile with nvcc, or with a host compiler through the emulator (csrc/emu, gpt2core_emu_cuda_sources)"
#endif
