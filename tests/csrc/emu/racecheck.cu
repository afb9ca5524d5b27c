// racecheck.cu: the emulator's memory checker (csrc/emu/racecheck.h). Without an argument, correct
// kernels that synchronise just enough (barriers, __syncwarp, atomics across blocks) must run clean under
// every schedule. With the name of a case, that case's buggy kernel runs once and must fail with a
// message naming what it did and the source line of the access: one process per case, so that a
// failed launch cannot affect the next. Prints "ok <name>" per passing check.
#include "emu_test.h"

#include <cmath>
#include <cstring>
#include <string>

constexpr unsigned FULL = 0xffffffffu;

// ---------------------------------------------------------------------------------- correct kernels
// Two block sums in a row over one scratch array, as csrc/cuda/common.cuh's block_sum: the barrier
// before the scratch write keeps the second sum's writes after the first sum's reads.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
}

__global__ void two_sums_kernel(float* out, const float* inp) {
  __shared__ float scratch[32];
  const float x = inp[blockIdx.x * blockDim.x + threadIdx.x];
  const float s = block_sum(x, scratch);
  const float q = block_sum(x * x, scratch);
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = s;
    out[2 * blockIdx.x + 1] = q;
  }
}

// Lane l reads lane l+1's slot after a __syncwarp; warps only touch their own slots.
__global__ void warp_exchange_kernel(float* out) {
  __shared__ float slot[128];
  slot[threadIdx.x] = float(threadIdx.x);
  __syncwarp();
  const int warp0 = threadIdx.x / 32 * 32;
  out[threadIdx.x] = slot[warp0 + (threadIdx.x + 1) % 32];
}

// Every thread of every block adds to one counter atomically; blocks write disjoint outputs.
__global__ void atomic_count_kernel(unsigned* count, float* out) {
  atomicAdd(count, 1u);
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}

// ---------------------------------------------------------------------------------- buggy kernels
// block_sum without its first barrier: a warp that runs ahead into the second sum overwrites scratch
// while another warp still reads the first sum's values (write after read). out[block] should be
// nwarps * (sum of the block's lane-0 inputs); only a schedule that lets a warp run ahead gets it wrong.
constexpr int kWarLine = __LINE__ + 6;
__global__ void war_kernel(float* out, const float* inp) {
  __shared__ float scratch[32];
  float v = inp[blockIdx.x * blockDim.x + threadIdx.x];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  for (int pass = 0; pass < 2; ++pass) {
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  }
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}

// Warp 1 reads what warp 0 wrote, with no barrier (read after write).
constexpr int kRawLine = __LINE__ + 5;
__global__ void raw_kernel(float* out) {
  __shared__ float buf[64];
  if (threadIdx.x < 32) buf[threadIdx.x] = 1.0f;
  else
    out[threadIdx.x] = buf[threadIdx.x - 32];
}

// Lane l reads lane l-1's slot without __syncwarp.
constexpr int kLaneLine = __LINE__ + 4;
__global__ void lane_kernel(float* out) {
  __shared__ float slot[32];
  slot[threadIdx.x] = float(threadIdx.x);
  out[threadIdx.x] = threadIdx.x > 0 ? slot[threadIdx.x - 1] : 0.0f;
}

// Every block writes the same output element (write after write across blocks).
constexpr int kWwLine = __LINE__ + 2;
__global__ void global_ww_kernel(float* out) {
  out[0] = float(blockIdx.x);
}

// The atomic counter of atomic_count_kernel as a plain read-modify-write.
constexpr int kRmwLine = __LINE__ + 2;
__global__ void plain_rmw_kernel(unsigned* count) {
  *count += 1u;
}

// One element past the end of the buffer (an off-by-one tail guard).
constexpr int kOobLine = __LINE__ + 3;
__global__ void oob_kernel(float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) out[i] = 1.0f;
}

// Reads a static __shared__ slot no thread wrote (lane <= nwarps instead of lane < nwarps).
constexpr int kUninitLine = __LINE__ + 6;
__global__ void uninit_static_kernel(float* out) {
  __shared__ float part[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  if (lane == 0) part[warp] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = lane <= nwarps ? part[lane] : 0.0f;
}

// One float past the end of dynamic shared memory.
constexpr int kSmemOobLine = __LINE__ + 3;
__global__ void smem_oob_kernel(float* out) {
  DYNAMIC_SMEM(float, buf);
  buf[threadIdx.x + 1] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x];
}

// Reads a buffer after cudaFree.
constexpr int kFreedLine = __LINE__ + 2;
__global__ void read_kernel(float* out, const float* inp) {
  out[threadIdx.x] = inp[threadIdx.x];
}

// ---------------------------------------------------------------------------------- driver
static void expect_report(const char* name, const char* what, int line) {
  const cudaError_t e = cudaGetLastError();
  const char* msg = cudaGetErrorString(e);
  TEST_TRUE(e == cudaErrorLaunchFailure, "%s: launch did not fail: %s", name, msg);
  const std::string at = "racecheck.cu:" + std::to_string(line);
  TEST_TRUE(strstr(msg, what) != nullptr, "%s: message lacks '%s': %s", name, what, msg);
  TEST_TRUE(strstr(msg, at.c_str()) != nullptr, "%s: message lacks '%s': %s", name, at.c_str(), msg);
  printf("ok %s: %s\n", name, msg);
}

