// Test-only bindings of the emulated module (gpt2core_cuda_emu.Ops / OpsBF16): every Backend op of a backend
// ("cpu" or the emulated "cuda") on numpy arrays, so tests can compare backends op by op. Inputs are copied
// into backend allocations; outputs (and accumulated-into buffers, given with their initial values) come
// back as new float32 arrays. Under the emulation "device" memory is host memory, so copies are plain loops.
//
// Ops is Backend<float>. OpsBF16 is Backend<bf16> and OpsF16 Backend<f16> (CUDA only): arguments the op stores in
// the model's type T (activations, the weights the ops read) are rounded to bf16 / fp16 (to nearest even) on the
// way in and widened on the way out; the ones it keeps in fp32 (gradients of parameters, statistics, master weights, AdamW moments)
// stay float32. Which is which follows csrc/model/backend.h.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // sample_tokens' per-row settings

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include "backends.h"
#include "cuda/seams.h"
#include "model/fp8.h"

namespace gpt2emu {
void set_schedule(const char* spec);
unsigned long long launch_count();
bool memory_checker_enabled();
}  // namespace gpt2emu
namespace gpt2emu_test {  // attention_tc_ops.cu
void attention_tc_16(bool f16, uint16_t* out, float* lse, uint16_t* dqkv, const uint16_t* qkv, const uint16_t* dout,
                     int B, int T, int C, int NH, bool misalign, bool accumulate);
int column_sum(bool bf16, float* out, const void* inp, int N, int C, bool misalign);  // kernel_ops.cu
void column_reduce(float* out, const float* partial, int R, int C);
int loss_count_accumulate(float* acc, const int32_t* targets, const float* losses, int N, float scale);
// modern_ops.cu: the modern architecture's kernels on host float arrays, dtype 0 float / 1 bf16 / 2 fp16
void rmsnorm_fwd(int dtype, bool mis, float* residual, float* out, float* rstd, const float* a, const float* b, int N,
                 int C, float eps);
void rmsnorm_bwd(int dtype, bool mis, float* dinp, const float* dout, const float* inp, const float* rstd, int N, int C,
                 bool accumulate);
void qknorm_fwd(int dtype, bool mis, float* qkv, float* rstd, int BT, int C, int NH, float eps);
void qknorm_bwd(int dtype, bool mis, float* dqkv, const float* qkv, const float* rstd, int BT, int C, int NH);
void rope(int dtype, bool mis, float* qkv, float* table, int B, int T, int C, int NH, int maxT, int pos0, double base,
          bool backward);
void relu2_fwd(int dtype, bool mis, float* out, const float* inp, size_t N);
void attention_kv_splits(int dtype, float* out, float* kc, float* vc, const float* qkv, const int* slot, const int* pos,
                         int S, int B, int Tq, int C, int NH, int maxT, int splits);
int decode_splits(int B, int Tq, int NH, int maxT, int sms);  // infer.cuh's choice
void relu2_bwd(int dtype, bool mis, float* dinp, const float* inp, const float* dout, size_t N, bool accumulate,
               bool inplace);
void classifier(int dtype, bool mis, int mode, float* losses, float* lse, int* count, float* capped, float* dlogits,
                const float* logits, const int* targets, int N, int V, int Vp, float cap, float grad_scale);
void layernorm_nobias(int dtype, bool mis, float* out, float* mean, float* rstd, float* dinp, float* dw,
                      const float* inp, const float* w, const float* dout, int N, int C);
void encoder_nowpe(int dtype, bool mis, float* out, float* dwte, const int* inp, const float* wte, const float* dout,
                   int BT, int Vp, int C);
}  // namespace gpt2emu_test

namespace py = pybind11;
using F = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

namespace {

template <class T>
struct Ops {
  static_assert(std::is_same_v<gpt2::Master<T>, float>, "test ops cover float, bf16 and fp16 models");
  std::unique_ptr<gpt2::Backend<T>> be;
  std::vector<T*> tbufs;
  std::vector<float*> mbufs;
  std::vector<int32_t*> ibufs;
  std::vector<uint8_t*> u8bufs;  // FP8 values and metas (alloc_fp8)
  int shift = 0;  // misalign: buffers start one element into their allocation (not 16-byte aligned)

