// Test-only bindings of the emulated module (gpt2core_cuda_emu.ops): every Backend<float> op of a backend
// ("cpu" or the emulated "cuda") on numpy arrays, so tests can compare the two op by op. Inputs are copied
// into backend allocations; outputs (and accumulated-into buffers, given with their initial values) come
// back as new arrays. Under the emulation "device" memory is host memory, so copies are plain memcpy.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "model/backend_factory.h"

namespace gpt2emu {
void set_schedule(const char* spec);
unsigned long long launch_count();
}  // namespace gpt2emu

namespace py = pybind11;
using F = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

namespace {

struct Ops {
  std::unique_ptr<gpt2::Backend<float>> be;
  std::vector<std::pair<float*, size_t>> bufs;  // (allocation, size)
  std::vector<int32_t*> ibufs;
  int shift = 0;  // misalign: float buffers start 4 bytes into their allocation (not 16-byte aligned)

  Ops(const std::string& device, bool misalign) : be(gpt2::make_backend<float>(device)), shift(misalign ? 1 : 0) {}
  ~Ops() { clear(); }
  void clear() {
    for (auto& b : bufs) be->free(b.first);
    for (auto* p : ibufs) be->free_i32(p);
    bufs.clear();
    ibufs.clear();
  }
  float* up(const F& a) {
    float* p = zeros(a.size());
    std::memcpy(p, a.data(), a.size() * sizeof(float));
    return p;
  }
  float* zeros(size_t n) {
    float* p = be->alloc(n + shift);
    bufs.push_back({p, n + shift});
    return p + shift;
  }
  int32_t* up(const I& a) {
    int32_t* p = be->alloc_i32(a.size());
    be->to_device_i32(p, a.data(), a.size());
    ibufs.push_back(p);
    return p;
  }
  static F down(const float* p, std::vector<py::ssize_t> shape) {
    F out(shape);
    std::memcpy(out.mutable_data(), p, out.size() * sizeof(float));
    return out;
  }
};

}  // namespace

