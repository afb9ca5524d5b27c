// Test-only entry to csrc/cuda/reduce.cuh (tests/csrc/cuda/cuda_emu/threshold_ops.py): the two-pass column sum
// (column_sum_accumulate) and its pass 2 alone (column_reduce) on host arrays, without a backend, so the threshold
// tests can put N, C and the chunk count R on either side of each of the kernels' code-path changes. Device buffers
// are poisoned (all-ones bits: NaN) before the inputs are copied in, the scratch is left poisoned (the kernels must
// write every partial they read), and out starts from the given values (both passes accumulate into it).
#include "cuda/reduce.cuh"

#include <cstdint>
#include <cstring>
#include <vector>

namespace gpt2emu_test {

namespace {
template <class E>
E* device_copy(const E* host, size_t n, int shift) {
  E* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, (n + shift) * sizeof(E)));
  CUDA_CHECK(cudaMemset(d, 0xff, (n + shift) * sizeof(E)));
  if (host) CUDA_CHECK(cudaMemcpy(d + shift, host, n * sizeof(E), cudaMemcpyHostToDevice));
  return d + shift;
}
template <class E>
void device_free(E* p, int shift) {
  CUDA_CHECK(cudaFree(p - shift));
}
}  // namespace

// out (C) += column sums of inp (N, C); bf16: inp holds bf16 bits. misalign: inp starts one element into its
// allocation (the K = 1 path). Returns the chunk count R the launcher used.
int column_sum(bool bf16, float* out, const void* inp, int N, int C, bool misalign) {
  using namespace gpt2::cuda;
  const int s = misalign ? 1 : 0;
  const size_t n = size_t(N) * C;
  float* d_out = device_copy(out, size_t(C), 0);
  float* scratch = device_copy<float>(nullptr, size_t(column_chunks(N, C)) * C, 0);
  if (bf16) {
    auto* d_inp = device_copy(static_cast<const bf16*>(inp), n, s);
    column_sum_accumulate<bf16>(d_out, d_inp, scratch, N, C, nullptr);
    device_free(d_inp, s);
  } else {
    auto* d_inp = device_copy(static_cast<const float*>(inp), n, s);
    column_sum_accumulate<float>(d_out, d_inp, scratch, N, C, nullptr);
    device_free(d_inp, s);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(out, d_out, size_t(C) * sizeof(float), cudaMemcpyDeviceToHost));
  device_free(d_out, 0);
  device_free(scratch, 0);
  return column_chunks(N, C);
}

// out (C) += sum_r partial[r, c] (pass 2 alone, R rows of partial sums).
void column_reduce(float* out, const float* partial, int R, int C) {
  float* d_out = device_copy(out, size_t(C), 0);
  float* d_part = device_copy(partial, size_t(R) * C, 0);
  gpt2::cuda::column_reduce(d_out, d_part, R, C, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(out, d_out, size_t(C) * sizeof(float), cudaMemcpyDeviceToHost));
  device_free(d_out, 0);
  device_free(d_part, 0);
}

}  // namespace gpt2emu_test
