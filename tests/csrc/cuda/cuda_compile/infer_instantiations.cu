// Compile-only: instantiates the KV-cache inference launchers (csrc/cuda/infer.cuh) for __nv_bfloat16 and __half so
// that scripts/check_cuda_compile.py reports registers, spills and shared memory of their 16-bit kernels.
// backend_cuda.cu instantiates all three types through the backend; this file compiles fast on its own. Never linked.
#include "cuda/infer.cuh"

namespace gpt2::cuda {

template <class floatX>
void instantiate_infer(floatX* out, floatX* kcache, floatX* vcache, const floatX* qkv, const int32_t* ids,
                       const int32_t* slot, const int32_t* pos, int32_t* ids_flags, const SampleArgs* args, int B,
                       int Tq, int C, int NH, int maxT, int V, int Vp, cudaStream_t stream) {
  encoder_forward_at(out, ids, qkv, qkv, pos, B, Tq, C, stream);
  attention_kv_forward(out, kcache, vcache, qkv, slot, pos, B, Tq, C, NH, maxT, decode_splits(B, Tq, NH, maxT, 132),
                       reinterpret_cast<float*>(kcache), stream);
  gather_rows(out, qkv, ids, B, C, stream);
  sample(ids_flags, qkv, args, B, V, Vp, stream);
}

template void instantiate_infer<__nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, const __nv_bfloat16*,
                                               const int32_t*, const int32_t*, const int32_t*, int32_t*,
                                               const SampleArgs*, int, int, int, int, int, int, int, cudaStream_t);
template void instantiate_infer<__half>(__half*, __half*, __half*, const __half*, const int32_t*, const int32_t*,
                                        const int32_t*, int32_t*, const SampleArgs*, int, int, int, int, int, int, int,
                                        cudaStream_t);
template void instantiate_infer<float>(float*, float*, float*, const float*, const int32_t*, const int32_t*,
                                       const int32_t*, int32_t*, const SampleArgs*, int, int, int, int, int, int, int,
                                       cudaStream_t);

}  // namespace gpt2::cuda
