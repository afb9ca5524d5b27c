// The seam between the model (layer loop, buffer layout, optimizer policy) and a device.
// A backend supplies memory and the ops; the model never touches device memory itself.
// Every op follows csrc/cpu/ops.h's contract (backward ops accumulate into their outputs).
#pragma once
#include <cstddef>
#include <cstdint>

namespace gpt2 {

template <typename T>
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // memory: allocations are zero-filled; host<->device copies
  virtual T* alloc(size_t n) = 0;
  virtual void free(T* p) = 0;
  virtual int32_t* alloc_i32(size_t n) = 0;
  virtual void free_i32(int32_t* p) = 0;
  virtual void zero(T* p, size_t n) = 0;
  virtual void to_device_i32(int32_t* dst, const int32_t* src, size_t n) = 0;
  virtual void to_host(T* dst, const T* src, size_t n) = 0;

  virtual void encoder_forward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn, int C) = 0;
  virtual void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* inp, int B, int Tn, int C) = 0;
  virtual void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N, int C) = 0;
  virtual void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                                  const T* mean, const T* rstd, int N, int C) = 0;
  virtual void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) = 0;
  virtual void matmul_backward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w,
                               int N, int C, int OC) = 0;
  // Elements of the per-layer attention state `att` that forward saves for backward: the softmax
  // probabilities (B, NH, T, T) by default; a flash kernel keeps only a logsumexp per query row.
  virtual size_t attention_state_size(int B, int NH, int Tn) const { return size_t(B) * NH * Tn * Tn; }
  virtual void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH) = 0;
  // out is the forward's output (flash backward needs rowsum(dout * out)).
  virtual void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* att, int B, int Tn,
                                  int C, int NH) = 0;
  virtual void gelu_forward(T* out, const T* inp, size_t N) = 0;
  virtual void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N) = 0;
  virtual void residual_forward(T* out, const T* a, const T* b, size_t N) = 0;
  virtual long crossentropy_forward(T* losses, T* lse, const T* logits, const int32_t* targets, int N, int V, int Vp) = 0;
  virtual void crossentropy_backward_inplace(T* logits, const T* lse, const int32_t* targets, T dloss,
                                             int N, int V, int Vp) = 0;
  // sum of squares of n values, accumulated in double
  virtual double sum_squares(const T* p, size_t n) = 0;
  // AdamW on n values; decay is the weight decay for this tensor (0 for 1-D tensors).
  virtual void adamw(T* param, const T* grad, T* m, T* v, size_t n, float lr, float beta1, float beta2,
                     float eps, float decay, float grad_scale, float bc1, float bc2) = 0;
};

}  // namespace gpt2
