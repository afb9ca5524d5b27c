// warp_reduce.cu: every shuffle kind with every width, warp reductions built from them, ballot/any/all,
// sm_80 __reduce_add_sync, a 16-byte type and bf16x2 through __shfl_xor_sync. The expected lanes
// follow the CUDA Programming Guide's definition of each shuffle, computed on the host.
#include "emu_test.h"

#include <cmath>
#include <cstring>

constexpr unsigned FULL = 0xffffffffu;

// out[(kind * 6 + w) * 64 + tid] = value read by thread tid with shuffle `kind` and width 1 << w.
// Values are lane ids * 10 + warp id, so the test sees which lane (and warp) each came from.
__global__ void shuffle_kernel(int* out, int arg) {
  const int tid = threadIdx.x;
  const int v = (tid % 32) * 10 + tid / 32;
  for (int w = 0; w < 6; ++w) {
    const int width = 1 << w;
    out[(0 * 6 + w) * 64 + tid] = __shfl_sync(FULL, v, arg, width);
    out[(1 * 6 + w) * 64 + tid] = __shfl_up_sync(FULL, v, arg, width);
    out[(2 * 6 + w) * 64 + tid] = __shfl_down_sync(FULL, v, arg, width);
    out[(3 * 6 + w) * 64 + tid] = __shfl_xor_sync(FULL, v, arg, width);
  }
}

// Warp sums of inp by butterfly (xor), by shift-down, and by __reduce_add_sync; the max by shuffles.
__global__ void warp_sum_kernel(float* sums, float* maxes, unsigned* isums, const float* __restrict__ inp) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float x = inp[tid];
  float a = x, b = x, m = x;
  for (int off = 16; off > 0; off /= 2) {
    a += __shfl_xor_sync(FULL, a, off);
    b += __shfl_down_sync(FULL, b, off);
    m = fmaxf(m, __shfl_xor_sync(FULL, m, off));
  }
  b = __shfl_sync(FULL, b, 0);
  const unsigned s = __reduce_add_sync(FULL, static_cast<unsigned>(tid));
  sums[2 * tid + 0] = a;
  sums[2 * tid + 1] = b;
  maxes[tid] = m;
  if (lane == 0) isums[warp] = s;
}

// Sums over each group of 8 lanes with a sub-warp width, every lane holds its group's sum.
__global__ void segment_sum_kernel(float* out, const float* __restrict__ inp) {
  float a = inp[threadIdx.x];
  for (int off = 4; off > 0; off /= 2) a += __shfl_xor_sync(FULL, a, off, 8);
  out[threadIdx.x] = a;
}

// Half-warp collectives with their own masks: lanes 0-15 and 16-31 shuffle independently.
__global__ void half_warp_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  int v = lane;
  for (int off = 8; off > 0; off /= 2) v += __shfl_xor_sync(mask, v, off);
  out[threadIdx.x] = v;
}

struct alignas(16) Quad {
  float a, b, c;
  int d;
};

__global__ void vote_kernel(unsigned* ballots, int* anys, int* alls, Quad* quads, __nv_bfloat162* pairs) {
  const int tid = threadIdx.x, lane = tid % 32;
  const unsigned bal = __ballot_sync(FULL, lane % 3 == 0);
  const int any = __any_sync(FULL, lane == 31);
  const int all = __all_sync(FULL, lane < 31);
  const int all2 = __all_sync(FULL, lane < 32);
  __syncwarp();
  Quad q{1.0f * lane, 2.0f * lane, 3.0f * lane, lane};
#if GPT2CORE_EMU
  q = __shfl_sync(FULL, q, 31 - lane);  // the emulator shuffles any bitwise-copyable type up to 16 bytes
#else
  q.a = __shfl_sync(FULL, q.a, 31 - lane);  // CUDA itself only has overloads for scalar types
  q.b = __shfl_sync(FULL, q.b, 31 - lane);
  q.c = __shfl_sync(FULL, q.c, 31 - lane);
  q.d = __shfl_sync(FULL, q.d, 31 - lane);
#endif
  __nv_bfloat162 p = __floats2bfloat162_rn(static_cast<float>(lane), static_cast<float>(-lane));
  p = __shfl_xor_sync(FULL, p, 1);
  ballots[tid] = bal;
  anys[tid] = any;
  alls[2 * tid] = all;
  alls[2 * tid + 1] = all2;
  quads[tid] = q;
  pairs[tid] = p;
}

// The CUDA Programming Guide's definitions, per thread (lane within its width segment).
static int expect_shuffle(int kind, int tid, int width, int arg) {
  const int lane = tid % 32, warp = tid / 32;
  const int seg = lane / width * width;
  int src = lane;
  switch (kind) {
    case 0: src = seg + (arg % width); break;                           // __shfl_sync
    case 1: src = (lane - seg) >= arg ? lane - arg : lane; break;        // __shfl_up_sync
    case 2: src = (lane - seg) + arg < width ? lane + arg : lane; break;  // __shfl_down_sync
    case 3: {                                                           // __shfl_xor_sync
      const int j = lane ^ arg;
      src = j < seg + width ? j : lane;  // later groups are not reachable, earlier ones are
      break;
    }
  }
  return src * 10 + warp;
}

