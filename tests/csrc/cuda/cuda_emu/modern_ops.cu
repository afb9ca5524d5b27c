// Test-only entry to the kernels of the modern architecture (tests/csrc/cuda/test_cuda_emu_modern.py): rmsnorm.cuh
// (RMSNorm, fused residual + RMSNorm, QK-norm), rope.cuh, relu2.cuh and the soft-capped classifier.cuh, called
// through their launchers on host arrays of floats, without a backend, for each storage type (dtype 0 float, 1 bf16,
// 2 fp16: values rounded to it to nearest even on the way in, widened on the way out). Device buffers are poisoned
// before the kernels run (all-ones bits: NaN in every storage type); outputs start poisoned, in-place and
// accumulated-into buffers start from the given values. misalign: buffers start one element into their allocation
// (the kernels' one-value-per-access paths).
// Also infer.cuh's decode attention with a given split count (attention_kv_splits), for the split-key tests
// (test_cuda_emu_infer.py): its workspace starts poisoned too.
#include <cstdint>
#include <cstring>
#include <vector>

// The headers' non-template kernels are also defined in backend_cuda.cu's translation unit, in the same module: their
// copies here get other names (one definition rule); the template kernels are merged by the linker.
#define column_reduce_kernel modern_ops_column_reduce_kernel
#define crossentropy_count_kernel modern_ops_crossentropy_count_kernel
#define loss_accumulate_kernel modern_ops_loss_accumulate_kernel
#define rope_table_kernel modern_ops_rope_table_kernel

#include "cuda/classifier.cuh"
#include "cuda/encoder.cuh"
#include "cuda/infer.cuh"
#include "cuda/layernorm.cuh"
#include "cuda/relu2.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"

namespace gpt2emu_test {

namespace {
using namespace gpt2::cuda;

struct Dev {
  int shift = 0;
  std::vector<void*> allocs;
  ~Dev() {
    for (void* p : allocs) (void)cudaFree(p);
  }
  template <class X>
  X* raw(size_t n) {
    void* d = nullptr;
    CUDA_CHECK(cudaMalloc(&d, (n + shift) * sizeof(X) + 16));
    CUDA_CHECK(cudaMemset(d, 0xff, (n + shift) * sizeof(X) + 16));
    allocs.push_back(d);
    return static_cast<X*>(d) + shift;
  }
  // a device copy of host (rounded to X), or poisoned (host null)
  template <class X>
  X* up(const float* host, size_t n) {
    X* d = raw<X>(n);
    if (host) {
      std::vector<X> h(n);
      for (size_t i = 0; i < n; i++) h[i] = store_t<X>(host[i]);
      CUDA_CHECK(cudaMemcpy(d, h.data(), n * sizeof(X), cudaMemcpyHostToDevice));
    }
    return d;
  }
  template <class X>
  void down(float* host, const X* d, size_t n) {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<X> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(X), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) host[i] = load_f(h[i]);
  }
};

template <class F>
void dispatch(int dtype, F&& f) {
  switch (dtype) {
    case 0: f(float{}); return;
    case 1: f(__nv_bfloat16{}); return;
    default: f(__half{}); return;
  }
}
}  // namespace

// residual (N, C) written when b is given (fused residual + RMSNorm), out (N, C), rstd (N)
void rmsnorm_fwd(int dtype, bool mis, float* residual, float* out, float* rstd, const float* a, const float* b, int N,
                 int C, float eps) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    const size_t n = size_t(N) * C;
    X* o = d.up<X>(nullptr, n);
    float* r = d.up<float>(nullptr, N);
    if (b) {
      X* res = d.up<X>(nullptr, n);
      residual_rmsnorm_forward(res, o, r, d.up<X>(a, n), d.up<X>(b, n), N, C, eps, nullptr);
      d.down(residual, res, n);
    } else {
      rmsnorm_forward(o, r, d.up<X>(a, n), N, C, eps, nullptr);
    }
    d.down(out, o, n);
    d.down(rstd, r, N);
  });
}

// dinp (N, C): accumulated into (accumulate) or written (it starts poisoned)
void rmsnorm_bwd(int dtype, bool mis, float* dinp, const float* dout, const float* inp, const float* rstd, int N, int C,
                 bool accumulate) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    const size_t n = size_t(N) * C;
    X* g = d.up<X>(accumulate ? dinp : nullptr, n);
    rmsnorm_backward(g, d.up<X>(dout, n), d.up<X>(inp, n), d.up<float>(rstd, N), N, C, accumulate, nullptr);
    d.down(dinp, g, n);
  });
}

