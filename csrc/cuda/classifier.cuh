// Fused classifier: softmax cross-entropy over the first V of Vp columns of each row of logits (N, Vp).
//   forward:  lse[n] = logsumexp(logits[n, :V]); losses[n] = lse[n] - logits[n, target[n]], or 0 where
//             the target is -1 (ignored) or targets is null; counts the non-ignored rows (integer atomics).
//   backward (in place): logits[n, i] becomes (softmax - onehot(target)) * dloss for i < V of valid rows,
//             0 in the padded columns V..Vp-1 and in ignored rows; dloss = grad_scale * loss_scale / count with
//             the count of valid rows and the loss scale (dynamic loss scaling; null: 1) read from device memory
//             when the kernel runs (no host round trip; a graph replay sees each step's scale), in double, rounded
//             once.
//   loss:     *acc += scale * sum(losses) / count (the mean loss, accumulated over micro-steps).
//   soft-cap (cap > 0; Gemma 2, modded-nanogpt): c = cap * tanh(z / cap) of the raw logits z is what the softmax
//             reads, and d/dz = d/dc * (1 - tanh^2(z / cap)) = d/dc * (1 - (c / cap)^2):
//     softcap_forward:  logits = c, in place (elementwise; eval and generation read capped logits);
//     crossentropy_backward with softcap: the logits hold c (softcap_forward's output): dlogits carry the factor
//             1 - (c / cap)^2 computed from c;
//     crossentropy_forward_backward with softcap: the logits hold z; the fused pass caps each value as it reads it
//             (losses and lse are those of c) and writes d/dz.
//   forward_backward (training, fused): a small kernel counts the valid rows first, then one kernel per row
//             computes lse and the loss (reading the row once), then turns the row into dlogits (its second read,
//             by the same threads moments later, meets the cache: one row is 100 KB at Vp = 50304 bf16 and a
//             1024-thread block per row (768 on sm_86 / sm_89) keeps about 2 rows per SM in flight, 26 MB on an H100, in its 50 MB L2),
//             as llm.c's fused classifier.
// One block per row; forward reads the row once (online max/sum), backward reads and writes it once, 16 bytes
// per access (Vec<floatX>) when every row starts 16-byte aligned, one value per access otherwise;
// softmax statistics in fp32 with a fixed-order block reduction. logits have the storage type floatX (float
// or bf16; widened to fp32 on load, the gradient rounded once to floatX on store); losses and lse are fp32.
#pragma once
#include "cuda/common.cuh"

namespace gpt2::cuda {

constexpr int kClassifierBlock = 512;       // crossentropy_forward / _backward: one block per row
constexpr int kClassifierFusedBlock = 1024; // crossentropy_forward_backward's largest block (see its launcher)
constexpr int kClassifierOneBlock = 1024;   // the single-block kernels: count and loss_accumulate
constexpr int kSoftcapBlock = 256;          // softcap_forward: elementwise

// Online softmax: (m, s) holds the running max and the sum of exp(x - m); adding values rescales s once when
// the max grows.
__device__ inline void online_add(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;
    m = x;
  } else {
    s += expf(x - m);
  }
}
template <int K>
__device__ inline void online_add(float& m, float& s, const float (&v)[K]) {
  float vm = v[0];
#pragma unroll
  for (int k = 1; k < K; k++) vm = fmaxf(vm, v[k]);
  if (vm > m) {
    s *= expf(m - vm);
    m = vm;
  }
#pragma unroll
  for (int k = 0; k < K; k++) s += expf(v[k] - m);
}

// The map from the value in the logits buffer to what the softmax reads, and its derivative: the identity (GPT-2),
// the soft-cap of raw logits (SoftCap), or already-capped logits whose derivative is still owed (Capped).
struct NoCap {
  __device__ float operator()(float x) const { return x; }
  __device__ float operator()(float x, float& grad) const {
    grad = 1.0f;
    return x;
  }
};
struct SoftCap {
  float cap, inv;  // cap and 1 / cap
  __device__ float operator()(float x) const { return cap * tanhf(x * inv); }
  __device__ float operator()(float x, float& grad) const {  // grad: d cap tanh(x / cap) / dx = 1 - tanh^2
    const float t = tanhf(x * inv);
    grad = 1.0f - t * t;
    return cap * t;
  }
};
inline SoftCap soft_cap(float cap) { return SoftCap{cap, 1.0f / cap}; }
struct Capped {
  float inv;  // 1 / cap
  __device__ float operator()(float c) const { return c; }
  __device__ float operator()(float c, float& grad) const {  // 1 - tanh^2 = 1 - (c / cap)^2
    const float t = c * inv;
    grad = 1.0f - t * t;
    return c;
  }
};

