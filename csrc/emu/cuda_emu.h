// cuda_emu.h: CUDA C++ on the CPU, with CUDA's semantics checked, for tests.
//
// Force-included by gpt2core_emu_cuda_sources (CMakeLists.txt here) ahead of CUDA sources, which include
// cuda/portable.h (the real CUDA headers under nvcc). Compiled with
// g++ against NVIDIA's own headers in host mode: cuda_runtime.h gives the types and the runtime API
// declarations (implemented in emu/runtime.cpp), cuda_bf16.h / cuda_fp16.h give the bf16 / fp16
// types and their host conversions. This header adds what only exists in device code:
//
//   execution   LAUNCH runs the grid synchronously: blocks are spread over a pool of OS threads, each
//               CUDA thread of a block is a fiber on its block's OS thread. threadIdx, blockIdx,
//               blockDim, gridDim read the running fiber.
//   __shared__  `static thread_local`: one instance per OS thread, and an OS thread runs one block at
//               a time from start to end, so every block sees its own copy. DYNAMIC_SMEM memory is
//               per block and filled with NaN bytes (0xFF) at block start.
//   barriers    __syncthreads (+ _count/_and/_or) is a counting barrier: it is released only when
//               every thread of the block waits at the same __syncthreads call; threads that exited
//               or wait elsewhere are reported as an error naming the kernel, block and thread.
//   warps       32 lanes. __shfl*_sync (any trivially copyable type up to 16 bytes), __ballot_sync,
//               __any_sync, __all_sync, __syncwarp, __reduce_*_sync wait until every lane named in
//               the mask arrives at the same operation with the same mask; a mask naming an exited
//               or missing lane, a caller outside its mask, a read of a lane outside the mask or a bad
//               width is an error. Results follow PTX shfl.sync (width segments, clamping).
//   schedules   GPT2CORE_EMU_SCHED=fwd|rev|random:<seed> (lock-step) or low|high|ahead:<seed> (one warp
//               runs ahead to its next __syncthreads) picks the order fibers run between
//               synchronisation points (and the order blocks are taken).
//   checker     kernels compiled with the emulator's instrumentation (racecheck.h) have shared-memory
//               races, uninitialised shared reads, device-memory bounds and cross-block write races
//               reported as kernel errors naming the source lines.
//   errors      a kernel error ends the launch: cudaGetLastError() (or the next synchronising call)
//               returns cudaErrorLaunchFailure and cudaGetErrorString() returns the detailed message.
//               Launch configuration errors return cudaErrorInvalidConfiguration / InvalidValue.
//   trace       GPT2CORE_EMU_TRACE=<file> appends each launched kernel's name, one per line;
//               GPT2CORE_EMU_LAUNCH_LOG=<file> one JSON object per kernel launch (grid, block, integer arguments),
//               library seam call and memset (scripts/gpu_model.py reads it).
//   memory      cudaMalloc'd memory starts as NaN bytes (0xFF); cudaMemcpy etc. are plain copies;
//               streams and events exist but everything runs synchronously.
//   graphs      a capturing stream records its work (enqueue below) instead of running it;
//               cudaGraphLaunch replays it. Host synchronisation during capture is refused (graph.cpp).
#pragma once

#if defined(__CUDACC__)
#error "emu/cuda_emu.h is the host-compiler emulation; nvcc uses the real CUDA headers (cuda/portable.h)"
#endif

// Defined before NVIDIA's headers: host_defines.h keeps a __shared__ that is already defined.
#define __shared__ static thread_local
#define __launch_bounds__(...)

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <tuple>
#include <type_traits>
#include <utility>

#define GPT2CORE_EMU 1

