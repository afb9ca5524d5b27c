// Compile-only: instantiates the tensor-core attention launchers (attention_tc.cuh) for both 16-bit storage types,
// __half (fp16: sm_75's m16n8k8 path below sm_80) and __nv_bfloat16, and the CUDA-core attention for __half (the
// fp16 fallback where the tensor-core tiles do not fit, hs = 128 on sm_75), so that scripts/check_cuda_compile.py
// reports their registers, spills and shared memory per architecture without compiling the whole backend.
// Never linked into anything.
#include "cuda/attention_tc.cuh"

namespace gpt2::cuda {

template <class floatX>
void instantiate_attention_tc(floatX* out, float* lse, float* scratch, floatX* dqkv, const floatX* dout,
                              const floatX* qkv, int B, int T, int C, int NH, cudaStream_t stream) {
  attention_tc_forward(out, lse, qkv, B, T, C, NH, stream);
  attention_tc_backward(dqkv, dout, qkv, out, lse, scratch, B, T, C, NH, true, stream);  // both: a run-time switch
}
template void instantiate_attention_tc(__half*, float*, float*, __half*, const __half*, const __half*, int, int, int,
                                       int, cudaStream_t);
template void instantiate_attention_tc(__nv_bfloat16*, float*, float*, __nv_bfloat16*, const __nv_bfloat16*,
                                       const __nv_bfloat16*, int, int, int, int, cudaStream_t);

void instantiate_attention_f16(__half* out, float* lse, float* scratch, __half* dqkv, const __half* dout,
                               const __half* qkv, int B, int T, int C, int NH, cudaStream_t stream) {
  attention_forward(out, lse, qkv, B, T, C, NH, stream);
  attention_backward(dqkv, dout, qkv, out, lse, scratch, B, T, C, NH, stream);
}

}  // namespace gpt2::cuda