void bind_cuda_emu_ops(py::module_& m) {
  m.def("set_schedule", [](const std::string& s) { gpt2emu::set_schedule(s.c_str()); },
        "Emulator schedule for later launches: fwd, rev or random:<seed>.");
  m.def("launch_count", []() { return gpt2emu::launch_count(); });
  py::class_<Ops>(m, "Ops", "Backend<float> ops of one backend on numpy arrays (tests only).")
      .def(py::init<const std::string&, bool>(), py::arg("device"), py::arg("misalign") = false)
      .def("encoder_forward",
           [](Ops& o, I inp, F wte, F wpe) {
             const int B = inp.shape(0), T = inp.shape(1), C = wte.shape(1);
             float* out = o.zeros(size_t(B) * T * C);
             o.be->encoder_forward(out, o.up(inp), o.up(wte), o.up(wpe), B, T, C);
             auto r = Ops::down(out, {B, T, C});
             o.clear();
             return r;
           })
      .def("encoder_backward",
           [](Ops& o, F dwte, F dwpe, F dout, I inp) {
             const int B = inp.shape(0), T = inp.shape(1), C = dwte.shape(1);
             float* a = o.up(dwte);
             float* b = o.up(dwpe);
             o.be->encoder_backward(a, b, o.up(dout), o.up(inp), B, T, C);
             auto r = py::make_tuple(Ops::down(a, {dwte.shape(0), C}), Ops::down(b, {dwpe.shape(0), C}));
             o.clear();
             return r;
           })
      .def("layernorm_forward",
           [](Ops& o, F inp, F w, F b) {
             const int N = inp.shape(0), C = inp.shape(1);
             float* out = o.zeros(size_t(N) * C);
             float* mean = o.zeros(N);
             float* rstd = o.zeros(N);
             o.be->layernorm_forward(out, mean, rstd, o.up(inp), o.up(w), o.up(b), N, C);
             auto r = py::make_tuple(Ops::down(out, {N, C}), Ops::down(mean, {N}), Ops::down(rstd, {N}));
             o.clear();
             return r;
           })
      .def("layernorm_backward",
           [](Ops& o, F dinp, F dw, F db, F dout, F inp, F w, F mean, F rstd) {
             const int N = inp.shape(0), C = inp.shape(1);
             float* a = o.up(dinp);
             float* b = o.up(dw);
             float* c = o.up(db);
             o.be->layernorm_backward(a, b, c, o.up(dout), o.up(inp), o.up(w), o.up(mean), o.up(rstd), N, C);
             auto r = py::make_tuple(Ops::down(a, {N, C}), Ops::down(b, {C}), Ops::down(c, {C}));
             o.clear();
             return r;
           })
      .def("matmul_forward",
           [](Ops& o, F inp, F w, py::object bias) {
             const int N = inp.shape(0), C = inp.shape(1), OC = w.shape(0);
             float* out = o.zeros(size_t(N) * OC);
             const float* bp = bias.is_none() ? nullptr : o.up(bias.cast<F>());
             o.be->matmul_forward(out, o.up(inp), o.up(w), bp, N, C, OC);
             auto r = Ops::down(out, {N, OC});
             o.clear();
             return r;
           })
      .def("matmul_backward",
           [](Ops& o, F dinp, F dw, py::object dbias, F dout, F inp, F w) {
             const int N = inp.shape(0), C = inp.shape(1), OC = w.shape(0);
             float* a = o.up(dinp);
             float* b = o.up(dw);
             float* c = dbias.is_none() ? nullptr : o.up(dbias.cast<F>());
             o.be->matmul_backward(a, b, c, o.up(dout), o.up(inp), o.up(w), N, C, OC);
             py::object cb = c ? py::object(Ops::down(c, {OC})) : py::object(py::none());
             auto r = py::make_tuple(Ops::down(a, {N, C}), Ops::down(b, {OC, C}), cb);
             o.clear();
             return r;
           })
      .def("attention",
           [](Ops& o, F qkv, F dout, F dqkv, int NH) {
             // forward, then backward with the forward's att buffer; returns (out, dqkv)
             const int B = qkv.shape(0), T = qkv.shape(1), C = qkv.shape(2) / 3;
             float* out = o.zeros(size_t(B) * T * C);
             float* att = o.zeros(o.be->attention_state_size(B, NH, T));
             float* q = o.up(qkv);
             o.be->attention_forward(out, att, q, B, T, C, NH);
             float* d = o.up(dqkv);
             o.be->attention_backward(d, o.up(dout), q, out, att, B, T, C, NH);
             auto r = py::make_tuple(Ops::down(out, {B, T, C}), Ops::down(d, {B, T, 3 * C}));
             o.clear();
             return r;
           })
      .def("gelu_forward",
           [](Ops& o, F inp) {
             float* out = o.zeros(inp.size());
             o.be->gelu_forward(out, o.up(inp), inp.size());
             auto r = Ops::down(out, {inp.size()});
             o.clear();
             return r;
           })
      .def("gelu_backward",
           [](Ops& o, F dinp, F inp, F dout) {
             float* a = o.up(dinp);
             o.be->gelu_backward(a, o.up(inp), o.up(dout), inp.size());
             auto r = Ops::down(a, {inp.size()});
             o.clear();
             return r;
           })
      .def("residual_forward",
           [](Ops& o, F a, F b) {
             float* out = o.zeros(a.size());
             o.be->residual_forward(out, o.up(a), o.up(b), a.size());
             auto r = Ops::down(out, {a.size()});
             o.clear();
             return r;
           })
      .def("crossentropy_forward",
           [](Ops& o, F logits, py::object targets, int V) {
             const int N = logits.shape(0), Vp = logits.shape(1);
             float* losses = o.zeros(N);
             float* lse = o.zeros(N);
             const int32_t* t = targets.is_none() ? nullptr : o.up(targets.cast<I>());
             const long valid = o.be->crossentropy_forward(losses, lse, o.up(logits), t, N, V, Vp);
             auto r = py::make_tuple(Ops::down(losses, {N}), Ops::down(lse, {N}), valid);
             o.clear();
             return r;
           })
      .def("crossentropy_backward_inplace",
           [](Ops& o, F logits, F lse, I targets, float dloss, int V) {
             const int N = logits.shape(0), Vp = logits.shape(1);
             float* a = o.up(logits);
             o.be->crossentropy_backward_inplace(a, o.up(lse), o.up(targets), dloss, N, V, Vp);
             auto r = Ops::down(a, {N, Vp});
             o.clear();
             return r;
           })
      .def("sum_squares",
           [](Ops& o, F p) {
             const double s = o.be->sum_squares(o.up(p), p.size());
             o.clear();
             return s;
           })
      .def("adamw",
           [](Ops& o, F param, F grad, F m, F v, float lr, float beta1, float beta2, float eps, float decay,
              float grad_scale, float bc1, float bc2) {
             float* p = o.up(param);
             float* mm = o.up(m);
             float* vv = o.up(v);
             o.be->adamw(p, o.up(grad), mm, vv, param.size(), lr, beta1, beta2, eps, decay, grad_scale, bc1, bc2);
             auto r = py::make_tuple(Ops::down(p, {param.size()}), Ops::down(mm, {param.size()}),
                                     Ops::down(vv, {param.size()}));
             o.clear();
             return r;
           });
}
