#include "model/gpt2.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>

// One op of the layer loop, timed under its name when profiling (GPT2Model::set_profile)
#define GPT2CORE_TIMED(name, ...) timed(name, [&] { __VA_ARGS__; })

namespace gpt2 {

template <typename T>
GPT2Model<T>::GPT2Model(const ModelConfig& config, std::unique_ptr<Backend<T>> backend, bool training)
    : config_(config), backend_(std::move(backend)), training_(training) {
  config_.validate();
  if (const std::string why = backend_->unsupported(config_); !why.empty())
    throw std::invalid_argument("backend " + std::string(backend_->name()) + ": " + why);
  sizes_ = param_sizes(config_);
  for (int i = 0; i < kNumParamTensors; i++) {
    offsets_[i] = num_params_;
    num_params_ += sizes_[i];
  }
  params_ = backend_->alloc(num_params_);
  if constexpr (kHasMasterCopy<T>) master_ = backend_->alloc_master(num_params_);
  if (training_) grads_ = backend_->alloc_master(num_params_);
  grad_hi_ = training_ ? num_params_ : 0;
  muon_mats_ = muon_matrices(config_);
  n_valid_dev_ = backend_->alloc_i32(1);
  loss_acc_ = backend_->alloc_master(1);
}

template <typename T>
GPT2Model<T>::~GPT2Model() {
  try {
    backend_->make_current();
  } catch (const std::exception& e) {  // destructors only log
    std::fprintf(stderr, "gpt2core: ~GPT2Model: %s\n", e.what());
  }
  drop_graph(step_graph_);
  drop_graph(optimizer_graph_);
  drop_graph(decode_graph_);
  kv_release();
  fp8_release();
  backend_->free_i32(n_valid_dev_);
  backend_->free_master(loss_acc_);
  backend_->free(params_);
  if (offload_) {  // pinned host memory, returned as such
    if constexpr (kHasMasterCopy<T>) backend_->free_pinned(master_);
    master_ = nullptr;
    for (M** p : {&m_, &v_, &host_master_, &grad_host_}) {
      backend_->free_pinned(*p);
      *p = nullptr;
    }
  }
  if (master_) backend_->free_master(master_);
  if (grads_) backend_->free_master(grads_);
  free_grad_buckets();
  if (m_) backend_->free_master(m_);
  if (v_) backend_->free_master(v_);
  if (muon_scratch_) backend_->free_master(muon_scratch_);
  if (acts_mem_) backend_->free(acts_mem_);
  if (stats_mem_) backend_->free_master(stats_mem_);
  if (inputs_) backend_->free_i32(inputs_);
  if (targets_) backend_->free_i32(targets_);
}

template <typename T>
void GPT2Model<T>::require_training(const char* what) const {
  if (!training_)
    throw std::logic_error(std::string(what) + ": this is an inference-only model (training=False): it has no "
                           "gradients or optimizer state; load it with training=True to train");
}

template <typename T>
void GPT2Model<T>::ensure_optimizer_state() {
  backend_->make_current();
  require_training("optimizer state");
  if (!m_) m_ = offload_ ? backend_->alloc_pinned(num_params_) : backend_->alloc_master(num_params_);
  if (!v_) v_ = offload_ ? backend_->alloc_pinned(num_params_) : backend_->alloc_master(num_params_);
}

template <typename T>
void GPT2Model<T>::set_offload(bool on) {
  backend_->make_current();
  require_training("set_offload");
  if (on == offload_) return;
  if (on && !backend_->has_offload())
    throw std::invalid_argument(std::string("set_offload: the ") + backend_->name() + " backend's memory is the "
                                "host's already: optimizer offload is for a GPU (device 'cuda')");
  Backend<T>& be = *backend_;
  drop_graph(optimizer_graph_);  // the update moves to the host (or back): no captured step holds
  const size_t n = num_params_;
  // move one buffer of n fp32 values between backend and pinned host memory (null stays null)
  auto move = [&](M*& p, bool to_host) {
    if (!p) return;
    M* q = to_host ? be.alloc_pinned(n) : be.alloc_master(n);
    if (to_host) {
      be.to_host_master(q, p, n);
      be.free_master(p);
    } else {  // backend memory is host-addressable (CPU; CUDA: managed), pinned memory is host memory
      std::memcpy(q, p, n * sizeof(M));
      be.free_pinned(p);
    }
    p = q;
  };
  be.synchronize();
  if constexpr (kHasMasterCopy<T>) move(master_, on);
  move(m_, on);
  move(v_, on);
  if (on) {
    if constexpr (!kHasMasterCopy<T>) {
      host_master_ = be.alloc_pinned(n);
      be.params_to_host(host_master_, params_, n);
    }
  } else {
    be.free_pinned(host_master_);
    be.free_pinned(grad_host_);
    host_master_ = grad_host_ = nullptr;
    grad_host_n_ = 0;
  }
  offload_ = on;
  host_master_stale_ = false;
}

// The gradients' pinned host copy for an offloaded update of n values: sized by the first update (the whole model,
// or a ZeRO rank's shard), grown if a later one needs more.
template <typename T>
typename GPT2Model<T>::M* GPT2Model<T>::host_grads(size_t n) {
  if (n > grad_host_n_) {
    backend_->free_pinned(grad_host_);
    grad_host_ = backend_->alloc_pinned(n);
    grad_host_n_ = n;
  }
  return grad_host_;
}

template <typename T>
void GPT2Model<T>::prefetch_grads() {
  if (!offload_) throw std::logic_error("prefetch_grads: the optimizer is not offloaded (--offload optimizer)");
  prefetch_armed_ = true;
}

template <typename T>
void GPT2Model<T>::require_offload_chunk(size_t lo, size_t n, const char* what) const {
  if (!offload_ || !kHasMasterCopy<T>)
    throw std::logic_error(std::string(what) + ": for a 16-bit model whose optimizer is offloaded");
  if (lo > num_params_ || n > num_params_ - lo) throw std::out_of_range(std::string(what) + ": past the parameters");
  backend_->make_current();
}

template <typename T>
void GPT2Model<T>::offload_chunk_out(size_t lo, M* dst, size_t n) const {
  require_offload_chunk(lo, n, "offload_chunk_out");
  std::memcpy(dst, master_ + lo, n * sizeof(M));  // backend memory is host-addressable (CUDA: managed)
}

template <typename T>
void GPT2Model<T>::offload_chunk_in(size_t lo, const M* src, size_t n) {
  require_offload_chunk(lo, n, "offload_chunk_in");
  fp8_stale_ = true;
  backend_->to_host_master(master_ + lo, src, n);
  backend_->cast_params(params_ + lo, src, n, round_seed_, lo);
  w16_stale_ = true;
}

template <typename T>
void GPT2Model<T>::require_no_offload(const char* what) const {
  if (offload_)
    throw std::logic_error(std::string(what) + ": the optimizer is offloaded to the host (--offload optimizer), "
                           "which runs AdamW in optimizer_step only");
}

template <typename T>
double GPT2Model<T>::offload_optimizer_step(float lr, float beta1, float beta2, float eps, float weight_decay,
                                            int step, double grad_clip) {
  Backend<T>& be = *backend_;
  ensure_optimizer_state();
  const size_t n = num_params_;
  be.set_step_args(step_args(lr, beta1, beta2, step, 1.0f, grad_clip, 0));
  be.grad_sum_squares(grads_, n);  // on the device, as the device update sums them
  const StepResult r = be.step_result();
  const float carried = r.scaler.scale;  // the scale these gradients carry (the scaler's update may change it)
  adamw_host_over(0, n, m_, v_, beta1, beta2, eps, weight_decay,
                  step_args(lr, beta1, beta2, step, 1.0f, grad_clip, r.sumsq), carried, "optimizer_step");
  if (loss_scaling_) be.loss_scale_update();
  const double sumsq = read_step_result();
  return step_norm(sumsq, carried, step);
}

template <typename T>
void GPT2Model<T>::refresh_params() {
  backend_->make_current();
  if constexpr (kHasMasterCopy<T>) {
    if (params_stale_) backend_->cast_params(params_, master_, num_params_, round_seed_, 0);
  }
  params_stale_ = false;
  fp8_refresh_weights();  // after the storage-type weights it is made from
}

// ------------------------------------------------------------------------------------------ FP8 Linear layers
template <typename T>
void GPT2Model<T>::set_fp8(bool on, bool head) {
  backend_->make_current();
  if (on && config_.n_embd % 16)
    throw std::invalid_argument("precision fp8: n_embd must be a multiple of 16 (cuBLASLt's FP8 kernels), got " +
                                std::to_string(config_.n_embd));
  if (on && head && config_.padded_vocab_size % 16)
    throw std::invalid_argument("precision fp8 with the head in FP8: padded_vocab_size must be a multiple of 16, got " +
                                std::to_string(config_.padded_vocab_size));
  if (!on && head) throw std::invalid_argument("the head in FP8 (fp8_head) needs precision fp8");
  fp8_release();
  fp8_ = fp8_head_ = false;
  if (!on) return;
  const size_t n = 4 * size_t(config_.n_layer) + (head ? 1 : 0);  // fp8_weight(4 n_layer) is the head
  size_t bytes = 0;
  for (size_t i = 0; i < n; i++) {
    const T* w;
    int out, in;
    fp8_weight(i, &w, &out, &in);
    bytes += 2 * size_t(out) * in;
  }
  fp8_wmem_ = backend_->alloc_fp8(bytes);  // throws for a backend without FP8 ops
  fp8_meta_ = backend_->alloc_fp8((n + 2) * 2 * sizeof(float));
  float* meta = reinterpret_cast<float*>(fp8_meta_);
  uint8_t* at = fp8_wmem_;
  fp8_w_.resize(n);
  for (size_t i = 0; i < n; i++) {
    const T* w;
    int out, in;
    fp8_weight(i, &w, &out, &in);
    const size_t k = size_t(out) * in;
    fp8_w_[i] = Fp8Tensor{at, at + k, meta + 2 * i};
    at += 2 * k;
  }
  fp8_x_.meta = meta + 2 * n;
  fp8_g_.meta = meta + 2 * n + 2;
  fp8_ = true;
  fp8_head_ = head;
  fp8_stale_ = true;
  drop_graph(step_graph_);  // the captured step holds the other matmuls
}

template <typename T>
void GPT2Model<T>::fp8_weight(size_t i, const T** w, int* out, int* in) const {
  const int C = config_.n_embd;
  if (i == 4 * size_t(config_.n_layer)) {  // the head
    *w = param(head()), *out = config_.padded_vocab_size, *in = C;
    return;
  }
  const LayerTensors<T> p = layer(params_, int(i / 4));
  switch (i % 4) {
    case 0: *w = p.qkvw, *out = 3 * C, *in = C; return;
    case 1: *w = p.attprojw, *out = C, *in = C; return;
    case 2: *w = p.fcw, *out = 4 * C, *in = C; return;
    default: *w = p.fcprojw, *out = C, *in = 4 * C; return;
  }
}

template <typename T>
void GPT2Model<T>::fp8_refresh_weights() {
  if (!fp8_ || !fp8_stale_) return;
  for (size_t i = 0; i < fp8_w_.size(); i++) {
    const T* w;
    int out, in;
    fp8_weight(i, &w, &out, &in);
    GPT2CORE_TIMED("forward.fp8_weights", backend_->fp8_quantize(fp8_w_[i], w, out, in, Fp8Kind::E4M3));
  }
  fp8_stale_ = false;
}

template <typename T>
std::vector<float> GPT2Model<T>::fp8_weight_meta() {
  if (!fp8_) return {};
  refresh_params();
  backend_->synchronize();
  std::vector<float> out(2 * fp8_w_.size());
  for (size_t i = 0; i < fp8_w_.size(); i++) {  // backend memory the host reads (CPU; CUDA managed memory)
    out[2 * i] = fp8_w_[i].meta[0];
    out[2 * i + 1] = fp8_w_[i].meta[1];
  }
  return out;
}

template <typename T>
size_t GPT2Model<T>::fp8_bytes(int B, int Tn) const {
  if (!fp8_) return 0;
  size_t bytes = (fp8_w_.size() + 2) * 2 * sizeof(float);  // the metas
  for (size_t i = 0; i < fp8_w_.size(); i++) {
    const T* w;
    int out, in;
    fp8_weight(i, &w, &out, &in);
    bytes += 2 * size_t(out) * in;
  }
  const size_t N = size_t(B) * Tn, C4 = 4 * size_t(config_.n_embd);
  return bytes + 2 * N * C4 + 2 * N * std::max<size_t>(C4, fp8_head_ ? config_.padded_vocab_size : 0);
}

// Scratch for one Linear at a time: its input (q, qt; N x 4C at most) and its output gradient (q, qt; N x 4C, or
// N x Vp with the head in FP8).
template <typename T>
void GPT2Model<T>::fp8_ensure_scratch(int N) {
  if (N % 16)
    throw std::invalid_argument("precision fp8: B * T must be a multiple of 16 (cuBLASLt's FP8 kernels), got " +
                                std::to_string(N));
  if (size_t(N) <= fp8_rows_) return;
  if (fp8_smem_) backend_->free_fp8(fp8_smem_);
  fp8_smem_ = nullptr;
  fp8_rows_ = 0;
  const size_t x = size_t(N) * 4 * config_.n_embd;
  const size_t g = size_t(N) * std::max<size_t>(4 * size_t(config_.n_embd), fp8_head_ ? config_.padded_vocab_size : 0);
  fp8_smem_ = backend_->alloc_fp8(2 * x + 2 * g);
  fp8_x_.q = fp8_smem_, fp8_x_.qt = fp8_smem_ + x;
  fp8_g_.q = fp8_smem_ + 2 * x, fp8_g_.qt = fp8_smem_ + 2 * x + g;
  fp8_rows_ = size_t(N);
}

template <typename T>
void GPT2Model<T>::fp8_release() {
  for (uint8_t** p : {&fp8_wmem_, &fp8_meta_, &fp8_smem_}) {
    if (*p) backend_->free_fp8(*p);
    *p = nullptr;
  }
  fp8_w_.clear();
  fp8_x_ = fp8_g_ = Fp8Tensor{};
  fp8_rows_ = 0;
}

template <typename T>
void GPT2Model<T>::linear_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC, size_t wi) {
  if (!fp8_ || wi >= fp8_w_.size()) {
    backend_->matmul_forward(out, inp, w, bias, N, C, OC);
    return;
  }
  Fp8Tensor x{fp8_x_.q, nullptr, fp8_x_.meta};  // backward quantises the input again, into the transpose
  backend_->fp8_linear_forward(out, x, inp, fp8_w_[wi], bias, N, C, OC);
}

