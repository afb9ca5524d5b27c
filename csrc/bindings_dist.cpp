// Python bindings of the communicator seam (csrc/comm): gpt2core._C.dist. Buffers are validated here
// (float32, C-contiguous, writable: they are reduced in place); collectives release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "model/grad_allreduce.h"
#include "model/grad_shard.h"
#include "model/gpt2.h"

#include "model/cuda_plugin.h"
#include "cuda_loader.h"  // load_cuda_backend: the NCCL communicator lives in the CUDA module

namespace py = pybind11;

using gpt2::dist::Comm;
using gpt2::dist::ReduceOp;
using gpt2::GradAllreducer;
using gpt2::GradReduceScatterer;

namespace {

// f(model) for a model whose gradients and optimizer state are float32: Model (fp32), ModelBF16 or ModelF16.
template <class F>
auto with_float_master(py::handle model, F&& f,
                       const char* refusal = "expected a float32, bf16 or fp16 gpt2core._C model (Model, ModelBF16 "
                                             "or ModelF16)") {
  if (py::isinstance<gpt2::GPT2Model<float>>(model)) return f(model.cast<gpt2::GPT2Model<float>&>());
  if (py::isinstance<gpt2::GPT2Model<gpt2::bf16>>(model)) return f(model.cast<gpt2::GPT2Model<gpt2::bf16>&>());
  if (py::isinstance<gpt2::GPT2Model<gpt2::f16>>(model)) return f(model.cast<gpt2::GPT2Model<gpt2::f16>&>());
  throw py::type_error(refusal);
}

// Where and how long the ranks meet; shared by the Gloo and NCCL groups.
gpt2::dist::RendezvousOptions rendezvous_options(int rank, int world_size, const std::string& master_addr,
                                                 int master_port, double timeout, const std::string& prefix) {
  if (!(timeout > 0)) throw py::value_error("timeout must be > 0 seconds");
  gpt2::dist::RendezvousOptions o;
  o.rank = rank;
  o.world_size = world_size;
  o.master_addr = master_addr;
  o.master_port = master_port;
  o.timeout = std::chrono::milliseconds(long(timeout * 1000));
  o.prefix = prefix;
  return o;
}

// (pointer, count) of a writable, C-contiguous float32 array.
std::pair<float*, size_t> float_buffer(const py::handle& obj, const char* name) {
  if (!py::isinstance<py::array>(obj)) throw py::type_error(std::string(name) + " must be a numpy float32 array");
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (!py::array_t<float>::check_(arr))  // dtype equivalence, not identity (pickled arrays)
    throw py::type_error(std::string(name) + " must be float32, got dtype " + std::string(py::str(arr.dtype())));
  if (!(arr.flags() & py::array::c_style)) throw py::value_error(std::string(name) + " must be C-contiguous");
  if (!arr.writeable()) throw py::value_error(std::string(name) + " must be writable (collectives work in place)");
  return {static_cast<float*>(arr.mutable_data()), size_t(arr.size())};
}

ReduceOp parse_op(const std::string& op) {
  if (op == "sum") return ReduceOp::Sum;
  if (op == "avg" || op == "mean") return ReduceOp::Avg;
  throw py::value_error("op must be 'sum' or 'avg', got '" + op + "'");
}

}  // namespace

