// CPU backend ops: the reference every other backend is checked against.
// Templated on the scalar type: float for training, double for finite-difference tests.
// Compiled once per instruction-set variant (backend_cpu_impl.h), each in its own namespace
// gpt2::cpu::GPT2CORE_CPU_ISA, so that the variants' copies never meet at link time.
// Conventions (as in llm.c): outputs first, then inputs, then sizes; backward ops ACCUMULATE (+=)
// into parameter gradients and into dinp, so callers zero gradients once per optimizer step.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/blas.h"

#ifndef GPT2CORE_CPU_ISA
#error "cpu/ops.h is included by cpu/backend_cpu_impl.h, which names the variant's namespace"
#endif

namespace gpt2::cpu::GPT2CORE_CPU_ISA {

// exp for the hot loops (softmax, cross-entropy, GELU): Cephes' expf (range reduction by ln 2, a
// degree-5 polynomial, 2^n built in the exponent bits), about 1 ulp from expf over [-87, 88], and
// written so the compiler vectorises it (no libm call, no branches). Double stays on std::exp: it is
// the precision reference for tests.
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}
inline double fast_exp(double x) { return std::exp(x); }

// tanh through exp: 1 - 2 / (exp(2u) + 1); |u| > 9 is +-1 to fp32 precision.
inline float fast_tanh(float u) {
  u = u < -9.0f ? -9.0f : (u > 9.0f ? 9.0f : u);
  return 1.0f - 2.0f / (fast_exp(2.0f * u) + 1.0f);
}
inline double fast_tanh(double u) { return std::tanh(u); }

// out[b,t,:] = wte[inp[b,t],:] + wpe[t,:] (wpe null: rotary positions, out = wte[inp[b,t],:])
template <typename T>
void encoder_forward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn, int C) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++)
    for (int t = 0; t < Tn; t++) {
      T* o = out + ((size_t)b * Tn + t) * C;
      const T* we = wte + (size_t)inp[b * Tn + t] * C;
      if (wpe) {
        const T* pe = wpe + (size_t)t * C;
        for (int i = 0; i < C; i++) o[i] = we[i] + pe[i];
      } else {
        for (int i = 0; i < C; i++) o[i] = we[i];
      }
    }
}

// dwte[inp[b,t],:] += dout[b,t,:]; dwpe[t,:] += sum_b dout[b,t,:] (dwpe may be null). Deterministic: parallel
// over channels.
template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* inp, int B, int Tn, int C) {
#pragma omp parallel for
  for (int i = 0; i < C; i++)
    for (int b = 0; b < B; b++)
      for (int t = 0; t < Tn; t++) {
        T d = dout[((size_t)b * Tn + t) * C + i];
        dwte[(size_t)inp[b * Tn + t] * C + i] += d;
        if (dwpe) dwpe[(size_t)t * C + i] += d;
      }
}

// y = (x - mean) * rstd * w + b over the last dim, eps 1e-5 (b may be null: no bias); saves mean and rstd.
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* bias, int N, int C) {
  const T eps = T(1e-5);
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    const T* x = inp + (size_t)n * C;
    T m = 0;
    for (int i = 0; i < C; i++) m += x[i];
    m /= C;
    T v = 0;
    for (int i = 0; i < C; i++) { T d = x[i] - m; v += d * d; }
    v /= C;
    T s = T(1) / std::sqrt(v + eps);
    T* o = out + (size_t)n * C;
    if (bias) {
      for (int i = 0; i < C; i++) o[i] = (x[i] - m) * s * w[i] + bias[i];
    } else {
      for (int i = 0; i < C; i++) o[i] = (x[i] - m) * s * w[i];
    }
    mean[n] = m;
    rstd[n] = s;
  }
}

