// The KV-cache inference methods of the _C.Model classes (part of bindings.cpp, included by it): validated here,
// once (ids in range, slots and lengths consistent), then GPT2Model's kv_* calls.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "cpu/backend_cpu.h"
#include "model/gpt2.h"
#include "model/sampling.h"

namespace gpt2_bind {
namespace py = pybind11;

// A C-contiguous int32 array of ndim dims (shape checked by the caller), or a ValueError naming it.
inline py::array_t<int32_t> int32_array(const py::handle& obj, const char* name, int ndim) {
  if (!py::isinstance<py::array>(obj) || !py::array_t<int32_t>::check_(obj))
    throw py::value_error(std::string(name) + " must be a numpy int32 array");
  auto a = py::reinterpret_borrow<py::array_t<int32_t>>(obj);
  if (a.ndim() != ndim) throw py::value_error(std::string(name) + " must have " + std::to_string(ndim) + " dimensions");
  if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(name) + " must be C-contiguous");
  return a;
}

inline void check_ids(const int32_t* p, size_t n, int V, const char* name) {
  for (size_t i = 0; i < n; i++)
    if (p[i] < 0 || p[i] >= V)
      throw py::value_error(std::string(name) + " contains id " + std::to_string(p[i]) + "; valid ids are 0.." +
                            std::to_string(V - 1));
}

