// GPT-2, backend-neutral: buffer layout, the layer loop (forward and backward) and the optimizer
// policy. The backend supplies memory and the ops. T is the storage type (float; double in tests).
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/backend.h"
#include "model/config.h"
#include "model/optimizer.h"

namespace gpt2 {

// Activations for one (B, T): the T-typed ones are slices of one allocation, the per-row statistics
// (Master<T>: layernorm mean/rstd, attention state, losses, logsumexps) slices of a second one.
template <typename T>
struct Activations {
  using M = Master<T>;
  T *encoded, *ln1, *qkv, *atty, *attproj, *residual2, *ln2, *fch, *fch_gelu, *fcproj, *residual3, *lnf, *logits;
  // (RMSNorm keeps only the rstds: the means have no room; qk_rstd (L, B*T, 2NH) only with qk_norm)
  M *ln1_mean, *ln1_rstd, *att, *ln2_mean, *ln2_rstd, *lnf_mean, *lnf_rstd, *losses, *lse, *qk_rstd;
  // backward scratch (not kept between steps)
  T *dres, *dln, *datty, *dqkv, *dfch, *dfch_gelu;
};

// What backward rebuilds instead of keeping it from forward (--recompute):
//   None:  every layer's activations are kept;
//   Gelu:  one activation-output buffer (B, T, 4C), refilled per layer from the kept pre-activation;
//   Layer: only each block's input (the residual stream between blocks) and what the loss needs (final norm,
//          logits) are kept; one block's activations are laid out once and backward runs the block's forward
//          again, one block at a time, just before its backward. The forward is deterministic, so the rebuilt
//          activations, and so the gradients, have the same bits as without recompute.
enum class Recompute { None, Gelu, Layer };

// Element counts of the activation buffers for (B, Tn): the T-typed ones (the logits separately) and the Master<T>
// ones (statistics), from the same layout the model allocates (activation_slots). att_size: the backend's
// attention state per layer (Backend::attention_state_size). For the memory plan, which allocates nothing.
struct ActivationCounts {
  size_t t = 0, logits = 0, m = 0;
};
ActivationCounts activation_counts(const ModelConfig& c, int B, int Tn, size_t att_size, Recompute r);

// One layer's slice of each per-layer tensor, by name (as llm.c's ParameterTensors): of the parameters (P = T) or
// of their gradients (P = Master<T>). A tensor the config does not have is null.
template <typename P>
struct LayerTensors {
  P *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
};

// One op's share of the profiled steps (GPT2Model::set_profile): its name ("forward.attention", ...), the seconds
// summed over its calls, and the calls.
struct OpTime {
  std::string name;
  double seconds = 0;
  long calls = 0;
};

// Flat gradient ranges [lo, hi) (offsets into grads()) and the callback backward reports them to.
using GradRanges = std::vector<std::pair<size_t, size_t>>;
using GradReadyHook = std::function<void(const GradRanges&)>;

template <typename T>
class GPT2Model {
 public:
  using M = Master<T>;
  // training = false: an inference-only model (no gradients, AdamW moments or backward activations; forward runs
  // through the KV-cache path, see kv_prefill; backward and the optimizer throw).
  GPT2Model(const ModelConfig& config, std::unique_ptr<Backend<T>> backend, bool training = true);
  ~GPT2Model();
  GPT2Model(const GPT2Model&) = delete;
  GPT2Model& operator=(const GPT2Model&) = delete;

  const ModelConfig& config() const { return config_; }
  Backend<T>& backend() { return *backend_; }
  size_t num_parameters() const { return num_params_; }
  const std::array<size_t, kNumParamTensors>& param_offsets() const { return offsets_; }

  // The parameters as the optimizer and the user see them: the master weights (the ops' own parameters when
  // M == T). With a separate bf16 copy, call params_changed() after writing them from outside.
  M* params() {
    if constexpr (kHasMasterCopy<T>) return master_;
    else return params_;
  }
  M* grads() { return grads_; }
  M* adam_m() { ensure_optimizer_state(); return m_; }
  M* adam_v() { ensure_optimizer_state(); return v_; }
  // The master weights were written from outside (init, checkpoint load, a collective): the ops' copy is
  // rebuilt from them before the next forward, rounded with param_round_seed() (no-op when M == T).
  void params_changed() {
    params_stale_ = kHasMasterCopy<T>;
    w16_stale_ = true;
    fp8_stale_ = true;
    host_master_stale_ = offload_ && !kHasMasterCopy<T>;  // an fp32 model's weights: the host copy is re-read
  }
  // Seed of the stochastic rounding that produced the ops' copy: the step of the last AdamW update (0: round
  // to nearest). A resumed run sets it to its step so the rebuilt copy has the same bits as a run that never
  // stopped.
  uint32_t param_round_seed() const { return round_seed_; }
  void set_param_round_seed(uint32_t seed) { round_seed_ = seed; params_changed(); }
  // bytes of the activations for (B, Tn), without allocating them
  size_t activation_bytes_for(int B, int Tn);
  // what backward recomputes instead of keeping (Recompute); a change lays the activations out again
  void set_recompute(Recompute r);
  Recompute recompute() const { return recompute_; }
  // the Gelu level's old switch: on = Gelu, off = None
  void set_recompute_gelu(bool on) { set_recompute(on ? Recompute::Gelu : Recompute::None); }
  bool recompute_gelu() const { return recompute_ == Recompute::Gelu; }