template <typename T>
void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w, const T* mean,
                        const T* rstd, int N, int C) {
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    const T* dy = dout + (size_t)n * C;
    const T* x = inp + (size_t)n * C;
    T* dx = dinp + (size_t)n * C;
    const T m = mean[n], s = rstd[n];
    T dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int i = 0; i < C; i++) {
      T norm = (x[i] - m) * s;
      T dnorm = w[i] * dy[i];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= C;
    dnorm_norm_mean /= C;
    for (int i = 0; i < C; i++) {
      T norm = (x[i] - m) * s;
      T dnorm = w[i] * dy[i];
      dx[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
  // parameter gradients: parallel over channels so the sum over rows is deterministic
#pragma omp parallel for
  for (int i = 0; i < C; i++) {
    T sw = 0, sb = 0;
    for (int n = 0; n < N; n++) {
      T dy = dout[(size_t)n * C + i];
      sw += (inp[(size_t)n * C + i] - mean[n]) * rstd[n] * dy;
      sb += dy;
    }
    dw[i] += sw;
    if (db) db[i] += sb;
  }
}

// out (N, OC) = inp (N, C) @ w^T + bias, w is (OC, C); bias may be null.
template <typename T>
void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) {
  if (bias) {
#pragma omp parallel for
    for (int n = 0; n < N; n++)
      for (int o = 0; o < OC; o++) out[(size_t)n * OC + o] = bias[o];
  }
  gemm(false, true, N, OC, C, T(1), inp, C, w, C, bias ? T(1) : T(0), out, OC);
}

// dinp (N, C) += dout @ w; dw (OC, C) += dout^T @ inp; dbias (OC) += sum_n dout. dbias may be null.
template <typename T>
void matmul_backward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int N, int C, int OC) {
  gemm(false, false, N, C, OC, T(1), dout, OC, w, C, T(1), dinp, C);
  gemm(true, false, OC, C, N, T(1), dout, OC, inp, C, T(1), dw, C);
  if (dbias) {
#pragma omp parallel for
    for (int o = 0; o < OC; o++) {
      T s = 0;
      for (int n = 0; n < N; n++) s += dout[(size_t)n * OC + o];
      dbias[o] += s;
    }
  }
}

// Causal multi-head attention over qkv (B, T, 3C) laid out [q | k | v], heads of size hs = C/NH.
// out (B, T, C); att (B, NH, T, T) keeps the softmax probabilities (row t valid for t2 <= t).
template <typename T>
void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH) {
  const int C3 = 3 * C, hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel for collapse(3)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++)
      for (int t = 0; t < Tn; t++) {
        const T* q = qkv + ((size_t)b * Tn + t) * C3 + h * hs;
        T* p = att + (((size_t)b * NH + h) * Tn + t) * Tn;
        T maxv = -INFINITY;
        for (int t2 = 0; t2 <= t; t2++) {
          const T* k = qkv + ((size_t)b * Tn + t2) * C3 + C + h * hs;
          T s = 0;
          for (int i = 0; i < hs; i++) s += q[i] * k[i];
          s *= scale;
          p[t2] = s;
          if (s > maxv) maxv = s;
        }
        T sum = 0;
        for (int t2 = 0; t2 <= t; t2++) { p[t2] = fast_exp(p[t2] - maxv); sum += p[t2]; }
        const T inv = T(1) / sum;
        for (int t2 = 0; t2 <= t; t2++) p[t2] *= inv;
        for (int t2 = t + 1; t2 < Tn; t2++) p[t2] = 0;
        T* o = out + ((size_t)b * Tn + t) * C + h * hs;
        for (int i = 0; i < hs; i++) o[i] = 0;
        for (int t2 = 0; t2 <= t; t2++) {
          const T* v = qkv + ((size_t)b * Tn + t2) * C3 + 2 * C + h * hs;
          const T a = p[t2];
          for (int i = 0; i < hs; i++) o[i] += a * v[i];
        }
      }
}

