// FP8 quantisation of a tensor with a per-tensor scale: the amax reduction and the cast (with its transpose), the
// inputs of the FP8 matmuls (matmul.cuh's fp8 Linear, through the cuBLASLt seam).
//
//   amax  = max |x| over the tensor (NaN when x holds one: its bit pattern orders above Inf's)
//   s     = fp8_scale(amax, kind): a power of two, amax * s <= the format's largest value (csrc/model/fp8.h)
//   q     = fp8(x * s)     (rows, cols) row-major          } rounded as cvt.rn.satfinite: to nearest even,
//   qt    = fp8(x * s)^T   (cols, rows) row-major          } saturating, NaN kept (model/fp8.h, exact here)
//   meta  = [1 / s, amax]  two floats: the dequantisation factor the matmul's scale pointer reads, and the amax
//
// Scaling: CURRENT scaling (the amax of this very tensor, reduced by its own kernel just before the cast), not
// delayed scaling (an amax history of past steps, as Transformer Engine does). Why: the scale then always fits
// the tensor it scales, so a step whose activations or gradients jump (warm-up, a loss spike) saturates nothing;
// there is no history length or margin to tune and nothing to warm up; a resumed run needs no saved amax history
// to stay bit-exact (the scale is a function of the tensor); and it is what nanochat's FP8 recipe does
// (tensor-wise current scaling). The cost is one extra read of each quantised tensor (the amax pass), which the
// power-of-two scale keeps exact: x * s and q / s round nothing, only the cast does.
// cuBLASLt's amax-of-D output is not used: in GPT-2's block no FP8 matmul's output is the next FP8 matmul's input
// (layernorm, attention, GELU sit between), so the next input's amax needs its own pass anyway.
//
// Kernels first, then the host launcher fp8_quantize. The amax and the scale never leave the device (meta), so
// the ops stay free of host synchronisation (CUDA graphs). On sm_89 / sm_90 the cast is the hardware's
// cvt.rn.satfinite (__nv_cvt_float_to_fp8); elsewhere (and in the emulator) model/fp8.h's bit-exact equivalent.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"
#include "model/fp8.h"
#if !GPT2CORE_EMU
#include <cuda_fp8.h>
#endif

namespace gpt2::cuda {

constexpr int kFp8AmaxThreads = 256;
constexpr int kFp8Tile = 32;      // the cast's tile: kFp8Tile x kFp8Tile values per block
constexpr int kFp8TileRows = 8;   // threadIdx.y of the cast (each thread covers kFp8Tile / kFp8TileRows rows)

__device__ __forceinline__ uint8_t fp8_cvt(float v, ::gpt2::Fp8Kind kind) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kind == ::gpt2::Fp8Kind::E4M3 ? __NV_E4M3 : __NV_E5M2));
#else
  return ::gpt2::float_to_fp8(v, kind);
#endif
}

__device__ __forceinline__ unsigned warp_max_u32(unsigned v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned w = __shfl_xor_sync(kFullMask, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// meta[1] (as its bits) = max over blocks of the bits of |x|: non-negative floats order as their bit patterns, so
// an unsigned atomicMax is a float max (NaN's bits above Inf's). meta[1] must be +0 before the launch.
template <class floatX>
__global__ void __launch_bounds__(kFp8AmaxThreads) fp8_amax_kernel(float* meta,           // (2): [1] amax
                                                                   const floatX* x,       // (n)
                                                                   size_t n) {
  __shared__ unsigned warp_max[kFp8AmaxThreads / 32];
  unsigned m = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const unsigned b = ::gpt2::fp8_float_bits(load_f(x[i])) & 0x7fffffffu;
    m = b > m ? b : m;
  }
  m = warp_max_u32(m);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kFp8AmaxThreads / 32 ? warp_max[threadIdx.x] : 0u;
    m = warp_max_u32(m);
    if (threadIdx.x == 0 && m) atomicMax(reinterpret_cast<unsigned*>(meta + 1), m);
  }
}

// One kFp8Tile x kFp8Tile tile of x per block (blockIdx.x over rows, blockIdx.y over columns): q and / or qt
// (either may be null) of the tile, through shared memory for the transpose. Block (0, 0) writes meta[0] = 1 / s.
template <class floatX>
__global__ void __launch_bounds__(kFp8Tile * kFp8TileRows) fp8_cast_kernel(uint8_t* q,        // (rows, cols) or null
                                                                           uint8_t* qt,       // (cols, rows) or null
                                                                           float* meta,       // (2): [0] written, [1] read
                                                                           const floatX* x,   // (rows, cols)
                                                                           int rows, int cols, ::gpt2::Fp8Kind kind) {
  __shared__ uint8_t tile[kFp8Tile][kFp8Tile + 1];
  const float s = ::gpt2::fp8_scale(meta[1], kind);
  const int r0 = blockIdx.x * kFp8Tile, c0 = blockIdx.y * kFp8Tile;
  for (int i = threadIdx.y; i < kFp8Tile; i += kFp8TileRows) {
    const int r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) {
      const uint8_t b = fp8_cvt(load_f(x[size_t(r) * cols + c]) * s, kind);
      if (q) q[size_t(r) * cols + c] = b;
      tile[i][threadIdx.x] = b;
    }
  }
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) meta[0] = 1.0f / s;  // exact
  if (!qt) return;  // uniform over the block
  __syncthreads();
  for (int i = threadIdx.y; i < kFp8Tile; i += kFp8TileRows) {
    const int c = c0 + i, r = r0 + threadIdx.x;
    if (c < cols && r < rows) qt[size_t(c) * rows + r] = tile[threadIdx.x][i];
  }
}

// Quantises x (rows, cols) with its current per-tensor scale: meta = [1 / s, amax], q and / or qt (null: not
// written). Stream-ordered, no host synchronisation. rows, cols >= 0; an empty tensor gets amax 0 and 1 / s = 1.
template <class floatX>
void fp8_quantize(uint8_t* q,         // (rows, cols) or null
                  uint8_t* qt,        // (cols, rows) or null
                  float* meta,        // (2)
                  const floatX* x,    // (rows, cols)
                  int rows, int cols, ::gpt2::Fp8Kind kind, cudaStream_t stream) {
  const size_t n = size_t(rows) * size_t(cols);
  CUDA_CHECK(cudaMemsetAsync(meta + 1, 0, sizeof(float), stream));
  if (n) {
    const int grid = ceil_div(n, size_t(kFp8AmaxThreads) * 8);
    LAUNCH(fp8_amax_kernel<floatX>, grid < 1024 ? grid : 1024, kFp8AmaxThreads, 0, stream, meta, x, n);
    CUDA_CHECK_LAUNCH();
  }
  const dim3 grid(n ? ceil_div(size_t(rows), kFp8Tile) : 1, n ? ceil_div(size_t(cols), kFp8Tile) : 1);
  LAUNCH(fp8_cast_kernel<floatX>, grid, dim3(kFp8Tile, kFp8TileRows), 0, stream, q, qt, meta, x, n ? rows : 0,
         n ? cols : 0, kind);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
