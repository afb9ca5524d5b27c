// graph.cpp: stream capture and CUDA graphs for the emulated device.
//
// A stream in capture mode records the work enqueued on it (kernel launches with their arguments
// copied by value, async copies and memsets, seam calls, event records) as the nodes of a graph
// instead of running it. cudaStreamEndCapture hands the graph out; cudaGraphInstantiate makes an
// executable graph that shares the node list; cudaGraphLaunch runs the nodes in order, synchronously
// like every other emulated operation.
//
// The rules follow CUDA's: a call that would synchronise with the host, allocate, free, or make the
// legacy default stream wait for the capture is refused on the capturing thread and invalidates the
// capture, and cudaStreamEndCapture then returns cudaErrorStreamCaptureInvalidated with no graph and
// a message naming the first offending call (see README.md, "Stream capture and graphs").
#include "emu/cuda_emu.h"
#include "emu/runtime_internal.h"

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

struct Node {
  std::string what;                   // names the node in messages, e.g. "kernel 'scale_kernel'"
  std::function<cudaError_t()> work;  // everything it needs is captured by value
};
using Nodes = std::vector<Node>;

}  // namespace

// NVIDIA's headers only declare these (cudaGraph_t and cudaGraphExec_t point to them). The node list
// is shared: no API adds nodes after cudaStreamEndCapture, so an executable graph can keep the
// captured list alive after its cudaGraph_t is destroyed.
struct CUgraph_st {
  std::shared_ptr<Nodes> nodes = std::make_shared<Nodes>();
};
struct CUgraphExec_st {
  std::shared_ptr<const Nodes> nodes;
};

namespace {

struct Capture {
  std::thread::id thread;  // the thread that began it
  cudaStreamCaptureMode mode;
  unsigned long long id;
  std::unique_ptr<CUgraph_st> graph;  // under construction; handed out by cudaStreamEndCapture
  std::string invalidated_by;         // message of the first refused call; empty while active
  std::string unjoined_by;            // message of the first GPT2CORE_EMU_UNJOINED work; fails the end
};

struct CaptureState {
  std::mutex m;
  std::unordered_map<const void*, Capture> by_stream;
  unsigned long long next_id = 1;
};
CaptureState& captures() {
  static CaptureState* s = new CaptureState();  // never destroyed: usable from static destructors
  return *s;
}
// Number of streams in capture mode: lets the common case (nothing captures) skip the lock.
std::atomic<int> g_capturing{0};
std::atomic<unsigned long long> g_graph_launches{0};

bool is_legacy(const void* s) { return s == nullptr || s == cudaStreamLegacy; }

// Capture modes (cudaThreadExchangeStreamCaptureMode's rules): a Global capture forbids every
// thread's potentially unsafe calls, a ThreadLocal one only its own thread's, a Relaxed one none.
bool forbids_unsafe_calls(const Capture& c) {
  return c.mode == cudaStreamCaptureModeGlobal ||
         (c.mode == cudaStreamCaptureModeThreadLocal && c.thread == std::this_thread::get_id());
}
// Work on the legacy stream would wait for the capturing stream: refused on the capturing thread
// (every thread for a Global capture).
bool forbids_legacy_work(const Capture& c) {
  return c.mode == cudaStreamCaptureModeGlobal || c.thread == std::this_thread::get_id();
}

// Invalidates `c` (the first reason is kept for cudaStreamEndCapture).
void invalidate(Capture& c, const std::string& msg) {
  if (c.invalidated_by.empty()) c.invalidated_by = msg;
}

// Refuses a call with `e` and `msg` when a capture `forbids` it: invalidates every such capture and
// records the error. Returns cudaSuccess when no capture forbids it. Caller holds the lock.
template <class Pred>
cudaError_t refuse_locked(CaptureState& cs, Pred forbids, cudaError_t e, const std::string& msg) {
  bool refused = false;
  for (auto& [stream, c] : cs.by_stream) {
    if (!forbids(c)) continue;
    invalidate(c, msg);
    refused = true;
  }
  return refused ? gpt2emu::detail::api_set_error(e, msg.c_str()) : cudaSuccess;
}

std::string during_capture(const char* call, const char* why) {
  return std::string(call) + " during stream capture (" + why + ")";
}

std::string on_legacy_stream(const char* what) {
  return std::string(what) +
         " on the legacy default stream during stream capture (it would synchronise implicitly with the "
         "capturing stream; pass the capturing stream)";
}

// True when `what` is named in the environment variable `var` (comma-separated, e.g. "matmul,attention_forward").
// GPT2CORE_EMU_UNCAPTURABLE: work the tests pretend a library cannot record into a graph (refused at the call);
// GPT2CORE_EMU_UNJOINED: work the tests pretend forks onto a library's internal stream without joining it back,
// which CUDA reports only at cudaStreamEndCapture (cudaErrorStreamCaptureUnjoined). Both exercise a caller's
// fallback.
bool listed(const char* var, const char* what) {
  const char* env = std::getenv(var);
  if (!env) return false;
  const std::string list = std::string(",") + env + ",";
  return list.find(std::string(",") + what + ",") != std::string::npos;
}

cudaError_t replay(const Nodes& nodes) {
  g_graph_launches.fetch_add(1);
  for (size_t i = 0; i < nodes.size(); ++i) {
    const cudaError_t e = nodes[i].work();
    if (e == cudaSuccess) continue;
    const char* detail = gpt2emu::detail::api_message_for(e);
    const std::string msg = "cudaGraphLaunch: node " + std::to_string(i) + " of " + std::to_string(nodes.size()) +
                            " (" + nodes[i].what + ") failed: " + (detail ? detail : cudaGetErrorName(e));
    return gpt2emu::detail::api_set_error(e, msg.c_str());
  }
  return cudaSuccess;
}

cudaError_t fail(cudaError_t e, const char* msg) { return gpt2emu::detail::api_set_error(e, msg); }

}  // namespace