void bind_dist(py::module_& m) {
  auto d = m.def_submodule("dist", "Process groups for data-parallel training (Gloo on CPU).");
  // module_local (types and exception): the test-only emulated module binds the same C++ types in the same interpreter
  py::register_local_exception<gpt2::dist::DistError>(d, "DistError", PyExc_RuntimeError);
  d.def("have_gloo", &gpt2::dist::have_gloo, "Whether Gloo (CPU collectives) is compiled in.");
  d.def("have_nccl", []() {
    try {
      load_cuda_backend();
    } catch (py::error_already_set&) {
      return false;
    }
    return gpt2::cuda_plugin() != nullptr && gpt2::cuda_plugin()->make_nccl_comm != nullptr;
  }, "Whether the NCCL communicator (GPU collectives) is compiled in and its libraries load.");

  py::class_<Comm>(d, "Comm",
                   "A process group. Collectives are blocking, in place on float32 numpy arrays, bounded by "
                   "the timeout; a failure (dead or hung peer) raises DistError and breaks the group.",
                   py::module_local())
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("size", &Comm::size)
      .def_property_readonly("backend", &Comm::backend)
      .def_property_readonly("timeout", [](const Comm& c) { return c.timeout().count() / 1000.0; },
                             "seconds")
      .def("shard", [](const Comm& c, size_t n, int r) {
             if (r < 0) r = c.rank();
             if (r >= c.size()) throw py::value_error("rank " + std::to_string(r) + " is outside the group");
             return std::make_pair(c.shard_lo(n, r), c.shard_hi(n, r));
           },
           py::arg("n"), py::arg("rank") = -1,
           "[lo, hi) of rank's shard of an n-value buffer (reduce_scatter / all_gather layout).")
      .def("allreduce", [](Comm& c, py::object buf, const std::string& op) {
             auto [p, n] = float_buffer(buf, "buf");
             ReduceOp o = parse_op(op);
             py::gil_scoped_release nogil;
             c.allreduce(p, n, o);
           },
           py::arg("buf"), py::arg("op") = "sum", "In place: buf = sum (op='sum') or mean (op='avg') over ranks.")
      .def("reduce_scatter", [](Comm& c, py::object buf, const std::string& op) {
             auto [p, n] = float_buffer(buf, "buf");
             ReduceOp o = parse_op(op);
             py::gil_scoped_release nogil;
             c.reduce_scatter(p, n, o);
           },
           py::arg("buf"), py::arg("op") = "sum",
           "In place: buf[lo:hi] (this rank's shard) = sum/mean over ranks; the rest of buf is scratch.")
      .def("reduce_scatter_v", [](Comm& c, py::object buf, std::vector<size_t> counts, const std::string& op) {
             auto [p, n] = float_buffer(buf, "buf");
             size_t total = 0;
             for (size_t k : counts) total += k;
             if (int(counts.size()) != c.size() || total != n)
               throw py::value_error("reduce_scatter_v: need one count per rank (" + std::to_string(c.size()) +
                                     ") summing to len(buf) (" + std::to_string(n) + ")");
             ReduceOp o = parse_op(op);
             py::gil_scoped_release nogil;
             c.reduce_scatter_v(p, counts, o);
           },
           py::arg("buf"), py::arg("counts"), py::arg("op") = "sum",
           "In place, pieces of any size: rank r's piece of buf (counts[r] values after those of ranks < r) = "
           "sum/mean over ranks, in the order reduce_scatter sums its owner's shard.")
      .def("all_gather", [](Comm& c, py::object buf) {
             auto [p, n] = float_buffer(buf, "buf");
             py::gil_scoped_release nogil;
             c.all_gather(p, n);
           },
           py::arg("buf"), "In place: every rank's shard of buf to every rank.")
      .def("broadcast", [](Comm& c, py::object buf, int root) {
             auto [p, n] = float_buffer(buf, "buf");
             py::gil_scoped_release nogil;
             c.broadcast(p, n, root);
           },
           py::arg("buf"), py::arg("root") = 0)
      .def("use_stream_of", [](Comm& c, py::object model) {
             with_float_master(model, [&](auto& m) { c.set_stream(m.backend().native_stream()); });
           },
           py::arg("model"),
           "Order the blocking collectives after the work queued on this model's backend stream (NCCL: its "
           "'inputs ready' event is recorded there instead of on the legacy default stream). DataParallel calls it.")
      .def("barrier", [](Comm& c) {
             py::gil_scoped_release nogil;
             c.barrier();
           });

  py::class_<GradAllreducer>(d, "GradAllreducer",
                             "Gradient averaging overlapped with backward (plain data parallel). backward(scale) "
                             "is the model's backward, with each group of final gradients (a layer's, from the "
                             "last layer down) averaged over the ranks in the background: a worker thread over "
                             "Gloo, a comm stream over NCCL. finish() waits for all of it (raises DistError if a "
                             "rank failed, within the timeout). Every rank must make the same calls.",
                             py::module_local())
      .def(py::init([](Comm& comm, py::object model) {
             return with_float_master(model, [&](auto& m) { return new GradAllreducer(comm, m); },
                                      "GradAllreducer needs a Model, ModelBF16 or ModelF16 (float32 gradients)");
           }),
           py::arg("comm"), py::arg("model"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("backward", [](GradAllreducer& g, float grad_scale) {
             py::gil_scoped_release nogil;
             g.backward(grad_scale);
           },
           py::arg("grad_scale") = 1.0f)
      .def("finish", [](GradAllreducer& g) {
             py::gil_scoped_release nogil;
             g.finish();
           })
      .def("stats", [](const GradAllreducer& g) {
             auto s = g.stats();
             py::dict d;
             d["finishes"] = s.finishes, d["groups"] = s.groups, d["ranges"] = s.ranges, d["values"] = s.values;
             return d;
           },
           "Counters since construction: finish() calls, hook groups enqueued, their ranges and values.");

  py::class_<GradReduceScatterer>(d, "GradReduceScatterer",
                                  "ZeRO-2: run(fn) calls fn (the model's forward_backward or backward) with each "
                                  "bucket of gradients (the head's, each layer's from the last one down, the "
                                  "embeddings') averaged over the ranks by one reduce-scatter whose pieces are the "
                                  "bucket's parts in each rank's shard, and this rank's part folded into the "
                                  "model's gradient shard "
                                  "(set_grad_shard(lo, hi) first, with comm.shard's range). Blocking per bucket. "
                                  "Every rank must make the same calls.",
                                  py::module_local())
      .def(py::init([](Comm& comm, py::object model) {
             return with_float_master(model, [&](auto& m) { return new GradReduceScatterer(comm, m); },
                                      "GradReduceScatterer needs a Model, ModelBF16 or ModelF16 (float32 gradients)");
           }),
           py::arg("comm"), py::arg("model"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("run", [](GradReduceScatterer& g, py::function fn) { g.run([&] { fn(); }); },
           py::arg("fn"),
           "fn() with the bucket hook installed: fn calls the model's forward_backward (or backward), whose buckets "
           "are then reduce-scattered as they are final (the GIL is held around fn; the model's call releases it).")
      .def("stats", [](const GradReduceScatterer& g) {
             auto s = g.stats();
             py::dict d;
             d["backwards"] = s.backwards, d["buckets"] = s.buckets, d["values"] = s.values;
             d["seconds"] = s.seconds;
             return d;
           },
           "Counters since construction: backward calls, buckets reduce-scattered, their values, and the seconds "
           "spent reducing them (the bucket hook: collectives and folding in, the backward's ops apart).");

  d.def("alloc_state",
        [](py::object model, size_t n, py::object pinned_arg) {
          return with_float_master(model, [&](auto& m) {
            // the model's optimizer state lives where it does: pinned host memory when offloaded
            const bool pinned = pinned_arg.is_none() ? m.offload() : pinned_arg.cast<bool>();
            if (pinned && !m.backend().has_offload())
              throw py::value_error("alloc_state: pinned host memory is for a GPU model (the CPU backend's memory "
                                    "is the host's)");
            float* p = pinned ? m.backend().alloc_pinned(n) : m.backend().alloc_master(n);
            // the capsule keeps the model (and so its backend) alive for as long as the array lives
            struct Owner {
              py::object model;
              float* p;
              bool pinned;
            };
            auto* owner = new Owner{model, p, pinned};
            py::capsule cap(owner, [](void* o) {
              auto* ow = static_cast<Owner*>(o);
              with_float_master(ow->model, [&](auto& mm) {
                if (ow->pinned) mm.backend().free_pinned(ow->p);
                else mm.backend().free_master(ow->p);
              });
              delete ow;
            });
            return py::array_t<float>({py::ssize_t(n)}, {py::ssize_t(sizeof(float))}, p, cap);
          });
        },
        py::arg("model"), py::arg("n"), py::arg("pinned") = py::none(),
        "n zero-filled float32 values in a float32 or bf16 Model's backend memory (host memory on the CPU, "
        "managed device memory on GPUs, readable from numpy either way): ZeRO-1's moment shards. pinned: in pinned "
        "host memory instead (default: when the model's optimizer is offloaded), or False for backend memory.");

  d.def("grad_sum_squares",
        [](py::object model, size_t lo, size_t hi) {
          return with_float_master(model, [&](auto& m) {
            if (lo > hi || hi > m.num_parameters())
              throw py::value_error("need 0 <= lo <= hi <= num_parameters (" + std::to_string(m.num_parameters()) +
                                    ")");
            py::gil_scoped_release nogil;
            return m.grad_sum_squares(lo, hi);
          });
        },
        py::arg("model"), py::arg("lo"), py::arg("hi"),
        "Sum of squares of flat gradients [lo, hi) of a float32 or bf16 Model, on its backend (double "
        "accumulation): ZeRO-1's per-shard part of the global grad norm.");

  d.def("init_gloo",
        [](int rank, int world_size, const std::string& master_addr, int master_port, double timeout,
           const std::string& hostname, const std::string& iface, const std::string& prefix) {
          auto o = rendezvous_options(rank, world_size, master_addr, master_port, timeout, prefix);
          o.hostname = hostname;
          o.iface = iface;
          py::gil_scoped_release nogil;
          return gpt2::dist::make_gloo_comm(o);
        },
        py::arg("rank"), py::arg("world_size"), py::arg("master_addr") = "127.0.0.1", py::arg("master_port") = 29500,
        py::arg("timeout") = 300.0, py::arg("hostname") = "", py::arg("iface") = "", py::arg("prefix") = "gpt2core",
        "Join a Gloo process group: rank 0 serves the rendezvous store on master_port, all ranks meet at "
        "master_addr:master_port; raises DistError naming the ranks that did not arrive within timeout "
        "seconds.");

  d.def("init_nccl",
        [](int rank, int world_size, const std::string& master_addr, int master_port, double timeout, int device,
           const std::string& prefix) -> std::unique_ptr<Comm> {
          if (!(timeout > 0)) throw py::value_error("timeout must be > 0 seconds");
          if (device < 0) throw py::value_error("device must be a GPU index >= 0");
          load_cuda_backend();
          const gpt2::CudaPlugin* cuda = gpt2::cuda_plugin();
          if (!cuda || !cuda->make_nccl_comm)
            throw gpt2::dist::DistError("this build of gpt2core has no NCCL communicator: it needs the CUDA backend "
                                        "and NCCL (nccl.h, libnccl) at build time");
          auto o = rendezvous_options(rank, world_size, master_addr, master_port, timeout, prefix);
          py::gil_scoped_release nogil;
          return cuda->make_nccl_comm(o, device, nullptr);
        },
        py::arg("rank"), py::arg("world_size"), py::arg("master_addr") = "127.0.0.1", py::arg("master_port") = 29500,
        py::arg("timeout") = 300.0, py::arg("device") = 0, py::arg("prefix") = "gpt2core",
        "Join an NCCL process group on GPU `device` (rendezvous as init_gloo; rank 0 hands out the "
        "ncclUniqueId). Collectives take device, managed or host float32 buffers (host ones are staged).");
}
