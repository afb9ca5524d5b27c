// cp_async.cu: the asynchronous copies of csrc/cuda/cp_async.cuh (emulated: csrc/emu/cuda_emu.h, runtime.cpp) against
// the PTX ISA's rules for cp.async, cp.async.commit_group, cp.async.wait_group N and cp.async.wait_all:
//   - (no argument) a double-buffered tile pipeline as the flash kernels run it (the next tile's copy in flight while
//     this one is read, each warp reading what another warp copied) sums to the reference under every schedule; the
//     group rules: wait_group 2 / 1 / 0 land the groups oldest first, a copy not yet committed is not waited for,
//     wait_all commits and waits for it, src-size 0 zero-fills;
//   - planted bugs, each a failed launch whose message names the source line: the pipeline without its wait
//     ("no_wait": the read sees a copy in flight), without the barrier after the wait ("no_barrier": another warp's
//     copy is read with no __syncthreads after it landed), without the barrier before a buffer is reused
//     ("no_reuse_barrier": the next copy overwrites what other warps still read); reading a group that wait_group 1
//     leaves in flight ("young_group"), an uncommitted copy after wait_group 0 ("uncommitted"); a misaligned
//     address, a destination outside shared memory, a source past its allocation;
//   - "poison_values" with the checker off (GPT2CORE_EMU_RACECHECK=0): a read before the wait returns the poison
//     pattern 0x7ff7fff7 (NaN in fp32, bf16 and fp16), not the data.
#include "emu_test.h"

#include "cuda/cp_async.cuh"

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

using gpt2::cuda::cp_async_16;
using gpt2::cuda::cp_async_commit;
using gpt2::cuda::cp_async_wait;
using gpt2::cuda::cp_async_wait_all;

constexpr int kThreads = 128;           // 4 warps, 16 bytes (4 floats) each per tile
constexpr int kTile = 4 * kThreads;     // floats per tile
enum Bug { kNone, kNoWait, kNoBarrier, kNoReuseBarrier };

// out[b * 128 + t] = sum over tiles j of sum_k (k + 1) x[b][j][(4t + 256) % 512 + k]: thread t reads the 16 bytes
// thread t + 64 (mod 128), of another warp, copied. Two tile buffers: tile j + 1's copy is issued before tile j is read.
constexpr int kPipeReadLine = __LINE__ + 18;
constexpr int kPipeIssueLine = __LINE__ + 10;
template <int kBug>
__global__ void pipeline_kernel(float* out, const float* x, int ntiles) {
  DYNAMIC_SMEM(float, buf);  // [2][kTile]
  const int t = threadIdx.x;
  const float* src = x + size_t(blockIdx.x) * ntiles * kTile;
  cp_async_16(buf + 4 * t, src + 4 * t);
  cp_async_commit();
  float acc = 0.0f;
  for (int j = 0; j < ntiles; j++) {
    if (j + 1 < ntiles) cp_async_16(buf + (j + 1) % 2 * kTile + 4 * t, src + (j + 1) * kTile + 4 * t);
    cp_async_commit();  // an empty group on the last tile: wait_group 1 below still covers tile j
    if (kBug != kNoWait) cp_async_wait<1>();
    if (kBug != kNoBarrier) __syncthreads();
    const float* cur = buf + j % 2 * kTile + (4 * t + 256) % kTile;
    for (int k = 0; k < 4; k++) {
      // k = 0 reads first: the line the reports name
      const float v = cur[k];
      acc += v * float(k + 1);
    }
    if (kBug != kNoReuseBarrier) __syncthreads();  // every warp is done with this buffer before it is refilled
  }
  out[blockIdx.x * kThreads + t] = acc;
}

