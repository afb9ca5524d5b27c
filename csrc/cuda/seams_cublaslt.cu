// gpt2core::seams::matmul over cuBLASLt (GPU build; the emulated build links csrc/emu/seams_cpu.cpp).
//
// Row-major D (m, n) = op(A) (m, k) @ op(B) (k, n) is computed as the column-major product
// D^T (n, m) = op(B)^T @ op(A)^T: cuBLASLt's "A" is our B and its "B" is our A, with the transposes swapped
// accordingly; the bias (n) is then a per-row vector of D^T, which is what cuBLASLt's bias epilogue takes.
// Compute: fp32 (CUBLAS_COMPUTE_32F), or TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32) for fp32 inputs
// when the call's params say tf32; bf16 and fp16 inputs accumulate in fp32 (scale type fp32 throughout). FP8 inputs
// (e4m3 / e5m2, "TN" as seams.h states) take their dequantisation factors through cuBLASLt's A / B scale pointers
// (device memory, swapped like the operands) and accumulate in fp32 without fast accumulation. Epilogues:
// bias, GELU (+ bias, + saving the pre-activation as aux, in D's type: the aux type is left at its default), GELU
// backward (dGELU from aux), bias gradient (BGRADB: cuBLASLt's B is our A, so the sums over k of op(A)'s rows,
// written to bias_grad in D's type); no GELU epilogue with accumulation (seams.h). A fused epilogue cuBLASLt
// refuses at run time (no algorithm, or NOT_SUPPORTED / INVALID_VALUE) returns cudaErrorNotSupported having
// written nothing, so the caller can run the unfused ops instead. Algorithm: once per shape, types, epilogue and the
// alignment of every pointer, the heuristic's first (p.tune false, the default: as llm.c), or (p.tune) the
// heuristic's best kCandidates timed with CUDA events and the fastest is cached (matmul_algo_choice.h); while
// the stream captures a CUDA graph nothing is timed and the heuristic's first runs (uncached: the model's first,
// uncaptured step has chosen before capture). A batch_invariant batch runs with the algorithm its entry 0 gets as
// a batch of one, checked against the batched layout (cublasLtMatmulAlgoCheck), or entry by entry. The preference
// states the actual alignments (cuBLASLt otherwise assumes 256 bytes and may pick a kernel that faults on a less
// aligned matrix). The choice is per process: two processes may time different winners, whose fp32 sums may
// round differently. One handle per device and a 32 MiB workspace per (device, stream), i.e. per backend: two
// models on two streams or devices never share one; release_matmul_stream frees a stream's before the stream goes.
//
// describe_matmul (seams_cublaslt_call.h) builds the descriptors, which need no GPU; matmul_impl picks the
// algorithm and runs it.
#include <cublasLt.h>

#include <array>
#include <map>
#include <optional>
#include <utility>
#include <vector>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda/matmul_algo_choice.h"
#include "cuda/seams.h"
#include "cuda/seams_check.h"
#include "cuda/seams_cublaslt.h"
#include "cuda/seams_cublaslt_call.h"

// Throws std::runtime_error with file, line and cuBLASLt's message.
#define CUBLAS_CHECK(call)                                                                                  \
  do {                                                                                                      \
    cublasStatus_t st_ = (call);                                                                            \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                       \
      throw std::runtime_error(std::string("cuBLASLt error ") + cublasLtGetStatusName(st_) + " at " +       \
                               __FILE__ + ":" + std::to_string(__LINE__) + " (" #call "): " +               \
                               cublasLtGetStatusString(st_));                                               \
  } while (0)