// (pointer, count) of every activation buffer for (B, Tn), in layout order. Recompute::Gelu: the activation's
// output is one (B, T, 4C) buffer, refilled per layer in backward, instead of one per layer. Recompute::Layer: the
// per-layer buffers hold one block (the one running), except residual3, each block's output (the next one's
// input, and lnf's): what backward rebuilds each block from.
template <typename T>
typename GPT2Model<T>::Slots GPT2Model<T>::activation_slots(Activations<T>& a, const ModelConfig& c, int B, int Tn,
                                                            size_t att_size, Recompute r) {
  const size_t L = c.n_layer, C = c.n_embd, NH = c.n_head, Vp = c.padded_vocab_size;
  const size_t BT = size_t(B) * Tn;
  const size_t K = r == Recompute::Layer ? 1 : L;        // blocks whose activations are kept
  const size_t gelu_layers = r == Recompute::None ? L : 1;
  const size_t mean_rows = c.norm == ModelConfig::Norm::LayerNorm ? BT : 0;  // RMSNorm keeps no mean
  const size_t qk_rows = c.qk_norm ? BT * 2 * NH : 0;
  Slots s;
  s.t = {{&a.encoded, BT * C}, {&a.ln1, K * BT * C}, {&a.qkv, K * BT * 3 * C}, {&a.atty, K * BT * C},
         {&a.attproj, K * BT * C}, {&a.residual2, K * BT * C}, {&a.ln2, K * BT * C}, {&a.fch, K * BT * 4 * C},
         {&a.fch_gelu, gelu_layers * BT * 4 * C}, {&a.fcproj, K * BT * C}, {&a.residual3, L * BT * C},
         {&a.lnf, BT * C}, {&a.logits, BT * Vp},
         {&a.dres, BT * C}, {&a.dln, BT * C}, {&a.datty, BT * C}, {&a.dqkv, BT * 3 * C},
         {&a.dfch, BT * 4 * C}, {&a.dfch_gelu, BT * 4 * C}};
  s.m = {{&a.ln1_mean, K * mean_rows}, {&a.ln1_rstd, K * BT}, {&a.att, K * att_size},
         {&a.ln2_mean, K * mean_rows}, {&a.ln2_rstd, K * BT}, {&a.lnf_mean, mean_rows}, {&a.lnf_rstd, BT},
         {&a.losses, BT}, {&a.lse, BT}, {&a.qk_rstd, K * qk_rows}};
  return s;
}

ActivationCounts activation_counts(const ModelConfig& c, int B, int Tn, size_t att_size, Recompute r) {
  Activations<float> a{};
  const auto s = GPT2Model<float>::activation_slots(a, c, B, Tn, att_size, r);
  ActivationCounts n;
  for (auto& x : s.t) (x.first == &a.logits ? n.logits : n.t) += x.second;
  for (auto& x : s.m) n.m += x.second;
  return n;
}

template <typename T>
size_t GPT2Model<T>::activation_bytes_for(int B, int Tn) {
  const ActivationCounts n =
      activation_counts(config_, B, Tn, backend_->attention_state_size(B, config_.n_head, Tn), recompute_);
  return (n.t + n.logits) * sizeof(T) + n.m * sizeof(M);
}