// qkv (BT, 3C) in place, rstd (BT * 2NH) written
void qknorm_fwd(int dtype, bool mis, float* qkv, float* rstd, int BT, int C, int NH, float eps) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    const size_t n = size_t(BT) * 3 * C, nr = size_t(BT) * 2 * NH;
    X* x = d.up<X>(qkv, n);
    float* r = d.up<float>(nullptr, nr);
    qknorm_forward(x, r, BT, C, NH, eps, nullptr);
    d.down(qkv, x, n);
    d.down(rstd, r, nr);
  });
}

// dqkv (BT, 3C) in place; qkv: the forward's output
void qknorm_bwd(int dtype, bool mis, float* dqkv, const float* qkv, const float* rstd, int BT, int C, int NH) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    const size_t n = size_t(BT) * 3 * C, nr = size_t(BT) * 2 * NH;
    X* g = d.up<X>(dqkv, n);
    qknorm_backward(g, d.up<X>(qkv, n), d.up<float>(rstd, nr), BT, C, NH, nullptr);
    d.down(dqkv, g, n);
  });
}

// qkv (B, T, 3C) in place (forward or backward rotation); table (maxT, HS) returned
void rope(int dtype, bool mis, float* qkv, float* table, int B, int T, int C, int NH, int maxT, int pos0, double base,
          bool backward) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    const size_t n = size_t(B) * T * 3 * C, nt = rope_table_floats(maxT, C / NH);
    X* x = d.up<X>(qkv, n);
    Dev dt;  // the table is always aligned (the backend allocates it)
    float* tab = dt.up<float>(nullptr, nt);
    rope_table(tab, maxT, C / NH, base, nullptr);
    if (backward) rope_backward(x, tab, B, T, C, NH, pos0, nullptr);
    else rope_forward(x, tab, B, T, C, NH, pos0, nullptr);
    d.down(qkv, x, n);
    dt.down(table, tab, nt);
  });
}

void relu2_fwd(int dtype, bool mis, float* out, const float* inp, size_t N) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    X* o = d.up<X>(nullptr, N);
    relu2_forward(o, d.up<X>(inp, N), N, nullptr);
    d.down(out, o, N);
  });
}

// dinp (N): accumulated into, or written (starts poisoned); inplace: written over a device copy of dout
void relu2_bwd(int dtype, bool mis, float* dinp, const float* inp, const float* dout, size_t N, bool accumulate,
               bool inplace) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    X* g = d.up<X>(inplace ? dout : accumulate ? dinp : nullptr, N);
    relu2_backward(g, d.up<X>(inp, N), inplace ? g : d.up<X>(dout, N), N, accumulate, nullptr);
    d.down(dinp, g, N);
  });
}

// The classifier with a soft-cap (cap 0: none). mode 0: softcap_forward then crossentropy_forward; 1: those, then the
// backward of the capped logits (dloss = grad_scale / count); 2: the fused forward_backward of the raw logits.
// logits (N, Vp) in; capped (N, Vp) out (modes 0, 1: softcap_forward's output); dlogits (N, Vp) out (modes 1, 2).
void classifier(int dtype, bool mis, int mode, float* losses, float* lse, int* count, float* capped, float* dlogits,
                const float* logits, const int* targets, int N, int V, int Vp, float cap, float grad_scale) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    const size_t n = size_t(N) * Vp;
    X* lg = d.up<X>(logits, n);
    float* l = d.up<float>(nullptr, N);
    float* s = d.up<float>(nullptr, N);
    Dev di;
    int* t = di.raw<int>(N);
    int* c = di.raw<int>(1);
    CUDA_CHECK(cudaMemcpy(t, targets, N * sizeof(int), cudaMemcpyHostToDevice));
    if (mode == 2) {
      crossentropy_forward_backward(l, s, lg, t, c, nullptr, grad_scale, N, V, Vp, nullptr, cap);
    } else {
      if (cap > 0.0f) softcap_forward(lg, cap, n, nullptr);
      d.down(capped, lg, n);
      crossentropy_forward(l, s, lg, t, c, N, V, Vp, nullptr);
      if (mode == 1) crossentropy_backward(lg, s, t, c, nullptr, grad_scale, N, V, Vp, nullptr, cap);
    }
    d.down(losses, l, N);
    d.down(lse, s, N);
    if (mode) d.down(dlogits, lg, n);
    CUDA_CHECK(cudaMemcpy(count, c, sizeof(int), cudaMemcpyDeviceToHost));
  });
}