// vec (Vp % K == 0 and logits 16-byte aligned, K = kVec<floatX>: every row starts 16-byte aligned): the
// threads stride over the V / K whole vectors below V as Vec<floatX>, then one value at a time over the
// ragged columns up to V; otherwise one value at a time over [0, V). Fixed per-thread order, so deterministic.
// The logsumexp of row[0, V), returned to every thread of the block. scratch: 32 floats of shared memory.
template <class floatX, class Cap>
__device__ inline float row_logsumexp(const floatX* row, int V, bool vec, float* scratch, Cap cap) {
  using P = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  // one pass over the row: each thread keeps a running (max, sum) pair, then the block combines the pairs
  float tm = -INFINITY, ts = 0.0f;
  const int VV = vec ? V / K : 0;  // whole vectors below V
  for (int i = threadIdx.x; i < VV; i += blockDim.x) {
    const P p = P::load(row + K * i);
    float v[K];
#pragma unroll
    for (int k = 0; k < K; k++) v[k] = cap(p.f(k));
    online_add(tm, ts, v);
  }
  for (int i = K * VV + threadIdx.x; i < V; i += blockDim.x) online_add(tm, ts, cap(load_f(row[i])));
  const float m = block_max(tm, scratch);
  const float s = block_sum(tm == -INFINITY ? 0.0f : ts * expf(tm - m), scratch);
  return m + logf(s);
}

template <class floatX, class Cap>
__global__ void __launch_bounds__(kClassifierBlock) crossentropy_forward_kernel(float* __restrict__ losses,         // (N)
                                            float* __restrict__ lse,            // (N)
                                            int* __restrict__ valid,            // (1), incremented
                                            const floatX* __restrict__ logits,  // (N, Vp)
                                            const int* __restrict__ targets,   // (N) or null
                                            int V, int Vp, bool vec, Cap cap) {
  __shared__ float scratch[32];
  const int n = blockIdx.x;
  const floatX* row = logits + size_t(n) * Vp;
  const float l = row_logsumexp(row, V, vec, scratch, cap);
  if (threadIdx.x == 0) {
    lse[n] = l;
    const int t = targets ? targets[n] : -1;
    if (t >= 0) {
      losses[n] = l - cap(load_f(row[t]));
      atomicAdd(valid, 1);
    } else {
      losses[n] = 0.0f;
    }
  }
}

// vec (as in the forward): Vec<floatX> read-modify-write over the whole vectors below V, one value at a time
// over [K * (V / K), K * ceil(V / K)) (the ragged columns and the padding that shares their vector), then Vec
// zero stores over the remaining padded vectors; ignored rows are zero stores only (nothing is read).
// Otherwise one value at a time over [0, Vp).
// row (Vp values) becomes (softmax - onehot(t)) * dloss below V, 0 in the padding; all 0 when t < 0.
template <class floatX, class Cap>
__device__ inline void row_dlogits(floatX* row, float l, int t, float dloss, int V, int Vp, bool vec, Cap cap) {
  using P = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  const int VV = vec && t >= 0 ? V / K : 0;               // vectors computed
  const int VZ = vec && t >= 0 ? (V + K - 1) / K : 0;     // first all-zero vector
  for (int i = threadIdx.x; i < VV; i += blockDim.x) {
    P v = P::load(row + K * i);
#pragma unroll
    for (int k = 0; k < K; k++) {
      float g;
      float d = expf(cap(v.f(k), g) - l) * dloss;
      if (K * i + k == t) d -= dloss;
      v.set(k, d * g);
    }
    v.store(row + K * i);
  }
  const int end = vec ? K * VZ : Vp;
  for (int i = K * VV + threadIdx.x; i < end; i += blockDim.x) {
    float d = 0.0f;
    if (t >= 0 && i < V) {
      float g;
      d = expf(cap(load_f(row[i]), g) - l) * dloss;
      if (i == t) d -= dloss;
      d *= g;
    }
    row[i] = store_t<floatX>(d);
  }
  if (vec) {
    P z;
#pragma unroll
    for (int k = 0; k < K; k++) z.set(k, 0.0f);
    for (int i = VZ + threadIdx.x; i < Vp / K; i += blockDim.x) z.store(row + K * i);
  }
}