template <typename T>
void GPT2Model<T>::set_recompute(Recompute r) {
  backend_->make_current();
  if (r == recompute_) return;
  recompute_ = r;
  release_activations();  // laid out again at the next forward
}

template <typename T>
void GPT2Model<T>::release_activations() {
  drop_graph(step_graph_);  // it points into the activations
  if (acts_mem_) backend_->free(acts_mem_);
  if (stats_mem_) backend_->free_master(stats_mem_);
  if (inputs_) backend_->free_i32(inputs_);
  if (targets_) backend_->free_i32(targets_);
  acts_mem_ = nullptr; stats_mem_ = nullptr; inputs_ = targets_ = nullptr; B_ = T_ = 0;
  have_targets_ = false;
}

template <typename T>
void GPT2Model<T>::ensure_activations(int B, int Tn) {
  if (B == B_ && Tn == T_) return;
  release_activations();
  att_size_ = backend_->attention_state_size(B, config_.n_head, Tn);
  const size_t BT = size_t(B) * Tn;
  auto slots = activation_slots(a_, config_, B, Tn, att_size_, recompute_);
  size_t nt = 0, nm = 0;
  for (auto& s : slots.t) nt += s.second;
  for (auto& s : slots.m) nm += s.second;
  acts_mem_ = backend_->alloc(nt);
  stats_mem_ = backend_->alloc_master(nm);
  T* p = acts_mem_;
  for (auto& s : slots.t) { *s.first = p; p += s.second; }
  M* q = stats_mem_;
  for (auto& s : slots.m) { *s.first = q; q += s.second; }
  inputs_ = backend_->alloc_i32(BT);
  targets_ = backend_->alloc_i32(BT);
  B_ = B; T_ = Tn;
}

template <typename T>
double GPT2Model<T>::forward(const int32_t* inp, const int32_t* targets, int B, int Tn, const int32_t* kv_slots) {
  backend_->make_current();
  if (B <= 0 || Tn <= 0 || Tn > config_.max_seq_len)
    throw std::invalid_argument("forward: need B > 0 and 0 < T <= max_seq_len");
  // inference-only: the KV-cache prefill with every position's logits (no per-layer activations kept); a backend
  // without the KV ops runs the forward below (its activations, no gradients)
  if (!training_ && backend_->has_kv()) return kv_forward(inp, targets, B, Tn, kv_slots);
  kv_forward_ = false;
  ensure_activations(B, Tn);
  Backend<T>& be = *backend_;
  const int V = config_.vocab_size, Vp = config_.padded_vocab_size;
  const int N = B * Tn;
  be.upload_batch(inputs_, targets_, inp, targets, B, Tn);
  have_targets_ = false;
  refresh_params();
  forward_ops(B, Tn);
  if (config_.logit_softcap > 0)
    GPT2CORE_TIMED("forward.softcap", be.softcap_forward(a_.logits, config_.logit_softcap, size_t(N) * Vp));
  GPT2CORE_TIMED("loss.crossentropy_forward", be.crossentropy_forward(a_.losses, a_.lse, a_.logits,
                                                                      targets ? targets_ : nullptr, n_valid_dev_, N,
                                                                      V, Vp));
  n_valid_ = 0;  // the count the backend keeps in its memory, from the host's copy of the targets
  if (!targets) return std::numeric_limits<double>::quiet_NaN();
  for (int i = 0; i < N; i++) n_valid_ += targets[i] >= 0;
  have_targets_ = true;
  std::vector<M> losses(N);
  be.to_host_master(losses.data(), a_.losses, N);
  double sum = 0;
  for (int i = 0; i < N; i++) sum += double(losses[i]);
  return n_valid_ ? sum / double(n_valid_) : std::numeric_limits<double>::quiet_NaN();
}

// The config's norm: LayerNorm (weight, bias when the config has one) or RMSNorm (no parameters, no mean).
template <typename T>
void GPT2Model<T>::norm_forward(T* out, M* mean, M* rstd, const T* inp, const T* w, const T* b, int N) {
  if (config_.norm == ModelConfig::Norm::RmsNorm)
    GPT2CORE_TIMED("forward.rmsnorm", backend_->rmsnorm_forward(out, rstd, inp, N, config_.n_embd));
  else
    GPT2CORE_TIMED("forward.layernorm", backend_->layernorm_forward(out, mean, rstd, inp, w, b, N, config_.n_embd));
}

template <typename T>
void GPT2Model<T>::residual_norm_forward(T* residual, T* out, M* mean, M* rstd, const T* a, const T* b, const T* w,
                                         const T* bias, int N) {
  if (config_.norm == ModelConfig::Norm::RmsNorm)
    GPT2CORE_TIMED("forward.residual+rmsnorm",
                   backend_->residual_rmsnorm_forward(residual, out, rstd, a, b, N, config_.n_embd));
  else
    GPT2CORE_TIMED("forward.residual+layernorm",
                   backend_->residual_layernorm_forward(residual, out, mean, rstd, a, b, w, bias, N, config_.n_embd));
}

template <typename T>
void GPT2Model<T>::norm_backward(T* dinp, M* dw, M* db, const T* dout, const T* inp, const T* w, const M* mean,
                                 const M* rstd, int N, InputGrad mode) {
  if (config_.norm == ModelConfig::Norm::RmsNorm)
    GPT2CORE_TIMED("backward.rmsnorm", backend_->rmsnorm_backward(dinp, dout, inp, rstd, N, config_.n_embd, mode));
  else
    GPT2CORE_TIMED("backward.layernorm",
                   backend_->layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, config_.n_embd, mode));
}

// The forward through the layers into a_.logits (not soft-capped: the caller caps, or fuses the cap into the
// loss), for the inputs already in inputs_ and current parameters.
template <typename T>
void GPT2Model<T>::forward_ops(int B, int Tn) {
  Backend<T>& be = *backend_;
  const int C = config_.n_embd, Vp = config_.padded_vocab_size;
  const int N = B * Tn;
  if (fp8_) fp8_ensure_scratch(N);
  GPT2CORE_TIMED("forward.embedding", be.encoder_forward(a_.encoded, inputs_, param(kWte), param(kWpe), B, Tn, C));
  const LayerTensors<T> first = layer(params_, 0);
  norm_forward(a_.ln1, a_.ln1_mean, a_.ln1_rstd, a_.encoded, first.ln1w, first.ln1b, N);
  for (int l = 0; l < config_.n_layer; l++) block_forward_ops(l, false);
  GPT2CORE_TIMED("forward.lm_head",
                 linear_forward(a_.logits, a_.lnf, param(head()), nullptr, N, C, Vp, 4 * size_t(config_.n_layer)));
}