namespace gpt2core::seams {

CublasLtCall::~CublasLtCall() {
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (d) cublasLtMatrixLayoutDestroy(d);
  if (c) cublasLtMatrixLayoutDestroy(c);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (op) cublasLtMatmulDescDestroy(op);
}

uint32_t alignment_bytes(const void* p, long long ld_bytes, long long batch_stride_bytes) {
  const uint64_t bits = uint64_t(reinterpret_cast<uintptr_t>(p)) | uint64_t(ld_bytes) | uint64_t(batch_stride_bytes) | 256u;
  return uint32_t(bits & (~bits + 1));  // the lowest set bit
}

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;
constexpr int kCandidates = 8;  // algorithms asked of the heuristic and timed
constexpr int kTimedRuns = 3;   // timed runs per candidate, after one warm-up run

// Algorithm cache key: device, shapes, leading dimensions, transposes, types, epilogue, accumulate, batch, strides
// (0 at batch 1, where cuBLASLt never sees them), compute type and the alignments of A, B, D, bias and aux (the
// heuristic's answer depends on all of them).
using AlgoKey = std::array<long long, 26>;

struct State {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;                   // per device
  std::map<std::pair<int, void*>, void*> workspaces;         // per (device, stream): one per backend
  AlgoChoice<AlgoKey, cublasLtMatmulAlgo_t> algos;
};
State& state() {
  static State* s = new State();  // never destroyed: no CUDA calls at exit
  return *s;
}
thread_local std::string t_last_error;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    case DType::E4M3: return CUDA_R_8F_E4M3;
    case DType::E5M2: return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}

template <class V>
void set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& v) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
}

void set_batch(cublasLtMatrixLayout_t l, int batch, long long stride) {
  if (batch <= 1) return;
  int32_t count = batch;
  int64_t s = stride;
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s, sizeof(s)));
}

cublasLtEpilogue_t epilogue_of(const MatmulParams& p) {
  switch (p.epilogue) {
    case Epilogue::Gelu:
      if (p.pre_gelu) return p.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      return p.bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    case Epilogue::GeluBackward: return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::None: break;
  }
  if (p.bias_grad) return CUBLASLT_EPILOGUE_BGRADB;  // cuBLASLt's B is our A: sums over k per column of D^T
  return p.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

cublasComputeType_t compute_of(const MatmulParams& p) {
  const bool all_f32 = p.a_type == DType::F32 && p.b_type == DType::F32 && p.d_type == DType::F32;
  return (p.tf32 && all_f32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

// Alignments of our A, B, D (with their leading dimensions and batch strides), bias and aux.
struct Alignments {
  uint32_t a, b, d, bias, aux;
};
Alignments alignments_of(const MatmulParams& p) {
  const long long ea = dtype_size(p.a_type), eb = dtype_size(p.b_type), ed = dtype_size(p.d_type);
  const bool batched = p.batch > 1;
  return {alignment_bytes(p.a, p.lda * ea, batched ? p.stride_a * ea : 0),
          alignment_bytes(p.b, p.ldb * eb, batched ? p.stride_b * eb : 0),
          alignment_bytes(p.d, p.ldd * ed, batched ? p.stride_d * ed : 0),
          p.bias ? alignment_bytes(p.bias, 0, 0) : p.bias_grad ? alignment_bytes(p.bias_grad, 0, 0) : 0u,
          p.pre_gelu ? alignment_bytes(p.pre_gelu, p.ldd * ed, batched ? p.stride_d * ed : 0) : 0u};
}

}  // namespace

void describe_matmul(const MatmulParams& p, size_t workspace_bytes, CublasLtCall& call) {
  const cublasComputeType_t compute = compute_of(p);
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.op, compute, CUDA_R_32F));
  set(call.op, CUBLASLT_MATMUL_DESC_TRANSA, p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);  // cuBLASLt's A is our B
  set(call.op, CUBLASLT_MATMUL_DESC_TRANSB, p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);  // cuBLASLt's B is our A
  set(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue_of(p));
  if (p.bias && p.epilogue != Epilogue::GeluBackward) {
    set(call.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
    set(call.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(p.d_type));
  }
  if (p.bias_grad) {  // the bias gradient's output: cuBLASLt's bias pointer, in D's type (cublasLt.h)
    set(call.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias_grad);
    set(call.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(p.d_type));
  }
  if (is_fp8(p.a_type)) {  // FP8: the dequantisation factors (cuBLASLt's A is our B), fp32 accumulation
    set(call.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(p.b_scale));
    set(call.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(p.a_scale));
    set(call.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(0));
  }
  if (p.pre_gelu) {  // aux: (m, n) like D, ld and batch stride of D; its type defaults to D's (cublasLt.h)
    set(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p.pre_gelu);
    set(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t(p.ldd));
    if (p.batch > 1) set(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, int64_t(p.stride_d));
  }

  // column-major layouts: our B as (rows, cols) = op-dependent, our A likewise, C = D^T (n, m)
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.a, cuda_type(p.b_type), p.trans_b ? p.k : p.n, p.trans_b ? p.n : p.k,
                                          p.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.b, cuda_type(p.a_type), p.trans_a ? p.m : p.k, p.trans_a ? p.k : p.m,
                                          p.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.c, cuda_type(p.d_type), p.n, p.m, p.ldd));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&call.d, cuda_type(p.d_type), p.n, p.m, p.ldd));
  set_batch(call.a, p.batch, p.stride_b);
  set_batch(call.b, p.batch, p.stride_a);
  set_batch(call.c, p.batch, p.stride_d);
  set_batch(call.d, p.batch, p.stride_d);

  const Alignments al = alignments_of(p);
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&call.pref));
  auto pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto v) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.pref, attr, &v, sizeof(v)));
  };
  pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(workspace_bytes));
  pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al.b);  // cuBLASLt's A is our B
  pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al.a);
  pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al.d);
  pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al.d);

  call.A = p.b, call.B = p.a, call.C = p.d, call.D = p.d;
  call.alpha = p.alpha, call.beta = p.accumulate ? 1.0f : 0.0f;
}

