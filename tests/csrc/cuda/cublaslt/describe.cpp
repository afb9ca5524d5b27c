// describe.cpp: a C entry point (for ctypes) that runs the real cuBLASLt translation of one seams::matmul
// (describe_matmul in csrc/cuda/seams_cublaslt.cu, linked against NVIDIA's libcublasLt) and reads every
// attribute of the resulting descriptors back through cuBLASLt's Get*Attribute calls. No handle, no GPU:
// tests/csrc/cuda/test_cublaslt_descriptors.py evaluates what was read back with its own column-major interpreter.
#include <cublasLt.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

#include "cuda/seams_cublaslt_call.h"

using namespace gpt2core::seams;

extern "C" {

// seams::MatmulParams with C types (pointers as addresses); tf32: the compute mode switch; bias_grad, then the FP8
// scale pointers last.
struct SeamParams {
  uint64_t d, a, b, bias, pre_gelu;
  int32_t d_type, a_type, b_type, lda, ldb, ldd, trans_a, trans_b, m, n, k, accumulate, epilogue, batch, tf32;
  float alpha;
  int64_t stride_a, stride_b, stride_d;
  uint64_t bias_grad;
  uint64_t a_scale, b_scale;
};

struct Layout {
  int32_t type, order, batch_count;
  uint64_t rows, cols;
  int64_t ld, batch_stride;
};

struct Described {
  int32_t compute_type, scale_type, transa, transb, bias_type, aux_type;
  uint32_t epilogue;
  uint64_t bias, aux;
  int64_t aux_ld, aux_batch_stride;
  Layout a, b, c, d;
  uint64_t max_workspace;
  uint32_t align_a, align_b, align_c, align_d;
  uint64_t A, B, C, D;  // the pointers cublasLtMatmul would get
  float alpha, beta;
  uint64_t a_scale, b_scale;  // CUBLASLT_MATMUL_DESC_A / B_SCALE_POINTER (cuBLASLt's A and B)
  int32_t fast_accum;         // CUBLASLT_MATMUL_DESC_FAST_ACCUM
};

}  // extern "C"

namespace {

void check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": " + cublasLtGetStatusName(st));
}
template <class V>
void get(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, V* v) {
  size_t written = 0;
  check(cublasLtMatmulDescGetAttribute(d, attr, v, sizeof(*v), &written), "cublasLtMatmulDescGetAttribute");
}
template <class V>
void get(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr, V* v) {
  size_t written = 0;
  check(cublasLtMatrixLayoutGetAttribute(l, attr, v, sizeof(*v), &written), "cublasLtMatrixLayoutGetAttribute");
}
template <class V>
void get(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, V* v) {
  size_t written = 0;
  check(cublasLtMatmulPreferenceGetAttribute(p, attr, v, sizeof(*v), &written), "cublasLtMatmulPreferenceGetAttribute");
}
Layout read(cublasLtMatrixLayout_t l) {
  Layout o{};
  uint32_t type = 0;
  get(l, CUBLASLT_MATRIX_LAYOUT_TYPE, &type);
  o.type = int32_t(type);
  get(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &o.order);
  get(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &o.rows);
  get(l, CUBLASLT_MATRIX_LAYOUT_COLS, &o.cols);
  get(l, CUBLASLT_MATRIX_LAYOUT_LD, &o.ld);
  get(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &o.batch_count);
  get(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &o.batch_stride);
  return o;
}

}  // namespace

extern "C" int gpt2_describe_matmul(const SeamParams* s, Described* out, char* err, int errlen) {
  try {
    MatmulParams p;
    p.d = reinterpret_cast<void*>(s->d), p.a = reinterpret_cast<const void*>(s->a);
    p.b = reinterpret_cast<const void*>(s->b), p.bias = reinterpret_cast<const void*>(s->bias);
    p.pre_gelu = reinterpret_cast<void*>(s->pre_gelu);
    p.d_type = DType(s->d_type), p.a_type = DType(s->a_type), p.b_type = DType(s->b_type);
    p.lda = s->lda, p.ldb = s->ldb, p.ldd = s->ldd, p.trans_a = s->trans_a, p.trans_b = s->trans_b;
    p.m = s->m, p.n = s->n, p.k = s->k, p.alpha = s->alpha, p.accumulate = s->accumulate;
    p.epilogue = Epilogue(s->epilogue), p.batch = s->batch;
    p.stride_a = s->stride_a, p.stride_b = s->stride_b, p.stride_d = s->stride_d;
    p.bias_grad = reinterpret_cast<void*>(s->bias_grad);
    p.a_scale = reinterpret_cast<const float*>(s->a_scale), p.b_scale = reinterpret_cast<const float*>(s->b_scale);
    if (validate_matmul(p) != cudaSuccess) throw std::runtime_error("validate_matmul refused the params");

    CublasLtCall call;
    p.tf32 = s->tf32 != 0;
    describe_matmul(p, size_t(32) << 20, call);
    Described& o = *out;
    void* ptr = nullptr;
    get(call.op, CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, &o.compute_type);
    get(call.op, CUBLASLT_MATMUL_DESC_SCALE_TYPE, &o.scale_type);
    get(call.op, CUBLASLT_MATMUL_DESC_TRANSA, &o.transa);
    get(call.op, CUBLASLT_MATMUL_DESC_TRANSB, &o.transb);
    get(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &o.epilogue);
    get(call.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr);
    o.bias = reinterpret_cast<uint64_t>(ptr);
    get(call.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &o.bias_type);
    get(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ptr);
    o.aux = reinterpret_cast<uint64_t>(ptr);
    get(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &o.aux_ld);
    get(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &o.aux_batch_stride);
    get(call.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &o.aux_type);
    o.a = read(call.a), o.b = read(call.b), o.c = read(call.c), o.d = read(call.d);
    get(call.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &o.max_workspace);
    get(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &o.align_a);
    get(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &o.align_b);
    get(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &o.align_c);
    get(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &o.align_d);
    o.A = reinterpret_cast<uint64_t>(call.A), o.B = reinterpret_cast<uint64_t>(call.B);
    o.C = reinterpret_cast<uint64_t>(call.C), o.D = reinterpret_cast<uint64_t>(call.D);
    o.alpha = call.alpha, o.beta = call.beta;
    get(call.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ptr);
    o.a_scale = reinterpret_cast<uint64_t>(ptr);
    get(call.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &ptr);
    o.b_scale = reinterpret_cast<uint64_t>(ptr);
    int8_t fast = -1;
    get(call.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast);
    o.fast_accum = fast;
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, size_t(errlen), "%s", e.what());
    return 1;
  }
}