template <typename T>
void GPT2Model<T>::block_forward_ops(int l, bool rebuild) {
  Backend<T>& be = *backend_;
  const ModelConfig& c = config_;
  const int B = B_, Tn = T_, L = c.n_layer, C = c.n_embd, NH = c.n_head;
  const int N = B * Tn;
  const size_t NC = size_t(N) * C, s = slot(l);
  const bool rope = c.position == ModelConfig::Position::Rope, relu2 = c.activation == ModelConfig::Activation::Relu2;
  const LayerTensors<T> p = layer(params_, l);
  const T* x = l == 0 ? a_.encoded : a_.residual3 + (l - 1) * NC;
  T* ln1 = a_.ln1 + s * NC;  // norm(x): written by the previous layer's fused residual + norm (or rebuilt here)
  T* qkv = a_.qkv + s * NC * 3;
  T* atty = a_.atty + s * NC;
  M* att = a_.att + s * att_size_;
  T* attproj = a_.attproj + s * NC;
  T* res2 = a_.residual2 + s * NC;
  T* ln2 = a_.ln2 + s * NC;
  T* fch = a_.fch + s * NC * 4;
  T* fch_gelu = recompute_ == Recompute::None ? a_.fch_gelu + s * NC * 4 : a_.fch_gelu;  // the activation's output
  T* fcproj = a_.fcproj + s * NC;
  if (rebuild)  // bit for bit what the fused residual + norm wrote (Backend: "then the forward on the ROUNDED sum")
    norm_forward(ln1, a_.ln1_mean + s * N, a_.ln1_rstd + s * N, x, p.ln1w, p.ln1b, N);
  const size_t wi = 4 * size_t(l);  // the block's FP8 weights (set_fp8): qkvw, attprojw, fcw, fcprojw
  GPT2CORE_TIMED("forward.matmul_qkv", linear_forward(qkv, ln1, p.qkvw, p.qkvb, N, C, 3 * C, wi));
  // q and k rotated, then normalised, in place: qkv is what attention (and its backward) reads
  if (rope) GPT2CORE_TIMED("forward.rope", be.rope_forward(qkv, B, Tn, C, NH, 0, c.rope_base));
  if (c.qk_norm)
    GPT2CORE_TIMED("forward.qk_norm", be.qk_norm_forward(qkv, a_.qk_rstd + s * N * 2 * NH, B, Tn, C, NH));
  GPT2CORE_TIMED("forward.attention", be.attention_forward(atty, att, qkv, B, Tn, C, NH));
  GPT2CORE_TIMED("forward.matmul_attproj", linear_forward(attproj, atty, p.attprojw, p.attprojb, N, C, C, wi + 1));
  residual_norm_forward(res2, ln2, a_.ln2_mean + s * N, a_.ln2_rstd + s * N, x, attproj, p.ln2w, p.ln2b, N);
  // fch = ln2 @ fcw^T + fcb, fch_gelu = act(fch): one op so that a backend can fuse the activation into the matmul
  // Recompute::Gelu: act from the stored (rounded) fch, the value backward rebuilds it from. A fused epilogue
  // (cuBLASLt's GELU_AUX) applies GELU to the fp32 sum before rounding: in 16-bit its act is not gelu(fch), so the
  // recomputed one would differ in the last bit from what this forward used (measured on an H200).
  if (fp8_) {  // the FP8 up-projection, then the activation as its own op
    GPT2CORE_TIMED("forward.matmul_fc", linear_forward(fch, ln2, p.fcw, p.fcb, N, C, 4 * C, wi + 2));
    if (relu2) GPT2CORE_TIMED("forward.relu2", be.relu2_forward(fch_gelu, fch, size_t(N) * 4 * C));
    else GPT2CORE_TIMED("forward.gelu", be.gelu_forward(fch_gelu, fch, size_t(N) * 4 * C));
  } else if (relu2) {
    GPT2CORE_TIMED("forward.matmul_fc+relu2", be.matmul_relu2_forward(fch, fch_gelu, ln2, p.fcw, p.fcb, N, C, 4 * C));
  } else if (recompute_ == Recompute::Gelu) {
    GPT2CORE_TIMED("forward.matmul_fc", be.matmul_forward(fch, ln2, p.fcw, p.fcb, N, C, 4 * C));
    GPT2CORE_TIMED("forward.gelu", be.gelu_forward(fch_gelu, fch, size_t(N) * 4 * C));
  } else {
    GPT2CORE_TIMED("forward.matmul_fc+gelu", be.matmul_gelu_forward(fch, fch_gelu, ln2, p.fcw, p.fcb, N, C, 4 * C));
  }
  GPT2CORE_TIMED("forward.matmul_fcproj",
                 linear_forward(fcproj, fch_gelu, p.fcprojw, p.fcprojb, N, 4 * C, C, wi + 3));
  if (rebuild) return;  // the block's output is kept (residual3), and the next norm is not needed again
  // residual3 = residual2 + fcproj, normalised by the next layer's ln1 (or, after the last layer, by lnf)
  T* res3 = a_.residual3 + l * NC;
  if (l + 1 < L) {
    const LayerTensors<T> next = layer(params_, l + 1);
    const size_t n = slot(l + 1);
    residual_norm_forward(res3, a_.ln1 + n * NC, a_.ln1_mean + n * N, a_.ln1_rstd + n * N, res2, fcproj, next.ln1w,
                          next.ln1b, N);
  } else {
    residual_norm_forward(res3, a_.lnf, a_.lnf_mean, a_.lnf_rstd, res2, fcproj, param(kLnfw), param(kLnfb), N);
  }
}

template <typename T>
void GPT2Model<T>::logits_to_host(M* dst) const {
  backend_->make_current();
  if (!B_) throw std::runtime_error("logits: no forward pass has run yet");
  if (kv_forward_) return kv_logits_to_host(dst);
  const size_t n = size_t(B_) * T_ * config_.padded_vocab_size;
  if constexpr (kHasMasterCopy<T>) {  // bf16 / fp16 logits, widened on the host
    std::vector<T> tmp(n);
    backend_->to_host(tmp.data(), a_.logits, n);
    for (size_t i = 0; i < n; i++) dst[i] = widen(tmp[i]);
  } else {
    backend_->to_host(dst, a_.logits, n);
  }
}

template <typename T>
void GPT2Model<T>::losses_to_host(M* dst) const {
  backend_->make_current();
  if (!B_) throw std::runtime_error("token_losses: no forward pass has run yet");
  backend_->to_host_master(dst, kv_forward_ ? kv_.losses : a_.losses, size_t(B_) * T_);
}

template <typename T>
void GPT2Model<T>::zero_grad() {
  backend_->make_current();
  require_training("zero_grad");
  backend_->zero_master(grads_, grad_hi_ - grad_lo_);
  shard_fresh_ = true;
  grads_on_host_ = false;
}

template <typename T>
void GPT2Model<T>::free_grad_buckets() {
  for (int b = 0; b < 3; b++) {
    if (bucket_[b]) backend_->free_master(bucket_[b]);
    bucket_[b] = nullptr;
    bucket_n_[b] = 0;
  }
}

template <typename T>
void GPT2Model<T>::set_grad_shard(size_t lo, size_t hi) {
  backend_->make_current();
  require_training("set_grad_shard");
  if (lo > hi || hi > num_params_)
    throw std::invalid_argument("set_grad_shard: need 0 <= lo <= hi <= num_parameters (" +
                                std::to_string(num_params_) + "), got lo=" + std::to_string(lo) +
                                " hi=" + std::to_string(hi));
  const bool shard = !(lo == 0 && hi == num_params_);
  drop_graph(step_graph_);  // its ops wrote the old gradient buffers
  drop_graph(optimizer_graph_);
  backend_->free_master(grads_);
  grads_ = nullptr;
  free_grad_buckets();
  grad_sharded_ = shard;
  grad_lo_ = shard ? lo : 0;
  grad_hi_ = shard ? hi : num_params_;
  grads_ = backend_->alloc_master(std::max<size_t>(1, grad_hi_ - grad_lo_));
  backend_->zero_master(grads_, grad_hi_ - grad_lo_);
  shard_fresh_ = true;
  if (!shard) return;
  const size_t L = size_t(config_.n_layer);
  for (int i = kFirstLayerTensor; i <= kLastLayerTensor; i++) bucket_n_[0] += sizes_[i] / L;
  bucket_n_[1] = sizes_[kLnfw] + sizes_[kLnfb] + sizes_[kLmHead];
  bucket_n_[2] = sizes_[kWte] + sizes_[kWpe];
  for (int b = 0; b < 3; b++) bucket_[b] = backend_->alloc_master(std::max<size_t>(1, bucket_n_[b]));
}

template <typename T>
void GPT2Model<T>::accumulate_grad_shard(const M* src, size_t flat_lo, size_t n) {
  M* dst = grad_at(flat_lo, n, "accumulate_grad_shard");
  backend_->accumulate_master(dst, src, n, !shard_fresh_);
  if (shard_prefetch_)  // the optimizer step's last micro-step: this part of the shard is final, to the host now
    backend_->grads_to_host_async(host_grads(grad_hi_ - grad_lo_) + (flat_lo - grad_lo_), dst, n);
}

template <typename T>
typename GPT2Model<T>::M* GPT2Model<T>::grad_at(size_t flat, size_t n, const char* what) const {
  if (flat < grad_lo_ || flat + n > grad_hi_)
    throw std::out_of_range(std::string(what) + ": gradients [" + std::to_string(flat) + ", " +
                            std::to_string(flat + n) + ") are not in this model's shard [" +
                            std::to_string(grad_lo_) + ", " + std::to_string(grad_hi_) + ")");
  return grads_ + (flat - grad_lo_);
}

template <typename T>
void GPT2Model<T>::require_unsharded(const char* what) const {
  if (grad_sharded_)
    throw std::logic_error(std::string(what) + ": the gradients are sharded (ZeRO-2): this model holds [" +
                           std::to_string(grad_lo_) + ", " + std::to_string(grad_hi_) +
                           ") only; step over the shard (adamw_update_range) instead");
}

template <typename T>
typename GPT2Model<T>::M* GPT2Model<T>::grad_out(ParamTensor i) const {
  if (!sizes_[i]) return nullptr;
  if (!grad_sharded_) return grad(i);
  if (i == kWte || i == kWpe) return bucket_[2] + (offsets_[i] - offsets_[kWte]);
  return bucket_[1] + (offsets_[i] - offsets_[kLnfw]);  // lnfw, lnfb, lm_head: consecutive in the layout
}

template <typename T>
LayerTensors<typename GPT2Model<T>::M> GPT2Model<T>::layer_grads_out(int l) const {
  if (!grad_sharded_) return layer(grads_, l);
  // the layer bucket: each per-layer tensor's slice back to back, in the flat layout's order (layer_grad_ranges)
  M* at[kNumParamTensors] = {};
  size_t pos = 0;
  for (int i = kFirstLayerTensor; i <= kLastLayerTensor; i++) {
    const size_t per_layer = sizes_[i] / size_t(config_.n_layer);
    at[i] = per_layer ? bucket_[0] + pos : nullptr;
    pos += per_layer;
  }
  return {at[kLn1w], at[kLn1b], at[kQkvw], at[kQkvb], at[kAttprojw], at[kAttprojb],
          at[kLn2w], at[kLn2b], at[kFcw], at[kFcb], at[kFcprojw], at[kFcprojb]};
}

