// graph_capture.cu: stream capture and CUDA graphs, as the CUDA backend uses them for a training
// micro-step. A captured sequence (kernels with by-value arguments, an async memset, device-to-device
// and pinned host<->device copies, a library seam) runs nothing while captured; each graph launch
// replays it on the buffers' current contents with the arguments captured. A host-synchronising call
// inside a capture is refused and invalidates the capture, after which the stream works normally.
// Random data throughout: a result that is still the NaN poison or a stale value cannot pass.
#include "emu_test.h"
#include "cuda/seams.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

// out = a * in + b
__global__ void affine_kernel(float* out, const float* in, float a, float b, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a * in[i] + b;
}

// acc += y * y (reads what the memset and the copy before it left)
__global__ void square_accumulate_kernel(float* acc, const float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) acc[i] += y[i] * y[i];
}

constexpr int kN = 1000;  // not a multiple of the block: the last block is partial
constexpr int kThreads = 256, kBlocks = (kN + kThreads - 1) / kThreads;
constexpr size_t kBytes = kN * sizeof(float);

// Under the emulator the last error's message names the offending call; real CUDA only has the
// generic string of the error code.
static bool message_names(const char* what) {
#if GPT2CORE_EMU
  return strstr(gpt2emu::last_error_message(), what) != nullptr;
#else
  (void)what;
  return true;
#endif
}

static const char* last_message() {
#if GPT2CORE_EMU
  return gpt2emu::last_error_message();
#else
  return "";
#endif
}

static float* poisoned(size_t n) { return to_device(std::vector<float>(n, NAN)); }

static void expect_all_nan(const float* d, size_t n, const char* what) {
  for (float v : to_host(d, n)) TEST_TRUE(std::isnan(v), "%s was written during capture", what);
}

static cudaStreamCaptureStatus capture_status(cudaStream_t s) {
  cudaStreamCaptureStatus status;
  TEST_CUDA(cudaStreamIsCapturing(s, &status));
  return status;
}

// Captures out = a * in + b on s and instantiates it.
static cudaGraphExec_t capture_affine(cudaStream_t s, float* out, const float* in, float a, float b) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  LAUNCH(affine_kernel, kBlocks, kThreads, 0, s, out, in, a, b, kN);
  TEST_CUDA(cudaGetLastError());
  TEST_CUDA(cudaStreamEndCapture(s, &graph));
  TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  TEST_CUDA(cudaGraphDestroy(graph));
  return exec;
}

static void expect_affine(const float* out, const std::vector<float>& x, float a, float b, const char* what) {
  const std::vector<float> got = to_host(out, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = a * x[i] + b;
    // one fp32 multiply-add: exact on the emulator, 1 ulp apart with the GPU's fused multiply-add
    TEST_TRUE(std::fabs(got[i] - want) <= 1e-6f * (1.0f + std::fabs(want)), "%s[%zu] = %g, want %g", what, i,
              got[i], want);
  }
}

