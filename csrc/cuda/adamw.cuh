// AdamW (PyTorch semantics), one launch for all parameters (a table of per-tensor segments, below):
//   g = grad * grad_scale;  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   w -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + decay * w)
// decay is 0 for 1-D tensors (the model's policy); lr is the LR of the segment's group (group_lr,
// model/optimizer.h: under Muon the embeddings and the head have their own). The step's values come from a
// StepState in device memory (so a step captured in a CUDA graph reads each step's values at replay): the group
// LRs, the bias corrections bc1, bc2, the seed,
// and grad_scale = update_factor(args, scaler.scale) = StepArgs::grad_scale * clip_factor / loss scale (the clip
// rule of model/optimizer.h on the unscaled norm, computed by every block from the same values); if the norm is
// not finite, nothing is written. loss_scale_update_kernel then steps the loss scaler (model/optimizer.h).
// grad, m, v and the master weights w are fp32. The parameters the ops read have the storage type floatX:
//   floatX = float: master is null and param is w itself (updated in place);
//   floatX = bf16:  w = master (fp32, updated in place), then param[i] = stochastic_round_bf16(w[i], seed,
//                   offset + i) (common.cuh): unbiased rounding, a pure function of (value, seed, global index),
//                   seed 0 = round to nearest even;
//   floatX = fp16:  the same with param[i] = w[i] rounded to nearest even (round_param; the seed is unused).
// cast_params writes param from master with exactly that rounding (same kernel, without the update), so a
// ZeRO-1 rank that refreshes its bf16 copy from all-gathered master weights with the step's seed writes the
// bits the full update would have.
#pragma once
#include <algorithm>
#include <string>

#include "cuda/common.cuh"
#include "model/optimizer.h"