template <typename T>
template <typename P>
LayerTensors<P> GPT2Model<T>::layer(P* base, int l) const {
  auto at = [&](ParamTensor i) -> P* {
    return sizes_[i] ? base + offsets_[i] + size_t(l) * (sizes_[i] / size_t(config_.n_layer)) : nullptr;
  };
  return {at(kLn1w), at(kLn1b), at(kQkvw), at(kQkvb), at(kAttprojw), at(kAttprojb),
          at(kLn2w), at(kLn2b), at(kFcw),  at(kFcb),  at(kFcprojw),  at(kFcprojb)};
}

template <typename T>
GradRanges GPT2Model<T>::layer_grad_ranges(int l) const {
  GradRanges r;
  r.reserve(kLastLayerTensor - kFirstLayerTensor + 1);
  for (int i = kFirstLayerTensor; i <= kLastLayerTensor; i++) {  // (L, ...) tensors, layer l's slice of each
    const size_t per_layer = sizes_[i] / size_t(config_.n_layer);
    if (per_layer) r.emplace_back(offsets_[i] + size_t(l) * per_layer, offsets_[i] + size_t(l + 1) * per_layer);
  }
  return r;
}

template <typename T>
GradRanges GPT2Model<T>::tensor_grad_ranges(ParamTensor first, ParamTensor last) const {
  GradRanges r;
  for (int i = first; i <= last; i++)
    if (sizes_[i]) r.emplace_back(offsets_[i], offsets_[i] + sizes_[i]);
  return r;
}

template <typename T>
GradRanges GPT2Model<T>::head_grad_ranges() const {
  GradRanges r = tensor_grad_ranges(kLnfw, kLnfb);
  const GradRanges h = tensor_grad_ranges(kLmHead, kLmHead);
  r.insert(r.end(), h.begin(), h.end());
  return r;
}

template <typename T>
void GPT2Model<T>::backward(float grad_scale, bool report_grads) {
  backend_->make_current();
  require_training("backward");
  if (!have_targets_)
    throw std::runtime_error("backward: call forward(idx, targets) first (each forward allows one backward)");
  have_targets_ = false;  // the logits buffer becomes dlogits below
  Backend<T>& be = *backend_;
  const int L = config_.n_layer, V = config_.vocab_size, Vp = config_.padded_vocab_size;
  const int N = B_ * T_;
  const bool report = report_grads && grad_hook_;  // call the grad-ready hook in this backward
  if (n_valid_ == 0) prefetch_armed_ = grads_on_host_ = false;  // the early returns below copy nothing
  if (grad_sharded_ && !bucket_hook_)
    throw std::logic_error("backward: the gradients are sharded (ZeRO-2): backward runs through the reducer that "
                           "set the bucket hook (DataParallel with zero=2)");
  if (n_valid_ == 0 && grad_sharded_) {  // nothing to add, but every rank takes part in every bucket's reduction
    for (int b = 0; b < 3; b++) backend_->zero_master(bucket_[b], bucket_n_[b]);
    if (!head_grad_ranges().empty()) bucket_hook_(bucket_[1], head_grad_ranges());
    for (int l = L - 1; l >= 0; l--) bucket_hook_(bucket_[0], layer_grad_ranges(l));
    bucket_hook_(bucket_[2], tensor_grad_ranges(kWte, kWpe));
    shard_fresh_ = false;
    return;
  }
  if (n_valid_ == 0) {  // every target ignored: the loss does not depend on the parameters
    if (report) {       // the gradients are final as they are; report them in the usual groups
      grad_hook_(head_grad_ranges());
      for (int l = L - 1; l >= 0; l--) grad_hook_(layer_grad_ranges(l));
      grad_hook_(tensor_grad_ranges(kWte, kWpe));
    }
    return;
  }

  if (config_.logit_softcap > 0)  // the logits hold the capped values forward wrote
    GPT2CORE_TIMED("loss.crossentropy_softcap_backward",
                   be.crossentropy_softcap_backward(a_.logits, a_.lse, targets_, n_valid_dev_, grad_scale,
                                                    config_.logit_softcap, N, V, Vp));
  else
    GPT2CORE_TIMED("loss.crossentropy_backward",
                   be.crossentropy_backward(a_.logits, a_.lse, targets_, n_valid_dev_, grad_scale, N, V, Vp));
  backward_ops(report);
  shard_fresh_ = false;
  be.synchronize();  // the gradients are read on the host next (numpy views)
}