// One warp; lane l owns 16 bytes of each of the slots A .. D. Groups: {A}, {B}, {C: zero-filled}, then D uncommitted.
// out[l] = sums of A, then B, then C, then D (4 floats each, weights 1, 2, 3, 4 by slot).
enum GroupBug { kGroupsOk, kYoungGroup, kUncommitted };
constexpr int kYoungLine = __LINE__ + 18;
constexpr int kUncommittedLine = __LINE__ + 23;
__global__ void groups_kernel(float* out, const float* x, int bug) {
  DYNAMIC_SMEM(float, s);  // [4][32 lanes][4]
  const int l = threadIdx.x;
  float* slot[4] = {s + 4 * l, s + 128 + 4 * l, s + 256 + 4 * l, s + 384 + 4 * l};
  cp_async_16(slot[0], x + 4 * l);
  cp_async_commit();
  cp_async_16(slot[1], x + 128 + 4 * l);
  cp_async_commit();
  cp_async_16(slot[2], x + 256 + 4 * l, false);  // src-size 0: zeros, the source is not read
  cp_async_commit();
  cp_async_16(slot[3], x + 384 + 4 * l);         // in no group yet
  cp_async_wait<2>();                            // {A} landed; {B}, {C} may be in flight
  float acc = 0.0f;
  for (int k = 0; k < 4; k++) acc += slot[0][k];
  if (bug == kYoungGroup) {
    float v = 0.0f;
    for (int k = 0; k < 4; k++) v += slot[1][k];
    acc += v;
  }
  cp_async_wait<1>();  // {B}
  for (int k = 0; k < 4; k++) acc += 2.0f * slot[1][k];
  cp_async_wait<0>();  // {C}; D was never committed: still in flight
  if (bug == kUncommitted) acc += slot[3][0];
  for (int k = 0; k < 4; k++) acc += 3.0f * slot[2][k];
  cp_async_wait_all();  // commits D's group and waits for it
  for (int k = 0; k < 4; k++) acc += 4.0f * slot[3][k];
  out[l] = acc;
}

// Lane l reads its slot without waiting; out (as bits) = what it saw.
__global__ void poison_kernel(uint32_t* out, const float* x) {
  DYNAMIC_SMEM(float, s);
  const int l = threadIdx.x;
  cp_async_16(s + 4 * l, x + 4 * l);
  cp_async_commit();
  uint32_t bits;
  memcpy(&bits, s + 4 * l, 4);
  out[l] = bits;
  cp_async_wait_all();
}

__global__ void bad_copy_kernel(float* out, const float* x, int what) {
  DYNAMIC_SMEM(float, s);
  const int l = threadIdx.x;
  if (what == 0) cp_async_16(s + 4 * l + 1, x + 4 * l);  // 4 bytes off the 16-byte alignment
  if (what == 1) cp_async_16(out + 4 * l, x + 4 * l);    // global, not shared memory
  if (what == 2) cp_async_16(s + 4 * l, x + 4 * l);      // x: 32 floats, lanes 8.. read past it
  cp_async_wait_all();
  __syncwarp();
  out[l] = s[4 * ((l + 1) % 32)];
}

// ---------------------------------------------------------------------------------- driver
// The launch failed with a message holding one of `whats` and "cp_async.cu:<line>" (line 0: not checked).
static void expect_report(const char* name, std::initializer_list<const char*> whats, int line) {
  const cudaError_t e = cudaGetLastError();
  const char* msg = cudaGetErrorString(e);
  TEST_TRUE(e == cudaErrorLaunchFailure, "%s: launch did not fail: %s", name, msg);
  bool found = false;
  for (const char* w : whats) found = found || strstr(msg, w) != nullptr;
  TEST_TRUE(found, "%s: message lacks '%s'%s: %s", name, *whats.begin(), whats.size() > 1 ? " (or another)" : "", msg);
  if (line) {
    const std::string at = "cp_async.cu:" + std::to_string(line);
    TEST_TRUE(strstr(msg, at.c_str()) != nullptr, "%s: message lacks '%s': %s", name, at.c_str(), msg);
  }
  printf("ok %s: %s\n", name, msg);
}

template <int kBug>
static void launch_pipeline(float* d_out, const float* d_x, int blocks, int ntiles) {
  LAUNCH(pipeline_kernel<kBug>, blocks, kThreads, 2 * kTile * sizeof(float), 0, d_out, d_x, ntiles);
}

