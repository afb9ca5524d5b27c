// The optimizer's policy, once: AdamW's defaults, the gradient-clipping rule, and the values one AdamW step
// carries. Shared by the model, every backend and the CUDA kernels: plain C++ (no CUDA or backend headers), with
// the clip rule callable from device code too.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "model/host_device.h"

namespace gpt2 {

// AdamW's defaults (GPT-2/3's betas; PyTorch's eps), used by every entry point that has defaults (the bindings).
constexpr float kAdamBeta1 = 0.9f;
constexpr float kAdamBeta2 = 0.95f;
constexpr float kAdamEps = 1e-8f;
constexpr float kWeightDecay = 0.1f;  // on 2-D tensors only (param_decays, model/config.h)

// Gradient clipping by global norm: the factor every gradient is multiplied by, from the sum of squares of all
// gradients and the threshold clip (0: no clipping): clip / (norm + 1e-6) when norm = sqrt(sumsq) > clip > 0,
// else 1; in double, rounded once to float. False when the norm is not finite: the step must write nothing.
GPT2CORE_HOST_DEVICE inline bool clip_factor(double sumsq, double clip, float* factor) {
  const double norm = std::sqrt(sumsq);
  if (!std::isfinite(norm)) return false;
  *factor = clip > 0 && norm > clip ? float(clip / (norm + 1e-6)) : 1.0f;
  return true;
}

// Dynamic loss scaling, PyTorch's GradScaler (torch.amp.GradScaler): the loss gradient is multiplied by `scale`
// so that small fp16 gradients do not flush to zero; the update divides it out again. A step whose gradients hold
// an inf or NaN (their global sum of squares is not finite) is skipped: nothing is written, the scale is
// multiplied by `backoff` and the run of clean steps restarts. After `interval` clean steps in a row the scale is
// multiplied by `growth` (unless that would overflow fp32, as GradScaler) and the run restarts. The state lives in
// backend memory and is updated there (Backend::loss_scale_update), so a step needs no host round trip; off, the
// scale stays 1 and nothing updates it.
// Step counters, as with GradScaler (which skips optimizer.step(), so Adam's own step does not advance while the
// LR scheduler, stepped by the loop, does): AdamW's step (bias corrections, the bf16 rounding seed) counts the
// updates applied; the learning rate follows the training loop's step, skipped or not (GPT2.step, train.py).
struct LossScaler {
  float scale = 1.0f;
  float growth = 2.0f, backoff = 0.5f;
  int32_t interval = 2000;  // clean steps in a row before the scale grows
  int32_t clean = 0;        // clean steps since the last growth or backoff (GradScaler's growth tracker)
  int64_t skipped = 0;      // steps skipped for non-finite gradients, in total
};
constexpr float kLossScaleInit = 65536.0f;  // 2^16, GradScaler's init_scale
constexpr int kLossScaleInterval = 2000;    // GradScaler's growth_interval

// One step of the scaler after an update whose gradients had sum of squares sumsq (of the scaled gradients).
GPT2CORE_HOST_DEVICE inline void loss_scale_update(LossScaler& s, double sumsq) {
  const bool finite = std::isfinite(sumsq);
  if (!finite) {
    s.scale *= s.backoff;
    s.clean = 0;
    s.skipped++;
  } else if (++s.clean >= s.interval) {
    const float grown = s.scale * s.growth;
    if (std::isfinite(grown)) s.scale = grown;
    s.clean = 0;
  }
}

// AdamW's bias corrections 1 - beta^step, in float (every update path uses these, so their bits agree).
inline float bias_correction(float beta, int step) { return 1.0f - std::pow(beta, float(step)); }

// AdamW's learning-rate groups: under Muon the AdamW tensors take the LR of their group (modded-nanogpt and
// nanochat give the embedding a much higher LR than the head, and the gains/biases their own): the embeddings (wte,
// wpe; a tied head is wte), the untied head, and the rest. StepArgs carries each group's LR of the step.
enum LrGroup : int { kLrRest = 0, kLrEmbedding = 1, kLrHead = 2 };

// One tensor (or the part of it inside a ZeRO-1 shard) in an AdamW update: flat indices [begin, end) of the
// parameters, with this tensor's weight decay and LR group.
struct AdamWSegment {
  size_t begin, end;
  float decay;
  int group = kLrRest;
};

// The values of one optimizer step that change from step to step, in backend memory (Backend::set_step_args) so
// that a captured step reads each step's values at replay. The gradients are multiplied by
// grad_scale * clip_factor(sumsq, clip); sumsq is written by Backend::grad_sum_squares in a training step, or
// given (ZeRO-1: the sum over all ranks' shards; 0 with clip = 0 for a plain update).
//
// With loss scaling the gradients in memory are scale * the true ones (scale: the LossScaler's, the one their
// backward used): the clip rule sees the unscaled sum of squares sumsq / scale^2, and the factor is
// grad_scale * clip_factor / scale (update_factor). Off, scale is 1 and this is the plain rule.
struct StepArgs {
  float lr, bc1, bc2;
  float grad_scale;  // 1 in a training step
  uint32_t seed;     // stochastic rounding of a bf16 copy: the step
  double clip;       // clip the global gradient norm to this (0: no clipping)
  float muon_lr;     // Muon's learning rate and momentum (beta) this step (MuonArgs; 0 when Muon is off)
  float muon_beta;
  float embedding_lr;  // AdamW's LR of the kLrEmbedding and kLrHead groups this step (lr, the kLrRest group's,
  float head_lr;       // unless the optimizer sets them: GPT2Model::MuonStep)
  double sumsq;      // sum of squares of all gradients (as they are in memory: scaled); LAST (see StepState)
};

// What a backend keeps in its memory for the optimizer: the step's values and the loss scaler, in this order, so
// that the one read after a step (Backend::step_result) copies sumsq and the scaler together.
struct StepState {
  StepArgs args;
  LossScaler scaler;
};
// The host's copy of what that read brings back.
struct StepResult {
  double sumsq;
  LossScaler scaler;
};

// The AdamW LR of a segment's group this step.
GPT2CORE_HOST_DEVICE inline float group_lr(const StepArgs& a, int group) {
  return group == kLrEmbedding ? a.embedding_lr : group == kLrHead ? a.head_lr : a.lr;
}

// The factor AdamW multiplies the gradients by: grad_scale * clip_factor(unscaled sumsq, clip) / scale, in float
// (with scale = 2^k the division is exact, so scaled and unscaled runs write the same bits). False when the sum
// of squares is not finite: the step must write nothing.
GPT2CORE_HOST_DEVICE inline bool update_factor(const StepArgs& a, float scale, float* factor) {
  float clip = 1.0f;
  if (!clip_factor(a.sumsq / (double(scale) * double(scale)), a.clip, &clip)) return false;
  *factor = (a.grad_scale * clip) / scale;
  return true;
}

// ---------------------------------------------------------------------------------------------------- Muon
// Muon (Keller Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024, and its reference code
// github.com/KellerJordan/Muon, muon.py; modded-nanogpt's records): for the 2-D hidden weight matrices, the
// momentum of the gradient, orthogonalised by Newton-Schulz, replaces AdamW's update. For each matrix G (rows,
// cols) of the gradients (already multiplied by update_factor, like AdamW's):
//   mom = lerp(mom, G, 1 - beta)                     (= beta * mom + (1 - beta) * G)
//   U   = lerp(G, mom, beta) with Nesterov, else mom
//   X   = U / (||U||_F + 1e-7); then ns_steps times, with (a, b, c) = (3.4445, -4.7750, 2.0315):
//         A = X X^T, B = b A + c A A, X = a X + B X      (on X^T when rows > cols, so A is the smaller Gram)
//   W   = W * (1 - lr * weight_decay) - lr * max(1, rows / cols)^0.5 * X
// The shape factor max(1, rows/cols)^0.5 is the reference code's (KellerJordan/Muon muon_update; modded-nanogpt
// uses the same): a tall matrix's orthogonalised update has RMS ~ 1/sqrt(rows), the factor restores it for
// fan-out matrices (fcw, 4C x C), while wide and square ones keep it.
constexpr double kMuonA = 3.4445, kMuonB = -4.7750, kMuonC = 2.0315;  // the quintic's published coefficients
constexpr double kMuonNormEps = 1e-7;
constexpr float kMuonBeta = 0.95f;
constexpr int kMuonNsSteps = 5;

// Muon's settings that stay fixed over a run (the ones that change per step, lr and beta, are StepArgs).
struct MuonArgs {
  float weight_decay = 0.0f;
  int ns_steps = kMuonNsSteps;
  bool nesterov = true;
  bool ns_bf16 = false;  // Newton-Schulz's products in bf16 (Backend::muon_orthogonalize_batch)
};

// The shape factor of a (rows, cols) matrix's update (see above).
inline float muon_scale(int rows, int cols) {
  return rows > cols ? float(std::sqrt(double(rows) / double(cols))) : 1.0f;
}

}  // namespace gpt2
