// The optimizer's policy, once: AdamW's defaults, the gradient-clipping rule, and the values one AdamW step
// carries. Shared by the model, every backend and the CUDA kernels: plain C++ (no CUDA or backend headers), with
// the clip rule callable from device code too.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define GPT2CORE_HOST_DEVICE __host__ __device__
#else
#define GPT2CORE_HOST_DEVICE
#endif

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
#if defined(__CUDACC__)
  const double norm = ::sqrt(sumsq);
  if (!::isfinite(norm)) return false;
#else
  const double norm = std::sqrt(sumsq);
  if (!std::isfinite(norm)) return false;
#endif
  *factor = clip > 0 && norm > clip ? float(clip / (norm + 1e-6)) : 1.0f;
  return true;
}

// AdamW's bias corrections 1 - beta^step, in float (every update path uses these, so their bits agree).
inline float bias_correction(float beta, int step) { return 1.0f - std::pow(beta, float(step)); }

// One tensor (or the part of it inside a ZeRO-1 shard) in an AdamW update: flat indices [begin, end) of the
// parameters, with this tensor's weight decay.
struct AdamWSegment {
  size_t begin, end;
  float decay;
};

// The values of one optimizer step that change from step to step, in backend memory (Backend::set_step_args) so
// that a captured step reads each step's values at replay. The gradients are multiplied by
// grad_scale * clip_factor(sumsq, clip); sumsq is written by Backend::grad_sum_squares in a training step, or
// given (ZeRO-1: the sum over all ranks' shards; 0 with clip = 0 for a plain update).
struct StepArgs {
  float lr, bc1, bc2;
  float grad_scale;  // 1 in a training step
  uint32_t seed;     // stochastic rounding of a bf16 copy: the step
  double clip;       // clip the global gradient norm to this (0: no clipping)
  double sumsq;      // sum of squares of all gradients
};

}  // namespace gpt2
