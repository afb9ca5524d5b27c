// oob_probe.cu: a kernel that reads one element past the end of its buffer. Under the ASan build the
// emulator must report a heap-buffer-overflow in oob_kernel (tests/csrc/emu/test_emu.py); it is not run otherwise.
#include "../emu_test.h"

__global__ void oob_kernel(float* out, const float* __restrict__ inp, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = inp[i + 1];  // BUG: the last thread reads inp[n]
}

int main() {
  const int n = 64;
  float* inp = to_device(std::vector<float>(n, 1.0f));
  float* out = device_alloc<float>(n);
  LAUNCH(oob_kernel, 1, n, 0, 0, out, inp, n);
  TEST_CUDA(cudaGetLastError());
  printf("no error detected\n");
  return 0;
}