template <typename M, typename Cls>
void bind_kv(Cls& cls) {
  using F = gpt2::Master<typename M::M>;
  cls.def_property_readonly("training", &M::training,
                            "False for an inference-only model (no gradients or optimizer state).")
      .def_property_readonly("kv_supported", [](M& self) { return self.backend().has_kv(); },
                             "The backend has the KV-cache inference ops, for every architecture the config describes (else "
                             "generation runs the full forward).")
      .def("kv_reserve",
           [](M& self, int slots, int max_len) {
             if (slots <= 0) throw py::value_error("slots must be > 0");
             if (max_len <= 0 || max_len > self.config().max_seq_len)
               throw py::value_error("max_len must be in [1, block_size=" + std::to_string(self.config().max_seq_len) + "]");
             self.kv_reserve(slots, max_len);
           },
           py::arg("slots"), py::arg("max_len"),
           "A KV cache for `slots` sequences of up to max_len tokens (kept when the one allocated is as large).")
      .def_property("weights16", &M::weights16,
                    [](M& self, int kind) {
                      if (kind < 0 || kind > 3)
                        throw py::value_error("weights16: 0 (fp32), 1 (bf16), 2 (fp16) or 3 (int8)");
                      self.set_weights16(kind);
                    },
                    "Decode reads 16-bit or 8-bit weights: 0 off, 1 bf16, 2 fp16, 3 int8 (blocks of 32 with an fp32 "
                    "scale; rounds the model's matrices; inference-only models on backends that have it).")
      .def_property("q8_int_dot", &M::q8_int_dot, &M::set_q8_int_dot,
                    "int8 decode: True (default) quantises the GEMV inputs per block of 32 too and takes integer dot "
                    "products (llama.cpp's Q8_0 x Q8_0); False widens the weights to fp32 against fp32 inputs.")
      .def_property_readonly("kv_slots", &M::kv_slots)
      .def_property_readonly("kv_max_len", &M::kv_max_len)
      .def("kv_pos", [](M& self, int slot) {
             if (slot < 0 || slot >= self.kv_slots()) throw py::value_error("slot out of range");
             return self.kv_pos(slot);
           }, py::arg("slot"), "Tokens in the slot's cache.")
      .def_property_readonly("kv_bytes", &M::kv_bytes, "Bytes of the KV cache and the inference activations.")
      .def("kv_prefill",
           [](M& self, py::object tokens, py::object lengths, py::object slots, bool all_logits, py::object start) {
             auto x = int32_array(tokens, "tokens", 2);
             auto len = int32_array(lengths, "lengths", 1);
             auto sl = int32_array(slots, "slots", 1);
             const int n = int(x.shape(0)), Tq = int(x.shape(1));
             if (n == 0 || Tq == 0) throw py::value_error("tokens must be non-empty (n, T)");
             if (len.shape(0) != n || sl.shape(0) != n)
               throw py::value_error("lengths and slots must have one entry per row of tokens");
             if (Tq > self.kv_max_len())
               throw py::value_error("tokens: T=" + std::to_string(Tq) + " exceeds the cache's max_len=" +
                                     std::to_string(self.kv_max_len()) + " (kv_reserve a larger one)");
             check_ids(x.data(), size_t(x.size()), self.config().vocab_size, "tokens");
             std::vector<int32_t> seen(self.kv_slots(), 0);
             for (int i = 0; i < n; i++) {
               if (len.data()[i] < 1 || len.data()[i] > Tq) throw py::value_error("lengths must be in [1, T]");
               if (sl.data()[i] < 0 || sl.data()[i] >= self.kv_slots())
                 throw py::value_error("slots must be in [0, kv_slots=" + std::to_string(self.kv_slots()) + ")");
               if (seen[sl.data()[i]]++) throw py::value_error("slots: slot " + std::to_string(sl.data()[i]) + " appears twice");
             }
             py::array_t<int32_t> st;
             if (!start.is_none()) {
               st = int32_array(start, "start", 1);
               if (st.shape(0) != n) throw py::value_error("start must have one entry per row of tokens");
               for (int i = 0; i < n; i++) {
                 const int s = st.data()[i], slot = sl.data()[i];
                 if (s < 0 || s > self.kv_pos(slot))
                   throw py::value_error("start[" + std::to_string(i) + "]=" + std::to_string(s) + " must be in [0, kv_pos(" +
                                         std::to_string(slot) + ")=" + std::to_string(self.kv_pos(slot)) +
                                         "]: a prefill continues the tokens already in the slot");
                 if (s + Tq > self.kv_max_len())
                   throw py::value_error("start[" + std::to_string(i) + "]=" + std::to_string(s) + " + T=" + std::to_string(Tq) +
                                         " exceeds the cache's max_len=" + std::to_string(self.kv_max_len()) +
                                         " (every row's T positions are written, padding included)");
               }
             }
             const int32_t* sp = start.is_none() ? nullptr : st.data();
             py::gil_scoped_release nogil;
             self.kv_prefill(x.data(), len.data(), sl.data(), n, Tq, all_logits, sp);
           },
           py::arg("tokens"), py::arg("lengths"), py::arg("slots"), py::arg("all_logits") = false,
           py::arg("start") = py::none(),
           "Prefill: row i of tokens (n, T) (its first lengths[i] ids) into cache slot slots[i] from position start[i] "
           "(None: 0; above 0 it continues the slot's cache, a prompt in chunks: start[i] <= kv_pos(slot) and "
           "start[i] + T <= max_len); logits of each row's last token (or of every position with all_logits), read by "
           "kv_logits/kv_sample.")
      .def("kv_free",
           [](M& self, int slot) {
             if (slot < 0 || slot >= self.kv_slots())
               throw py::value_error("slot must be in [0, kv_slots=" + std::to_string(self.kv_slots()) + ")");
             self.kv_free(slot);
           },
           py::arg("slot"), "Release a slot: kv_pos(slot) becomes 0; the next sequence there is prefilled from 0.")
      .def("kv_decode",
           [](M& self, py::object tokens, py::object slots) {
             auto x = int32_array(tokens, "tokens", 1);
             auto sl = int32_array(slots, "slots", 1);
             const int n = int(x.shape(0));
             if (n == 0 || sl.shape(0) != n) throw py::value_error("tokens and slots: one entry per sequence, >= 1");
             check_ids(x.data(), size_t(n), self.config().vocab_size, "tokens");
             for (int i = 0; i < n; i++)
               if (sl.data()[i] < 0 || sl.data()[i] >= self.kv_slots())
                 throw py::value_error("slots must be in [0, kv_slots=" + std::to_string(self.kv_slots()) + ")");
             py::gil_scoped_release nogil;
             self.kv_decode(x.data(), sl.data(), n);
           },
           py::arg("tokens"), py::arg("slots"),
           "Decode: token i at the next position of slot slots[i]; logits (n, Vp) for kv_logits/kv_sample.")
      .def("kv_logits",
           [](M& self) {
             py::array_t<F> out({self.kv_logit_rows(), self.config().padded_vocab_size});
             self.kv_logits_to_host(out.mutable_data());
             return out;
           },
           "The logits of the last kv_prefill / kv_decode (rows, padded_vocab), copied to the host (for tests).")
      .def("kv_sample",
           [](M& self, std::vector<float> temperature, std::vector<int> top_k, std::vector<float> top_p,
              std::vector<uint64_t> seed, std::vector<uint64_t> stream, std::vector<uint64_t> step) {
             const size_t n = temperature.size();
             if (!n || top_k.size() != n || top_p.size() != n || seed.size() != n || stream.size() != n ||
                 step.size() != n)
               throw py::value_error("kv_sample: one temperature, top_k, top_p, seed, stream and step per row");
             std::vector<gpt2::SampleRow> rows(n);
             for (size_t i = 0; i < n; i++) {
               // 0 (also a tiny temperature rounded to float32): greedy, the limit of temperature -> 0
               if (!(temperature[i] >= 0) || !std::isfinite(temperature[i])) throw py::value_error("temperature must be >= 0");
               if (top_k[i] < 0) throw py::value_error("top_k must be >= 0");
               // 0 (a positive top_p below float32's range, rounded): the most likely token, the limit of top_p -> 0
               if (!(top_p[i] >= 0 && top_p[i] <= 1)) throw py::value_error("top_p must be in [0, 1]");
               rows[i] = {temperature[i], top_k[i], top_p[i], seed[i], stream[i], step[i]};
             }
             if (int(n) != self.kv_logit_rows())
               throw py::value_error("kv_sample: " + std::to_string(n) + " rows of settings for " +
                                     std::to_string(self.kv_logit_rows()) + " rows of logits");
             py::array_t<int32_t> ids(std::vector<py::ssize_t>{py::ssize_t(n)});
             int32_t* out = ids.mutable_data();
             {
               py::gil_scoped_release nogil;
               self.kv_sample(out, rows.data(), int(n));
             }
             return ids;
           },
           py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("seed"), py::arg("stream"),
           py::arg("step"),
           "One token id per row of the last prefill / decode's logits, sampled where they are (model/sampling.h).");
}