namespace {

// Whether candidates may be timed on stream: not while it (or, in global mode, another stream) captures a graph.
bool can_time(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) == cudaSuccess && status == cudaStreamCaptureStatusNone;
}

// A device buffer freed when the matmul's timing is done.
struct Scratch {
  void* ptr = nullptr;
  ~Scratch() { free_quietly(ptr); }
};

// Milliseconds per run of call with algo (the mean of kTimedRuns after a warm-up run), or -1 if cuBLASLt or CUDA
// failed. A beta = 1 call reads C = the real D and writes a scratch D of the same layout (allocated on first
// use), so timing leaves D as it was; a beta = 0 call writes D in place, and either writes its aux or bias
// gradient output in place: outputs only, which the real run then overwrites.
float time_algo(cublasLtHandle_t handle, const CublasLtCall& call, const MatmulParams& p,
                const cublasLtMatmulAlgo_t& algo, void* workspace, Scratch& scratch) {
  void* D = call.D;
  if (call.beta != 0.0f) {
    if (!scratch.ptr) {
      const size_t bytes = (size_t(p.batch - 1) * size_t(p.stride_d) + size_t(p.m - 1) * size_t(p.ldd) + size_t(p.n)) *
                           dtype_size(p.d_type);
      if (cudaMalloc(&scratch.ptr, bytes) != cudaSuccess) {
        (void)cudaGetLastError();  // out of memory is not sticky: clear it and use the heuristic's first
        scratch.ptr = nullptr;
        return -1.0f;
      }
    }
    D = scratch.ptr;
  }
  auto run = [&] {
    return cublasLtMatmul(handle, call.op, &call.alpha, call.A, call.a, call.B, call.b, &call.beta, call.C, call.c, D,
                          call.d, &algo, workspace, kWorkspaceBytes, p.stream) == CUBLAS_STATUS_SUCCESS;
  };
  cudaEvent_t start = nullptr, stop = nullptr;
  float ms = -1.0f;
  if (cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess && run() &&
      cudaEventRecord(start, p.stream) == cudaSuccess) {
    bool ok = true;
    for (int r = 0; r < kTimedRuns && ok; r++) ok = run();
    if (ok && cudaEventRecord(stop, p.stream) == cudaSuccess && cudaEventSynchronize(stop) == cudaSuccess &&
        cudaEventElapsedTime(&ms, start, stop) == cudaSuccess)
      ms /= kTimedRuns;
    else
      ms = -1.0f;
  }
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  return ms;
}