  // inp, targets: host arrays of B*Tn ints, already validated (ids in range, targets -1 or in range).
  // Returns the mean loss over non-ignored targets (NaN without targets). An inference-only model runs it as a
  // prefill into KV-cache slots kv_slots[0..B) (nullptr: 0..B-1), the caller's scratch slots.
  double forward(const int32_t* inp, const int32_t* targets, int B, int Tn, const int32_t* kv_slots = nullptr);
  // Copies logits (B, Tn, Vp) and per-token losses of the last forward to the host.
  void logits_to_host(M* dst) const;
  void losses_to_host(M* dst) const;
  // Accumulates gradients of (grad_scale * mean loss) into grads(). Needs a forward with targets.
  // With report_grads (and a hook set), backward calls the grad-ready hook each time a group of gradient ranges
  // is final, in backend stream order (the ops that wrote them are enqueued, not necessarily finished: a
  // device backend's consumer orders itself after them, see Backend::native_stream): lnfw, lnfb (and an untied
  // lm_head) after the final norm; layer l's slices (ln1w..fcprojb) after its backward, from the last layer down;
  // wte, wpe last (wte also holds a tied lm_head's gradient). Every gradient value is in exactly one range, once
  // per call; tensors the config does not have give no range.
  void backward(float grad_scale, bool report_grads = false);
  // Installs the grad-ready hook (empty: none) and returns the previous one; the hook runs on the thread that
  // calls backward. Only backward(..., report_grads=true) calls it.
  GradReadyHook set_grad_ready_hook(GradReadyHook hook) { return std::exchange(grad_hook_, std::move(hook)); }

  // ---- ZeRO-2: the gradients sharded over the ranks of a data-parallel run.
  // set_grad_shard(lo, hi): this model keeps only the gradients of flat [lo, hi) (its rank's shard, as ZeRO-1's),
  // plus three bucket buffers that backward writes into instead of a full gradient buffer: one layer's slices
  // (reused from layer to layer), the head's (lnfw, lnfb, an untied lm_head) and the embeddings' (wte, wpe; wte
  // also takes a tied head's gradient at the start of backward). Each time a bucket is final, backward hands it to
  // the bucket hook (packed: the group's ranges in flat order, back to back) and reuses the buffer when the hook
  // returns; the hook reduces it over the ranks and folds this rank's part in with accumulate_grad_shard. The full
  // gradient buffer is freed. (0, num_parameters()) goes back to one full buffer. A sharded model's backward needs
  // the hook, and the full-model optimizer steps refuse (adamw_update_range over the shard is ZeRO's step).
  using BucketHook = std::function<void(M* bucket, const GradRanges& ranges)>;
  void set_grad_shard(size_t lo, size_t hi);
  bool grad_sharded() const { return grad_sharded_; }
  size_t grad_shard_lo() const { return grad_lo_; }
  size_t grad_shard_hi() const { return grad_hi_; }
  BucketHook set_grad_bucket_hook(BucketHook hook) { return std::exchange(bucket_hook_, std::move(hook)); }
  // The shard's [flat_lo, flat_lo + n) += src[0..n) (backend memory), in stream order; the first backward after
  // zero_grad copies instead (the shard then holds exactly what that backward's buckets reduced to, as a full
  // gradient buffer holds 0 + its first backward).
  void accumulate_grad_shard(const M* src, size_t flat_lo, size_t n);
  // values of the three bucket buffers (0 when not sharded): the memory plan's "largest bucket in flight"
  size_t grad_bucket_values() const { return bucket_n_[0] + bucket_n_[1] + bucket_n_[2]; }