// 1. Kernels (scalar arguments by value), memset and device-to-device copy: nothing runs during
//    capture; each replay reads the input's current contents but keeps the captured scalars.
static void test_capture_and_replay(cudaStream_t s) {
  std::vector<float> hx = random_floats(kN, 1);
  float* x = to_device(hx);
  float *y = poisoned(kN), *ycopy = poisoned(kN), *acc = poisoned(kN);
  float a = 1.5f, b = -0.25f;  // host variables passed by value: the graph keeps these values
  const float a0 = a, b0 = b;
#if GPT2CORE_EMU
  const unsigned long long launches0 = gpt2emu::launch_count(), graphs0 = gpt2emu::graph_launch_count();
#endif
  cudaGraph_t graph = nullptr;
  TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  TEST_TRUE(capture_status(s) == cudaStreamCaptureStatusActive, "stream not capturing after BeginCapture");
  LAUNCH(affine_kernel, kBlocks, kThreads, 0, s, y, x, a, b, kN);
  TEST_CUDA(cudaGetLastError());
  TEST_CUDA(cudaMemsetAsync(acc, 0, kBytes, s));
  TEST_CUDA(cudaMemcpyAsync(ycopy, y, kBytes, cudaMemcpyDeviceToDevice, s));
  LAUNCH(square_accumulate_kernel, kBlocks, kThreads, 0, s, acc, ycopy, kN);
  TEST_CUDA(cudaGetLastError());
  TEST_CUDA(cudaStreamEndCapture(s, &graph));
  TEST_TRUE(graph != nullptr, "no graph");
  TEST_TRUE(capture_status(s) == cudaStreamCaptureStatusNone, "stream still capturing after EndCapture");
  expect_all_nan(y, kN, "y");
  expect_all_nan(ycopy, kN, "ycopy");
  expect_all_nan(acc, kN, "acc");
#if GPT2CORE_EMU
  TEST_TRUE(gpt2emu::launch_count() == launches0, "a captured kernel ran during capture");
#endif
  a = 100.0f;  // too late: the launch was captured with the old values
  b = 7.0f;
  cudaGraphExec_t exec = nullptr;
  TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  TEST_CUDA(cudaGraphDestroy(graph));  // the executable graph stands on its own
  for (int round = 0; round < 3; ++round) {
    if (round > 0) {  // new contents, same buffer
      hx = random_floats(kN, 10 + round);
      TEST_CUDA(cudaMemcpy(x, hx.data(), kBytes, cudaMemcpyHostToDevice));
    }
    TEST_CUDA(cudaGraphLaunch(exec, s));
    TEST_CUDA(cudaStreamSynchronize(s));
    expect_affine(y, hx, a0, b0, "y");
    const std::vector<float> hy = to_host(y, kN), hcopy = to_host(ycopy, kN), hacc = to_host(acc, kN);
    TEST_TRUE(memcmp(hy.data(), hcopy.data(), kBytes) == 0, "round %d: the captured copy did not copy y", round);
    for (int i = 0; i < kN; ++i)  // the memset reran: acc is y^2, not accumulated over rounds
      TEST_TRUE(std::fabs(hacc[i] - hy[i] * hy[i]) <= 1e-6f * (1.0f + hacc[i]), "round %d acc[%d] = %g, want %g",
                round, i, hacc[i], hy[i] * hy[i]);
  }
#if GPT2CORE_EMU
  TEST_TRUE(gpt2emu::launch_count() == launches0 + 6, "3 replays of 2 kernels counted %llu launches",
            gpt2emu::launch_count() - launches0);
  TEST_TRUE(gpt2emu::graph_launch_count() == graphs0 + 3, "graph launches not counted");
#endif
  TEST_CUDA(cudaGraphExecDestroy(exec));
  for (float* p : {x, y, ycopy, acc}) TEST_CUDA(cudaFree(p));
  printf("ok capture_and_replay\n");
}

