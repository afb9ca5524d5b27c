// Error handling shared by the GPU-only seam implementations (seams_cublaslt.cu, seams_cudnn.cu): inside, a
// failed call throws (CUDA_CHECK_THROW: file, line and CUDA's message); at the seam, run_guarded turns any
// exception or pending CUDA error into the cudaError_t result and keeps the message for the caller (seams never
// throw; see csrc/cuda/seams.h).
#pragma once
#include <cuda_runtime_api.h>

#include <exception>
#include <stdexcept>
#include <string>

#define CUDA_CHECK_THROW(call)                                                                              \
  do {                                                                                                      \
    cudaError_t e_ = (call);                                                                                \
    if (e_ != cudaSuccess)                                                                                  \
      throw std::runtime_error(std::string("CUDA error at ") + __FILE__ + ":" + std::to_string(__LINE__) + \
                               " (" #call "): " + cudaGetErrorString(e_));                                  \
  } while (0)

namespace gpt2core::seams {

// f() with exceptions and launch errors as a cudaError_t; their message goes to last_error. A launch error
// counts only when f() raised it: one already pending before the call (an unrelated earlier launch's) is left
// for its owner's check, unread, instead of being reported as this call's.
template <class F>
cudaError_t run_guarded(std::string& last_error, F&& f) {
  const bool pending_before = cudaPeekAtLastError() != cudaSuccess;
  try {
    f();
  } catch (const std::exception& ex) {
    last_error = ex.what();
    return cudaErrorUnknown;
  }
  if (pending_before) return cudaSuccess;
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) last_error = cudaGetErrorString(e);
  return e;
}

// cudaFree that never throws nor leaves an error pending (destructors, cleanup).
inline void free_quietly(void* p) {
  if (p && cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
}

// Frees (with free_one) and erases the entries of a map keyed by (device, stream) whose stream is `stream`: the
// per-stream library workspaces of a backend that goes away.
template <class Map, class Free>
void release_stream(Map& by_device_stream, void* stream, Free free_one) {
  for (auto it = by_device_stream.begin(); it != by_device_stream.end();) {
    if (it->first.second != stream) {
      ++it;
      continue;
    }
    free_one(it->second);
    it = by_device_stream.erase(it);
  }
}

}  // namespace gpt2core::seams