  // ---- Optimizer offload (--offload optimizer; backends with has_offload: CUDA). On: the fp32 master weights (an
  // fp32 model: a host copy of its weights) and the AdamW moments move to pinned host memory, and optimizer_step
  // sums the gradients' squares on the device as always, copies the gradients to the host, runs AdamW there
  // (Backend::adamw_host: the kernel's own per-value arithmetic) and writes the storage-type weights back: the bits
  // of the device update. The device keeps the weights it computes with and the gradients. With ZeRO-1/2,
  // adamw_update_range does the same for the rank's range, its moments in pinned memory too (dist.alloc_state);
  // the caller then gathers the other ranks' new master weights. AdamW only (Muon refuses); off moves everything
  // back.
  void set_offload(bool on);
  bool offload() const { return offload_; }
  // Offloaded: the next backward (or forward_backward) is the optimizer step's last micro-step, so each group of
  // gradients it finishes is final: copy it to the host then (a copy stream, overlapped with the rest of backward),
  // and the offloaded update skips its own copy. One process: optimizer_step; ZeRO-2: each part of the shard once
  // the bucket hook folded it in (accumulate_grad_shard), for adamw_update_range over the shard. Not inside a CUDA
  // graph (that micro-step runs directly). grad_prefetches: the backwards that did so.
  void prefetch_grads();
  // ZeRO with offload, a 16-bit model (DataParallel's staged gather): flat [lo, lo + n) of the host master weights
  // out to dst (backend memory), and another rank's new values in from src (backend memory): into the host master,
  // and cast into the weights the ops read with the rounding a full rebuild would use (param_round_seed()).
  void offload_chunk_out(size_t lo, M* dst, size_t n) const;
  void offload_chunk_in(size_t lo, const M* src, size_t n);
  long grad_prefetches() const { return grad_prefetches_; }
  // A training step with no host round trip until its end: forward_backward per micro-step, then optimizer_step.
  //
  // forward_backward: forward(inp, targets) and backward(grad_scale) in one call, the mean loss times grad_scale
  // added to an accumulator in backend memory (take_loss()). Gradients accumulate into grads() as with
  // backward(); the ops may still be running when it returns (optimizer_step, grad_norm and take_loss wait).
  void forward_backward(const int32_t* inp, const int32_t* targets, int B, int Tn, float grad_scale);
  // The loss accumulated by forward_backward since the last call (0 if none), and resets it.
  double take_loss();
  // optimizer_step: the global gradient norm, clipping to grad_clip (0: none) and AdamW, all in backend memory;
  // returns the pre-clip norm (unscaled). A non-finite norm leaves weights and moments untouched (and is returned);
  // with loss scaling that is a skipped step, and the scaler backs off (see set_loss_scaling).
  double optimizer_step(float lr, float beta1, float beta2, float eps, float weight_decay, int step, double grad_clip);
  // Dynamic loss scaling (LossScaler, model/optimizer.h: PyTorch GradScaler's rule), off by default. On, every
  // backward multiplies the loss gradient by the scale in backend memory, so grads() hold scale * the gradients
  // (as PyTorch's .grad before GradScaler.unscale_); the optimizer divides it out (clipping by the unscaled norm)
  // and then steps the scaler on the device: a step with non-finite gradients writes nothing and halves the
  // scale, `interval` clean steps in a row double it. `state` is where the scaler starts (a new run: scale = the
  // initial scale, clean = skipped = 0; a resumed one: the saved state). Off, the scale is 1 and never changes.
  // The host's copy, loss_scaler(), is refreshed by the read that ends each optimizer step (no extra round trip).
  void set_loss_scaling(bool on, const LossScaler& state = LossScaler{});
  bool loss_scaling() const { return loss_scaling_; }
  const LossScaler& loss_scaler() const { return scaler_; }
  // With graphs on and a backend that can capture (CUDA), each of the two runs from a CUDA graph: the first call
  // for a shape (forward_backward: B, Tn, grad_scale; optimizer_step: beta1, beta2, eps, weight_decay) runs the
  // ops directly, which also sizes every scratch buffer; the second records them into a graph and launches it;
  // later calls replay it. A micro-step is then one launch instead of ~25 per layer. If a capture fails, graphs
  // turn themselves off (graphs() is then false) with a message on stderr, and the ops run directly.
  // kv_decode's step is graphed the same way, keyed on its batch and buffers (its tokens, slots and positions are
  // read from device memory, so one graph serves every step), except for rotary models (their table is sized on
  // the host from the positions: they run directly).
  void set_graphs(bool on);
  bool graphs() const { return graphs_; }
  // Graphs recorded and replays of them so far (for tests and benchmarks).
  long graph_captures() const { return graph_captures_; }
  long graph_replays() const { return graph_replays_; }
  // Per-op timing of training steps (scripts/bench.py --profile), opt-in: off (the default), each op costs one
  // branch. On, every op of forward, backward and the optimizer runs between two Backend::synchronize() calls and
  // is timed on the host's steady clock (a GPU's queue drained before and after: its ops are timed one by one, at
  // the cost of the overlap a real step has), nothing runs from a CUDA graph, and op_profile() holds the seconds
  // and calls per op name since set_profile(true) (which clears them), in the order the ops first ran. Names are
  // "<phase>.<op>" with phase forward, loss (the cross-entropy with its soft-cap, forward and backward fused),
  // backward or optimizer; AdamW is timed per tensor group (optimizer.adamw.embedding / .head / .rest).
  void set_profile(bool on);
  bool profile() const { return profile_; }
  const std::vector<OpTime>& op_profile() const { return op_times_; }
  void zero_grad();
  // The host-synchronous forms of the optimizer's device ops (each the ops plus one read of the sum of squares):
  // of flat gradients [lo, hi) as they are in memory (with loss scaling: scaled), accumulated in double
  double grad_sum_squares(size_t lo, size_t hi);
  double grad_norm();  // global L2 norm of all gradients (unscaled)
  // AdamW with the gradients multiplied by grad_scale (and divided by the loss scale), no clipping.
  void adamw_update(float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale);
  // AdamW over the flat parameter range [lo, hi) only (ZeRO-1: this rank's shard), with the same per-tensor
  // weight-decay policy as adamw_update and the gradients multiplied by grad_scale * clip_factor(sumsq,
  // grad_clip) (model/optimizer.h; sumsq: of all gradients, every rank's shard; nothing is written when it is
  // not finite). m and v are the shard's moments: hi - lo values each in backend memory, owned by the caller;
  // the model's own adam_m()/adam_v() are not touched (nor allocated). With loss scaling, sumsq is of the scaled
  // gradients and the scaler then steps from it: every rank passes the same all-reduced sumsq, so every rank
  // takes the same skip decision.
  void adamw_update_range(size_t lo, size_t hi, M* m, M* v, float lr, float beta1, float beta2, float eps,
                          float weight_decay, int step, float grad_scale, double grad_clip, double sumsq);
  // Muon (model/optimizer.h) for the Muon tensors (param_uses_muon), AdamW for the rest, each with its own lr and
  // weight decay. The momentum lives where AdamW's first moment would (adam_m()'s slots of the Muon tensors; their
  // adam_v() slots stay unused), so checkpoints and ZeRO-1 shards carry it as they carry the moments. The Muon ops
  // write the update over the gradients (grads() afterwards hold the orthogonalised update of the Muon tensors).
  // MuonStep: this step's Muon values and the matrices (indices [mat_lo, mat_hi) of muon_matrices()) orthogonalised
  // and applied here; mat_hi < 0 means all. Data parallel: every rank updates the momentum it holds, orthogonalises
  // its share of the matrices, and the results are all-gathered by the caller.
  // embedding_lr, head_lr: the AdamW LR of the embedding and head groups (LrGroup, model/optimizer.h); < 0: the
  // AdamW lr of the step, as the rest.
  struct MuonStep {
    float lr = 0.02f, beta = kMuonBeta;
    MuonArgs args;
    int mat_lo = 0, mat_hi = -1;
    float embedding_lr = -1.0f, head_lr = -1.0f;
  };
  const std::vector<MuonMatrix>& muon_matrix_list() const { return muon_mats_; }
  // optimizer_step with Muon: the global norm and clip as optimizer_step; AdamW (lr, weight_decay) on the AdamW
  // tensors; Muon's momentum on every Muon tensor; orthogonalisation and update of the step's matrices.
  double muon_optimizer_step(float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                             double grad_clip, const MuonStep& muon);
  // ZeRO-1 with Muon, in two calls around the caller's all-gather of the gradient buffer:
  //   muon_update_range: over flat [lo, hi) (m, v: that range's state, as adamw_update_range), AdamW on the AdamW
  //     tensors' parts and Muon's momentum on the Muon tensors' parts (the update written over grads()[lo, hi));
  //   muon_update_matrices: after every rank's update was all-gathered into grads(), orthogonalise and apply the
  //     step's matrices, then step the loss scaler. Nothing is written when sumsq is not finite.
  void muon_update_range(size_t lo, size_t hi, M* m, M* v, float lr, float beta1, float beta2, float eps,
                         float weight_decay, int step, double grad_clip, double sumsq, const MuonStep& muon);
  void muon_update_matrices(int step, double sumsq, const MuonStep& muon);
  bool training() const { return training_; }

