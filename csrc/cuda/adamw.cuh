// AdamW (PyTorch semantics) over one tensor of n values, one launch:
//   g = grad * grad_scale;  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   w -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + decay * w)
// grad_scale folds in gradient clipping; decay is 0 for 1-D tensors (the model's policy).
// grad, m, v and the master weights w are fp32. The parameters the ops read have the storage type floatX:
//   floatX = float: master is null and param is w itself (updated in place);
//   floatX = bf16:  w = master (fp32, updated in place), then param[i] = stochastic_round_bf16(w[i], seed,
//                   offset + i) (common.cuh): unbiased rounding, a pure function of (value, seed, global index),
//                   seed 0 = round to nearest even.
// cast_params writes param from master with exactly that rounding (same kernel, without the update), so a
// ZeRO-1 rank that refreshes its bf16 copy from all-gathered master weights with the step's seed writes the
// bits the full update would have.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

struct AdamWParams {
  float lr, beta1, beta2, eps, decay, grad_scale, bc1, bc2;
  uint32_t seed;  // stochastic rounding of bf16 parameters (0: round to nearest even)
  size_t offset;  // global index of element 0 of this tensor (the rounding's index is offset + i)
};

__device__ inline void adamw_one(float& w, float grad, float& m, float& v, const AdamWParams& p) {
  const float g = grad * p.grad_scale;
  const float mi = p.beta1 * m + (1.0f - p.beta1) * g;
  const float vi = p.beta2 * v + (1.0f - p.beta2) * g * g;
  m = mi;
  v = vi;
  const float mhat = mi / p.bc1, vhat = vi / p.bc2;
  w = w - p.lr * (mhat / (sqrtf(vhat) + p.eps) + p.decay * w);
}

// Element k: kStep: AdamW update of the master value (master[k], or param[k] when floatX = float), then the
// parameter write; !kStep (cast_params): the parameter write only. grad, m, v unused (null) when !kStep.
template <class floatX, bool kStep>
__device__ inline void adamw_element(floatX* param, float* master, const float* grad, float* m, float* v, size_t k,
                                     const AdamWParams& p) {
  float w = kIsBF16<floatX> ? master[k] : load_f(param[k]);
  if constexpr (kStep) adamw_one(w, grad[k], m[k], v[k], p);
  param[k] = round_param<floatX>(w, p.seed, p.offset + k);
  if constexpr (kIsBF16<floatX> && kStep) master[k] = w;
}

// vec: thread i handles values 4i..4i+3: float4 (16 bytes) for the fp32 arrays, Pack<floatX, 4> (16 or 8
// bytes) for param, all pointers 16-byte aligned (param 8-byte for bf16); the last thread the tail; otherwise
// one value per thread.
template <class floatX, bool kStep>
__global__ void adamw_kernel(floatX* __restrict__ param,       // (n)
                             float* __restrict__ master,       // (n), null when floatX = float
                             const float* __restrict__ grad,   // (n)  (kStep only)
                             float* __restrict__ m,            // (n)  (kStep only)
                             float* __restrict__ v,            // (n)  (kStep only)
                             size_t n, AdamWParams p, bool vec) {
  using P4 = Pack<floatX, 4>;
  using F4 = Pack<float, 4>;
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (i < n) adamw_element<floatX, kStep>(param, master, grad, m, v, i, p);
    return;
  }
  const size_t i4 = 4 * i;
  if (i4 + 4 <= n) {
    F4 w, g, mm, vv;
    if constexpr (kIsBF16<floatX>) {
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
      if constexpr (kIsBF16<floatX>) w.store(master + i4);
    }
    P4 out;
#pragma unroll
    for (int k = 0; k < 4; k++) out.x[k] = round_param<floatX>(w.x[k], p.seed, p.offset + i4 + k);
    out.store(param + i4);
  } else {
    for (size_t k = i4; k < n; k++) adamw_element<floatX, kStep>(param, master, grad, m, v, k, p);
  }
}

// floatX = float: master must be null (param is the master). floatX = bf16: master (fp32) is updated and
// param refreshed from it with stochastic rounding (p.seed, p.offset).
template <class floatX>
void adamw_update(floatX* param, float* master, const float* grad, float* m, float* v, size_t n,
                  const AdamWParams& p, cudaStream_t stream) {
  if (n == 0) return;
  if (kIsBF16<floatX> == (master == nullptr))
    throw std::invalid_argument(kIsBF16<floatX> ? "adamw_update: bf16 parameters need fp32 master weights"
                                                : "adamw_update: fp32 parameters are their own master (pass null)");
  const bool vec = aligned_to<4 * sizeof(floatX)>(param) && aligned16(master, grad, m, v);
  LAUNCH((adamw_kernel<floatX, true>), ceil_div(vec ? (n + 3) / 4 : n, 256), 256, 0, stream, param, master, grad, m,
         v, n, p, vec);
  CUDA_CHECK_LAUNCH();
}

// param[i] = stochastic_round_bf16(master[i], seed, offset + i) (a plain copy when floatX = float);
// seed 0 = round to nearest even.
template <class floatX>
void cast_params(floatX* param, const float* master, size_t n, uint32_t seed, size_t offset, cudaStream_t stream) {
  if (n == 0) return;
  if constexpr (!kIsBF16<floatX>) {  // fp32: the parameters are the master weights
    (void)seed;
    (void)offset;
    if (param != master)
      CUDA_CHECK(cudaMemcpyAsync(param, master, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    return;
  } else {
    AdamWParams p{};
    p.seed = seed;
    p.offset = offset;
    // the kernel takes master non-const (the update writes it); with kStep = false it only reads it
    float* mw = const_cast<float*>(master);
    const bool vec = aligned_to<8>(param) && aligned16(master);
    LAUNCH((adamw_kernel<floatX, false>), ceil_div(vec ? (n + 3) / 4 : n, 256), 256, 0, stream, param, mw,
           static_cast<const float*>(nullptr), static_cast<float*>(nullptr), static_cast<float*>(nullptr), n, p, vec);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace gpt2::cuda
