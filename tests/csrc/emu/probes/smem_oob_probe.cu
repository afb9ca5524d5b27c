// smem_oob_probe.cu: a kernel that writes one float past the end of its dynamic shared memory. Under
// the ASan build the emulator must report a heap-buffer-overflow in smem_oob_kernel.
#include "../emu_test.h"

__global__ void smem_oob_kernel(float* out) {
  DYNAMIC_SMEM(float, buf);  // blockDim.x floats
  buf[threadIdx.x + 1] = 1.0f;  // BUG: the last thread writes buf[blockDim.x]
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x];
}

int main() {
  const int n = 40;  // 160 bytes: not a multiple of any allocation granule above 32
  float* out = device_alloc<float>(n);
  LAUNCH(smem_oob_kernel, 1, n, n * sizeof(float), 0, out);
  TEST_CUDA(cudaGetLastError());
  printf("no error detected\n");
  return 0;
}