  // ---- KV-cache inference (model/gpt2_infer.h): the same per-layer ops as forward, over a cache of K and V per
  // layer (S slots x maxT positions x C, in backend memory) and one layer's activations at a time.
  // A sequence lives in a slot; its positions are kept here (kv_pos). Batches mix lengths by per-sequence
  // positions: each row carries its own start position into the encoder and the attention, so no padding
  // is attended and no mask is needed (prefill pads rows on the right only, into cache positions that a
  // later decode overwrites before any query reaches them).
  //
  // kv_reserve: a cache for `slots` sequences of up to max_len tokens (<= max_seq_len); a larger one replaces it,
  // keeping every slot's cached positions (a live sequence continues as if nothing happened), a smaller or equal
  // request keeps it.
  void kv_reserve(int slots, int max_len);
  int kv_slots() const { return kv_S_; }
  int kv_max_len() const { return kv_T_; }
  int kv_pos(int slot) const { return kv_pos_.at(slot); }
  size_t kv_bytes() const;  // cache + inference activations now allocated
  // Prefill: n sequences (tokens (n, Tq), host), row i's first lengths[i] ids real (the rest any ids), into slots
  // slots[i] from position start[i] (null: 0); afterwards kv_pos(slot) = start[i] + lengths[i]. A start above 0
  // extends a running cache (a prompt prefilled in chunks, the server's scheduler): it must be at most
  // kv_pos(slot) (positions up to it hold that sequence's K and V), and start[i] + Tq at most kv_max_len (the
  // padded rows are written too). Logits into the inference logits buffer: of each row's last real position
  // (n, Vp), or with all_logits of every position (n * Tq, Vp).
  void kv_prefill(const int32_t* tokens, const int32_t* lengths, const int32_t* slots, int n, int Tq,
                  bool all_logits = false, const int32_t* start = nullptr);
  // Decode: one token per sequence (n), at position kv_pos(slot) (< kv_max_len), then kv_pos += 1; logits (n, Vp).
  void kv_decode(const int32_t* tokens, const int32_t* slots, int n);
  // Release a slot: its positions are forgotten (kv_pos = 0) and it takes a new sequence by a prefill from 0.
  void kv_free(int slot);
  // One id per row of the last prefill/decode's logits (rows: n settings, n = that call's sequences), to the host.
  void kv_sample(int32_t* ids, const SampleRow* rows, int n);
  int kv_logit_rows() const { return kv_rows_; }
  // Decode with 16-bit or 8-bit weights (0: off, fp32; 1: bf16; 2: fp16, backends with has_w16; 3: int8, backends
  // with has_q8, Backend::quantize_q8): the matrices (wte, qkvw, attprojw, fcw, fcprojw, an untied lm_head) are
  // rounded to that type, in the fp32 parameters too (the forward reads the same weights), and prefill and decode
  // read the 16-bit / 8-bit copy (each row's logits independent of the batch: kv_matmul). Written parameters
  // (params_changed) are rounded again before the next prefill / decode.
  void set_weights16(int kind);
  int weights16() const { return w16_kind_; }
  // int8 decode: true (default) quantises each GEMV's input rows per block too and takes integer dot products
  // (Backend::matmul_forward_q8's int_dot); false widens the int8 weights to fp32 against the fp32 inputs.
  bool q8_int_dot() const { return q8_int_dot_; }
  void set_q8_int_dot(bool v) { q8_int_dot_ = v; }
  void kv_logits_to_host(M* dst) const;  // (kv_logit_rows(), Vp)