namespace gpt2emu {

cudaError_t enqueue(cudaStream_t stream, const char* what, std::function<cudaError_t()> work) {
  if (g_capturing.load() == 0) return work();
  {
    CaptureState& cs = captures();
    std::lock_guard<std::mutex> lock(cs.m);
    if (is_legacy(stream)) {
      const cudaError_t e =
          refuse_locked(cs, forbids_legacy_work, cudaErrorStreamCaptureImplicit, on_legacy_stream(what));
      if (e != cudaSuccess) return e;
    }
    auto it = cs.by_stream.find(stream);
    if (it != cs.by_stream.end()) {
      Capture& c = it->second;
      if (!c.invalidated_by.empty()) {
        const std::string msg = std::string(what) + " on a stream whose capture was invalidated by " + c.invalidated_by;
        return fail(cudaErrorStreamCaptureInvalidated, msg.c_str());
      }
      if (listed("GPT2CORE_EMU_UNCAPTURABLE", what)) {
        const std::string msg = during_capture(what, "not capturable: GPT2CORE_EMU_UNCAPTURABLE");
        invalidate(c, msg);
        return fail(cudaErrorStreamCaptureUnsupported, msg.c_str());
      }
      if (c.unjoined_by.empty() && listed("GPT2CORE_EMU_UNJOINED", what))
        c.unjoined_by = std::string(what) + " forked work onto a stream that was not joined back into the capture "
                        "(GPT2CORE_EMU_UNJOINED)";
      c.graph->nodes->push_back(Node{what, std::move(work)});
      return cudaSuccess;
    }
  }
  return work();
}

unsigned long long graph_launch_count() { return g_graph_launches.load(); }

namespace detail {

bool capture_active() { return g_capturing.load() != 0; }

bool stream_capturing(const void* stream) {
  if (g_capturing.load() == 0) return false;
  CaptureState& cs = captures();
  std::lock_guard<std::mutex> lock(cs.m);
  return cs.by_stream.count(stream) > 0;
}

cudaError_t refuse_in_capture(const void* stream, cudaError_t e, const std::string& msg) {
  CaptureState& cs = captures();
  std::lock_guard<std::mutex> lock(cs.m);
  auto it = cs.by_stream.find(stream);
  if (it != cs.by_stream.end()) invalidate(it->second, msg);
  return api_set_error(e, msg.c_str());
}

cudaError_t refuse_unsafe_call(const char* call, const char* why) {
  if (g_capturing.load() == 0) return cudaSuccess;
  CaptureState& cs = captures();
  std::lock_guard<std::mutex> lock(cs.m);
  return refuse_locked(cs, forbids_unsafe_calls, cudaErrorStreamCaptureUnsupported, during_capture(call, why));
}

cudaError_t refuse_stream_wait(const void* stream, const char* call) {
  if (g_capturing.load() == 0) return cudaSuccess;
  static const char* const kWhy = "a host synchronisation inside the captured region";
  CaptureState& cs = captures();
  std::lock_guard<std::mutex> lock(cs.m);
  if (is_legacy(stream))
    return refuse_locked(cs, forbids_legacy_work, cudaErrorStreamCaptureImplicit, on_legacy_stream(call));
  auto it = cs.by_stream.find(stream);
  if (it != cs.by_stream.end()) {  // waiting for the capture itself, whichever thread asks
    const std::string msg = during_capture(call, kWhy);
    invalidate(it->second, msg);
    return api_set_error(cudaErrorStreamCaptureUnsupported, msg.c_str());
  }
  // Stricter than CUDA, which lets a capturing thread wait for an unrelated stream: in this project a
  // host wait inside the captured region is a bug either way.
  return refuse_locked(cs, forbids_unsafe_calls, cudaErrorStreamCaptureUnsupported, during_capture(call, kWhy));
}

void capture_forget_stream(const void* stream) {
  CaptureState& cs = captures();
  std::lock_guard<std::mutex> lock(cs.m);
  g_capturing.fetch_sub(static_cast<int>(cs.by_stream.erase(stream)));
}

}  // namespace detail
}  // namespace gpt2emu