// dqkv += d(attention)/d(qkv) . dout. Parallel over (b, h): each task owns its head's dq/dk/dv slices.
template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* att, int B, int Tn, int C, int NH) {
  const int C3 = 3 * C, hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
  {
    std::vector<T> dp(Tn);
#pragma omp for collapse(2)
    for (int b = 0; b < B; b++)
      for (int h = 0; h < NH; h++)
        for (int t = 0; t < Tn; t++) {
          const T* p = att + (((size_t)b * NH + h) * Tn + t) * Tn;
          const T* dy = dout + ((size_t)b * Tn + t) * C + h * hs;
          const T* q = qkv + ((size_t)b * Tn + t) * C3 + h * hs;
          T* dq = dqkv + ((size_t)b * Tn + t) * C3 + h * hs;
          // dP = dY . V, and dV += P * dY
          T pdp = 0;
          for (int t2 = 0; t2 <= t; t2++) {
            const T* v = qkv + ((size_t)b * Tn + t2) * C3 + 2 * C + h * hs;
            T* dv = dqkv + ((size_t)b * Tn + t2) * C3 + 2 * C + h * hs;
            T s = 0;
            for (int i = 0; i < hs; i++) { s += dy[i] * v[i]; dv[i] += p[t2] * dy[i]; }
            dp[t2] = s;
            pdp += p[t2] * s;
          }
          // dS = P * (dP - sum(P dP)); dQ += scale dS K; dK += scale dS Q
          for (int t2 = 0; t2 <= t; t2++) {
            const T ds = p[t2] * (dp[t2] - pdp) * scale;
            const T* k = qkv + ((size_t)b * Tn + t2) * C3 + C + h * hs;
            T* dk = dqkv + ((size_t)b * Tn + t2) * C3 + C + h * hs;
            for (int i = 0; i < hs; i++) { dq[i] += ds * k[i]; dk[i] += ds * q[i]; }
          }
        }
  }
}

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
template <typename T>
void gelu_forward(T* out, const T* inp, size_t N) {
  const T s = std::sqrt(T(2) / T(M_PI));
#pragma omp parallel for
  for (size_t i = 0; i < N; i++) {
    T x = inp[i];
    out[i] = T(0.5) * x * (T(1) + fast_tanh(s * (x + T(0.044715) * x * x * x)));
  }
}

template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N) {
  const T s = std::sqrt(T(2) / T(M_PI));
#pragma omp parallel for
  for (size_t i = 0; i < N; i++) {
    T x = inp[i];
    T u = s * (x + T(0.044715) * x * x * x);
    T th = fast_tanh(u);
    T sech2 = T(1) - th * th;
    T grad = T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * s * (T(1) + T(3) * T(0.044715) * x * x);
    dinp[i] += grad * dout[i];
  }
}

template <typename T>
void residual_forward(T* out, const T* a, const T* b, size_t N) {
#pragma omp parallel for
  for (size_t i = 0; i < N; i++) out[i] = a[i] + b[i];
}

template <typename T>
void add_inplace(T* dst, const T* src, size_t N) {
#pragma omp parallel for
  for (size_t i = 0; i < N; i++) dst[i] += src[i];
}

// ---- the modern architecture (model/backend.h states each op's contract)

// RMSNorm without gain: rstd[n] = 1/sqrt(mean(x^2) + eps), out = x * rstd.
template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, int N, int C, double eps) {
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    const T* x = inp + (size_t)n * C;
    T ss = 0;
    for (int i = 0; i < C; i++) ss += x[i] * x[i];
    const T s = T(1) / std::sqrt(ss / T(C) + T(eps));
    T* o = out + (size_t)n * C;
    for (int i = 0; i < C; i++) o[i] = x[i] * s;
    rstd[n] = s;
  }
}

// dinp += rstd * (dout - xhat * mean(dout * xhat)), xhat = inp * rstd
template <typename T>
void rmsnorm_backward(T* dinp, const T* dout, const T* inp, const T* rstd, int N, int C) {
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    const T* dy = dout + (size_t)n * C;
    const T* x = inp + (size_t)n * C;
    T* dx = dinp + (size_t)n * C;
    const T s = rstd[n];
    T dot = 0;
    for (int i = 0; i < C; i++) dot += dy[i] * x[i] * s;
    dot /= C;
    for (int i = 0; i < C; i++) dx[i] += s * (dy[i] - x[i] * s * dot);
  }
}

// cos(theta), sign * sin(theta) of the position p for i < hs/2, theta = p * base^(-2i / hs) in double (the one formula
// of the training forward's table and of the KV cache's per-sequence positions, so that both round alike).
template <typename T>
void rope_table_row(T* cs, T* sn, long p, int hs, double base, int sign) {
  for (int i = 0; i < hs / 2; i++) {
    const double theta = double(p) * std::pow(base, -2.0 * i / hs);
    cs[i] = T(std::cos(theta));
    sn[i] = T(sign * std::sin(theta));
  }
}

