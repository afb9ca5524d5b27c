// KV-cache inference for GPT2Model (declared in model/gpt2.h): prefill, decode and sampling over the Backend's
// ops. Part of gpt2.cpp (included at its end, ahead of the explicit instantiations, so that the class is
// instantiated once). The layer loop is forward_ops' (the same ops in the same order), with one layer's activations reused by
// every layer (nothing is kept for a backward) and attention_kv_forward in place of attention_forward.
#pragma once
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/gpt2.h"

namespace gpt2 {

template <typename T>
void GPT2Model<T>::set_weights16(int kind) {
  if (kind < 0 || kind > 3) throw std::invalid_argument("weights16: 0 (fp32), 1 (bf16), 2 (fp16) or 3 (int8)");
  if (kind == 3 && !backend_->has_q8())
    throw std::logic_error(std::string("backend ") + backend_->name() + " has no 8-bit-weight inference");
  if (kind && kind < 3 && !backend_->has_w16())
    throw std::logic_error(std::string("backend ") + backend_->name() + " has no 16-bit-weight inference");
  if (kind && training_)
    throw std::logic_error("16-bit and 8-bit weights are for inference-only models (training=False): they round the "
                           "weights");
  backend_->make_current();
  if (w16_ && (kind == 0 || kind == 3)) { backend_->free_u16(w16_); w16_ = nullptr; }
  if (kind != 3) free_q8();
  if ((kind == 1 || kind == 2) && !w16_) w16_ = backend_->alloc_u16(num_params_);
  if (kind == 3 && !q8_) {
    size_t nscales = 0;
    for (ParamTensor i : {kWte, kQkvw, kAttprojw, kFcw, kFcprojw, kLmHead}) {
      const size_t inner = q8_inner(i);
      q8_soff_[i] = nscales;
      nscales += sizes_[i] / inner * q8_blocks(inner);
    }
    q8_ = backend_->alloc_i8(num_params_);
    q8_scales_ = reinterpret_cast<float*>(backend_->alloc_i8(std::max<size_t>(nscales, 1) * sizeof(float)));
    q8_nscales_ = nscales;
  }
  w16_kind_ = kind;
  w16_stale_ = true;
  kv_refresh_w16();
}

template <typename T>
void GPT2Model<T>::kv_refresh_w16() {
  if (!w16_kind_ || !w16_stale_) return;
  for (ParamTensor i : {kWte, kQkvw, kAttprojw, kFcw, kFcprojw, kLmHead}) {
    if (!sizes_[i]) continue;
    if (w16_kind_ == 3)
      backend_->quantize_q8(q8_ + offsets_[i], q8_scales_ + q8_soff_[i], params_ + offsets_[i],
                            long(sizes_[i] / q8_inner(i)), q8_inner(i));
    else
      backend_->round_w16(w16_ + offsets_[i], params_ + offsets_[i], sizes_[i], w16_kind_ == 1);
  }
  w16_stale_ = false;
}

// With 16-bit / 8-bit weights every call, a decode step's or a prefill's, reads that copy (the backend's GEMV, whose
// arithmetic for one row does not depend on the other rows of the call): a row's logits are then the same bits
// whatever else is prefilled or decoded beside it, so that a seeded request's text does not depend on the load.
// (Prefill through the fp32 GEMM of the rounded weights was faster, but its rows' rounding depended on the call's
// row count, and int8's GEMV quantises its inputs where the GEMM does not.)
template <typename T>
void GPT2Model<T>::kv_matmul(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) {
  if (w16_kind_ == 3) {
    const size_t off = size_t(w - params_);
    for (ParamTensor i : {kWte, kQkvw, kAttprojw, kFcw, kFcprojw, kLmHead}) {
      if (!sizes_[i] || off < offsets_[i] || off >= offsets_[i] + sizes_[i]) continue;
      if (q8_inner(i) != C) throw std::logic_error("kv_matmul: 8-bit weights of another inner size");
      const size_t row0 = (off - offsets_[i]) / C;
      backend_->matmul_forward_q8(out, inp, q8_ + off, q8_scales_ + q8_soff_[i] + row0 * q8_blocks(C), bias, N, C,
                                  OC, q8_int_dot_);
      return;
    }
    throw std::logic_error("kv_matmul: not a quantised matrix");
  } else if (w16_kind_) {
    backend_->matmul_forward_w16(out, inp, w16_ + (w - params_), bias, N, C, OC, w16_kind_ == 1);
  } else {
    backend_->matmul_forward(out, inp, w, bias, N, C, OC);
  }
}

template <typename T>
void GPT2Model<T>::kv_release() {
  drop_graph(decode_graph_);  // it points into the buffers freed here
  if (w16_) { backend_->free_u16(w16_); w16_ = nullptr; }
  free_q8();
  Backend<T>& be = *backend_;
  if (kcache_) be.free(kcache_);
  if (vcache_) be.free(vcache_);
  if (kv_mem_) be.free(kv_mem_);
  if (kv_stats_) be.free_master(kv_stats_);
  for (int32_t** p : {&kv_ids_, &kv_slot_, &kv_posd_, &kv_gather_, &kv_targets_})
    if (*p) { be.free_i32(*p); *p = nullptr; }
  kcache_ = vcache_ = kv_mem_ = nullptr;
  kv_stats_ = nullptr;
  kv_S_ = kv_T_ = kv_cap_ = kv_logit_cap_ = kv_rows_ = 0;
  kv_mem_n_ = kv_stats_n_ = 0;
  kv_pos_.clear();
  kv_forward_ = false;
}

template <typename T>
void GPT2Model<T>::kv_reserve(int slots, int max_len) {
  if (slots <= 0 || max_len <= 0 || max_len > config_.max_seq_len)
    throw std::invalid_argument("kv_reserve: need slots > 0 and 0 < max_len <= max_seq_len (" +
                                std::to_string(config_.max_seq_len) + ")");
  if (!backend_->has_kv())
    throw std::logic_error(std::string("backend ") + backend_->name() + " has no KV-cache inference ops");
  if (slots <= kv_S_ && max_len <= kv_T_) return;
  backend_->make_current();  // the calling thread's device may be another (CUDA's current device is per thread)
  drop_graph(decode_graph_);
  slots = std::max(slots, kv_S_);
  max_len = std::max(max_len, kv_T_);
  Backend<T>& be = *backend_;
  const size_t L = size_t(config_.n_layer), C = size_t(config_.n_embd);
  const size_t n = L * slots * max_len * C;
  T* knew = be.alloc(n);
  T* vnew = nullptr;
  try {
    vnew = be.alloc(n);
  } catch (...) {
    be.free(knew);  // the old cache stays as it was
    throw;
  }
  // the live slots' rows move to the new layout (L, slots, max_len, C): row (l, s, t) of the new cache is row
  // (l, s, t) of the old one where that exists; the other rows are copied from row 0, garbage that no query reads
  // before a prefill or decode writes it (a slot's positions past kv_pos are never attended)
  const bool live = std::any_of(kv_pos_.begin(), kv_pos_.end(), [](int p) { return p > 0; });
  const size_t rows = L * slots * max_len;
  if (live && rows <= size_t(std::numeric_limits<int32_t>::max())) {
    std::vector<int32_t> idx(rows, 0);
    for (size_t l = 0; l < L; l++)
      for (int s = 0; s < kv_S_; s++)
        for (int t = 0; t < kv_pos_[s]; t++)
          idx[(l * slots + s) * max_len + t] = int32_t((l * kv_S_ + s) * kv_T_ + t);
    int32_t* didx = be.alloc_i32(rows);
    be.to_device_i32(didx, idx.data(), rows);
    be.gather_rows(knew, kcache_, didx, int(rows), int(C));
    be.gather_rows(vnew, vcache_, didx, int(rows), int(C));
    be.synchronize();
    be.free_i32(didx);
  } else if (live) {
    throw std::length_error("kv_reserve: a cache of " + std::to_string(rows) + " rows is too large to grow in place");
  }
  if (kcache_) be.free(kcache_);
  if (vcache_) be.free(vcache_);
  kcache_ = knew;
  vcache_ = vnew;
  kv_S_ = slots;
  kv_T_ = max_len;
  kv_pos_.resize(size_t(slots), 0);
  kv_forward_ = false;
}

template <typename T>
size_t GPT2Model<T>::kv_bytes() const {
  const size_t cache = 2 * size_t(config_.n_layer) * kv_S_ * kv_T_ * config_.n_embd * sizeof(T);
  return cache + kv_mem_n_ * sizeof(T) + kv_stats_n_ * sizeof(M) + 5 * size_t(kv_cap_) * sizeof(int32_t) +
         (w16_ ? num_params_ * sizeof(uint16_t) : 0) + (q8_ ? num_params_ + q8_nscales_ * sizeof(float) : 0);
}

// One layer's activations for `rows` token rows and logits for `logit_rows`, grown (never shrunk) as needed.
template <typename T>
void GPT2Model<T>::kv_ensure_rows(int rows, int logit_rows) {
  if (rows <= kv_cap_ && logit_rows <= kv_logit_cap_) return;
  drop_graph(decode_graph_);
  Backend<T>& be = *backend_;
  rows = std::max(rows, kv_cap_);
  logit_rows = std::max(logit_rows, kv_logit_cap_);
  if (kv_mem_) be.free(kv_mem_);
  if (kv_stats_) be.free_master(kv_stats_);
  for (int32_t** p : {&kv_ids_, &kv_slot_, &kv_posd_, &kv_gather_, &kv_targets_})
    if (*p) { be.free_i32(*p); *p = nullptr; }
  kv_mem_ = nullptr;
  kv_stats_ = nullptr;
  kv_cap_ = kv_logit_cap_ = 0;
  const size_t R = rows, C = config_.n_embd, Vp = config_.padded_vocab_size, LR = logit_rows;
  // x, ln, qkv (3C), atty, proj, res2, fch (4C), fch_gelu (4C), last (logit rows x C), logits
  const size_t sizes[] = {R * C, R * C, R * 3 * C, R * C, R * C, R * C, R * 4 * C, R * 4 * C, LR * C, LR * Vp};
  size_t total = 0;
  for (size_t k : sizes) total += k;
  kv_mem_ = be.alloc(total);
  kv_mem_n_ = total;
  T* p = kv_mem_;
  T** slots[] = {&kv_.x, &kv_.ln, &kv_.qkv, &kv_.atty, &kv_.proj, &kv_.res2, &kv_.fch, &kv_.fch_gelu, &kv_.last,
                 &kv_.logits};
  for (size_t i = 0; i < std::size(sizes); i++) { *slots[i] = p; p += sizes[i]; }
  // mean, rstd per row; losses, lse per logit row; QK-norm's rstd per row and q / k head
  const size_t QK = config_.qk_norm ? R * 2 * config_.n_head : 0;
  kv_stats_n_ = 2 * R + 2 * LR + QK;
  kv_stats_ = be.alloc_master(kv_stats_n_);
  kv_.mean = kv_stats_;
  kv_.rstd = kv_stats_ + R;
  kv_.losses = kv_stats_ + 2 * R;
  kv_.lse = kv_stats_ + 2 * R + LR;
  kv_.qk_rstd = kv_stats_ + 2 * R + 2 * LR;
  kv_ids_ = be.alloc_i32(R);
  kv_slot_ = be.alloc_i32(R);
  kv_posd_ = be.alloc_i32(R);
  kv_gather_ = be.alloc_i32(R);
  kv_targets_ = be.alloc_i32(LR);
  kv_cap_ = rows;
  kv_logit_cap_ = logit_rows;
}

// forward_ops' loop over one layer's buffers: for l, x <- x + attn(norm1(x)), then x <- x + mlp(norm2(x)), with
// the config's ops in forward_ops' order (norm: LayerNorm or RMSNorm; q and k rotated at each row's own position,
// then QK-normed, before their K goes into the cache; GELU or ReLU^2; null biases); the norm that follows each
// residual add is fused into it, as in forward_ops; kv_.ln ends as the final norm of x.
template <typename T>
void GPT2Model<T>::kv_layers(int n, int Tq) {
  Backend<T>& be = *backend_;
  const ModelConfig& c = config_;
  const int L = c.n_layer, C = c.n_embd, NH = c.n_head;
  const int N = n * Tq;
  const bool rope = c.position == ModelConfig::Position::Rope, relu2 = c.activation == ModelConfig::Activation::Relu2;
  const size_t cache_layer = size_t(kv_S_) * kv_T_ * C;
  be.encoder_forward_at(kv_.x, kv_ids_, param(kWte), param(kWpe), kv_posd_, n, Tq, C);  // wpe null with rope
  const LayerTensors<T> first = layer(params_, 0);
  norm_forward(kv_.ln, kv_.mean, kv_.rstd, kv_.x, first.ln1w, first.ln1b, N);
  for (int l = 0; l < L; l++) {
    const LayerTensors<T> p = layer(params_, l);
    kv_matmul(kv_.qkv, kv_.ln, p.qkvw, p.qkvb, N, C, 3 * C);
    if (rope) be.rope_forward_at(kv_.qkv, kv_posd_, n, Tq, C, NH, c.rope_base);
    if (c.qk_norm) be.qk_norm_forward(kv_.qkv, kv_.qk_rstd, n, Tq, C, NH);
    be.attention_kv_forward(kv_.atty, kcache_ + l * cache_layer, vcache_ + l * cache_layer, kv_.qkv, kv_slot_,
                            kv_posd_, n, Tq, C, NH, kv_T_);
    kv_matmul(kv_.proj, kv_.atty, p.attprojw, p.attprojb, N, C, C);
    residual_norm_forward(kv_.res2, kv_.ln, kv_.mean, kv_.rstd, kv_.x, kv_.proj, p.ln2w, p.ln2b, N);
    if (w16_kind_) {  // the activation after the 16/8-bit GEMV (the fused ops read fp32 weights)
      kv_matmul(kv_.fch, kv_.ln, p.fcw, p.fcb, N, C, 4 * C);
      if (relu2) be.relu2_forward(kv_.fch_gelu, kv_.fch, size_t(N) * 4 * C);
      else be.gelu_forward(kv_.fch_gelu, kv_.fch, size_t(N) * 4 * C);
    } else if (relu2) {
      be.matmul_relu2_forward(kv_.fch, kv_.fch_gelu, kv_.ln, p.fcw, p.fcb, N, C, 4 * C);
    } else {
      be.matmul_gelu_forward(kv_.fch, kv_.fch_gelu, kv_.ln, p.fcw, p.fcb, N, C, 4 * C);
    }
    kv_matmul(kv_.proj, kv_.fch_gelu, p.fcprojw, p.fcprojb, N, 4 * C, C);
    const T* nw = l + 1 < L ? layer(params_, l + 1).ln1w : param(kLnfw);
    const T* nb = l + 1 < L ? layer(params_, l + 1).ln1b : param(kLnfb);
    residual_norm_forward(kv_.x, kv_.ln, kv_.mean, kv_.rstd, kv_.res2, kv_.proj, nw, nb, N);
  }
}

// The head over `rows` rows of `in` into kv_.logits (the untied lm_head or wte), soft-capped as forward caps them.
template <typename T>
void GPT2Model<T>::kv_head(const T* in, int rows) {
  const int C = config_.n_embd, Vp = config_.padded_vocab_size;
  kv_matmul(kv_.logits, in, param(head()), nullptr, rows, C, Vp);
  if (config_.logit_softcap > 0) backend_->softcap_forward(kv_.logits, config_.logit_softcap, size_t(rows) * Vp);
}

template <typename T>
void GPT2Model<T>::kv_prefill(const int32_t* tokens, const int32_t* lengths, const int32_t* slots, int n, int Tq,
                              bool all_logits, const int32_t* start) {
  if (n <= 0 || Tq <= 0) throw std::invalid_argument("kv_prefill: need at least one sequence of one token");
  backend_->make_current();
  if (!kv_S_) throw std::logic_error("kv_prefill: no KV cache (kv_reserve first)");
  if (Tq > kv_T_)
    throw std::invalid_argument("kv_prefill: " + std::to_string(Tq) + " tokens do not fit the cache's " +
                                std::to_string(kv_T_) + " positions");
  std::vector<int32_t> seen(kv_S_, 0), rows(n), pos(n, 0);
  for (int i = 0; i < n; i++) {
    if (slots[i] < 0 || slots[i] >= kv_S_) throw std::invalid_argument("kv_prefill: slot out of range");
    if (seen[slots[i]]++) throw std::invalid_argument("kv_prefill: a slot appears twice");
    if (lengths[i] < 1 || lengths[i] > Tq) throw std::invalid_argument("kv_prefill: lengths must be in [1, T]");
    if (start) {
      pos[i] = start[i];
      if (pos[i] < 0 || pos[i] > kv_pos_[slots[i]])
        throw std::invalid_argument("kv_prefill: start " + std::to_string(pos[i]) + " of slot " +
                                    std::to_string(slots[i]) + " is outside [0, kv_pos=" +
                                    std::to_string(kv_pos_[slots[i]]) + "]");
      if (pos[i] + Tq > kv_T_)
        throw std::invalid_argument("kv_prefill: start " + std::to_string(pos[i]) + " + T " + std::to_string(Tq) +
                                    " runs past the cache's " + std::to_string(kv_T_) + " positions");
    }
    rows[i] = i * Tq + lengths[i] - 1;
  }
  const int N = n * Tq;
  const int logit_rows = all_logits ? N : n;
  kv_ensure_rows(N, logit_rows);
  Backend<T>& be = *backend_;
  refresh_params();
  kv_refresh_w16();
  be.to_device_i32(kv_ids_, tokens, size_t(N));
  be.to_device_i32(kv_slot_, slots, size_t(n));
  be.to_device_i32(kv_posd_, pos.data(), size_t(n));
  kv_layers(n, Tq);
  if (all_logits) {
    kv_head(kv_.ln, N);
  } else {
    be.to_device_i32(kv_gather_, rows.data(), size_t(n));
    be.gather_rows(kv_.last, kv_.ln, kv_gather_, n, config_.n_embd);
    kv_head(kv_.last, n);
  }
  for (int i = 0; i < n; i++) kv_pos_[slots[i]] = pos[i] + lengths[i];
  kv_rows_ = logit_rows;
  kv_forward_ = false;
}

template <typename T>
void GPT2Model<T>::kv_decode(const int32_t* tokens, const int32_t* slots, int n) {
  if (n <= 0) throw std::invalid_argument("kv_decode: need at least one sequence");
  backend_->make_current();
  if (!kv_S_) throw std::logic_error("kv_decode: no KV cache (kv_reserve first)");
  std::vector<int32_t> seen(kv_S_, 0), pos(n);
  for (int i = 0; i < n; i++) {
    if (slots[i] < 0 || slots[i] >= kv_S_) throw std::invalid_argument("kv_decode: slot out of range");
    if (seen[slots[i]]++) throw std::invalid_argument("kv_decode: a slot appears twice");
    pos[i] = kv_pos_[slots[i]];
    if (pos[i] >= kv_T_)
      throw std::out_of_range("kv_decode: slot " + std::to_string(slots[i]) + " is full (" + std::to_string(kv_T_) +
                              " positions): prefill its last tokens again");
    if (pos[i] == 0) throw std::logic_error("kv_decode: slot " + std::to_string(slots[i]) + " was never prefilled");
  }
  kv_ensure_rows(n, n);
  Backend<T>& be = *backend_;
  refresh_params();
  kv_refresh_w16();
  be.to_device_i32(kv_ids_, tokens, size_t(n));
  be.to_device_i32(kv_slot_, slots, size_t(n));
  be.to_device_i32(kv_posd_, pos.data(), size_t(n));
  // With graphs on (set_graphs), the step's ops replay from a CUDA graph: they read the tokens, slots and
  // positions just copied into kv_ids_ / kv_slot_ / kv_posd_ (fixed buffers), so one graph per batch size serves
  // every step; the key holds what the graph's pointers and sizes depend on. Rotary models run directly:
  // rope_forward_at sizes its table on the host from the positions (a host read, which capture forbids).
  const auto ops = [&] {
    kv_layers(n, 1);
    kv_head(kv_.ln, n);
  };
  if (config_.position == ModelConfig::Position::Rope) {
    ops();
  } else {
    const auto addr = [](const void* p) { return double(reinterpret_cast<uintptr_t>(p)); };
    run_graphed(decode_graph_, {double(n), double(kv_S_), double(kv_T_), double(w16_kind_), addr(kcache_),
                                addr(kv_mem_), addr(params_), addr(w16_), addr(q8_), double(q8_int_dot_)}, ops);
  }
  for (int i = 0; i < n; i++) kv_pos_[slots[i]]++;
  kv_rows_ = n;
  kv_forward_ = false;
}

template <typename T>
void GPT2Model<T>::kv_free(int slot) {
  if (slot < 0 || slot >= kv_S_) throw std::invalid_argument("kv_free: slot out of range");
  kv_pos_[slot] = 0;
}

template <typename T>
void GPT2Model<T>::kv_sample(int32_t* ids, const SampleRow* rows, int n) {
  if (n != kv_rows_ || n <= 0)
    throw std::invalid_argument("kv_sample: " + std::to_string(n) + " settings for " + std::to_string(kv_rows_) +
                                " rows of logits (one per sequence of the last prefill / decode)");
  backend_->make_current();
  backend_->sample_tokens(ids, kv_.logits, rows, n, config_.vocab_size, config_.padded_vocab_size);
}

template <typename T>
void GPT2Model<T>::kv_logits_to_host(M* dst) const {
  if (!kv_rows_) throw std::runtime_error("kv_logits: no prefill or decode has run yet");
  backend_->make_current();
  const size_t n = size_t(kv_rows_) * config_.padded_vocab_size;
  if constexpr (kHasMasterCopy<T>) {
    std::vector<T> tmp(n);
    backend_->to_host(tmp.data(), kv_.logits, n);
    for (size_t i = 0; i < n; i++) dst[i] = widen(tmp[i]);
  } else {
    backend_->to_host(dst, kv_.logits, n);
  }
}

// forward() of an inference-only model: a prefill of B sequences of Tn tokens with every position's logits, then
// the loss over them as forward computes it.
template <typename T>
double GPT2Model<T>::kv_forward(const int32_t* inp, const int32_t* targets, int B, int Tn,
                                const int32_t* kv_slots) {
  std::vector<int32_t> lengths(B, Tn), slots(B);
  int top = B;
  for (int b = 0; b < B; b++) {
    slots[b] = kv_slots ? kv_slots[b] : b;
    if (slots[b] < 0) throw std::invalid_argument("forward: slots must be >= 0");
    top = std::max(top, slots[b] + 1);
  }
  kv_reserve(std::max(top, kv_S_), std::max(Tn, kv_T_));
  kv_prefill(inp, lengths.data(), slots.data(), B, Tn, true);
  Backend<T>& be = *backend_;
  const int N = B * Tn, V = config_.vocab_size, Vp = config_.padded_vocab_size;
  if (targets) be.to_device_i32(kv_targets_, targets, size_t(N));
  be.crossentropy_forward(kv_.losses, kv_.lse, kv_.logits, targets ? kv_targets_ : nullptr, n_valid_dev_, N, V, Vp);
  B_ = B;
  T_ = Tn;
  kv_forward_ = true;
  have_targets_ = false;
  if (!targets) return std::numeric_limits<double>::quiet_NaN();
  long valid = 0;
  for (int i = 0; i < N; i++) valid += targets[i] >= 0;
  std::vector<M> losses(N);
  be.to_host_master(losses.data(), kv_.losses, N);
  double sum = 0;
  for (int i = 0; i < N; i++) sum += double(losses[i]);
  return valid ? sum / double(valid) : std::numeric_limits<double>::quiet_NaN();
}

}  // namespace gpt2
