// runtime_internal.h: what runtime.cpp shares with runtime_api.cpp (not for kernels).
#pragma once

#include <cuda_runtime_api.h>

namespace gpt2emu::detail {

cudaError_t api_set_error(cudaError_t e, const char* msg);  // records e as this thread's last error
cudaError_t api_take_error();                                // returns and clears the last error
cudaError_t api_peek_error();
const char* api_message_for(cudaError_t e);                  // detailed message of the last e, or null
bool api_register_stream(const void* s, bool add);           // add or remove; false if unknown
void api_set_max_dyn_smem(const void* func, int bytes);

}  // namespace gpt2emu::detail
