// seams.cpp: the emulated library seams (csrc/cuda/seams.h) against double-precision references:
// matmul with every transpose, bias / GELU / GELU-backward epilogues, accumulation, batching, fp32 and
// bf16 outputs; causal attention forward, and backward against finite differences of the reference.
// Host-only (not a kernel file), so not part of the nvcc compile check.
#include "cuda/seams.h"
#include "cuda/seams_check.h"
#include "check.h"

#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace gpt2core::seams;


static std::vector<float> rnd(size_t n, unsigned seed) {
  std::vector<float> v(n);
  unsigned s = seed * 2654435761u + 1u;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>(s >> 8) / 8388608.0f - 1.0f;
  }
  return v;
}
static double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
static double gelu_grad(double x) {
  const double h = 1e-5;
  return (gelu(x + h) - gelu(x - h)) / (2 * h);
}
static float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

static void test_matmul() {
  const int m = 13, n = 17, k = 29, batch = 2;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (int epi = 0; epi < 3; ++epi)
        for (int bf = 0; bf < 2; ++bf)
          for (int accum = 0; accum < 2; ++accum) {
            const int lda = ta ? m : k, ldb = tb ? k : n;
            std::vector<float> a = rnd(size_t(batch) * m * k, 1), b = rnd(size_t(batch) * k * n, 2);
            std::vector<float> bias = rnd(n, 3), d0 = rnd(size_t(batch) * m * n, 4), pre = rnd(size_t(batch) * m * n, 5);
            if (bf) {  // bf16 storage: round the inputs so the reference sees the same values
              for (auto* v : {&a, &b, &bias, &d0, &pre})
                for (auto& x : *v) x = bf16_round(x);
            }
            auto pack = [&](const std::vector<float>& v) {
              std::vector<__nv_bfloat16> o(v.size());
              for (size_t i = 0; i < v.size(); ++i) o[i] = __float2bfloat16_rn(v[i]);
              return o;
            };
            std::vector<__nv_bfloat16> ab = pack(a), bb = pack(b), biasb = pack(bias), db = pack(d0), preb = pack(pre);
            std::vector<float> d = d0, pref = pre;
            MatmulParams p;
            p.d_type = p.a_type = p.b_type = bf ? DType::BF16 : DType::F32;
            p.d = bf ? static_cast<void*>(db.data()) : d.data();
            p.a = bf ? static_cast<const void*>(ab.data()) : a.data();
            p.b = bf ? static_cast<const void*>(bb.data()) : b.data();
            p.ldd = n, p.lda = lda, p.ldb = ldb, p.trans_a = ta, p.trans_b = tb;
            p.m = m, p.n = n, p.k = k, p.alpha = 0.5f, p.accumulate = accum;
            p.epilogue = static_cast<Epilogue>(epi);
            p.bias = epi == 2 ? nullptr : (bf ? static_cast<const void*>(biasb.data()) : bias.data());
            p.pre_gelu = bf ? static_cast<void*>(preb.data()) : pref.data();
            p.batch = batch, p.stride_a = size_t(m) * k, p.stride_b = size_t(k) * n, p.stride_d = size_t(m) * n;
            if (epi != 0 && accum) {  // cuBLASLt would compute gelu(AB + C + bias): refused, not reinterpreted
              TEST_TRUE(matmul(p) == cudaErrorNotSupported, "GELU epilogue %d with accumulate must be refused", epi);
              const std::vector<__nv_bfloat16> db0 = pack(d0);
              TEST_TRUE(bf ? std::memcmp(db.data(), db0.data(), db.size() * sizeof(db[0])) == 0 : d == d0,
                        "a refused matmul must not write D");
              continue;
            }
            TEST_TRUE(matmul(p) == cudaSuccess, "matmul failed");
            for (int bi = 0; bi < batch; ++bi)
              for (int i = 0; i < m; ++i)
                for (int j = 0; j < n; ++j) {
                  double acc = 0;
                  for (int kk = 0; kk < k; ++kk) {
                    const double x = ta ? a[bi * m * k + kk * lda + i] : a[bi * m * k + i * lda + kk];
                    const double y = tb ? b[bi * k * n + j * ldb + kk] : b[bi * k * n + kk * ldb + j];
                    acc += x * y;
                  }
                  const size_t at = size_t(bi) * m * n + size_t(i) * n + j;
                  double v = 0.5 * acc, want_pre = 0;
                  if (epi == 0) v += bias[j];
                  if (epi == 1) {
                    v += bias[j];
                    want_pre = v;
                    v = gelu(v);
                  }
                  if (epi == 2) v *= gelu_grad(pre[at]);
                  if (accum) v += d0[at];  // Epilogue::None only
                  const double got = bf ? __bfloat162float(db[at]) : d[at];
                  // fp32 accumulation of 29 products ~1e-6; bf16 output: one rounding, 2^-8 relative
                  const double tol = bf ? 1e-2 * std::fabs(v) + 1e-2 : 1e-5 * std::fabs(v) + 1e-5;
                  TEST_TRUE(std::fabs(got - v) <= tol, "ta=%d tb=%d epi=%d bf=%d acc=%d [%d,%d,%d]: %g vs %g", ta, tb,
                        epi, bf, accum, bi, i, j, got, v);
                  if (epi == 1) {
                    const double gp = bf ? __bfloat162float(preb[at]) : pref[at];
                    TEST_TRUE(std::fabs(gp - want_pre) <= tol, "pre_gelu %g vs %g", gp, want_pre);
                  }
                  if (bf) {  // bf16 output is exactly a bf16 value
                    const float g = __bfloat162float(db[at]);
                    TEST_TRUE(bf16_round(g) == g, "not rounded");
                  }
                }
          }
  printf("ok matmul\n");
}