static int run_correct() {
  const int blocks = 5, n = 256;
  std::vector<float> x = random_floats(size_t(blocks) * n, 3);
  float* d_x = to_device(x);
  float* d_out = device_alloc<float>(size_t(blocks) * n);
  LAUNCH(two_sums_kernel, blocks, n, 0, 0, d_out, d_x);
  TEST_CUDA(cudaGetLastError());
  std::vector<float> got = to_host(d_out, 2 * blocks);
  for (int b = 0; b < blocks; ++b) {
    double s = 0, q = 0;
    for (int i = 0; i < n; ++i) s += x[b * n + i], q += double(x[b * n + i]) * x[b * n + i];
    TEST_TRUE(std::abs(got[2 * b] - s) < 1e-4 && std::abs(got[2 * b + 1] - q) < 1e-4, "block %d sums", b);
  }
  printf("ok two_block_sums\n");

  LAUNCH(warp_exchange_kernel, 1, 128, 0, 0, d_out);
  TEST_CUDA(cudaGetLastError());
  got = to_host(d_out, 128);
  for (int t = 0; t < 128; ++t) TEST_TRUE(got[t] == float(t / 32 * 32 + (t + 1) % 32), "warp exchange %d", t);
  printf("ok warp_exchange\n");

  unsigned* d_count = to_device(std::vector<unsigned>{0u});
  LAUNCH(atomic_count_kernel, blocks, n, 0, 0, d_count, d_out);
  TEST_CUDA(cudaGetLastError());
  TEST_TRUE(to_host(d_count, 1)[0] == unsigned(blocks * n), "atomic count");
  printf("ok atomic_count\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) return run_correct();
  const std::string c = argv[1];
  float* d_out = device_alloc<float>(1024);
  float* d_in = to_device(random_floats(1024, 5));
  if (c == "war_values") {  // run with the checker off: the race shows only in the values
    const int blocks = 4, n = 256, nwarps = n / 32;
    float* d_x = to_device(random_floats(size_t(blocks) * n, 9));
    std::vector<float> x = to_host(d_x, size_t(blocks) * n);
    LAUNCH(war_kernel, blocks, n, 0, 0, d_out, d_x);
    TEST_CUDA(cudaGetLastError());
    std::vector<float> got = to_host(d_out, blocks);
    int bad = 0;
    for (int b = 0; b < blocks; ++b) {
      double s = 0;
      for (int w = 0; w < nwarps; ++w) s += x[size_t(b) * n + 32 * w];
      bad += std::abs(got[b] - nwarps * s) > 1e-4;
    }
    printf("value war_mismatches %d\n", bad);
    printf("ok war_values\n");
  } else if (c == "war") {
    LAUNCH(war_kernel, 2, 256, 0, 0, d_out, d_in);
    expect_report("war", "shared-memory race: writes static __shared__", kWarLine);
  } else if (c == "raw") {
    LAUNCH(raw_kernel, 1, 64, 0, 0, d_out);
    expect_report("raw", "reads static __shared__", kRawLine);  // after the write, or before it
  } else if (c == "lane") {
    LAUNCH(lane_kernel, 1, 32, 0, 0, d_out);
    expect_report("lane", "reads static __shared__", kLaneLine);
  } else if (c == "global_ww") {
    LAUNCH(global_ww_kernel, 4, 1, 0, 0, d_out);
    expect_report("global_ww", "device-memory race: writes", kWwLine);
  } else if (c == "plain_rmw") {
    unsigned* d_count = to_device(std::vector<unsigned>{0u});
    LAUNCH(plain_rmw_kernel, 4, 32, 0, 0, d_count);
    expect_report("plain_rmw", "without an atomic", kRmwLine);
  } else if (c == "oob") {
    float* d_small = device_alloc<float>(37);
    LAUNCH(oob_kernel, 1, 64, 0, 0, d_small, 37);
    expect_report("oob", "byte 1 past the end of a 148-byte allocation", kOobLine);
  } else if (c == "uninit_static") {
    LAUNCH(uninit_static_kernel, 1, 128, 0, 0, d_out);
    expect_report("uninit_static", "uninitialised shared memory: reads static __shared__", kUninitLine);
  } else if (c == "smem_oob") {
    LAUNCH(smem_oob_kernel, 1, 40, 40 * sizeof(float), 0, d_out);
    expect_report("smem_oob", "out-of-bounds shared memory access", kSmemOobLine);
  } else if (c == "freed") {
    float* d_tmp = device_alloc<float>(64);
    TEST_CUDA(cudaFree(d_tmp));
    LAUNCH(read_kernel, 1, 32, 0, 0, d_out, d_tmp);
    expect_report("freed", "inside a freed 256-byte allocation", kFreedLine);
  } else {
    TEST_TRUE(false, "unknown case %s", c.c_str());
  }
  return 0;
}
