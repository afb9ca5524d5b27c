// The seam between the model (layer loop, buffer layout, optimizer policy) and a device.
// A backend supplies memory and the ops; the model never touches device memory itself.
// Every op follows csrc/cpu/ops.h's contract (backward ops accumulate into their outputs; the exceptions:
// gelu_matmul_backward's dpre, and the input gradients of ops called with InputGrad::Write).
//
// Two storage types (model/dtypes.h): T, what the ops read and write (parameters as the ops see them,
// activations, activation gradients), and M = Master<T>, what must keep full precision (master weights,
// parameter gradients, AdamW moments, per-row statistics: layernorm mean/rstd, attention state, losses,
// logsumexps). For float and double models M == T; for bf16 models M is float.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/dtypes.h"
#include "model/fp8.h"
#include "model/optimizer.h"
#include "model/sampling.h"

namespace gpt2 {

// How a backward op delivers the gradient of its input (matmul_backward's and layernorm_backward's dinp,
// attention_backward's dqkv):
//   Add:   dinp += ...  (the ops' contract, csrc/cpu/ops.h)
//   Write: dinp =  ...  (the old contents are never read, NaN included): what the first writer of a gradient
//          buffer does, so that no zero fill precedes it and no read of the zeros follows (llm.c's beta = 0).
// Parameter gradients (dw, db) always accumulate: they sum over the micro-steps of an optimizer step.
enum class InputGrad { Add, Write };

// An FP8 tensor in backend memory (the FP8 ops below): fp8 values (rows, cols), their transpose (cols, rows) (either
// may be null when an op does not need it) and meta = [1 / s, amax] (two floats).
struct Fp8Tensor {
  uint8_t* q = nullptr;
  uint8_t* qt = nullptr;
  float* meta = nullptr;
};

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
  // Makes this backend's device the calling thread's current one (CUDA: cudaSetDevice), so that kernels, the
  // library seams (which key their handles, graphs and fit checks on the current device) and allocations land
  // on it even when another model or library made another GPU current in this thread. The model calls it at
  // each of its entry points; a backend with one device keeps the default.
  virtual void make_current() {}
  // Why this backend cannot run a model of config c yet ("" when it can): the model refuses to start with it
  // (std::invalid_argument), before any op runs. The default runs every config.
  virtual std::string unsupported(const ModelConfig& /*c*/) const { return ""; }

  // memory: allocations are zero-filled; host<->device copies
  virtual T* alloc(size_t n) = 0;
  virtual void free(T* p) = 0;
  // Bytes this backend has allocated and not freed (the CPU's count; 0 where the device's own accounting serves,
  // as cudaMemGetInfo does): what the memory plan's tests measure.
  virtual size_t bytes_in_use() const { return 0; }
  virtual M* alloc_master(size_t n) = 0;
  virtual void free_master(M* p) = 0;
  virtual int32_t* alloc_i32(size_t n) = 0;
  virtual void free_i32(int32_t* p) = 0;
  virtual void zero(T* p, size_t n) = 0;
  virtual void zero_master(M* p, size_t n) = 0;
  // dst[0..n) += src[0..n) (add), or = src (copy), in stream order (ZeRO-2's gradient shard)
  virtual void accumulate_master(M* dst, const M* src, size_t n, bool add) = 0;
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