// Backward from dlogits (written into a_.logits) through the layers to the embedding gradients, accumulating
// into grads(); with report, calls the grad-ready hook as groups of gradients are final.
template <typename T>
void GPT2Model<T>::backward_ops(bool report) {
  Backend<T>& be = *backend_;
  const int B = B_, Tn = T_, L = config_.n_layer, C = config_.n_embd, NH = config_.n_head;
  const int Vp = config_.padded_vocab_size;
  const int N = B * Tn;
  const size_t NC = size_t(N) * C;
  T* dlogits = a_.logits;
  const ModelConfig& c = config_;
  const bool rope = c.position == ModelConfig::Position::Rope, relu2 = c.activation == ModelConfig::Activation::Relu2;
  // Activation gradients: the first op to produce one writes it (InputGrad::Write: no zero fill, no read of
  // zeros); only the residual stream's gradient a_.dres is summed (+=) by the two norms of each layer.
  constexpr InputGrad kWrite = InputGrad::Write, kAdd = InputGrad::Add;
  // ZeRO-2: the gradients go to the buckets (cleared here: the ops add into them), each handed to the bucket hook
  // when final, where a full gradient buffer would have them reported to the grad-ready hook
  const bool sharded = grad_sharded_;
  if (sharded)
    for (int b = 0; b < 3; b++) be.zero_master(bucket_[b], bucket_n_[b]);
  // optimizer offload's prefetch (prefetch_grads): each group of final gradients to the host on the copy stream,
  // as the grad-ready hook would be told of it
  const bool prefetch = prefetch_armed_ && offload_ && !sharded;
  shard_prefetch_ = prefetch_armed_ && offload_ && sharded;  // ZeRO-2: accumulate_grad_shard copies each part
  prefetch_armed_ = grads_on_host_ = false;
  M* host = prefetch ? host_grads(num_params_) : nullptr;
  auto final_grads = [&](const auto& ranges) {
    if (report) grad_hook_(ranges);
    if (prefetch)
      for (const auto& r : ranges) be.grads_to_host_async(host + r.first, grads_ + r.first, r.second - r.first);
  };
  // One Linear's backward: through the FP8 op (weight wi, set_fp8) or in the model's precision. FP8: the kept input
  // is quantised again into the scratch's transpose (the bits forward multiplied), dout into the gradient scratch.
  auto linear_backward = [&](T* dinp, M* dw, M* db, const T* dout, const T* inp, const T* w, int Cin, int OC,
                             size_t wi, InputGrad mode) {
    if (!fp8_ || wi >= fp8_w_.size()) {
      be.matmul_backward(dinp, dw, db, dout, inp, w, N, Cin, OC, mode);
      return;
    }
    be.fp8_quantize(Fp8Tensor{nullptr, fp8_x_.qt, fp8_x_.meta}, inp, N, Cin, Fp8Kind::E4M3);
    be.fp8_linear_backward(dinp, dw, db, fp8_g_, dout, fp8_x_, fp8_w_[wi], N, Cin, OC, mode);
  };
  GPT2CORE_TIMED("backward.lm_head", linear_backward(a_.dln, grad_out(head()), nullptr, dlogits, a_.lnf,
                                                     param(head()), C, Vp, 4 * size_t(L), kWrite));
  norm_backward(a_.dres, grad_out(kLnfw), grad_out(kLnfb), a_.dln, a_.residual3 + (L - 1) * NC, param(kLnfw),
                a_.lnf_mean, a_.lnf_rstd, N, kWrite);
  if (sharded && !head_grad_ranges().empty()) bucket_hook_(bucket_[1], head_grad_ranges());
  final_grads(head_grad_ranges());
  // a_.dres now holds d(loss)/d(output of the last layer); walk the layers backwards.
  for (int l = L - 1; l >= 0; l--) {
    if (recompute_ == Recompute::Layer) block_forward_ops(l, true);  // this block's activations, from its input
    const size_t s = slot(l);
    const T* x = l == 0 ? a_.encoded : a_.residual3 + (l - 1) * NC;
    const LayerTensors<T> p = layer(params_, l);
    if (sharded && l < L - 1) be.zero_master(bucket_[0], bucket_n_[0]);  // the hook is done with layer l + 1's
    const LayerTensors<M> g = layer_grads_out(l);
    T* qkv = a_.qkv + s * NC * 3;
    T* fch = a_.fch + s * NC * 4;
    // residual3 = residual2 + fcproj(act(fc(ln2(residual2))))
    const T* fch_gelu = a_.fch_gelu + s * NC * 4;
    if (recompute_ == Recompute::Gelu) {  // the forward kept only fch; rebuild act(fch) for this layer
      if (relu2) GPT2CORE_TIMED("backward.recompute_relu2", be.relu2_forward(a_.fch_gelu, fch, NC * 4));
      else GPT2CORE_TIMED("backward.recompute_gelu", be.gelu_forward(a_.fch_gelu, fch, NC * 4));
      fch_gelu = a_.fch_gelu;
    }
    // dfch = (dres @ fcprojw) * act'(fch) (written; a_.dfch_gelu is the op's scratch), fcprojw/fcprojb grads +=
    const size_t wi = 4 * size_t(l);  // the block's FP8 weights (set_fp8)
    if (fp8_) {  // the FP8 down-projection's backward into d act, then the activation's backward as its own op
      GPT2CORE_TIMED("backward.matmul_fcproj", linear_backward(a_.dfch_gelu, g.fcprojw, g.fcprojb, a_.dres, fch_gelu,
                                                               p.fcprojw, 4 * C, C, wi + 3, kWrite));
      be.zero(a_.dfch, NC * 4);
      if (relu2) GPT2CORE_TIMED("backward.relu2", be.relu2_backward(a_.dfch, fch, a_.dfch_gelu, NC * 4));
      else GPT2CORE_TIMED("backward.gelu", be.gelu_backward(a_.dfch, fch, a_.dfch_gelu, NC * 4));
    } else if (relu2)
      GPT2CORE_TIMED("backward.matmul_fcproj+relu2",
                     be.relu2_matmul_backward(a_.dfch, g.fcprojw, g.fcprojb, a_.dres, fch, fch_gelu, p.fcprojw,
                                              a_.dfch_gelu, N, 4 * C, C));
    else
      GPT2CORE_TIMED("backward.matmul_fcproj+gelu",
                     be.gelu_matmul_backward(a_.dfch, g.fcprojw, g.fcprojb, a_.dres, fch, fch_gelu, p.fcprojw,
                                             a_.dfch_gelu, N, 4 * C, C));
    GPT2CORE_TIMED("backward.matmul_fc",
                   linear_backward(a_.dln, g.fcw, g.fcb, a_.dfch, a_.ln2 + s * NC, p.fcw, C, 4 * C, wi + 2, kWrite));
    norm_backward(a_.dres, g.ln2w, g.ln2b, a_.dln, a_.residual2 + s * NC, p.ln2w, a_.ln2_mean + s * N,
                  a_.ln2_rstd + s * N, N, kAdd);
    // residual2 = x + attproj(attention(qk_norm(rope(qkv(ln1(x))))))
    GPT2CORE_TIMED("backward.matmul_attproj",
                   linear_backward(a_.datty, g.attprojw, g.attprojb, a_.dres, a_.atty + s * NC, p.attprojw, C, C,
                                   wi + 1, kWrite));
    GPT2CORE_TIMED("backward.attention",
                   be.attention_backward(a_.dqkv, a_.datty, qkv, a_.atty + s * NC, a_.att + s * att_size_, B, Tn, C,
                                         NH, kWrite));
    // in place, in the reverse order of forward: through the QK-norm, then the rotation
    if (c.qk_norm)
      GPT2CORE_TIMED("backward.qk_norm", be.qk_norm_backward(a_.dqkv, qkv, a_.qk_rstd + s * N * 2 * NH, B, Tn, C, NH));
    if (rope) GPT2CORE_TIMED("backward.rope", be.rope_backward(a_.dqkv, B, Tn, C, NH, 0, c.rope_base));
    GPT2CORE_TIMED("backward.matmul_qkv",
                   linear_backward(a_.dln, g.qkvw, g.qkvb, a_.dqkv, a_.ln1 + s * NC, p.qkvw, C, 3 * C, wi, kWrite));
    norm_backward(a_.dres, g.ln1w, g.ln1b, a_.dln, x, p.ln1w, a_.ln1_mean + s * N, a_.ln1_rstd + s * N, N, kAdd);
    if (sharded) bucket_hook_(bucket_[0], layer_grad_ranges(l));
    final_grads(layer_grad_ranges(l));  // ln1w .. fcprojb of layer l
  }
  GPT2CORE_TIMED("backward.embedding",
                 be.encoder_backward(grad_out(kWte), grad_out(kWpe), a_.dres, inputs_, B, Tn, C));  // no dwpe: rope
  if (sharded) bucket_hook_(bucket_[2], tensor_grad_ranges(kWte, kWpe));
  final_grads(tensor_grad_ranges(kWte, kWpe));  // wte (embedding and tied lm_head gradients), wpe
  if (prefetch || shard_prefetch_) {
    shard_prefetch_ = false;
    grads_on_host_ = true;
    grad_prefetches_++;
  }
}

template <typename T>
void GPT2Model<T>::forward_backward(const int32_t* inp, const int32_t* targets, int B, int Tn, float grad_scale) {
  backend_->make_current();
  if (B <= 0 || Tn <= 0 || Tn > config_.max_seq_len)
    throw std::invalid_argument("forward_backward: need B > 0 and 0 < T <= max_seq_len");
  if (!targets) throw std::invalid_argument("forward_backward: needs targets");
  require_training("forward_backward");
  kv_forward_ = false;
  ensure_activations(B, Tn);  // a new layout drops the graph
  Backend<T>& be = *backend_;
  // outside any graph: the host-side work of the step (the batch's upload, a rebuilt bf16 weight copy)
  be.upload_batch(inputs_, targets_, inp, targets, B, Tn);
  refresh_params();
  have_targets_ = false;  // the logits become dlogits
  if (grad_sharded_) {  // ZeRO-2: the bucket hook runs collectives between the ops, which no graph can hold
    if (!bucket_hook_)
      throw std::logic_error("forward_backward: the gradients are sharded (ZeRO-2): it runs through the reducer "
                             "that set the bucket hook");
    forward_backward_ops(grad_scale);
    shard_fresh_ = false;
    return;
  }
  if (prefetch_armed_) {  // its copies run on a second stream, which a captured step does not hold
    forward_backward_ops(grad_scale);
    return;
  }
  run_graphed(step_graph_, {double(B), double(Tn), grad_scale}, [&] { forward_backward_ops(grad_scale); });
}

// Runs ops() directly, or through g (see set_graphs): a key seen for the first time runs directly (and sizes the
// backend's scratch buffers), the second time it is captured and launched, after that replayed.
// A capture that fails (a library call that cannot be recorded, say) turns graphs off for this model with a
// message, and the ops run directly: recording runs nothing, so running them now is the step's only run, and an
// error that is not about capturing comes back from it.
template <typename T>
template <class Ops>
void GPT2Model<T>::run_graphed(GraphSlot& g, std::vector<double> key, Ops&& ops) {
  Backend<T>& be = *backend_;
  if (!graphs_ || !be.can_capture() || profile_) {  // profiling times each op: nothing runs from a graph
    ops();
    return;
  }
  if (g.exec && g.key != key) drop_graph(g);
  if (!g.exec && g.warm_key != key) {
    ops();
    g.warm_key = std::move(key);
    return;
  }
  if (!g.exec) {
    try {
      be.capture_begin();
      try {
        ops();
      } catch (...) {
        be.capture_end(false);
        throw;
      }
      g.exec = be.capture_end(true);
    } catch (const std::exception& e) {
      fprintf(stderr, "gpt2core: CUDA graphs turned off, the step could not be captured (%s); running it directly\n",
              e.what());
      set_graphs(false);
      ops();
      return;
    }
    g.key = std::move(key);
    graph_captures_++;
  }
  be.graph_launch(g.exec);
  graph_replays_++;
}

// The ops of one micro-step, all in backend memory (what a graph records): forward, the loss into loss_acc_,
// backward of grad_scale * mean loss.
template <typename T>
void GPT2Model<T>::forward_backward_ops(float grad_scale) {
  Backend<T>& be = *backend_;
  const int N = B_ * T_, V = config_.vocab_size, Vp = config_.padded_vocab_size;
  forward_ops(B_, T_);
  if (config_.logit_softcap > 0)  // the raw logits, capped inside the fused pass
    GPT2CORE_TIMED("loss.crossentropy_softcap",
                   be.crossentropy_softcap_forward_backward(a_.losses, a_.lse, a_.logits, targets_, n_valid_dev_,
                                                            grad_scale, config_.logit_softcap, N, V, Vp));
  else
    GPT2CORE_TIMED("loss.crossentropy",
                   be.crossentropy_forward_backward(a_.losses, a_.lse, a_.logits, targets_, n_valid_dev_, grad_scale,
                                                    N, V, Vp));
  GPT2CORE_TIMED("loss.accumulate", be.loss_accumulate(loss_acc_, a_.losses, n_valid_dev_, N, grad_scale));
  backward_ops(false);
}

