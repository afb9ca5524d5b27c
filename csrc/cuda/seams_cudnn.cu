// gpt2core::seams::attention_forward / attention_backward over cuDNN's fused SDPA (flash attention) through the
// cuDNN frontend graph API (GPU build; the emulated build links csrc/emu/seams_cpu.cpp).
//
// Causal attention, S = scale * Q K^T masked to t2 <= t (top-left diagonal, right bound 0):
//   forward:  out = softmax(S) V, stats = logsumexp of each row of S (fp32), saved for backward;
//   backward: dQ, dK, dV from (Q, K, V, out, dout, stats), written over dqkv (no accumulation).
// Layouts (seams.h) as strided 4-d views (B, NH, T, HS) into the packed buffers, no copies:
//   Q, K, V   (and dQ, dK, dV) in qkv (B, T, 3, NH, HS): strides (3*NH*HS*T, HS, 3*NH*HS, 1),
//             at element offsets 0, NH*HS, 2*NH*HS of the buffer;
//   out, dout (B, T, NH, HS):                          strides (NH*HS*T, HS, NH*HS, 1);
//   stats     (B, NH, T, 1) fp32:                      strides (NH*T, T, 1, 1).
// bf16 or fp16 in and out (the params' dtype), fp32 intermediates and compute. cuDNN's SDPA has no fp32 I/O: F32
// is NotSupported.
//
// One cudnnHandle per device, set to each call's stream; one graph per (device, B, T, NH, HS, scale, direction, dtype,
// deterministic: the backward's set_deterministic_algorithm, AttentionBackwardParams::deterministic),
// built once from cuDNN's heuristics (mode A) and cached; one workspace per (device, stream), i.e. per backend,
// grown to the largest graph's need (two models on two streams never share one; release_attention_stream frees
// a stream's). A mutex covers all of it (a handle's stream is shared state). Errors inside are exceptions (CUDNN_CHECK: file, line, the library's message); the seam
// returns cudaErrorUnknown and keeps the message for last_attention_error().
//
// Compiled without GPT2CORE_HAS_CUDNN_SDPA (cuDNN or the frontend headers not found at configure time), both
// calls return cudaErrorNotSupported.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/seams_check.h"
#include "cuda/seams_cudnn.h"
#include "cuda/seams.h"

#ifndef GPT2CORE_HAS_CUDNN_SDPA
#define GPT2CORE_HAS_CUDNN_SDPA 0
#endif

namespace gpt2core::seams {
namespace {
thread_local std::string t_last_error;
}  // namespace

std::string last_attention_error() { return t_last_error; }

}  // namespace gpt2core::seams

#if GPT2CORE_HAS_CUDNN_SDPA

#include <cudnn.h>
#include <cudnn_frontend.h>

#include "cuda/seams_cudnn_graph.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fe = cudnn_frontend;

