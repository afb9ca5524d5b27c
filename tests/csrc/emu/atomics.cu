// atomics.cu: atomics under contention from many blocks (which the emulator runs on several OS
// threads) and many threads: float/int/unsigned adds, min/max, CAS spin-free counters, exch, and
// bf16 / bf16x2 / fp16 adds where neighbouring 16-bit values share one 32-bit word.
#include "emu_test.h"

#include <cmath>

__global__ void contention_kernel(float* fsum, int* isum, unsigned* usum, int* imax, int* imin, unsigned* cas_count,
                                  unsigned long long* ull_sum) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(fsum, 1.0f);
  atomicAdd(isum, g % 7 - 3);
  atomicAdd(usum, 2u);
  atomicMax(imax, g);
  atomicMin(imin, -g);
  atomicAdd(ull_sum, 1ull << 33);
  // increment through a CAS loop, the pattern custom atomics use
  unsigned old = *cas_count, assumed;
  do {
    assumed = old;
    old = atomicCAS(cas_count, assumed, assumed + 1);
  } while (old != assumed);
}

// bf16: every thread adds 1 to element g % 4 (neighbours share words); bf16x2: adds (1, 2).
// Counts stay <= 256, so every partial sum is exact in bf16.
__global__ void bf16_kernel(__nv_bfloat16* h4, __nv_bfloat162* p2, __half* f4) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(&h4[g % 4], __float2bfloat16(1.0f));
  atomicAdd(p2, __floats2bfloat162_rn(1.0f, 2.0f));
  atomicAdd(&f4[g % 4], __float2half(1.0f));
}

int main() {
  const int blocks = 64, threads = 128, n = blocks * threads;
  float* fsum = device_alloc<float>(1);
  int* ints = device_alloc<int>(3);
  unsigned* uints = device_alloc<unsigned>(2);
  unsigned long long* ull = device_alloc<unsigned long long>(1);
  TEST_CUDA(cudaMemset(fsum, 0, sizeof(float)));
  TEST_CUDA(cudaMemset(ull, 0, sizeof(unsigned long long)));
  const int init_i[3] = {0, -1, 1};
  TEST_CUDA(cudaMemcpy(ints, init_i, sizeof init_i, cudaMemcpyHostToDevice));
  TEST_CUDA(cudaMemset(uints, 0, 2 * sizeof(unsigned)));
  LAUNCH(contention_kernel, blocks, threads, 0, 0, fsum, ints, uints, ints + 1, ints + 2, uints + 1, ull);
  TEST_CUDA(cudaGetLastError());
  const float f = to_host(fsum, 1)[0];
  std::vector<int> iv = to_host(ints, 3);
  std::vector<unsigned> uv = to_host(uints, 2);
  const unsigned long long u64 = to_host(ull, 1)[0];
  long long want_isum = 0;
  for (int g = 0; g < n; ++g) want_isum += g % 7 - 3;
  TEST_TRUE(f == float(n), "float sum %f", f);  // integers below 2^24 are exact in fp32
  TEST_TRUE(iv[0] == want_isum, "int sum %d vs %lld", iv[0], want_isum);
  TEST_TRUE(iv[1] == n - 1 && iv[2] == -(n - 1), "max/min %d %d", iv[1], iv[2]);
  TEST_TRUE(uv[0] == 2u * n && uv[1] == unsigned(n), "unsigned sum %u, CAS count %u", uv[0], uv[1]);
  TEST_TRUE(u64 == (unsigned long long)n << 33, "ull sum");
  printf("ok int_float_contention\n");

  __nv_bfloat16* h4 = device_alloc<__nv_bfloat16>(4);
  __nv_bfloat162* p2 = device_alloc<__nv_bfloat162>(1);
  __half* f4 = device_alloc<__half>(4);
  TEST_CUDA(cudaMemset(h4, 0, 4 * sizeof(__nv_bfloat16)));
  TEST_CUDA(cudaMemset(p2, 0, sizeof(__nv_bfloat162)));
  TEST_CUDA(cudaMemset(f4, 0, 4 * sizeof(__half)));
  LAUNCH(bf16_kernel, 8, 128, 0, 0, h4, p2, f4);  // 1024 threads: 256 per bf16 slot
  TEST_CUDA(cudaGetLastError());
  std::vector<__nv_bfloat16> hv = to_host(h4, 4);
  std::vector<__half> fv = to_host(f4, 4);
  const __nv_bfloat162 pv = to_host(p2, 1)[0];
  for (int i = 0; i < 4; ++i) {
    TEST_TRUE(__bfloat162float(hv[i]) == 256.0f, "bf16 slot %d: %f", i, __bfloat162float(hv[i]));
    TEST_TRUE(__half2float(fv[i]) == 256.0f, "fp16 slot %d: %f", i, __half2float(fv[i]));
  }
  // 1024 adds of (1, 2) in bf16: the low half saturates at 256 (256 + 1 rounds back to 256 in bf16,
  // 8 bits of mantissa), the high half at 512 for the same reason.
  TEST_TRUE(__low2float(pv) == 256.0f && __high2float(pv) == 512.0f, "bf16x2 (%f, %f)", __low2float(pv),
            __high2float(pv));
  printf("ok bf16_fp16_contention\n");
  return 0;
}
