// Muon's elementwise kernels (the math: model/optimizer.h; the Newton-Schulz GEMMs go through the cuBLASLt seam,
// backend_cuda.cu). Every kernel reads the step's values from a StepState in device memory (a captured step reads
// each step's values at replay) and writes nothing when update_factor says the norm is not finite.
//   muon_momentum_kernel:  over a table of segments (as AdamW's), g = grad * factor:
//                          mom = mom + (1 - beta) (g - mom); grad = nesterov ? g + beta (mom - g) : mom
//   muon_normalize_kernel: x (bf16) = u / (sqrt(sumsq) + eps)          (sumsq: of u, in double, device memory)
//   muon_scale_kernel:     y (bf16) = alpha * x (bf16), the fp32 product rounded once
//   muon_store_kernel:     u (fp32) = x (bf16)                          (the orthogonalised update, back in place)
//   (these three over a batch of matrices: blockIdx.y is the matrix, each array's entries `stride` apart)
//   muon_apply_kernel:     w = w (1 - lr decay) - lr scale x; param = round_param(w, seed, offset + i) (as AdamW's
//                          write of a bf16/fp16 copy; fp32: param is w)
#pragma once
#include <algorithm>
#include <string>
#include <utility>

#include "cuda/adamw.cuh"
#include "cuda/common.cuh"
#include "cuda/global_norm.cuh"
#include "cuda/matmul.cuh"
#include "model/optimizer.h"

namespace gpt2::cuda {

constexpr int kMuonBlock = 256;  // threads per block of this file's kernels (launch bounds)
__global__ void __launch_bounds__(kMuonBlock) muon_momentum_kernel(float* __restrict__ grad,  // (N) flat: in g, out the update
                                     float* __restrict__ mom,   // (N) flat
                                     AdamWTable table, bool nesterov, const StepState* step) {
  float factor;
  if (!update_factor(step->args, step->scaler.scale, &factor)) return;
  const float beta = step->args.muon_beta;
  const int s = blockIdx.y;
  const size_t b = table.begin[s], n = table.end[s] - b;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = grad[b + i] * factor;
    const float m = mom[b + i] + (1.0f - beta) * (g - mom[b + i]);
    mom[b + i] = m;
    grad[b + i] = nesterov ? g + beta * (m - g) : m;
  }
}

template <class xT>
__global__ void __launch_bounds__(kMuonBlock) muon_normalize_kernel(xT* __restrict__ x,          // (batch, x_stride)
                                      const float* __restrict__ u,  // (batch, n)
                                      const double* __restrict__ sumsq,  // (batch, sumsq_stride)
                                      size_t n, size_t x_stride, size_t sumsq_stride) {
  x += blockIdx.y * x_stride, u += blockIdx.y * n;
  const float inv = 1.0f / (float(sqrt(sumsq[blockIdx.y * sumsq_stride])) + float(kMuonNormEps));
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = store_t<xT>(u[i] * inv);
}

template <class xT>
__global__ void __launch_bounds__(kMuonBlock) muon_scale_kernel(xT* __restrict__ y, const xT* __restrict__ x, float alpha, size_t n,
                                  size_t stride) {
  y += blockIdx.y * stride, x += blockIdx.y * stride;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] = store_t<xT>(alpha * load_f(x[i]));
}

template <class xT>
__global__ void __launch_bounds__(kMuonBlock) muon_store_kernel(float* __restrict__ u, const xT* __restrict__ x, size_t n, size_t x_stride,
                                  const StepState* step) {
  float factor;
  if (!update_factor(step->args, step->scaler.scale, &factor)) return;
  u += blockIdx.y * n, x += blockIdx.y * x_stride;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    u[i] = load_f(x[i]);
}

template <class floatX>
__global__ void __launch_bounds__(kMuonBlock) muon_apply_kernel(floatX* __restrict__ param,   // (n)
                                  float* __restrict__ master,   // (n), null when floatX = float
                                  const float* __restrict__ x,  // (n) the orthogonalised update
                                  size_t n, size_t offset, float decay, float scale, const StepState* step) {
  float factor;
  if (!update_factor(step->args, step->scaler.scale, &factor)) return;
  const float lr = step->args.muon_lr;
  const uint32_t seed = step->args.seed;
  const float keep = 1.0f - lr * decay, by = lr * scale;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float w = kIs16Bit<floatX> ? master[i] : load_f(param[i]);
    w = w * keep - by * x[i];
    param[i] = round_param<floatX>(w, seed, offset + i);
    if constexpr (kIs16Bit<floatX>) master[i] = w;
  }
}