// The rotation of one qkv row's q and k heads (the first 2C columns) by a table row (cs, sn of rope_table_row).
template <typename T>
void rope_rotate_row(T* row, const T* c, const T* s, int NH, int hs) {
  const int half = hs / 2;
  for (int h = 0; h < 2 * NH; h++) {  // q heads, then k heads
    T* x = row + (size_t)h * hs;
    for (int i = 0; i < half; i++) {
      const T x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c[i] - x2 * s[i];
      x[i + half] = x2 * c[i] + x1 * s[i];
    }
  }
}

// Rotary embedding in place on q and k of qkv (B, Tn, 3C); sign = +1 forward, -1 backward (the inverse rotation).
// cos and sin from theta in double, once per call: a (Tn, hs/2) table.
template <typename T>
void rope_apply(T* qkv, int B, int Tn, int C, int NH, int t0, double base, int sign) {
  const int hs = C / NH, half = hs / 2;
  std::vector<T> cs((size_t)Tn * half), sn((size_t)Tn * half);
  for (int t = 0; t < Tn; t++)
    rope_table_row(cs.data() + (size_t)t * half, sn.data() + (size_t)t * half, t0 + t, hs, base, sign);
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++)
    for (int t = 0; t < Tn; t++)
      rope_rotate_row(qkv + ((size_t)b * Tn + t) * 3 * C, cs.data() + (size_t)t * half, sn.data() + (size_t)t * half,
                      NH, hs);
}

// QK-norm in place: each head vector of q and k (the first 2C columns of a qkv row) RMS-normalised.
template <typename T>
void qk_norm_forward(T* qkv, T* rstd, int B, int Tn, int C, int NH, double eps) {
  const int hs = C / NH;
  const int R = B * Tn;
#pragma omp parallel for
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 2 * NH; j++) {
      T* x = qkv + (size_t)r * 3 * C + (size_t)j * hs;
      T ss = 0;
      for (int i = 0; i < hs; i++) ss += x[i] * x[i];
      const T s = T(1) / std::sqrt(ss / T(hs) + T(eps));
      for (int i = 0; i < hs; i++) x[i] *= s;
      rstd[(size_t)r * 2 * NH + j] = s;
    }
}

// in place on dq, dk: d <- rstd * (d - xhat * mean(d * xhat)), xhat = the normalised q / k in qkv
template <typename T>
void qk_norm_backward(T* dqkv, const T* qkv, const T* rstd, int B, int Tn, int C, int NH) {
  const int hs = C / NH;
  const int R = B * Tn;
#pragma omp parallel for
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 2 * NH; j++) {
      const T* xh = qkv + (size_t)r * 3 * C + (size_t)j * hs;
      T* d = dqkv + (size_t)r * 3 * C + (size_t)j * hs;
      const T s = rstd[(size_t)r * 2 * NH + j];
      T dot = 0;
      for (int i = 0; i < hs; i++) dot += d[i] * xh[i];
      dot /= hs;
      for (int i = 0; i < hs; i++) d[i] = s * (d[i] - xh[i] * dot);
    }
}

// relu(x)^2, and its backward (accumulating): dinp += 2 relu(x) dout
template <typename T>
void relu2_forward(T* out, const T* inp, size_t N) {
#pragma omp parallel for
  for (size_t i = 0; i < N; i++) {
    const T r = inp[i] > T(0) ? inp[i] : T(0);
    out[i] = r * r;
  }
}

template <typename T>
void relu2_backward(T* dinp, const T* inp, const T* dout, size_t N) {
#pragma omp parallel for
  for (size_t i = 0; i < N; i++) {
    const T r = inp[i] > T(0) ? inp[i] : T(0);
    dinp[i] += T(2) * r * dout[i];
  }
}

// in place: x = cap * tanh(x / cap)
template <typename T>
void softcap_forward(T* x, T cap, size_t n) {
  const T inv = T(1) / cap;
#pragma omp parallel for
  for (size_t i = 0; i < n; i++) x[i] = cap * fast_tanh(x[i] * inv);
}