namespace gpt2emu {

// ---------------------------------------------------------------------------------- runtime seam
namespace detail {

struct ThreadState {  // the running CUDA thread, as kernels see it
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
// The running CUDA thread of this OS thread (null outside kernels). __thread rather than thread_local:
// no TLS init wrapper, so a threadIdx read is one %fs-relative load. Fibers never migrate between OS
// threads, so caching its address across a fiber switch is safe.
extern __thread ThreadState* t_thread;
#if defined(GPT2CORE_EMU_SANITIZE)
// GCC 12's -fsanitize=null can test stale flags on inlined TLS address computations (false "load of
// null pointer" reports in kernels); sanitizer builds read the pointer through a call instead.
ThreadState* current_thread();
#define GPT2EMU_THREAD (::gpt2emu::detail::current_thread())
#else
#define GPT2EMU_THREAD (::gpt2emu::detail::t_thread)
#endif

struct KernelLaunch {
  const char* name;      // as written at the LAUNCH site
  const void* func;      // the kernel's address (cudaFuncSetAttribute key)
  dim3 grid, block;
  size_t smem;           // dynamic shared memory bytes
  cudaStream_t stream;
  void (*invoke)(void* ctx);  // runs the kernel body for the current fiber
  void* ctx;
  // A heap copy of *ctx (the kernel and its arguments), for a launch recorded by stream capture:
  // CUDA copies kernel parameters when the launch is captured, not when the graph runs.
  std::shared_ptr<void> (*copy_ctx)(const void* ctx);
  // The integer arguments (sizes) of *ctx as "[a, b, ...]", for the launch log (GPT2CORE_EMU_LAUNCH_LOG).
  std::string (*int_args)(const void* ctx) = nullptr;
};
cudaError_t launch_kernel(const KernelLaunch& l);
// Appends an integral, non-bool argument to a comma-separated list (other types are skipped).
template <class T>
void append_int_arg(std::string& s, const T& v) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) s += (s.empty() ? "" : ", ") + std::to_string(v);
}

enum class WarpOp : int { ShflIdx, ShflUp, ShflDown, ShflXor, Ballot, Any, All, Sync, ReduceAdd, ReduceMin, ReduceMax, ReduceAnd, ReduceOr, ReduceXor };
// Blocks the calling fiber until the warp collective completes; `in`/`out` hold `size` bytes.
void warp_collective(WarpOp op, unsigned mask, const void* in, void* out, size_t size, int arg,
                     int width, bool is_signed, const char* file, int line);
enum class BarrierOp : int { Sync, Count, And, Or };
int block_barrier(BarrierOp op, int pred, const char* file, int line);
unsigned char* dynamic_smem();
unsigned active_mask();
[[noreturn]] void device_trap(const char* what, const char* file, int line);

}  // namespace detail

// Launches `kernel` with CUDA's argument passing (each argument converted to the parameter type,
// each CUDA thread gets its own copy). Returns the launch's error code (also kept as last error).
template <class... P, class... A>
cudaError_t launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "LAUNCH: wrong number of kernel arguments");
  struct Ctx {
    void (*k)(P...);
    std::tuple<std::decay_t<P>...> args;
  };
  Ctx ctx{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
  detail::KernelLaunch l{name, reinterpret_cast<const void*>(kernel), grid, block, smem, stream,
                         [](void* c) {
                           Ctx* x = static_cast<Ctx*>(c);
                           auto copy = x->args;  // by-value parameters: one copy per CUDA thread
                           std::apply(x->k, copy);
                         },
                         &ctx,
                         [](const void* c) -> std::shared_ptr<void> {
                           return std::make_shared<Ctx>(*static_cast<const Ctx*>(c));
                         },
                         [](const void* c) {
                           std::string s;
                           std::apply([&s](const auto&... a) { (detail::append_int_arg(s, a), ...); },
                                      static_cast<const Ctx*>(c)->args);
                           return "[" + s + "]";
                         }};
  return detail::launch_kernel(l);
}

// Stream-ordered host work, as the library seams (seams_cpu.cpp) and the async copies do it: runs
// `work` now and returns its result, unless `stream` is capturing, in which case `work` becomes a graph
// node (so it must hold copies of what it needs, not references) run by each cudaGraphLaunch.
// Refused with cudaErrorStreamCaptureImplicit (and the capture invalidated) when `stream` is the
// legacy default stream while this thread captures. `what` names the work in messages.
cudaError_t enqueue(cudaStream_t stream, const char* what, std::function<cudaError_t()> work);

// Appends one line to GPT2CORE_EMU_LAUNCH_LOG (when set): the library seams log their calls with it.
void log_launch(const std::string& json_line);

