// The one PYBIND11_MODULE. Arguments are validated here, once, with messages that name the argument;
// the model and its backends trust their inputs.
#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "cpu/backend_cpu.h"
#include "backends.h"
#include "cpu/blas.h"
#include "cpu/gemm_bf16.h"
#include "model/fp8.h"
#include "model/gpt2.h"
#include "bindings_infer.h"

// The module's name: _C for the package; the test-only emulated-CUDA module (tests/csrc/cuda/cuda_emu) builds this
// same file under another name, without the distributed bindings, plus its own extra bindings.
#ifndef GPT2CORE_MODULE_NAME
#define GPT2CORE_MODULE_NAME _C
#endif
#ifndef GPT2CORE_HAS_CUDNN_SDPA
#define GPT2CORE_HAS_CUDNN_SDPA 0
#endif
#ifndef GPT2CORE_WITH_DIST
#define GPT2CORE_WITH_DIST 1
#endif
// The CUDA backend: GPT2CORE_CUDA_MODULE=1 in the package's _C, which imports a CUDA module on first use (this
// build's gpt2core._C_cuda or a plugin's, see load_cuda_backend); GPT2CORE_BACKEND_CUDA=1 when it is linked into this module (the emulated test build).
#ifndef GPT2CORE_CUDA_MODULE
#define GPT2CORE_CUDA_MODULE 0
#endif
#ifndef GPT2CORE_BACKEND_CUDA
#define GPT2CORE_BACKEND_CUDA 0
#endif
#if GPT2CORE_BACKEND_CUDA
#include "cuda/plugin.h"
#endif

#include "cuda_loader.h"  // load_cuda_backend

namespace py = pybind11;
#if GPT2CORE_WITH_DIST
void bind_dist(py::module_& m);  // bindings_dist.cpp
#endif
#ifdef GPT2CORE_EXTRA_BINDINGS
void GPT2CORE_EXTRA_BINDINGS(py::module_& m);
#endif
using gpt2::GPT2Model;
using gpt2::ModelConfig;