  Ops(const std::string& device, bool misalign, const std::string& attention, bool fused)
      : be(gpt2::make_backend<T>(device, options(attention, fused))), shift(misalign ? 1 : 0) {}
  static gpt2::BackendOptions options(const std::string& attention, bool fused) {
    gpt2::BackendOptions o;
    o.fused = fused;
    if (!gpt2::parse_attention(attention, &o.attention)) throw py::value_error("bad attention '" + attention + "'");
    return o;
  }
  ~Ops() { clear(); }
  void clear() {
    for (auto* p : tbufs) be->free(p);
    for (auto* p : mbufs) be->free_master(p);
    for (auto* p : ibufs) be->free_i32(p);
    for (auto* p : u8bufs) be->free_fp8(p);
    u8bufs.clear();
    tbufs.clear();
    mbufs.clear();
    ibufs.clear();
  }
  static T cvt(float x) {
    if constexpr (std::is_same_v<T, float>) return x;
    else if constexpr (std::is_same_v<T, gpt2::bf16>) return gpt2::float_to_bf16(x);
    else return gpt2::float_to_f16(x);
  }
  static gpt2::InputGrad mode(bool write) { return write ? gpt2::InputGrad::Write : gpt2::InputGrad::Add; }
  static float wide(T x) {
    if constexpr (std::is_same_v<T, float>) return x;
    else return gpt2::widen(x);
  }
  T* zt(size_t n) {  // zero-filled T buffer
    T* p = be->alloc(n + shift);
    tbufs.push_back(p);
    return p + shift;
  }
  float* zm(size_t n) {  // zero-filled float (master-type) buffer
    float* p = be->alloc_master(n + shift);
    mbufs.push_back(p);
    return p + shift;
  }
  T* ut(const F& a) {  // upload rounded to T
    T* p = zt(a.size());
    for (py::ssize_t i = 0; i < a.size(); i++) p[i] = cvt(a.data()[i]);
    return p;
  }
  float* um(const F& a) {
    float* p = zm(a.size());
    std::memcpy(p, a.data(), a.size() * sizeof(float));
    return p;
  }
  T* ot(const py::object& a) { return a.is_none() ? nullptr : ut(a.cast<F>()); }  // None: a null pointer
  float* om(const py::object& a) { return a.is_none() ? nullptr : um(a.cast<F>()); }
  int32_t* ui(const I& a) {
    int32_t* p = be->alloc_i32(a.size());
    be->to_device_i32(p, a.data(), a.size());
    ibufs.push_back(p);
    return p;
  }
  int32_t* ui_batch(const I& a) {  // token ids of a (B, T) batch, uploaded as the model does (upload_batch)
    int32_t* p = be->alloc_i32(a.size());
    be->upload_batch(p, nullptr, a.data(), nullptr, int(a.shape(0)), int(a.shape(1)));
    ibufs.push_back(p);
    return p;
  }
  static F dt(const T* p, std::vector<py::ssize_t> shape) {
    F out(shape);
    for (py::ssize_t i = 0; i < out.size(); i++) out.mutable_data()[i] = wide(p[i]);
    return out;
  }
  // Backend::adamw over param (fp32: the parameters; bf16: the master copy), arrays starting at flat index base,
  // with the step's values already set. With norm: the gradients' sum of squares first; returns (norm, param or
  // master, m, v). Without: (param, m, v) for fp32, (bf16 copy, master, m, v) for bf16.
  py::tuple adamw(F param, F grad, F m, F v, size_t base, const std::vector<gpt2::AdamWSegment>& segments,
                  float beta1, float beta2, float eps, bool norm) {
    const size_t n = param.size();
    const py::ssize_t sn = py::ssize_t(n);
    float* mm = um(m);
    float* vv = um(v);
    float* g = um(grad);
    float* w = um(param);
    T* p = nullptr;
    if constexpr (std::is_same_v<T, float>) p = w;
    else p = zt(n);
    float* master = std::is_same_v<T, float> ? nullptr : w;
    if (norm) be->grad_sum_squares(g, n);
    be->adamw(p, master, g, mm, vv, base, segments, beta1, beta2, eps);
    const double sumsq = be->step_result().sumsq;  // also waits for the update
    py::list out;
    if (norm) out.append(std::sqrt(sumsq));
    if constexpr (!std::is_same_v<T, float>) {
      if (!norm) out.append(dt(p, {sn}));
    }
    out.append(dm(w, {sn}));
    out.append(dm(mm, {sn}));
    out.append(dm(vv, {sn}));
    clear();
    return py::tuple(out);
  }
  // An FP8 tensor of n values in backend memory, poisoned: q and qt all 0xFF (NaN in both formats), meta NaN.
  gpt2::Fp8Tensor fp8_tensor(size_t n) {
    auto bytes = [&](size_t k) {
      uint8_t* p = be->alloc_fp8(k ? k : 1);
      u8bufs.push_back(p);
      std::memset(p, 0xff, k ? k : 1);
      return p;
    };
    gpt2::Fp8Tensor t;
    t.q = bytes(n), t.qt = bytes(n), t.meta = reinterpret_cast<float*>(bytes(2 * sizeof(float)));
    return t;
  }
  static py::array_t<uint8_t> du8(const uint8_t* p, std::vector<py::ssize_t> shape) {
    py::array_t<uint8_t> out(shape);
    if (out.size()) std::memcpy(out.mutable_data(), p, size_t(out.size()));
    return out;
  }
  // (q, qt, meta) of an Fp8Tensor of (rows, cols) values, as numpy arrays
  static py::tuple fp8_out(const gpt2::Fp8Tensor& t, int rows, int cols) {
    return py::make_tuple(du8(t.q, {rows, cols}), du8(t.qt, {cols, rows}), dm(t.meta, {2}));
  }
  static gpt2::Fp8Kind fp8_kind(const std::string& kind) {
    if (kind == "e4m3") return gpt2::Fp8Kind::E4M3;
    if (kind == "e5m2") return gpt2::Fp8Kind::E5M2;
    throw py::value_error("kind must be 'e4m3' or 'e5m2'");
  }
  static F dm(const float* p, std::vector<py::ssize_t> shape) {
    F out(shape);
    std::memcpy(out.mutable_data(), p, out.size() * sizeof(float));
    return out;
  }
};

template <class T>
void bind_ops(py::module_& m, const char* name, const char* doc) {
  using O = Ops<T>;
  py::class_<O>(m, name, doc)
      .def(py::init<const std::string&, bool, const std::string&, bool>(), py::arg("device"),
           py::arg("misalign") = false, py::arg("attention") = "auto", py::arg("fused") = true)
      .def("encoder_forward",
           [](O& o, I inp, F wte, py::object wpe) {  // wpe None: no position embedding (rotary)
             const int B = inp.shape(0), T_ = inp.shape(1), C = wte.shape(1);
             T* out = o.zt(size_t(B) * T_ * C);
             o.be->encoder_forward(out, o.ui(inp), o.ut(wte), o.ot(wpe), B, T_, C);
             auto r = O::dt(out, {B, T_, C});
             o.clear();
             return r;
           })
      .def("encoder_backward",
           [](O& o, F dwte, py::object dwpe, F dout, I inp) {  // dwpe None: no position embedding
             const int B = inp.shape(0), T_ = inp.shape(1), C = dwte.shape(1);
             float* a = o.um(dwte);
             float* b = o.om(dwpe);
             o.be->encoder_backward(a, b, o.ut(dout), o.ui_batch(inp), B, T_, C);
             py::object rb = b ? py::object(O::dm(b, {dwpe.cast<F>().shape(0), C})) : py::object(py::none());
             auto r = py::make_tuple(O::dm(a, {dwte.shape(0), C}), rb);
             o.clear();
             return r;
           })
      .def("layernorm_forward",
           [](O& o, F inp, F w, py::object b) {  // b None: no bias
             const int N = inp.shape(0), C = inp.shape(1);
             T* out = o.zt(size_t(N) * C);
             float* mean = o.zm(N);
             float* rstd = o.zm(N);
             o.be->layernorm_forward(out, mean, rstd, o.ut(inp), o.ut(w), o.ot(b), N, C);
             auto r = py::make_tuple(O::dt(out, {N, C}), O::dm(mean, {N}), O::dm(rstd, {N}));
             o.clear();
             return r;
           })
      .def("residual_layernorm_forward",
           [](O& o, F a, F b, F w, py::object bias) {
             const int N = a.shape(0), C = a.shape(1);
             T* res = o.zt(size_t(N) * C);
             T* out = o.zt(size_t(N) * C);
             float* mean = o.zm(N);
             float* rstd = o.zm(N);
             o.be->residual_layernorm_forward(res, out, mean, rstd, o.ut(a), o.ut(b), o.ut(w), o.ot(bias), N, C);
             auto r = py::make_tuple(O::dt(res, {N, C}), O::dt(out, {N, C}), O::dm(mean, {N}), O::dm(rstd, {N}));
             o.clear();
             return r;
           })
      .def("layernorm_backward",  // write: InputGrad::Write (dinp's initial values must be ignored)
           [](O& o, F dinp, F dw, py::object db, F dout, F inp, F w, F mean, F rstd, bool write) {
             const int N = inp.shape(0), C = inp.shape(1);
             T* a = o.ut(dinp);
             float* b = o.um(dw);
             float* c = o.om(db);  // None: no bias
             o.be->layernorm_backward(a, b, c, o.ut(dout), o.ut(inp), o.ut(w), o.um(mean), o.um(rstd), N, C,
                                      O::mode(write));
             py::object rc = c ? py::object(O::dm(c, {C})) : py::object(py::none());
             auto r = py::make_tuple(O::dt(a, {N, C}), O::dm(b, {C}), rc);
             o.clear();
             return r;
           },
           py::arg("dinp"), py::arg("dw"), py::arg("db"), py::arg("dout"), py::arg("inp"), py::arg("w"),
           py::arg("mean"), py::arg("rstd"), py::arg("write") = false)
      .def("matmul_forward",
           [](O& o, F inp, F w, py::object bias) {
             const int N = inp.shape(0), C = inp.shape(1), OC = w.shape(0);
             T* out = o.zt(size_t(N) * OC);
             const T* bp = bias.is_none() ? nullptr : o.ut(bias.cast<F>());
             o.be->matmul_forward(out, o.ut(inp), o.ut(w), bp, N, C, OC);
             auto r = O::dt(out, {N, OC});
             o.clear();
             return r;
           })
      .def("matmul_backward",  // write: InputGrad::Write (dinp's initial values must be ignored)
           [](O& o, F dinp, F dw, py::object dbias, F dout, F inp, F w, bool write) {
             const int N = inp.shape(0), C = inp.shape(1), OC = w.shape(0);
             T* a = o.ut(dinp);
             float* b = o.um(dw);
             float* c = dbias.is_none() ? nullptr : o.um(dbias.cast<F>());
             o.be->matmul_backward(a, b, c, o.ut(dout), o.ut(inp), o.ut(w), N, C, OC, O::mode(write));
             py::object cb = c ? py::object(O::dm(c, {OC})) : py::object(py::none());
             auto r = py::make_tuple(O::dt(a, {N, C}), O::dm(b, {OC, C}), cb);
             o.clear();
             return r;
           },
           py::arg("dinp"), py::arg("dw"), py::arg("dbias"), py::arg("dout"), py::arg("inp"), py::arg("w"),
           py::arg("write") = false)
      // FP8 (backend.h's FP8 Linear ops). Inputs are rounded to T on the way in; fp8 tensors come back as (q, qt,
      // meta) with q, qt uint8 bit patterns and meta = [1 / s, amax]; every output starts poisoned (NaN).
      .def("fp8_quantize",  // x (rows, cols) -> (q, qt, meta); q / qt False: that layout not asked for (null)
           [](O& o, F x, const std::string& kind, bool q, bool qt) {
             const int rows = x.shape(0), cols = x.shape(1);
             gpt2::Fp8Tensor t = o.fp8_tensor(size_t(rows) * cols);
             gpt2::Fp8Tensor asked = t;
             if (!q) asked.q = nullptr;
             if (!qt) asked.qt = nullptr;
             o.be->fp8_quantize(asked, o.ut(x), rows, cols, O::fp8_kind(kind));
             o.be->synchronize();
             auto r = O::fp8_out(t, rows, cols);
             o.clear();
             return r;
           },
           py::arg("x"), py::arg("kind"), py::arg("q") = true, py::arg("qt") = true)
      .def("fp8_linear_forward",  // -> (out, inp (q, qt, meta), w (q, qt, meta)); w quantised first (e4m3)
           [](O& o, F inp, F w, py::object bias) {
             const int N = inp.shape(0), C = inp.shape(1), OC = w.shape(0);
             T* out = o.zt(size_t(N) * OC);
             for (size_t i = 0; i < size_t(N) * OC; i++) out[i] = O::cvt(NAN);
             const T* bp = bias.is_none() ? nullptr : o.ut(bias.cast<F>());
             gpt2::Fp8Tensor w8 = o.fp8_tensor(size_t(OC) * C), x8 = o.fp8_tensor(size_t(N) * C);
             o.be->fp8_quantize(w8, o.ut(w), OC, C, gpt2::Fp8Kind::E4M3);
             o.be->fp8_linear_forward(out, x8, o.ut(inp), w8, bp, N, C, OC);
             o.be->synchronize();
             auto r = py::make_tuple(O::dt(out, {N, OC}), O::fp8_out(x8, N, C), O::fp8_out(w8, OC, C));
             o.clear();
             return r;
           },
           py::arg("inp"), py::arg("w"), py::arg("bias"))
      .def("fp8_linear_backward",  // -> (dinp, dw, dbias, dout (q, qt, meta)); w and inp quantised as forward does
           [](O& o, F dinp, F dw, py::object dbias, F dout, F inp, F w, bool write) {
             const int N = inp.shape(0), C = inp.shape(1), OC = w.shape(0);
             gpt2::Fp8Tensor w8 = o.fp8_tensor(size_t(OC) * C), x8 = o.fp8_tensor(size_t(N) * C);
             gpt2::Fp8Tensor g8 = o.fp8_tensor(size_t(N) * OC);
             o.be->fp8_quantize(w8, o.ut(w), OC, C, gpt2::Fp8Kind::E4M3);
             o.be->fp8_linear_forward(o.zt(size_t(N) * OC), x8, o.ut(inp), w8, nullptr, N, C, OC);
             T* a = o.ut(dinp);
             float* b = o.um(dw);
             float* c = dbias.is_none() ? nullptr : o.um(dbias.cast<F>());
             o.be->fp8_linear_backward(a, b, c, g8, o.ut(dout), x8, w8, N, C, OC, O::mode(write));
             o.be->synchronize();
             py::object cb = c ? py::object(O::dm(c, {OC})) : py::object(py::none());
             auto r = py::make_tuple(O::dt(a, {N, C}), O::dm(b, {OC, C}), cb, O::fp8_out(g8, N, OC));
             o.clear();
             return r;
           },
           py::arg("dinp"), py::arg("dw"), py::arg("dbias"), py::arg("dout"), py::arg("inp"), py::arg("w"),
           py::arg("write") = false)
      .def("matmul_gelu_forward",  // returns (pre, gelu(pre))
           [](O& o, F inp, F w, py::object bias) {
             const int N = inp.shape(0), C = inp.shape(1), OC = w.shape(0);
             T* pre = o.zt(size_t(N) * OC);
             T* out = o.zt(size_t(N) * OC);
             const T* bp = bias.is_none() ? nullptr : o.ut(bias.cast<F>());
             o.be->matmul_gelu_forward(pre, out, o.ut(inp), o.ut(w), bp, N, C, OC);
             auto r = py::make_tuple(O::dt(pre, {N, OC}), O::dt(out, {N, OC}));
             o.clear();
             return r;
           })
      .def("gelu_matmul_backward",  // returns (dpre, dw, dbias); dpre's initial values must be overwritten
           [](O& o, F dpre, F dw, py::object dbias, F dout, F pre, F act, F w) {
             const int N = pre.shape(0), C = pre.shape(1), OC = w.shape(0);
             T* a = o.ut(dpre);
             float* b = o.um(dw);
             float* c = dbias.is_none() ? nullptr : o.um(dbias.cast<F>());
             T* scratch = o.zt(size_t(N) * C);  // NaN: the op must not read the scratch before writing it
             for (size_t i = 0; i < size_t(N) * C; i++) scratch[i] = O::cvt(std::numeric_limits<float>::quiet_NaN());
             o.be->gelu_matmul_backward(a, b, c, o.ut(dout), o.ut(pre), o.ut(act), o.ut(w), scratch, N, C, OC);
             py::object cb = c ? py::object(O::dm(c, {OC})) : py::object(py::none());
             auto r = py::make_tuple(O::dt(a, {N, C}), O::dm(b, {OC, C}), cb);
             o.clear();
             return r;
           })
      .def("attention",  // write: backward with InputGrad::Write (dqkv's initial values must be ignored)
           [](O& o, F qkv, F dout, F dqkv, int NH, bool write) {
             // forward, then backward with the forward's att buffer; returns (out, dqkv)
             const int B = qkv.shape(0), T_ = qkv.shape(1), C = qkv.shape(2) / 3;
             T* out = o.zt(size_t(B) * T_ * C);
             float* att = o.zm(o.be->attention_state_size(B, NH, T_));
             T* q = o.ut(qkv);
             o.be->attention_forward(out, att, q, B, T_, C, NH);
             T* d = o.ut(dqkv);
             o.be->attention_backward(d, o.ut(dout), q, out, att, B, T_, C, NH, O::mode(write));
             auto r = py::make_tuple(O::dt(out, {B, T_, C}), O::dt(d, {B, T_, 3 * C}));
             o.clear();
             return r;
           },
           py::arg("qkv"), py::arg("dout"), py::arg("dqkv"), py::arg("NH"), py::arg("write") = false)
      // ---- the modern architecture's ops (csrc/model/backend.h)
      .def("rmsnorm_forward",
           [](O& o, F inp) {
             const int N = inp.shape(0), C = inp.shape(1);
             T* out = o.zt(size_t(N) * C);
             float* rstd = o.zm(N);
             o.be->rmsnorm_forward(out, rstd, o.ut(inp), N, C);
             auto r = py::make_tuple(O::dt(out, {N, C}), O::dm(rstd, {N}));
             o.clear();
             return r;
           })
      .def("residual_rmsnorm_forward",
           [](O& o, F a, F b) {
             const int N = a.shape(0), C = a.shape(1);
             T* res = o.zt(size_t(N) * C);
             T* out = o.zt(size_t(N) * C);
             float* rstd = o.zm(N);
             o.be->residual_rmsnorm_forward(res, out, rstd, o.ut(a), o.ut(b), N, C);
             auto r = py::make_tuple(O::dt(res, {N, C}), O::dt(out, {N, C}), O::dm(rstd, {N}));
             o.clear();
             return r;
           })
      .def("rmsnorm_backward",  // write: InputGrad::Write
           [](O& o, F dinp, F dout, F inp, F rstd, bool write) {
             const int N = inp.shape(0), C = inp.shape(1);
             T* a = o.ut(dinp);
             o.be->rmsnorm_backward(a, o.ut(dout), o.ut(inp), o.um(rstd), N, C, O::mode(write));
             auto r = O::dt(a, {N, C});
             o.clear();
             return r;
           },
           py::arg("dinp"), py::arg("dout"), py::arg("inp"), py::arg("rstd"), py::arg("write") = false)
      .def("rope",  // rope_forward (or rope_backward) in place on qkv (B, T, 3C)
           [](O& o, F qkv, int NH, int t0, float base, bool backward) {
             const int B = qkv.shape(0), T_ = qkv.shape(1), C = qkv.shape(2) / 3;
             T* x = o.ut(qkv);
             if (backward) o.be->rope_backward(x, B, T_, C, NH, t0, base);
             else o.be->rope_forward(x, B, T_, C, NH, t0, base);
             o.be->synchronize();
             auto r = O::dt(x, {B, T_, 3 * C});
             o.clear();
             return r;
           },
           py::arg("qkv"), py::arg("NH"), py::arg("t0") = 0, py::arg("base") = 10000.0f, py::arg("backward") = false)
      .def("rope_at",  // rope_forward_at in place on qkv (B, T, 3C): row (b, t) at position pos[b] + t
           [](O& o, F qkv, I pos, int NH, float base) {
             const int B = qkv.shape(0), T_ = qkv.shape(1), C = qkv.shape(2) / 3;
             T* x = o.ut(qkv);
             o.be->rope_forward_at(x, o.ui(pos), B, T_, C, NH, base);
             o.be->synchronize();
             auto r = O::dt(x, {B, T_, 3 * C});
             o.clear();
             return r;
           },
           py::arg("qkv"), py::arg("pos"), py::arg("NH"), py::arg("base") = 10000.0f)
      .def("qk_norm_forward",  // returns (qkv normed in place, rstd (B*T, 2NH))
           [](O& o, F qkv, int NH) {
             const int B = qkv.shape(0), T_ = qkv.shape(1), C = qkv.shape(2) / 3;
             T* x = o.ut(qkv);
             float* rstd = o.zm(size_t(B) * T_ * 2 * NH);
             o.be->qk_norm_forward(x, rstd, B, T_, C, NH);
             auto r = py::make_tuple(O::dt(x, {B, T_, 3 * C}), O::dm(rstd, {B * T_, 2 * NH}));
             o.clear();
             return r;
           })
      .def("qk_norm_backward",  // dqkv in place, from the forward's output qkv
           [](O& o, F dqkv, F qkv, F rstd, int NH) {
             const int B = qkv.shape(0), T_ = qkv.shape(1), C = qkv.shape(2) / 3;
             T* d = o.ut(dqkv);
             o.be->qk_norm_backward(d, o.ut(qkv), o.um(rstd), B, T_, C, NH);
             auto r = O::dt(d, {B, T_, 3 * C});
             o.clear();
             return r;
           })
      .def("relu2_forward",
           [](O& o, F inp) {
             T* out = o.zt(inp.size());
             o.be->relu2_forward(out, o.ut(inp), inp.size());
             auto r = O::dt(out, {inp.size()});
             o.clear();
             return r;
           })
      .def("relu2_backward",
           [](O& o, F dinp, F inp, F dout) {
             T* a = o.ut(dinp);
             o.be->relu2_backward(a, o.ut(inp), o.ut(dout), inp.size());
             auto r = O::dt(a, {inp.size()});
             o.clear();
             return r;
           })
      .def("matmul_relu2_forward",  // returns (pre, relu(pre)^2)
           [](O& o, F inp, F w, py::object bias) {
             const int N = inp.shape(0), C = inp.shape(1), OC = w.shape(0);
             T* pre = o.zt(size_t(N) * OC);
             T* out = o.zt(size_t(N) * OC);
             o.be->matmul_relu2_forward(pre, out, o.ut(inp), o.ut(w), o.ot(bias), N, C, OC);
             auto r = py::make_tuple(O::dt(pre, {N, OC}), O::dt(out, {N, OC}));
             o.clear();
             return r;
           })
      .def("relu2_matmul_backward",  // returns (dpre, dw, dbias); dpre's and the scratch's initial values are NaN
           [](O& o, F dw, py::object dbias, F dout, F pre, F act, F w) {
             const int N = pre.shape(0), C = pre.shape(1), OC = w.shape(0);
             T* a = o.zt(size_t(N) * C);
             T* scratch = o.zt(size_t(N) * C);
             for (size_t i = 0; i < size_t(N) * C; i++) a[i] = scratch[i] = O::cvt(std::numeric_limits<float>::quiet_NaN());
             float* b = o.um(dw);
             float* c = o.om(dbias);
             o.be->relu2_matmul_backward(a, b, c, o.ut(dout), o.ut(pre), o.ut(act), o.ut(w), scratch, N, C, OC);
             py::object cb = c ? py::object(O::dm(c, {OC})) : py::object(py::none());
             auto r = py::make_tuple(O::dt(a, {N, C}), O::dm(b, {OC, C}), cb);
             o.clear();
             return r;
           })
      .def("softcap_forward",
           [](O& o, F logits, float cap) {
             T* x = o.ut(logits);
             o.be->softcap_forward(x, cap, logits.size());
             o.be->synchronize();
             auto r = O::dt(x, std::vector<py::ssize_t>(logits.shape(), logits.shape() + logits.ndim()));
             o.clear();
             return r;
           })
      .def("crossentropy_softcap",  // the training step's loss with a soft-cap: fused (raw logits, one op) or
           // softcap_forward, crossentropy_forward, loss_accumulate, crossentropy_softcap_backward;
           // returns (losses, lse, count, acc, dlogits)
           [](O& o, F logits, I targets, int V, float cap, float grad_scale, bool fused) {
             const int N = logits.shape(0), Vp = logits.shape(1);
             float* losses = o.zm(N);
             float* lse = o.zm(N);
             float acc0 = 0.0f;
             float* acc = o.um(F(py::array_t<float>(1, &acc0)));
             int32_t* nv = o.ui(I(py::array_t<int32_t>(1)));
             *nv = -12345;  // poisoned: the op must write it
             T* lg = o.ut(logits);
             const int32_t* t = o.ui(targets);
             if (fused) {
               o.be->crossentropy_softcap_forward_backward(losses, lse, lg, t, nv, grad_scale, cap, N, V, Vp);
               o.be->loss_accumulate(acc, losses, nv, N, 1.0f);
             } else {
               o.be->softcap_forward(lg, cap, size_t(N) * Vp);
               o.be->crossentropy_forward(losses, lse, lg, t, nv, N, V, Vp);
               o.be->loss_accumulate(acc, losses, nv, N, 1.0f);
               o.be->crossentropy_softcap_backward(lg, lse, t, nv, grad_scale, cap, N, V, Vp);
             }
             o.be->synchronize();
             auto r = py::make_tuple(O::dm(losses, {N}), O::dm(lse, {N}), long(*nv), double(*acc),
                                     O::dt(lg, {N, Vp}));
             o.clear();
             return r;
           },
           py::arg("logits"), py::arg("targets"), py::arg("V"), py::arg("cap"), py::arg("grad_scale"),
           py::arg("fused") = false)
      // ---- KV-cache inference ops (model/backend.h)
      .def("attention_kv",  // returns (out (B, Tq, C), kcache, vcache) after attention_kv_forward; out poisoned NaN
           [](O& o, F qkv, F kcache, F vcache, I slot, I pos, int NH) {
             const int B = qkv.shape(0), Tq = qkv.shape(1), C = qkv.shape(2) / 3;
             const int S = kcache.shape(0), maxT = kcache.shape(1);
             T* out = o.zt(size_t(B) * Tq * C);
             for (size_t i = 0; i < size_t(B) * Tq * C; i++) out[i] = O::cvt(NAN);
             T* kc = o.ut(kcache);
             T* vc = o.ut(vcache);
             o.be->attention_kv_forward(out, kc, vc, o.ut(qkv), o.ui(slot), o.ui(pos), B, Tq, C, NH, maxT);
             o.be->synchronize();
             auto r = py::make_tuple(O::dt(out, {B, Tq, C}), O::dt(kc, {S, maxT, C}), O::dt(vc, {S, maxT, C}));
             o.clear();
             return r;
           },
           py::arg("qkv"), py::arg("kcache"), py::arg("vcache"), py::arg("slot"), py::arg("pos"), py::arg("NH"))
      .def("encoder_forward_at",
           [](O& o, I inp, F wte, F wpe, I pos) {
             const int B = inp.shape(0), Tn = inp.shape(1), C = wte.shape(1);
             T* out = o.zt(size_t(B) * Tn * C);
             o.be->encoder_forward_at(out, o.ui(inp), o.ut(wte), o.ut(wpe), o.ui(pos), B, Tn, C);
             o.be->synchronize();
             auto r = O::dt(out, {B, Tn, C});
             o.clear();
             return r;
           })
      .def("gather_rows",
           [](O& o, F inp, I rows) {
             const int n = rows.shape(0), C = inp.shape(1);
             T* out = o.zt(size_t(n) * C);
             o.be->gather_rows(out, o.ut(inp), o.ui(rows), n, C);
             o.be->synchronize();
             auto r = O::dt(out, {n, C});
             o.clear();
             return r;
           })
      .def("sample_tokens",  // logits (n, Vp) rounded to T; one setting per row; returns the ids (n)
           [](O& o, F logits, int V, std::vector<float> temperature, std::vector<int> top_k, std::vector<float> top_p,
              std::vector<uint64_t> seed, std::vector<uint64_t> stream, std::vector<uint64_t> step) {
             const int n = logits.shape(0), Vp = logits.shape(1);
             std::vector<gpt2::SampleRow> rows(n);
             for (int i = 0; i < n; i++) rows[i] = {temperature[i], top_k[i], top_p[i], seed[i], stream[i], step[i]};
             I ids(std::vector<py::ssize_t>{n});
             o.be->sample_tokens(ids.mutable_data(), o.ut(logits), rows.data(), n, V, Vp);
             o.clear();
             return ids;
           })
      .def("gelu_forward",
           [](O& o, F inp) {
             T* out = o.zt(inp.size());
             o.be->gelu_forward(out, o.ut(inp), inp.size());
             auto r = O::dt(out, {inp.size()});
             o.clear();
             return r;
           })
      .def("gelu_backward",
           [](O& o, F dinp, F inp, F dout) {
             T* a = o.ut(dinp);
             o.be->gelu_backward(a, o.ut(inp), o.ut(dout), inp.size());
             auto r = O::dt(a, {inp.size()});
             o.clear();
             return r;
           })
      .def("residual_forward",
           [](O& o, F a, F b) {
             T* out = o.zt(a.size());
             o.be->residual_forward(out, o.ut(a), o.ut(b), a.size());
             auto r = O::dt(out, {a.size()});
             o.clear();
             return r;
           })
      .def("crossentropy_forward",
           [](O& o, F logits, py::object targets, int V) {
             const int N = logits.shape(0), Vp = logits.shape(1);
             float* losses = o.zm(N);
             float* lse = o.zm(N);
             const int32_t* t = targets.is_none() ? nullptr : o.ui(targets.cast<I>());
             int32_t* nv = o.ui(I(py::array_t<int32_t>(1)));
             *nv = -12345;  // poisoned: the op must write it
             o.be->crossentropy_forward(losses, lse, o.ut(logits), t, nv, N, V, Vp);
             o.be->synchronize();
             auto r = py::make_tuple(O::dm(losses, {N}), O::dm(lse, {N}), long(*nv));
             o.clear();
             return r;
           })
      .def("crossentropy_backward_inplace",  // with one valid row counted: dloss = grad_scale / 1
           [](O& o, F logits, F lse, I targets, float dloss, int V) {
             const int N = logits.shape(0), Vp = logits.shape(1);
             T* a = o.ut(logits);
             const int32_t* one = o.ui(I(py::array_t<int32_t>(1, std::array<int32_t, 1>{1}.data())));
             o.be->crossentropy_backward(a, o.um(lse), o.ui(targets), one, dloss, N, V, Vp);
             o.be->synchronize();
             auto r = O::dt(a, {N, Vp});
             o.clear();
             return r;
           })
      .def("crossentropy_counted",  // the device-resident loss of forward_backward: counted forward, loss, backward
           // (fused: crossentropy_forward_backward, then the loss, as the model's training step); loss_scale: the
           // dynamic loss scale the backward reads from backend memory
           [](O& o, F logits, I targets, int V, float grad_scale, float acc0, bool fused, float loss_scale) {
             gpt2::LossScaler scaler;
             scaler.scale = loss_scale;
             o.be->set_loss_scaler(scaler);
             const int N = logits.shape(0), Vp = logits.shape(1);
             float* losses = o.zm(N);
             float* lse = o.zm(N);
             float* acc = o.um(F(py::array_t<float>(1, &acc0)));
             int32_t* nv = o.ui(I(py::array_t<int32_t>(1)));  // poisoned below: the op must write it
             *nv = -12345;
             T* lg = o.ut(logits);
             const int32_t* t = o.ui(targets);
             if (fused) {
               o.be->crossentropy_forward_backward(losses, lse, lg, t, nv, grad_scale, N, V, Vp);
               o.be->loss_accumulate(acc, losses, nv, N, grad_scale);
             } else {
               o.be->crossentropy_forward(losses, lse, lg, t, nv, N, V, Vp);
               o.be->loss_accumulate(acc, losses, nv, N, grad_scale);
               o.be->crossentropy_backward(lg, lse, t, nv, grad_scale, N, V, Vp);
             }
             o.be->synchronize();
             auto r = py::make_tuple(O::dm(losses, {N}), O::dm(lse, {N}), long(*nv), double(*acc), O::dt(lg, {N, Vp}));
             o.be->set_loss_scaler(gpt2::LossScaler{});
             o.clear();
             return r;
           },
           py::arg("logits"), py::arg("targets"), py::arg("V"), py::arg("grad_scale"), py::arg("acc0"),
           py::arg("fused") = false, py::arg("loss_scale") = 1.0f)
      .def("sum_squares",
           [](O& o, F p) {
             o.be->grad_sum_squares(o.um(p), p.size());
             const double s = o.be->step_result().sumsq;
             o.clear();
             return s;
           })
      .def("adamw",  // one tensor: AdamW with grad_scale and no clipping; rounding index of value i: offset + i
           [](O& o, F param, F grad, F m, F v, float lr, float beta1, float beta2, float eps, float decay,
              float grad_scale, float bc1, float bc2, uint32_t seed, size_t offset) {
             const size_t n = param.size();
             o.be->set_step_args(gpt2::StepArgs{lr, bc1, bc2, grad_scale, seed, 0.0, 0.0f, 0.0f, lr, lr, 0.0});
             return o.adamw(param, grad, m, v, offset, {{offset, offset + n, decay}}, beta1, beta2, eps, false);
           },
           py::arg("param"), py::arg("grad"), py::arg("m"), py::arg("v"), py::arg("lr"), py::arg("beta1"),
           py::arg("beta2"), py::arg("eps"), py::arg("decay"), py::arg("grad_scale"), py::arg("bc1"), py::arg("bc2"),
           py::arg("seed") = 0, py::arg("offset") = 0)
      .def("clipped_adamw",  // the optimizer step of a training step: norm, clip factor and AdamW over two segments
           [](O& o, F param, F grad, F m, F v, float lr, float bc1, float bc2, uint32_t seed, double clip,
              float loss_scale) {  // the gradients carry the loss scale: the update divides it out
             const size_t n = param.size();
             gpt2::LossScaler scaler;
             scaler.scale = loss_scale;
             o.be->set_loss_scaler(scaler);
             // sumsq poisoned: the update must compute it
             o.be->set_step_args(gpt2::StepArgs{lr, bc1, bc2, 1.0f, seed, clip, 0.0f, 0.0f, lr, lr, -1.0});
             auto r = o.adamw(param, grad, m, v, 0, {{0, n / 2, 0.1f}, {n / 2, n, 0.0f}}, 0.9f, 0.95f, 1e-8f, true);
             o.be->set_loss_scaler(gpt2::LossScaler{});
             return r;
           },
           py::arg("param"), py::arg("grad"), py::arg("m"), py::arg("v"), py::arg("lr"), py::arg("bc1"),
           py::arg("bc2"), py::arg("seed"), py::arg("clip"), py::arg("loss_scale") = 1.0f)
      .def("loss_scale_update",  // the scaler's step after an update whose gradients' sum of squares was sumsq
           [](O& o, float scale, int interval, int clean, int64_t skipped, double sumsq) {
             gpt2::LossScaler s;
             s.scale = scale, s.interval = interval, s.clean = clean, s.skipped = skipped;
             o.be->set_loss_scaler(s);
             o.be->set_step_args(gpt2::StepArgs{0.0f, 1.0f, 1.0f, 1.0f, 0, 0.0, 0.0f, 0.0f, 0.0f, 0.0f, sumsq});
             o.be->loss_scale_update();
             const gpt2::StepResult r = o.be->step_result();
             o.be->set_loss_scaler(gpt2::LossScaler{});
             return py::make_tuple(r.sumsq, r.scaler.scale, r.scaler.clean, r.scaler.skipped);
           })
      .def("newton_schulz",  // Muon's Newton-Schulz of each x[b] (batch, rows, cols), in place on an upload of x
           [](O& o, F x, int steps, bool per_matrix, bool bf16) {
             if (x.ndim() != 3) throw py::value_error("x must be (batch, rows, cols)");
             const int batch = int(x.shape(0)), rows = int(x.shape(1)), cols = int(x.shape(2));
             float* u = o.um(x);
             const size_t need = per_matrix ? o.be->muon_scratch_size(rows, cols)
                                            : o.be->muon_batch_scratch_size(batch, rows, cols);
             float* scratch = o.zm(need);
             std::memset(scratch, 0xff, need * sizeof(float));  // poisoned: NaN until the op writes it
             o.be->set_step_args(gpt2::StepArgs{0.0f, 1.0f, 1.0f, 1.0f, 0, 0.0, 0.0f, 0.0f, 0.0f, 0.0f, 0.0});
             if (per_matrix)
               for (int b = 0; b < batch; b++)
                 o.be->muon_orthogonalize(u + size_t(b) * rows * cols, scratch, rows, cols, steps);
             else
               o.be->muon_orthogonalize_batch(u, scratch, batch, rows, cols, steps, bf16);
             o.be->synchronize();
             auto r = O::dm(u, {batch, rows, cols});
             o.clear();
             return r;
           },
           py::arg("x"), py::arg("steps") = 5, py::arg("per_matrix") = false, py::arg("bf16") = true)
      .def("cast_params",
           [](O& o, F master, uint32_t seed, size_t offset) {
             const size_t n = master.size();
             T* p = o.zt(n);
             o.be->cast_params(p, o.um(master), n, seed, offset);
             auto r = O::dt(p, {py::ssize_t(n)});
             o.clear();
             return r;
           },
           py::arg("master"), py::arg("seed") = 0, py::arg("offset") = 0);
}

}  // namespace

