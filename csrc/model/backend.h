// The seam between the model (layer loop, buffer layout, optimizer policy) and a device.
// A backend supplies memory and the ops; the model never touches device memory itself.
// Every op follows csrc/cpu/ops.h's contract (backward ops accumulate into their outputs; the one exception,
// gelu_matmul_backward's dpre, says so).
//
// Two storage types (model/dtypes.h): T, what the ops read and write (parameters as the ops see them,
// activations, activation gradients), and M = Master<T>, what must keep full precision (master weights,
// parameter gradients, AdamW moments, per-row statistics: layernorm mean/rstd, attention state, losses,
// logsumexps). For float and double models M == T; for bf16 models M is float.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/dtypes.h"
#include "model/optimizer.h"

namespace gpt2 {

template <typename T>
class Backend {
 public:
  using M = Master<T>;
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // The device queue the ops are enqueued on, for work that must be ordered after them without a host sync
  // (the overlapped gradient all-reduce): a cudaStream_t for the CUDA backend, where nullptr is the legacy
  // default stream. Backends whose ops have finished when they return (the CPU) keep the default, nullptr.
  virtual void* native_stream() { return nullptr; }

  // memory: allocations are zero-filled; host<->device copies
  virtual T* alloc(size_t n) = 0;
  virtual void free(T* p) = 0;
  virtual M* alloc_master(size_t n) = 0;
  virtual void free_master(M* p) = 0;
  virtual int32_t* alloc_i32(size_t n) = 0;
  virtual void free_i32(int32_t* p) = 0;
  virtual void zero(T* p, size_t n) = 0;
  virtual void zero_master(M* p, size_t n) = 0;
  virtual void to_device_i32(int32_t* dst, const int32_t* src, size_t n) = 0;
  virtual void to_host(T* dst, const T* src, size_t n) = 0;
  virtual void to_host_master(M* dst, const M* src, size_t n) = 0;
  // Waits until every op enqueued so far has finished (a no-op for backends whose ops finish as they return).
  virtual void synchronize() {}
  // The token ids of the next forward, from the host: inp (and targets, unless null) into backend memory
  // dev_inp (dev_targets), B*Tn ints each. The host arrays may be reused as soon as it returns. A backend may
  // also prepare here, from the host copy, what encoder_backward needs (the CUDA backend: the positions bucketed
  // by token id), so that backward never reads the ids back.
  virtual void upload_batch(int32_t* dev_inp, int32_t* dev_targets, const int32_t* inp, const int32_t* targets,
                            int B, int Tn) {
    to_device_i32(dev_inp, inp, size_t(B) * Tn);
    if (targets) to_device_i32(dev_targets, targets, size_t(B) * Tn);
  }