// Double reference of causal attention on qkv (T, 3, NH, HS), B = 1.
static std::vector<double> ref_attention(const std::vector<double>& qkv, int T, int NH, int HS) {
  const int C = NH * HS;
  std::vector<double> out(size_t(T) * C, 0.0);
  const double scale = 1.0 / std::sqrt(double(HS));
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < T; ++t) {
      std::vector<double> s(t + 1);
      double mx = -1e300;
      for (int j = 0; j <= t; ++j) {
        double dot = 0;
        for (int e = 0; e < HS; ++e) dot += qkv[t * 3 * C + h * HS + e] * qkv[j * 3 * C + C + h * HS + e];
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int j = 0; j <= t; ++j)
        for (int e = 0; e < HS; ++e) out[t * C + h * HS + e] += s[j] / sum * qkv[j * 3 * C + 2 * C + h * HS + e];
    }
  return out;
}

static void test_attention() {
  const int T = 7, NH = 2, HS = 4, C = NH * HS;
  std::vector<float> qkv = rnd(size_t(T) * 3 * C, 9), out(size_t(T) * C), stats(size_t(NH) * T);
  for (auto& x : qkv) x *= 2.0f;
  AttentionForwardParams f;
  f.out = out.data(), f.stats = stats.data(), f.qkv = qkv.data(), f.B = 1, f.T = T, f.NH = NH, f.HS = HS;
  f.scale = 1.0f / std::sqrt(float(HS));
  TEST_TRUE(attention_forward(f) == cudaSuccess, "attention_forward failed");
  std::vector<double> qd(qkv.begin(), qkv.end());
  std::vector<double> ref = ref_attention(qd, T, NH, HS);
  for (size_t i = 0; i < out.size(); ++i) TEST_TRUE(std::fabs(out[i] - ref[i]) < 1e-5, "out %zu: %g vs %g", i, out[i], ref[i]);
  printf("ok attention_forward\n");

  // Backward of L = sum(out * G) against central differences of the double reference.
  std::vector<float> G = rnd(out.size(), 11), dqkv(qkv.size());
  AttentionBackwardParams bw;
  bw.dqkv = dqkv.data(), bw.dout = G.data(), bw.qkv = qkv.data(), bw.out = out.data(), bw.stats = stats.data();
  bw.B = 1, bw.T = T, bw.NH = NH, bw.HS = HS, bw.scale = f.scale;
  TEST_TRUE(attention_backward(bw) == cudaSuccess, "attention_backward failed");
  for (size_t i = 0; i < qd.size(); ++i) {
    const double h = 1e-6;
    std::vector<double> qp = qd, qm = qd;
    qp[i] += h;
    qm[i] -= h;
    const std::vector<double> op = ref_attention(qp, T, NH, HS), om = ref_attention(qm, T, NH, HS);
    double num = 0;
    for (size_t j = 0; j < op.size(); ++j) num += (op[j] - om[j]) * G[j];
    num /= 2 * h;
    TEST_TRUE(std::fabs(dqkv[i] - num) < 1e-4 * (1 + std::fabs(num)), "dqkv %zu: %g vs %g", i, dqkv[i], num);
  }
  printf("ok attention_backward\n");
}

static void test_collectives() {
  Comm* comm = nullptr;
  TEST_TRUE(comm_init(&comm, 0, 1, nullptr, 0) == cudaSuccess, "comm_init");
  TEST_TRUE(comm_world(comm) == 1 && comm_rank(comm) == 0, "rank/world");
  std::vector<float> a = rnd(10, 1), b(10);
  TEST_TRUE(all_reduce(comm, b.data(), a.data(), 10, DType::F32, ReduceOp::Avg, nullptr) == cudaSuccess && a == b, "all_reduce");
  TEST_TRUE(all_gather(comm, b.data(), a.data(), 10, DType::F32, nullptr) == cudaSuccess && a == b, "all_gather");
  Comm* c2 = nullptr;
  TEST_TRUE(comm_init(&c2, 0, 2, nullptr, 0) == cudaErrorNotSupported, "two ranks must be refused");
  TEST_TRUE(comm_destroy(comm) == cudaSuccess, "destroy");
  printf("ok collectives\n");
}

// run_guarded (the GPU seams' error wrapper) reports the errors its call raised, and leaves an unrelated one that
// was pending before the call for its owner (CUDA keeps a failed call's error as the thread's last error until
// cudaGetLastError reads it).
static void test_run_guarded() {
  std::string msg;
  TEST_TRUE(cudaSetDevice(99) == cudaErrorInvalidDevice, "setup: an error left pending");
  TEST_TRUE(run_guarded(msg, [] {}) == cudaSuccess, "an earlier pending error was reported as the call's");
  TEST_TRUE(cudaGetLastError() == cudaErrorInvalidDevice, "the earlier error must stay pending for its owner");
  TEST_TRUE(run_guarded(msg, [] { (void)cudaSetDevice(99); }) == cudaErrorInvalidDevice, "the call's own error");
  TEST_TRUE(cudaPeekAtLastError() == cudaSuccess, "the call's own error is taken");
  TEST_TRUE(run_guarded(msg, [] { throw std::runtime_error("library says no"); }) == cudaErrorUnknown &&
                msg == "library says no",
            "an exception becomes cudaErrorUnknown with its message");
  printf("ok run_guarded\n");
}

int main() {
  test_run_guarded();
  test_matmul();
  test_attention();
  test_collectives();
  return 0;
}