template <typename T>
double GPT2Model<T>::take_loss() {
  backend_->make_current();
  M acc;
  backend_->to_host_master(&acc, loss_acc_, 1);
  backend_->zero_master(loss_acc_, 1);
  return double(acc);
}

template <typename T>
void GPT2Model<T>::set_graphs(bool on) {
  backend_->make_current();
  graphs_ = on;
  if (!on) {
    drop_graph(step_graph_);
    drop_graph(optimizer_graph_);
    drop_graph(decode_graph_);
  }
}

template <typename T>
void GPT2Model<T>::drop_graph(GraphSlot& g) {
  if (g.exec) backend_->graph_destroy(g.exec);
  g = GraphSlot{};
}

template <typename T>
double GPT2Model<T>::read_step_result() {
  const StepResult r = backend_->step_result();
  scaler_ = r.scaler;
  return r.sumsq;
}

template <typename T>
double GPT2Model<T>::step_norm(double sumsq, float carried, int step) {
  fp8_stale_ = true;  // the step's update (even a skipped one: the copy is made again, the same)
  const double norm = std::sqrt(sumsq / (double(carried) * double(carried)));
  if (std::isfinite(norm)) {  // else nothing was written
    round_seed_ = uint32_t(step);
    params_stale_ = false;
  }
  return norm;
}

template <typename T>
void GPT2Model<T>::set_loss_scaling(bool on, const LossScaler& state) {
  backend_->make_current();
  if (on && !(state.scale > 0 && std::isfinite(state.scale) && state.interval >= 1 && state.growth >= 1 &&
              std::isfinite(state.growth) && state.backoff > 0 && state.backoff < 1 && state.clean >= 0 &&
              state.skipped >= 0))
    throw std::invalid_argument("loss scaling: need a finite scale > 0, interval >= 1, growth >= 1, 0 < backoff < 1 "
                                "and counters >= 0");
  loss_scaling_ = on;
  scaler_ = on ? state : LossScaler{};  // off: scale 1, never updated
  backend_->set_loss_scaler(scaler_);
}

template <typename T>
double GPT2Model<T>::grad_sum_squares(size_t lo, size_t hi) {
  backend_->make_current();
  require_training("grad_sum_squares");
  backend_->grad_sum_squares(grad_at(lo, hi - lo, "grad_sum_squares"), hi - lo);
  return read_step_result();
}

template <typename T>
double GPT2Model<T>::grad_norm() {
  require_unsharded("grad_norm");
  return std::sqrt(unscaled(grad_sum_squares(0, num_params_)));
}

template <typename T>
void GPT2Model<T>::adamw_update(float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                                float grad_scale) {
  require_no_offload("adamw_update");
  require_unsharded("adamw_update");
  backend_->make_current();
  if (step < 1) throw std::invalid_argument("adamw_update: step counts from 1");
  ensure_optimizer_state();
  adamw_over(0, num_params_, m_, v_, beta1, beta2, eps, weight_decay,
             step_args(lr, beta1, beta2, step, grad_scale, 0, 0));
  backend_->synchronize();  // the host may read the parameters next
  round_seed_ = uint32_t(step);
  params_stale_ = false;  // the update rewrote the ops' copy from the new master weights
  fp8_stale_ = true;
}

// The step's values: the bias corrections of this step, and the step as the seed of the bf16 rounding.
template <typename T>
StepArgs GPT2Model<T>::step_args(float lr, float beta1, float beta2, int step, float grad_scale, double clip,
                                 double sumsq) const {
  StepArgs args{};
  args.lr = lr;
  args.bc1 = bias_correction(beta1, step);
  args.bc2 = bias_correction(beta2, step);
  args.grad_scale = grad_scale;
  args.seed = uint32_t(step);
  args.clip = clip;
  args.embedding_lr = args.head_lr = lr;
  args.sumsq = sumsq;
  return args;
}

template <typename T>
StepArgs GPT2Model<T>::muon_step_args(float lr, float beta1, float beta2, int step, double clip, double sumsq,
                                      const MuonStep& muon) const {
  StepArgs args = step_args(lr, beta1, beta2, step, 1.0f, clip, sumsq);
  args.muon_lr = muon.lr;
  args.muon_beta = muon.beta;
  if (muon.embedding_lr >= 0) args.embedding_lr = muon.embedding_lr;
  if (muon.head_lr >= 0) args.head_lr = muon.head_lr;
  return args;
}

template <typename T>
double GPT2Model<T>::optimizer_step(float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                                    double grad_clip) {
  require_unsharded("optimizer_step");
  backend_->make_current();
  if (step < 1) throw std::invalid_argument("optimizer_step: step counts from 1");
  if (offload_) return offload_optimizer_step(lr, beta1, beta2, eps, weight_decay, step, grad_clip);
  ensure_optimizer_state();
  Backend<T>& be = *backend_;
  be.set_step_args(step_args(lr, beta1, beta2, step, 1.0f, grad_clip, 0));  // outside the graph: read at replay
  const std::vector<AdamWSegment> segments = adamw_segments(0, num_params_, weight_decay);
  const bool scaling = loss_scaling_;
  run_graphed(optimizer_graph_, {beta1, beta2, eps, weight_decay, double(scaling)}, [&] {
    GPT2CORE_TIMED("optimizer.grad_norm", be.grad_sum_squares(grads_, num_params_));
    adamw_ops(segments, beta1, beta2, eps);
    if (scaling) be.loss_scale_update();
  });
  const float carried = scaler_.scale;  // the scale these gradients carry (the update may change it)
  return step_norm(read_step_result(), carried, step);
}

template <typename T>
void GPT2Model<T>::adamw_update_range(size_t lo, size_t hi, M* m, M* v, float lr, float beta1, float beta2,
                                      float eps, float weight_decay, int step, float grad_scale, double grad_clip,
                                      double sumsq) {
  backend_->make_current();
  fp8_stale_ = true;
  if (step < 1) throw std::invalid_argument("adamw_update_range: step counts from 1");
  require_training("adamw_update_range");
  if (lo > hi || hi > num_params_) throw std::invalid_argument("adamw_update_range: bad range");
  const StepArgs args = step_args(lr, beta1, beta2, step, grad_scale, grad_clip, sumsq);
  if (offload_) {  // ZeRO with offload: this rank's range on the host (m, v: its pinned shard of the moments)
    backend_->set_step_args(args);  // the sumsq every rank was given, for the scaler's update below
    adamw_host_over(lo, hi, m, v, beta1, beta2, eps, weight_decay, args, backend_->step_result().scaler.scale,
                    "adamw_update_range");
  } else {
    adamw_over(lo, hi, m, v, beta1, beta2, eps, weight_decay, args);
  }
  if (loss_scaling_) backend_->loss_scale_update();  // from the sumsq every rank was given: the same decision
  read_step_result();  // also waits: the host reads the shard next (all-gather)
  // the rest of the master weights arrive from the other ranks (all-gather), which calls params_changed();
  // rebuilding the whole copy with this step's seed then gives every rank the bits a full update writes
  if (std::isfinite(sumsq)) round_seed_ = uint32_t(step);
}

// The offloaded update of flat [lo, hi) (moments m, v of that range, pinned) on the host's cores, the gradients
// carrying the loss scale `carried`: an fp32 model's host copy of its weights first re-read if they were written
// from outside (a checkpoint, ZeRO's all-gather); the gradients' host copy reused when the last backward made it
// (prefetch_grads: it holds [grad_lo_, grad_hi_), the whole model or ZeRO-2's shard).
template <typename T>
void GPT2Model<T>::adamw_host_over(size_t lo, size_t hi, M* m, M* v, float beta1, float beta2, float eps,
                                   float weight_decay, const StepArgs& args, float carried, const char* what) {
  Backend<T>& be = *backend_;
  if constexpr (!kHasMasterCopy<T>) {
    if (host_master_stale_) {
      be.params_to_host(host_master_, params_, num_params_);
      host_master_stale_ = false;
    }
  }
  M* master = kHasMasterCopy<T> ? master_ : host_master_;
  const bool on_host = grads_on_host_ && lo == grad_lo_ && hi == grad_hi_;
  grads_on_host_ = false;
  be.adamw_host(params_ + lo, master + lo, grad_at(lo, hi - lo, what), host_grads(hi - lo), m, v,
                lo, adamw_segments(lo, hi, weight_decay), beta1, beta2, eps, args, carried, on_host);
}

// AdamW over flat [lo, hi) (moments m, v of that range) with the step's values, each tensor's part with its
// weight decay, in one backend call.
template <typename T>
void GPT2Model<T>::adamw_over(size_t lo, size_t hi, M* m, M* v, float beta1, float beta2, float eps,
                              float weight_decay, const StepArgs& args) {
  backend_->set_step_args(args);
  backend_->adamw(params_ + lo, master_ ? master_ + lo : nullptr, grad_at(lo, hi - lo, "adamw_update_range"), m, v,
                  lo, adamw_segments(lo, hi, weight_decay), beta1, beta2, eps);
}