// Detailed message of the last kernel failure on this host thread ("" if none).
const char* last_error_message();
// Overrides GPT2CORE_EMU_SCHED for later launches: "fwd", "rev", "random:<seed>", "low", "high" or
// "ahead:<seed>".
void set_schedule(const char* spec);
// Number of kernel launches so far in this process (a captured launch counts when a graph runs it).
unsigned long long launch_count();
// Number of graph launches (cudaGraphLaunch replays) so far in this process.
unsigned long long graph_launch_count();
// Whether the memory checker (racecheck.h: shared-memory races, device-memory bounds and cross-block
// write races) checks this process's kernels: they were compiled with its instrumentation and
// GPT2CORE_EMU_RACECHECK is not 0.
bool memory_checker_enabled();

}  // namespace gpt2emu

// ---------------------------------------------------------------------------------- runtime C++ API
// The template overloads cuda_runtime.h only declares under nvcc (they take a kernel or a symbol).
template <class T>
inline cudaError_t cudaFuncSetAttribute(T* entry, enum cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}
template <class T>
inline cudaError_t cudaMemcpyToSymbol(const T& symbol, const void* src, size_t count, size_t offset = 0,
                                      enum cudaMemcpyKind kind = cudaMemcpyHostToDevice) {
  return ::cudaMemcpyToSymbol(static_cast<const void*>(&symbol), src, count, offset, kind);
}
template <class T>
inline cudaError_t cudaMemcpyFromSymbol(void* dst, const T& symbol, size_t count, size_t offset = 0,
                                        enum cudaMemcpyKind kind = cudaMemcpyDeviceToHost) {
  return ::cudaMemcpyFromSymbol(dst, static_cast<const void*>(&symbol), count, offset, kind);
}

