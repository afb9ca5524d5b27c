// The optimizer's policy and the values an AdamW step carries, shared by the model, every backend and the
// CUDA kernels (plain C++: no CUDA or backend headers, so csrc/cuda can include it).
#pragma once
#include <cstddef>
#include <cstdint>

namespace gpt2 {

// One tensor (or the part of it inside a ZeRO-1 shard) in an AdamW update: flat indices [begin, end) of the
// parameters, with this tensor's weight decay.
struct AdamWSegment {
  size_t begin, end;
  float decay;
};

// The values of one optimizer step that change from step to step, for clipped_adamw_segments: in backend memory
// so that a captured step reads each step's values at replay. sumsq is written by grad_sum_squares in the step.
struct StepArgs {
  float lr, bc1, bc2;
  uint32_t seed;  // stochastic rounding of a bf16 copy: the step
  double clip;    // clip the global gradient norm to this (0: no clipping)
  double sumsq;   // sum of squares of all gradients
};

}  // namespace gpt2