  // ---- FP8 Linear layers (precision fp8, issue 49; the Backend's FP8 ops, model/fp8.h). On, the four Linear layers
  // of every block (qkv, attention projection, MLP up and down) -- and with head the lm_head -- multiply in FP8:
  // e4m3 inputs and weights forward, e5m2 output gradients backward, per-tensor current scales, fp32 accumulation;
  // norms, attention, the activation, the loss and the optimizer stay in the model's precision (bf16 mixed
  // precision on the GPU). The weights' e4m3 copy (and its transpose) is made once per optimizer step: by the first
  // forward after the weights changed (an update, params_changed), never per micro-step. Backward quantises each
  // Linear's kept input again (the same bits as forward: the quantisation is a function of the tensor) instead of
  // keeping an fp8 copy per layer. The MLP's activation runs as its own op after the FP8 up-projection. Needs a
  // backend with the FP8 ops (a bf16 CUDA model on sm_89 / sm_90, or the CPU reference), n_embd a multiple of 16
  // (with head also padded_vocab_size), and B * T a multiple of 16 at each training forward (cuBLASLt's FP8 kernels).
  // KV-cache inference stays in the model's precision. Current scaling keeps no amax history, so resuming needs
  // nothing beyond the weights to stay bit-exact; fp8_weight_meta() gives the scales of the weights' copy.
  void set_fp8(bool on, bool head = false);
  bool fp8() const { return fp8_; }
  bool fp8_head() const { return fp8_head_; }
  // [1 / s, amax] of every FP8 weight in order (per layer qkvw, attprojw, fcw, fcprojw; then the head with
  // fp8_head): 2 * (4 * n_layer + head) floats, of the weights as they are now (the copy is refreshed first).
  std::vector<float> fp8_weight_meta();
  // Backend bytes the FP8 buffers take for micro-batch (B, Tn) (0 when off): the weights' copy (q and qt, 2 bytes a
  // weight), their metas, and the scratch of one Linear's input (2 x B*Tn x 4C) and output gradient (2 x B*Tn x 4C,
  // or x padded_vocab_size with the head). What the memory plan adds for precision fp8.
  size_t fp8_bytes(int B, int Tn) const;
  int last_B() const { return B_; }
  int last_T() const { return T_; }

