// The CPU backend: host memory, OpenMP + BLAS ops from cpu/ops.h.
#pragma once
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "cpu/ops.h"
#include "model/backend.h"
#include "model/optimizer.h"

namespace gpt2::cpu {

template <typename T>
class CpuBackend final : public Backend<T> {
  static_assert(std::is_same_v<T, Master<T>>, "the CPU backend computes in float or double");

 public:
  const char* name() const override { return "cpu"; }

  T* alloc(size_t n) override { return static_cast<T*>(zeroed(n * sizeof(T))); }
  void free(T* p) override { std::free(p); }
  // CPU models are float or double: the master type is T itself
  T* alloc_master(size_t n) override { return alloc(n); }
  void free_master(T* p) override { std::free(p); }
  int32_t* alloc_i32(size_t n) override { return static_cast<int32_t*>(zeroed(n * sizeof(int32_t))); }
  void free_i32(int32_t* p) override { std::free(p); }
  void zero(T* p, size_t n) override {
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) p[i] = 0;
  }
  void to_device_i32(int32_t* dst, const int32_t* src, size_t n) override { std::memcpy(dst, src, n * sizeof(int32_t)); }
  void zero_master(T* p, size_t n) override { zero(p, n); }
  void to_host(T* dst, const T* src, size_t n) override { std::memcpy(dst, src, n * sizeof(T)); }
  void to_host_master(T* dst, const T* src, size_t n) override { to_host(dst, src, n); }

  void encoder_forward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn, int C) override {
    cpu::encoder_forward(out, inp, wte, wpe, B, Tn, C);
  }
  void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* inp, int B, int Tn, int C) override {
    cpu::encoder_backward(dwte, dwpe, dout, inp, B, Tn, C);
  }
  void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N, int C) override {
    cpu::layernorm_forward(out, mean, rstd, inp, w, b, N, C);
  }
  void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w, const T* mean,
                          const T* rstd, int N, int C) override {
    cpu::layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
  }
  void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) override {
    cpu::matmul_forward(out, inp, w, bias, N, C, OC);
  }
  void matmul_backward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int N, int C, int OC) override {
    cpu::matmul_backward(dinp, dw, dbias, dout, inp, w, N, C, OC);
  }
  void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH) override {
    cpu::attention_forward(out, att, qkv, B, Tn, C, NH);
  }
  void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* /*out*/, const T* att, int B, int Tn, int C,
                          int NH) override {
    cpu::attention_backward(dqkv, dout, qkv, att, B, Tn, C, NH);
  }
  void gelu_forward(T* out, const T* inp, size_t N) override { cpu::gelu_forward(out, inp, N); }
  void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N) override { cpu::gelu_backward(dinp, inp, dout, N); }
  void residual_forward(T* out, const T* a, const T* b, size_t N) override { cpu::residual_forward(out, a, b, N); }
  void crossentropy_forward(T* losses, T* lse, const T* logits, const int32_t* targets, int32_t* n_valid, int N,
                            int V, int Vp) override {
    *n_valid = int32_t(cpu::crossentropy_forward(losses, lse, logits, targets, N, V, Vp));
  }
  void crossentropy_backward(T* logits, const T* lse, const int32_t* targets, const int32_t* n_valid,
                             float grad_scale, int N, int V, int Vp) override {
    const T dloss = *n_valid > 0 ? T(double(grad_scale) / double(*n_valid)) : T(0);
    cpu::crossentropy_backward_inplace(logits, lse, targets, dloss, N, V, Vp);
  }
  void loss_accumulate(T* acc, const T* losses, const int32_t* n_valid, int N, float scale) override {
    if (*n_valid <= 0) return;
    double s = 0;
    for (int i = 0; i < N; i++) s += double(losses[i]);
    *acc += T(double(scale) * (s / double(*n_valid)));
  }
  void set_step_args(const StepArgs& args) override { step_ = args; }
  void grad_sum_squares(const T* grad, size_t n) override {
    // simd reduction: lets the compiler keep several double accumulators per thread (a plain loop is a
    // serial scalar chain of cvtss2sd + fma: ~25% of a d12 step before this).
    double s = 0;
#pragma omp parallel for simd reduction(+ : s)
    for (size_t i = 0; i < n; i++) s += double(grad[i]) * double(grad[i]);
    step_.sumsq = s;
  }
  void adamw(T* param, T* /*master: none, M == T*/, const T* grad, T* m, T* v, size_t base,
             const std::vector<AdamWSegment>& segments, float beta1, float beta2, float eps) override {
    float clip = 1.0f;
    if (!clip_factor(step_.sumsq, step_.clip, &clip)) return;
    const float grad_scale = step_.grad_scale * clip;
    const float lr = step_.lr, bc1 = step_.bc1, bc2 = step_.bc2;
    for (const AdamWSegment& seg : segments) {
      const float decay = seg.decay;
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
  double step_sum_squares() override { return step_.sumsq; }

 private:
  StepArgs step_{};  // set_step_args' values (the CPU's "backend memory" is host memory)
  static void* zeroed(size_t bytes) {
    void* p = std::calloc(bytes ? bytes : 1, 1);
    if (!p) throw std::bad_alloc();
    return p;
  }
};

// Instantiated once in backend_cpu.cpp, with the CPU library's flags (-O3, -march=native).
extern template class CpuBackend<float>;
extern template class CpuBackend<double>;

}  // namespace gpt2::cpu