namespace {

// gpt2::cuda_status(), where a CUDA backend that cannot be loaded says why
std::string cuda_status() {
  try {
    load_cuda_backend();
  } catch (py::error_already_set& e) {
    return "the CUDA backend could not be loaded: " + std::string(py::str(e.value()));
  }
  return gpt2::cuda_status();
}

[[noreturn]] void arg_error(const std::string& msg) { throw py::value_error(msg); }

// An int32, C-contiguous, 2-D array: the only form the core reads token ids in. Targets (allow_ignore) may
// mark ignored positions with -1 or with Hugging Face's -100; the core sees only -1 (a copy, when -100 occurs).
py::array_t<int32_t> check_tokens(const py::handle& obj, const char* name, int B, int Tn, bool allow_ignore,
                                  int vocab_size, int max_T) {
  if (!py::isinstance<py::array>(obj)) arg_error(std::string(name) + " must be a numpy array of int32");
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (!py::array_t<int32_t>::check_(arr))  // numpy's dtype equivalence, not identity (pickled arrays)
    arg_error(std::string(name) + " must be int32 of shape (B, T), got dtype " + std::string(py::str(arr.dtype())));
  if (arr.ndim() != 2) arg_error(std::string(name) + " must be int32 of shape (B, T), got " + std::to_string(arr.ndim()) + " dimensions");
  if (!(arr.flags() & py::array::c_style)) arg_error(std::string(name) + " must be C-contiguous (use np.ascontiguousarray)");
  if (B >= 0 && (arr.shape(0) != B || arr.shape(1) != Tn)) {
    std::ostringstream s;
    s << name << " must have the same shape as idx (" << B << ", " << Tn << "), got (" << arr.shape(0) << ", " << arr.shape(1) << ")";
    arg_error(s.str());
  }
  if (arr.shape(0) <= 0 || arr.shape(1) <= 0) arg_error(std::string(name) + " must be non-empty");
  if (arr.shape(1) > max_T) {
    std::ostringstream s;
    s << name << ": sequence length T=" << arr.shape(1) << " exceeds the model's block size (max_seq_len=" << max_T << ")";
    arg_error(s.str());
  }
  auto a = py::reinterpret_borrow<py::array_t<int32_t>>(arr);
  const int32_t* p = a.data();
  const py::ssize_t n = a.size();
  constexpr int32_t kHfIgnore = -100;
  bool has_hf_ignore = false;
  for (py::ssize_t i = 0; i < n; i++) {
    const bool ignored = allow_ignore && (p[i] == -1 || p[i] == kHfIgnore);
    has_hf_ignore |= allow_ignore && p[i] == kHfIgnore;
    if (!ignored && (p[i] < 0 || p[i] >= vocab_size)) {
      std::ostringstream s;
      s << name << " contains id " << p[i] << " at flat position " << i << "; valid ids are 0.." << vocab_size - 1
        << (allow_ignore ? ", or -1 or -100 for an ignored position" : "");
      arg_error(s.str());
    }
  }
  if (!has_hf_ignore) return a;
  py::array_t<int32_t> mapped({arr.shape(0), arr.shape(1)});
  std::replace_copy(p, p + n, mapped.mutable_data(), kHfIgnore, -1);
  return mapped;
}

// The architecture's fields (GPT2Config's names; python/gpt2core/config.py documents them).
struct Arch {
  std::string position = "learned", norm = "layernorm", activation = "gelu";
  float rope_base = 10000.0f;
  bool qk_norm = false, bias = true, tie_embeddings = true;
  float logit_softcap = 0.0f;
};

ModelConfig make_config(int max_seq_len, int vocab_size, int padded_vocab_size, int n_layer, int n_head, int n_embd,
                        const Arch& a) {
  ModelConfig c;
  using P = ModelConfig::Position;
  using N = ModelConfig::Norm;
  using A = ModelConfig::Activation;
  if (a.position != "learned" && a.position != "rope")
    arg_error("position must be 'learned' or 'rope', got '" + a.position + "'");
  if (a.norm != "layernorm" && a.norm != "rmsnorm") arg_error("norm must be 'layernorm' or 'rmsnorm', got '" + a.norm + "'");
  if (a.activation != "gelu" && a.activation != "relu2")
    arg_error("activation must be 'gelu' or 'relu2', got '" + a.activation + "'");
  c.position = a.position == "rope" ? P::Rope : P::Learned;
  c.norm = a.norm == "rmsnorm" ? N::RmsNorm : N::LayerNorm;
  c.activation = a.activation == "relu2" ? A::Relu2 : A::Gelu;
  c.rope_base = a.rope_base;
  c.qk_norm = a.qk_norm;
  c.bias = a.bias;
  c.tie_embeddings = a.tie_embeddings;
  c.logit_softcap = a.logit_softcap;
  c.max_seq_len = max_seq_len;
  c.vocab_size = vocab_size;
  c.padded_vocab_size = padded_vocab_size;
  c.n_layer = n_layer;
  c.n_head = n_head;
  c.n_embd = n_embd;
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
  return c;
}

gpt2::Recompute parse_recompute(const std::string& r) {
  if (r == "none") return gpt2::Recompute::None;
  if (r == "gelu") return gpt2::Recompute::Gelu;
  if (r == "layer") return gpt2::Recompute::Layer;
  arg_error("recompute must be 'none', 'gelu' or 'layer', got '" + r + "'");
}
std::string recompute_name(gpt2::Recompute r) {
  return r == gpt2::Recompute::Layer ? "layer" : r == gpt2::Recompute::Gelu ? "gelu" : "none";
}

// A 1-D, C-contiguous, writable array of F that is already backend memory (no conversion: a copy would be host
// memory the device cannot reach, and writes to it would be lost): DataParallel's staging buffer.
template <typename F>
F* staging_array(py::array& a, const char* what) {
  if (a.ndim() != 1 || !py::isinstance<py::array_t<F>>(a) || !(a.flags() & py::array::c_style) || !a.writeable())
    throw py::value_error(std::string(what) + ": needs a 1-D, contiguous, writable float32 buffer in backend memory "
                          "(_C.dist.alloc_state(model, n, pinned=False))");
  return static_cast<F*>(a.mutable_data());
}

// The backend's options from the constructor's arguments (GPT2(precision=..., attention=..., fused=...,
// matmul_tuning=..., deterministic=...)).
gpt2::BackendOptions backend_options(bool tf32, const std::string& attention, bool fused, bool matmul_tuning,
                                     bool deterministic) {
  gpt2::BackendOptions o;
  o.tf32 = tf32;
  o.fused = fused;
  o.matmul_tuning = matmul_tuning;
  o.deterministic = deterministic;
  if (!gpt2::parse_attention(attention, &o.attention))
    arg_error("attention must be 'auto', 'flash', 'cudnn' or 'naive', got '" + attention + "'");
  return o;
}

// A numpy view of count values at ptr, owned by `owner` (no copy).
template <typename T>
py::array view(T* ptr, std::vector<py::ssize_t> shape, py::handle owner) {
  return py::array(py::dtype::of<T>(), shape, ptr, owner);
}

template <typename T>
py::dict named_views(GPT2Model<T>& m, gpt2::Master<T>* base, py::handle owner) {
  py::dict out;
  auto shapes = gpt2::param_shapes(m.config());
  const auto& names = gpt2::param_names();
  for (int i = 0; i < gpt2::kNumParamTensors; i++) {
    if (!gpt2::param_present(m.config(), i)) continue;  // a tensor this architecture does not have
    std::vector<py::ssize_t> shape;
    for (size_t d : shapes[i]) if (d) shape.push_back(py::ssize_t(d));
    out[names[i]] = view(base + m.param_offsets()[i], shape, owner);
  }
  return out;
}

// A hook set from Python: fn (callable), shared so that copies of the C++ hook never touch Python reference counts;
// the last one lets go of fn under the GIL. The hooks run in backward, without the GIL: they take it to call fn.
inline std::shared_ptr<py::object> python_hook(const py::object& fn) {
  if (!PyCallable_Check(fn.ptr())) throw py::type_error("hook must be callable or None");
  return std::shared_ptr<py::object>(new py::object(fn), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// ZeRO-2 (set_grad_shard) keeps a shard of the gradients: the full-buffer views refuse
template <typename T>
void require_full_grads(GPT2Model<T>& m, const char* what) {
  if (m.grad_sharded())
    throw py::value_error(std::string(what) + ": the gradients are sharded (ZeRO-2): this model holds flat [" +
                          std::to_string(m.grad_shard_lo()) + ", " + std::to_string(m.grad_shard_hi()) +
                          ") only (grad_shard())");
}

template <typename T>
void bind_model(py::module_& m, const char* cls_name) {
  using M = GPT2Model<T>;
  using F = gpt2::Master<T>;  // the dtype Python sees: master weights, gradients, AdamW state, logits, losses
  // module_local: the test-only emulated module binds the same C++ type in the same interpreter
  auto cls = py::class_<M>(m, cls_name, "GPT-2 in the C++ core: parameters, gradients, forward/backward, AdamW.",
                py::module_local());
  gpt2_bind::bind_kv<M>(cls);
  cls
      .def(py::init([](int max_seq_len, int vocab_size, int padded_vocab_size, int n_layer, int n_head, int n_embd,
                       const std::string& device, bool tf32, const std::string& attention, bool fused,
                       bool matmul_tuning, bool training, bool deterministic, const std::string& position, float rope_base, const std::string& norm,
                       bool qk_norm, const std::string& activation, bool bias, bool tie_embeddings,
                       float logit_softcap) {
             const Arch arch{position, norm, activation, rope_base, qk_norm, bias, tie_embeddings, logit_softcap};
             auto config = make_config(max_seq_len, vocab_size, padded_vocab_size, n_layer, n_head, n_embd, arch);
             if (gpt2::is_cuda_device(device)) load_cuda_backend();
             return new M(config,
                          gpt2::make_backend<T>(
                              device, backend_options(tf32, attention, fused, matmul_tuning, deterministic)),
                          training);
           }),
           py::arg("max_seq_len"), py::arg("vocab_size"), py::arg("padded_vocab_size"), py::arg("n_layer"),
           py::arg("n_head"), py::arg("n_embd"), py::arg("device") = "cpu", py::arg("tf32") = false,
           py::arg("attention") = "auto", py::arg("fused") = true, py::arg("matmul_tuning") = false, py::arg("training") = true,
           py::arg("deterministic") = true,
           py::arg("position") = "learned", py::arg("rope_base") = 10000.0f, py::arg("norm") = "layernorm",
           py::arg("qk_norm") = false, py::arg("activation") = "gelu", py::arg("bias") = true,
           py::arg("tie_embeddings") = true, py::arg("logit_softcap") = 0.0f,
           "The architecture (position .. logit_softcap, GPT2Config's fields; logit_softcap 0: none) defaults to "
           "GPT-2. tf32: fp32 matmuls on TF32 tensor cores (CUDA); attention: 'auto', 'flash', 'cudnn' or 'naive' (CUDA; "
           "the CPU materialises attention); fused: fused kernels (CUDA); matmul_tuning: time cuBLASLt's candidate "
           "algorithms once per shape (CUDA); deterministic: the same bits for the same inputs (CUDA: cuDNN's "
           "SDPA backward without atomics). See csrc/model/backend_options.h.")
      .def_property_readonly("num_parameters", &M::num_parameters)
      .def_property_readonly("backend_bytes_in_use", [](M& self) { return self.backend().bytes_in_use(); },
                             "Bytes the backend has allocated and not freed (the CPU backend counts them; 0 on "
                             "CUDA, whose cudaMemGetInfo serves): what the memory plan's tests measure.")
      .def_property("recompute_gelu", &M::recompute_gelu, &M::set_recompute_gelu,
                    "Recompute GELU outputs in backward instead of keeping one per layer (saves memory); "
                    "the recompute='gelu' level.")
      .def_property(
          "recompute", [](M& self) { return recompute_name(self.recompute()); },
          [](M& self, const std::string& r) { self.set_recompute(parse_recompute(r)); },
          "What backward recomputes instead of keeping: 'none', 'gelu' (the activation's output) or 'layer' (each "
          "block from its input, one block at a time).")
      .def("set_fp8", [](M& self, bool on, bool head) {
             try {
               self.set_fp8(on, head);
             } catch (const std::logic_error& e) {  // a backend without FP8 ops, or a bad shape: the caller's error
               throw py::value_error(e.what());
             }
           },
           py::arg("on"), py::arg("head") = false,
           "precision fp8 (csrc/model/gpt2.h, set_fp8): the four Linear layers of every block (and, with head, the "
           "lm_head) multiply in FP8 (e4m3 forward, e5m2 gradients, per-tensor current scales, fp32 accumulation). "
           "ValueError without FP8 ops (a bf16 CUDA model or the CPU backend) or when n_embd (padded_vocab_size with "
           "head) is not a multiple of 16.")
      .def_property_readonly("fp8", &M::fp8, "Whether the block Linears multiply in FP8 (set_fp8).")
      .def_property_readonly("fp8_head", &M::fp8_head, "Whether the lm_head multiplies in FP8 too (set_fp8).")
      .def("fp8_weight_meta", [](M& self) {
             const std::vector<float> v = self.fp8_weight_meta();
             py::array_t<float> out({py::ssize_t(v.size() / 2), py::ssize_t(2)});
             std::copy(v.begin(), v.end(), out.mutable_data());
             return out;
           },
           "(n, 2) float32: [1 / scale, amax] of each FP8 weight copy (per layer qkvw, attprojw, fcw, fcprojw, then "
           "the head), of the weights as they are now.")
      .def("memory_bytes",
           [](M& self, int B, int Tn) {
             if (B <= 0 || Tn <= 0) throw py::value_error("memory_bytes: B and T must be positive");
             py::dict d;
             const size_t n = self.num_parameters();
             d["params"] = n * sizeof(T) + (gpt2::kHasMasterCopy<T> ? n * sizeof(F) : 0);  // + fp32 master
             if (!self.training()) {  // inference-only: no gradients, moments or backward activations
               d["grads"] = 0, d["optimizer"] = 0, d["activations"] = self.kv_bytes();
               return d;
             }
             d["grads"] = n * sizeof(F);
             d["optimizer"] = 2 * n * sizeof(F);
             d["activations"] = self.activation_bytes_for(B, Tn);
             if (self.fp8()) d["fp8"] = self.fp8_bytes(B, Tn);  // precision fp8's weight copy and scratch
             return d;
           },
           py::arg("B"), py::arg("T"),
           "Bytes of parameters (with the fp32 master copy in bf16 / fp16), gradients, AdamW state and activations for "
           "(B, T); with precision fp8 also 'fp8' (the weights' FP8 copy and the FP8 scratch, GPT2Model::fp8_bytes).")
      .def_property_readonly("dtype", [](M&) -> std::string {
                               if constexpr (std::is_same_v<T, gpt2::bf16>) return "bfloat16";
                               else if constexpr (std::is_same_v<T, gpt2::f16>) return "float16";
                               else return std::is_same_v<T, float> ? "float32" : "float64";
                             },
                             "Storage type of the activations and of the parameters the ops read.")
      .def("params_changed", &M::params_changed,
           "Tell the model its parameters were written from outside (bf16: its bf16 copy is rebuilt before the "
           "next forward; no-op otherwise).")
      .def_property("param_round_seed", &M::param_round_seed, &M::set_param_round_seed,
                    "Seed of the stochastic rounding of the bf16 weight copy (the step of the last AdamW update; 0 = "
                    "round to nearest). Set it to the restored step when resuming.")
      .def_property_readonly("device", [](M& self) { return std::string(self.backend().name()); })
      .def("params",
           [](py::object self) {
             auto& s = self.cast<M&>();
             s.params_changed();  // the caller may write through the views
             return named_views(s, s.params(), self);
           },
           "Parameters by name as numpy views (no copy; writes go into the model). In bf16 these are the fp32 master "
           "weights: after writing through views kept from an earlier call, call params_changed().")
      .def("grads", [](py::object self) {
             auto& s = self.cast<M&>();
             require_full_grads(s, "grads");
             return s.training() ? named_views(s, s.grads(), self) : py::dict();  // inference-only: none
           })
      .def("adam_m", [](py::object self) { auto& s = self.cast<M&>(); return named_views(s, s.adam_m(), self); })
      .def("adam_v", [](py::object self) { auto& s = self.cast<M&>(); return named_views(s, s.adam_v(), self); })
      .def("flat_params",
           [](py::object self) {
             auto& s = self.cast<M&>();
             s.params_changed();
             return view(s.params(), {py::ssize_t(s.num_parameters())}, self);
           })
      .def("flat_grads", [](py::object self) {
             auto& s = self.cast<M&>();
             if (!s.training()) throw py::value_error("flat_grads: an inference-only model (training=False) has no gradients");
             require_full_grads(s, "flat_grads");
             return view(s.grads(), {py::ssize_t(s.num_parameters())}, self);
           })
      .def("set_grad_shard",
           [](M& self, size_t lo, size_t hi) {
             if (lo > hi || hi > self.num_parameters())
               throw py::value_error("set_grad_shard: need 0 <= lo <= hi <= num_parameters (" +
                                     std::to_string(self.num_parameters()) + "), got lo=" + std::to_string(lo) +
                                     " hi=" + std::to_string(hi));
             self.set_grad_shard(lo, hi);
           },
           py::arg("lo"), py::arg("hi"),
           "ZeRO-2: keep only the gradients of flat [lo, hi) (this rank's shard) plus three bucket buffers that "
           "backward fills and hands to the bucket hook; (0, num_parameters) goes back to one full buffer.")
      .def_property_readonly("grad_shard_range",
                             [](M& self) { return std::make_pair(self.grad_shard_lo(), self.grad_shard_hi()); },
                             "(lo, hi): the flat gradients this model holds ((0, num_parameters) unless sharded)")
      .def_property_readonly("grad_sharded", &M::grad_sharded)
      .def_property("offload", &M::offload, &M::set_offload,
                    "Optimizer offload (CUDA): the fp32 master weights and the AdamW moments in pinned host memory, "
                    "AdamW run on the host's cores with the kernel's arithmetic (bit for bit the device update), "
                    "the new weights written back to the device. False moves them back.")
      .def("offload_chunk_out",
           [](M& self, size_t lo, py::array dst) {
             F* p = staging_array<F>(dst, "offload_chunk_out");
             self.offload_chunk_out(lo, p, size_t(dst.shape(0)));
           },
           py::arg("lo"), py::arg("dst"),
           "Offloaded 16-bit model: the host master weights [lo, lo + dst.size) into dst, a float32 buffer in "
           "backend memory (_C.dist.alloc_state(model, n, pinned=False)): DataParallel's staged gather.")
      .def("offload_chunk_in",
           [](M& self, size_t lo, py::array src) {
             const F* p = staging_array<F>(src, "offload_chunk_in");
             self.offload_chunk_in(lo, p, size_t(src.shape(0)));
           },
           py::arg("lo"), py::arg("src"),
           "Offloaded 16-bit model: another rank's master weights [lo, lo + src.size), in backend memory, into the "
           "host master and, rounded with param_round_seed, into the weights the ops read.")
      .def("prefetch_grads", &M::prefetch_grads,
           "Offloaded, one process: the next backward is the optimizer step's last micro-step; each group of "
           "gradients it finishes goes to the host at once (a copy stream, overlapped with the rest of backward) "
           "and optimizer_step skips its own copy.")
      .def_property_readonly("grad_prefetches", &M::grad_prefetches,
                             "backwards that copied their final gradients to the host (prefetch_grads)")
      .def_property_readonly("grad_bucket_values", &M::grad_bucket_values,
                             "values of the ZeRO-2 bucket buffers (0 unless sharded)")
      .def("grad_shard",
           [](py::object self) {
             auto& s = self.cast<M&>();
             if (!s.training()) throw py::value_error("grad_shard: an inference-only model has no gradients");
             s.backend().synchronize();
             return view(s.grads(), {py::ssize_t(s.grad_shard_hi() - s.grad_shard_lo())}, self);
           },
           "The gradients this model holds (flat [lo, hi) of grad_shard_range) as a numpy view.")
      .def("set_grad_bucket_hook",
           [](M& self, py::object fn) {
             if (fn.is_none()) {
               self.set_grad_bucket_hook({});
               return;
             }
             auto f = python_hook(fn);
             M* model = &self;
             self.set_grad_bucket_hook([f, model](F* bucket, const gpt2::GradRanges& ranges) {
               size_t n = 0;
               for (const auto& r : ranges) n += r.second - r.first;
               model->backend().synchronize();  // the bucket is read on the host next
               py::gil_scoped_acquire gil;
               // a view of the bucket for the duration of the call (no owner: the model keeps the buffer)
               py::array_t<F> v({py::ssize_t(n)}, {py::ssize_t(sizeof(F))}, bucket, py::none());
               (*f)(v, py::cast(ranges));
             });
           },
           py::arg("hook"),
           "ZeRO-2 (set_grad_shard): hook(bucket, ranges) is called by backward each time a bucket of gradients is "
           "final: bucket is a numpy view of the values of `ranges` (flat (lo, hi) pairs, in order) back to back, "
           "valid during the call; fold this rank's part in with accumulate_grad_shard. DataParallel(zero=2) sets "
           "its own (gpt2core._C.dist.GradReduceScatterer); this one is for tests and custom reductions.")
      .def("accumulate_grad_shard",
           [](M& self, py::array_t<F, py::array::c_style | py::array::forcecast> src, size_t flat_lo) {
             if (src.ndim() != 1) throw py::value_error("accumulate_grad_shard: src must be 1-D");
             const size_t n = size_t(src.shape(0));
             if (flat_lo < self.grad_shard_lo() || flat_lo + n > self.grad_shard_hi())
               throw py::value_error("accumulate_grad_shard: [" + std::to_string(flat_lo) + ", " +
                                     std::to_string(flat_lo + n) + ") is not in the shard [" +
                                     std::to_string(self.grad_shard_lo()) + ", " +
                                     std::to_string(self.grad_shard_hi()) + ")");
             // through a backend buffer: src is host memory, the shard is the backend's
             F* tmp = self.backend().alloc_master(std::max<size_t>(1, n));
             std::memcpy(tmp, src.data(), n * sizeof(F));  // backend memory is host-visible (CPU; CUDA: managed)
             self.accumulate_grad_shard(tmp, flat_lo, n);
             self.backend().synchronize();
             self.backend().free_master(tmp);
           },
           py::arg("src"), py::arg("flat_lo"),
           "The shard's [flat_lo, flat_lo + len(src)) += src (the first backward after zero_grad: = src).")
      .def("forward",
           [](M& self, py::object idx, py::object targets, py::object slots) {
             const auto& c = self.config();
             auto x = check_tokens(idx, "idx", -1, -1, false, c.vocab_size, c.max_seq_len);
             const int B = int(x.shape(0)), Tn = int(x.shape(1));
             py::array_t<int32_t> y, sl;
             if (!targets.is_none()) y = check_tokens(targets, "targets", B, Tn, true, c.vocab_size, c.max_seq_len);
             const int32_t* yp = targets.is_none() ? nullptr : y.data();
             if (!slots.is_none()) {
               sl = gpt2_bind::int32_array(slots, "slots", 1);
               if (sl.shape(0) != B) throw py::value_error("slots must have one entry per row of idx");
               std::vector<char> seen;
               for (int b = 0; b < B; b++) {
                 const int s = sl.data()[b];
                 if (s < 0 || s >= (1 << 20)) throw py::value_error("slots must be in [0, 2**20)");
                 if (size_t(s) >= seen.size()) seen.resize(size_t(s) + 1, 0);
                 if (seen[size_t(s)]++) throw py::value_error("slots: a slot appears twice");
               }
             }
             const int32_t* sp = slots.is_none() ? nullptr : sl.data();
             py::gil_scoped_release nogil;
             return self.forward(x.data(), yp, B, Tn, sp);
           },
           py::arg("idx"), py::arg("targets") = py::none(), py::arg("slots") = py::none(),
           "Forward pass. idx, targets: int32 (B, T), targets[b, t] the token after idx[b, t]; targets -1 or -100 are ignored. Returns the mean loss (NaN without targets). slots: an inference-only model's KV-cache slots to run in (int32 (B,), default 0..B-1).")
      .def("logits",
           [](M& self) {
             py::array_t<F> out({self.last_B(), self.last_T(), self.config().padded_vocab_size});
             self.logits_to_host(out.mutable_data());
             return out;
           },
           "Logits (B, T, padded_vocab) of the last forward (valid until backward).")
      .def("token_losses",
           [](M& self) {
             py::array_t<F> out({self.last_B(), self.last_T()});
             self.losses_to_host(out.mutable_data());
             return out;
           },
           "Per-token cross-entropy (B, T) of the last forward with targets (0 where ignored).")
      .def("backward",
           [](M& self, float grad_scale, bool report_grads) {
             py::gil_scoped_release nogil;
             self.backward(grad_scale, report_grads);
           },
           py::arg("grad_scale") = 1.0f, py::arg("report_grads") = false,
           "Accumulate gradients of grad_scale * loss into grads(). report_grads: call the grad-ready hook "
           "(set_grad_ready_hook) as groups of gradients become final.")
      .def("forward_backward",
           [](M& self, py::object idx, py::object targets, float grad_scale) {
             const auto& c = self.config();
             auto x = check_tokens(idx, "idx", -1, -1, false, c.vocab_size, c.max_seq_len);
             const int B = int(x.shape(0)), Tn = int(x.shape(1));
             auto y = check_tokens(targets, "targets", B, Tn, true, c.vocab_size, c.max_seq_len);
             if (!std::isfinite(grad_scale)) throw py::value_error("grad_scale must be finite");
             py::gil_scoped_release nogil;
             self.forward_backward(x.data(), y.data(), B, Tn, grad_scale);
           },
           py::arg("idx"), py::arg("targets"), py::arg("grad_scale") = 1.0f,
           "One training micro-step: forward(idx, targets) and backward(grad_scale) with no host round trip; "
           "grad_scale * mean loss is added to a device-side sum that take_loss() returns. With cuda_graphs on, "
           "replayed from a CUDA graph after the first two calls for a shape. The GPU may still be working when "
           "it returns: grad_norm(), adamw_update() and take_loss() wait for it.")
      .def("take_loss", [](M& self) { py::gil_scoped_release nogil; return self.take_loss(); },
           "The loss summed by forward_backward since the last call (0.0 if none); resets the sum.")
      .def_property("cuda_graphs", &M::graphs, &M::set_graphs,
                    "Capture forward_backward's ops in a CUDA graph and replay it (CUDA backend; ignored elsewhere).")
      .def_property("profile", &M::profile, &M::set_profile,
                    "Time every op of forward, backward and the optimizer (each between two device synchronisations, "
                    "no CUDA graphs; scripts/bench.py --profile); setting it True clears op_profile.")
      .def_property_readonly("op_profile",
                             [](const M& self) {
                               py::list out;
                               for (const gpt2::OpTime& t : self.op_profile())
                                 out.append(py::make_tuple(t.name, t.seconds, t.calls));
                               return out;
                             },
                             "(op, seconds, calls) of each op since profile was set True, in first-run order.")
      .def_property_readonly("graph_captures", &M::graph_captures, "CUDA graphs recorded so far.")
      .def_property_readonly("graph_replays", &M::graph_replays, "CUDA graph launches so far.")
      .def("set_grad_ready_hook",
           [](M& self, py::object fn) {
             if (fn.is_none()) {
               self.set_grad_ready_hook({});
               return;
             }
             auto f = python_hook(fn);
             self.set_grad_ready_hook([f](const gpt2::GradRanges& ranges) {
               py::gil_scoped_acquire gil;  // backward runs without the GIL
               (*f)(py::cast(ranges));
             });
           },
           py::arg("hook"),
           "hook(ranges) is called by backward(report_grads=True) with a list of flat (lo, hi) gradient ranges "
           "each time they are final: lnfw, lnfb; then each layer's 12 slices from the last layer down; then wte, "
           "wpe. None removes it.")
      .def("zero_grad", &M::zero_grad)
      .def("grad_norm", [](M& self) { py::gil_scoped_release nogil; return self.grad_norm(); })
      .def("grad_sum_squares",
           [](M& self, size_t lo, size_t hi) {
             if (lo > hi || hi > self.num_parameters())
               throw py::value_error("need 0 <= lo <= hi <= num_parameters (" + std::to_string(self.num_parameters()) +
                                     "), got lo=" + std::to_string(lo) + " hi=" + std::to_string(hi));
             py::gil_scoped_release nogil;
             return self.grad_sum_squares(lo, hi);
           },
           py::arg("lo"), py::arg("hi"),
           "Sum of squares of flat gradients [lo, hi), accumulated in double on the backend (ZeRO-1: this rank's "
           "part of the global norm).")
      .def("adamw_update",
           [](M& self, float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale) {
             if (!(lr >= 0)) throw py::value_error("lr must be >= 0");
             if (!(grad_scale >= 0) || !std::isfinite(grad_scale)) throw py::value_error("grad_scale must be finite and >= 0");
             if (step < 1) throw py::value_error("step counts from 1");
             py::gil_scoped_release nogil;
             self.adamw_update(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
           },
           py::arg("lr"), py::arg("beta1") = gpt2::kAdamBeta1, py::arg("beta2") = gpt2::kAdamBeta2,
           py::arg("eps") = gpt2::kAdamEps, py::arg("weight_decay") = gpt2::kWeightDecay, py::arg("step"), py::arg("grad_scale") = 1.0f,
           "AdamW over all parameters; weight decay on 2-D tensors only; grads are multiplied by grad_scale "
           "(gradient clipping folds in here).")
      .def("optimizer_step",
           [](M& self, float lr, float beta1, float beta2, float eps, float weight_decay, int step, double grad_clip) {
             if (!(lr >= 0)) throw py::value_error("lr must be >= 0");
             if (!(grad_clip >= 0) || !std::isfinite(grad_clip))
               throw py::value_error("grad_clip must be finite and >= 0");
             if (step < 1) throw py::value_error("step counts from 1");
             py::gil_scoped_release nogil;
             return self.optimizer_step(lr, beta1, beta2, eps, weight_decay, step, grad_clip);
           },
           py::arg("lr"), py::arg("beta1") = gpt2::kAdamBeta1, py::arg("beta2") = gpt2::kAdamBeta2,
           py::arg("eps") = gpt2::kAdamEps, py::arg("weight_decay") = gpt2::kWeightDecay, py::arg("step"), py::arg("grad_clip") = 1.0,
           "One optimizer step in the backend: the global gradient norm, clipping to grad_clip (0: none) and AdamW "
           "(as adamw_update with grad_scale = grad_clip / (norm + 1e-6) when norm > grad_clip). Returns the pre-clip "
           "norm; when it is not finite nothing is updated. With cuda_graphs on, replayed from a CUDA graph.")
      .def("set_loss_scaling",
           [](M& self, bool on, float scale, int interval, int clean, int64_t skipped, float growth, float backoff) {
             gpt2::LossScaler st;
             st.scale = scale, st.interval = interval, st.clean = clean, st.skipped = skipped;
             st.growth = growth, st.backoff = backoff;
             self.set_loss_scaling(on, st);
           },
           py::arg("on"), py::arg("scale") = gpt2::kLossScaleInit, py::arg("interval") = gpt2::kLossScaleInterval,
           py::arg("clean") = 0, py::arg("skipped") = 0, py::arg("growth") = 2.0f, py::arg("backoff") = 0.5f,
           "Dynamic loss scaling (GradScaler's rule, csrc/model/optimizer.h) on or off, starting from this state: "
           "the scale, clean steps in a row so far, steps skipped so far; growth and backoff factors. Off: scale 1.")
      .def_property_readonly("loss_scaling", &M::loss_scaling)
      .def_property_readonly("loss_scaler",
                             [](M& self) {
                               const gpt2::LossScaler& s = self.loss_scaler();
                               py::dict d;
                               d["scale"] = s.scale, d["interval"] = s.interval, d["clean"] = s.clean;
                               d["skipped"] = s.skipped, d["growth"] = s.growth, d["backoff"] = s.backoff;
                               return d;
                             },
                             "The loss scaler's state as of the last optimizer step: scale, interval, clean (steps "
                             "in a row without overflow), skipped (in total), growth, backoff.")
      .def("adamw_update_range",
           [](M& self, size_t lo, size_t hi, py::array m, py::array v, float lr, float beta1,
              float beta2, float eps, float weight_decay, int step, float grad_scale, double grad_clip,
              double sum_squares) {
             if (lo > hi || hi > self.num_parameters())
               throw py::value_error("need 0 <= lo <= hi <= num_parameters (" + std::to_string(self.num_parameters()) +
                                     "), got lo=" + std::to_string(lo) + " hi=" + std::to_string(hi));
             for (auto* a : {&m, &v}) {
               const char* name = a == &m ? "m" : "v";
               if (!py::array_t<F>::check_(*a) || a->ndim() != 1 || size_t(a->shape(0)) != hi - lo ||
                   !(a->flags() & py::array::c_style) || !a->writeable())
                 throw py::value_error(std::string(name) + " must be a writable contiguous 1-D array of hi - lo = " +
                                       std::to_string(hi - lo) + " values of the model's dtype");
             }
             if (!(lr >= 0)) throw py::value_error("lr must be >= 0");
             if (!(grad_scale >= 0) || !std::isfinite(grad_scale)) throw py::value_error("grad_scale must be finite and >= 0");
             if (!(grad_clip >= 0) || !std::isfinite(grad_clip)) throw py::value_error("grad_clip must be finite and >= 0");
             if (!(sum_squares >= 0) && !std::isnan(sum_squares)) throw py::value_error("sum_squares must be >= 0");
             if (step < 1) throw py::value_error("step counts from 1");
             F* mp = static_cast<F*>(m.mutable_data());
             F* vp = static_cast<F*>(v.mutable_data());
             py::gil_scoped_release nogil;
             self.adamw_update_range(lo, hi, mp, vp, lr, beta1, beta2, eps, weight_decay, step, grad_scale, grad_clip,
                                     sum_squares);
           },
           py::arg("lo"), py::arg("hi"), py::arg("m"), py::arg("v"), py::arg("lr"), py::arg("beta1") = gpt2::kAdamBeta1,
           py::arg("beta2") = gpt2::kAdamBeta2, py::arg("eps") = gpt2::kAdamEps,
           py::arg("weight_decay") = gpt2::kWeightDecay, py::arg("step"), py::arg("grad_scale") = 1.0f,
           py::arg("grad_clip") = 0.0, py::arg("sum_squares") = 0.0,
           "AdamW over flat parameters [lo, hi) only (ZeRO-1 shard) with the moments m, v of that range "
           "(arrays of hi - lo values, updated in place); same weight-decay policy as adamw_update. The gradients "
           "are multiplied by grad_scale and clipped as optimizer_step does (the clip rule of "
           "csrc/model/optimizer.h) to grad_clip (0: no clipping) by the global norm sqrt(sum_squares): pass the sum "
           "of squares of ALL gradients (every rank's shard). Nothing is written when that norm is not finite.");
  // ------------------------------------------------------------------------------------------------ Muon
  auto muon_step = [](float lr, float beta, float weight_decay, int ns_steps, bool nesterov, int mat_lo, int mat_hi,
                      std::optional<float> embedding_lr = std::nullopt, std::optional<float> head_lr = std::nullopt) {
    if (!(lr >= 0) || !std::isfinite(lr)) throw py::value_error("muon_lr must be finite and >= 0");
    if (!(beta >= 0 && beta < 1)) throw py::value_error("muon_momentum must be in [0, 1)");
    if (!(weight_decay >= 0) || !std::isfinite(weight_decay))
      throw py::value_error("muon_weight_decay must be finite and >= 0");
    if (ns_steps < 0 || ns_steps > 100) throw py::value_error("muon_ns_steps must be in [0, 100]");
    for (const auto& [name, v] : {std::pair{"embedding_lr", embedding_lr}, std::pair{"head_lr", head_lr}})
      if (v && (!(*v >= 0) || !std::isfinite(*v)))
        throw py::value_error(std::string(name) + " must be finite and >= 0");
    typename M::MuonStep s;
    s.embedding_lr = embedding_lr.value_or(-1.0f), s.head_lr = head_lr.value_or(-1.0f);
    s.lr = lr, s.beta = beta, s.args.weight_decay = weight_decay, s.args.ns_steps = ns_steps;
    s.args.nesterov = nesterov, s.mat_lo = mat_lo, s.mat_hi = mat_hi;
    return s;
  };
  // Newton-Schulz's precision (MuonArgs::ns_bf16) from its name
  auto ns_bf16 = [](const std::string& dtype) {
    if (dtype != "float32" && dtype != "bfloat16")
      throw py::value_error("ns_dtype must be 'float32' or 'bfloat16', got '" + dtype + "'");
    return dtype == "bfloat16";
  };
  cls.def_property_readonly("muon_matrices",
                            [](M& self) {
                              py::list out;
                              for (const gpt2::MuonMatrix& x : self.muon_matrix_list())
                                out.append(py::make_tuple(x.offset, x.rows, x.cols,
                                                          gpt2::param_names()[x.tensor], x.layer));
                              return out;
                            },
                            "The matrices Muon orthogonalises, in flat-offset order: (offset, rows, cols, tensor, "
                            "layer); qkvw's layer slice is three (q, k, v).")
      .def("muon_optimizer_step",
           [muon_step, ns_bf16](M& self, float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                                double grad_clip, float muon_lr, float muon_momentum, float muon_weight_decay,
                                int ns_steps, bool nesterov, int mat_lo, int mat_hi, std::optional<float> embedding_lr,
                                std::optional<float> head_lr, const std::string& ns_dtype) {
             if (!(lr >= 0)) throw py::value_error("lr must be >= 0");
             if (!(grad_clip >= 0) || !std::isfinite(grad_clip))
               throw py::value_error("grad_clip must be finite and >= 0");
             if (step < 1) throw py::value_error("step counts from 1");
             auto s = muon_step(muon_lr, muon_momentum, muon_weight_decay, ns_steps, nesterov, mat_lo, mat_hi,
                                embedding_lr, head_lr);
             s.args.ns_bf16 = ns_bf16(ns_dtype);
             py::gil_scoped_release nogil;
             return self.muon_optimizer_step(lr, beta1, beta2, eps, weight_decay, step, grad_clip, s);
           },
           py::arg("lr"), py::arg("beta1") = gpt2::kAdamBeta1, py::arg("beta2") = gpt2::kAdamBeta2,
           py::arg("eps") = gpt2::kAdamEps, py::arg("weight_decay") = gpt2::kWeightDecay, py::arg("step"),
           py::arg("grad_clip") = 1.0, py::arg("muon_lr") = 0.02f, py::arg("muon_momentum") = gpt2::kMuonBeta,
           py::arg("muon_weight_decay") = 0.0f, py::arg("ns_steps") = gpt2::kMuonNsSteps, py::arg("nesterov") = true,
           py::arg("mat_lo") = 0, py::arg("mat_hi") = -1, py::arg("embedding_lr") = py::none(),
           py::arg("head_lr") = py::none(), py::arg("ns_dtype") = "float32",
           "optimizer_step with Muon (csrc/model/optimizer.h) on the hidden matrices and AdamW on the rest; "
           "matrices [mat_lo, mat_hi) of muon_matrices are orthogonalised and applied (mat_hi -1: all), the "
           "momentum of every Muon tensor is updated. AdamW's LR: embedding_lr for wte and wpe, head_lr for an "
           "untied lm_head (None: lr), lr for the rest. ns_dtype: 'bfloat16' rounds the Newton-Schulz products' "
           "inputs to bf16 (fp32 sums; the CUDA backend's always are), 'float32' keeps them in the model's type. "
           "Returns the pre-clip norm.")
      .def("muon_update_range",
           [muon_step](M& self, size_t lo, size_t hi, py::array m, py::array v, float lr, float beta1, float beta2,
                       float eps, float weight_decay, int step, double grad_clip, double sum_squares, float muon_lr,
                       float muon_momentum, float muon_weight_decay, int ns_steps, bool nesterov,
                       std::optional<float> embedding_lr, std::optional<float> head_lr) {
             if (lo > hi || hi > self.num_parameters())
               throw py::value_error("need 0 <= lo <= hi <= num_parameters");
             for (auto* a : {&m, &v}) {
               if (!py::array_t<F>::check_(*a) || a->ndim() != 1 || size_t(a->shape(0)) != hi - lo ||
                   !(a->flags() & py::array::c_style) || !a->writeable())
                 throw py::value_error(std::string(a == &m ? "m" : "v") +
                                       " must be a writable contiguous 1-D array of hi - lo values of the model's dtype");
             }
             if (!(lr >= 0)) throw py::value_error("lr must be >= 0");
             if (!(grad_clip >= 0) || !std::isfinite(grad_clip)) throw py::value_error("grad_clip must be finite and >= 0");
             if (step < 1) throw py::value_error("step counts from 1");
             const auto s = muon_step(muon_lr, muon_momentum, muon_weight_decay, ns_steps, nesterov, 0, 0,
                                      embedding_lr, head_lr);
             F* mp = static_cast<F*>(m.mutable_data());
             F* vp = static_cast<F*>(v.mutable_data());
             py::gil_scoped_release nogil;
             self.muon_update_range(lo, hi, mp, vp, lr, beta1, beta2, eps, weight_decay, step, grad_clip, sum_squares, s);
           },
           py::arg("lo"), py::arg("hi"), py::arg("m"), py::arg("v"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
           py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("grad_clip"), py::arg("sum_squares"),
           py::arg("muon_lr"), py::arg("muon_momentum"), py::arg("muon_weight_decay"), py::arg("ns_steps"),
           py::arg("nesterov"), py::arg("embedding_lr") = py::none(), py::arg("head_lr") = py::none(),
           "ZeRO-1 with Muon, part 1: AdamW on the AdamW tensors' part of flat [lo, hi) (embedding_lr, head_lr as "
           "muon_optimizer_step's) and Muon's momentum on the "
           "Muon tensors' part (m: its slots), the update written over the gradients there; all-gather the "
           "gradient buffer, then muon_update_matrices.")
      .def("muon_update_matrices",
           [muon_step, ns_bf16](M& self, int step, double sum_squares, float muon_weight_decay, int ns_steps,
                                int mat_lo, int mat_hi, const std::string& ns_dtype) {
             auto s = muon_step(0.0f, 0.0f, muon_weight_decay, ns_steps, true, mat_lo, mat_hi);
             s.args.ns_bf16 = ns_bf16(ns_dtype);
             py::gil_scoped_release nogil;
             self.muon_update_matrices(step, sum_squares, s);
           },
           py::arg("step"), py::arg("sum_squares"), py::arg("muon_weight_decay"), py::arg("ns_steps"),
           py::arg("mat_lo"), py::arg("mat_hi"), py::arg("ns_dtype") = "float32",
           "ZeRO-1 with Muon, part 2: orthogonalise and apply matrices [mat_lo, mat_hi) from the all-gathered "
           "updates (the step's lr and momentum as muon_update_range set them), then step the loss scaler.");
}

}  // namespace

PYBIND11_MODULE(GPT2CORE_MODULE_NAME, m) {
  m.doc() = "gpt2core C++ core";
  gpt2::cpu::blas_init();
#if GPT2CORE_BACKEND_CUDA
  gpt2::cuda_plugin() = gpt2::cuda::plugin();  // linked in: no module to load
#endif
  m.def(
      "activation_counts",
      [](int max_seq_len, int vocab_size, int padded_vocab_size, int n_layer, int n_head, int n_embd, int B, int Tn,
         size_t att_size, const std::string& recompute, const std::string& position, const std::string& norm,
         bool qk_norm, const std::string& activation, bool bias, bool tie_embeddings) {
        if (B <= 0 || Tn <= 0) arg_error("activation_counts: B and T must be positive");
        const Arch arch{position, norm, activation, 10000.0f, qk_norm, bias, tie_embeddings, 0.0f};
        const auto c = make_config(max_seq_len, vocab_size, padded_vocab_size, n_layer, n_head, n_embd, arch);
        const gpt2::ActivationCounts n = gpt2::activation_counts(c, B, Tn, att_size, parse_recompute(recompute));
        py::dict d;
        d["t"] = n.t, d["logits"] = n.logits, d["m"] = n.m;
        return d;
      },
      py::arg("max_seq_len"), py::arg("vocab_size"), py::arg("padded_vocab_size"), py::arg("n_layer"),
      py::arg("n_head"), py::arg("n_embd"), py::arg("B"), py::arg("T"), py::arg("att_size"), py::arg("recompute"),
      py::arg("position") = "learned", py::arg("norm") = "layernorm", py::arg("qk_norm") = false,
      py::arg("activation") = "gelu", py::arg("bias") = true, py::arg("tie_embeddings") = true,
      "Elements of the training activations a model of this config lays out for (B, T), allocating nothing: 't' "
      "(storage type, logits aside), 'logits' (storage type), 'm' (fp32 statistics; float64 in a float64 model). "
      "att_size: the backend's attention state per layer (CPU and the naive CUDA rung: B*NH*T*T; flash and cuDNN: "
      "B*NH*T). The memory plan's activations (gpt2core.memplan).");
  m.def("build_info", []() {
    py::dict d;
    d["version"] = GPT2CORE_VERSION;
    py::list backends;
    backends.append("cpu");
    // compiled into this build (a plugin's CUDA backend: gpt2core.build_info(), python/gpt2core/_plugins.py)
    if (GPT2CORE_HAS_CUDA || GPT2CORE_BACKEND_CUDA) backends.append("cuda");
    d["backends"] = backends;
    d["blas"] = GPT2CORE_BLAS_NAME;
    d["openmp"] = true;
    d["cuda"] = bool(GPT2CORE_HAS_CUDA || GPT2CORE_BACKEND_CUDA);  // the CUDA backend (csrc/cuda) is compiled
    d["cuda_toolkit"] = bool(GPT2CORE_HAS_CUDA);
    py::list archs;
    std::string s = GPT2CORE_CUDA_ARCHS_STR;
    size_t pos = 0;
    while (pos < s.size()) {
      size_t e = s.find(',', pos);
      if (e == std::string::npos) e = s.size();
      if (e > pos) archs.append(s.substr(pos, e - pos));
      pos = e + 1;
    }
    d["cuda_archs"] = archs;
    d["cudnn"] = bool(GPT2CORE_HAS_CUDNN);
    d["cudnn_sdpa"] = bool(GPT2CORE_HAS_CUDNN_SDPA);  // attention seam over cuDNN's fused SDPA (csrc/cuda/seams_cudnn.cu)
    d["nccl"] = bool(GPT2CORE_HAS_NCCL);
    d["gloo"] = bool(GPT2CORE_HAS_GLOO);  // CPU multi-process training (gpt2core._C.dist)
    d["cpu_isa"] = gpt2::cpu::isa();  // the CPU backend's instruction-set variant in use (best this CPU runs)
    // run-time facts of this process's CUDA backend (0 until it is loaded): dW shapes whose bias-gradient
    // epilogue (BGRADB) the matmul library refused, and dW GEMMs that summed dbias with kernels instead
    long long refused = 0, fallbacks = 0;
    if (const gpt2::CudaPlugin* p = gpt2::cuda_plugin()) p->bgradb_refusals(&refused, &fallbacks);
    d["bgradb_refused_shapes"] = refused;
    d["bgradb_fallbacks"] = fallbacks;
    return d;
  });
  gpt2_bind::bind_q8_ops(m);
  m.def("set_num_threads", [](int n) {
    if (n < 1) throw py::value_error("num_threads must be >= 1");
    omp_set_num_threads(n);
  }, py::arg("n"), "Threads for the CPU backend (OpenMP; BLAS calls are split over the same threads).");
  m.def("get_num_threads", []() { return omp_get_max_threads(); });
  m.def("cpu_isas", []() { return gpt2::cpu::isas(); },
        "The CPU backend's instruction-set variants this CPU runs, best first (cpu/backend_cpu.h).");
  m.def("cpu_isa", []() { return gpt2::cpu::isa(); }, "The variant CPU models created from now on use.");
  m.def("set_cpu_isa", [](const std::string& name) {
    try {
      gpt2::cpu::set_isa(name);
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
  }, py::arg("name"), "Use another of cpu_isas() for CPU models created from now on (to compare variants).");
  m.def("rope", [](py::object qkv_obj, int n_head, int t0, float base, bool inverse) {
    const char* what = "qkv must be a C-contiguous float64 numpy array of shape (B, T, 3C)";
    if (!py::isinstance<py::array>(qkv_obj) || !py::array_t<double>::check_(qkv_obj)) arg_error(what);
    auto a = py::reinterpret_borrow<py::array_t<double>>(qkv_obj);
    if (a.ndim() != 3 || !(a.flags() & py::array::c_style) || a.size() == 0 || a.shape(2) % 3) arg_error(what);
    const int C = int(a.shape(2) / 3);
    if (n_head <= 0 || C % n_head || (C / n_head) % 2) arg_error("n_head must divide C into heads of even size");
    if (t0 < 0) arg_error("t0 must be >= 0");
    if (!(base > 1.0f && std::isfinite(base))) arg_error("base must be a finite number > 1");
    auto be = gpt2::cpu::make_backend<double>();
    auto out = py::array_t<double>({a.shape(0), a.shape(1), a.shape(2)});
    std::copy(a.data(), a.data() + a.size(), out.mutable_data());
    if (inverse) be->rope_backward(out.mutable_data(), int(a.shape(0)), int(a.shape(1)), C, n_head, t0, base);
    else be->rope_forward(out.mutable_data(), int(a.shape(0)), int(a.shape(1)), C, n_head, t0, base);
    return out;
  }, py::arg("qkv"), py::arg("n_head"), py::arg("t0") = 0, py::arg("base") = 10000.0f, py::arg("inverse") = false,
     "The CPU backend's rotary embedding (Backend::rope_forward, or rope_backward with inverse) of a float64 qkv "
     "(B, T, 3C), returned as a new array: q and k rotated for positions t0 .. t0+T-1, v as it was.");
  m.def("gemm_bf16", [](py::object a_obj, py::object b_obj, bool trans_a, bool trans_b) {
    auto matrix = [](const py::object& obj, const char* name) {
      const std::string what = std::string(name) + " must be a C-contiguous float32 numpy array of 2 dimensions";
      if (!py::isinstance<py::array>(obj) || !py::array_t<float>::check_(obj)) arg_error(what);
      auto arr = py::reinterpret_borrow<py::array_t<float>>(obj);
      if (arr.ndim() != 2 || !(arr.flags() & py::array::c_style)) arg_error(what);
      return arr;
    };
    auto a = matrix(a_obj, "a"), b = matrix(b_obj, "b");
    const py::ssize_t M = a.shape(trans_a), K = a.shape(!trans_a), N = b.shape(!trans_b);
    if (b.shape(trans_b) != K) arg_error("op(a) (M, K) @ op(b) (K, N): op(a) has K=" + std::to_string(K) +
                                         " columns but op(b) has " + std::to_string(b.shape(trans_b)) + " rows");
    if (std::max({M, N, K}) > std::numeric_limits<int>::max()) arg_error("a and b: each dimension must fit in int32");
    py::array_t<float> c({M, N});
    {
      py::gil_scoped_release nogil;
      gpt2::cpu::gemm_bf16(trans_a, trans_b, int(M), int(N), int(K), 1.0f, a.data(), int(a.shape(1)), b.data(),
                           int(b.shape(1)), 0.0f, c.mutable_data(), int(N));
    }
    return c;
  }, py::arg("a"), py::arg("b"), py::arg("trans_a") = false, py::arg("trans_b") = false,
     "op(a) @ op(b) (op: transposed when trans_*) with the inputs rounded to bf16 and fp32 sums: the CPU's bf16 GEMM "
     "of Muon's Newton-Schulz (csrc/cpu/gemm_bf16.h; AVX512-BF16 where the CPU has it, see has_avx512_bf16).");
  m.def("has_avx512_bf16", &gpt2::cpu::has_avx512_bf16,
        "Whether this CPU runs gemm_bf16's AVX512-BF16 kernel (else the rounded inputs go through sgemm).");
  m.def("newton_schulz", [](py::object x_obj, int steps, const std::string& ns_dtype, bool per_matrix,
                            const std::string& device) {
    if (!py::isinstance<py::array>(x_obj) || !(py::array_t<float>::check_(x_obj) || py::array_t<double>::check_(x_obj)))
      arg_error("x must be a float32 or float64 numpy array of shape (batch, rows, cols)");
    auto xa = py::reinterpret_borrow<py::array>(x_obj);
    if (xa.ndim() != 3 || xa.size() == 0) arg_error("x must be a non-empty array of shape (batch, rows, cols)");
    if (steps < 0 || steps > 100) arg_error("steps must be in [0, 100]");
    if (ns_dtype != "float32" && ns_dtype != "bfloat16")
      arg_error("ns_dtype must be 'float32' or 'bfloat16', got '" + ns_dtype + "'");
    const bool cuda = gpt2::is_cuda_device(device);
    if (!cuda && device != "cpu") arg_error("device must be 'cpu' or 'cuda[:N]', got '" + device + "'");
    if (cuda && (ns_dtype != "bfloat16" || !py::array_t<float>::check_(x_obj)))
      arg_error("device 'cuda' runs Newton-Schulz in bf16 (cuda/muon.cuh): give ns_dtype='bfloat16' and a float32 x");
    if (ns_dtype == "bfloat16" && !py::array_t<float>::check_(x_obj)) arg_error("ns_dtype 'bfloat16' needs a float32 x");
    if (!cuda && ns_dtype == "bfloat16" && per_matrix)
      arg_error("per_matrix on the CPU runs the unbatched op, which has no bf16");
    if (cuda) load_cuda_backend();
    auto run = [&](auto tag) {
      using F = decltype(tag);
      auto x = py::array_t<F, py::array::c_style | py::array::forcecast>::ensure(xa);
      py::array_t<F> out({x.shape(0), x.shape(1), x.shape(2)});
      const int batch = int(x.shape(0)), rows = int(x.shape(1)), cols = int(x.shape(2));
      const size_t n = size_t(x.size());
      {
        py::gil_scoped_release nogil;
        auto be = gpt2::make_backend<F>(device);
        be->set_step_args(gpt2::StepArgs{});
        F* u = be->alloc_master(n);
        F* scratch = be->alloc_master(per_matrix ? be->muon_scratch_size(rows, cols)
                                                 : be->muon_batch_scratch_size(batch, rows, cols));
        be->synchronize();  // backend memory is host-addressable (CUDA: managed) once its zero-fill has run
        std::copy(x.data(), x.data() + n, u);
        if (per_matrix)  // the unbatched op (CPU: its GEMMs split over the threads, what the model ran before batching)
          for (int b = 0; b < batch; b++)
            be->muon_orthogonalize(u + size_t(b) * rows * cols, scratch, rows, cols, steps);
        else
          be->muon_orthogonalize_batch(u, scratch, batch, rows, cols, steps, ns_dtype == "bfloat16");
        be->synchronize();
        be->to_host_master(out.mutable_data(), u, n);
        be->free_master(scratch);
        be->free_master(u);
      }
      return py::object(out);
    };
    return py::array_t<float>::check_(x_obj) ? run(float{}) : run(double{});
  }, py::arg("x"), py::arg("steps") = gpt2::kMuonNsSteps, py::arg("ns_dtype") = "float32", py::arg("per_matrix") = false,
     py::arg("device") = "cpu",
     "Muon's Newton-Schulz (csrc/model/optimizer.h) of each matrix x[b] through a backend's batched op "
     "(Backend::muon_orthogonalize_batch), as a new array of x's dtype: X = x / (||x||_F + 1e-7), then `steps` "
     "quintic iterations; ns_dtype 'bfloat16' rounds the products' inputs to bf16 (float32 x only). per_matrix: "
     "one Backend::muon_orthogonalize per matrix instead (CPU: GEMMs split over the threads, float32 / float64 "
     "only), the unbatched op scripts/bench.py --newton-schulz compares against. device 'cuda[:N]': the CUDA "
     "backend's (cuda/muon.cuh: bf16 products, one strided-batched call per product; ns_dtype 'bfloat16', float32).");
  m.def("matmul", [](py::object a_obj, py::object b_obj) {
    auto matrix = [](const py::object& obj, const char* name) {
      const std::string what = std::string(name) + " must be a non-empty, C-contiguous float32 numpy array of 2 dimensions";
      if (!py::isinstance<py::array>(obj) || !py::array_t<float>::check_(obj)) arg_error(what);
      auto arr = py::reinterpret_borrow<py::array_t<float>>(obj);
      if (arr.ndim() != 2 || !(arr.flags() & py::array::c_style) || arr.size() == 0) arg_error(what);
      return arr;
    };
    auto a = matrix(a_obj, "a"), b = matrix(b_obj, "b");
    const py::ssize_t M = a.shape(0), K = a.shape(1), N = b.shape(1);
    if (b.shape(0) != K) {
      std::ostringstream s;
      s << "a (M, K) @ b (K, N): a has K=" << K << " columns but b has " << b.shape(0) << " rows";
      arg_error(s.str());
    }
    if (std::max({M, N, K}) > std::numeric_limits<int>::max())
      arg_error("a and b: each dimension must fit in int32 (BLAS's int)");
    py::array_t<float> c({M, N});
    {
      py::gil_scoped_release nogil;
      gpt2::cpu::gemm(false, false, int(M), int(N), int(K), 1.0f, a.data(), int(K), b.data(), int(N), 0.0f,
                      c.mutable_data(), int(N));
    }
    return c;
  }, py::arg("a"), py::arg("b"),
     "a @ b for float32 matrices through the CPU backend's GEMM (BLAS, C split over the OpenMP threads), as the "
     "model's matmuls run: scripts/bench.py times it for the CPU's fp32 peak.");
  m.def("fp8_cast", [](py::object x_obj, const std::string& kind) {
    gpt2::Fp8Kind k;
    if (kind == "e4m3") k = gpt2::Fp8Kind::E4M3;
    else if (kind == "e5m2") k = gpt2::Fp8Kind::E5M2;
    else arg_error("kind must be 'e4m3' or 'e5m2', got '" + kind + "'");
    if (!py::isinstance<py::array>(x_obj) || !py::array_t<float>::check_(x_obj))
      arg_error("x must be a float32 numpy array" + (py::isinstance<py::array>(x_obj)
                    ? ", got dtype " + std::string(py::str(py::reinterpret_borrow<py::array>(x_obj).dtype()))
                    : std::string()));
    // any layout and shape: a C-contiguous copy when needed (values only; the result is C-contiguous)
    auto x = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(x_obj);
    std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
    py::array_t<float> out(shape);
    const float* in = x.data();
    float* o = out.mutable_data();
    for (py::ssize_t i = 0; i < x.size(); i++) o[i] = gpt2::fp8_to_float(gpt2::float_to_fp8(in[i], k), k);
    return out;
  }, py::arg("x"), py::arg("kind"),
     "x (float32) rounded to FP8 e4m3 or e5m2 as the GPU's cvt.rn.satfinite does (round to nearest even, "
     "subnormals kept, saturating to +-448 / +-57344, NaN kept), returned as float32 (csrc/model/fp8.h).");
  m.def("muon_param_names", []() {
    std::vector<std::string> v;
    for (int i = 0; i < gpt2::kNumParamTensors; i++)
      if (gpt2::param_uses_muon(i)) v.push_back(gpt2::param_names()[i]);
    return v;
  }, "The tensors Muon updates under optimizer='muon' (the rest: AdamW), in layout order.");
  m.def("param_names", []() {  // GPT-2's 16 tensors in llm.c's order (a model's params() has its config's)
    std::vector<std::string> v(gpt2::param_names().begin(), gpt2::param_names().begin() + gpt2::kNumGpt2Tensors);
    return v;
  });
  bind_model<float>(m, "Model");
  bind_model<double>(m, "ModelF64");
  bind_model<gpt2::bf16>(m, "ModelBF16");  // CUDA only: bf16 weights copy and activations, fp32 master state
  bind_model<gpt2::f16>(m, "ModelF16");    // CUDA only: the same in fp16 (sm_70 / sm_75 GPUs)
  m.def("cuda_capability", [](int index) { return cuda_status().empty() ? gpt2::cuda_capability(index) : -1; },
        py::arg("index") = 0,
        "Compute capability of CUDA device `index` as major*10+minor (80 = A100, 90 = H100); -1 without one.");
  m.def("cuda_device_name", [](int index) { return cuda_status().empty() ? gpt2::cuda_device_name(index) : ""; },
        py::arg("index") = 0, "Name of CUDA device `index` as the driver reports it; '' without one.");
  m.def("cuda_mem_info",
        [](int index) {
          if (const std::string why = cuda_status(); !why.empty()) throw std::runtime_error(why);
          return gpt2::cuda_mem_info(index);
        },
        py::arg("index") = 0,
        "(free, total) bytes of CUDA device `index`'s memory (cudaMemGetInfo); RuntimeError without one.");
  m.def("cuda_status", &cuda_status,
        "'' when device='cuda' is usable here, otherwise why not (no CUDA backend compiled, a missing NVIDIA "
        "library, no driver, no GPU). Loads the CUDA backend (gpt2core._C_cuda) the first time.");
  m.def("set_cuda_plugin", [](const py::capsule& c) {
    if (c.name() == nullptr || std::string(c.name()) != "gpt2core.cuda_plugin")
      throw py::type_error("set_cuda_plugin takes gpt2core._C_cuda.plugin()");
    const auto* plugin = static_cast<const gpt2::CudaPlugin*>(c.get_pointer());
    if (plugin->abi != gpt2::kCudaPluginAbi)
      throw py::value_error("gpt2core._C_cuda comes from another build of gpt2core (plugin ABI " +
                            std::to_string(plugin->abi) + ", expected " + std::to_string(gpt2::kCudaPluginAbi) +
                            "): reinstall gpt2core");
    gpt2::cuda_plugin() = plugin;
  }, py::arg("plugin"), "Take the CUDA backend's entry points (gpt2core._cuda.load() calls this).");
#if GPT2CORE_WITH_DIST
  bind_dist(m);
#endif
#ifdef GPT2CORE_EXTRA_BINDINGS
  GPT2CORE_EXTRA_BINDINGS(m);
#endif
}