// dloss = grad_scale * loss_scale / count, in double and rounded once; 0 without valid rows. loss_scale: the
// dynamic loss scale in device memory (null: 1), read when the kernel runs, so a graph replay sees each step's.
__device__ inline float dloss_of(float grad_scale, const float* loss_scale, int count) {
  const double scale = loss_scale ? double(*loss_scale) : 1.0;
  return count > 0 ? float(double(grad_scale) * scale / double(count)) : 0.0f;
}

template <class floatX, class Cap>
__global__ void __launch_bounds__(kClassifierBlock) crossentropy_backward_kernel(floatX* __restrict__ logits,           // (N, Vp), in place
                                             const float* __restrict__ lse,         // (N)
                                             const int* __restrict__ targets,       // (N)
                                             const int* __restrict__ count,         // (1) valid rows
                                             const float* __restrict__ loss_scale,  // (1) or null: 1
                                             float grad_scale, int V, int Vp, bool vec, Cap cap) {
  const int n = blockIdx.x;
  row_dlogits(logits + size_t(n) * Vp, lse[n], targets[n], dloss_of(grad_scale, loss_scale, *count), V, Vp, vec,
              cap);
}

// One block: *count = the number of targets >= 0, a fixed-order integer sum.
__global__ void __launch_bounds__(kClassifierOneBlock) crossentropy_count_kernel(int* __restrict__ count, const int* __restrict__ targets, int N) {
  __shared__ int scratch[32];
  int c = 0;
  for (int i = threadIdx.x; i < N; i += blockDim.x) c += targets[i] >= 0;
  c = block_sum(c, scratch);
  if (threadIdx.x == 0) *count = c;
}

// forward and backward of one row in one block: lse and the loss, then dlogits in place (count already known).
template <class floatX, class Cap>
__global__ void __launch_bounds__(kClassifierFusedBlock) crossentropy_forward_backward_kernel(float* __restrict__ losses,        // (N)
                                                     float* __restrict__ lse,           // (N)
                                                     floatX* __restrict__ logits,       // (N, Vp), in place
                                                     const int* __restrict__ targets,  // (N)
                                                     const int* __restrict__ count,    // (1) valid rows
                                                     const float* __restrict__ loss_scale,  // (1) or null: 1
                                                     float grad_scale, int V, int Vp, bool vec, Cap cap) {
  __shared__ float scratch[32];
  const int n = blockIdx.x;
  floatX* row = logits + size_t(n) * Vp;
  const int t = targets[n];
  const float l = row_logsumexp(row, V, vec, scratch, cap);
  if (threadIdx.x == 0) {
    lse[n] = l;
    losses[n] = t >= 0 ? l - cap(load_f(row[t])) : 0.0f;
  }
  __syncthreads();  // row[t] is read before any thread overwrites it
  row_dlogits(row, l, t, dloss_of(grad_scale, loss_scale, *count), V, Vp, vec, cap);
}

// One block: *acc += scale * (sum of losses in a fixed order) / *count, in double until the one rounding of *acc.
__global__ void __launch_bounds__(kClassifierOneBlock) loss_accumulate_kernel(float* __restrict__ acc, const float* __restrict__ losses,
                                       const int* __restrict__ count, int N, float scale) {
  __shared__ double scratch[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < N; i += blockDim.x) s += double(losses[i]);
  s = block_sum(s, scratch);
  if (threadIdx.x == 0 && *count > 0) *acc = float(double(*acc) + double(scale) * (s / double(*count)));
}

// logits = cap * tanh(logits / cap), in place. vec: thread e handles values K*e .. K*e+K-1 (K = kVec<floatX>) as one
// Vec (16-byte aligned), the last thread the tail; otherwise one value per thread.
template <class floatX>
__global__ void __launch_bounds__(kSoftcapBlock) softcap_forward_kernel(floatX* __restrict__ logits,  // (total), in place
                                       size_t total, SoftCap cap, bool vec) {
  using P = Vec<floatX>;
  constexpr int K = kVec<floatX>;
  // e, total: not i, n, which index rows and columns above (test_index_width.py takes a name declared size_t
  // anywhere in a file as 64-bit there)
  const size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!vec) {
    if (e < total) logits[e] = store_t<floatX>(cap(load_f(logits[e])));
    return;
  }
  const size_t iv = K * e;
  if (iv + K <= total) {
    P v = P::load(logits + iv);
#pragma unroll
    for (int k = 0; k < K; k++) v.set(k, cap(v.f(k)));
    v.store(logits + iv);
  } else {
    for (size_t j = iv; j < total; j++) logits[j] = store_t<floatX>(cap(load_f(logits[j])));
  }
}