 private:
  struct Slots {
    std::vector<std::pair<T**, size_t>> t;  // (slot, count) in layout order
    std::vector<std::pair<M**, size_t>> m;
  };
  void ensure_activations(int B, int Tn);
  void forward_ops(int B, int Tn);          // embeddings to logits
  // block l's forward from its input (the residual stream) to fcproj; with write_output also the block's output
  // (residual3) and the next norm (the next block's ln1, or lnf). rebuild: first ln1 = norm(input) (Recompute::
  // Layer's backward: the fused residual + norm that wrote it in forward is the previous block's)
  void block_forward_ops(int l, bool rebuild);
  // the slot of layer l in the per-layer activations: l, or 0 when one block is kept (Recompute::Layer)
  size_t slot(int l) const { return recompute_ == Recompute::Layer ? 0 : size_t(l); }
  void backward_ops(bool report);           // from dlogits (in a_.logits) to the embedding gradients
  void forward_backward_ops(float grad_scale);
  // One captured sequence of ops (see set_graphs): the graph, and the key of the run that sized its buffers.
  struct GraphSlot {
    void* exec = nullptr;
    std::vector<double> key, warm_key;
  };
  template <class Ops>
  void run_graphed(GraphSlot& g, std::vector<double> key, Ops&& ops);
  // op(): the op, timed under its name when profiling (set_profile)
  template <class Op>
  void timed(const char* name, Op&& op) {
    if (!profile_) {
      op();
      return;
    }
    backend_->synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    op();
    backend_->synchronize();
    add_op_time(name, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  void add_op_time(const char* name, double seconds);
  void drop_graph(GraphSlot& g);
  void release_activations();
  // (pointer in a, count) of every activation buffer for (B, Tn): the one layout (activation_counts sums it)
  static Slots activation_slots(Activations<T>& a, const ModelConfig& c, int B, int Tn, size_t att_size, Recompute r);
  friend ActivationCounts activation_counts(const ModelConfig& c, int B, int Tn, size_t att_size, Recompute r);
  void ensure_optimizer_state();
  void refresh_params();
  // with_muon: which tensors' parts to list (-1: every tensor; 0: the AdamW ones under Muon; 1: the Muon ones)
  std::vector<AdamWSegment> adamw_segments(size_t lo, size_t hi, float weight_decay, int with_muon = -1) const;
  void muon_matrix_ops(const MuonStep& muon);  // orthogonalise + apply the step's matrices
  // AdamW over the whole model's segments (profiling: per tensor group, each timed)
  void adamw_ops(const std::vector<AdamWSegment>& segments, float beta1, float beta2, float eps);
  std::vector<MuonMatrix> muon_mats_;
  M* muon_scratch_ = nullptr;
  size_t muon_scratch_n_ = 0;
  StepArgs step_args(float lr, float beta1, float beta2, int step, float grad_scale, double clip,
                     double sumsq) const;
  StepArgs muon_step_args(float lr, float beta1, float beta2, int step, double clip, double sumsq,
                          const MuonStep& muon) const;  // step_args with Muon's values and the group LRs
  void adamw_over(size_t lo, size_t hi, M* m, M* v, float beta1, float beta2, float eps, float weight_decay,
                  const StepArgs& args);
  // a sum of squares of the gradients in memory, divided by the square of the loss scale they carry now
  double unscaled(double sumsq) const { return sumsq / (double(scaler_.scale) * double(scaler_.scale)); }
  // The step's one read (Backend::step_result): refreshes the host's scaler copy, returns the sum of squares.
  double read_step_result();
  // The pre-clip norm of a step whose gradients carried loss scale `carried` and summed to sumsq; when it is finite
  // (the update was written) the ops' copy is now the update's, rounded with the step's seed.
  double step_norm(double sumsq, float carried, int step);
  // tensor i (null when the config does not have it)
  T* param(ParamTensor i) const { return sizes_[i] ? params_ + offsets_[i] : nullptr; }
  M* grad(ParamTensor i) const { return sizes_[i] ? grads_ + offsets_[i] : nullptr; }
  // gradients at flat offset `flat` in memory: grads_ holds [grad_lo_, grad_hi_) (all of it unless sharded)
  M* grad_at(size_t flat, size_t n, const char* what) const;
  // where backward writes tensor i's gradient (a non-layer tensor): grad(i), or its place in a bucket (sharded)
  M* grad_out(ParamTensor i) const;
  // where backward writes layer l's gradients: layer(grads_, l), or the layer bucket (sharded)
  LayerTensors<M> layer_grads_out(int l) const;
  void require_unsharded(const char* what) const;
  void require_no_offload(const char* what) const;
  M* host_grads(size_t n);
  void adamw_host_over(size_t lo, size_t hi, M* m, M* v, float beta1, float beta2, float eps, float weight_decay,
                       const StepArgs& args, float carried, const char* what);
  void require_offload_chunk(size_t lo, size_t n, const char* what) const;
  double offload_optimizer_step(float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                                double grad_clip);
  void free_grad_buckets();
  // the lm_head's weight: wte when tied
  ParamTensor head() const { return config_.tie_embeddings ? kWte : kLmHead; }
  // The config's norm (LayerNorm or RMSNorm) over rows of C; mean is unused by RMSNorm, w and b are null for it.
  void norm_forward(T* out, M* mean, M* rstd, const T* inp, const T* w, const T* b, int N);
  void residual_norm_forward(T* residual, T* out, M* mean, M* rstd, const T* a, const T* b, const T* w,
                             const T* bias, int N);
  void norm_backward(T* dinp, M* dw, M* db, const T* dout, const T* inp, const T* w, const M* mean, const M* rstd,
                     int N, InputGrad mode);
  // layer l's tensors in base (params_ or grads_)
  template <typename P>
  LayerTensors<P> layer(P* base, int l) const;
  // The grad-ready groups: layer l's per-layer slices; lnfw, lnfb (and lm_head, untied); wte, wpe. Tensors the
  // config does not have give no range.
  GradRanges layer_grad_ranges(int l) const;
  GradRanges tensor_grad_ranges(ParamTensor first, ParamTensor last) const;
  GradRanges head_grad_ranges() const;

  void require_training(const char* what) const;
  double kv_forward(const int32_t* inp, const int32_t* targets, int B, int Tn, const int32_t* kv_slots);
  void kv_ensure_rows(int rows, int logit_rows);
  void kv_release();
  // the layers over n * Tq rows whose inputs are in kv_.ids, slots/positions in kv_slot_/kv_posd_; leaves the
  // final layernorm's output of every row in kv_.ln
  void kv_layers(int n, int Tq);
  // out = inp @ param(i)-slice^T + bias for the KV path: the 16-bit copy for few rows when it is on
  void kv_matmul(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC);
  // the lm_head (untied, or wte) over `rows` rows into kv_.logits, soft-capped when the config caps
  void kv_head(const T* in, int rows);
  void kv_refresh_w16();
  // FP8 (set_fp8): weight i's (out, in) shape and pointer in fp8_weight_meta's order; the weights' e4m3 copy when
  // stale; the scratch of one Linear's input (q, qt) and output gradient (q, qt) for N rows; the buffers freed
  void fp8_weight(size_t i, const T** w, int* out, int* in) const;
  void fp8_refresh_weights();
  void fp8_ensure_scratch(int N);
  void fp8_release();
  // out (N, OC) = inp @ w^T + bias through the FP8 op (weight index wi) or the model's precision
  void linear_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC, size_t wi);

  ModelConfig config_;
  std::unique_ptr<Backend<T>> backend_;
  bool training_ = true;
  // inference state: the cache (L, S, T, C) for K and V, one layer's activations for kv_cap_ rows, logits
  struct KvBuffers {
    T *x, *ln, *qkv, *atty, *proj, *res2, *fch, *fch_gelu, *last, *logits;
    M *mean, *rstd, *losses, *lse, *qk_rstd;  // qk_rstd: with qk_norm only
  };
  T* kcache_ = nullptr;
  T* vcache_ = nullptr;
  int kv_S_ = 0, kv_T_ = 0;
  std::vector<int> kv_pos_;
  T* kv_mem_ = nullptr;
  M* kv_stats_ = nullptr;
  size_t kv_mem_n_ = 0, kv_stats_n_ = 0;
  int kv_cap_ = 0, kv_logit_cap_ = 0;  // rows the activations / logits are sized for
  int kv_rows_ = 0;                   // logit rows of the last prefill / decode
  KvBuffers kv_{};
  int32_t *kv_ids_ = nullptr, *kv_slot_ = nullptr, *kv_posd_ = nullptr, *kv_gather_ = nullptr, *kv_targets_ = nullptr;
  bool kv_forward_ = false;
  uint16_t* w16_ = nullptr;  // num_params_ values, the parameters' layout (only the matrices are filled)
  // weights16 = 3 (int8): num_params_ bytes in the parameters' layout (only the matrices filled) and the scales of
  // each matrix (rows x ceil(inner / 32)) from q8_soff_[tensor]
  int8_t* q8_ = nullptr;
  float* q8_scales_ = nullptr;
  size_t q8_soff_[kNumParamTensors] = {};
  size_t q8_nscales_ = 0;
  bool q8_int_dot_ = true;
  int q8_inner(ParamTensor i) const { return i == kFcprojw ? 4 * config_.n_embd : config_.n_embd; }
  // scales per row of `inner` inputs: one per block of 32 (the CPU backend's kQ8Block)
  static size_t q8_blocks(int inner) { return size_t(inner + 31) / 32; }
  void free_q8() {  // the 8-bit copy and its scales, if any
    if (!q8_) return;
    backend_->free_i8(q8_);
    backend_->free_i8(reinterpret_cast<int8_t*>(q8_scales_));
    q8_ = nullptr;
    q8_scales_ = nullptr;
  }
  // FP8 (set_fp8): the weights' copy (q then qt of each, fp8_weight_meta's order) and their metas, the scratch
  bool fp8_ = false, fp8_head_ = false, fp8_stale_ = true;
  std::vector<Fp8Tensor> fp8_w_;
  uint8_t* fp8_wmem_ = nullptr;     // the weights' fp8 values
  uint8_t* fp8_meta_ = nullptr;     // 2 floats per weight, then 2 for each scratch tensor
  uint8_t* fp8_smem_ = nullptr;     // the scratch's fp8 values
  size_t fp8_rows_ = 0;             // rows the scratch holds
  Fp8Tensor fp8_x_{}, fp8_g_{};     // a Linear's input, its output gradient
  int w16_kind_ = 0;
  bool w16_stale_ = true;  // the last forward() ran through the inference path (logits/losses are kv_'s)
  std::array<size_t, kNumParamTensors> sizes_{}, offsets_{};
  size_t num_params_ = 0;
  T* params_ = nullptr;
  M* master_ = nullptr;  // only when M != T
  M* grads_ = nullptr;
  // ZeRO-2 (set_grad_shard): grads_ holds flat [grad_lo_, grad_hi_); the buckets: 0 layer, 1 head, 2 embeddings
  bool grad_sharded_ = false;
  size_t grad_lo_ = 0, grad_hi_ = 0;
  bool shard_fresh_ = true;  // no backward reached the shard since zero_grad: accumulate_grad_shard copies
  M* bucket_[3] = {nullptr, nullptr, nullptr};
  size_t bucket_n_[3] = {0, 0, 0};
  BucketHook bucket_hook_;
  // optimizer offload (set_offload): m_, v_ and (16-bit) master_ are pinned host memory; an fp32 model's host copy
  // of its weights (stale after the device's were written from outside), and the gradients' host copy
  bool offload_ = false;
  M* host_master_ = nullptr;
  M* grad_host_ = nullptr;  // host_grads(n): grad_host_n_ values
  size_t grad_host_n_ = 0;
  bool prefetch_armed_ = false;  // prefetch_grads() for the next backward
  bool grads_on_host_ = false;   // the last backward copied every gradient (ZeRO-2: the shard) to grad_host_
  bool shard_prefetch_ = false;  // this backward's accumulate_grad_shard copies what it folds in
  long grad_prefetches_ = 0;
  bool host_master_stale_ = false;
  M* m_ = nullptr;
  M* v_ = nullptr;
  T* acts_mem_ = nullptr;
  M* stats_mem_ = nullptr;
  uint32_t round_seed_ = 0;
  bool params_stale_ = false;
  Activations<T> a_{};
  int32_t* inputs_ = nullptr;
  int32_t* targets_ = nullptr;
  int B_ = 0, T_ = 0;           // shape the activations are laid out for
  size_t att_size_ = 0;         // per-layer attention state, sized by the backend
  Recompute recompute_ = Recompute::None;
  GradReadyHook grad_hook_;
  bool have_targets_ = false;   // last forward had targets and its logits are intact
  long n_valid_ = 0;            // non-ignored targets of the last forward, counted on the host
  // in backend memory: non-ignored targets of the last forward, the loss accumulated by forward_backward
  int32_t* n_valid_dev_ = nullptr;
  M* loss_acc_ = nullptr;
  bool graphs_ = false;
  GraphSlot step_graph_, optimizer_graph_;  // forward_backward's and optimizer_step's
  GraphSlot decode_graph_;                  // kv_decode's layers and head (gpt2_infer.h)
  bool loss_scaling_ = false;
  LossScaler scaler_;  // the host's copy of the backend's (as of the last optimizer step's read)
  long graph_captures_ = 0, graph_replays_ = 0;
  bool profile_ = false;
  std::vector<OpTime> op_times_;
};

extern template class GPT2Model<float>;
extern template class GPT2Model<double>;
extern template class GPT2Model<bf16>;
extern template class GPT2Model<f16>;

}  // namespace gpt2
