// Asynchronous global -> shared copies (PTX cp.async, sm_80+), portable: inline PTX under nvcc, the emulator's
// cp.async under g++ (csrc/emu/cuda_emu.h: the data lands only at the issuing thread's wait, the destination reads
// as poison until then, and the memory checker fails any access to a copy in flight).
//
//   cp_async_16(smem, gmem, valid): 16 bytes (cp.async.cg: cached in L2 only, as the tiles of a block are read once);
//     !valid: the 16 bytes are zero-filled and gmem is not read (src-size 0: rows past the sequence end). Both
//     addresses 16-byte aligned.
//   cp_async_4(smem, gmem, valid): 4 bytes (cp.async.ca, the only kind below 16 bytes), as cp_async_16; both
//     addresses 4-byte aligned.
//   cp_async_commit():  closes this thread's group of copies issued since the last commit.
//   cp_async_wait<N>(): waits until at most N of this thread's committed groups are in flight. Other threads see the
//     data only after a __syncthreads that follows the wait.
//   cp_async_wait_all(): commit, then wait for every group.
// Below sm_80 (sm_75 builds) the copy is an ordinary 16-byte load and store, and commit / wait do nothing: the same
// code runs, without the overlap.
#pragma once
#include "cuda/portable.h"

#include <cstdint>

namespace gpt2::cuda {

#if GPT2CORE_EMU

__device__ inline void cp_async_16(void* smem, const void* gmem, bool valid = true) {
  gpt2emu::cp_async(smem, gmem, 16, valid ? 16 : 0);
}
__device__ inline void cp_async_4(void* smem, const void* gmem, bool valid = true) {
  gpt2emu::cp_async(smem, gmem, 4, valid ? 4 : 0);
}
__device__ inline void cp_async_commit() { gpt2emu::cp_async_commit_group(); }
template <int N>
__device__ inline void cp_async_wait() {
  gpt2emu::cp_async_wait_group(N);
}
__device__ inline void cp_async_wait_all() { gpt2emu::cp_async_wait_all(); }

#else

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define GPT2_CP_ASYNC 0
#else
#define GPT2_CP_ASYNC 1
#endif

__device__ inline void cp_async_16(void* smem, const void* gmem, bool valid = true) {
#if GPT2_CP_ASYNC
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
#else
  *static_cast<uint4*>(smem) = valid ? *static_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ inline void cp_async_4(void* smem, const void* gmem, bool valid = true) {
#if GPT2_CP_ASYNC
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 4 : 0));
#else
  *static_cast<uint32_t*>(smem) = valid ? *static_cast<const uint32_t*>(gmem) : 0u;
#endif
}
__device__ inline void cp_async_commit() {
#if GPT2_CP_ASYNC
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ inline void cp_async_wait() {
#if GPT2_CP_ASYNC
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
__device__ inline void cp_async_wait_all() {
#if GPT2_CP_ASYNC
  asm volatile("cp.async.wait_all;\n" ::);
#endif
}

#undef GPT2_CP_ASYNC
#endif

}  // namespace gpt2::cuda