// ----------------------------------------------------------------------------------------- launchers
template <class floatX>
void softcap_forward(floatX* logits, float cap, size_t total, cudaStream_t stream) {
  if (total == 0) return;
  constexpr int K = kVec<floatX>;
  const bool vec = aligned16(logits);
  LAUNCH(softcap_forward_kernel<floatX>, ceil_div(vec ? (total + K - 1) / K : total, kSoftcapBlock), kSoftcapBlock, 0, stream, logits, total,
         soft_cap(cap), vec);
  CUDA_CHECK_LAUNCH();
}

// Counts the non-ignored rows into *valid_dev (one device int) without reading it back.
template <class floatX>
void crossentropy_forward(float* losses, float* lse, const floatX* logits, const int* targets, int* valid_dev, int N,
                          int V, int Vp, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(valid_dev, 0, sizeof(int), stream));
  if (N <= 0) return;
  const bool vec = Vp % kVec<floatX> == 0 && aligned16(logits);
  LAUNCH((crossentropy_forward_kernel<floatX, NoCap>), N, kClassifierBlock, 0, stream, losses, lse, valid_dev, logits,
         targets, V, Vp, vec, NoCap{});
  CUDA_CHECK_LAUNCH();
}

// softcap > 0: the logits hold softcap_forward's output c, and dlogits are d/dz of the raw logits z.
// count: a device int of valid rows; loss_scale: a device float or null; dloss = grad_scale * *loss_scale / *count
// on the device.
template <class floatX>
void crossentropy_backward(floatX* logits, const float* lse, const int* targets, const int* count,
                           const float* loss_scale, float grad_scale, int N, int V, int Vp, cudaStream_t stream,
                           float softcap = 0.0f) {
  if (N <= 0) return;
  const bool vec = Vp % kVec<floatX> == 0 && aligned16(logits);
  if (softcap > 0.0f)  // the logits hold softcap_forward's capped values
    LAUNCH((crossentropy_backward_kernel<floatX, Capped>), N, kClassifierBlock, 0, stream, logits, lse, targets,
           count, loss_scale, grad_scale, V, Vp, vec, Capped{1.0f / softcap});
  else
    LAUNCH((crossentropy_backward_kernel<floatX, NoCap>), N, kClassifierBlock, 0, stream, logits, lse, targets, count,
           loss_scale, grad_scale, V, Vp, vec, NoCap{});
  CUDA_CHECK_LAUNCH();
}

// The fused kernel's block on the current device: 1024 threads where an SM holds a whole number of such blocks
// (sm_75: 1024 threads per SM, sm_80 / sm_90: 2048), 768 where it holds 1536 (sm_86 / sm_89: a 1024-thread block
// would leave a third of the SM idle; llm.c uses 768 there). The row's reductions are fixed-order per block
// size, so the loss bits depend on the GPU family, as the matmuls' do.
inline int classifier_fused_block() {
  int device = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return kClassifierFusedBlock;
  }
  return per_sm % kClassifierFusedBlock == 0 ? kClassifierFusedBlock : 768;
}

// The training pass: *valid_dev = number of valid targets, then losses, lse and dlogits (in place) in one pass;
// loss_scale as in crossentropy_backward. softcap > 0: the logits hold the raw z, capped as they are read.
template <class floatX>
void crossentropy_forward_backward(float* losses, float* lse, floatX* logits, const int* targets, int* valid_dev,
                                   const float* loss_scale, float grad_scale, int N, int V, int Vp,
                                   cudaStream_t stream, float softcap = 0.0f) {
  LAUNCH(crossentropy_count_kernel, 1, kClassifierOneBlock, 0, stream, valid_dev, targets, N);
  CUDA_CHECK_LAUNCH();
  if (N <= 0) return;
  const bool vec = Vp % kVec<floatX> == 0 && aligned16(logits);
  if (softcap > 0.0f)
    LAUNCH((crossentropy_forward_backward_kernel<floatX, SoftCap>), N, classifier_fused_block(), 0, stream, losses, lse,
           logits, targets, valid_dev, loss_scale, grad_scale, V, Vp, vec, soft_cap(softcap));
  else
    LAUNCH((crossentropy_forward_backward_kernel<floatX, NoCap>), N, classifier_fused_block(), 0, stream, losses, lse,
           logits, targets, valid_dev, loss_scale, grad_scale, V, Vp, vec, NoCap{});
  CUDA_CHECK_LAUNCH();
}

inline void loss_accumulate(float* acc, const float* losses, const int* count, int N, float scale,
                            cudaStream_t stream) {
  LAUNCH(loss_accumulate_kernel, 1, kClassifierOneBlock, 0, stream, acc, losses, count, N, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace gpt2::cuda
