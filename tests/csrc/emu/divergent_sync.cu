// divergent_sync.cu: kernels that break CUDA's synchronisation rules. Each launch must fail with
// cudaErrorLaunchFailure and a message naming the kernel (never abort the process), and a correct
// launch afterwards must work. Also launch-configuration errors.
#include "emu_test.h"

#include <cstring>
#include <stdexcept>

constexpr unsigned FULL = 0xffffffffu;

// Half the block returns before the barrier. (Each block writes its own part of out: with both blocks writing the
// same values the race checker could report that race first, whichever block the schedule ran first.)
__global__ void early_exit_sync_kernel(float* out) {
  if (threadIdx.x >= 16) return;
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
  __syncthreads();
}

// The two halves wait at different __syncthreads calls.
__global__ void split_sync_kernel(float* out) {
  if (threadIdx.x < 16) {
    out[threadIdx.x] = 1.0f;
    __syncthreads();
  } else {
    __syncthreads();
    out[threadIdx.x] = 2.0f;
  }
}

// A full-mask shuffle after some lanes of the warp exited.
__global__ void shfl_exited_lane_kernel(float* out, int n) {
  const int i = threadIdx.x;
  if (i >= n) return;
  out[i] = __shfl_xor_sync(FULL, 1.0f * i, 1);
}

// The caller is not in its own mask.
__global__ void shfl_bad_mask_kernel(float* out) {
  out[threadIdx.x] = __shfl_sync(0x1u, 1.0f, 0);
}

// Width that is not a power of two.
__global__ void shfl_bad_width_kernel(float* out) {
  out[threadIdx.x] = __shfl_down_sync(FULL, 1.0f, 1, 12);
}

// Lanes of one warp in different collectives.
__global__ void mismatched_collectives_kernel(float* out) {
  if (threadIdx.x % 2) out[threadIdx.x] = __shfl_sync(FULL, 1.0f, 0);
  else out[threadIdx.x] = static_cast<float>(__ballot_sync(FULL, 1));
}

// A warp collective while other lanes wait at a block barrier.
__global__ void warp_vs_block_barrier_kernel(float* out) {
  if (threadIdx.x == 0) __syncthreads();
  else out[threadIdx.x] = __shfl_sync(FULL, 1.0f, 1);
}

// One thread traps: the launch fails (as it would on the GPU, with an unrecoverable error there).
__global__ void trap_kernel(float* out) {
  if (threadIdx.x == 5) __trap();
  out[threadIdx.x] = 1.0f;
}

#if GPT2CORE_EMU
// Emulator only (device code cannot throw): a C++ exception leaving a kernel fails the launch.
__global__ void throwing_kernel(float* out) {
  if (threadIdx.x == 7) throw std::runtime_error("boom");
  out[threadIdx.x] = 1.0f;
}
#endif

__global__ void fill_kernel(float* out, float v) { out[blockIdx.x * blockDim.x + threadIdx.x] = v; }

static void expect_failure(const char* kernel, const char* fragment) {
  const cudaError_t e = cudaGetLastError();
  const char* msg = cudaGetErrorString(e);
  TEST_TRUE(e == cudaErrorLaunchFailure, "%s: expected cudaErrorLaunchFailure, got %d (%s)", kernel, int(e), msg);
  TEST_TRUE(strstr(msg, kernel) != nullptr, "message does not name the kernel: %s", msg);
  TEST_TRUE(strstr(msg, fragment) != nullptr, "message lacks '%s': %s", fragment, msg);
  TEST_TRUE(cudaGetLastError() == cudaSuccess, "the error is not cleared after cudaGetLastError");
  printf("ok %s: %s\n", kernel, msg);
}

int main() {
  float* d = device_alloc<float>(4096);
  LAUNCH(early_exit_sync_kernel, 2, 32, 0, 0, d);
  expect_failure("early_exit_sync_kernel", "reached by 16 of 32 threads");
  LAUNCH(split_sync_kernel, 1, 64, 0, 0, d);
  expect_failure("split_sync_kernel", "divergent __syncthreads");
  LAUNCH(shfl_exited_lane_kernel, 1, 32, 0, 0, d, 20);
  expect_failure("shfl_exited_lane_kernel", "has exited");
  LAUNCH(shfl_bad_mask_kernel, 1, 32, 0, 0, d);
  expect_failure("shfl_bad_mask_kernel", "not in its mask");
  LAUNCH(shfl_bad_width_kernel, 1, 32, 0, 0, d);
  expect_failure("shfl_bad_width_kernel", "power of two");
  LAUNCH(mismatched_collectives_kernel, 1, 32, 0, 0, d);
  expect_failure("mismatched_collectives_kernel", "meets lane");
  LAUNCH(warp_vs_block_barrier_kernel, 1, 32, 0, 0, d);
  expect_failure("warp_vs_block_barrier_kernel", "deadlock");

  LAUNCH(trap_kernel, 1, 32, 0, 0, d);
  expect_failure("trap_kernel", "__trap()");
#if GPT2CORE_EMU
  LAUNCH(throwing_kernel, 1, 32, 0, 0, d);
  expect_failure("throwing_kernel", "boom");
#endif

  // The failure surfaces at the next synchronising call too, when nobody asked cudaGetLastError.
  LAUNCH(early_exit_sync_kernel, 1, 32, 0, 0, d);
  TEST_TRUE(cudaDeviceSynchronize() == cudaErrorLaunchFailure, "cudaDeviceSynchronize did not report the failure");
  printf("ok failure_at_synchronize\n");

  // Launch configuration errors.
  LAUNCH(fill_kernel, 1, 2048, 0, 0, d, 1.0f);
  TEST_TRUE(cudaGetLastError() == cudaErrorInvalidConfiguration, "2048 threads per block accepted");
  LAUNCH(fill_kernel, 1, 32, 64 * 1024, 0, d, 1.0f);
  TEST_TRUE(cudaGetLastError() == cudaErrorInvalidValue, "64 KiB dynamic smem accepted without opt-in");
  TEST_CUDA(cudaFuncSetAttribute(fill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
  LAUNCH(fill_kernel, 1, 32, 64 * 1024, 0, d, 1.0f);
  TEST_CUDA(cudaGetLastError());
  printf("ok launch_configuration\n");

  // The emulator is still healthy.
  LAUNCH(fill_kernel, 4, 256, 0, 0, d, 3.0f);
  TEST_CUDA(cudaGetLastError());
  std::vector<float> h = to_host(d, 1024);
  for (float v : h) TEST_TRUE(v == 3.0f, "fill after failures: %f", v);
  printf("ok recovers\n");
  TEST_CUDA(cudaFree(d));
  return 0;
}