// ---------------------------------------------------------------------------------- project macros
#define LAUNCH(kernel, grid, block, smem, stream, ...) \
  ((void)::gpt2emu::launch(#kernel, kernel, (grid), (block), (smem), (stream), ##__VA_ARGS__))

#define DYNAMIC_SMEM(type, name) \
  type* const name = reinterpret_cast<type*>(::gpt2emu::detail::dynamic_smem())

// ---------------------------------------------------------------------------------- built-in variables
// NVIDIA's headers declare these as extern "C" objects for device code; in the emulation they are the
// running fiber's.
#define threadIdx (static_cast<const uint3&>(GPT2EMU_THREAD->thread_idx))
#define blockIdx (static_cast<const uint3&>(GPT2EMU_THREAD->block_idx))
#define blockDim (static_cast<const dim3&>(GPT2EMU_THREAD->block_dim))
#define gridDim (static_cast<const dim3&>(GPT2EMU_THREAD->grid_dim))
// warpSize: NVIDIA's `extern "C" const int warpSize`, defined as 32 in runtime.cpp.

// ---------------------------------------------------------------------------------- synchronisation
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::gpt2emu::detail::block_barrier(::gpt2emu::detail::BarrierOp::Sync, 1, file, line);
}
inline int __syncthreads_count(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::gpt2emu::detail::block_barrier(::gpt2emu::detail::BarrierOp::Count, pred, file, line);
}
inline int __syncthreads_and(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::gpt2emu::detail::block_barrier(::gpt2emu::detail::BarrierOp::And, pred, file, line);
}
inline int __syncthreads_or(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::gpt2emu::detail::block_barrier(::gpt2emu::detail::BarrierOp::Or, pred, file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::gpt2emu::detail::warp_collective(::gpt2emu::detail::WarpOp::Sync, mask, nullptr, nullptr, 0, 0, 32, false, file, line);
}
inline unsigned __activemask() { return ::gpt2emu::detail::active_mask(); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __trap(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::gpt2emu::detail::device_trap("__trap()", file, line);
}
inline void __nanosleep(unsigned) {}

// ---------------------------------------------------------------------------------- warp shuffles
namespace gpt2emu::detail {
template <class T>
inline T shfl(WarpOp op, unsigned mask, T var, int arg, int width, const char* file, int line) {
  // CUDA's own __nv_bfloat162 / __half2 declare a copy assignment, so "bitwise copyable" is checked as
  // trivially destructible + copy constructible.
  static_assert(std::is_trivially_destructible<T>::value && std::is_copy_constructible<T>::value,
                "__shfl*_sync needs a trivially copyable type");
  static_assert(sizeof(T) <= 16, "__shfl*_sync supports types up to 16 bytes");
  T out;
  warp_collective(op, mask, &var, &out, sizeof(T), arg, width, false, file, line);
  return out;
}
template <class T>
inline T warp_reduce(WarpOp op, unsigned mask, T v, const char* file, int line) {
  T out;
  warp_collective(op, mask, &v, &out, sizeof(T), 0, 32, std::is_signed<T>::value, file, line);
  return out;
}
}  // namespace gpt2emu::detail

template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::gpt2emu::detail::shfl(::gpt2emu::detail::WarpOp::ShflIdx, mask, var, srcLane, width, file, line);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::gpt2emu::detail::shfl(::gpt2emu::detail::WarpOp::ShflUp, mask, var, static_cast<int>(delta), width, file, line);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::gpt2emu::detail::shfl(::gpt2emu::detail::WarpOp::ShflDown, mask, var, static_cast<int>(delta), width, file, line);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::gpt2emu::detail::shfl(::gpt2emu::detail::WarpOp::ShflXor, mask, var, laneMask, width, file, line);
}
inline unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  int p = pred != 0;
  unsigned out;
  ::gpt2emu::detail::warp_collective(::gpt2emu::detail::WarpOp::Ballot, mask, &p, &out, sizeof(p), 0, 32, false, file, line);
  return out;
}
inline int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  int p = pred != 0, out;
  ::gpt2emu::detail::warp_collective(::gpt2emu::detail::WarpOp::Any, mask, &p, &out, sizeof(p), 0, 32, false, file, line);
  return out;
}
inline int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  int p = pred != 0, out;
  ::gpt2emu::detail::warp_collective(::gpt2emu::detail::WarpOp::All, mask, &p, &out, sizeof(p), 0, 32, false, file, line);
  return out;
}
// sm_80 warp reductions (unsigned and int; and/or/xor on unsigned)
#define GPT2EMU_WARP_REDUCE(NAME, OP, T)                                                            \
  inline T NAME(unsigned mask, T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { \
    return ::gpt2emu::detail::warp_reduce(::gpt2emu::detail::WarpOp::OP, mask, v, file, line);       \
  }
GPT2EMU_WARP_REDUCE(__reduce_add_sync, ReduceAdd, unsigned)
GPT2EMU_WARP_REDUCE(__reduce_add_sync, ReduceAdd, int)
GPT2EMU_WARP_REDUCE(__reduce_min_sync, ReduceMin, unsigned)
GPT2EMU_WARP_REDUCE(__reduce_min_sync, ReduceMin, int)
GPT2EMU_WARP_REDUCE(__reduce_max_sync, ReduceMax, unsigned)
GPT2EMU_WARP_REDUCE(__reduce_max_sync, ReduceMax, int)
GPT2EMU_WARP_REDUCE(__reduce_and_sync, ReduceAnd, unsigned)
GPT2EMU_WARP_REDUCE(__reduce_or_sync, ReduceOr, unsigned)
GPT2EMU_WARP_REDUCE(__reduce_xor_sync, ReduceXor, unsigned)
#undef GPT2EMU_WARP_REDUCE

// ---------------------------------------------------------------------------------- atomics
// Blocks run on several OS threads, so these are real atomic read-modify-writes (GCC __atomic
// builtins). Sub-word types (bf16, fp16) CAS the aligned 32-bit word that contains them.
namespace gpt2emu::detail {
template <class T, class F>
inline T atomic_rmw32(T* addr, F f) {  // T is 4 bytes; f: T -> T
  static_assert(sizeof(T) == 4, "");
  uint32_t* w = reinterpret_cast<uint32_t*>(addr);
  uint32_t old = __atomic_load_n(w, __ATOMIC_RELAXED), upd;
  T o;
  do {
    memcpy(static_cast<void*>(&o), &old, 4);
    T n = f(o);
    memcpy(&upd, static_cast<const void*>(&n), 4);
  } while (!__atomic_compare_exchange_n(w, &old, upd, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  return o;
}
template <class T, class F>
inline T atomic_rmw16(T* addr, F f) {  // T is 2 bytes: CAS on the containing aligned word
  static_assert(sizeof(T) == 2, "");
  uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  uint32_t* w = reinterpret_cast<uint32_t*>(a & ~uintptr_t(3));
  const unsigned shift = (a & 2) ? 16 : 0;
  uint32_t old = __atomic_load_n(w, __ATOMIC_RELAXED), upd;
  T o;
  do {
    uint16_t bits = static_cast<uint16_t>(old >> shift);
    memcpy(static_cast<void*>(&o), &bits, 2);
    T n = f(o);
    uint16_t nb;
    memcpy(&nb, static_cast<const void*>(&n), 2);
    upd = (old & ~(0xffffu << shift)) | (uint32_t(nb) << shift);
  } while (!__atomic_compare_exchange_n(w, &old, upd, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  return o;
}
}  // namespace gpt2emu::detail

#define GPT2EMU_ATOMIC_INT(T)                                                                              \
  inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }                     \
  inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }                     \
  inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }                   \
  inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }                     \
  inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }                       \
  inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }                     \
  inline T atomicCAS(T* a, T cmp, T v) {                                                                   \
    __atomic_compare_exchange_n(a, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                    \
    return cmp;                                                                                            \
  }                                                                                                        \
  inline T atomicMin(T* a, T v) {                                                                          \
    T old = __atomic_load_n(a, __ATOMIC_RELAXED);                                                          \
    while (v < old && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {} \
    return old;                                                                                            \
  }                                                                                                        \
  inline T atomicMax(T* a, T v) {                                                                          \
    T old = __atomic_load_n(a, __ATOMIC_RELAXED);                                                          \
    while (v > old && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {} \
    return old;                                                                                            \
  }
GPT2EMU_ATOMIC_INT(int)
GPT2EMU_ATOMIC_INT(unsigned int)
GPT2EMU_ATOMIC_INT(unsigned long long int)
GPT2EMU_ATOMIC_INT(long long int)
#undef GPT2EMU_ATOMIC_INT

inline unsigned short atomicCAS(unsigned short* a, unsigned short cmp, unsigned short v) {
  return ::gpt2emu::detail::atomic_rmw16(a, [&](unsigned short o) { return o == cmp ? v : o; });
}
inline unsigned atomicInc(unsigned* a, unsigned limit) {
  return ::gpt2emu::detail::atomic_rmw32(a, [&](unsigned o) { return o >= limit ? 0u : o + 1; });
}
inline unsigned atomicDec(unsigned* a, unsigned limit) {
  return ::gpt2emu::detail::atomic_rmw32(a, [&](unsigned o) { return (o == 0 || o > limit) ? limit : o - 1; });
}
inline float atomicAdd(float* a, float v) {
  return ::gpt2emu::detail::atomic_rmw32(a, [&](float o) { return o + v; });
}
inline float atomicExch(float* a, float v) {
  return ::gpt2emu::detail::atomic_rmw32(a, [&](float) { return v; });
}
inline float atomicMax(float* a, float v) {  // not CUDA built-in for float, provided for convenience
  return ::gpt2emu::detail::atomic_rmw32(a, [&](float o) { return fmaxf(o, v); });
}
inline double atomicAdd(double* a, double v) {
  uint64_t* w = reinterpret_cast<uint64_t*>(a);
  uint64_t old = __atomic_load_n(w, __ATOMIC_RELAXED), upd;
  double o;
  do {
    memcpy(&o, &old, 8);
    double n = o + v;
    memcpy(&upd, &n, 8);
  } while (!__atomic_compare_exchange_n(w, &old, upd, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  return o;
}
// bf16 / fp16: the sum is computed in fp32 and rounded to nearest even, as the hardware does.
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* a, __nv_bfloat16 v) {
  return ::gpt2emu::detail::atomic_rmw16(a, [&](__nv_bfloat16 o) {
    return __float2bfloat16_rn(__bfloat162float(o) + __bfloat162float(v));
  });
}
inline __nv_bfloat162 atomicAdd(__nv_bfloat162* a, __nv_bfloat162 v) {
  return ::gpt2emu::detail::atomic_rmw32(a, [&](__nv_bfloat162 o) {
    return __floats2bfloat162_rn(__low2float(o) + __low2float(v), __high2float(o) + __high2float(v));
  });
}
inline __half atomicAdd(__half* a, __half v) {
  return ::gpt2emu::detail::atomic_rmw16(a, [&](__half o) {
    return __float2half_rn(__half2float(o) + __half2float(v));
  });
}
inline __half2 atomicAdd(__half2* a, __half2 v) {
  return ::gpt2emu::detail::atomic_rmw32(a, [&](__half2 o) {
    return __floats2half2_rn(__low2float(o) + __low2float(v), __high2float(o) + __high2float(v));
  });
}
// CUDA's *_block / *_system scoped variants behave the same here.
#define atomicAdd_block atomicAdd
#define atomicAdd_system atomicAdd

// ---------------------------------------------------------------------------------- bf16 / fp16 device-only math
// What cuda_bf16.h / cuda_fp16.h declare for device code only: computed in double or float and rounded
// once to the 16-bit type (round to nearest even).
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __double2bfloat16(double(__bfloat162float(a)) * __bfloat162float(b) + __bfloat162float(c));
}
inline __nv_bfloat16 __hfma_relu(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  const __nv_bfloat16 r = __hfma(a, b, c);
  return __bfloat162float(r) < 0.0f ? __float2bfloat16(0.0f) : r;
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return __halves2bfloat162(__hfma(__low2bfloat16(a), __low2bfloat16(b), __low2bfloat16(c)),
                            __hfma(__high2bfloat16(a), __high2bfloat16(b), __high2bfloat16(c)));
}
inline __half __hfma(__half a, __half b, __half c) {
  return __double2half(double(__half2float(a)) * __half2float(b) + __half2float(c));
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __halves2half2(__hfma(__low2half(a), __low2half(b), __low2half(c)),
                        __hfma(__high2half(a), __high2half(b), __high2half(c)));
}
inline __nv_bfloat16 hexp(__nv_bfloat16 x) { return __float2bfloat16(expf(__bfloat162float(x))); }
inline __nv_bfloat16 hlog(__nv_bfloat16 x) { return __float2bfloat16(logf(__bfloat162float(x))); }
inline __nv_bfloat16 hsqrt(__nv_bfloat16 x) { return __float2bfloat16(sqrtf(__bfloat162float(x))); }
inline __nv_bfloat16 hrsqrt(__nv_bfloat16 x) { return __float2bfloat16(1.0f / sqrtf(__bfloat162float(x))); }
inline __nv_bfloat16 hrcp(__nv_bfloat16 x) { return __float2bfloat16(1.0f / __bfloat162float(x)); }
inline __nv_bfloat16 htanh(__nv_bfloat16 x) { return __float2bfloat16(tanhf(__bfloat162float(x))); }
inline __nv_bfloat162 h2exp(__nv_bfloat162 x) { return __floats2bfloat162_rn(expf(__low2float(x)), expf(__high2float(x))); }
inline __nv_bfloat162 h2sqrt(__nv_bfloat162 x) { return __floats2bfloat162_rn(sqrtf(__low2float(x)), sqrtf(__high2float(x))); }
inline __half hexp(__half x) { return __float2half(expf(__half2float(x))); }
inline __half hlog(__half x) { return __float2half(logf(__half2float(x))); }
inline __half hsqrt(__half x) { return __float2half(sqrtf(__half2float(x))); }
inline __half hrsqrt(__half x) { return __float2half(1.0f / sqrtf(__half2float(x))); }
inline int __bfloat162int_rn(__nv_bfloat16 x) { return static_cast<int>(nearbyintf(__bfloat162float(x))); }
inline int __half2int_rn(__half x) { return static_cast<int>(nearbyintf(__half2float(x))); }

// ---------------------------------------------------------------------------------- loads and stores
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---------------------------------------------------------------------------------- fp32 intrinsics
// Device fast-math intrinsics computed with the accurate libm function (results agree with the GPU
// within the intrinsic's documented error, not bit for bit).
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return static_cast<unsigned>(nearbyintf(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }
inline int __float_as_int(float x) { int r; memcpy(&r, &x, 4); return r; }
inline unsigned __float_as_uint(float x) { unsigned r; memcpy(&r, &x, 4); return r; }
inline float __int_as_float(int x) { float r; memcpy(&r, &x, 4); return r; }
inline float __uint_as_float(unsigned x) { float r; memcpy(&r, &x, 4); return r; }
inline long long __double_as_longlong(double x) { long long r; memcpy(&r, &x, 8); return r; }
inline double __longlong_as_double(long long x) { double r; memcpy(&r, &x, 8); return r; }

// ---------------------------------------------------------------------------------- integer intrinsics
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
  return (x >> 16) | (x << 16);
}
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((uint64_t(a) * b) >> 32); }
inline int __mulhi(int a, int b) { return static_cast<int>((int64_t(a) * b) >> 32); }
inline int __mul24(int a, int b) { return (a << 8 >> 8) * (b << 8 >> 8); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
inline long long clock64() { return static_cast<long long>(__builtin_ia32_rdtsc()); }

// ---------------------------------------------------------------------------------- min / max
// CUDA's device overloads (the host headers do not declare them).
#define GPT2EMU_MINMAX(T)                              \
  inline T min(T a, T b) { return a < b ? a : b; }     \
  inline T max(T a, T b) { return a > b ? a : b; }
GPT2EMU_MINMAX(int)
GPT2EMU_MINMAX(unsigned int)
GPT2EMU_MINMAX(long)
GPT2EMU_MINMAX(unsigned long)
GPT2EMU_MINMAX(long long)
GPT2EMU_MINMAX(unsigned long long)
#undef GPT2EMU_MINMAX
inline unsigned min(int a, unsigned b) { return min(static_cast<unsigned>(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, static_cast<unsigned>(b)); }
inline unsigned max(int a, unsigned b) { return max(static_cast<unsigned>(a), b); }
inline unsigned max(unsigned a, int b) { return max(a, static_cast<unsigned>(b)); }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---------------------------------------------------------------------------------- cooperative groups
#include "emu/cooperative_groups.h"

// ---------------------------------------------------------------------------------- asynchronous copies
// cp.async (PTX ISA, "Data movement: cp.async"): each copy belongs to the calling thread's open group until
// cp.async.commit_group closes it; cp.async.wait_group N returns once every committed group but the N most recent
// has landed; cp.async.wait_all is commit_group then wait_group 0. Emulated with the data in flight made visible:
// at issue the source is read (bounds-checked) and the shared destination is filled with the poison pattern
// 0x7ff7fff7 (NaN as fp32, bf16 and fp16); the data lands only when the issuing thread's wait covers its group. The
// memory checker records issue and landing as writes by the issuing thread (so another warp's read needs a
// __syncthreads after the wait) and fails any access to a byte whose copy is still in flight (a missing wait).
namespace gpt2emu {
namespace detail {
void async_copy(void* dst, const void* src, int cp_size, int src_size, const void* pc);
void async_commit();
void async_wait(int n, const void* pc);  // n < 0: wait_all
}  // namespace detail
// cp.async.{ca,cg}.shared.global [dst], [src], cp_size, src_size: cp_size 4, 8 or 16 bytes, both addresses aligned
// to it, dst in shared memory; bytes src_size .. cp_size - 1 are zero-filled (src_size 0: src is not read).
// noinline: the return address is the call site in the kernel, which the checker's messages name.
__attribute__((noinline)) inline void cp_async(void* dst, const void* src, int cp_size, int src_size) {
  detail::async_copy(dst, src, cp_size, src_size, __builtin_return_address(0));
}
inline void cp_async_commit_group() { detail::async_commit(); }
__attribute__((noinline)) inline void cp_async_wait_group(int n) { detail::async_wait(n, __builtin_return_address(0)); }
__attribute__((noinline)) inline void cp_async_wait_all() { detail::async_wait(-1, __builtin_return_address(0)); }
}  // namespace gpt2emu

// ---------------------------------------------------------------------------------- warp matrix instructions
#include "emu/mma_emu.h"  // gpt2emu::mma_m16n8k16, ldmatrix_x4: what cuda/mma.cuh calls under GPT2CORE_EMU
