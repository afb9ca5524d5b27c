// Compile-only: instantiates every attention launcher (flash and naive, forward and backward) for
// __nv_bfloat16 so that scripts/check_cuda_compile.py (which compiles csrc/cuda/*.cu and tests/csrc/cuda/cuda_compile/*.cu)
// reports registers, spills and shared memory of the bf16 kernels. backend_cuda.cu instantiates the float ones.
// Never linked into anything.
#include "cuda/attention.cuh"
#include "cuda/attention_naive.cuh"

namespace gpt2::cuda {

void instantiate_attention_bf16(__nv_bfloat16* out, float* lse, float* att, float* scratch, __nv_bfloat16* dqkv,
                                const __nv_bfloat16* dout, const __nv_bfloat16* qkv, int B, int T, int C, int NH,
                                cudaStream_t stream) {
  attention_forward(out, lse, qkv, B, T, C, NH, stream);
  attention_backward(dqkv, dout, qkv, out, lse, scratch, B, T, C, NH, stream);
  attention_naive_forward(out, att, qkv, B, T, C, NH, stream);
  attention_naive_backward(dqkv, dout, qkv, att, scratch, B, T, C, NH, stream);
}

}  // namespace gpt2::cuda
