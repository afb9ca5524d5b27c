// runtime_api.cpp: the CUDA runtime API subset the project uses, against NVIDIA's declarations in
// cuda_runtime_api.h, for the emulated device. Memory is host memory; everything is synchronous.
// Fresh device allocations are filled with 0xFF bytes (NaN for fp32, bf16 and fp16).
// Stream-ordered calls (async copies and memsets, event records) go through gpt2emu::enqueue, so a
// capturing stream records them; allocations, frees and host synchronisations check the capture
// rules first (graph.cpp).
#include "emu/cuda_emu.h"
#include "emu/racecheck.h"
#include "emu/runtime_internal.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

struct ApiState {
  std::mutex m;
  std::unordered_map<const void*, size_t> device_allocs;
  std::unordered_map<const void*, int> alloc_device;  // the device current when each allocation was made
  std::map<const char*, size_t> host_allocs;  // pinned memory (cudaMallocHost), by base address
  std::unordered_map<const void*, double> events;  // recorded time in ms (or -1)
  int device = 0;
};
ApiState& st() {
  static ApiState* s = new ApiState();  // never destroyed: usable from static destructors
  return *s;
}

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

constexpr size_t kTotalMem = size_t(80) << 30;  // pretend H100 80 GB

// Test knobs: GPT2CORE_EMU_TOTAL_MEM (bytes of memory per device: cudaMemGetInfo and totalGlobalMem report it and
// cudaMalloc refuses beyond it, for tests of what the backend does when memory is short; default 80 GiB) and
// GPT2CORE_EMU_DEVICES (how many devices there are, 1 to 8; default 1: tests of code that keeps several GPUs apart).
size_t total_mem() {
  const char* v = std::getenv("GPT2CORE_EMU_TOTAL_MEM");
  const unsigned long long n = v ? strtoull(v, nullptr, 10) : 0;
  return n ? size_t(n) : kTotalMem;
}
int device_count() {
  const char* v = std::getenv("GPT2CORE_EMU_DEVICES");
  return v ? std::min(8, std::max(1, atoi(v))) : 1;
}
thread_local int t_device = 0;  // the current device, per host thread as in CUDA

// Bytes allocated on `device` (caller holds s.m).
size_t used_locked(ApiState& s, int device) {
  size_t used = 0;
  for (const auto& kv : s.device_allocs) {
    const auto it = s.alloc_device.find(kv.first);
    if ((it == s.alloc_device.end() ? 0 : it->second) == device) used += kv.second;
  }
  return used;
}

// 256-byte aligned like cudaMalloc, and exactly `size` bytes long so ASan reports any overflow.
void* aligned_block(size_t size) {
  void* m = nullptr;
  return posix_memalign(&m, 256, std::max<size_t>(size, 1)) == 0 ? m : nullptr;
}

cudaError_t fail(cudaError_t e, const char* msg) { return gpt2emu::detail::api_set_error(e, msg); }

// Reasons completing "<call> during stream capture (<why>)".
constexpr const char* kAllocates = "an allocation inside the captured region: allocate before capturing";
constexpr const char* kFrees = "a free synchronises the device: free after capturing";
constexpr const char* kSynchronises = "a host synchronisation inside the captured region";

// A device pointer argument must point into a live allocation with `n` bytes from it.
bool device_range_ok(const void* p, size_t n) {
  if (n == 0) return true;
  ApiState& s = st();
  std::lock_guard<std::mutex> lock(s.m);
  const char* c = static_cast<const char*>(p);
  for (const auto& [base, size] : s.device_allocs) {
    const char* b = static_cast<const char*>(base);
    if (c >= b && c + n <= b + size) return true;
  }
  return false;
}

// Whether [p, p + n) lies inside pinned host memory from cudaMallocHost / cudaHostAlloc.
bool pinned_range_ok(const void* p, size_t n) {
  ApiState& s = st();
  std::lock_guard<std::mutex> lock(s.m);
  const char* c = static_cast<const char*>(p);
  auto it = s.host_allocs.upper_bound(c);  // the first allocation above p; the one before may hold it
  if (it == s.host_allocs.begin()) return false;
  --it;
  return c + n <= it->first + it->second;
}

// The checks cudaMemcpy and cudaMemcpyAsync share: pointers, and device sides inside allocations.
cudaError_t check_memcpy(const char* call, void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  const std::string c = call;
  if (count && (!dst || !src)) return fail(cudaErrorInvalidValue, (c + ": null pointer").c_str());
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (dst_dev && !device_range_ok(dst, count))
    return fail(cudaErrorInvalidValue, (c + ": destination is not inside a device allocation").c_str());
  if (src_dev && !device_range_ok(src, count))
    return fail(cudaErrorInvalidValue, (c + ": source is not inside a device allocation").c_str());
  return cudaSuccess;
}

}  // namespace