// _C.quantize_q8 / _C.gemv_q8: the CPU backend's 8-bit-weight ops (Backend::quantize_q8, matmul_forward_q8) on
// numpy arrays, in the instruction-set variant set_cpu_isa chose, for the tests against numpy.
template <typename T>
py::array_t<T> float_matrix(const py::handle& obj, const char* name) {
  const std::string what = std::string(name) + " must be a non-empty, C-contiguous " +
                           (sizeof(T) == 4 ? "float32" : "float64") + " numpy array of 2 dimensions";
  if (!py::isinstance<py::array>(obj) || !py::array_t<T>::check_(obj)) throw py::value_error(what);
  auto a = py::reinterpret_borrow<py::array_t<T>>(obj);
  if (a.ndim() != 2 || !(a.flags() & py::array::c_style) || a.size() == 0) throw py::value_error(what);
  return a;
}

template <typename T>
py::tuple quantize_q8_np(const py::handle& w_obj) {
  auto w = float_matrix<T>(w_obj, "w");
  const long rows = long(w.shape(0));
  const int C = int(w.shape(1)), nb = (C + 31) / 32;
  py::array_t<int8_t> q({w.shape(0), w.shape(1)});
  py::array_t<float> s({w.shape(0), py::ssize_t(nb)});
  py::array_t<T> wq({w.shape(0), w.shape(1)});
  std::copy(w.data(), w.data() + w.size(), wq.mutable_data());
  auto be = gpt2::cpu::make_backend<T>();
  be->quantize_q8(q.mutable_data(), s.mutable_data(), wq.mutable_data(), rows, C);
  return py::make_tuple(q, s, wq);
}

