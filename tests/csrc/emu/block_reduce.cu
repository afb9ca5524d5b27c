// block_reduce.cu: a shared-memory tree reduction per block (sum over each row), with 1-D and 2-D
// blocks, plus __syncthreads_count / _and / _or. Known answers computed on the host in double.
#include "emu_test.h"

#include <cmath>

// out[row] = sum_i inp[row, i]; one block per row, blockDim.x a power of two <= 256.
__global__ void row_sum_kernel(float* out, const float* __restrict__ inp, int C) {
  __shared__ float buf[256];
  const int row = blockIdx.x;
  float acc = 0.0f;
  for (int i = threadIdx.x; i < C; i += blockDim.x) acc += inp[row * C + i];
  buf[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) buf[threadIdx.x] += buf[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[row] = buf[0];
}

// Same with a 2-D block (x: 32 lanes, y: 8 rows of threads) and dynamic shared memory.
__global__ void row_sum_2d_kernel(float* out, const float* __restrict__ inp, int C) {
  DYNAMIC_SMEM(float, buf);  // blockDim.x * blockDim.y floats
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int nt = blockDim.x * blockDim.y;
  float acc = 0.0f;
  for (int i = t; i < C; i += nt) acc += inp[blockIdx.x * C + i];
  buf[t] = acc;
  __syncthreads();
  for (int stride = nt / 2; stride > 0; stride /= 2) {
    if (t < stride) buf[t] += buf[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = buf[0];
}

// counts[b] = number of threads with odd index, all/any flags.
__global__ void barrier_pred_kernel(int* counts) {
  const int odd = threadIdx.x & 1;
  const int c = __syncthreads_count(odd);
  const int a = __syncthreads_and(threadIdx.x < 1024);
  const int o = __syncthreads_or(threadIdx.x == 5);
  if (threadIdx.x == 0) {
    counts[3 * blockIdx.x + 0] = c;
    counts[3 * blockIdx.x + 1] = a;
    counts[3 * blockIdx.x + 2] = o;
  }
}

// Every thread of a 3-D grid of 3-D blocks writes its coordinates at its linear global index.
__global__ void coords_kernel(int* out) {
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const int g = block * blockDim.x * blockDim.y * blockDim.z + thread;
  out[2 * g] = block;
  out[2 * g + 1] = thread;
}

int main() {
  const int B = 37, C = 1000;
  std::vector<float> h = random_floats(size_t(B) * C, 1);
  float* d_inp = to_device(h);
  float* d_out = device_alloc<float>(B);
  std::vector<double> ref(B, 0.0);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < C; ++i) ref[b] += h[size_t(b) * C + i];

  for (int bs : {32, 64, 256}) {
    LAUNCH(row_sum_kernel, B, bs, 0, 0, d_out, d_inp, C);
    TEST_CUDA(cudaGetLastError());
    std::vector<float> got = to_host(d_out, B);
    for (int b = 0; b < B; ++b)  // fp32 sums of 1000 values in [-1, 1): ~1e-4 absolute
      TEST_TRUE(std::fabs(got[b] - ref[b]) < 1e-3, "block %d row %d: %f vs %f", bs, b, got[b], ref[b]);
  }
  printf("ok row_sum\n");

  const dim3 block2(32, 8);
  LAUNCH(row_sum_2d_kernel, dim3(B), block2, 256 * sizeof(float), 0, d_out, d_inp, C);
  TEST_CUDA(cudaGetLastError());
  std::vector<float> got = to_host(d_out, B);
  for (int b = 0; b < B; ++b) TEST_TRUE(std::fabs(got[b] - ref[b]) < 1e-3, "row %d: %f vs %f", b, got[b], ref[b]);
  printf("ok row_sum_2d\n");

  int* d_counts = device_alloc<int>(3 * 4);
  LAUNCH(barrier_pred_kernel, 4, 96, 0, 0, d_counts);
  TEST_CUDA(cudaDeviceSynchronize());
  std::vector<int> counts = to_host(d_counts, 12);
  for (int b = 0; b < 4; ++b)
    TEST_TRUE(counts[3 * b] == 48 && counts[3 * b + 1] == 1 && counts[3 * b + 2] == 1, "block %d: %d %d %d", b,
              counts[3 * b], counts[3 * b + 1], counts[3 * b + 2]);
  printf("ok syncthreads_count\n");

  const dim3 grid3(2, 3, 4), block3(4, 2, 3);
  const int total = 24 * 24;
  int* d_coords = device_alloc<int>(2 * total);
  LAUNCH(coords_kernel, grid3, block3, 0, 0, d_coords);
  TEST_CUDA(cudaGetLastError());
  std::vector<int> coords = to_host(d_coords, 2 * total);
  for (int g = 0; g < total; ++g)
    TEST_TRUE(coords[2 * g] == g / 24 && coords[2 * g + 1] == g % 24, "3-D index %d: %d %d", g, coords[2 * g],
              coords[2 * g + 1]);
  printf("ok grid_3d\n");

  TEST_CUDA(cudaFree(d_coords));
  TEST_CUDA(cudaFree(d_inp));
  TEST_CUDA(cudaFree(d_out));
  TEST_CUDA(cudaFree(d_counts));
  return 0;
}
