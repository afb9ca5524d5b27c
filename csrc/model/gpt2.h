// GPT-2, backend-neutral: buffer layout, the layer loop (forward and backward) and the optimizer
// policy. The backend supplies memory and the ops. T is the storage type (float; double in tests).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/backend.h"
#include "model/config.h"

namespace gpt2 {

// Activations for one (B, T), each a slice of one allocation.
template <typename T>
struct Activations {
  T *encoded, *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *att, *attproj, *residual2, *ln2, *ln2_mean,
      *ln2_rstd, *fch, *fch_gelu, *fcproj, *residual3, *lnf, *lnf_mean, *lnf_rstd, *logits, *losses, *lse;
  // backward scratch (not kept between steps)
  T *dres, *dln, *datty, *dqkv, *dfch, *dfch_gelu;
};

template <typename T>
class GPT2Model {
 public:
  GPT2Model(const ModelConfig& config, std::unique_ptr<Backend<T>> backend);
  ~GPT2Model();
  GPT2Model(const GPT2Model&) = delete;
  GPT2Model& operator=(const GPT2Model&) = delete;

  const ModelConfig& config() const { return config_; }
  Backend<T>& backend() { return *backend_; }
  size_t num_parameters() const { return num_params_; }
  const std::array<size_t, kNumParamTensors>& param_offsets() const { return offsets_; }

  T* params() { return params_; }
  T* grads() { return grads_; }
  T* adam_m() { ensure_optimizer_state(); return m_; }
  T* adam_v() { ensure_optimizer_state(); return v_; }
  size_t activation_count() const { return act_count_; }
  // values the activations for (B, Tn) take, without allocating them
  size_t activation_count_for(int B, int Tn);
  // keep one GELU output buffer and recompute it per layer in backward (saves (L-1)*B*T*4C values)
  void set_recompute_gelu(bool on);
  bool recompute_gelu() const { return recompute_gelu_; }

  // inp, targets: host arrays of B*Tn ints, already validated (ids in range, targets -1 or in range).
  // Returns the mean loss over non-ignored targets (NaN without targets).
  double forward(const int32_t* inp, const int32_t* targets, int B, int Tn);
  // Copies logits (B, Tn, Vp) and per-token losses of the last forward to the host.
  void logits_to_host(T* dst) const;
  void losses_to_host(T* dst) const;
  // Accumulates gradients of (grad_scale * mean loss) into grads(). Needs a forward with targets.
  void backward(float grad_scale);
  void zero_grad();
  double grad_norm();  // global L2 norm of all gradients
  void adamw_update(float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale);
  // AdamW over the flat parameter range [lo, hi) only (ZeRO-1: this rank's shard), with the same per-tensor
  // weight-decay policy as adamw_update. m and v are the shard's moments: hi - lo values each in backend
  // memory, owned by the caller; the model's own adam_m()/adam_v() are not touched (nor allocated).
  void adamw_update_range(size_t lo, size_t hi, T* m, T* v, float lr, float beta1, float beta2, float eps,
                          float weight_decay, int step, float grad_scale);
  int last_B() const { return B_; }
  int last_T() const { return T_; }

 private:
  void ensure_activations(int B, int Tn);
  void release_activations();
  std::vector<std::pair<T**, size_t>> activation_slots(int B, int Tn);
  void ensure_optimizer_state();
  T* param(int i) const { return params_ + offsets_[i]; }
  T* grad(int i) const { return grads_ + offsets_[i]; }

  ModelConfig config_;
  std::unique_ptr<Backend<T>> backend_;
  std::array<size_t, kNumParamTensors> sizes_{}, offsets_{};
  size_t num_params_ = 0;
  T* params_ = nullptr;
  T* grads_ = nullptr;
  T* m_ = nullptr;
  T* v_ = nullptr;
  T* acts_mem_ = nullptr;
  size_t act_count_ = 0;
  Activations<T> a_{};
  int32_t* inputs_ = nullptr;
  int32_t* targets_ = nullptr;
  int B_ = 0, T_ = 0;           // shape the activations are laid out for
  size_t att_size_ = 0;         // per-layer attention state, sized by the backend
  bool recompute_gelu_ = false;
  bool have_targets_ = false;   // last forward had targets and its logits are intact
  long n_valid_ = 0;
};

extern template class GPT2Model<float>;
extern template class GPT2Model<double>;

}  // namespace gpt2
