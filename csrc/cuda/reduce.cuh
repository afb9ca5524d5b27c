// Deterministic column sums over the rows of a (N, C) matrix, without float atomics, in two passes:
//   pass 1 (column_partial_sum_kernel): partial[r, c] = sum of the rows in chunk r of column c. A block covers
//           kColTile column groups (threadIdx.x) of K columns each, K = 16 bytes of floatX when every row starts
//           16-byte aligned (C % kVec == 0, aligned input: each lane loads one Vec per row, a warp 512 contiguous
//           bytes), else K = 1; kColRows row-threads (threadIdx.y) stride over the chunk's rows and are combined
//           in a fixed order;
//   pass 2 (column_reduce_kernel): out[c] += sum_r partial[r, c], the chunks in order per row-thread, the
//           kReduceRows row-threads combined in a fixed order.
// The chunking depends only on N and C, so results are bit-identical run to run and GPU to GPU. The number of
// chunks aims at about kColBlocks blocks in pass 1 (a d12 bias of C = 768..3072 columns, N = 65536 rows: ~1000
// blocks, 7+ per SM of an H100) with at least kColMinRows rows per chunk.
// Used for bias gradients (dbias[o] += sum_n dout[n, o]); layernorm.cuh reuses the chunking and pass 2.
// The input has the storage type floatX (float, bf16 or fp16); partial sums and out are fp32.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kColTile = 32;      // column groups per block (threadIdx.x)
constexpr int kColRows = 8;       // row-threads per block (threadIdx.y)
constexpr int kColBlocks = 1024;  // pass-1 blocks aimed at
constexpr int kColMinRows = 32;   // rows per chunk, at least
constexpr int kReduceRows = 32;   // pass 2: row-threads per block (threadIdx.y), 32 columns per block

// Number of row chunks for N rows of C columns (pass 1 has ceil(C / 256) column blocks at 16 bytes of bf16 per
// lane: the chunk count is counted against those, whatever floatX), and the rows per chunk.
inline int column_chunks(int N, int C) {
  if (N <= 0 || C <= 0) return 0;
  const int by_rows = ceil_div(N, kColMinRows), by_grid = ceil_div(kColBlocks, ceil_div(C, kColTile * 8));
  return by_rows < by_grid ? by_rows : by_grid;
}
inline int column_chunk_rows(int N, int C) { return ceil_div(N, column_chunks(N, C)); }

// K: columns per lane (kVec<floatX> with 16-byte loads, or 1).
template <class floatX, int K>
__global__ void __launch_bounds__(kColTile * kColRows) column_partial_sum_kernel(float* __restrict__ partial,     // (R, C)
                                          const floatX* __restrict__ inp,  // (N, C)
                                          int N, int C, int rows_per_chunk) {
  __shared__ float sh[kColRows][kColTile * K + 1];
  const int c0 = (blockIdx.x * kColTile + threadIdx.x) * K;  // this lane's first column
  const int r0 = blockIdx.y * rows_per_chunk;
  const int r1 = min(N, r0 + rows_per_chunk);
  float s[K] = {};
  if (c0 < C)
    for (int n = r0 + threadIdx.y; n < r1; n += kColRows) {
      const Pack<floatX, K> v = Pack<floatX, K>::load(inp + size_t(n) * C + c0);
#pragma unroll
      for (int k = 0; k < K; k++) s[k] += v.f(k);
    }
#pragma unroll
  for (int k = 0; k < K; k++) sh[threadIdx.y][threadIdx.x * K + k] = s[k];
  __syncthreads();
  // the block's kColTile * K columns, each summed over the row-threads in order by one thread
  for (int j = threadIdx.y * kColTile + threadIdx.x; j < kColTile * K; j += kColTile * kColRows) {
    const int c = blockIdx.x * kColTile * K + j;
    if (c >= C) continue;
    float t = 0.0f;
    for (int y = 0; y < kColRows; y++) t += sh[y][j];
    partial[size_t(blockIdx.y) * C + c] = t;
  }
}

// block (32, kReduceRows), grid ceil(C / 32)
__global__ void __launch_bounds__(32 * kReduceRows) column_reduce_kernel(float* __restrict__ out,            // (C), accumulated into
                                     const float* __restrict__ partial,  // (R, C)
                                     int R, int C) {
  __shared__ float sh[kReduceRows][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < C)
    for (int r = threadIdx.y; r < R; r += kReduceRows) s += partial[size_t(r) * C + c];
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.0f;
    for (int y = 0; y < kReduceRows; y++) t += sh[y][threadIdx.x];
    out[c] += t;
  }
}

// out[c] += sum_r partial[r, c] (pass 2).
inline void column_reduce(float* out, const float* partial, int R, int C, cudaStream_t stream) {
  LAUNCH(column_reduce_kernel, ceil_div(C, 32), dim3(32, kReduceRows), 0, stream, out, partial, R, C);
  CUDA_CHECK_LAUNCH();
}

// out[c] += sum_n inp[n, c]. scratch: at least column_chunks(N, C) * C floats of device memory.
template <class floatX>
void column_sum_accumulate(float* out, const floatX* inp, float* scratch, int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const int R = column_chunks(N, C), rows = column_chunk_rows(N, C);
  constexpr int K = kVec<floatX>;
  const dim3 block(kColTile, kColRows);
  if (C % K == 0 && aligned16(inp))
    LAUNCH((column_partial_sum_kernel<floatX, K>), dim3(ceil_div(C, kColTile * K), R), block, 0, stream, scratch, inp,
           N, C, rows);
  else
    LAUNCH((column_partial_sum_kernel<floatX, 1>), dim3(ceil_div(C, kColTile), R), block, 0, stream, scratch, inp, N,
           C, rows);
  CUDA_CHECK_LAUNCH();
  column_reduce(out, scratch, R, C, stream);
}

}  // namespace gpt2::cuda