int main() {
  int* d_out = device_alloc<int>(4 * 6 * 64);
  for (int arg : {0, 1, 2, 3, 5, 8, 13, 16, 31}) {
    LAUNCH(shuffle_kernel, 1, 64, 0, 0, d_out, arg);
    TEST_CUDA(cudaGetLastError());
    std::vector<int> got = to_host(d_out, 4 * 6 * 64);
    for (int kind = 0; kind < 4; ++kind)
      for (int w = 0; w < 6; ++w)
        for (int tid = 0; tid < 64; ++tid) {
          const int e = expect_shuffle(kind, tid, 1 << w, arg);
          const int g = got[(kind * 6 + w) * 64 + tid];
          TEST_TRUE(g == e, "kind %d width %d arg %d thread %d: got %d want %d", kind, 1 << w, arg, tid, g, e);
        }
  }
  printf("ok shuffle_kinds_and_widths\n");

  const int N = 128;
  std::vector<float> h = random_floats(N, 7);
  float* d_inp = to_device(h);
  float* d_sums = device_alloc<float>(2 * N);
  float* d_max = device_alloc<float>(N);
  unsigned* d_isum = device_alloc<unsigned>(N / 32);
  LAUNCH(warp_sum_kernel, 1, N, 0, 0, d_sums, d_max, d_isum, d_inp);
  TEST_CUDA(cudaGetLastError());
  std::vector<float> sums = to_host(d_sums, 2 * N), maxes = to_host(d_max, N);
  std::vector<unsigned> isums = to_host(d_isum, N / 32);
  for (int w = 0; w < N / 32; ++w) {
    double ref = 0.0;
    float mref = -INFINITY;
    for (int l = 0; l < 32; ++l) {
      ref += h[w * 32 + l];
      mref = std::fmax(mref, h[w * 32 + l]);
    }
    for (int l = 0; l < 32; ++l) {
      const int t = w * 32 + l;
      TEST_TRUE(std::fabs(sums[2 * t] - ref) < 1e-5, "xor sum warp %d lane %d: %f vs %f", w, l, sums[2 * t], ref);
      TEST_TRUE(std::fabs(sums[2 * t + 1] - ref) < 1e-5, "down sum warp %d lane %d", w, l);
      TEST_TRUE(maxes[t] == mref, "max warp %d lane %d", w, l);
    }
    TEST_TRUE(isums[w] == unsigned(32 * 32 * w + 496), "reduce_add warp %d: %u", w, isums[w]);
  }
  printf("ok warp_reductions\n");

  LAUNCH(segment_sum_kernel, 1, N, 0, 0, d_sums, d_inp);
  TEST_CUDA(cudaGetLastError());
  sums = to_host(d_sums, N);
  for (int t = 0; t < N; ++t) {
    double ref = 0.0;
    for (int l = t / 8 * 8; l < t / 8 * 8 + 8; ++l) ref += h[l];
    TEST_TRUE(std::fabs(sums[t] - ref) < 1e-5, "segment sum thread %d", t);
  }
  printf("ok segment_width_8\n");

  LAUNCH(half_warp_kernel, 1, 64, 0, 0, d_out);
  TEST_CUDA(cudaGetLastError());
  std::vector<int> halves = to_host(d_out, 64);
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32, want = lane < 16 ? 120 : 376;  // 0+..+15, 16+..+31
    TEST_TRUE(halves[t] == want, "half warp thread %d: %d", t, halves[t]);
  }
  printf("ok half_warp_masks\n");

  unsigned* d_bal = device_alloc<unsigned>(64);
  int* d_any = device_alloc<int>(64);
  int* d_all = device_alloc<int>(128);
  Quad* d_quad = device_alloc<Quad>(64);
  __nv_bfloat162* d_pair = device_alloc<__nv_bfloat162>(64);
  LAUNCH(vote_kernel, 1, 64, 0, 0, d_bal, d_any, d_all, d_quad, d_pair);
  TEST_CUDA(cudaGetLastError());
  std::vector<unsigned> bal = to_host(d_bal, 64);
  std::vector<int> anys = to_host(d_any, 64), alls = to_host(d_all, 128);
  std::vector<Quad> quads = to_host(d_quad, 64);
  std::vector<__nv_bfloat162> pairs = to_host(d_pair, 64);
  unsigned want_bal = 0;
  for (int l = 0; l < 32; l += 3) want_bal |= 1u << l;
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32;
    TEST_TRUE(bal[t] == want_bal, "ballot %08x", bal[t]);
    TEST_TRUE(anys[t] == 1 && alls[2 * t] == 0 && alls[2 * t + 1] == 1, "any/all thread %d", t);
    const Quad& q = quads[t];
    TEST_TRUE(q.a == 31 - lane && q.b == 2.0f * (31 - lane) && q.c == 3.0f * (31 - lane) && q.d == 31 - lane,
              "16-byte shuffle thread %d", t);
    TEST_TRUE(__low2float(pairs[t]) == float(lane ^ 1) && __high2float(pairs[t]) == -float(lane ^ 1),
              "bf16x2 shuffle thread %d", t);
  }
  printf("ok vote_and_wide_types\n");
  return 0;
}