// Softmax cross-entropy over the first V of Vp columns of each row of logits (N, Vp).
// losses[n] = logsumexp(logits[n,:V]) - logits[n, target]; target -1 marks an ignored row (loss 0).
// lse[n] is kept for the backward pass. Returns the number of non-ignored rows.
template <typename T>
long crossentropy_forward(T* losses, T* lse, const T* logits, const int32_t* targets, int N, int V, int Vp) {
  long valid = 0;
#pragma omp parallel for reduction(+ : valid)
  for (int n = 0; n < N; n++) {
    const T* row = logits + (size_t)n * Vp;
    T maxv = -INFINITY;
    for (int i = 0; i < V; i++) maxv = row[i] > maxv ? row[i] : maxv;
    T sum = 0;
    for (int i = 0; i < V; i++) sum += fast_exp(row[i] - maxv);
    const T l = maxv + std::log(sum);
    lse[n] = l;
    if (targets && targets[n] >= 0) {
      losses[n] = l - row[targets[n]];
      valid++;
    } else {
      losses[n] = 0;
    }
  }
  return valid;
}

// One valid row's dlogits in place (crossentropy_backward_inplace's rule): row holds the (capped) logits, l their
// log-sum-exp, tg the target; inv = 1 / cap (0: no cap).
template <typename T>
inline void crossentropy_grad_row(T* row, T l, int tg, T dloss, int V, int Vp, T cap, T inv) {
  if (cap > T(0)) {
    for (int i = 0; i < V; i++) {
      const T u = row[i] * inv;
      row[i] = (fast_exp(row[i] - l) - (i == tg ? T(1) : T(0))) * dloss * (T(1) - u * u);
    }
  } else {
    for (int i = 0; i < V; i++) row[i] = fast_exp(row[i] - l) * dloss;
    row[tg] -= dloss;
  }
  for (int i = V; i < Vp; i++) row[i] = 0;
}

// In place: logits (N, Vp) become dlogits = (softmax - onehot) * dloss for valid rows, 0 elsewhere,
// and 0 in the padded columns V..Vp-1.
// cap > 0: the logits held are capped, c = cap * tanh(z / cap), and the gradient is the one with respect to z:
// (softmax(c) - onehot) * dloss * (1 - (c / cap)^2).
template <typename T>
void crossentropy_backward_inplace(T* logits, const T* lse, const int32_t* targets, T dloss, int N, int V, int Vp,
                                   T cap = T(0)) {
  const T inv = cap > T(0) ? T(1) / cap : T(0);
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    T* row = logits + (size_t)n * Vp;
    if (targets[n] < 0) {
      for (int i = 0; i < Vp; i++) row[i] = 0;
      continue;
    }
    const T l = lse[n];
    const int tg = targets[n];
    crossentropy_grad_row(row, l, tg, dloss, V, Vp, cap, inv);
  }
}

// crossentropy_forward then crossentropy_backward_inplace (with the soft-cap: softcap_forward first), one row at a
// time: the row's passes (cap + max, sum of exponentials, gradient) run while its Vp values sit in the core's cache
// instead of three sweeps over the whole (N, Vp) logits, with the same per-value arithmetic in the same order (the
// same bits as the separate ops). logits hold the RAW z; targets not null; dloss as crossentropy_backward's.
template <typename T>
void crossentropy_forward_backward_rows(T* losses, T* lse, T* logits, const int32_t* targets, T dloss, int N, int V,
                                        int Vp, T cap = T(0)) {
  const T inv = cap > T(0) ? T(1) / cap : T(0);
#pragma omp parallel for
  for (int n = 0; n < N; n++) {
    T* row = logits + (size_t)n * Vp;
    // the cap in a loop of its own: a map the compiler vectorises (fused with the max's reduction it stayed scalar,
    // and the fused loss cost more than the separate ops it replaces); the row is still in cache for the max
    if (cap > T(0))
      for (int i = 0; i < V; i++) row[i] = cap * fast_tanh(row[i] * inv);
    T maxv = -INFINITY;
    for (int i = 0; i < V; i++) maxv = row[i] > maxv ? row[i] : maxv;
    T sum = 0;
    for (int i = 0; i < V; i++) sum += fast_exp(row[i] - maxv);
    const T l = maxv + std::log(sum);
    lse[n] = l;
    const int tg = targets[n];
    if (tg < 0) {
      losses[n] = 0;
      for (int i = 0; i < Vp; i++) row[i] = 0;
      continue;
    }
    losses[n] = l - row[tg];
    crossentropy_grad_row(row, l, tg, dloss, V, Vp, cap, inv);
  }
}

}  // namespace gpt2::cpu::GPT2CORE_CPU_ISA