namespace gpt2::cuda {

struct AdamWParams {
  float lr, beta1, beta2, eps, decay, grad_scale, bc1, bc2;
  uint32_t seed;  // stochastic rounding of bf16 parameters (0: round to nearest even)
  size_t offset;  // global index of element 0 of the arrays (the rounding's index is offset + i)
  const StepState* step = nullptr;  // device memory: lr, bc1, bc2, seed and the gradient scale come from here
};

// p with the values of *p.step, the LR of LR group `group`. False when the norm is not finite: the step must write
// nothing.
__device__ inline bool adamw_step_values(AdamWParams& p, int group) {
  const StepArgs a = p.step->args;
  if (!update_factor(a, p.step->scaler.scale, &p.grad_scale)) return false;
  p.lr = group_lr(a, group);
  p.bc1 = a.bc1;
  p.bc2 = a.bc2;
  p.seed = a.seed;
  return true;
}

// One value's update. Host and device (the optimizer offload runs it on the CPU over host memory,
// CudaBackend::adamw_host): every multiply-add is an explicit fma, so that nvcc's contraction of a * b + c in device
// code and the host compiler's (none, or another) cannot round differently; sqrt and division are IEEE on both
// (no fast-math), so the two write the same bits.
__host__ __device__ inline void adamw_one(float& w, float grad, float& m, float& v, const AdamWParams& p) {
  const float g = grad * p.grad_scale;
  const float mi = fmaf(p.beta1, m, (1.0f - p.beta1) * g);
  const float vi = fmaf(p.beta2, v, ((1.0f - p.beta2) * g) * g);
  m = mi;
  v = vi;
  const float mhat = mi / p.bc1, vhat = vi / p.bc2;
  w = fmaf(-p.lr, fmaf(p.decay, w, mhat / (sqrtf(vhat) + p.eps)), w);
}

// Element k: kStep: AdamW update of the master value (master[k], or param[k] when floatX = float), then the
// parameter write; !kStep (cast_params): the parameter write only. grad, m, v unused (null) when !kStep.
template <class floatX, bool kStep>
__device__ inline void adamw_element(floatX* param, float* master, const float* grad, float* m, float* v, size_t k,
                                     const AdamWParams& p) {
  float w = kIs16Bit<floatX> ? master[k] : load_f(param[k]);
  if constexpr (kStep) adamw_one(w, grad[k], m[k], v[k], p);
  param[k] = round_param<floatX>(w, p.seed, p.offset + k);
  if constexpr (kIs16Bit<floatX> && kStep) master[k] = w;
}

// One launch for many tensors: segment s of the table is the range [begin[s], end[s]) of the arrays param, master,
// grad, m and v, with its own weight decay.
// The model passes its 16 tensors (or their parts inside a shard) in one table, so a step is one launch.
constexpr int kAdamWMaxSegments = 16;
struct AdamWTable {
  int count = 0;
  size_t begin[kAdamWMaxSegments], end[kAdamWMaxSegments];
  float decay[kAdamWMaxSegments];
  int group[kAdamWMaxSegments];  // LrGroup: which of the step's LRs (group_lr, model/optimizer.h)
  bool vec[kAdamWMaxSegments];  // this segment's pointers are aligned for 4-value vector access
};

// grid (x, table.count): blockIdx.y picks the segment, the x blocks stride over it. In a segment, unit i is
// values 4i..4i+3 when vec (float4 for the fp32 arrays, Pack<floatX, 4> of 16 or 8 bytes for param; the
// last unit takes the ragged tail one value at a time), else value i. The rounding index of flat value k is
// p.offset + k.
constexpr int kAdamWThreads = 256;
constexpr int kLossScaleThreads = 32;

template <class floatX, bool kStep>
__global__ void __launch_bounds__(kAdamWThreads) adamw_kernel(floatX* __restrict__ param,       // (N) flat
                             float* __restrict__ master,       // (N) flat, null when floatX = float
                             const float* __restrict__ grad,   // (N) flat  (kStep only)
                             float* __restrict__ m,            // (N) flat  (kStep only)
                             float* __restrict__ v,            // (N) flat  (kStep only)
                             AdamWTable table, AdamWParams p) {
  using P4 = Pack<floatX, 4>;
  using F4 = Pack<float, 4>;
  const int s = blockIdx.y;
  if (kStep && !adamw_step_values(p, table.group[s])) return;
  const size_t b = table.begin[s], n = table.end[s] - b;
  p.decay = table.decay[s];
  p.offset += b;
  param += b;
  if (master) master += b;
  if constexpr (kStep) {
    grad += b;
    m += b;
    v += b;
  }
  const bool vec = table.vec[s];
  const size_t units = vec ? (n + 3) / 4 : n;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < units; i += size_t(gridDim.x) * blockDim.x) {
    if (!vec) {
      adamw_element<floatX, kStep>(param, master, grad, m, v, i, p);
      continue;
    }
    const size_t i4 = 4 * i;
    if (i4 + 4 > n) {
      for (size_t k = i4; k < n; k++) adamw_element<floatX, kStep>(param, master, grad, m, v, k, p);
      continue;
    }
    F4 w, g, mm, vv;
    if constexpr (kIs16Bit<floatX>) {
      w = F4::load(master + i4);
    } else {
      const P4 pw = P4::load(param + i4);
#pragma unroll
      for (int k = 0; k < 4; k++) w.x[k] = load_f(pw.x[k]);
    }
    if constexpr (kStep) {
      g = F4::load(grad + i4);
      mm = F4::load(m + i4);
      vv = F4::load(v + i4);
#pragma unroll
      for (int k = 0; k < 4; k++) adamw_one(w.x[k], g.x[k], mm.x[k], vv.x[k], p);
      mm.store(m + i4);
      vv.store(v + i4);
      if constexpr (kIs16Bit<floatX>) w.store(master + i4);
    }
    P4 out;
#pragma unroll
    for (int k = 0; k < 4; k++) out.x[k] = round_param<floatX>(w.x[k], p.seed, p.offset + i4 + k);
    out.store(param + i4);
  }
}

// One thread: the loss scaler's step after the update, from the sum of squares the update saw.
__global__ void __launch_bounds__(kLossScaleThreads) loss_scale_update_kernel(StepState* state) {
  if (blockIdx.x == 0 && threadIdx.x == 0) loss_scale_update(state->scaler, state->args.sumsq);
}