namespace gpt2core::seams {
namespace {

const char* fe_code_name(fe::error_code_t c) {
  switch (c) {
    case fe::error_code_t::OK: return "OK";
    case fe::error_code_t::ATTRIBUTE_NOT_SET: return "ATTRIBUTE_NOT_SET";
    case fe::error_code_t::SHAPE_DEDUCTION_FAILED: return "SHAPE_DEDUCTION_FAILED";
    case fe::error_code_t::INVALID_TENSOR_NAME: return "INVALID_TENSOR_NAME";
    case fe::error_code_t::INVALID_VARIANT_PACK: return "INVALID_VARIANT_PACK";
    case fe::error_code_t::GRAPH_NOT_SUPPORTED: return "GRAPH_NOT_SUPPORTED";
    case fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED: return "GRAPH_EXECUTION_PLAN_CREATION_FAILED";
    case fe::error_code_t::GRAPH_EXECUTION_FAILED: return "GRAPH_EXECUTION_FAILED";
    case fe::error_code_t::HEURISTIC_QUERY_FAILED: return "HEURISTIC_QUERY_FAILED";
    case fe::error_code_t::UNSUPPORTED_GRAPH_FORMAT: return "UNSUPPORTED_GRAPH_FORMAT";
    case fe::error_code_t::CUDA_API_FAILED: return "CUDA_API_FAILED";
    case fe::error_code_t::CUDNN_BACKEND_API_FAILED: return "CUDNN_BACKEND_API_FAILED";
    case fe::error_code_t::INVALID_CUDA_DEVICE: return "INVALID_CUDA_DEVICE";
    case fe::error_code_t::HANDLE_ERROR: return "HANDLE_ERROR";
    default: return "frontend error";
  }
}

std::string where(const char* file, int line, const char* expr) {
  return std::string(" at ") + file + ":" + std::to_string(line) + " (" + expr + "): ";
}

// cuDNN backend status: the status name plus cuDNN's own last error message (cuDNN 9).
void check_cudnn(cudnnStatus_t st, const char* file, int line, const char* expr) {
  if (st == CUDNN_STATUS_SUCCESS) return;
  char detail[1024] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  throw std::runtime_error(std::string("cuDNN error ") + cudnnGetErrorString(st) + where(file, line, expr) +
                           (detail[0] ? detail : "(no further message)"));
}
// cuDNN frontend error_t: its code and message.
void check_cudnn(fe::error_t err, const char* file, int line, const char* expr) {
  if (err.is_good()) return;
  throw std::runtime_error(std::string("cuDNN frontend error ") + fe_code_name(err.get_code()) +
                           where(file, line, expr) + err.get_message());
}

}  // namespace
}  // namespace gpt2core::seams

// Throws std::runtime_error with file, line and the library's message; takes a cudnnStatus_t or a frontend error_t.
#define CUDNN_CHECK(call) ::gpt2core::seams::check_cudnn((call), __FILE__, __LINE__, #call)