// layernorm without bias (b and db null); out, mean, rstd written; dinp accumulated into, dw too
void layernorm_nobias(int dtype, bool mis, float* out, float* mean, float* rstd, float* dinp, float* dw,
                      const float* inp, const float* w, const float* dout, int N, int C) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    const size_t n = size_t(N) * C;
    X* x = d.up<X>(inp, n);
    X* ww = d.up<X>(w, C);
    X* o = d.up<X>(nullptr, n);
    float* m = d.up<float>(nullptr, N);
    float* r = d.up<float>(nullptr, N);
    layernorm_forward<X>(o, m, r, x, ww, nullptr, N, C, nullptr);
    X* g = d.up<X>(dinp, n);
    float* gw = d.up<float>(dw, C);
    Dev ds;
    float* scratch = ds.raw<float>(2 * size_t(column_chunks(N, C)) * C);
    layernorm_backward<X>(g, gw, nullptr, d.up<X>(dout, n), x, ww, m, r, scratch, N, C, true, nullptr);
    d.down(out, o, n);
    d.down(mean, m, N);
    d.down(rstd, r, N);
    d.down(dinp, g, n);
    d.down(dw, gw, C);
  });
}

// encoder without position embedding (wpe, dwpe null): out (B*T, C) written, dwte (Vp, C) accumulated into
void encoder_nowpe(int dtype, bool mis, float* out, float* dwte, const int* inp, const float* wte, const float* dout,
                   int BT, int Vp, int C) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    d.shift = mis;
    const size_t n = size_t(BT) * C;
    Dev di;
    int* tok = di.raw<int>(BT);
    CUDA_CHECK(cudaMemcpy(tok, inp, BT * sizeof(int), cudaMemcpyHostToDevice));
    std::vector<int> buckets(encoder_buckets_size(BT));
    const size_t used = encoder_buckets(inp, BT, buckets.data());
    int* bk = di.raw<int>(buckets.size());
    CUDA_CHECK(cudaMemcpy(bk, buckets.data(), used * sizeof(int), cudaMemcpyHostToDevice));
    X* o = d.up<X>(nullptr, n);
    encoder_forward<X>(o, tok, d.up<X>(wte, size_t(Vp) * C), nullptr, 1, BT, C, nullptr);
    float* g = d.up<float>(dwte, size_t(Vp) * C);
    encoder_backward<X>(g, nullptr, d.up<X>(dout, n), bk, 1, BT, C, nullptr);
    d.down(out, o, n);
    d.down(dwte, g, size_t(Vp) * C);
  });
}

// kv_write + decode attention with `splits` blocks per (head, query, sequence) (1: the one-block kernel): out (B, Tq,
// C) poisoned, kc / vc (S, maxT, C) updated in place, qkv (B, Tq, 3C).
void attention_kv_splits(int dtype, float* out, float* kc, float* vc, const float* qkv, const int* slot, const int* pos,
                         int S, int B, int Tq, int C, int NH, int maxT, int splits) {
  dispatch(dtype, [&](auto tag) {
    using X = decltype(tag);
    Dev d;
    const size_t nc = size_t(S) * maxT * C, no = size_t(B) * Tq * C;
    X* o = d.up<X>(nullptr, no);
    X* k = d.up<X>(kc, nc);
    X* v = d.up<X>(vc, nc);
    X* x = d.up<X>(qkv, size_t(B) * Tq * 3 * C);
    int* sl = d.raw<int>(size_t(B));
    int* ps = d.raw<int>(size_t(B));
    CUDA_CHECK(cudaMemcpy(sl, slot, size_t(B) * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(ps, pos, size_t(B) * sizeof(int), cudaMemcpyHostToDevice));
    float* work = splits > 1 ? d.raw<float>(decode_workspace_floats(B, Tq, C, NH, splits)) : nullptr;
    attention_kv_forward(o, k, v, x, sl, ps, B, Tq, C, NH, maxT, splits, work, nullptr);
    d.down(out, o, no);
    d.down(kc, k, nc);
    d.down(vc, v, nc);
  });
}

int decode_splits(int B, int Tq, int NH, int maxT, int sms) { return gpt2::cuda::decode_splits(B, Tq, NH, maxT, sms); }

}  // namespace gpt2emu_test