// ----------------------------------------------------------------------------------------- launchers
inline int muon_blocks(size_t n) { return std::max(1, std::min(ceil_div(n, 256), 1024)); }

inline void muon_momentum(float* grad, float* mom, const AdamWSpan* spans, int count, bool nesterov,
                          const StepState* step, cudaStream_t stream) {
  if (count > kAdamWMaxSegments)
    throw std::invalid_argument("muon_momentum: at most " + std::to_string(kAdamWMaxSegments) + " segments");
  AdamWTable t;
  size_t most = 0;
  for (int i = 0; i < count; i++) {
    if (spans[i].end <= spans[i].begin) continue;
    const int s = t.count++;
    t.begin[s] = spans[i].begin;
    t.end[s] = spans[i].end;
    t.decay[s] = 0.0f;
    t.group[s] = kLrRest;
    t.vec[s] = false;
    most = std::max(most, spans[i].end - spans[i].begin);
  }
  if (t.count == 0) return;
  LAUNCH(muon_momentum_kernel, dim3(muon_blocks(most), t.count), kMuonBlock, 0, stream, grad, mom, t, nesterov, step);
  CUDA_CHECK_LAUNCH();
}

// The launchers of a batch (batch >= 1 matrices; the strides as the kernels')
template <class xT>
void muon_normalize(xT* x, const float* u, const double* sumsq, size_t n, int batch, size_t x_stride,
                    size_t sumsq_stride, cudaStream_t stream) {
  if (n == 0 || batch == 0) return;
  LAUNCH(muon_normalize_kernel<xT>, dim3(muon_blocks(n), batch), kMuonBlock, 0, stream, x, u, sumsq, n, x_stride,
         sumsq_stride);
  CUDA_CHECK_LAUNCH();
}

template <class xT>
void muon_scale(xT* y, const xT* x, float alpha, size_t n, int batch, size_t stride, cudaStream_t stream) {
  if (n == 0 || batch == 0) return;
  LAUNCH(muon_scale_kernel<xT>, dim3(muon_blocks(n), batch), kMuonBlock, 0, stream, y, x, alpha, n, stride);
  CUDA_CHECK_LAUNCH();
}

template <class xT>
void muon_store(float* u, const xT* x, size_t n, int batch, size_t x_stride, const StepState* step,
                cudaStream_t stream) {
  if (n == 0 || batch == 0) return;
  LAUNCH(muon_store_kernel<xT>, dim3(muon_blocks(n), batch), kMuonBlock, 0, stream, u, x, n, x_stride, step);
  CUDA_CHECK_LAUNCH();
}

template <class floatX>
void muon_apply(floatX* param, float* master, const float* x, size_t n, size_t offset, float decay, float scale,
                const StepState* step, cudaStream_t stream) {
  if (kIs16Bit<floatX> == (master == nullptr))
    throw std::invalid_argument(kIs16Bit<floatX> ? "muon_apply: bf16 / fp16 parameters need fp32 master weights"
                                                : "muon_apply: fp32 parameters are their own master (pass null)");
  if (n == 0) return;
  LAUNCH(muon_apply_kernel<floatX>, muon_blocks(n), kMuonBlock, 0, stream, param, master, x, n, offset, decay, scale, step);
  CUDA_CHECK_LAUNCH();
}

