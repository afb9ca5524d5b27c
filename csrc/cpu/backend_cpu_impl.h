// The CPU backend's class, compiled once per instruction-set variant: a variant's source file
// (backend_cpu_<isa>.cpp) defines GPT2CORE_CPU_ISA (its namespace) and GPT2CORE_CPU_TARGET (GCC target options,
// e.g. "arch=x86-64-v3"; none for the baseline) and includes this file. Everything below the target pragma, the
// ops and their OpenMP loop bodies included, is compiled for that target; the headers above it stay at the
// baseline, so the inline code the variants share (std::, model/backend.h) is the same in every object file.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <sys/mman.h>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <omp.h>

#include "cpu/blas.h"
#include "cpu/gemm_bf16.h"
#include "model/backend.h"
#include "model/optimizer.h"
#include "model/sampling.h"

#if defined(GPT2CORE_CPU_AVX2)
#include <immintrin.h>  // the intrinsics carry their own target attributes; used below the pragma only
#endif

#if defined(GPT2CORE_CPU_TARGET)
#define GPT2CORE_PRAGMA_(x) _Pragma(#x)
#define GPT2CORE_TARGET_PRAGMA(t) GPT2CORE_PRAGMA_(GCC target(t))
GPT2CORE_TARGET_PRAGMA(GPT2CORE_CPU_TARGET)
#endif

#include "cpu/ops.h"
#include "cpu/ops_infer.h"

namespace gpt2::cpu::GPT2CORE_CPU_ISA {

namespace ops = ::gpt2::cpu::GPT2CORE_CPU_ISA;  // this variant's ops (cpu/ops.h), beside the members of the same names

template <typename T>
class CpuBackend final : public Backend<T> {
  static_assert(std::is_same_v<T, Master<T>>, "the CPU backend computes in float or double");

 public:
  const char* name() const override { return "cpu"; }