namespace gpt2emu::detail {
int api_current_device() { return t_device; }
}  // namespace gpt2emu::detail

extern "C" {

cudaError_t cudaMalloc(void** p, size_t size) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaMalloc", kAllocates); e != cudaSuccess) return e;
  if (!p) return fail(cudaErrorInvalidValue, "cudaMalloc: null output pointer");
  {
    ApiState& s = st();
    std::lock_guard<std::mutex> lock(s.m);
    if (used_locked(s, t_device) + size > total_mem())
      return fail(cudaErrorMemoryAllocation, "cudaMalloc: out of memory (GPT2CORE_EMU_TOTAL_MEM)");
  }
  void* m = gpt2emu::detail::race::device_alloc(size);  // checked memory with guard zones, or
  if (!m) m = aligned_block(size);
  if (!m) return fail(cudaErrorMemoryAllocation, "cudaMalloc: out of memory");
  memset(m, 0xff, size);
  {
    ApiState& s = st();
    std::lock_guard<std::mutex> lock(s.m);
    s.device_allocs[m] = size;
    s.alloc_device[m] = t_device;
  }
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaMallocManaged(void** p, size_t size, unsigned int) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaMallocManaged", kAllocates); e != cudaSuccess)
    return e;
  return cudaMalloc(p, size);
}

cudaError_t cudaFree(void* p) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaFree", kFrees); e != cudaSuccess) return e;
  if (!p) return cudaSuccess;
  {
    ApiState& s = st();
    std::lock_guard<std::mutex> lock(s.m);
    if (!s.device_allocs.erase(p)) return fail(cudaErrorInvalidValue, "cudaFree: not a pointer from cudaMalloc");
    s.alloc_device.erase(p);
  }
  if (!gpt2emu::detail::race::device_free(p)) free(p);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, size_t size) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaMallocHost", kAllocates); e != cudaSuccess)
    return e;
  if (!p) return fail(cudaErrorInvalidValue, "cudaMallocHost: null output pointer");
  void* m = aligned_block(size);
  if (!m) return fail(cudaErrorMemoryAllocation, "cudaMallocHost: out of memory");
  memset(m, 0xff, size);
  {
    ApiState& s = st();
    std::lock_guard<std::mutex> lock(s.m);
    s.host_allocs[static_cast<const char*>(m)] = size;
  }
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** p, size_t size, unsigned int) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaHostAlloc", kAllocates); e != cudaSuccess)
    return e;
  return cudaMallocHost(p, size);
}

cudaError_t cudaFreeHost(void* p) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaFreeHost", kFrees); e != cudaSuccess) return e;
  if (!p) return cudaSuccess;
  {
    ApiState& s = st();
    std::lock_guard<std::mutex> lock(s.m);
    if (!s.host_allocs.erase(static_cast<const char*>(p)))
      return fail(cudaErrorInvalidValue, "cudaFreeHost: not a pointer from cudaMallocHost");
  }
  free(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaMemcpy", kSynchronises); e != cudaSuccess)
    return e;
  if (const cudaError_t e = check_memcpy("cudaMemcpy", dst, src, count, kind); e != cudaSuccess) return e;
  if (count) memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream) {
  const bool capturing = gpt2emu::detail::stream_capturing(stream);
  if (const cudaError_t e = check_memcpy("cudaMemcpyAsync", dst, src, count, kind); e != cudaSuccess)
    return capturing ? gpt2emu::detail::refuse_in_capture(stream, e, gpt2emu::last_error_message()) : e;
  // A graph copies from / to fixed addresses at each launch: CUDA accepts only device and pinned memory.
  for (const void* p : {static_cast<const void*>(dst), src}) {
    if (capturing && count && !device_range_ok(p, count) && !pinned_range_ok(p, count))
      return gpt2emu::detail::refuse_in_capture(
          stream, cudaErrorStreamCaptureUnsupported,
          "cudaMemcpyAsync of pageable host memory during stream capture (only pinned memory from "
          "cudaMallocHost / cudaHostAlloc can be captured)");
  }
  return gpt2emu::enqueue(stream, "cudaMemcpyAsync", [=] {
    if (count) memmove(dst, src, count);
    return cudaSuccess;
  });
}

cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                         enum cudaMemcpyKind) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaMemcpy2D", kSynchronises); e != cudaSuccess)
    return e;
  for (size_t r = 0; r < height; ++r)
    memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, size_t count) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaMemset", kSynchronises); e != cudaSuccess)
    return e;
  if (!device_range_ok(p, count)) return fail(cudaErrorInvalidValue, "cudaMemset: not inside a device allocation");
  if (count) memset(p, value, count);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t stream) {
  if (!device_range_ok(p, count)) {
    const char* msg = "cudaMemsetAsync: not inside a device allocation";
    return gpt2emu::detail::stream_capturing(stream)
               ? gpt2emu::detail::refuse_in_capture(stream, cudaErrorInvalidValue, msg)
               : fail(cudaErrorInvalidValue, msg);
  }
  return gpt2emu::enqueue(stream, "cudaMemsetAsync", [=] {
    gpt2emu::log_launch("{\"memset\": " + std::to_string(count) + "}");
    if (count) memset(p, value, count);
    return cudaSuccess;
  });
}

cudaError_t cudaMemcpyToSymbol(const void* symbol, const void* src, size_t count, size_t offset, enum cudaMemcpyKind) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaMemcpyToSymbol", kSynchronises); e != cudaSuccess)
    return e;
  memcpy(const_cast<char*>(static_cast<const char*>(symbol)) + offset, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyFromSymbol(void* dst, const void* symbol, size_t count, size_t offset, enum cudaMemcpyKind) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaMemcpyFromSymbol", kSynchronises);
      e != cudaSuccess)
    return e;
  memcpy(dst, static_cast<const char*>(symbol) + offset, count);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {  // of the current device
  size_t used = 0;
  {
    ApiState& s = st();
    std::lock_guard<std::mutex> lock(s.m);
    used = used_locked(s, t_device);
  }
  const size_t all = total_mem();
  if (total) *total = all;
  if (free_bytes) *free_bytes = used < all ? all - used : 0;
  return cudaSuccess;
}

// ---- streams and events (all work is already done when a call returns, unless a stream captures it)
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  if (!s) return fail(cudaErrorInvalidValue, "cudaStreamCreate: null output pointer");
  *s = reinterpret_cast<cudaStream_t>(new char[1]);
  gpt2emu::detail::api_register_stream(*s, true, t_device);
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (!gpt2emu::detail::api_register_stream(s, false))
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: not a stream");
  gpt2emu::detail::capture_forget_stream(s);
  delete[] reinterpret_cast<char*>(s);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (const cudaError_t e = gpt2emu::detail::refuse_stream_wait(s, "cudaStreamSynchronize"); e != cudaSuccess) return e;
  return gpt2emu::detail::api_take_error();
}
cudaError_t cudaStreamQuery(cudaStream_t s) { return gpt2emu::detail::refuse_stream_wait(s, "cudaStreamQuery"); }
// Work runs in stream order anyway; through enqueue for the capture rules (legacy stream, invalidated capture).
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t, unsigned int) {
  return gpt2emu::enqueue(s, "cudaStreamWaitEvent", [] { return cudaSuccess; });
}
cudaError_t cudaDeviceSynchronize(void) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaDeviceSynchronize", kSynchronises);
      e != cudaSuccess)
    return e;
  return gpt2emu::detail::api_take_error();
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  if (!e) return fail(cudaErrorInvalidValue, "cudaEventCreate: null output pointer");
  *e = reinterpret_cast<cudaEvent_t>(new char[1]);
  ApiState& s = st();
  std::lock_guard<std::mutex> lock(s.m);
  s.events[*e] = -1.0;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  {
    ApiState& s = st();
    std::lock_guard<std::mutex> lock(s.m);
    if (!s.events.erase(e)) return fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: not an event");
  }
  delete[] reinterpret_cast<char*>(e);
  return cudaSuccess;
}
// Takes the time when the stream reaches it: now, or at each launch of a graph that captured it.
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
  return gpt2emu::enqueue(stream, "cudaEventRecord", [e] {
    ApiState& s = st();
    std::lock_guard<std::mutex> lock(s.m);
    auto it = s.events.find(e);
    if (it == s.events.end()) return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: not an event");
    it->second = now_ms();
    return cudaSuccess;
  });
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
  if (const cudaError_t e = gpt2emu::detail::refuse_unsafe_call("cudaEventSynchronize", kSynchronises);
      e != cudaSuccess)
    return e;
  return gpt2emu::detail::api_take_error();
}
cudaError_t cudaEventQuery(cudaEvent_t) { return gpt2emu::detail::refuse_unsafe_call("cudaEventQuery", kSynchronises); }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  ApiState& s = st();
  std::lock_guard<std::mutex> lock(s.m);
  auto ia = s.events.find(a), ib = s.events.find(b);
  if (ia == s.events.end() || ib == s.events.end())
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: not an event");
  if (ia->second < 0 || ib->second < 0) return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: event not recorded");
  *ms = static_cast<float>(ib->second - ia->second);
  return cudaSuccess;
}

