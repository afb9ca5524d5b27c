// coop_groups.cu: the cooperative groups subset in llm.c's style: one warp per row with
// tiled_partition<32>, meta_group_rank / meta_group_size, cg::reduce with plus and greater, block.sync,
// and 8-wide tiles (shfl, ballot relative to the tile, any/all).
#include "emu_test.h"

#include <cmath>

namespace cg = cooperative_groups;

// mean[row] and max[row] of inp (N, C): one warp per row, several warps per block.
__global__ void row_stats_kernel(float* mean, float* mx, const float* __restrict__ inp, int N, int C) {
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
  const int row = blockIdx.x * warp.meta_group_size() + warp.meta_group_rank();
  if (row >= N) return;  // whole warps leave together
  float sum = 0.0f, m = -INFINITY;
  for (int i = warp.thread_rank(); i < C; i += warp.size()) {
    sum += inp[row * C + i];
    m = fmaxf(m, inp[row * C + i]);
  }
  sum = cg::reduce(warp, sum, cg::plus<float>{});
  m = cg::reduce(warp, m, cg::greater<float>{});
  if (warp.thread_rank() == 0) {
    mean[row] = sum / C;
    mx[row] = m;
  }
}

// Per 8-wide tile: tile sum via reduce, value of the tile's rank-3 thread, ballot of odd ranks, any/all.
__global__ void tile8_kernel(int* out) {
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<8> tile = cg::tiled_partition<8>(block);
  const int r = static_cast<int>(block.thread_rank());
  const int s = cg::reduce(tile, r, cg::plus<int>{});
  const int third = tile.shfl(r, 3);
  const unsigned odd = tile.ballot(tile.thread_rank() % 2 == 1);
  const int any = tile.any(r == 9), all = tile.all(r < 1000);
  block.sync();
  out[5 * r + 0] = s;
  out[5 * r + 1] = third;
  out[5 * r + 2] = static_cast<int>(odd);
  out[5 * r + 3] = any;
  out[5 * r + 4] = all;
  (void)tile.meta_group_size();
}

int main() {
  const int N = 37, C = 100;
  std::vector<float> h = random_floats(size_t(N) * C, 5);
  float* d_inp = to_device(h);
  float* d_mean = device_alloc<float>(N);
  float* d_max = device_alloc<float>(N);
  LAUNCH(row_stats_kernel, (N + 3) / 4, 128, 0, 0, d_mean, d_max, d_inp, N, C);
  TEST_CUDA(cudaGetLastError());
  std::vector<float> mean = to_host(d_mean, N), mx = to_host(d_max, N);
  for (int r = 0; r < N; ++r) {
    double s = 0;
    float m = -INFINITY;
    for (int i = 0; i < C; ++i) {
      s += h[size_t(r) * C + i];
      m = std::fmax(m, h[size_t(r) * C + i]);
    }
    TEST_TRUE(std::fabs(mean[r] - s / C) < 1e-6, "row %d mean %f vs %f", r, mean[r], s / C);
    TEST_TRUE(mx[r] == m, "row %d max", r);
  }
  printf("ok warp_per_row_reduce\n");

  int* d_out = device_alloc<int>(5 * 64);
  LAUNCH(tile8_kernel, 1, 64, 0, 0, d_out);
  TEST_CUDA(cudaGetLastError());
  std::vector<int> o = to_host(d_out, 5 * 64);
  for (int r = 0; r < 64; ++r) {
    const int base = r / 8 * 8;
    TEST_TRUE(o[5 * r] == 8 * base + 28, "tile sum thread %d: %d", r, o[5 * r]);
    TEST_TRUE(o[5 * r + 1] == base + 3, "tile shfl thread %d", r);
    TEST_TRUE(o[5 * r + 2] == 0xaa, "tile ballot thread %d: %x", r, o[5 * r + 2]);
    TEST_TRUE(o[5 * r + 3] == (base == 8) && o[5 * r + 4] == 1, "tile any/all thread %d", r);
  }
  printf("ok tile8\n");
  return 0;
}