namespace gpt2core::seams {
namespace {

// Tensor UIDs of the variant packs (the frontend numbers its internal tensors around these).
enum : int64_t { kQ = 1, kK = 2, kV = 3, kO = 4, kStats = 5, kdO = 6, kdQ = 7, kdK = 8, kdV = 9 };

struct GraphKey {
  int device, B, T, NH, HS;
  uint32_t scale_bits;
  bool backward;
  DType dtype;  // BF16 or F16 (check_args refuses the rest)
  bool deterministic;  // backward only (false for every forward graph)
  bool operator<(const GraphKey& o) const {
    return std::tie(device, B, T, NH, HS, scale_bits, backward, dtype, deterministic) <
           std::tie(o.device, o.B, o.T, o.NH, o.HS, o.scale_bits, o.backward, o.dtype, o.deterministic);
  }
};

struct Cached {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;  // bytes
};

struct Workspace {
  void* p = nullptr;
  int64_t bytes = 0;
};

struct State {
  std::mutex mu;
  std::map<int, cudnnHandle_t> handles;                  // per device
  std::map<std::pair<int, void*>, Workspace> workspaces;  // per (device, stream)
  std::map<GraphKey, Cached> graphs;
};
State& state() {
  static State* s = new State();  // never destroyed: no CUDA / cuDNN calls at exit
  return *s;
}

// Dims (B, NH, T, HS) and strides of a view into a (B, T, rows, NH, HS) buffer: rows = 3 for qkv / dqkv (Q, K, V
// at element offsets 0, NH*HS, 2*NH*HS, applied to the pointers), 1 for out / dout.
std::vector<int64_t> bhsd_dim(const GraphKey& k) { return {k.B, k.NH, k.T, k.HS}; }
std::vector<int64_t> bhsd_stride(const GraphKey& k, int64_t rows) {
  const int64_t T = k.T, NH = k.NH, HS = k.HS;
  return {rows * NH * HS * T, HS, rows * NH * HS, 1};
}
fe::graph::Tensor_attributes view(const char* name, int64_t uid, const GraphKey& k, int64_t rows) {
  return fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(bhsd_dim(k)).set_stride(bhsd_stride(k, rows));
}
// stats (B, NH, T, 1) fp32, packed.
fe::graph::Tensor_attributes& stats_layout(fe::graph::Tensor_attributes& t, const GraphKey& k) {
  const int64_t T = k.T, NH = k.NH;
  return t.set_uid(kStats).set_dim({k.B, k.NH, k.T, 1}).set_stride({NH * T, T, 1, 1}).set_data_type(fe::DataType_t::FLOAT);
}

std::shared_ptr<fe::graph::Graph> new_graph(const GraphKey& k) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(k.dtype == DType::F16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// Q, K, V: strided views into the packed qkv input (B, T, 3, NH, HS).
auto qkv_inputs(fe::graph::Graph& g, const GraphKey& k) {
  return std::make_tuple(g.tensor(view("Q", kQ, k, 3)), g.tensor(view("K", kK, k, 3)), g.tensor(view("V", kV, k, 3)));
}

std::shared_ptr<fe::graph::Graph> forward_graph(const GraphKey& k, float scale) {
  auto g = new_graph(k);
  auto [Q, K, V] = qkv_inputs(*g, k);
  auto opts = fe::graph::SDPA_attributes()
                  .set_name("gpt2core_attention_forward")
                  .set_generate_stats(true)  // training: save the logsumexp for backward
                  .set_attn_scale(scale)
                  .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)  // causal: keys t2 <= t
                  .set_diagonal_band_right_bound(0);
  auto [O, Stats] = g->sdpa(Q, K, V, opts);
  O->set_output(true).set_uid(kO).set_dim(bhsd_dim(k)).set_stride(bhsd_stride(k, 1));
  if (!Stats) throw std::runtime_error("cuDNN frontend SDPA returned no stats tensor with generate_stats(true)");
  stats_layout(Stats->set_output(true), k);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const GraphKey& k, float scale) {
  auto g = new_graph(k);
  auto [Q, K, V] = qkv_inputs(*g, k);
  auto O = g->tensor(view("O", kO, k, 1));
  auto dO = g->tensor(view("dO", kdO, k, 1));
  fe::graph::Tensor_attributes st;
  auto Stats = g->tensor(stats_layout(st.set_name("Stats"), k));
  auto opts = fe::graph::SDPA_backward_attributes()
                  .set_name("gpt2core_attention_backward")
                  .set_attn_scale(scale)
                  .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                  .set_diagonal_band_right_bound(0)
                  // cudnn-frontend's default is false: dQ may then be accumulated with atomics (Hopper), so two
                  // identical steps round differently
                  .set_deterministic_algorithm(k.deterministic);
  auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, opts);
  dQ->set_output(true).set_uid(kdQ).set_dim(bhsd_dim(k)).set_stride(bhsd_stride(k, 3));
  dK->set_output(true).set_uid(kdK).set_dim(bhsd_dim(k)).set_stride(bhsd_stride(k, 3));
  dV->set_output(true).set_uid(kdV).set_dim(bhsd_dim(k)).set_stride(bhsd_stride(k, 3));
  return g;
}

// What one call runs with: the device's handle (pointed at the call's stream), the graph, the stream's workspace.
struct Prepared {
  cudnnHandle_t handle;
  const Cached& graph;
  void* workspace;
};

// Creates the device's handle on first use, points it at `stream`, returns the (cached) graph for `key` (its
// device: the current one), with the stream's workspace grown to its need. Caller holds S.mu.
Prepared prepare(State& S, const GraphKey& key, float scale, cudaStream_t stream) {
  cudnnHandle_t& handle = S.handles[key.device];
  if (!handle) CUDNN_CHECK(cudnnCreate(&handle));
  CUDNN_CHECK(cudnnSetStream(handle, stream));

  auto it = S.graphs.find(key);
  if (it == S.graphs.end()) {
    Cached c;
    c.graph = key.backward ? backward_graph(key, scale) : forward_graph(key, scale);
    CUDNN_CHECK(c.graph->validate());
    CUDNN_CHECK(c.graph->build_operation_graph(handle));
    CUDNN_CHECK(c.graph->create_execution_plans({fe::HeurMode_t::A}));
    CUDNN_CHECK(c.graph->check_support());  // the handle overloads of these two are slated for removal
    CUDNN_CHECK(c.graph->build_plans());
    CUDNN_CHECK(c.graph->get_workspace_size(c.workspace));
    it = S.graphs.emplace(key, std::move(c)).first;
  }
  const int64_t need = it->second.workspace;
  Workspace& ws = S.workspaces[{key.device, static_cast<void*>(stream)}];
  if (need > ws.bytes) {
    if (ws.p) {
      CUDA_CHECK_THROW(cudaStreamSynchronize(stream));  // earlier calls on this stream may still use the old one
      CUDA_CHECK_THROW(cudaFree(ws.p));
      ws = Workspace{};
    }
    CUDA_CHECK_THROW(cudaMalloc(&ws.p, size_t(need)));
    ws.bytes = need;
  }
  return {handle, it->second, ws.p};
}

GraphKey key_of(int B, int T, int NH, int HS, float scale, bool backward, DType dtype, bool deterministic) {
  int device = 0;
  CUDA_CHECK_THROW(cudaGetDevice(&device));
  GraphKey k{device, B, T, NH, HS, 0u, backward, dtype, backward && deterministic};
  static_assert(sizeof(float) == sizeof(uint32_t), "float is 32-bit");
  std::memcpy(&k.scale_bits, &scale, sizeof(scale));
  return k;
}

void* mut(const void* p) { return const_cast<void*>(p); }

}  // namespace

