// Test-only entry to kernels of csrc/cuda called directly (tests/csrc/cuda/cuda_emu/threshold_ops.py), on host
// arrays, without a backend, so the threshold tests can put sizes on either side of each code-path change:
//   reduce.cuh: the two-pass column sum (column_sum_accumulate) and its pass 2 alone (column_reduce);
//   classifier.cuh: the one-block row loops over N (crossentropy_count_kernel, loss_accumulate_kernel), alone:
//   through the backend they come with N blocks of per-row kernels, too many to emulate at d12's N = 65,536. Device buffers
// are poisoned (all-ones bits: NaN) before the inputs are copied in, the scratch is left poisoned (the kernels must
// write every partial they read), and out starts from the given values (both passes accumulate into it).
// reduce.cuh defines a non-template kernel (column_reduce_kernel), which backend_cuda.cu's translation unit defines
// too: in this whole unit the namespace gpt2::cuda is renamed, so its copies are distinct symbols.
#define cuda cuda_reduce_ops
#include "cuda/classifier.cuh"
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
int column_sum(bool is_bf16, float* out, const void* inp, int N, int C, bool misalign) {
  using namespace gpt2::cuda_reduce_ops;
  const int s = misalign ? 1 : 0;
  const size_t n = size_t(N) * C;
  float* d_out = device_copy(out, size_t(C), 0);
  float* scratch = device_copy<float>(nullptr, size_t(column_chunks(N, C)) * C, 0);
  if (is_bf16) {
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
  gpt2::cuda_reduce_ops::column_reduce(d_out, d_part, R, C, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(out, d_out, size_t(C) * sizeof(float), cudaMemcpyDeviceToHost));
  device_free(d_out, 0);
  device_free(d_part, 0);
}

// The classifier's row loops: *count = number of targets >= 0 (crossentropy_count_kernel), then
// *acc += scale * sum(losses) / *count (loss_accumulate_kernel). Returns the count; acc is updated in place.
int loss_count_accumulate(float* acc, const int32_t* targets, const float* losses, int N, float scale) {
  using namespace gpt2::cuda_reduce_ops;
  int* d_count = device_copy<int>(nullptr, 1, 0);  // poisoned: the kernel must write it
  int* d_t = device_copy(reinterpret_cast<const int*>(targets), size_t(N), 0);
  float* d_l = device_copy(losses, size_t(N), 0);
  float* d_acc = device_copy(acc, 1, 0);
  LAUNCH(crossentropy_count_kernel, 1, 1024, 0, nullptr, d_count, d_t, N);
  CUDA_CHECK_LAUNCH();
  loss_accumulate(d_acc, d_l, d_count, N, scale, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  int count = 0;
  CUDA_CHECK(cudaMemcpy(&count, d_count, sizeof(int), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(acc, d_acc, sizeof(float), cudaMemcpyDeviceToHost));
  device_free(d_count, 0);
  device_free(d_t, 0);
  device_free(d_l, 0);
  device_free(d_acc, 0);
  return count;
}

}  // namespace gpt2emu_test
