// cooperative_groups.h (emulation): the subset of CUDA's cooperative groups that kernels here use,
// built on the emulator's barrier and warp collectives (so the same checks apply).
//
//   this_thread_block(): sync, thread_rank, size / num_threads, group_index, thread_index, dim_threads
//   tiled_partition<N>(block), N a power of two <= 32: thread_rank, size / num_threads,
//     meta_group_rank, meta_group_size, sync, shfl, shfl_up, shfl_down, shfl_xor, any, all, ballot
//   reduce(tile, value, op) with plus, less, greater, bit_and, bit_or, bit_xor
//
// Included by cuda_emu.h. NVIDIA's <cooperative_groups.h> is empty for host compilers, and the include
// guard of <cooperative_groups/reduce.h> is defined here, so kernel files may include both.
#pragma once

#ifndef _COOPERATIVE_GROUPS_REDUCE_H
#define _COOPERATIVE_GROUPS_REDUCE_H
#endif

namespace cooperative_groups {

class thread_block {
 public:
  void sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const { __syncthreads(file, line); }
  unsigned long long thread_rank() const {
    return (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  }
  unsigned long long size() const { return num_threads(); }
  unsigned long long num_threads() const {
    return static_cast<unsigned long long>(blockDim.x) * blockDim.y * blockDim.z;
  }
  dim3 group_index() const { return dim3(blockIdx.x, blockIdx.y, blockIdx.z); }
  dim3 thread_index() const { return dim3(threadIdx.x, threadIdx.y, threadIdx.z); }
  dim3 dim_threads() const { return blockDim; }
  dim3 group_dim() const { return blockDim; }
};

inline thread_block this_thread_block() { return thread_block(); }

inline void sync(const thread_block& b, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  b.sync(file, line);
}

template <unsigned N>
class thread_block_tile {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "tile size must be a power of two <= 32");

 public:
  explicit thread_block_tile(const thread_block& b) {
    const unsigned long long r = b.thread_rank(), n = b.num_threads();
    lane_ = static_cast<unsigned>(r % 32);
    const unsigned base = lane_ / N * N;
    mask_ = (N == 32 ? 0xffffffffu : ((1u << N) - 1u) << base);
    const unsigned long long warp_base = r - lane_;
    for (unsigned l = 0; l < 32; ++l)  // lanes past the end of the block are not in the tile
      if (warp_base + l >= n) mask_ &= ~(1u << l);
    rank_ = static_cast<unsigned>(r / N);
    groups_ = static_cast<unsigned>((n + N - 1) / N);
  }
  unsigned long long thread_rank() const { return lane_ % N; }
  unsigned long long size() const { return N; }
  unsigned long long num_threads() const { return N; }
  unsigned long long meta_group_rank() const { return rank_; }
  unsigned long long meta_group_size() const { return groups_; }
  void sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const { __syncwarp(mask_, file, line); }

  template <class T>
  T shfl(T v, int src, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    return __shfl_sync(mask_, v, src, N, file, line);
  }
  template <class T>
  T shfl_up(T v, unsigned d, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    return __shfl_up_sync(mask_, v, d, N, file, line);
  }
  template <class T>
  T shfl_down(T v, unsigned d, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    return __shfl_down_sync(mask_, v, d, N, file, line);
  }
  template <class T>
  T shfl_xor(T v, unsigned m, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    return __shfl_xor_sync(mask_, v, static_cast<int>(m), N, file, line);
  }
  int any(int p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    return __any_sync(mask_, p, file, line);
  }
  int all(int p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    return __all_sync(mask_, p, file, line);
  }
  unsigned ballot(int p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    const unsigned b = __ballot_sync(mask_, p, file, line);
    return N == 32 ? b : (b >> (lane_ / N * N)) & ((1u << N) - 1u);  // bits relative to the tile
  }

 private:
  unsigned lane_ = 0, mask_ = 0, rank_ = 0, groups_ = 0;
};

template <unsigned N>
inline thread_block_tile<N> tiled_partition(const thread_block& b) {
  return thread_block_tile<N>(b);
}

template <class T> struct plus { T operator()(T a, T b) const { return a + b; } };
template <class T> struct less { T operator()(T a, T b) const { return (b < a) ? b : a; } };
template <class T> struct greater { T operator()(T a, T b) const { return (a < b) ? b : a; } };
template <class T> struct bit_and { T operator()(T a, T b) const { return a & b; } };
template <class T> struct bit_or { T operator()(T a, T b) const { return a | b; } };
template <class T> struct bit_xor { T operator()(T a, T b) const { return a ^ b; } };

// Butterfly over the tile: every thread gets op folded over the tile's values.
template <unsigned N, class T, class Op>
inline T reduce(const thread_block_tile<N>& g, T v, Op op) {
  for (unsigned off = N / 2; off > 0; off /= 2) v = op(v, g.shfl_xor(v, off));
  return v;
}

}  // namespace cooperative_groups