// 2. Each refused call: the error, an invalidated capture with no graph and a message naming the
//    call; then the stream runs work directly again and a new capture succeeds.
static void test_refused_calls(cudaStream_t s) {
  const std::vector<float> hx = random_floats(kN, 2);
  std::vector<float> pageable(kN);
  float* x = to_device(hx);
  float* y = poisoned(kN);
  float* spare = device_alloc<float>(16);  // for cudaFree
  float* scratch = nullptr;
  cudaEvent_t event;
  TEST_CUDA(cudaEventCreate(&event));
  struct Refusal {
    const char* call;  // what the message must name
    cudaError_t code;
    std::function<cudaError_t()> run;
  };
  const Refusal refusals[] = {
      {"cudaMemcpy", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaMemcpy(pageable.data(), y, kBytes, cudaMemcpyDeviceToHost); }},
      {"cudaMemset", cudaErrorStreamCaptureUnsupported, [&] { return cudaMemset(y, 0, kBytes); }},
      {"cudaStreamSynchronize", cudaErrorStreamCaptureUnsupported, [&] { return cudaStreamSynchronize(s); }},
      {"cudaDeviceSynchronize", cudaErrorStreamCaptureUnsupported, [&] { return cudaDeviceSynchronize(); }},
      {"cudaEventSynchronize", cudaErrorStreamCaptureUnsupported, [&] { return cudaEventSynchronize(event); }},
      {"cudaMalloc", cudaErrorStreamCaptureUnsupported, [&] { return cudaMalloc(&scratch, 64); }},
      {"cudaFree", cudaErrorStreamCaptureUnsupported, [&] { return cudaFree(spare); }},
      {"cudaMallocHost", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaMallocHost(reinterpret_cast<void**>(&scratch), 64); }},
      {"cudaMemcpyAsync of pageable host memory", cudaErrorStreamCaptureUnsupported,
       [&] { return cudaMemcpyAsync(y, pageable.data(), kBytes, cudaMemcpyHostToDevice, s); }},
      {"affine_kernel", cudaErrorStreamCaptureImplicit, [&] {
         LAUNCH(affine_kernel, kBlocks, kThreads, 0, cudaStreamLegacy, y, x, 1.0f, 0.0f, kN);
         return cudaGetLastError();
       }},
      {"cudaMemsetAsync", cudaErrorStreamCaptureImplicit, [&] { return cudaMemsetAsync(y, 0, kBytes, nullptr); }},
  };
  for (const Refusal& r : refusals) {
    TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    LAUNCH(affine_kernel, kBlocks, kThreads, 0, s, y, x, 2.0f, 1.0f, kN);  // recorded before the refused call
    TEST_CUDA(cudaGetLastError());
    const cudaError_t e = r.run();
    TEST_TRUE(e == r.code, "%s during capture returned %s, want %s", r.call, cudaGetErrorName(e),
              cudaGetErrorName(r.code));
    TEST_TRUE(message_names(r.call), "the message '%s' does not name %s", last_message(), r.call);
    (void)cudaGetLastError();
    TEST_TRUE(capture_status(s) == cudaStreamCaptureStatusInvalidated, "%s did not invalidate the capture", r.call);
    TEST_TRUE(cudaMemsetAsync(y, 0, kBytes, s) == cudaErrorStreamCaptureInvalidated,
              "work on an invalidated capture was accepted after %s", r.call);
    (void)cudaGetLastError();
    cudaGraph_t graph = nullptr;
    TEST_TRUE(cudaStreamEndCapture(s, &graph) == cudaErrorStreamCaptureInvalidated && graph == nullptr,
              "EndCapture after %s did not report the invalidated capture", r.call);
    TEST_TRUE(message_names(r.call), "EndCapture's message '%s' does not name %s", last_message(), r.call);
    (void)cudaGetLastError();
    TEST_TRUE(capture_status(s) == cudaStreamCaptureStatusNone, "still capturing after EndCapture (%s)", r.call);
    expect_all_nan(y, kN, "y");  // the kernel recorded before the refused call never ran

    LAUNCH(affine_kernel, kBlocks, kThreads, 0, s, y, x, 2.0f, 1.0f, kN);  // runs at once again
    TEST_CUDA(cudaGetLastError());
    TEST_CUDA(cudaStreamSynchronize(s));
    expect_affine(y, hx, 2.0f, 1.0f, "direct launch after a refused capture");
    cudaGraphExec_t exec = capture_affine(s, y, x, -3.0f, 0.5f);
    TEST_CUDA(cudaGraphLaunch(exec, s));
    TEST_CUDA(cudaStreamSynchronize(s));
    expect_affine(y, hx, -3.0f, 0.5f, "new capture after a refused one");
    TEST_CUDA(cudaGraphExecDestroy(exec));
    TEST_CUDA(cudaMemcpy(y, std::vector<float>(kN, NAN).data(), kBytes, cudaMemcpyHostToDevice));
  }
  TEST_TRUE(scratch == nullptr, "a refused allocation allocated");
  TEST_CUDA(cudaEventDestroy(event));
  for (float* p : {x, y, spare}) TEST_CUDA(cudaFree(p));
  printf("ok refused_calls\n");
}