// The modern architecture's kernels without a backend (modern_ops.cu), module functions k_*: dtype 0 float, 1 bf16,
// 2 fp16; every array argument is copied, results come back as new float32 arrays.
void bind_modern_kernels(py::module_& m) {
  auto copy = [](const F& a) {
    F c(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
    std::memcpy(c.mutable_data(), a.data(), size_t(a.size()) * sizeof(float));
    return c;
  };
  m.def("k_rmsnorm_forward", [](int dtype, F a, py::object b, float eps, bool mis) {
    const int N = a.shape(0), C = a.shape(1);
    F res({N, C}), out({N, C}), rstd(N);
    F bb = b.is_none() ? F(0) : b.cast<F>();
    gpt2emu_test::rmsnorm_fwd(dtype, mis, res.mutable_data(), out.mutable_data(), rstd.mutable_data(), a.data(),
                              b.is_none() ? nullptr : bb.data(), N, C, eps);
    return py::make_tuple(res, out, rstd);
  }, py::arg("dtype"), py::arg("a"), py::arg("b"), py::arg("eps"), py::arg("misalign") = false);
  m.def("k_rmsnorm_backward", [copy](int dtype, F dinp, F dout, F inp, F rstd, bool accumulate, bool mis) {
    F g = copy(dinp);
    gpt2emu_test::rmsnorm_bwd(dtype, mis, g.mutable_data(), dout.data(), inp.data(), rstd.data(), inp.shape(0),
                              inp.shape(1), accumulate);
    return g;
  }, py::arg("dtype"), py::arg("dinp"), py::arg("dout"), py::arg("inp"), py::arg("rstd"), py::arg("accumulate"),
     py::arg("misalign") = false);
  m.def("k_qknorm_forward", [copy](int dtype, F qkv, int NH, float eps, bool mis) {  // qkv (BT, 3C)
    F x = copy(qkv), rstd(qkv.shape(0) * 2 * NH);
    gpt2emu_test::qknorm_fwd(dtype, mis, x.mutable_data(), rstd.mutable_data(), qkv.shape(0), qkv.shape(1) / 3, NH,
                             eps);
    return py::make_tuple(x, rstd);
  }, py::arg("dtype"), py::arg("qkv"), py::arg("NH"), py::arg("eps"), py::arg("misalign") = false);
  m.def("k_qknorm_backward", [copy](int dtype, F dqkv, F qkv, F rstd, int NH, bool mis) {
    F g = copy(dqkv);
    gpt2emu_test::qknorm_bwd(dtype, mis, g.mutable_data(), qkv.data(), rstd.data(), qkv.shape(0), qkv.shape(1) / 3,
                             NH);
    return g;
  }, py::arg("dtype"), py::arg("dqkv"), py::arg("qkv"), py::arg("rstd"), py::arg("NH"), py::arg("misalign") = false);
  m.def("k_rope", [copy](int dtype, F qkv, int NH, int maxT, int pos0, double base, bool backward, bool mis) {
    // qkv (B, T, 3C); returns (rotated qkv, table (maxT, HS))
    const int B = qkv.shape(0), T_ = qkv.shape(1), C = qkv.shape(2) / 3;
    F x = copy(qkv), table({maxT, C / NH});
    gpt2emu_test::rope(dtype, mis, x.mutable_data(), table.mutable_data(), B, T_, C, NH, maxT, pos0, base, backward);
    return py::make_tuple(x, table);
  }, py::arg("dtype"), py::arg("qkv"), py::arg("NH"), py::arg("maxT"), py::arg("pos0"), py::arg("base"),
     py::arg("backward"), py::arg("misalign") = false);
  m.def("k_attention_kv_splits", [copy](int dtype, F qkv, F kcache, F vcache, I slot, I pos, int NH, int splits) {
    // infer.cuh's decode attention with a given split count: returns (out (B, Tq, C), kcache, vcache)
    const int B = qkv.shape(0), Tq = qkv.shape(1), C = qkv.shape(2) / 3, S = kcache.shape(0), maxT = kcache.shape(1);
    if (slot.size() != B || pos.size() != B || vcache.shape(0) != S || vcache.shape(1) != maxT)
      throw py::value_error("k_attention_kv_splits: slot / pos (B), kcache / vcache (S, maxT, C)");
    F out({B, Tq, C}), kc = copy(kcache), vc = copy(vcache);
    gpt2emu_test::attention_kv_splits(dtype, out.mutable_data(), kc.mutable_data(), vc.mutable_data(), qkv.data(),
                                      slot.data(), pos.data(), S, B, Tq, C, NH, maxT, splits);
    return py::make_tuple(out, kc, vc);
  }, py::arg("dtype"), py::arg("qkv"), py::arg("kcache"), py::arg("vcache"), py::arg("slot"), py::arg("pos"),
     py::arg("NH"), py::arg("splits"));
  m.def("decode_splits", [](int B, int Tq, int NH, int maxT, int sms) {
    return gpt2emu_test::decode_splits(B, Tq, NH, maxT, sms);
  }, py::arg("B"), py::arg("Tq"), py::arg("NH"), py::arg("maxT"), py::arg("sms") = 132);
  m.def("k_relu2_forward", [](int dtype, F inp, bool mis) {
    F out(inp.size());
    gpt2emu_test::relu2_fwd(dtype, mis, out.mutable_data(), inp.data(), inp.size());
    return out;
  }, py::arg("dtype"), py::arg("inp"), py::arg("misalign") = false);
  m.def("k_relu2_backward", [copy](int dtype, F dinp, F inp, F dout, bool accumulate, bool inplace, bool mis) {
    F g = copy(dinp);
    gpt2emu_test::relu2_bwd(dtype, mis, g.mutable_data(), inp.data(), dout.data(), inp.size(), accumulate, inplace);
    return g;
  }, py::arg("dtype"), py::arg("dinp"), py::arg("inp"), py::arg("dout"), py::arg("accumulate"),
     py::arg("inplace") = false, py::arg("misalign") = false);
  m.def("k_classifier", [](int dtype, int mode, F logits, I targets, int V, float cap, float grad_scale, bool mis) {
    // returns (losses, lse, count, capped logits or None (mode 2), dlogits or None (mode 0))
    const int N = logits.shape(0), Vp = logits.shape(1);
    F losses(N), lse(N), capped({N, Vp}), dl({N, Vp});
    int count = -12345;
    gpt2emu_test::classifier(dtype, mis, mode, losses.mutable_data(), lse.mutable_data(), &count,
                             capped.mutable_data(), dl.mutable_data(), logits.data(), targets.data(), N, V, Vp, cap,
                             grad_scale);
    return py::make_tuple(losses, lse, count, mode != 2 ? py::object(capped) : py::object(py::none()),
                          mode ? py::object(dl) : py::object(py::none()));
  }, py::arg("dtype"), py::arg("mode"), py::arg("logits"), py::arg("targets"), py::arg("V"), py::arg("cap"),
     py::arg("grad_scale") = 1.0f, py::arg("misalign") = false);
  m.def("k_layernorm_nobias", [copy](int dtype, F inp, F w, F dout, F dinp, F dw, bool mis) {
    // forward and backward without bias: (out, mean, rstd, dinp += ..., dw += ...)
    const int N = inp.shape(0), C = inp.shape(1);
    F out({N, C}), mean(N), rstd(N), g = copy(dinp), gw = copy(dw);
    gpt2emu_test::layernorm_nobias(dtype, mis, out.mutable_data(), mean.mutable_data(), rstd.mutable_data(),
                                   g.mutable_data(), gw.mutable_data(), inp.data(), w.data(), dout.data(), N, C);
    return py::make_tuple(out, mean, rstd, g, gw);
  }, py::arg("dtype"), py::arg("inp"), py::arg("w"), py::arg("dout"), py::arg("dinp"), py::arg("dw"),
     py::arg("misalign") = false);
  m.def("k_encoder_nowpe", [copy](int dtype, I inp, F wte, F dout, F dwte, bool mis) {
    // token embedding only: (out (BT, C), dwte += ...)
    const int BT = inp.size(), Vp = wte.shape(0), C = wte.shape(1);
    F out({BT, C}), g = copy(dwte);
    gpt2emu_test::encoder_nowpe(dtype, mis, out.mutable_data(), g.mutable_data(), inp.data(), wte.data(), dout.data(),
                                BT, Vp, C);
    return py::make_tuple(out, g);
  }, py::arg("dtype"), py::arg("inp"), py::arg("wte"), py::arg("dout"), py::arg("dwte"), py::arg("misalign") = false);
}

void bind_cuda_emu_ops(py::module_& m) {
  m.def("set_schedule", [](const std::string& s) { gpt2emu::set_schedule(s.c_str()); },
        "Emulator schedule for later launches: fwd, rev, random:<seed>, low, high or ahead:<seed>.");
  m.def("launch_count", []() { return gpt2emu::launch_count(); });
  // The calling thread's current device, as another library sharing the process would set it (tests of make_current:
  // every backend entry point makes its own GPU current again).
  m.def("set_device", [](int d) {
    if (cudaSetDevice(d) != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::invalid_argument("set_device: no emulated device " + std::to_string(d));
    }
  });
  m.def("get_device", []() {
    int d = -1;
    (void)cudaGetDevice(&d);
    return d;
  });
  m.def("memory_checker_enabled", []() { return gpt2emu::memory_checker_enabled(); },
        "Whether the emulator's race / bounds checker checks the kernels.");
  // The matmul seam's CPU implementation (csrc/emu/seams_cpu.cpp) on raw addresses, every MatmulParams field by
  // keyword: runs it on the very buffers another implementation described (tests/csrc/cuda/test_cublaslt_descriptors.py).
  m.def("seam_matmul", [](uint64_t d, uint64_t a, uint64_t b, uint64_t bias, uint64_t pre_gelu, int d_type, int a_type,
                          int b_type, int lda, int ldb, int ldd, bool trans_a, bool trans_b, int m, int n, int k,
                          float alpha, bool accumulate, int epilogue, int batch, long long stride_a,
                          long long stride_b, long long stride_d, uint64_t bias_grad, uint64_t a_scale,
                          uint64_t b_scale) {
    namespace s = gpt2core::seams;
    s::MatmulParams p;
    p.d = reinterpret_cast<void*>(d), p.a = reinterpret_cast<const void*>(a), p.b = reinterpret_cast<const void*>(b);
    p.bias = reinterpret_cast<const void*>(bias), p.pre_gelu = reinterpret_cast<void*>(pre_gelu);
    p.d_type = s::DType(d_type), p.a_type = s::DType(a_type), p.b_type = s::DType(b_type);
    p.lda = lda, p.ldb = ldb, p.ldd = ldd, p.trans_a = trans_a, p.trans_b = trans_b, p.m = m, p.n = n, p.k = k;
    p.alpha = alpha, p.accumulate = accumulate, p.epilogue = s::Epilogue(epilogue), p.batch = batch;
    p.stride_a = stride_a, p.stride_b = stride_b, p.stride_d = stride_d;
    p.bias_grad = reinterpret_cast<void*>(bias_grad);
    p.a_scale = reinterpret_cast<const float*>(a_scale), p.b_scale = reinterpret_cast<const float*>(b_scale);
    return int(s::matmul(p));
  }, py::kw_only(), py::arg("d"), py::arg("a"), py::arg("b"), py::arg("bias"), py::arg("pre_gelu"), py::arg("d_type"),
     py::arg("a_type"), py::arg("b_type"), py::arg("lda"), py::arg("ldb"), py::arg("ldd"), py::arg("trans_a"),
     py::arg("trans_b"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("alpha"), py::arg("accumulate"),
     py::arg("epilogue"), py::arg("batch"), py::arg("stride_a"), py::arg("stride_b"), py::arg("stride_d"),
     py::arg("bias_grad") = 0, py::arg("a_scale") = 0, py::arg("b_scale") = 0);
  // NVIDIA's own float -> fp8 conversion (cuda_fp8.h's host code, __NV_SATFINITE) on float32 values, as bit
  // patterns: what tests/csrc/cuda/test_fp8.py checks model/fp8.h's conversion against, beside ml_dtypes.
  m.def("nv_float_to_fp8", [](F x, const std::string& kind) {
    const __nv_fp8_interpretation_t k = kind == "e4m3" ? __NV_E4M3 : __NV_E5M2;
    py::array_t<uint8_t> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
    for (py::ssize_t i = 0; i < x.size(); i++)
      out.mutable_data()[i] = uint8_t(__nv_cvt_float_to_fp8(x.data()[i], __NV_SATFINITE, k));
    return out;
  }, py::arg("x"), py::arg("kind"));
  // model/fp8.h's conversion as bit patterns (gpt2core.fp8_cast returns the values)
  m.def("float_to_fp8", [](F x, const std::string& kind) {
    const gpt2::Fp8Kind k = kind == "e4m3" ? gpt2::Fp8Kind::E4M3 : gpt2::Fp8Kind::E5M2;
    py::array_t<uint8_t> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
    for (py::ssize_t i = 0; i < x.size(); i++) out.mutable_data()[i] = gpt2::float_to_fp8(x.data()[i], k);
    return out;
  }, py::arg("x"), py::arg("kind"));
  m.def("fp8_scale", [](float amax, const std::string& kind) {
    return gpt2::fp8_scale(amax, kind == "e4m3" ? gpt2::Fp8Kind::E4M3 : gpt2::Fp8Kind::E5M2);
  }, py::arg("amax"), py::arg("kind"));
  // The attention seam's CPU implementation in a 16-bit dtype (1 = BF16, 2 = F16) on raw addresses
  // (tests/csrc/cuda/test_cudnn_graph.py): forward when dqkv is 0 (writes out, stats), backward otherwise (writes dqkv).
  m.def("seam_attention", [](uint64_t qkv, uint64_t out, uint64_t stats, uint64_t dout, uint64_t dqkv, int B, int T,
                             int NH, int HS, float scale, int dtype) {
    namespace s = gpt2core::seams;
    if (!dqkv) {
      s::AttentionForwardParams p;
      p.out = reinterpret_cast<void*>(out), p.stats = reinterpret_cast<float*>(stats);
      p.qkv = reinterpret_cast<const void*>(qkv), p.dtype = s::DType(dtype);
      p.B = B, p.T = T, p.NH = NH, p.HS = HS, p.scale = scale;
      return int(s::attention_forward(p));
    }
    s::AttentionBackwardParams p;
    p.dqkv = reinterpret_cast<void*>(dqkv), p.dout = reinterpret_cast<const void*>(dout);
    p.qkv = reinterpret_cast<const void*>(qkv), p.out = reinterpret_cast<const void*>(out);
    p.stats = reinterpret_cast<const float*>(stats), p.dtype = s::DType(dtype);
    p.B = B, p.T = T, p.NH = NH, p.HS = HS, p.scale = scale;
    return int(s::attention_backward(p));
  }, py::kw_only(), py::arg("qkv"), py::arg("out"), py::arg("stats"), py::arg("dout"), py::arg("dqkv"), py::arg("B"),
     py::arg("T"), py::arg("NH"), py::arg("HS"), py::arg("scale"), py::arg("dtype") = 1);
  // csrc/cuda/attention_tc.cuh's forward + backward called directly (attention_tc_ops.cu), fp16 (f16=True) or bf16:
  // qkv (B, T, 3C), dout (B, T, C), dqkv (B, T, 3C) as uint16 bit patterns -> (out, lse, dqkv + gradient); with
  // accumulate=False the backward writes the gradient (InputGrad::Write) into a poisoned dqkv.
  using U16 = py::array_t<uint16_t, py::array::c_style | py::array::forcecast>;
  m.def("attention_tc", [](bool f16, U16 qkv, U16 dout, U16 dqkv, int NH, bool misalign, bool accumulate) {
    if (qkv.ndim() != 3 || qkv.shape(2) % 3 || dout.ndim() != 3 || dqkv.ndim() != 3)
      throw py::value_error("attention_tc: qkv and dqkv (B, T, 3C), dout (B, T, C)");
    const int B = int(qkv.shape(0)), T = int(qkv.shape(1)), C = int(qkv.shape(2) / 3);
    if (dout.shape(0) != B || dout.shape(1) != T || dout.shape(2) != C || dqkv.shape(0) != B ||
        dqkv.shape(1) != T || dqkv.shape(2) != 3 * C || NH <= 0 || C % NH)
      throw py::value_error("attention_tc: shapes disagree (or C is not a multiple of NH)");
    U16 out({B, T, C}), grad(std::vector<py::ssize_t>{B, T, 3 * C});
    py::array_t<float> lse({B, NH, T});
    std::memcpy(grad.mutable_data(), dqkv.data(), size_t(dqkv.size()) * 2);
    gpt2emu_test::attention_tc_16(f16, out.mutable_data(), lse.mutable_data(), grad.mutable_data(), qkv.data(),
                                  dout.data(), B, T, C, NH, misalign, accumulate);
    return py::make_tuple(out, lse, grad);
  }, py::arg("f16"), py::arg("qkv"), py::arg("dout"), py::arg("dqkv"), py::arg("NH"), py::arg("misalign") = false,
        py::arg("accumulate") = true);
  // csrc/cuda/reduce.cuh called directly (kernel_ops.cu): out (C) + the column sums of inp (N, C) (fp32, or bf16
  // bits as uint16), returned with the chunk count R; and pass 2 alone, out (C) + sum_r partial (R, C).
  m.def("column_sum", [](F out0, py::array inp, bool misalign) {
    if (inp.ndim() != 2 || out0.ndim() != 1 || out0.shape(0) != inp.shape(1))
      throw py::value_error("column_sum: inp (N, C) float32 or uint16 (bf16 bits), out (C)");
    const bool bf16 = inp.dtype().is(py::dtype::of<uint16_t>());
    if (!bf16 && !inp.dtype().is(py::dtype::of<float>()))
      throw py::value_error("column_sum: inp must be float32 or uint16 (bf16 bits)");
    auto c = py::array::ensure(inp, py::array::c_style);
    F out(out0.size());
    std::memcpy(out.mutable_data(), out0.data(), size_t(out0.size()) * sizeof(float));
    const int R = gpt2emu_test::column_sum(bf16, out.mutable_data(), c.data(), int(inp.shape(0)), int(inp.shape(1)),
                                           misalign);
    return py::make_tuple(out, R);
  }, py::arg("out"), py::arg("inp"), py::arg("misalign") = false);
  m.def("column_reduce", [](F out0, F partial) {
    if (partial.ndim() != 2 || out0.ndim() != 1 || out0.shape(0) != partial.shape(1))
      throw py::value_error("column_reduce: partial (R, C), out (C)");
    F out(out0.size());
    std::memcpy(out.mutable_data(), out0.data(), size_t(out0.size()) * sizeof(float));
    gpt2emu_test::column_reduce(out.mutable_data(), partial.data(), int(partial.shape(0)), int(partial.shape(1)));
    return out;
  }, py::arg("out"), py::arg("partial"));
  // classifier.cuh's one-block row loops alone (kernel_ops.cu): (count of targets >= 0, acc0 + scale * sum / count)
  m.def("loss_count_accumulate", [](I targets, F losses, float scale, float acc0) {
    if (targets.ndim() != 1 || losses.ndim() != 1 || targets.size() != losses.size())
      throw py::value_error("loss_count_accumulate: targets (N) int32 and losses (N) float32");
    float acc = acc0;
    const int c = gpt2emu_test::loss_count_accumulate(&acc, targets.data(), losses.data(), int(targets.size()), scale);
    return py::make_tuple(c, acc);
  }, py::arg("targets"), py::arg("losses"), py::arg("scale"), py::arg("acc0"));
  bind_modern_kernels(m);
  bind_ops<float>(m, "Ops", "Backend<float> ops of one backend on numpy arrays (tests only).");
  bind_ops<gpt2::bf16>(m, "OpsBF16",
                       "Backend<bf16> ops of the emulated CUDA backend on numpy arrays: T-typed arguments rounded "
                       "to bf16 (tests only).");
  bind_ops<gpt2::f16>(m, "OpsF16",
                      "Backend<f16> ops of the emulated CUDA backend on numpy arrays: T-typed arguments rounded "
                      "to fp16 (tests only).");
  // gpt2::float_to_f16 / f16_to_float (csrc/model/dtypes.h) elementwise, for the exhaustive conversion test
  m.def("f16_bits", [](F x) {
    py::array_t<uint16_t> out(x.size());
    for (py::ssize_t i = 0; i < x.size(); i++) out.mutable_data()[i] = gpt2::float_to_f16(x.data()[i]).bits;
    return out;
  });
  m.def("f16_values", [](py::array_t<uint16_t, py::array::c_style | py::array::forcecast> h) {
    F out(h.size());
    for (py::ssize_t i = 0; i < h.size(); i++) out.mutable_data()[i] = gpt2::f16_to_float(gpt2::f16{h.data()[i]});
    return out;
  });
}