static int run_correct() {
  const int blocks = 3, ntiles = 5;
  std::vector<float> x = random_floats(size_t(blocks) * ntiles * kTile, 11);
  float* d_x = to_device(x);
  float* d_out = device_alloc<float>(size_t(blocks) * kThreads);
  launch_pipeline<kNone>(d_out, d_x, blocks, ntiles);
  TEST_CUDA(cudaGetLastError());
  std::vector<float> got = to_host(d_out, size_t(blocks) * kThreads);
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < kThreads; ++t) {
      double want = 0.0;
      for (int j = 0; j < ntiles; ++j)
        for (int k = 0; k < 4; ++k) want += (k + 1) * double(x[(size_t(b) * ntiles + j) * kTile + (4 * t + 256) % kTile + k]);
      TEST_TRUE(std::abs(got[b * kThreads + t] - want) < 1e-4, "pipeline block %d thread %d: %g, want %g", b, t,
                got[b * kThreads + t], want);
    }
  printf("ok pipeline\n");

  std::vector<float> y = random_floats(512, 12);
  float* d_y = to_device(y);
  float* d_g = device_alloc<float>(32);
  LAUNCH(groups_kernel, 1, 32, 512 * sizeof(float), 0, d_g, d_y, int(kGroupsOk));
  TEST_CUDA(cudaGetLastError());
  std::vector<float> g = to_host(d_g, 32);
  for (int l = 0; l < 32; ++l) {
    double want = 0.0;
    for (int k = 0; k < 4; ++k) want += y[4 * l + k] + 2.0 * y[128 + 4 * l + k] + 4.0 * y[384 + 4 * l + k];
    TEST_TRUE(std::abs(g[l] - want) < 1e-5, "groups lane %d: %g, want %g (slot C must read as zeros)", l, g[l], want);
  }
  printf("ok groups\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) return run_correct();
  const std::string c = argv[1];
  const int blocks = 2, ntiles = 3;
  float* d_x = to_device(random_floats(size_t(blocks) * ntiles * kTile, 13));
  float* d_out = device_alloc<float>(size_t(blocks) * kTile);
  if (c == "no_wait") {
    launch_pipeline<kNoWait>(d_out, d_x, blocks, ntiles);
    expect_report("no_wait", {"cp.async in flight: reads dynamic shared memory"}, kPipeReadLine);
  } else if (c == "no_barrier") {
    // another warp's copy read before it was issued, while in flight, or landed with no __syncthreads between
    // (which one depends on the schedule)
    launch_pipeline<kNoBarrier>(d_out, d_x, blocks, ntiles);
    expect_report("no_barrier", {"uninitialised shared memory: reads dynamic shared memory",
                                 "cp.async in flight: reads dynamic shared memory",
                                 "shared-memory race: reads dynamic shared memory"}, kPipeReadLine);
  } else if (c == "no_reuse_barrier") {
    // the next copy issued over bytes another warp read since the last barrier (a race at the issue), or read
    // after it (the read meets the copy in flight); the message names both lines either way
    launch_pipeline<kNoReuseBarrier>(d_out, d_x, blocks, ntiles);
    const std::string msg = cudaGetErrorString(cudaPeekAtLastError());
    const std::string issue = "cp_async.cu:" + std::to_string(kPipeIssueLine);
    TEST_TRUE(msg.find(issue) != std::string::npos, "no_reuse_barrier: message lacks '%s': %s", issue.c_str(),
              msg.c_str());
    expect_report("no_reuse_barrier", {"shared-memory race: writes dynamic shared memory",
                                       "cp.async in flight: reads dynamic shared memory"}, kPipeReadLine);
  } else if (c == "young_group") {
    LAUNCH(groups_kernel, 1, 32, 512 * sizeof(float), 0, d_out, d_x, int(kYoungGroup));
    expect_report("young_group", {"cp.async in flight: reads dynamic shared memory"}, kYoungLine);
  } else if (c == "uncommitted") {
    LAUNCH(groups_kernel, 1, 32, 512 * sizeof(float), 0, d_out, d_x, int(kUncommitted));
    expect_report("uncommitted", {"which this thread's cp.async at"}, kUncommittedLine);
  } else if (c == "misaligned") {
    LAUNCH(bad_copy_kernel, 1, 32, 128 * sizeof(float), 0, d_out, d_x, 0);
    expect_report("misaligned", {"not aligned to the 16-byte copy"}, 0);
  } else if (c == "not_shared") {
    LAUNCH(bad_copy_kernel, 1, 32, 128 * sizeof(float), 0, d_out, d_x, 1);
    expect_report("not_shared", {"is not the block's shared memory"}, 0);
  } else if (c == "source_oob") {
    float* d_small = device_alloc<float>(32);
    LAUNCH(bad_copy_kernel, 1, 32, 128 * sizeof(float), 0, d_out, d_small, 2);
    expect_report("source_oob", {"out-of-bounds device memory access: reads 16 bytes"}, 0);
  } else if (c == "poison_values") {  // with the checker off
    uint32_t* d_bits = device_alloc<uint32_t>(32);
    LAUNCH(poison_kernel, 1, 32, 128 * sizeof(float), 0, d_bits, d_x);
    TEST_CUDA(cudaGetLastError());
    std::vector<uint32_t> bits = to_host(d_bits, 32);
    int poisoned = 0;
    for (uint32_t b : bits) poisoned += b == 0x7ff7fff7u;
    printf("value poisoned_reads %d\n", poisoned);
    printf("ok poison_values\n");
  } else {
    TEST_TRUE(false, "unknown case %s", c.c_str());
  }
  return 0;
}