// 3. What cannot be captured or ended, and other threads during a thread-local capture.
static void test_capture_rules(cudaStream_t s) {
  TEST_TRUE(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeThreadLocal) == cudaErrorStreamCaptureUnsupported,
            "capturing the legacy stream (nullptr) was accepted");
  TEST_TRUE(cudaStreamBeginCapture(cudaStreamLegacy, cudaStreamCaptureModeThreadLocal) ==
                cudaErrorStreamCaptureUnsupported,
            "capturing cudaStreamLegacy was accepted");
  (void)cudaGetLastError();
  cudaGraph_t graph = nullptr;
  TEST_TRUE(cudaStreamEndCapture(s, &graph) == cudaErrorIllegalState, "EndCapture of a stream not capturing");
  (void)cudaGetLastError();
  TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  TEST_TRUE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaErrorIllegalState,
            "BeginCapture of a capturing stream was accepted");
  (void)cudaGetLastError();
  bool other_thread_ok = false;  // thread-local mode: another thread may still allocate and synchronise
  std::thread other([&] {
    float* p = nullptr;
    other_thread_ok = cudaMalloc(&p, 64) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess &&
                      cudaFree(p) == cudaSuccess;
  });
  other.join();
  TEST_TRUE(other_thread_ok, "another thread's cudaMalloc / cudaDeviceSynchronize / cudaFree was refused");
  TEST_CUDA(cudaStreamEndCapture(s, &graph));  // the capture survived the other thread's calls
  TEST_CUDA(cudaGraphDestroy(graph));
  printf("ok capture_rules\n");
}