// Newton-Schulz in bf16 (the iterate X, the Gram matrix A and B = b A + c A A stored in bf16; products through
// the matmul seam, accumulated in fp32 and rounded once) of `batch` matrices of one shape at once: x (batch, rows,
// cols), fp32, in place, each matrix as alone (Backend::muon_orthogonalize_batch). Wide or square (rows <= cols):
// A = X X^T, X = a X + B X; tall: A = X^T X, X = a X + X B. Each product is one strided-batched call with
// batch_invariant set (seams.h), and every bf16 array starts on a 256-byte boundary whatever the batch (each
// matrix's slot padded to kMuonSlot elements, the scratch itself from cudaMalloc), so a matrix gets the bits it
// gets alone. scratch (muon_ns_scratch_floats(batch, ...)): bf16 X, Y (batch slots of n each), A, B (batch slots
// of k*k each); then the sums of squares, a double per matrix.
constexpr size_t kMuonSlot = 128;  // bf16 elements: 256 bytes
inline size_t muon_slot(size_t elements) { return (elements + kMuonSlot - 1) / kMuonSlot * kMuonSlot; }
inline size_t muon_ns_sumsq_at(int batch, int rows, int cols) {  // floats before the sums of squares
  const size_t n = size_t(rows) * cols, k = size_t(std::min(rows, cols));
  return size_t(batch) * (muon_slot(n) + muon_slot(k * k));  // 2 * batch * (slots) bf16
}
inline size_t muon_ns_scratch_floats(int batch, int rows, int cols) {
  return muon_ns_sumsq_at(batch, rows, cols) + 2 * size_t(batch);
}
// The most matrices of one shape a batch holds: as many as fit in kMuonBatchBytes of scratch (at least one), so the
// scratch stays a small workspace the memory plan need not count (d12's 768 x 768: 13 a batch, 468 tiles of 128 x 128
// per product, several waves of an H100's SMs; GPT-2 XL's 1600 x 1600: 3)
constexpr size_t kMuonBatchBytes = size_t(64) << 20;
inline int muon_ns_batch_cap(int rows, int cols) {
  return int(std::max<size_t>(1, kMuonBatchBytes / (muon_ns_scratch_floats(1, rows, cols) * sizeof(float))));
}

inline void muon_newton_schulz(float* x, float* scratch, int batch, int rows, int cols, int steps, double* norm_work,
                               const StepState* step, cudaStream_t stream) {
  using gpt2core::seams::DType;
  using gpt2core::seams::MatmulParams;
  if (batch <= 0) return;
  const size_t n = size_t(rows) * cols;
  const int k = std::min(rows, cols);
  const bool tall = rows > cols;
  const size_t sx = muon_slot(n), sa = muon_slot(size_t(k) * k);  // the slots: X, Y's and A, B's strides
  bf16* X = reinterpret_cast<bf16*>(scratch);
  bf16* Y = X + batch * sx;
  bf16* A = Y + batch * sx;
  bf16* Bm = A + batch * sa;
  double* ss = reinterpret_cast<double*>(scratch + muon_ns_sumsq_at(batch, rows, cols));
  for (int b = 0; b < batch; b++) sum_squares_into(ss + b, x + b * n, n, norm_work, stream);
  muon_normalize(X, x, ss, n, batch, sx, 1, stream);
  auto base = [&](void* d, int ldd, long long sd, const void* a, int lda, long long sa_, bool ta, const void* b,
                  int ldb, long long sb, bool tb, int m, int nn, int kk) {
    MatmulParams p;
    p.d = d, p.ldd = ldd, p.d_type = DType::BF16;
    p.a = a, p.lda = lda, p.trans_a = ta, p.a_type = DType::BF16;
    p.b = b, p.ldb = ldb, p.trans_b = tb, p.b_type = DType::BF16;
    p.m = m, p.n = nn, p.k = kk;
    p.batch = batch, p.stride_d = sd, p.stride_a = sa_, p.stride_b = sb;
    p.batch_invariant = true;
    p.stream = stream;
    return p;
  };
  const long long lx = (long long)sx, la = (long long)sa;
  for (int s = 0; s < steps; s++) {
    // A (k, k) = X X^T (wide) or X^T X (tall)
    MatmulParams g = tall ? base(A, k, la, X, cols, lx, true, X, cols, lx, false, k, k, rows)
                          : base(A, k, la, X, cols, lx, false, X, cols, lx, true, k, k, cols);
    MATMUL_CHECK(gpt2core::seams::matmul(g), "muon gram");
    muon_scale(Bm, A, float(kMuonB), size_t(k) * k, batch, sa, stream);
    MatmulParams q = base(Bm, k, la, A, k, la, false, A, k, la, false, k, k, k);  // B += c A A
    q.alpha = float(kMuonC);
    q.accumulate = true;
    MATMUL_CHECK(gpt2core::seams::matmul(q), "muon quintic");
    muon_scale(Y, X, float(kMuonA), n, batch, sx, stream);
    MatmulParams u = tall ? base(Y, cols, lx, X, cols, lx, false, Bm, k, la, false, rows, cols, cols)   // Y += X B
                          : base(Y, cols, lx, Bm, k, la, false, X, cols, lx, false, rows, cols, rows);  // Y += B X
    u.accumulate = true;
    MATMUL_CHECK(gpt2core::seams::matmul(u), "muon update");
    std::swap(X, Y);
  }
  muon_store(x, X, n, batch, sx, step, stream);
}

}  // namespace gpt2::cuda