  virtual void encoder_forward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn, int C) = 0;
  virtual void encoder_backward(M* dwte, M* dwpe, const T* dout, const int32_t* inp, int B, int Tn, int C) = 0;
  virtual void layernorm_forward(T* out, M* mean, M* rstd, const T* inp, const T* w, const T* b, int N, int C) = 0;
  virtual void layernorm_backward(T* dinp, M* dw, M* db, const T* dout, const T* inp, const T* w,
                                  const M* mean, const M* rstd, int N, int C) = 0;
  // residual = a + b, then out = layernorm(residual): one op so a backend can fuse the two passes.
  virtual void residual_layernorm_forward(T* residual, T* out, M* mean, M* rstd, const T* a, const T* b,
                                          const T* w, const T* bias, int N, int C) {
    residual_forward(residual, a, b, size_t(N) * C);
    layernorm_forward(out, mean, rstd, residual, w, bias, N, C);
  }
  virtual void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) = 0;
  virtual void matmul_backward(T* dinp, M* dw, M* dbias, const T* dout, const T* inp, const T* w,
                               int N, int C, int OC) = 0;
  // The MLP's up-projection and its activation: pre (N, OC) = inp @ w^T + bias, out = gelu(pre) (the tanh form,
  // as gelu_forward). One op so a backend can apply GELU in the matmul's epilogue (CUDA: cuBLASLt's GELU_AUX_BIAS,
  // writing pre as the epilogue's aux output); pre is what backward needs.
  virtual void matmul_gelu_forward(T* pre, T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) {
    matmul_forward(pre, inp, w, bias, N, C, OC);
    gelu_forward(out, pre, size_t(N) * OC);
  }
  // The backward of out (N, OC) = gelu(pre) @ w^T + bias (the MLP's down-projection of its activation), where
  // act = gelu(pre) (N, C) is the matmul's input:
  //   dpre (N, C) = (dout @ w) * gelu'(pre)   WRITTEN, not accumulated (unlike matmul_backward's dinp): cuBLASLt's
  //                                           DGELU epilogue, which the CUDA backend uses for it, cannot add into D
  //   dw += dout^T @ act, dbias += sum_n dout  (dbias may be null), as matmul_backward.
  // scratch: (N, C) values the op may overwrite (here: dL/d act, between the two separate ops).
  virtual void gelu_matmul_backward(T* dpre, M* dw, M* dbias, const T* dout, const T* pre, const T* act, const T* w,
                                    T* scratch, int N, int C, int OC) {
    const size_t n = size_t(N) * C;
    zero(scratch, n);
    matmul_backward(scratch, dw, dbias, dout, act, w, N, C, OC);
    zero(dpre, n);
    gelu_backward(dpre, pre, scratch, n);
  }
  // Elements of the per-layer attention state `att` that forward saves for backward: the softmax
  // probabilities (B, NH, T, T) by default; a flash kernel keeps only a logsumexp per query row.
  virtual size_t attention_state_size(int B, int NH, int Tn) const { return size_t(B) * NH * Tn * Tn; }
  virtual void attention_forward(T* out, M* att, const T* qkv, int B, int Tn, int C, int NH) = 0;
  // out is the forward's output (flash backward needs rowsum(dout * out)).
  virtual void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const M* att, int B, int Tn,
                                  int C, int NH) = 0;
  virtual void gelu_forward(T* out, const T* inp, size_t N) = 0;
  virtual void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N) = 0;
  virtual void residual_forward(T* out, const T* a, const T* b, size_t N) = 0;
  virtual long crossentropy_forward(M* losses, M* lse, const T* logits, const int32_t* targets, int N, int V, int Vp) = 0;
  virtual void crossentropy_backward_inplace(T* logits, const M* lse, const int32_t* targets, M dloss,
                                             int N, int V, int Vp) = 0;
  // The loss without host round trips (GPT2Model::forward_backward, which a CUDA graph can capture): the number of
  // non-ignored targets stays in backend memory (*n_valid), the backward scale is computed from it where it is
  // used (dloss = grad_scale / *n_valid, in double, as backward() does on the host), and the mean loss is added
  // to an accumulator in backend memory: *acc += scale * sum(losses) / *n_valid (nothing when *n_valid is 0).
  // The defaults are for backends whose memory is host memory.
  virtual void crossentropy_forward_counted(M* losses, M* lse, const T* logits, const int32_t* targets,
                                            int32_t* n_valid, int N, int V, int Vp) {
    *n_valid = int32_t(crossentropy_forward(losses, lse, logits, targets, N, V, Vp));
  }
  virtual void crossentropy_backward_counted(T* logits, const M* lse, const int32_t* targets, const int32_t* n_valid,
                                             float grad_scale, int N, int V, int Vp) {
    const M dloss = *n_valid > 0 ? M(double(grad_scale) / double(*n_valid)) : M(0);
    crossentropy_backward_inplace(logits, lse, targets, dloss, N, V, Vp);
  }
  virtual void loss_accumulate(M* acc, const M* losses, const int32_t* n_valid, int N, float scale) {
    if (*n_valid <= 0) return;
    double s = 0;
    for (int i = 0; i < N; i++) s += double(losses[i]);
    *acc += M(double(scale) * (s / double(*n_valid)));
  }
  // CUDA graphs: the ops enqueued between capture_begin() and capture_end() are recorded, not run, and
  // graph_launch() replays them with the pointers and scalar arguments they had when recorded. Only a backend
  // with a device queue can (can_capture()); ops that would synchronise with the host fail while capturing.
  // capture_end(false) abandons a capture whose ops failed.
  virtual bool can_capture() const { return false; }
  virtual void capture_begin() { throw std::logic_error(std::string("backend ") + name() + " cannot capture graphs"); }
  virtual void* capture_end(bool /*keep*/) { return nullptr; }
  virtual void graph_launch(void* /*graph*/) {}
  virtual void graph_destroy(void* /*graph*/) noexcept {}
  // sum of squares of n values, accumulated in double
  virtual double sum_squares(const M* p, size_t n) = 0;
  // AdamW on n values; decay is the weight decay for this tensor (0 for 1-D tensors). master is null when the
  // parameters are their own master copy (M == T); otherwise master is updated and param rewritten from it as
  // cast_params(param, master, n, seed, offset) does.
  virtual void adamw(T* param, M* master, const M* grad, M* m, M* v, size_t n, float lr, float beta1, float beta2,
                     float eps, float decay, float grad_scale, float bc1, float bc2, uint32_t seed,
                     size_t offset) = 0;
  // AdamW over several segments of the flat buffers at once (the model passes all of its tensors): param, master
  // and grad are indexed by flat index, m and v by flat index - m_base. The rounding index of flat value k is k.
  // By default one adamw() per segment; a backend may do it in one pass (the CUDA backend: one launch).
  virtual void adamw_segments(T* param, M* master, const M* grad, M* m, M* v, size_t m_base,
                              const std::vector<AdamWSegment>& segments, float lr, float beta1, float beta2, float eps,
                              float grad_scale, float bc1, float bc2, uint32_t seed) {
    for (const AdamWSegment& s : segments)
      adamw(param + s.begin, master ? master + s.begin : nullptr, grad + s.begin, m + (s.begin - m_base),
            v + (s.begin - m_base), s.end - s.begin, lr, beta1, beta2, eps, s.decay, grad_scale, bc1, bc2, seed,
            s.begin);
  }
  // The optimizer step without a host round trip (GPT2Model::optimizer_step): set_step_args stores the step's
  // values in backend memory (never while capturing), grad_sum_squares writes the sum of squares of n gradients
  // into them, and clipped_adamw_segments is adamw_segments with grad_scale = clip / (norm + 1e-6) when clip > 0
  // and norm = sqrt(sumsq) > clip (else 1), computed where it runs, in double, and with nothing written at all
  // when the norm is not finite. last_grad_norm() reads the norm back. Defaults: for host-memory backends.
  virtual void set_step_args(const StepArgs& args) { step_args_ = args; }
  virtual void grad_sum_squares(const M* grad, size_t n) { step_args_.sumsq = sum_squares(grad, n); }
  virtual void clipped_adamw_segments(T* param, M* master, const M* grad, M* m, M* v, size_t m_base,
                                      const std::vector<AdamWSegment>& segments, float beta1, float beta2,
                                      float eps) {
    const StepArgs& a = step_args_;
    const double norm = std::sqrt(a.sumsq);
    if (!std::isfinite(norm)) return;
    const float scale = a.clip > 0 && norm > a.clip ? float(a.clip / (norm + 1e-6)) : 1.0f;
    adamw_segments(param, master, grad, m, v, m_base, segments, a.lr, beta1, beta2, eps, scale, a.bc1, a.bc2,
                   a.seed);
  }
  virtual double last_grad_norm() { return std::sqrt(step_args_.sumsq); }
  // param[i] = master[i] rounded to T: stochastically with random bits that are a function of (seed, offset + i)
  // only, or to nearest even when seed == 0. Only backends whose models keep a master copy implement it.
  virtual void cast_params(T* /*param*/, const M* /*master*/, size_t /*n*/, uint32_t /*seed*/, size_t /*offset*/) {
    throw std::logic_error(std::string("backend ") + name() + " has no separate master weights to cast");
  }

 private:
  StepArgs step_args_{};  // the defaults' copy (host memory)
};

}  // namespace gpt2