// What matmul_impl did with p.
enum class Ran {
  Yes,       // ran
  Refused,   // cuBLASLt refused its fused epilogue (nothing was written; t_last_error says why)
  PerEntry,  // nothing: p (batch_invariant) is to run as one call per batch entry (entry_of)
};

// Entry b of a batched p as a call of its own (batch 1).
MatmulParams entry_of(const MatmulParams& p, int b) {
  MatmulParams q = p;
  q.batch = 1;
  q.stride_a = q.stride_b = q.stride_d = 0;
  q.a = static_cast<const char*>(p.a) + b * p.stride_a * (long long)dtype_size(p.a_type);
  q.b = static_cast<const char*>(p.b) + b * p.stride_b * (long long)dtype_size(p.b_type);
  q.d = static_cast<char*>(p.d) + b * p.stride_d * (long long)dtype_size(p.d_type);
  if (p.pre_gelu) q.pre_gelu = static_cast<char*>(p.pre_gelu) + b * p.stride_d * (long long)dtype_size(p.d_type);
  return q;
}

Ran matmul_impl(const MatmulParams& p) {
  State& S = state();
  std::lock_guard<std::mutex> lock(S.mu);
  int device = 0;
  CUDA_CHECK_THROW(cudaGetDevice(&device));
  cublasLtHandle_t& handle = S.handles[device];
  if (!handle) CUBLAS_CHECK(cublasLtCreate(&handle));
  void*& workspace = S.workspaces[{device, static_cast<void*>(p.stream)}];
  if (!workspace) CUDA_CHECK_THROW(cudaMalloc(&workspace, kWorkspaceBytes));

  CublasLtCall call;
  describe_matmul(p, kWorkspaceBytes, call);
  const bool fused = p.epilogue != Epilogue::None || p.bias_grad;
  auto refused = [&](const char* what, cublasStatus_t st) {
    t_last_error = std::string("cuBLASLt refused the fused ") + (p.bias_grad ? "bias gradient" : "GELU") +
                   " epilogue (" + what + ": " + cublasLtGetStatusName(st) + ")";
    return Ran::Refused;
  };
  // batch_invariant (seams.h): the algorithm is the one entry 0 gets as a batch of one (its key, its heuristic,
  // its timing); with every alignment at 256 bytes each entry's own batch-of-one call would get the same one
  const bool pinned = p.batch > 1 && p.batch_invariant;
  const Alignments al = alignments_of(p);
  if (pinned && (al.a != 256 || al.b != 256 || al.d != 256 || (p.pre_gelu && al.aux != 256))) return Ran::PerEntry;
  const MatmulParams one = pinned ? entry_of(p, 0) : p;
  CublasLtCall one_call;
  if (pinned) describe_matmul(one, kWorkspaceBytes, one_call);
  const CublasLtCall& chosen_for = pinned ? one_call : call;
  const Alignments ol = alignments_of(one);
  const AlgoKey key = {device, one.m, one.n, one.k, one.lda, one.ldb, one.ldd, one.trans_a, one.trans_b,
                       int(one.a_type), int(one.b_type), int(one.d_type), int(epilogue_of(one)), one.bias != nullptr,
                       one.accumulate, one.batch, one.batch > 1 ? one.stride_a : 0, one.batch > 1 ? one.stride_b : 0,
                       one.batch > 1 ? one.stride_d : 0, int(compute_of(one)),
                       ol.a, ol.b, ol.d, ol.bias, ol.aux, one.tune};
  cublasStatus_t heuristic = CUBLAS_STATUS_SUCCESS;
  auto candidates = [&] {
    std::array<cublasLtMatmulHeuristicResult_t, kCandidates> res{};
    int found = 0;
    heuristic = cublasLtMatmulAlgoGetHeuristic(handle, chosen_for.op, chosen_for.a, chosen_for.b, chosen_for.c,
                                               chosen_for.d, chosen_for.pref, kCandidates, res.data(), &found);
    std::vector<cublasLtMatmulAlgo_t> algos;
    for (int i = 0; heuristic == CUBLAS_STATUS_SUCCESS && i < found; i++)
      if (res[size_t(i)].state == CUBLAS_STATUS_SUCCESS) algos.push_back(res[size_t(i)].algo);
    return algos;
  };
  Scratch scratch;
  auto time = [&](const cublasLtMatmulAlgo_t& algo) {
    return time_algo(handle, chosen_for, one, algo, workspace, scratch);
  };
  const std::optional<cublasLtMatmulAlgo_t> algo = S.algos.choose(key, p.tune, can_time(p.stream), candidates, time);
  if (!algo) {
    if (fused && (heuristic == CUBLAS_STATUS_NOT_SUPPORTED || heuristic == CUBLAS_STATUS_INVALID_VALUE ||
                  heuristic == CUBLAS_STATUS_SUCCESS))
      return refused("no algorithm", heuristic);
    CUBLAS_CHECK(heuristic);
    throw std::runtime_error("cuBLASLt has no algorithm for this matmul (m=" + std::to_string(p.m) + " n=" +
                             std::to_string(p.n) + " k=" + std::to_string(p.k) + ")");
  }
  if (pinned) {  // the batch-of-one's algorithm over the batched layout, if cuBLASLt takes it there
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(handle, call.op, call.a, call.b, call.c, call.d, &*algo, &check) !=
            CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > kWorkspaceBytes)
      return Ran::PerEntry;
  }
  const cublasStatus_t st = cublasLtMatmul(handle, call.op, &call.alpha, call.A, call.a, call.B, call.b, &call.beta,
                                           call.C, call.c, call.D, call.d, &*algo, workspace, kWorkspaceBytes,
                                           p.stream);
  if (fused && (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE))
    return refused("cublasLtMatmul", st);
  if (pinned && (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)) return Ran::PerEntry;
  CUBLAS_CHECK(st);
  return Ran::Yes;
}

}  // namespace