template <typename T>
py::array_t<T> gemv_q8_np(const py::handle& x_obj, const py::handle& q_obj, const py::handle& s_obj,
                          const py::handle& b_obj, bool int_dot) {
  auto x = float_matrix<T>(x_obj, "x");
  if (!py::isinstance<py::array>(q_obj) || !py::array_t<int8_t>::check_(q_obj))
    throw py::value_error("q must be a numpy int8 array");
  auto q = py::reinterpret_borrow<py::array_t<int8_t>>(q_obj);
  const auto s = float_matrix<float>(s_obj, "scales");
  const py::ssize_t N = x.shape(0), C = x.shape(1);
  if (q.ndim() != 2 || !(q.flags() & py::array::c_style) || q.shape(1) != C)
    throw py::value_error("q must be C-contiguous int8 (OC, C) with x's C=" + std::to_string(C));
  const py::ssize_t OC = q.shape(0);
  if (s.shape(0) != OC || s.shape(1) != (C + 31) / 32)
    throw py::value_error("scales must be float32 (OC, ceil(C / 32)) = (" + std::to_string(OC) + ", " +
                          std::to_string((C + 31) / 32) + ")");
  py::array_t<T> bias;
  if (!b_obj.is_none()) {
    if (!py::isinstance<py::array>(b_obj) || !py::array_t<T>::check_(b_obj))
      throw py::value_error("bias must be a numpy array of x's dtype");
    bias = py::reinterpret_borrow<py::array_t<T>>(b_obj);
    if (bias.ndim() != 1 || bias.shape(0) != OC) throw py::value_error("bias must have shape (OC,)");
  }
  py::array_t<T> out({N, OC});
  std::fill(out.mutable_data(), out.mutable_data() + out.size(), std::numeric_limits<T>::quiet_NaN());  // poisoned
  auto be = gpt2::cpu::make_backend<T>();
  be->matmul_forward_q8(out.mutable_data(), x.data(), q.data(), s.data(), b_obj.is_none() ? nullptr : bias.data(),
                        int(N), int(C), int(OC), int_dot);
  return out;
}

inline void bind_q8_ops(py::module_& m) {
  m.def("quantize_q8",
        [](py::object w) {
          return py::array_t<double>::check_(w) ? quantize_q8_np<double>(w) : quantize_q8_np<float>(w);
        },
        py::arg("w"),
        "The CPU backend's int8 quantisation of a float32 / float64 matrix w (rows, C): (q int8 (rows, C), scales "
        "float32 (rows, ceil(C / 32)), w dequantised = q * scale), per block of 32 inputs of a row: scale = "
        "max|w| / 127, q = w / scale rounded to nearest even.");
  m.def("gemv_q8",
        [](py::object x, py::object q, py::object s, py::object b, bool int_dot) {
          return py::array_t<double>::check_(x) ? py::object(gemv_q8_np<double>(x, q, s, b, int_dot))
                                                : py::object(gemv_q8_np<float>(x, q, s, b, int_dot));
        },
        py::arg("x"), py::arg("q"), py::arg("scales"), py::arg("bias") = py::none(), py::arg("int_dot") = false,
        "x (N, C) @ (q * scales)^T + bias through the CPU backend's 8-bit-weight GEMV (Backend::matmul_forward_q8), "
        "the output NaN-poisoned before it runs.");
}

}  // namespace gpt2_bind