std::shared_ptr<fe::graph::Graph> attention_graph(int B, int T, int NH, int HS, float scale, bool backward,
                                                  DType dtype, bool deterministic) {
  // shape, dtype and determinism: all the graph depends on besides scale
  const GraphKey k{-1, B, T, NH, HS, 0u, backward, dtype, backward && deterministic};
  return backward ? backward_graph(k, scale) : forward_graph(k, scale);
}

std::unordered_map<int64_t, void*> attention_pack(const AttentionForwardParams& p) {
  const size_t C = size_t(p.NH) * p.HS;
  const auto* qkv = static_cast<const char*>(p.qkv);
  return {
      {kQ, mut(qkv)},
      {kK, mut(qkv + C * 2)},  // bf16 / fp16: 2 bytes per element
      {kV, mut(qkv + 2 * C * 2)},
      {kO, p.out},
      {kStats, p.stats},
  };
}

std::unordered_map<int64_t, void*> attention_pack(const AttentionBackwardParams& p) {
  const size_t C = size_t(p.NH) * p.HS;
  const auto* qkv = static_cast<const char*>(p.qkv);
  auto* dqkv = static_cast<char*>(p.dqkv);
  return {
      {kQ, mut(qkv)},          {kK, mut(qkv + C * 2)},  {kV, mut(qkv + 2 * C * 2)},
      {kO, mut(p.out)},        {kdO, mut(p.dout)},      {kStats, mut(p.stats)},
      {kdQ, dqkv},             {kdK, dqkv + C * 2},     {kdV, dqkv + 2 * C * 2},
  };
}

