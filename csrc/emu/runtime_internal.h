// runtime_internal.h: what runtime.cpp shares with runtime_api.cpp (not for kernels).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace gpt2emu::detail {

cudaError_t api_set_error(cudaError_t e, const char* msg);  // records e as this thread's last error
cudaError_t api_take_error();                                // returns and clears the last error
cudaError_t api_peek_error();
const char* api_message_for(cudaError_t e);                  // detailed message of the last e, or null
// add (made while `device` was current) or remove; false if unknown
bool api_register_stream(const void* s, bool add, int device = 0);
int api_current_device();  // this host thread's current device (cudaSetDevice)
void api_set_max_dyn_smem(const void* func, int bytes);

// ---- stream capture (graph.cpp). The refuse_* calls return cudaSuccess when the call may go on;
// otherwise they invalidate the capture(s) concerned, record the error with a message naming `call`,
// and return it.
bool capture_active();                         // is any stream capturing (cheap)
bool stream_capturing(const void* stream);
cudaError_t refuse_in_capture(const void* stream, cudaError_t e, const std::string& msg);
// Allocation, free or host synchronisation while a capture forbids this thread's unsafe calls;
// `why` completes the message "<call> during stream capture (<why>)".
cudaError_t refuse_unsafe_call(const char* call, const char* why);
// A host wait for `stream` (cudaStreamSynchronize / cudaStreamQuery): the capturing stream itself,
// the legacy stream, or any stream from a thread whose capture forbids unsafe calls.
cudaError_t refuse_stream_wait(const void* stream, const char* call);
void capture_forget_stream(const void* stream);  // cudaStreamDestroy of a capturing stream

}  // namespace gpt2emu::detail