  // Null pointers (the modern architecture's missing tensors, ModelConfig): wpe / dwpe null (rotary positions):
  // out = wte[inp] and no position gradient; layernorm's bias / db null (bias = false): no bias term and no bias
  // gradient; matmul bias / dbias null (bias = false, and the lm_head): none. Every op taking a bias accepts null.
  virtual void encoder_forward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn, int C) = 0;
  virtual void encoder_backward(M* dwte, M* dwpe, const T* dout, const int32_t* inp, int B, int Tn, int C) = 0;
  virtual void layernorm_forward(T* out, M* mean, M* rstd, const T* inp, const T* w, const T* b, int N, int C) = 0;
  virtual void layernorm_backward(T* dinp, M* dw, M* db, const T* dout, const T* inp, const T* w,
                                  const M* mean, const M* rstd, int N, int C, InputGrad mode) = 0;
  // residual = a + b, then out = layernorm(residual): one op so a backend can fuse the two passes (bias may be null).
  virtual void residual_layernorm_forward(T* residual, T* out, M* mean, M* rstd, const T* a, const T* b,
                                          const T* w, const T* bias, int N, int C) {
    residual_forward(residual, a, b, size_t(N) * C);
    layernorm_forward(out, mean, rstd, residual, w, bias, N, C);
  }
  virtual void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) = 0;
  virtual void matmul_backward(T* dinp, M* dw, M* dbias, const T* dout, const T* inp, const T* w,
                               int N, int C, int OC, InputGrad mode) = 0;
  // The MLP's up-projection and its activation: pre (N, OC) = inp @ w^T + bias, out = gelu(pre) (the tanh form,
  // as gelu_forward). One op so a backend can apply GELU in the matmul's epilogue (CUDA: cuBLASLt's GELU_AUX_BIAS,
  // writing pre as the epilogue's aux output); pre is what backward needs.
  // bias may be null.
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
    matmul_backward(scratch, dw, dbias, dout, act, w, N, C, OC, InputGrad::Write);
    zero(dpre, n);
    gelu_backward(dpre, pre, scratch, n);
  }
  // ---- FP8 Linear layers (precision fp8: e4m3 activations and weights forward, e5m2 gradients backward; the formats,
  // the conversion and the per-tensor scale in model/fp8.h). Current scaling: each quantisation reduces the amax of
  // the tensor it quantises, then casts with the power-of-two scale s = fp8_scale(amax, kind) (csrc/cuda/fp8.cuh says
  // why current, not delayed). A quantised tensor lives in backend memory as an Fp8Tensor: the fp8 values q (rows,
  // cols), their transpose qt (cols, rows) (FP8 matmuls are "TN": each operand contiguous along k, so backward reads
  // the transposes), and meta = [1 / s, amax] (two floats: the dequantisation factor, value = fp8 * meta[0]).
  // Backends without FP8 ops keep the defaults, which throw.
  //
  // fp8_quantize: out.q and / or out.qt (null: not written) and out.meta from x (rows, cols).
  virtual void fp8_quantize(Fp8Tensor /*out*/, const T* /*x*/, int /*rows*/, int /*cols*/, Fp8Kind /*kind*/) {
    no_fp8();
  }
  // Bytes of backend memory for fp8 values and metas (zero-filled; a meta is 2 floats = 8 bytes, 16-byte aligned).
  virtual uint8_t* alloc_fp8(size_t /*bytes*/) {
    no_fp8();
    return nullptr;  // not reached
  }
  virtual void free_fp8(uint8_t* /*p*/) { no_fp8(); }
  // out (N, OC) = deq(inp8.q) @ deq(w8.q)^T + bias, products of the fp8 values accumulated in fp32 and scaled by
  // both dequantisation factors, rounded once to T; bias (OC, may be null) added to the fp32 value. First inp (N, C)
  // is quantised to e4m3 into inp8 (q, and qt unless null: qt is what backward's dW reads; the model quantises the
  // kept input again in backward instead). w8: the weight (OC, C) quantised to e4m3 (fp8_quantize, q and qt), made
  // once per optimizer step by the caller. C and OC multiples of 16 (cuBLASLt's FP8 kernels), and in backward N too.
  virtual void fp8_linear_forward(T* /*out*/, Fp8Tensor /*inp8*/, const T* /*inp*/, const Fp8Tensor& /*w8*/,
                                  const T* /*bias*/, int /*N*/, int /*C*/, int /*OC*/) {
    no_fp8();
  }
  // Backward of fp8_linear_forward: dout (N, OC) is quantised to e5m2 into dout8 (q and qt, scratch), then
  //   dinp (N, C) (+)= deq(dout8) @ deq(w8)       (reads w8.qt; mode as matmul_backward; rounded once to T)
  //   dw (OC, C)   += deq(dout8)^T @ deq(inp8)    (reads dout8.qt and inp8.qt; fp32 accumulation into M)
  //   dbias (OC)   += sum_n dout                  (the unquantised gradient; dbias may be null)
  virtual void fp8_linear_backward(T* /*dinp*/, M* /*dw*/, M* /*dbias*/, Fp8Tensor /*dout8*/, const T* /*dout*/,
                                   const Fp8Tensor& /*inp8*/, const Fp8Tensor& /*w8*/, int /*N*/, int /*C*/,
                                   int /*OC*/, InputGrad /*mode*/) {
    no_fp8();
  }
  // ---- The modern architecture's ops (ModelConfig: norm, position, qk_norm, activation, logit_softcap). Each is
  // its own piece of math; the layer loop (model/gpt2.cpp) picks them from the config. eps = kNormEps (1e-5).
  //
  // RMSNorm without gain (modded-nanogpt, nanochat), over the last dim of inp (N, C):
  //   rstd[n] = 1 / sqrt(mean_i inp[n,i]^2 + eps),  out[n,i] = inp[n,i] * rstd[n].   rstd (N) is M, kept for backward.
  virtual void rmsnorm_forward(T* out, M* rstd, const T* inp, int N, int C) = 0;
  // With xhat = inp * rstd[n] (from inp, as layernorm_backward recomputes its norm):
  //   dinp[n,i] (+)= rstd[n] * (dout[n,i] - xhat[n,i] * mean_j(dout[n,j] * xhat[n,j]))
  // Add: accumulated (the residual stream's gradient: the residual fusion of backward); Write: stored.
  virtual void rmsnorm_backward(T* dinp, const T* dout, const T* inp, const M* rstd, int N, int C,
                                InputGrad mode) = 0;
  // residual = a + b, then out = rmsnorm(residual): one op so a backend can fuse the two passes (as
  // residual_layernorm_forward).
  virtual void residual_rmsnorm_forward(T* residual, T* out, M* rstd, const T* a, const T* b, int N, int C) {
    residual_forward(residual, a, b, size_t(N) * C);
    rmsnorm_forward(out, rstd, residual, N, C);
  }
  // Rotary position embedding, IN PLACE on the q and k parts of qkv (B, Tn, 3C) = [q | k | v] (v untouched),
  // each head's hs = C / NH values (hs even) rotated in the rotate-half layout (Llama / Hugging Face, modded-nanogpt):
  // for the token at position p = t0 + t and i < hs/2, with theta = p * base^(-2i / hs),
  //   x'[i]        = x[i] * cos(theta) - x[i + hs/2] * sin(theta)
  //   x'[i + hs/2] = x[i + hs/2] * cos(theta) + x[i] * sin(theta)
  // t0 is the position of row t = 0 (0 in training; the KV cache's offset in generation). cos and sin must be
  // accurate to the rounding of the storage type at every p < 2^20 (the CPU evaluates theta, cos, sin in double;
  // fp32 sincosf of a rounded fp32 theta is NOT accurate enough at large p: reduce in double or use a table).
  virtual void rope_forward(T* qkv, int B, int Tn, int C, int NH, int t0, float base) = 0;
  // The transpose (the inverse rotation, theta -> -theta), IN PLACE on the dq and dk parts of dqkv (B, Tn, 3C);
  // dv untouched. dqkv holds d(loss)/d(rotated q, k) and becomes d(loss)/d(q, k before rotation).
  virtual void rope_backward(T* dqkv, int B, int Tn, int C, int NH, int t0, float base) = 0;
  // QK-norm: RMSNorm without gain of every head's q and of every head's k, IN PLACE in qkv (B, Tn, 3C) (v
  // untouched): for row r = b*Tn + t, head h, and j = h (q) or NH + h (k), the hs values x at column
  // (j < NH ? 0 : C) + h*hs become x * rstd[r * 2NH + j], rstd = 1 / sqrt(mean(x^2) + eps). rstd (B*Tn, 2NH) is M.
  virtual void qk_norm_forward(T* qkv, M* rstd, int B, int Tn, int C, int NH) = 0;
  // Backward, IN PLACE on the dq and dk parts of dqkv (dv untouched), from qkv as qk_norm_forward left it
  // (xhat = the normalised q, k): per head vector, d <- rstd * (d - xhat * mean(d * xhat)).
  virtual void qk_norm_backward(T* dqkv, const T* qkv, const M* rstd, int B, int Tn, int C, int NH) = 0;
  // ReLU squared: out = relu(x)^2. Backward ACCUMULATES as gelu_backward: dinp += 2 * relu(x) * dout.
  virtual void relu2_forward(T* out, const T* inp, size_t N) = 0;
  virtual void relu2_backward(T* dinp, const T* inp, const T* dout, size_t N) = 0;
  // matmul_gelu_forward with relu^2: pre (N, OC) = inp @ w^T + bias (bias may be null), out = relu(pre)^2.
  virtual void matmul_relu2_forward(T* pre, T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) {
    matmul_forward(pre, inp, w, bias, N, C, OC);
    relu2_forward(out, pre, size_t(N) * OC);
  }
  // gelu_matmul_backward with relu^2, the same contract: dpre (N, C) = (dout @ w) * 2 relu(pre), WRITTEN;
  // dw += dout^T @ act, dbias += sum_n dout (dbias may be null); scratch (N, C) may be overwritten.
  virtual void relu2_matmul_backward(T* dpre, M* dw, M* dbias, const T* dout, const T* pre, const T* act, const T* w,
                                     T* scratch, int N, int C, int OC) {
    const size_t n = size_t(N) * C;
    matmul_backward(scratch, dw, dbias, dout, act, w, N, C, OC, InputGrad::Write);
    zero(dpre, n);
    relu2_backward(dpre, pre, scratch, n);
  }
  // Soft-capped logits (Gemma 2, modded-nanogpt): IN PLACE, logits[k] = cap * tanh(logits[k] / cap) for all n
  // values (callers pass N * Vp: the padded columns too, which never enter the loss). What model.logits() returns.
  virtual void softcap_forward(T* logits, float cap, size_t n) = 0;
  // crossentropy_backward of capped logits: logits (N, Vp) hold c = cap * tanh(z / cap) (softcap_forward's
  // output) and become, IN PLACE, d(loss)/dz = (softmax(c[:V]) - onehot(target)) * dloss * (1 - (c / cap)^2) on
  // valid rows, 0 on ignored rows and in the padded columns V..Vp-1; lse is of c (crossentropy_forward of c);
  // dloss as crossentropy_backward (grad_scale * loss scale / *n_valid).
  virtual void crossentropy_softcap_backward(T* logits, const M* lse, const int32_t* targets, const int32_t* n_valid,
                                             float grad_scale, float cap, int N, int V, int Vp) = 0;
  // crossentropy_forward_backward with the soft-cap inside: logits hold the RAW z; losses, lse and *n_valid are
  // those of c = cap * tanh(z / cap), and logits become d(loss)/dz as crossentropy_softcap_backward writes it. One op
  // so that a backend can cap, reduce and write dlogits in its one fused pass over the logits.
  virtual void crossentropy_softcap_forward_backward(M* losses, M* lse, T* logits, const int32_t* targets,
                                                     int32_t* n_valid, float grad_scale, float cap, int N, int V,
                                                     int Vp) {
    softcap_forward(logits, cap, size_t(N) * Vp);
    crossentropy_forward(losses, lse, logits, targets, n_valid, N, V, Vp);
    crossentropy_softcap_backward(logits, lse, targets, n_valid, grad_scale, cap, N, V, Vp);
  }

  // Elements of the per-layer attention state `att` that forward saves for backward: the softmax
  // probabilities (B, NH, T, T) by default; a flash kernel keeps only a logsumexp per query row.
  virtual size_t attention_state_size(int B, int NH, int Tn) const { return size_t(B) * NH * Tn * Tn; }
  virtual void attention_forward(T* out, M* att, const T* qkv, int B, int Tn, int C, int NH) = 0;
  // out is the forward's output (flash backward needs rowsum(dout * out)).
  virtual void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const M* att, int B, int Tn,
                                  int C, int NH, InputGrad mode) = 0;
  virtual void gelu_forward(T* out, const T* inp, size_t N) = 0;
  virtual void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N) = 0;
  virtual void residual_forward(T* out, const T* a, const T* b, size_t N) = 0;
  // The loss, counted and summed in backend memory (no host round trip, so a CUDA graph can capture it):
  // crossentropy_forward writes per-row losses and logsumexps and the number of non-ignored targets into *n_valid
  // (targets may be null: every row ignored); crossentropy_backward turns logits into dlogits in place, scaled by
  // dloss = grad_scale * S / *n_valid (in double, rounded once; 0 when *n_valid is 0), where S is the loss scale
  // in backend memory (LossScaler::scale, 1 unless loss scaling is on), read when the op runs, so a captured
  // backward uses each step's scale; loss_accumulate adds the mean (unscaled) loss: *acc += scale * sum(losses) /
  // *n_valid (nothing when *n_valid is 0).
  virtual void crossentropy_forward(M* losses, M* lse, const T* logits, const int32_t* targets, int32_t* n_valid,
                                    int N, int V, int Vp) = 0;
  virtual void crossentropy_backward(T* logits, const M* lse, const int32_t* targets, const int32_t* n_valid,
                                     float grad_scale, int N, int V, int Vp) = 0;
  virtual void loss_accumulate(M* acc, const M* losses, const int32_t* n_valid, int N, float scale) = 0;
  // crossentropy_forward then crossentropy_backward (targets not null), one op so that a backend can make it one
  // pass over the logits (CUDA: the count of valid targets first, by a small kernel, so that the fused pass knows
  // dloss before it writes dlogits).
  virtual void crossentropy_forward_backward(M* losses, M* lse, T* logits, const int32_t* targets, int32_t* n_valid,
                                             float grad_scale, int N, int V, int Vp) {
    crossentropy_forward(losses, lse, logits, targets, n_valid, N, V, Vp);
    crossentropy_backward(logits, lse, targets, n_valid, grad_scale, N, V, Vp);
  }
  // ---- KV-cache inference (model/inference.cpp). A backend without these ops runs generation through the
  // full forward (Python's ForwardEngine); has_kv() says which. Positions and slots are int32 in backend memory.
  virtual bool has_kv() const { return false; }
  // out[b,t,:] = wte[inp[b,t],:] + wpe[pos[b] + t,:]: the encoder with each sequence starting at its own position
  // (wpe null with rotary positions: out = wte[inp[b,t],:]).
  virtual void encoder_forward_at(T* /*out*/, const int32_t* /*inp*/, const T* /*wte*/, const T* /*wpe*/,
                                  const int32_t* /*pos*/, int /*B*/, int /*Tn*/, int /*C*/) {
    no_kv();
  }
  // Causal attention of Tq new tokens per sequence against a KV cache. kcache, vcache: (S, maxT, C) for S slots.
  // First the keys and values of qkv (B, Tq, 3C) (laid out [q | k | v]) are written into slot slot[b] at
  // positions pos[b] + t; then out[b,t,:] (B, Tq, C) is the attention of query (b, t) over that slot's positions
  // 0 .. pos[b] + t (softmax of q.k / sqrt(hs) per head, as attention_forward). Positions past maxT are a
  // caller's error (the model never makes them).
  virtual void attention_kv_forward(T* /*out*/, T* /*kcache*/, T* /*vcache*/, const T* /*qkv*/,
                                    const int32_t* /*slot*/, const int32_t* /*pos*/, int /*B*/, int /*Tq*/,
                                    int /*C*/, int /*NH*/, int /*maxT*/) {
    no_kv();
  }
  // rope_forward with row (b, t) of qkv (B, Tn, 3C) at position pos[b] + t (pos: B ints in backend memory): the
  // rotary positions of decode, where each sequence is at its own position (the same cos / sin as rope_forward
  // gives that position). Models with position = rope need it for the KV path.
  virtual void rope_forward_at(T* /*qkv*/, const int32_t* /*pos*/, int /*B*/, int /*Tn*/, int /*C*/, int /*NH*/,
                               float /*base*/) {
    no_kv();
  }
  // out[i,:] = inp[rows[i],:] for i < n (rows in backend memory): the last position of each prompt, for the head.
  virtual void gather_rows(T* /*out*/, const T* /*inp*/, const int32_t* /*rows*/, int /*n*/, int /*C*/) { no_kv(); }
  // One token id per row of logits (n, Vp) (the first V columns), drawn as model/sampling.h defines, written to
  // ids (HOST memory: only the ids leave the device). rows: n sampling settings, host memory.
  virtual void sample_tokens(int32_t* /*ids*/, const T* /*logits*/, const SampleRow* /*rows*/, int /*n*/,
                             int /*V*/, int /*Vp*/) {
    no_kv();
  }
  // 16-bit weights for inference (has_w16): a copy of fp32 weights as bf16 or fp16 bits that matmul_forward_w16
  // reads, widened to fp32 in registers (decode reads half the bytes). round_w16 writes dst[i] = src[i] rounded to
  // nearest even (bf16 or fp16 bits) and src[i] = that value widened back, so that the fp32 copy (what GEMMs of
  // many rows read) holds the same weights. matmul_forward_w16 is matmul_forward with w as those bits, for any N,
  // each row's result independent of the other rows of the call (the model's KV inference relies on it: a seeded
  // request's text must not depend on the batch).
  virtual bool has_w16() const { return false; }
  virtual uint16_t* alloc_u16(size_t /*n*/) {
    no_kv();
    return nullptr;  // not reached (no_kv throws); nvcc's host pass does not see [[noreturn]] through the class
  }
  virtual void free_u16(uint16_t* /*p*/) {}
  virtual void round_w16(uint16_t* /*dst*/, T* /*src*/, size_t /*n*/, bool /*bf16*/) { no_kv(); }
  virtual void matmul_forward_w16(T* /*out*/, const T* /*inp*/, const uint16_t* /*w*/, const T* /*bias*/, int /*N*/,
                                  int /*C*/, int /*OC*/, bool /*bf16*/) {
    no_kv();
  }
  // 8-bit weights for inference (has_q8): quantize_q8 turns a matrix w (rows, C) into int8 q (rows, C) and one fp32
  // scale per block of 32 inputs of a row (scales: rows x ceil(C / 32)): s = max|w| / 127, q = w / s rounded to
  // nearest even, then writes w = q * s (the weights the fp32 forward reads). matmul_forward_q8 is matmul_forward with
  // w = q * s: int_dot quantises inp's rows the same way (per block of 32) and sums s_w s_x times each block's exact
  // integer dot product (llama.cpp's Q8_0 x Q8_0); else w is widened to fp32 in registers against the fp32 inp.
  // Any N, each row's result independent of the other rows (as matmul_forward_w16).
  // alloc_i8: n bytes of backend memory (the scales too, as floats).
  virtual bool has_q8() const { return false; }
  virtual int8_t* alloc_i8(size_t /*n*/) {
    no_kv();
    return nullptr;
  }
  virtual void free_i8(int8_t* /*p*/) {}
  virtual void quantize_q8(int8_t* /*q*/, float* /*scales*/, T* /*w*/, long /*rows*/, int /*C*/) { no_kv(); }
  virtual void matmul_forward_q8(T* /*out*/, const T* /*inp*/, const int8_t* /*q*/, const float* /*scales*/,
                                 const T* /*bias*/, int /*N*/, int /*C*/, int /*OC*/, bool /*int_dot*/) {
    no_kv();
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
  // The optimizer step, its values in backend memory (a StepState, model/optimizer.h, so a captured step reads
  // each step's values at replay): set_step_args stores the StepArgs (never while capturing); grad_sum_squares
  // writes the sum of squares of n gradients (accumulated in double) into their sumsq; adamw is AdamW over
  // segments of the flat buffers with the gradients multiplied by update_factor(args, scaler.scale) (grad_scale *
  // clip_factor / scale), computed where it runs, writing nothing at all when the norm is not finite. param, master, grad, m and v hold flat indices [base, ...): value k is at
  // ptr[k - base], and the bf16 rounding index of value k is k (master is null when M == T: the parameters are
  // their own master copy; otherwise master is updated and param rewritten from it as cast_params does).
  // Loss scaling: set_loss_scaler stores the scaler's state (never while capturing); loss_scale_update applies
  // loss_scale_update(scaler, sumsq) where it runs (one tiny kernel on a GPU), after adamw.
  // step_result() reads sumsq and the scaler back in one copy (the one host read of a step; the ops before it
  // have finished when it returns).
  virtual void set_step_args(const StepArgs& args) = 0;
  virtual void grad_sum_squares(const M* grad, size_t n) = 0;
  // Optimizer offload (GPT2Model::set_offload; backends with has_offload, CUDA): the fp32 master weights and the
  // AdamW moments in pinned host memory (alloc_pinned: zeroed), and adamw_host, the update on the host's cores:
  // the gradients (backend memory, flat [base, ...) as adamw's) are copied into grad_host (pinned), then over each
  // segment the same per-value arithmetic as adamw's kernel with the step's `args` (their sumsq: read back after
  // grad_sum_squares) and the loss scale `scale`, master (host) updated in place, and param (backend memory)
  // written from it with adamw's rounding through pinned staging. Nothing is written when the norm is not finite.
  virtual bool has_offload() const { return false; }
  virtual M* alloc_pinned(size_t /*n*/) {
    throw std::logic_error(std::string("backend ") + name() + " has no optimizer offload (its memory is the host's)");
  }
  virtual void free_pinned(M* /*p*/) {}
  // grads_on_host: grad_host already holds them (grads_to_host_async during backward): wait for those copies.
  virtual void adamw_host(T* /*param*/, M* /*master*/, const M* /*grad*/, M* /*grad_host*/, M* /*m*/, M* /*v*/,
                          size_t /*base*/, const std::vector<AdamWSegment>& /*segments*/, float /*beta1*/,
                          float /*beta2*/, float /*eps*/, const StepArgs& /*args*/, float /*scale*/,
                          bool /*grads_on_host*/ = false) {
    throw std::logic_error(std::string("backend ") + name() + " has no optimizer offload");
  }
  // n final gradient values (backend memory) into pinned host memory, on a copy stream after the ops queued so far
  // (those that finished them): offload's copies overlapped with the rest of backward (GPT2Model::prefetch_grads)
  virtual void grads_to_host_async(M* /*dst*/, const M* /*src*/, size_t /*n*/) {
    throw std::logic_error(std::string("backend ") + name() + " has no optimizer offload");
  }
  // backend memory -> host memory, n values of the storage type (fp32 models: the weights into the host master)
  virtual void params_to_host(T* dst, const T* src, size_t n) { to_host(dst, src, n); }
  virtual void adamw(T* param, M* master, const M* grad, M* m, M* v, size_t base,
                     const std::vector<AdamWSegment>& segments, float beta1, float beta2, float eps) = 0;
  // Muon (model/optimizer.h), in three ops that read the step's values (StepArgs: muon_lr, muon_beta, and the
  // factor update_factor(args, scaler.scale) the gradients are multiplied by), each writing nothing at all when
  // the sum of squares is not finite:
  //   muon_momentum: over segments of flat [base, ...) (as adamw's), with g = grad * factor:
  //                  mom = lerp(mom, g, 1 - beta); grad = (nesterov ? lerp(g, mom, beta) : mom), the update
  //                  written over the gradient (grad and mom hold flat indices [base, ...), as adamw's)
  //   muon_orthogonalize: x (rows, cols) := the Newton-Schulz quintic, `steps` iterations, of x / (||x||_F + eps),
  //                  in place; scratch holds muon_scratch_size(rows, cols) values
  //   muon_apply:    param = param * (1 - muon_lr * decay) - muon_lr * scale * x, n values (param, master as adamw's:
  //                  master null when M == T, else master updated and param rounded from it with the step's seed;
  //                  base: the flat index of param[0], the bf16 rounding index)
  virtual void muon_momentum(M* /*grad*/, M* /*mom*/, size_t /*base*/, const std::vector<AdamWSegment>& /*segments*/,
                             bool /*nesterov*/) {
    throw std::logic_error(std::string("backend ") + name() + " has no Muon");
  }
  virtual size_t muon_scratch_size(int rows, int cols) const {
    const size_t n = size_t(rows < cols ? rows : cols);
    return 2 * n * n + size_t(rows) * cols;
  }
  virtual void muon_orthogonalize(M* /*x*/, M* /*scratch*/, int /*rows*/, int /*cols*/, int /*steps*/) {
    throw std::logic_error(std::string("backend ") + name() + " has no Muon");
  }
  // muon_orthogonalize of `batch` matrices of one shape at once: x + b * rows * cols for b < batch (consecutive in
  // memory: the layers' slices of one tensor, or qkvw's q, k, v), each as muon_orthogonalize alone, so that a
  // backend can batch the products of every matrix into one call per product and iteration. A matrix's result
  // does not depend on the batch it is in (data parallel ranks orthogonalise different shares of the matrices).
  // bf16: the Newton-Schulz products' inputs rounded to bf16, summed in fp32 (modded-nanogpt's precision; the CUDA
  // backend's products always are bf16, cuda/muon.cuh); false: in the storage type. scratch holds
  // muon_batch_scratch_size(batch, rows, cols) values. The default: muon_orthogonalize one matrix at a time.
  virtual size_t muon_batch_scratch_size(int /*batch*/, int rows, int cols) const {
    return muon_scratch_size(rows, cols);
  }
  virtual void muon_orthogonalize_batch(M* x, M* scratch, int batch, int rows, int cols, int steps, bool /*bf16*/) {
    for (int b = 0; b < batch; b++) muon_orthogonalize(x + size_t(b) * rows * cols, scratch, rows, cols, steps);
  }
  virtual void muon_apply(T* /*param*/, M* /*master*/, const M* /*x*/, size_t /*n*/, size_t /*base*/, float /*decay*/,
                          float /*scale*/) {
    throw std::logic_error(std::string("backend ") + name() + " has no Muon");
  }
  virtual void set_loss_scaler(const LossScaler& scaler) = 0;
  virtual void loss_scale_update() = 0;
  virtual StepResult step_result() = 0;
  // param[i] = master[i] rounded to T: stochastically with random bits that are a function of (seed, offset + i)
  // only, or to nearest even when seed == 0. Only backends whose models keep a master copy implement it.
  virtual void cast_params(T* /*param*/, const M* /*master*/, size_t /*n*/, uint32_t /*seed*/, size_t /*offset*/) {
    throw std::logic_error(std::string("backend ") + name() + " has no separate master weights to cast");
  }

 private:
  [[noreturn]] void no_fp8() const {
    throw std::logic_error(std::string("backend ") + name() + " has no FP8 ops (FP8 matmuls: a bf16 CUDA model on "
                           "sm_89 / sm_90, or the CPU reference)");
  }
  [[noreturn]] void no_kv() const {
    throw std::logic_error(std::string("backend ") + name() + " has no KV-cache inference ops");
  }
};

}  // namespace gpt2