extern "C" {

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  if (is_legacy(stream))
    return fail(cudaErrorStreamCaptureUnsupported,
                "cudaStreamBeginCapture: the legacy default stream cannot be captured");
  if (stream == cudaStreamPerThread)  // one handle for every thread's stream here: capture would mix them
    return fail(cudaErrorNotSupported, "cudaStreamBeginCapture: capturing cudaStreamPerThread is not emulated; "
                                       "capture a created stream");
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed)
    return fail(cudaErrorInvalidValue, "cudaStreamBeginCapture: unknown capture mode");
  CaptureState& cs = captures();
  std::lock_guard<std::mutex> lock(cs.m);
  if (cs.by_stream.count(stream))
    return fail(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is already capturing");
  cs.by_stream.emplace(stream, Capture{std::this_thread::get_id(), mode, cs.next_id++,
                                       std::make_unique<CUgraph_st>(), std::string(), std::string()});
  g_capturing.fetch_add(1);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  if (!pGraph) return fail(cudaErrorInvalidValue, "cudaStreamEndCapture: null output pointer");
  CaptureState& cs = captures();
  std::lock_guard<std::mutex> lock(cs.m);
  auto it = cs.by_stream.find(stream);
  if (it == cs.by_stream.end()) return fail(cudaErrorIllegalState, "cudaStreamEndCapture: the stream is not capturing");
  Capture& c = it->second;
  if (c.mode != cudaStreamCaptureModeRelaxed && c.thread != std::this_thread::get_id())
    return fail(cudaErrorStreamCaptureWrongThread,
                "cudaStreamEndCapture: called from another thread than cudaStreamBeginCapture");
  const std::string invalidated_by = c.invalidated_by, unjoined_by = c.unjoined_by;
  *pGraph = invalidated_by.empty() && unjoined_by.empty() ? c.graph.release() : nullptr;
  cs.by_stream.erase(it);
  g_capturing.fetch_sub(1);
  if (!invalidated_by.empty()) {
    const std::string msg = "cudaStreamEndCapture: the capture was invalidated by " + invalidated_by;
    return fail(cudaErrorStreamCaptureInvalidated, msg.c_str());
  }
  if (!unjoined_by.empty()) {  // nothing failed before: only the end of the capture finds it
    const std::string msg = "cudaStreamEndCapture: " + unjoined_by;
    return fail(cudaErrorStreamCaptureUnjoined, msg.c_str());
  }
  return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, enum cudaStreamCaptureStatus* status,
                                     unsigned long long* id, cudaGraph_t* graph, const cudaGraphNode_t** deps,
                                     const cudaGraphEdgeData** edge_data, size_t* num_deps) {
  if (!status) return fail(cudaErrorInvalidValue, "cudaStreamGetCaptureInfo: null status pointer");
  CaptureState& cs = captures();
  std::lock_guard<std::mutex> lock(cs.m);
  if (is_legacy(stream)) {  // CUDA answers this without invalidating the capture
    for (const auto& [s, c] : cs.by_stream)
      if (forbids_legacy_work(c))
        return fail(cudaErrorStreamCaptureImplicit,
                    "capture status of the legacy stream asked while a stream captures");
  }
  auto it = cs.by_stream.find(stream);
  const Capture* c = it == cs.by_stream.end() ? nullptr : &it->second;
  *status = !c ? cudaStreamCaptureStatusNone
               : c->invalidated_by.empty() ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusInvalidated;
  // Nodes form a chain in capture order; the emulator has no node handles to report as dependencies.
  if (id) *id = c ? c->id : 0;
  if (graph) *graph = c ? c->graph.get() : nullptr;
  if (deps) *deps = nullptr;
  if (edge_data) *edge_data = nullptr;
  if (num_deps) *num_deps = 0;
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
  return cudaStreamGetCaptureInfo(stream, status, nullptr, nullptr, nullptr, nullptr, nullptr);
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pExec, cudaGraph_t graph, unsigned long long) {
  if (!pExec || !graph) return fail(cudaErrorInvalidValue, "cudaGraphInstantiate: null graph or output pointer");
  *pExec = new CUgraphExec_st{graph->nodes};
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (!exec) return fail(cudaErrorInvalidValue, "cudaGraphLaunch: null executable graph");
  // Into a capturing stream it becomes one node that replays the whole graph (CUDA's child graph).
  return gpt2emu::enqueue(stream, "cudaGraphLaunch", [nodes = exec->nodes] { return replay(*nodes); });
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  if (!exec) return fail(cudaErrorInvalidValue, "cudaGraphExecDestroy: null executable graph");
  delete exec;
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  if (!graph) return fail(cudaErrorInvalidValue, "cudaGraphDestroy: null graph");
  delete graph;
  return cudaSuccess;
}

}  // extern "C"
