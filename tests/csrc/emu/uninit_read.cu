// uninit_read.cu: memory nobody wrote reads as NaN: fresh cudaMalloc buffers (fp32, bf16, fp16) and
// dynamic shared memory (filled at every block start, so one block cannot see another's values). With
// the memory checker on, a read of shared memory no thread of the block wrote fails the launch instead.
#include "emu_test.h"

#include <cmath>
#include <cstring>

// out[i] = 2 * inp[i] where only the first n_written entries of inp were ever written.
__global__ void scale_kernel(float* out, const float* __restrict__ inp, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = 2.0f * inp[i];
}

__global__ void bf16_to_float_kernel(float* out, const __nv_bfloat16* __restrict__ a, const __half* __restrict__ b,
                                     int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __bfloat162float(a[i]) + __half2float(b[i]);
}

// Each thread writes its dynamic smem slot only when `write` is set, then reads its neighbour's slot.
__global__ void smem_read_kernel(float* out, int write) {
  DYNAMIC_SMEM(float, buf);
  if (write) buf[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}

int main() {
  const int n = 300, written = 100;
  float* d_inp = device_alloc<float>(n);
  float* d_out = device_alloc<float>(n);
  std::vector<float> h(written, 1.5f);
  TEST_CUDA(cudaMemcpy(d_inp, h.data(), written * sizeof(float), cudaMemcpyHostToDevice));
  LAUNCH(scale_kernel, (n + 127) / 128, 128, 0, 0, d_out, d_inp, n);
  TEST_CUDA(cudaGetLastError());
  std::vector<float> got = to_host(d_out, n);
  for (int i = 0; i < n; ++i) {
    if (i < written) TEST_TRUE(got[i] == 3.0f, "written element %d: %f", i, got[i]);
    else TEST_TRUE(std::isnan(got[i]), "unwritten element %d is not NaN: %f", i, got[i]);
  }
  printf("ok global_fp32_nan\n");

  __nv_bfloat16* d_a = device_alloc<__nv_bfloat16>(n);
  __half* d_b = device_alloc<__half>(n);
  LAUNCH(bf16_to_float_kernel, (n + 127) / 128, 128, 0, 0, d_out, d_a, d_b, n);
  TEST_CUDA(cudaGetLastError());
  got = to_host(d_out, n);
  for (int i = 0; i < n; ++i) TEST_TRUE(std::isnan(got[i]), "unwritten bf16/fp16 element %d is not NaN", i);
  printf("ok global_bf16_fp16_nan\n");

  // Blocks that write first see their values; blocks that do not see NaN, not a previous block's data.
  float* d_sm = device_alloc<float>(4 * 64);
  LAUNCH(smem_read_kernel, 4, 64, 64 * sizeof(float), 0, d_sm, 1);
  TEST_CUDA(cudaGetLastError());
  got = to_host(d_sm, 4 * 64);
  for (int i = 0; i < 4 * 64; ++i) TEST_TRUE(got[i] == float((i % 64 + 1) % 64), "smem written %d", i);

  TEST_CUDA(cudaMemset(d_out, 0, n * sizeof(float)));
  got = to_host(d_out, n);
  for (float v : got) TEST_TRUE(v == 0.0f, "cudaMemset");
  printf("ok memset\n");

  LAUNCH(smem_read_kernel, 4, 64, 64 * sizeof(float), 0, d_sm, 0);
#if GPT2CORE_EMU
  if (gpt2emu::memory_checker_enabled()) {
    const cudaError_t e = cudaGetLastError();
    TEST_TRUE(e == cudaErrorLaunchFailure && strstr(cudaGetErrorString(e), "uninitialised shared memory"),
              "unwritten dynamic smem read not reported: %s", cudaGetErrorString(e));
    printf("ok dynamic_smem_uninitialised_read_reported\n");
    return 0;
  }
#endif
  TEST_CUDA(cudaGetLastError());
  got = to_host(d_sm, 4 * 64);
  for (int i = 0; i < 4 * 64; ++i) TEST_TRUE(std::isnan(got[i]), "unwritten dynamic smem %d is not NaN: %f", i, got[i]);
  printf("ok dynamic_smem_nan\n");
  return 0;
}
