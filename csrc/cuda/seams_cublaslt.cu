// gpt2core::seams::matmul over cuBLASLt (GPU build; the emulated build links csrc/emu/seams_cpu.cpp).
//
// Row-major D (m, n) = op(A) (m, k) @ op(B) (k, n) is computed as the column-major product
// D^T (n, m) = op(B)^T @ op(A)^T: cuBLASLt's "A" is our B and its "B" is our A, with the transposes swapped
// accordingly; the bias (n) is then a per-row vector of D^T, which is what cuBLASLt's bias epilogue takes.
// Compute: fp32 (CUBLAS_COMPUTE_32F), or TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32) for fp32 inputs
// when the call's params say tf32; bf16 inputs accumulate in fp32. Epilogues: bias, GELU (+ bias, + saving the
// pre-activation as aux), GELU backward (dGELU from aux; not combined with accumulation). Algorithms come from
// cuBLASLt's heuristic once per shape (cached). One handle and a 32 MiB workspace for the process, on the
// device current when first used.
#include <cublasLt.h>

#include <array>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda/seams_check.h"
#include "cuda/seams_cublaslt.h"
#include "cuda/seams.h"

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
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

struct State {
  std::mutex mu;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<std::array<long long, 20>, cublasLtMatmulAlgo_t> algos;
};
State& state() {
  static State* s = new State();  // never destroyed: no CUDA calls at exit
  return *s;
}
thread_local std::string t_last_error;

cudaDataType_t cuda_type(DType t) { return t == DType::F32 ? CUDA_R_32F : CUDA_R_16BF; }

// RAII holders for the descriptors of one call.
struct Desc {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Desc() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

void set_batch(cublasLtMatrixLayout_t l, int batch, long long stride) {
  if (batch <= 1) return;
  int32_t count = batch;
  int64_t s = stride;
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s, sizeof(s)));
}

void matmul_impl(const MatmulParams& p) {
  State& S = state();
  std::lock_guard<std::mutex> lock(S.mu);
  if (!S.handle) {
    CUBLAS_CHECK(cublasLtCreate(&S.handle));
    CUDA_CHECK_THROW(cudaMalloc(&S.workspace, kWorkspaceBytes));
  }
  const bool all_f32 = p.a_type == DType::F32 && p.b_type == DType::F32 && p.d_type == DType::F32;
  const cublasComputeType_t compute = (p.tf32 && all_f32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;

  Desc ds;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&ds.op, compute, CUDA_R_32F));
  const cublasOperation_t ta = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our B
  const cublasOperation_t tb = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B is our A
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));

  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  switch (p.epilogue) {
    case Epilogue::None:
      epi = p.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
      break;
    case Epilogue::Gelu:
      if (p.pre_gelu) epi = p.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      else epi = p.bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
      break;
    case Epilogue::GeluBackward:
      epi = CUBLASLT_EPILOGUE_DGELU;
      break;
  }
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (p.bias && p.epilogue != Epilogue::GeluBackward) {
    const void* bias = p.bias;
    const cudaDataType_t bt = cuda_type(p.d_type);
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  if (p.pre_gelu) {
    void* aux = p.pre_gelu;
    const int64_t ld = p.ldd;
    const cudaDataType_t at = cuda_type(p.d_type);
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &at, sizeof(at)));
    if (p.batch > 1) {
      const int64_t s = p.stride_d;
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &s,
                                                  sizeof(s)));
    }
  }

  // column-major layouts: our B as (rows, cols) = op-dependent, our A likewise, D^T (n, m)
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.a, cuda_type(p.b_type), p.trans_b ? p.k : p.n, p.trans_b ? p.n : p.k,
                                          p.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.b, cuda_type(p.a_type), p.trans_a ? p.m : p.k, p.trans_a ? p.k : p.m,
                                          p.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds.d, cuda_type(p.d_type), p.n, p.m, p.ldd));
  set_batch(ds.a, p.batch, p.stride_b);
  set_batch(ds.b, p.batch, p.stride_a);
  set_batch(ds.d, p.batch, p.stride_d);

  const std::array<long long, 20> key = {p.m, p.n, p.k, p.lda, p.ldb, p.ldd, p.trans_a, p.trans_b, int(p.a_type),
                                         int(p.b_type), int(p.d_type), int(epi), p.bias != nullptr, p.accumulate,
                                         p.batch, p.stride_a, p.stride_b, p.stride_d, int(compute),
                                         // pointer alignment changes which algorithms apply
                                         (long long)((reinterpret_cast<uintptr_t>(p.a) | reinterpret_cast<uintptr_t>(p.b) |
                                                      reinterpret_cast<uintptr_t>(p.d)) & 15)};
  auto it = S.algos.find(key);
  if (it == S.algos.end()) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&ds.pref));
    const uint64_t ws = kWorkspaceBytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                      sizeof(ws)));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(S.handle, ds.op, ds.a, ds.b, ds.d, ds.d, ds.pref, 1, &res, &found));
    if (found == 0)
      throw std::runtime_error("cuBLASLt has no algorithm for this matmul (m=" + std::to_string(p.m) + " n=" +
                               std::to_string(p.n) + " k=" + std::to_string(p.k) + ")");
    it = S.algos.emplace(key, res.algo).first;
  }
  const float alpha = p.alpha, beta = p.accumulate ? 1.0f : 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(S.handle, ds.op, &alpha, p.b, ds.a, p.a, ds.b, &beta, p.d, ds.d, p.d, ds.d, &it->second,
                              S.workspace, kWorkspaceBytes, p.stream));
}

}  // namespace

std::string last_matmul_error() { return t_last_error; }

cudaError_t matmul(const MatmulParams& p) {
  if (const cudaError_t e = validate_matmul(p); e != cudaSuccess) {
    if (p.epilogue == Epilogue::GeluBackward && !p.pre_gelu) t_last_error = "GELU backward epilogue needs pre_gelu";
    return e;
  }
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if (p.epilogue == Epilogue::GeluBackward && p.accumulate) {
    t_last_error = "GELU backward epilogue with accumulation is not supported by cuBLASLt";
    return cudaErrorNotSupported;
  }
  return run_guarded(t_last_error, [&] { matmul_impl(p); });
}

}  // namespace gpt2core::seams
