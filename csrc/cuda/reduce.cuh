// Deterministic column sums over the rows of a (N, C) matrix, without float atomics, in two passes:
//   pass 1 (column_partial_sum_kernel): partial[r, c] = sum of rows in chunk r of column c, one block per
//           (32 columns, chunk), 8 row-threads per column combined in a fixed order;
//   pass 2 (column_reduce_kernel): out[c] += sum_r partial[r, c], r in order.
// The chunking depends only on N, so results are bit-identical run to run and GPU to GPU.
// Used for bias gradients (dbias[o] += sum_n dout[n, o]); layernorm.cuh reuses pass 2.
// The input has the storage type floatX (float, bf16 or fp16); partial sums and out are fp32.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kColTile = 32;   // columns per block (threadIdx.x)
constexpr int kColRows = 8;    // row-threads per block (threadIdx.y)

// Number of row chunks for N rows, and the rows per chunk.
inline int column_chunks(int N) { return N <= 0 ? 0 : (ceil_div(N, 64) < 1024 ? ceil_div(N, 64) : 1024); }
inline int column_chunk_rows(int N) { return ceil_div(N, column_chunks(N)); }

template <class floatX>
__global__ void column_partial_sum_kernel(float* __restrict__ partial,     // (R, C)
                                          const floatX* __restrict__ inp,  // (N, C)
                                          int N, int C, int rows_per_chunk) {
  __shared__ float sh[kColRows][kColTile + 1];
  const int c = blockIdx.x * kColTile + threadIdx.x;
  const int r0 = blockIdx.y * rows_per_chunk;
  const int r1 = min(N, r0 + rows_per_chunk);
  float s = 0.0f;
  if (c < C)
    for (int n = r0 + threadIdx.y; n < r1; n += kColRows) s += load_f(inp[size_t(n) * C + c]);
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.0f;
    for (int y = 0; y < kColRows; y++) t += sh[y][threadIdx.x];
    partial[size_t(blockIdx.y) * C + c] = t;
  }
}

__global__ void column_reduce_kernel(float* __restrict__ out,            // (C), accumulated into
                                     const float* __restrict__ partial,  // (R, C)
                                     int R, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int r = 0; r < R; r++) s += partial[size_t(r) * C + c];
  out[c] += s;
}

// out[c] += sum_n inp[n, c]. scratch: at least column_chunks(N) * C floats of device memory.
template <class floatX>
void column_sum_accumulate(float* out, const floatX* inp, float* scratch, int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const int R = column_chunks(N);
  dim3 grid(ceil_div(C, kColTile), R), block(kColTile, kColRows);
  LAUNCH(column_partial_sum_kernel<floatX>, grid, block, 0, stream, scratch, inp, N, C, column_chunk_rows(N));
  CUDA_CHECK_LAUNCH();
  LAUNCH(column_reduce_kernel, ceil_div(C, 256), 256, 0, stream, out, scratch, R, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