namespace {

// Executes the forward or backward graph (by the params' type) on the params' stream.
template <class Params>
void execute(const Params& p) {
  constexpr bool backward = std::is_same_v<Params, AttentionBackwardParams>;
  State& S = state();
  std::lock_guard<std::mutex> lock(S.mu);
  bool deterministic = false;
  if constexpr (backward) deterministic = p.deterministic;
  const Prepared c =
      prepare(S, key_of(p.B, p.T, p.NH, p.HS, p.scale, backward, p.dtype, deterministic), p.scale, p.stream);
  auto pack = attention_pack(p);
  CUDNN_CHECK(c.graph.graph->execute(c.handle, pack, c.workspace));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Shared argument checks. Returns cudaSuccess to go on, or the error to return (message set).
cudaError_t check_args(int B, int T, int NH, int HS, DType dtype, bool any_null, bool misaligned, bool* empty) {
  *empty = false;
  if (B < 0 || T < 0 || NH < 0 || HS < 0) {
    t_last_error = "attention: B, T, NH, HS must be >= 0";
    return cudaErrorInvalidValue;
  }
  if (size_t(B) * T * NH * HS == 0) {
    *empty = true;
    return cudaSuccess;
  }
  if (any_null) {
    t_last_error = "attention: null pointer argument";
    return cudaErrorInvalidValue;
  }
  if (dtype != DType::BF16 && dtype != DType::F16) {
    t_last_error = "attention: cuDNN's fused SDPA needs bf16 or fp16 inputs; fp32 attention is not supported "
                   "by the cuDNN seam";
    return cudaErrorNotSupported;
  }
  if (misaligned) {
    t_last_error = "attention: bf16 / fp16 tensors (and the K / V views, NH*HS a multiple of 8) must be 16-byte aligned";
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace

void release_attention_stream(void* stream) {
  State& S = state();
  std::lock_guard<std::mutex> lock(S.mu);
  release_stream(S.workspaces, stream, [](const Workspace& w) { free_quietly(w.p); });
}

cudaError_t attention_forward(const AttentionForwardParams& p) {
  bool empty = false;
  const size_t kv_bytes = size_t(p.NH) * p.HS * 2;
  const bool misaligned = !aligned16(p.qkv) || !aligned16(p.out) || kv_bytes % 16 != 0;
  const cudaError_t e =
      check_args(p.B, p.T, p.NH, p.HS, p.dtype, !p.out || !p.stats || !p.qkv, misaligned, &empty);
  if (e != cudaSuccess || empty) return e;
  return run_guarded(t_last_error, [&] { execute(p); });
}

cudaError_t attention_backward(const AttentionBackwardParams& p) {
  bool empty = false;
  const size_t kv_bytes = size_t(p.NH) * p.HS * 2;
  const bool misaligned = !aligned16(p.qkv) || !aligned16(p.dqkv) || !aligned16(p.out) || !aligned16(p.dout) ||
                          kv_bytes % 16 != 0;
  const cudaError_t e = check_args(p.B, p.T, p.NH, p.HS, p.dtype,
                                   !p.dqkv || !p.dout || !p.qkv || !p.out || !p.stats, misaligned, &empty);
  if (e != cudaSuccess || empty) return e;
  return run_guarded(t_last_error, [&] { execute(p); });
}

}  // namespace gpt2core::seams

#else  // !GPT2CORE_HAS_CUDNN_SDPA: the GPU build without cuDNN or its frontend headers

namespace gpt2core::seams {

void release_attention_stream(void*) {}

cudaError_t attention_forward(const AttentionForwardParams& p) {
  t_last_error = p.dtype == DType::F32 ? "attention: cuDNN's fused SDPA needs bf16 or fp16 inputs (and this build has "
                                         "no cuDNN frontend either)"
                                       : "attention: gpt2core was built without cuDNN frontend (cuDNN SDPA unavailable)";
  return cudaErrorNotSupported;
}

cudaError_t attention_backward(const AttentionBackwardParams& p) {
  t_last_error = p.dtype == DType::F32 ? "attention: cuDNN's fused SDPA needs bf16 or fp16 inputs (and this build has "
                                         "no cuDNN frontend either)"
                                       : "attention: gpt2core was built without cuDNN frontend (cuDNN SDPA unavailable)";
  return cudaErrorNotSupported;
}

}  // namespace gpt2core::seams

#endif  // GPT2CORE_HAS_CUDNN_SDPA