// ----------------------------------------------------------------------------------------- launchers
inline void loss_scale_update(StepState* state, cudaStream_t stream) {
  LAUNCH(loss_scale_update_kernel, 1, kLossScaleThreads, 0, stream, state);
  CUDA_CHECK_LAUNCH();
}

struct AdamWSpan {  // one tensor (or its part): array indices [begin, end) with its weight decay and LR group
  size_t begin, end;
  float decay;
  int group = kLrRest;
};

template <class floatX, bool kStep>
void launch_adamw(floatX* param, float* master, const float* grad, float* m, float* v, const AdamWSpan* spans,
                  int count, const AdamWParams& p, cudaStream_t stream) {
  if (count > kAdamWMaxSegments)
    throw std::invalid_argument("adamw: at most " + std::to_string(kAdamWMaxSegments) + " segments per launch");
  AdamWTable t;
  size_t most = 0;
  for (int i = 0; i < count; i++) {
    if (spans[i].end <= spans[i].begin) continue;
    const size_t b = spans[i].begin;
    const int s = t.count++;
    t.begin[s] = b;
    t.end[s] = spans[i].end;
    t.decay[s] = spans[i].decay;
    t.group[s] = spans[i].group;
    t.vec[s] = aligned_to<4 * sizeof(floatX)>(param + b) && (!master || aligned16(master + b)) &&
               (!kStep || aligned16(grad + b, m + b, v + b));
    most = std::max(most, t.vec[s] ? (spans[i].end - b + 3) / 4 : spans[i].end - b);
  }
  if (t.count == 0) return;
  // enough blocks to fill a large GPU (x 256 threads); bigger segments loop
  const dim3 grid(std::min(ceil_div(most, kAdamWThreads), 2048), t.count);
  LAUNCH((adamw_kernel<floatX, kStep>), grid, kAdamWThreads, 0, stream, param, master, grad, m, v, t, p);
  CUDA_CHECK_LAUNCH();
}

// AdamW over the spans of the arrays in one launch, the step's values from p.step (device memory; p.lr, p.bc1,
// p.bc2, p.seed, p.grad_scale and p.decay are ignored: each span has its own decay). floatX = float: master must
// be null (param is the master). floatX = bf16: master (fp32) is updated and param refreshed from it with
// stochastic rounding (rounding index p.offset + array index).
template <class floatX>
void adamw_update(floatX* param, float* master, const float* grad, float* m, float* v, const AdamWSpan* spans,
                  int count, const AdamWParams& p, cudaStream_t stream) {
  if (kIs16Bit<floatX> == (master == nullptr))
    throw std::invalid_argument(kIs16Bit<floatX> ? "adamw_update: bf16 / fp16 parameters need fp32 master weights"
                                                : "adamw_update: fp32 parameters are their own master (pass null)");
  if (!p.step) throw std::invalid_argument("adamw_update: the step's values (p.step) are needed");
  launch_adamw<floatX, true>(param, master, grad, m, v, spans, count, p, stream);
}

// param[i] = stochastic_round_bf16(master[i], seed, offset + i) (a plain copy when floatX = float);
// seed 0 = round to nearest even.
template <class floatX>
void cast_params(floatX* param, const float* master, size_t n, uint32_t seed, size_t offset, cudaStream_t stream) {
  if (n == 0) return;
  if constexpr (!kIs16Bit<floatX>) {  // fp32: the parameters are the master weights
    (void)seed;
    (void)offset;
    if (param != master)
      CUDA_CHECK(cudaMemcpyAsync(param, master, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    return;
  } else {
    AdamWParams p{};
    p.seed = seed;
    p.offset = offset;
    const AdamWSpan span{0, n, 0.0f};
    // the kernel takes master non-const (the update writes it); with kStep = false it only reads it
    launch_adamw<floatX, false>(param, const_cast<float*>(master), nullptr, nullptr, nullptr, &span, 1, p, stream);
  }
}

}  // namespace gpt2::cuda
