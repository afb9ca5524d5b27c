// Compile check only (never linked into a build): explicit instantiations of every kernel launcher of
// csrc/cuda for the bf16 storage type (and the float launchers backend_cuda.cu does not call yet), so
// `scripts/check_cuda_compile.py` sees their kernels through ptxas: warnings as errors, no register spills.
//
//   python scripts/check_cuda_compile.py --archs 80,90 -I csrc tests/csrc/cuda/cuda_compile/bf16_instantiations.cu
#include "cuda/adamw.cuh"
#include "cuda/classifier.cuh"
#include "cuda/encoder.cuh"
#include "cuda/gelu.cuh"
#include "cuda/layernorm.cuh"
#include "cuda/matmul.cuh"
#include "cuda/reduce.cuh"
#include "cuda/residual.cuh"

namespace gpt2::cuda {

using X = __nv_bfloat16;

template void encoder_forward<X>(X*, const int*, const X*, const X*, int, int, int, cudaStream_t);
template void encoder_backward<X>(float*, float*, const X*, const int*, int, int, int, cudaStream_t);
template void layernorm_forward<X>(X*, float*, float*, const X*, const X*, const X*, int, int, cudaStream_t);
template void residual_layernorm_forward<X>(X*, X*, float*, float*, const X*, const X*, const X*, const X*, int, int,
                                            cudaStream_t);
template void residual_layernorm_forward<float>(float*, float*, float*, float*, const float*, const float*,
                                                const float*, const float*, int, int, cudaStream_t);
template void layernorm_backward<X>(X*, float*, float*, const X*, const X*, const X*, const float*, const float*,
                                    float*, int, int, bool, cudaStream_t);
template void matmul_forward<X>(X*, const X*, const X*, const X*, int, int, int, MatmulMode, cudaStream_t);
template void matmul_backward<X>(X*, float*, float*, const X*, const X*, const X*, float*, int, int, int, bool,
                                 MatmulMode, cudaStream_t);
template void matmul_backward_weights<X>(float*, float*, const X*, const X*, float*, int, int, int, MatmulMode,
                                         cudaStream_t);
template bool matmul_gelu_forward<X>(X*, X*, const X*, const X*, const X*, int, int, int, MatmulMode, cudaStream_t);
template bool gelu_matmul_backward<X>(X*, float*, float*, const X*, const X*, const X*, const X*, float*, int, int,
                                      int, MatmulMode, cudaStream_t);
template void column_sum_accumulate<X>(float*, const X*, float*, int, int, cudaStream_t);
template void gelu_forward<X>(X*, const X*, size_t, cudaStream_t);
template void gelu_backward<X>(X*, const X*, const X*, size_t, cudaStream_t);
template void residual_forward<X>(X*, const X*, const X*, size_t, cudaStream_t);
template void crossentropy_forward<X>(float*, float*, const X*, const int*, int*, int, int, int, cudaStream_t);
template void crossentropy_backward<X>(X*, const float*, const int*, const int*, const float*, float, int, int, int,
                                       cudaStream_t, float);
template void crossentropy_forward_backward<X>(float*, float*, X*, const int*, int*, const float*, float, int, int, int,
                                               cudaStream_t, float);
template void adamw_update<X>(X*, float*, const float*, float*, float*, const AdamWSpan*, int, const AdamWParams&,
                              cudaStream_t);
template void cast_params<X>(X*, const float*, size_t, uint32_t, size_t, cudaStream_t);
template void cast_params<float>(float*, const float*, size_t, uint32_t, size_t, cudaStream_t);

}  // namespace gpt2::cuda