  T* alloc(size_t n) override { return static_cast<T*>(zeroed(n * sizeof(T))); }
  void free(T* p) override { release(p); }
  size_t bytes_in_use() const override { return in_use_; }
  // CPU models are float or double: the master type is T itself
  T* alloc_master(size_t n) override { return alloc(n); }
  void free_master(T* p) override { release(p); }
  int32_t* alloc_i32(size_t n) override { return static_cast<int32_t*>(zeroed(n * sizeof(int32_t))); }
  void free_i32(int32_t* p) override { release(p); }
  void zero(T* p, size_t n) override {
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) p[i] = 0;
  }
  void to_device_i32(int32_t* dst, const int32_t* src, size_t n) override { std::memcpy(dst, src, n * sizeof(int32_t)); }
  void zero_master(T* p, size_t n) override { zero(p, n); }
  void accumulate_master(T* dst, const T* src, size_t n, bool add) override {
    if (!add) {
      if (n) std::memcpy(dst, src, n * sizeof(T));
      return;
    }
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) dst[i] += src[i];
  }
  void to_host(T* dst, const T* src, size_t n) override { std::memcpy(dst, src, n * sizeof(T)); }
  void to_host_master(T* dst, const T* src, size_t n) override { to_host(dst, src, n); }

  void encoder_forward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn, int C) override {
    ops::encoder_forward(out, inp, wte, wpe, B, Tn, C);
  }
  void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* inp, int B, int Tn, int C) override {
    ops::encoder_backward(dwte, dwpe, dout, inp, B, Tn, C);
  }
  void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N, int C) override {
    ops::layernorm_forward(out, mean, rstd, inp, w, b, N, C);
  }
  // InputGrad::Write: the reference ops accumulate, so the input gradient is cleared first
  void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w, const T* mean,
                          const T* rstd, int N, int C, InputGrad mode) override {
    if (mode == InputGrad::Write) zero(dinp, size_t(N) * C);
    ops::layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
  }
  void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) override {
    if (N <= ops::kGemvMaxRows)  // decode: the weights' read is the cost; a GEMV streams them once
      ops::gemv_forward(out, inp, w, bias, N, C, OC);
    else
      ops::matmul_forward(out, inp, w, bias, N, C, OC);
  }
  void matmul_backward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int N, int C, int OC,
                       InputGrad mode) override {
    if (mode == InputGrad::Write) zero(dinp, size_t(N) * C);
    ops::matmul_backward(dinp, dw, dbias, dout, inp, w, N, C, OC);
  }
  // FP8 Linear (backend.h): the reference of the CUDA backend's FP8 ops. The amax, the scale and the cast are
  // model/fp8.h's (the values converted to float first, as a bf16 model's are exactly); the matmuls run on the
  // dequantised values (fp8 * 1 / s: exact in T) through the BLAS GEMM, so they agree with the device's fp32 sums of
  // the same fp8 products up to summation order. Backward reads the transposes (qt) as the device does.
  uint8_t* alloc_fp8(size_t bytes) override { return static_cast<uint8_t*>(zeroed(bytes)); }
  void free_fp8(uint8_t* p) override { release(p); }
  void fp8_quantize(Fp8Tensor out, const T* x, int rows, int cols, Fp8Kind kind) override {
    const size_t n = size_t(rows) * size_t(cols);
    uint32_t amax = 0;  // the bits of max |x| (NaN's above Inf's, as the device's unsigned max)
#pragma omp parallel for reduction(max : amax)
    for (size_t i = 0; i < n; i++) amax = std::max(amax, float_bits(float(x[i])) & 0x7fffffffu);
    const float s = fp8_scale(bits_float(amax), kind);
#pragma omp parallel for
    for (int r = 0; r < rows; r++)
      for (int c = 0; c < cols; c++) {
        const uint8_t b = float_to_fp8(float(x[size_t(r) * cols + c]) * s, kind);
        if (out.q) out.q[size_t(r) * cols + c] = b;
        if (out.qt) out.qt[size_t(c) * rows + r] = b;
      }
    out.meta[0] = 1.0f / s;
    out.meta[1] = bits_float(amax);
  }
  void fp8_linear_forward(T* out, Fp8Tensor inp8, const T* inp, const Fp8Tensor& w8, const T* bias, int N, int C,
                          int OC) override {
    fp8_quantize(inp8, inp, N, C, Fp8Kind::E4M3);
    const std::vector<T> a = dequantize(inp8.q, inp8.meta, size_t(N) * C, Fp8Kind::E4M3);
    const std::vector<T> w = dequantize(w8.q, w8.meta, size_t(OC) * C, Fp8Kind::E4M3);
    ops::matmul_forward(out, a.data(), w.data(), bias, N, C, OC);
  }
  void fp8_linear_backward(T* dinp, T* dw, T* dbias, Fp8Tensor dout8, const T* dout, const Fp8Tensor& inp8,
                           const Fp8Tensor& w8, int N, int C, int OC, InputGrad mode) override {
    fp8_quantize(dout8, dout, N, OC, Fp8Kind::E5M2);
    const std::vector<T> g = dequantize(dout8.q, dout8.meta, size_t(N) * OC, Fp8Kind::E5M2);     // (N, OC)
    const std::vector<T> gt = dequantize(dout8.qt, dout8.meta, size_t(N) * OC, Fp8Kind::E5M2);   // (OC, N)
    const std::vector<T> wt = dequantize(w8.qt, w8.meta, size_t(OC) * C, Fp8Kind::E4M3);         // (C, OC)
    const std::vector<T> xt = dequantize(inp8.qt, inp8.meta, size_t(N) * C, Fp8Kind::E4M3);      // (C, N)
    if (N > 0 && C > 0 && OC > 0) {
      gemm(false, true, N, C, OC, T(1), g.data(), OC, wt.data(), OC, mode == InputGrad::Add ? T(1) : T(0), dinp, C);
      gemm(false, true, OC, C, N, T(1), gt.data(), N, xt.data(), N, T(1), dw, C);
    } else if (mode == InputGrad::Write) {
      zero(dinp, size_t(N) * C);
    }
    if (dbias) {
#pragma omp parallel for
      for (int o = 0; o < OC; o++) {
        T sum = 0;
        for (int r = 0; r < N; r++) sum += dout[size_t(r) * OC + o];
        dbias[o] += sum;
      }
    }
  }
  void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH) override {
    ops::attention_forward(out, att, qkv, B, Tn, C, NH);
  }
  void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* /*out*/, const T* att, int B, int Tn, int C,
                          int NH, InputGrad mode) override {
    if (mode == InputGrad::Write) zero(dqkv, size_t(B) * Tn * 3 * C);
    ops::attention_backward(dqkv, dout, qkv, att, B, Tn, C, NH);
  }
  void gelu_forward(T* out, const T* inp, size_t N) override { ops::gelu_forward(out, inp, N); }
  void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N) override { ops::gelu_backward(dinp, inp, dout, N); }
  void residual_forward(T* out, const T* a, const T* b, size_t N) override { ops::residual_forward(out, a, b, N); }
  void crossentropy_forward(T* losses, T* lse, const T* logits, const int32_t* targets, int32_t* n_valid, int N,
                            int V, int Vp) override {
    *n_valid = int32_t(ops::crossentropy_forward(losses, lse, logits, targets, N, V, Vp));
  }
  void crossentropy_backward(T* logits, const T* lse, const int32_t* targets, const int32_t* n_valid,
                             float grad_scale, int N, int V, int Vp) override {
    ops::crossentropy_backward_inplace(logits, lse, targets, dloss(n_valid, grad_scale), N, V, Vp);
  }
  void loss_accumulate(T* acc, const T* losses, const int32_t* n_valid, int N, float scale) override {
    if (*n_valid <= 0) return;
    double s = 0;
    for (int i = 0; i < N; i++) s += double(losses[i]);
    *acc += T(double(scale) * (s / double(*n_valid)));
  }
  // the modern architecture (model/backend.h)
  void rmsnorm_forward(T* out, T* rstd, const T* inp, int N, int C) override {
    ops::rmsnorm_forward(out, rstd, inp, N, C, kNormEps);
  }
  void rmsnorm_backward(T* dinp, const T* dout, const T* inp, const T* rstd, int N, int C, InputGrad mode) override {
    if (mode == InputGrad::Write) zero(dinp, size_t(N) * C);
    ops::rmsnorm_backward(dinp, dout, inp, rstd, N, C);
  }
  void rope_forward(T* qkv, int B, int Tn, int C, int NH, int t0, float base) override {
    ops::rope_apply(qkv, B, Tn, C, NH, t0, double(base), +1);
  }
  void rope_backward(T* dqkv, int B, int Tn, int C, int NH, int t0, float base) override {
    ops::rope_apply(dqkv, B, Tn, C, NH, t0, double(base), -1);
  }
  void qk_norm_forward(T* qkv, T* rstd, int B, int Tn, int C, int NH) override {
    ops::qk_norm_forward(qkv, rstd, B, Tn, C, NH, kNormEps);
  }
  void qk_norm_backward(T* dqkv, const T* qkv, const T* rstd, int B, int Tn, int C, int NH) override {
    ops::qk_norm_backward(dqkv, qkv, rstd, B, Tn, C, NH);
  }
  void relu2_forward(T* out, const T* inp, size_t N) override { ops::relu2_forward(out, inp, N); }
  void relu2_backward(T* dinp, const T* inp, const T* dout, size_t N) override {
    ops::relu2_backward(dinp, inp, dout, N);
  }
  void softcap_forward(T* logits, float cap, size_t n) override { ops::softcap_forward(logits, T(cap), n); }
  void crossentropy_softcap_backward(T* logits, const T* lse, const int32_t* targets, const int32_t* n_valid,
                                     float grad_scale, float cap, int N, int V, int Vp) override {
    ops::crossentropy_backward_inplace(logits, lse, targets, dloss(n_valid, grad_scale), N, V, Vp, T(cap));
  }
  // the loss's forward and backward fused per row (ops::crossentropy_forward_backward_rows): one pass over the
  // logits instead of three (four with the soft-cap)
  void crossentropy_forward_backward(T* losses, T* lse, T* logits, const int32_t* targets, int32_t* n_valid,
                                     float grad_scale, int N, int V, int Vp) override {
    *n_valid = count_valid(targets, N);
    ops::crossentropy_forward_backward_rows(losses, lse, logits, targets, dloss(n_valid, grad_scale), N, V, Vp);
  }
  void crossentropy_softcap_forward_backward(T* losses, T* lse, T* logits, const int32_t* targets, int32_t* n_valid,
                                             float grad_scale, float cap, int N, int V, int Vp) override {
    *n_valid = count_valid(targets, N);
    ops::crossentropy_forward_backward_rows(losses, lse, logits, targets, dloss(n_valid, grad_scale), N, V, Vp,
                                            T(cap));
  }
  bool has_kv() const override { return true; }
  void encoder_forward_at(T* out, const int32_t* inp, const T* wte, const T* wpe, const int32_t* pos, int B, int Tn,
                          int C) override {
    ops::encoder_forward_at(out, inp, wte, wpe, pos, B, Tn, C);
  }
  void attention_kv_forward(T* out, T* kcache, T* vcache, const T* qkv, const int32_t* slot, const int32_t* pos,
                            int B, int Tq, int C, int NH, int maxT) override {
    ops::attention_kv_forward(out, kcache, vcache, qkv, slot, pos, B, Tq, C, NH, maxT);
  }
  void rope_forward_at(T* qkv, const int32_t* pos, int B, int Tn, int C, int NH, float base) override {
    ops::rope_apply_at(qkv, pos, B, Tn, C, NH, double(base));
  }
  void gather_rows(T* out, const T* inp, const int32_t* rows, int n, int C) override {
    ops::gather_rows(out, inp, rows, n, C);
  }
  bool has_w16() const override { return true; }
  uint16_t* alloc_u16(size_t n) override { return static_cast<uint16_t*>(zeroed(n * sizeof(uint16_t))); }
  void free_u16(uint16_t* p) override { release(p); }
  void round_w16(uint16_t* dst, T* src, size_t n, bool bf16) override {
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) {
      const float f = float(src[i]);
      dst[i] = bf16 ? float_to_bf16(f).bits : float_to_f16(f).bits;
      src[i] = T(bf16 ? bf16_to_float(gpt2::bf16{dst[i]}) : f16_to_float(gpt2::f16{dst[i]}));
    }
  }
  // The 16/8-bit GEMVs over blocks of kGemvChunkRows input rows (a prefill's many rows: each block's inputs stay
  // in cache while the weights stream once per block); a row's arithmetic is the same in any block.
  void matmul_forward_w16(T* out, const T* inp, const uint16_t* w, const T* bias, int N, int C, int OC,
                          bool bf16) override {
    for (int n0 = 0; n0 < N; n0 += ops::kGemvChunkRows)
      ops::gemv_forward(out + size_t(n0) * OC, inp + size_t(n0) * C, w, bias, std::min(ops::kGemvChunkRows, N - n0),
                        C, OC, bf16);
  }
  bool has_q8() const override { return true; }
  int8_t* alloc_i8(size_t n) override { return static_cast<int8_t*>(zeroed(n)); }
  void free_i8(int8_t* p) override { release(p); }
  void quantize_q8(int8_t* q, float* scales, T* w, long rows, int C) override {
    ops::quantize_q8(q, scales, w, rows, C);
  }
  void matmul_forward_q8(T* out, const T* inp, const int8_t* q, const float* scales, const T* bias, int N, int C,
                         int OC, bool int_dot) override {
    for (int n0 = 0; n0 < N; n0 += ops::kGemvChunkRows) {
      const int n = std::min(ops::kGemvChunkRows, N - n0);
      T* y = out + size_t(n0) * OC;
      const T* x = inp + size_t(n0) * C;
      if (int_dot) ops::gemv_forward_q8i(y, x, q, scales, bias, n, C, OC);
      else ops::gemv_forward_q8(y, x, q, scales, bias, n, C, OC);
    }
  }
  void sample_tokens(int32_t* ids, const T* logits, const SampleRow* rows, int n, int V, int Vp) override {
#pragma omp parallel
    {
      std::vector<int32_t> idx;
      std::vector<double> p;
#pragma omp for schedule(dynamic, 1)
      for (int i = 0; i < n; i++)
        ids[i] = sample_row(logits + size_t(i) * Vp, V, rows[i], [](T x) { return double(x); }, idx, p);
    }
  }
  void set_step_args(const StepArgs& args) override { step_.args = args; }
  void grad_sum_squares(const T* grad, size_t n) override {
    // simd reduction: lets the compiler keep several double accumulators per thread (a plain loop is a
    // serial scalar chain of cvtss2sd + fma: ~25% of a d12 step before this).
    double s = 0;
#pragma omp parallel for simd reduction(+ : s)
    for (size_t i = 0; i < n; i++) s += double(grad[i]) * double(grad[i]);
    step_.args.sumsq = s;
  }
  void adamw(T* param, T* /*master: none, M == T*/, const T* grad, T* m, T* v, size_t base,
             const std::vector<AdamWSegment>& segments, float beta1, float beta2, float eps) override {
    float grad_scale = 1.0f;
    if (!update_factor(step_.args, step_.scaler.scale, &grad_scale)) return;
    const float bc1 = step_.args.bc1, bc2 = step_.args.bc2;
    for (const AdamWSegment& seg : segments) {
      const float decay = seg.decay, lr = group_lr(step_.args, seg.group);
#pragma omp parallel for
      for (size_t k = seg.begin; k < seg.end; k++) {
        const size_t i = k - base;
        T g = grad[i] * T(grad_scale);
        T mi = T(beta1) * m[i] + T(1 - beta1) * g;
        T vi = T(beta2) * v[i] + T(1 - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        T mhat = mi / T(bc1), vhat = vi / T(bc2);
        param[i] -= T(lr) * (mhat / (std::sqrt(vhat) + T(eps)) + T(decay) * param[i]);
      }
    }
  }
  void muon_momentum(T* grad, T* mom, size_t base, const std::vector<AdamWSegment>& segments,
                     bool nesterov) override {
    float factor = 1.0f;
    if (!update_factor(step_.args, step_.scaler.scale, &factor)) return;
    const T beta = T(step_.args.muon_beta);
    for (const AdamWSegment& seg : segments) {
#pragma omp parallel for
      for (size_t k = seg.begin; k < seg.end; k++) {
        const size_t i = k - base;
        const T g = grad[i] * T(factor);
        const T mi = mom[i] + (T(1) - beta) * (g - mom[i]);
        mom[i] = mi;
        grad[i] = nesterov ? g + beta * (mi - g) : mi;
      }
    }
  }
  // Newton-Schulz in T (fp32; fp64 for the double model), the GEMMs through BLAS: wide/square X (rows <= cols):
  // A = X X^T, X = a X + B X; tall: A = X^T X, X = a X + X B (B = b A + c A A is symmetric, so this is the
  // transpose of the wide form on X^T).
  void muon_orthogonalize(T* x, T* scratch, int rows, int cols, int steps) override {
    float factor = 1.0f;
    if (!update_factor(step_.args, step_.scaler.scale, &factor)) return;
    const size_t n = size_t(rows) * cols;
    const int k = rows < cols ? rows : cols;
    const bool tall = rows > cols;
    T* A = scratch;
    T* Bm = scratch + size_t(k) * k;
    T* Y = Bm + size_t(k) * k;
    double ss = 0;
#pragma omp parallel for simd reduction(+ : ss)
    for (size_t i = 0; i < n; i++) ss += double(x[i]) * double(x[i]);
    const T inv = T(1) / (T(std::sqrt(ss)) + T(kMuonNormEps));
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) x[i] *= inv;
    for (int s = 0; s < steps; s++) {
      if (tall) gemm(true, false, k, k, rows, T(1), x, cols, x, cols, T(0), A, k);
      else gemm(false, true, k, k, cols, T(1), x, cols, x, cols, T(0), A, k);
#pragma omp parallel for
      for (size_t i = 0; i < size_t(k) * k; i++) Bm[i] = T(kMuonB) * A[i];
      gemm(false, false, k, k, k, T(kMuonC), A, k, A, k, T(1), Bm, k);
#pragma omp parallel for
      for (size_t i = 0; i < n; i++) Y[i] = T(kMuonA) * x[i];
      if (tall) gemm(false, false, rows, cols, cols, T(1), x, cols, Bm, cols, T(1), Y, cols);
      else gemm(false, false, rows, cols, rows, T(1), Bm, rows, x, cols, T(1), Y, cols);
      std::memcpy(x, Y, n * sizeof(T));
    }
  }
  // The batched op: one matrix per thread (its products on that thread alone, gemm_serial / gemm_bf16), so a
  // matrix's bits are the same whatever the batch and the thread count; the threads take the matrices dynamically.
  size_t muon_batch_scratch_size(int batch, int rows, int cols) const override {
    return ns_scratch(rows, cols) * size_t(std::max(1, std::min(batch, omp_get_max_threads())));
  }
  void muon_orthogonalize_batch(T* x, T* scratch, int batch, int rows, int cols, int steps, bool bf16) override {
    float factor = 1.0f;
    if (!update_factor(step_.args, step_.scaler.scale, &factor)) return;
    const size_t n = size_t(rows) * cols, per = ns_scratch(rows, cols);
    const int threads = std::max(1, std::min(batch, omp_get_max_threads()));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int b = 0; b < batch; b++)
      newton_schulz_one(x + size_t(b) * n, scratch + size_t(omp_get_thread_num()) * per, rows, cols, steps, bf16);
  }
  void muon_apply(T* param, T* /*master: none, M == T*/, const T* x, size_t n, size_t /*base*/, float decay,
                  float scale) override {
    float factor = 1.0f;
    if (!update_factor(step_.args, step_.scaler.scale, &factor)) return;
    const T lr = T(step_.args.muon_lr);
    const T keep = T(1) - lr * T(decay), step = lr * T(scale);
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) param[i] = param[i] * keep - step * x[i];
  }
  void set_loss_scaler(const LossScaler& scaler) override { step_.scaler = scaler; }
  void loss_scale_update() override { gpt2::loss_scale_update(step_.scaler, step_.args.sumsq); }
  StepResult step_result() override { return {step_.args.sumsq, step_.scaler}; }

 private:
  // Newton-Schulz scratch of one matrix (newton_schulz_one): A, B (k, k) and Y, X (rows, cols)
  static size_t ns_scratch(int rows, int cols) {
    const size_t k = size_t(std::min(rows, cols));
    return 2 * k * k + 2 * size_t(rows) * cols;
  }
  // One matrix's Newton-Schulz (model/optimizer.h) on the calling thread alone, on its wide form X (k, w), k <= w
  // (a tall matrix is transposed into X and back): A = X X^T, B = b A + c A A, X = a X + B X. bf16 (float models):
  // the products' inputs rounded to bf16 (cpu/gemm_bf16.h); the double model's are always fp64 (the reference).
  static void newton_schulz_one(T* x, T* scratch, int rows, int cols, int steps, bool bf16) {
    const size_t n = size_t(rows) * cols;
    const bool tall = rows > cols;
    const int k = tall ? cols : rows, w = tall ? rows : cols;
    T* A = scratch;
    T* Bm = A + size_t(k) * k;
    T* Y = Bm + size_t(k) * k;
    T* X = tall ? Y + n : x;
    double ss = 0;
    for (size_t i = 0; i < n; i++) ss += double(x[i]) * double(x[i]);
    const T inv = T(1) / (T(std::sqrt(ss)) + T(kMuonNormEps));
    if (tall) {
      for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) X[size_t(c) * rows + r] = x[size_t(r) * cols + c] * inv;
    } else {
      for (size_t i = 0; i < n; i++) X[i] *= inv;
    }
    // C (M, N) = alpha op(A) op(B) + beta C on this thread
    auto mm = [bf16](bool ta, bool tb, int M, int N, int K, T alpha, const T* a, int lda, const T* b, int ldb, T beta,
                     T* c, int ldc) {
      if constexpr (std::is_same_v<T, float>) {
        if (bf16) return gemm_bf16(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
      }
      gemm_serial(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
    };
    for (int s = 0; s < steps; s++) {
      mm(false, true, k, k, w, T(1), X, w, X, w, T(0), A, k);  // A = X X^T
      for (size_t i = 0; i < size_t(k) * k; i++) Bm[i] = T(kMuonB) * A[i];
      mm(false, true, k, k, k, T(kMuonC), A, k, A, k, T(1), Bm, k);  // + c A A (A^T = A)
      for (size_t i = 0; i < n; i++) Y[i] = T(kMuonA) * X[i];
      mm(false, false, k, w, k, T(1), Bm, k, X, w, T(1), Y, w);  // + B X
      std::memcpy(X, Y, n * sizeof(T));
    }
    if (tall)
      for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) x[size_t(r) * cols + c] = X[size_t(c) * rows + r];
  }
  static int32_t count_valid(const int32_t* targets, int N) {
    int32_t valid = 0;
    for (int i = 0; i < N; i++) valid += targets[i] >= 0;
    return valid;
  }
  // crossentropy_backward's dloss: grad_scale * loss scale / *n_valid, in double, rounded once (0: no valid target)
  T dloss(const int32_t* n_valid, float grad_scale) const {
    return *n_valid > 0 ? T(double(grad_scale) * double(step_.scaler.scale) / double(*n_valid)) : T(0);
  }
  StepState step_{};  // set_step_args' values and the loss scaler (the CPU's "backend memory" is host memory)
  // Buffers of 2 MiB and more start on a 2 MiB boundary and are advised as transparent huge pages (where the
  // kernel has them, in "madvise" mode as on most distributions): decode streams every weight once per token,
  // and with 4 KiB pages a TLB miss every 4 KiB cost it ~6% (d12 decode GEMVs, 2 threads: 26.5 -> 24.8 ms).
  // the bytes asked for by live allocations (bytes_in_use), by pointer: allocations and frees come from the
  // model's thread
  std::unordered_map<void*, size_t> sizes_;
  size_t in_use_ = 0;
  // n fp8 values (bits q) times the dequantisation factor meta[0], in T (exact)
  static std::vector<T> dequantize(const uint8_t* q, const float* meta, size_t n, Fp8Kind kind) {
    std::vector<T> v(n);
    const T f = T(meta[0]);
    for (size_t i = 0; i < n; i++) v[i] = T(fp8_to_float(q[i], kind)) * f;
    return v;
  }
  void* zeroed(size_t bytes) {
    void* p = zeroed_block(bytes);
    sizes_[p] = bytes;
    in_use_ += bytes;
    return p;
  }
  void release(void* p) {
    if (!p) return;
    const auto it = sizes_.find(p);
    if (it != sizes_.end()) {
      in_use_ -= it->second;
      sizes_.erase(it);
    }
    std::free(p);
  }
  static void* zeroed_block(size_t bytes) {
    constexpr size_t kHuge = size_t(2) << 20;
    if (bytes >= kHuge) {
      const size_t n = (bytes + kHuge - 1) / kHuge * kHuge;
      void* p = nullptr;
      if (posix_memalign(&p, kHuge, n) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
      madvise(p, n, MADV_HUGEPAGE);  // advice only: where it is refused, 4 KiB pages as before
#endif
      std::memset(p, 0, n);
      return p;
    }
    void* p = std::calloc(bytes ? bytes : 1, 1);
    if (!p) throw std::bad_alloc();
    return p;
  }
};

template <typename T>
std::unique_ptr<Backend<T>> make_backend() {
  return std::make_unique<CpuBackend<T>>();
}
template std::unique_ptr<Backend<float>> make_backend<float>();
template std::unique_ptr<Backend<double>> make_backend<double>();

}  // namespace gpt2::cpu::GPT2CORE_CPU_ISA
