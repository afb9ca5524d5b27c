// Compile check only (never linked into a build): the FP8 kernels and launchers of csrc/cuda/fp8.cuh and the FP8
// Linear launchers of matmul.cuh, for the storage types the backend quantises (bf16 and float), so
// scripts/check_cuda_compile.py sees them through ptxas on every arch: sm_89 / sm_90 take the hardware's
// cvt.rn.satfinite (__nv_cvt_float_to_fp8), older archs model/fp8.h's bit-exact conversion.
//
//   python scripts/check_cuda_compile.py --archs 75,89,90 -I csrc tests/csrc/cuda/cuda_compile/fp8_instantiations.cu
#include "cuda/fp8.cuh"
#include "cuda/matmul.cuh"

namespace gpt2::cuda {

using X = __nv_bfloat16;

template void fp8_quantize<X>(uint8_t*, uint8_t*, float*, const X*, int, int, ::gpt2::Fp8Kind, cudaStream_t);
template void fp8_quantize<float>(uint8_t*, uint8_t*, float*, const float*, int, int, ::gpt2::Fp8Kind, cudaStream_t);
template void fp8_linear_forward<X>(X*, const uint8_t*, const float*, const uint8_t*, const float*, const X*, int, int,
                                    int, MatmulMode, cudaStream_t);
template void fp8_linear_backward<X>(X*, float*, const uint8_t*, const uint8_t*, const float*, const uint8_t*,
                                     const float*, const uint8_t*, const float*, int, int, int, bool, MatmulMode,
                                     cudaStream_t);

}  // namespace gpt2::cuda