// The part of each tensor inside flat [lo, hi), with its weight decay (2-D tensors only) and LR group.
template <typename T>
std::vector<AdamWSegment> GPT2Model<T>::adamw_segments(size_t lo, size_t hi, float weight_decay,
                                                       int with_muon) const {
  std::vector<AdamWSegment> segments;
  for (int i = 0; i < kNumParamTensors; i++) {
    if (with_muon >= 0 && int(param_uses_muon(i)) != with_muon) continue;
    const size_t a = std::max(lo, offsets_[i]), b = std::min(hi, offsets_[i] + sizes_[i]);
    if (a < b) segments.push_back({a, b, param_decays(i) ? weight_decay : 0.0f, param_lr_group(i)});
  }
  return segments;
}

// The whole model's AdamW over segments in one backend call; profiling, one call per tensor group (embedding,
// head, rest: the same per-value arithmetic, each segment's values independent of the others), timed apart.
template <typename T>
void GPT2Model<T>::adamw_ops(const std::vector<AdamWSegment>& segments, float beta1, float beta2, float eps) {
  Backend<T>& be = *backend_;
  if (!profile_) {
    be.adamw(params_, master_, grads_, m_, v_, 0, segments, beta1, beta2, eps);
    return;
  }
  static const char* const kNames[] = {"optimizer.adamw.rest", "optimizer.adamw.embedding", "optimizer.adamw.head"};
  for (int group : {kLrEmbedding, kLrHead, kLrRest}) {
    std::vector<AdamWSegment> part;
    for (const AdamWSegment& s : segments)
      if (s.group == group) part.push_back(s);
    if (!part.empty())
      GPT2CORE_TIMED(kNames[group], be.adamw(params_, master_, grads_, m_, v_, 0, part, beta1, beta2, eps));
  }
}

template <typename T>
void GPT2Model<T>::set_profile(bool on) {
  backend_->make_current();
  profile_ = on;
  if (on) op_times_.clear();
}

template <typename T>
void GPT2Model<T>::add_op_time(const char* name, double seconds) {
  for (OpTime& t : op_times_)
    if (t.name == name) {
      t.seconds += seconds;
      t.calls++;
      return;
    }
  op_times_.push_back({name, seconds, 1});
}

// ------------------------------------------------------------------------------------------------------ Muon
template <typename T>
void GPT2Model<T>::muon_matrix_ops(const MuonStep& muon) {
  const int hi = muon.mat_hi < 0 ? int(muon_mats_.size()) : muon.mat_hi;
  if (muon.mat_lo < 0 || muon.mat_lo > hi || hi > int(muon_mats_.size()))
    throw std::invalid_argument("muon: matrix range out of bounds");
  Backend<T>& be = *backend_;
  // runs of matrices [j, j + count) of one shape, consecutive in memory (a tensor's layer slices, qkvw's q, k, v):
  // one batched Newton-Schulz and one update each
  struct Run {
    int j, count;
  };
  std::vector<Run> runs;
  for (int j = muon.mat_lo; j < hi; j++) {
    const MuonMatrix& x = muon_mats_[j];
    if (!runs.empty()) {
      const MuonMatrix& p = muon_mats_[runs.back().j + runs.back().count - 1];
      if (p.rows == x.rows && p.cols == x.cols && p.offset + size_t(p.rows) * p.cols == x.offset) {
        runs.back().count++;
        continue;
      }
    }
    runs.push_back({j, 1});
  }
  size_t need = 0;  // sized for every run of the whole model, so that a later range needs no new scratch
  for (size_t j = 0, c = 1; j < muon_mats_.size(); j += c) {
    const MuonMatrix& x = muon_mats_[j];
    for (c = 1; j + c < muon_mats_.size() && muon_mats_[j + c].rows == x.rows && muon_mats_[j + c].cols == x.cols &&
                muon_mats_[j + c].offset == x.offset + c * size_t(x.rows) * x.cols;
         c++) {
    }
    for (size_t b = 1; b <= c; b++) need = std::max(need, be.muon_batch_scratch_size(int(b), x.rows, x.cols));
  }
  if (need > muon_scratch_n_) {
    if (muon_scratch_) be.free_master(muon_scratch_);
    muon_scratch_ = be.alloc_master(need);
    muon_scratch_n_ = need;
  }
  for (const Run& r : runs) {
    const MuonMatrix& x = muon_mats_[r.j];
    M* u = grads_ + x.offset;
    GPT2CORE_TIMED("optimizer.muon_newton_schulz",
                   be.muon_orthogonalize_batch(u, muon_scratch_, r.count, x.rows, x.cols, muon.args.ns_steps,
                                               muon.args.ns_bf16));
    GPT2CORE_TIMED("optimizer.muon_apply",
                   be.muon_apply(params_ + x.offset, master_ ? master_ + x.offset : nullptr, u,
                                 size_t(r.count) * x.rows * x.cols, x.offset, muon.args.weight_decay,
                                 muon_scale(x.rows, x.cols)));
  }
}

template <typename T>
double GPT2Model<T>::muon_optimizer_step(float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                                         double grad_clip, const MuonStep& muon) {
  require_no_offload("muon_optimizer_step");
  require_unsharded("muon_optimizer_step");
  require_training("muon_optimizer_step");
  if (step < 1) throw std::invalid_argument("muon_optimizer_step: step counts from 1");
  ensure_optimizer_state();
  Backend<T>& be = *backend_;
  be.set_step_args(muon_step_args(lr, beta1, beta2, step, grad_clip, 0, muon));  // outside the graph: read at replay
  const std::vector<AdamWSegment> adam = adamw_segments(0, num_params_, weight_decay, 0);
  const std::vector<AdamWSegment> mom = adamw_segments(0, num_params_, 0.0f, 1);
  const bool scaling = loss_scaling_;
  muon_matrix_ops(MuonStep{muon.lr, muon.beta, muon.args, 0, 0});  // sizes the scratch outside any capture
  run_graphed(optimizer_graph_,
              {beta1, beta2, eps, weight_decay, double(scaling), 1.0, muon.args.weight_decay,
               double(muon.args.ns_steps), double(muon.args.nesterov), double(muon.mat_lo), double(muon.mat_hi),
               double(muon.args.ns_bf16)},
              [&] {
                GPT2CORE_TIMED("optimizer.grad_norm", be.grad_sum_squares(grads_, num_params_));
                adamw_ops(adam, beta1, beta2, eps);
                GPT2CORE_TIMED("optimizer.muon_momentum", be.muon_momentum(grads_, m_, 0, mom, muon.args.nesterov));
                muon_matrix_ops(muon);
                if (scaling) be.loss_scale_update();
              });
  const float carried = scaler_.scale;
  const double sumsq = read_step_result();
  return step_norm(sumsq, carried, step);
}

template <typename T>
void GPT2Model<T>::muon_update_range(size_t lo, size_t hi, M* m, M* v, float lr, float beta1, float beta2, float eps,
                                     float weight_decay, int step, double grad_clip, double sumsq,
                                     const MuonStep& muon) {
  fp8_stale_ = true;
  require_no_offload("muon_update_range");
  require_unsharded("muon_update_range");
  require_training("muon_update_range");
  if (step < 1) throw std::invalid_argument("muon_update_range: step counts from 1");
  if (lo > hi || hi > num_params_) throw std::invalid_argument("muon_update_range: bad range");
  backend_->set_step_args(muon_step_args(lr, beta1, beta2, step, grad_clip, sumsq, muon));
  backend_->adamw(params_ + lo, master_ ? master_ + lo : nullptr, grads_ + lo, m, v, lo,
                  adamw_segments(lo, hi, weight_decay, 0), beta1, beta2, eps);
  backend_->muon_momentum(grads_ + lo, m, lo, adamw_segments(lo, hi, 0.0f, 1), muon.args.nesterov);
  backend_->synchronize();  // the host all-gathers the updates next
}

template <typename T>
void GPT2Model<T>::muon_update_matrices(int step, double sumsq, const MuonStep& muon) {
  fp8_stale_ = true;
  require_no_offload("muon_update_matrices");
  require_unsharded("muon_update_matrices");
  // the step's values are muon_update_range's (set_step_args), read again by these ops
  require_training("muon_update_matrices");
  muon_matrix_ops(muon);
  if (loss_scaling_) backend_->loss_scale_update();  // from the sumsq every rank was given: the same decision
  read_step_result();
  if (std::isfinite(sumsq)) round_seed_ = uint32_t(step);
}
}  // namespace gpt2

#include "model/gpt2_infer.h"  // the KV-cache inference members

namespace gpt2 {

template class GPT2Model<float>;
template class GPT2Model<double>;
template class GPT2Model<bf16>;
template class GPT2Model<f16>;

}  // namespace gpt2
