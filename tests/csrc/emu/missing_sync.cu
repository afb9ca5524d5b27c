// missing_sync.cu: a kernel that forgot a __syncthreads between writing shared memory and reading a
// neighbour's slot. With the memory checker on, its launch fails with a report of the race under every
// schedule (printed as "report ..."). Without it the count of wrong answers depends only on the schedule
// (a read of a slot not yet written this block never equals the right value): "fwd" happens to give the
// right answer (thread i-1 runs before thread i), "rev" and most random schedules expose the race. The
// fixed kernel is right under every schedule. Prints "value racy_reported <0|1>",
// "value racy_mismatches <n>" and "value fixed_mismatches <n>".
#include "emu_test.h"

__global__ void shift_racy_kernel(float* out, int n) {
  __shared__ float buf[128];
  const int t = threadIdx.x;
  buf[t] = 1000.0f * blockIdx.x + t + 1;  // never 0 (fresh memory) nor another block's value
  // BUG: missing __syncthreads();
  out[blockIdx.x * n + t] = t > 0 ? buf[t - 1] : -1.0f;
}

__global__ void shift_fixed_kernel(float* out, int n) {
  __shared__ float buf[128];
  const int t = threadIdx.x;
  buf[t] = 1000.0f * blockIdx.x + t + 1;
  __syncthreads();
  out[blockIdx.x * n + t] = t > 0 ? buf[t - 1] : -1.0f;
}

static int mismatches(const float* d_out, int blocks, int n) {
  std::vector<float> got = to_host(d_out, size_t(blocks) * n);
  int bad = 0;
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < n; ++t) {
      const float want = t > 0 ? 1000.0f * b + t : -1.0f;
      bad += got[size_t(b) * n + t] != want;
    }
  return bad;
}

int main() {
  const int blocks = 8, n = 128;
  float* d_out = device_alloc<float>(size_t(blocks) * n);
  LAUNCH(shift_fixed_kernel, blocks, n, 0, 0, d_out, n);
  TEST_CUDA(cudaGetLastError());
  const int fixed = mismatches(d_out, blocks, n);
  printf("value fixed_mismatches %d\n", fixed);
  TEST_TRUE(fixed == 0, "the synchronised kernel is wrong");
  printf("ok fixed_kernel\n");
  LAUNCH(shift_racy_kernel, blocks, n, 0, 0, d_out, n);
  const cudaError_t e = cudaGetLastError();
  TEST_TRUE(e == cudaSuccess || e == cudaErrorLaunchFailure, "racy launch: %s", cudaGetErrorString(e));
  printf("value racy_reported %d\n", e == cudaErrorLaunchFailure);
  if (e == cudaErrorLaunchFailure) printf("report %s\n", cudaGetErrorString(e));
  else printf("value racy_mismatches %d\n", mismatches(d_out, blocks, n));
  return 0;
}