// 4. A library seam captured on the stream (its params copied at capture) replays like a direct call.
static void test_seam_capture(cudaStream_t s) {
  using namespace gpt2core::seams;
  const int m = 7, n = 5, k = 9;  // D (m, n) = A (m, k) @ W (n, k)^T + bias, a Linear layer
  std::vector<float> ha = random_floats(size_t(m) * k, 3);
  float* a = to_device(ha);
  float* w = to_device(random_floats(size_t(n) * k, 4));
  float* bias = to_device(random_floats(n, 5));
  float *direct = poisoned(size_t(m) * n), *graphed = poisoned(size_t(m) * n);
  MatmulParams p;
  p.d = direct, p.ldd = n, p.a = a, p.lda = k, p.b = w, p.ldb = k, p.trans_b = true;
  p.m = m, p.n = n, p.k = k, p.alpha = 0.5f, p.bias = bias, p.stream = s;
  MatmulParams captured = p;
  captured.d = graphed;
  cudaGraph_t graph = nullptr;
  TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  TEST_CUDA(matmul(captured));
  TEST_CUDA(cudaStreamEndCapture(s, &graph));
  captured.alpha = 0.0f;  // the graph holds its own copy of the params
  expect_all_nan(graphed, size_t(m) * n, "the captured matmul's output");
  cudaGraphExec_t exec = nullptr;
  TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  TEST_CUDA(cudaGraphDestroy(graph));
  for (int round = 0; round < 2; ++round) {
    if (round > 0) {
      ha = random_floats(size_t(m) * k, 6);
      TEST_CUDA(cudaMemcpy(a, ha.data(), ha.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    TEST_CUDA(matmul(p));
    TEST_CUDA(cudaGraphLaunch(exec, s));
    TEST_CUDA(cudaStreamSynchronize(s));
    const std::vector<float> want = to_host(direct, size_t(m) * n), got = to_host(graphed, size_t(m) * n);
    for (size_t i = 0; i < want.size(); ++i)  // same implementation, same inputs: the same bits
      TEST_TRUE(memcmp(&got[i], &want[i], sizeof(float)) == 0, "round %d D[%zu]: graph %g, direct %g", round, i,
                got[i], want[i]);
  }
  TEST_CUDA(cudaGraphExecDestroy(exec));
  for (float* q : {a, w, bias, direct, graphed}) TEST_CUDA(cudaFree(q));
  printf("ok seam_capture\n");
}

// 5. Pinned host<->device copies are recorded and copy the pinned buffers' contents at each replay.
static void test_pinned_copies(cudaStream_t s) {
  float *in = nullptr, *out = nullptr;
  TEST_CUDA(cudaMallocHost(reinterpret_cast<void**>(&in), kBytes));
  TEST_CUDA(cudaMallocHost(reinterpret_cast<void**>(&out), kBytes));
  std::vector<float> hx = random_floats(kN, 7);
  memcpy(in, hx.data(), kBytes);
  for (int i = 0; i < kN; ++i) out[i] = NAN;
  float *d = poisoned(kN), *dy = poisoned(kN);
  cudaGraph_t graph = nullptr;
  TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  TEST_CUDA(cudaMemcpyAsync(d, in, kBytes, cudaMemcpyHostToDevice, s));
  LAUNCH(affine_kernel, kBlocks, kThreads, 0, s, dy, d, 0.75f, 2.0f, kN);
  TEST_CUDA(cudaGetLastError());
  TEST_CUDA(cudaMemcpyAsync(out, dy, kBytes, cudaMemcpyDeviceToHost, s));
  TEST_CUDA(cudaStreamEndCapture(s, &graph));
  expect_all_nan(d, kN, "the captured host-to-device copy's destination");
  for (int i = 0; i < kN; ++i) TEST_TRUE(std::isnan(out[i]), "the captured device-to-host copy ran during capture");
  cudaGraphExec_t exec = nullptr;
  TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  TEST_CUDA(cudaGraphDestroy(graph));
  for (int round = 0; round < 2; ++round) {
    hx = random_floats(kN, 20 + round);  // the pinned buffer's contents at launch time are what counts
    memcpy(in, hx.data(), kBytes);
    TEST_CUDA(cudaGraphLaunch(exec, s));
    TEST_CUDA(cudaStreamSynchronize(s));
    const std::vector<float> hd = to_host(d, kN);
    TEST_TRUE(memcmp(hd.data(), hx.data(), kBytes) == 0, "round %d: the device copy is not the pinned input", round);
    expect_affine(dy, hx, 0.75f, 2.0f, "dy");
    const std::vector<float> hy = to_host(dy, kN);
    TEST_TRUE(memcmp(out, hy.data(), kBytes) == 0, "round %d: the pinned output is not dy", round);
  }
  TEST_CUDA(cudaGraphExecDestroy(exec));
  TEST_CUDA(cudaFreeHost(in));
  TEST_CUDA(cudaFreeHost(out));
  TEST_CUDA(cudaFree(d));
  TEST_CUDA(cudaFree(dy));
  printf("ok pinned_copies\n");
}

#if GPT2CORE_EMU
__global__ void trap_kernel() { __trap(); }

// 6. (emulator only: a trap ends a real GPU context) A node failing at replay stops the replay; the
//    error names the node and carries the kernel's message.
static void test_failing_node(cudaStream_t s) {
  cudaGraph_t graph = nullptr;
  TEST_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  LAUNCH(trap_kernel, 1, 32, 0, s);
  TEST_CUDA(cudaGetLastError());  // recorded, not run: nothing failed yet
  TEST_CUDA(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  TEST_TRUE(cudaGraphLaunch(exec, s) == cudaErrorLaunchFailure, "the trapping node did not fail the launch");
  TEST_TRUE(message_names("node 0 of 1 (kernel 'trap_kernel')") && message_names("__trap()"),
            "message '%s'", last_message());
  TEST_TRUE(cudaGetLastError() == cudaErrorLaunchFailure, "the failure is not the last error");
  TEST_CUDA(cudaGraphExecDestroy(exec));
  TEST_CUDA(cudaGraphDestroy(graph));
  printf("ok failing_node\n");
}
#endif

int main() {
  cudaStream_t s;
  TEST_CUDA(cudaStreamCreate(&s));  // a blocking stream, as the backend's
  test_capture_and_replay(s);
  test_refused_calls(s);
  test_capture_rules(s);
  test_seam_capture(s);
  test_pinned_copies(s);
#if GPT2CORE_EMU
  test_failing_node(s);
#endif
  TEST_CUDA(cudaStreamDestroy(s));
  return 0;
}
