// Compile check only (never linked into a build): the launchers of the modern architecture's kernels (rmsnorm.cuh,
// rope.cuh, relu2.cuh, the soft-capped classifier) for float, __nv_bfloat16 and __half, so that
// scripts/check_cuda_compile.py sees every instantiation through ptxas (warnings as errors, no register spills)
// whether or not the backend calls it yet.
#include "cuda/classifier.cuh"
#include "cuda/relu2.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"

namespace gpt2::cuda {

template <class X>
void instantiate_modern(X* a, X* b, X* c, float* s, float* l, int* t, int* n, int N, int C, int NH, cudaStream_t st) {
  rmsnorm_forward(a, s, b, N, C, 1e-6f, st);
  residual_rmsnorm_forward(a, b, s, c, a, N, C, 1e-6f, st);
  rmsnorm_backward(a, b, c, s, N, C, true, st);
  qknorm_forward(a, s, N, C, NH, 1e-6f, st);
  qknorm_backward(a, b, s, N, C, NH, st);
  rope_table(s, N, C / NH, 10000.0, st);
  rope_forward(a, s, 1, N, C, NH, 0, st);
  rope_backward(a, s, 1, N, C, NH, 0, st);
  relu2_forward(a, b, size_t(N) * C, st);
  relu2_backward(a, b, c, size_t(N) * C, false, st);
  softcap_forward(a, 15.0f, size_t(N) * C, st);
  crossentropy_backward(a, l, t, n, s, 1.0f, N, C, C, st, 15.0f);
  crossentropy_forward_backward(s, l, a, t, n, s, 1.0f, N, C, C, st, 15.0f);
}
template void instantiate_modern<float>(float*, float*, float*, float*, float*, int*, int*, int, int, int,
                                        cudaStream_t);
template void instantiate_modern<__nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, float*, float*, int*,
                                                int*, int, int, int, cudaStream_t);
template void instantiate_modern<__half>(__half*, __half*, __half*, float*, float*, int*, int*, int, int, int,
                                         cudaStream_t);

}  // namespace gpt2::cuda
