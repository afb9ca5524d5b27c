// racecheck.h: the emulator's memory checker (racecheck.cpp), as the scheduler (runtime.cpp) and the
// allocator (runtime_api.cpp) drive it. Not for kernels.
//
// Kernel sources are compiled with GCC's ThreadSanitizer instrumentation (-fsanitize=thread, see
// CMakeLists.txt) but linked without its runtime: every load, store and atomic in them calls a __tsan_*
// entry point that racecheck.cpp defines. While a CUDA thread runs, those calls check:
//   shared memory (static __shared__ and DYNAMIC_SMEM), per byte, the last writer and the readers since
//     the last __syncthreads: a write and a read or two writes by threads of different warps with no
//     __syncthreads between them, or by different lanes of one warp with no __syncwarp between them, is
//     a race; a read of a byte no thread of the block wrote is an uninitialised read (the byte is
//     poisoned with 0x7ff7fff7 first: NaN as fp64, fp32, bf16 and fp16, 2146959351 as int32);
//   device memory (cudaMalloc'd from an arena whose bytes have an 8-byte shadow each): an access outside
//     every live allocation (guard zones between allocations, freed memory) is an out-of-bounds access;
//     two writes to one byte by different blocks of a launch, unless both are atomics, are a race.
// The first finding fails the launch; its message names the kernel, block, threads and source lines
// (addr2line on the instrumented code's return addresses, after the launch).
#pragma once

#include <vector_types.h>  // uint3, dim3

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpt2emu::detail::race {

// Bytes after a block's dynamic shared memory that the scheduler allocates too: the checker reports
// accesses to them.
constexpr size_t kSmemGuard = 256;

// Whether any loaded kernel code is instrumented and GPT2CORE_EMU_RACECHECK is not 0.
bool enabled();

// ---- device memory: an arena with guard zones. Returns null when the arena is not in use (checker
// off, or the address space could not be reserved): the caller allocates elsewhere.
void* device_alloc(size_t size);
bool device_free(void* p);  // false: p is not from the arena

// ---- the scheduler's calls, on the OS thread running the block
void launch_begin(uint64_t launch_id);
// kernel_code: any code address of the kernel's module (its static __shared__ memory is that module's
// thread-local storage).
void block_begin(const void* kernel_code, uint32_t block_linear, dim3 grid, dim3 block, void* dyn_smem,
                 size_t dyn_bytes);
void thread_runs(int tid);  // tid < 0: no CUDA thread runs
void barrier();             // a __syncthreads completed
void syncwarp(int warp);    // a __syncwarp of that warp completed
void block_end();

// ---- cp.async (runtime.cpp), for the running CUDA thread; no-ops while the checker is off
bool is_shared(const void* p, size_t n);                   // inside the block's dynamic or static shared memory
void read_global(const void* src, size_t n, const void* pc);  // the copy's source read (bounds-checked)
// Issue: a write of the destination by this thread, which then stays in flight: any access to it fails until
// async_land (the write that the issuing thread's cp.async.wait_group makes).
void async_issue(void* dst, size_t n, const void* pc);
void async_land(void* dst, size_t n, const void* pc);

// Replaces the code addresses the checker wrote into a message ("@pc:0x...@") by file:line (function).
std::string symbolize(const std::string& msg);

// Defined by the scheduler: fails the running block with `msg` and never returns to the caller.
[[noreturn]] void fail_running_thread(const std::string& msg);

}  // namespace gpt2emu::detail::race