std::string last_matmul_error() { return t_last_error; }

void release_matmul_stream(void* stream) {
  State& S = state();
  std::lock_guard<std::mutex> lock(S.mu);
  release_stream(S.workspaces, stream, [](void* w) { free_quietly(w); });
}

cudaError_t matmul(const MatmulParams& p) {
  if (const cudaError_t e = validate_matmul(p); e != cudaSuccess) {
    if (is_fp8(p.a_type) || is_fp8(p.b_type) || is_fp8(p.d_type) || p.a_scale || p.b_scale)
      t_last_error = "FP8 matmul outside what cuBLASLt's FP8 kernels take (seams.h: e4m3 / e5m2 inputs, not both "
                     "e5m2, trans_a false and trans_b true, k, lda, ldb multiples of 16, 16-byte aligned, no epilogue)";
    else if (e == cudaErrorNotSupported)
      t_last_error = "a GELU epilogue does not combine with accumulate (cuBLASLt would apply GELU to alpha AB + C)";
    else if (p.epilogue == Epilogue::GeluBackward && !p.pre_gelu)
      t_last_error = "GELU backward epilogue needs pre_gelu";
    return e;
  }
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  Ran ran = Ran::Yes;
  const cudaError_t e = run_guarded(t_last_error, [&] { ran = matmul_impl(p); });
  if (e == cudaSuccess && ran == Ran::PerEntry)  // batch_invariant, not batchable here: each entry on its own
    for (int b = 0; b < p.batch; b++)
      if (const cudaError_t eb = matmul(entry_of(p, b)); eb != cudaSuccess) return eb;
  return e == cudaSuccess && ran == Ran::Refused ? cudaErrorNotSupported : e;
}

}  // namespace gpt2core::seams