// ---- errors
cudaError_t cudaGetLastError(void) { return gpt2emu::detail::api_take_error(); }
cudaError_t cudaPeekAtLastError(void) { return gpt2emu::detail::api_peek_error(); }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  const char* detail = gpt2emu::detail::api_message_for(e);
  if (detail) return detail;
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorStreamCaptureUnjoined: return "capture sequence contains a fork that was not joined to the primary stream";
    default: return "unknown error (emulated device)";
  }
}

// ---- the pretend device: an sm_90 part with H100-like limits
cudaError_t cudaGetDeviceCount(int* n) {
  *n = device_count();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= device_count())
    return fail(cudaErrorInvalidDevice, "cudaSetDevice: no such emulated device (GPT2CORE_EMU_DEVICES)");
  t_device = d;
  return cudaSuccess;
}
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* p, int device) {
  if (device < 0 || device >= device_count())
    return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: no such emulated device (GPT2CORE_EMU_DEVICES)");
  memset(p, 0, sizeof *p);
  // sm_90 (an H100), or the capability GPT2CORE_EMU_COMPUTE_CAPABILITY names ("75": a T4), for tests of what the
  // backend refuses or picks on older GPUs
  const char* cc = std::getenv("GPT2CORE_EMU_COMPUTE_CAPABILITY");
  const int cap = cc ? std::atoi(cc) : 90;
  snprintf(p->name, sizeof p->name, "gpt2core emulated device (sm_%d, CPU)", cap);
  p->totalGlobalMem = total_mem();
  p->sharedMemPerBlock = 48 * 1024;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->memPitch = size_t(1) << 31;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024;
  p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647;
  p->maxGridSize[1] = 65535;
  p->maxGridSize[2] = 65535;
  p->totalConstMem = 65536;
  p->major = cap / 10;
  p->minor = cap % 10;
  p->textureAlignment = 512;
  p->multiProcessorCount = 132;
  p->concurrentKernels = 1;
  p->asyncEngineCount = 2;
  p->unifiedAddressing = 1;
  p->memoryBusWidth = 5120;
  p->l2CacheSize = 50 * 1024 * 1024;
  // threads per SM by family: 1024 on sm_75, 1536 on sm_86 / sm_89 (and sm_120), 2048 on sm_80 / sm_90
  p->maxThreadsPerMultiProcessor = cap == 75 ? 1024 : (cap == 86 || cap == 89 || cap >= 120) ? 1536 : 2048;
  p->sharedMemPerMultiprocessor = 228 * 1024;
  p->regsPerMultiprocessor = 65536;
  p->managedMemory = 1;
  p->cooperativeLaunch = 1;
  p->sharedMemPerBlockOptin = 227 * 1024;
  p->maxBlocksPerMultiProcessor = 32;
  p->reservedSharedMemPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, device);
  if (e != cudaSuccess) return e;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxBlockDimX: *value = p.maxThreadsDim[0]; break;
    case cudaDevAttrMaxBlockDimY: *value = p.maxThreadsDim[1]; break;
    case cudaDevAttrMaxBlockDimZ: *value = p.maxThreadsDim[2]; break;
    case cudaDevAttrMaxGridDimX: *value = p.maxGridSize[0]; break;
    case cudaDevAttrMaxGridDimY: *value = p.maxGridSize[1]; break;
    case cudaDevAttrMaxGridDimZ: *value = p.maxGridSize[2]; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(p.sharedMemPerBlock); break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(p.sharedMemPerBlockOptin); break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = static_cast<int>(p.sharedMemPerMultiprocessor); break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = p.maxThreadsPerMultiProcessor; break;
    case cudaDevAttrL2CacheSize: *value = p.l2CacheSize; break;
    case cudaDevAttrMaxRegistersPerBlock: *value = p.regsPerBlock; break;
    case cudaDevAttrManagedMemory: *value = 1; break;
    // GPT2CORE_EMU_NO_CONCURRENT_MANAGED_ACCESS: pretend a platform where the host must not touch managed memory
    // while the device runs (Windows, WSL), for testing that callers detect it
    case cudaDevAttrConcurrentManagedAccess:
      *value = std::getenv("GPT2CORE_EMU_NO_CONCURRENT_MANAGED_ACCESS") ? 0 : 1;
      break;
    default: return fail(cudaErrorNotSupported, "cudaDeviceGetAttribute: attribute not emulated");
  }
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > 227 * 1024)
      return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: MaxDynamicSharedMemorySize above the device's 227 KiB");
    gpt2emu::detail::api_set_max_dyn_smem(func, value);
  }
  return cudaSuccess;
}

}  // extern "C"
