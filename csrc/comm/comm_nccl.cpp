// Comm over NCCL (see comm_nccl.h).
//
//   allreduce        ncclAllReduce (ncclAvg for Avg)
//   reduce_scatter   ncclReduceScatter in place when size() divides n; otherwise one ncclReduce per
//                    shard to its owner, grouped (same traffic, uneven shards)
//   reduce_scatter_v one ncclReduce per piece to its owner, grouped (ZeRO-2's buckets)
//   all_gather       ncclAllGather in place when size() divides n; otherwise grouped ncclBroadcast
//   broadcast        ncclBroadcast;  barrier: an allreduce of one float
//   (all of these on the communicator's own non-blocking stream, after an event recorded on the compute stream
//   has completed, so the wait's timeout counts communication only; host buffers are staged on that stream)
//   bucket_allreduce NcclBuckets: on a comm stream of its own (non-blocking, so the legacy default stream
//                    does not serialise with it), each group waits for an event recorded on the compute
//                    stream at enqueue time, then runs its ranges' ncclAllReduce(avg) in one
//                    ncclGroupStart/End; finish() makes the compute stream wait for the comm stream
// The communicator is non-blocking (config.blocking = 0), so init and every wait can time out; a timeout or an
// error aborts it at once (fail) and throws DistError, and a clean shutdown finalizes it (polled) and destroys it.
#include "comm/comm_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "comm/rendezvous.h"

namespace gpt2::dist {

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void nccl_fail(ncclResult_t r, const char* expr, const char* file, int line) {
  std::ostringstream s;
  s << "NCCL error " << int(r) << " (" << ncclGetErrorString(r) << ") in " << expr << " at " << file << ":" << line;
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) s << ": " << last;
  throw DistError(s.str());
}

// A call before there is a communicator.
#define GPT2_NCCL_CHECK(expr)                                                    \
  do {                                                                           \
    ncclResult_t _r = (expr);                                                    \
    if (_r != ncclSuccess && _r != ncclInProgress) nccl_fail(_r, #expr, __FILE__, __LINE__); \
  } while (0)

// A call on a live communicator: an error aborts it (NcclComm::fail) before DistError is thrown.
#define GPT2_NCCL_CALL(owner, expr)                                                                  \
  do {                                                                                               \
    ncclResult_t _r = (expr);                                                                        \
    if (_r != ncclSuccess && _r != ncclInProgress)                                                   \
      (owner).fail(#expr, std::string("NCCL error ") + std::to_string(int(_r)) + " (" + ncclGetErrorString(_r) + ")"); \
  } while (0)

#define GPT2_CUDA_CHECK(expr)                                                                  \
  do {                                                                                         \
    cudaError_t _e = (expr);                                                                   \
    if (_e != cudaSuccess) {                                                                   \
      std::ostringstream _s;                                                                   \
      _s << "CUDA error " << cudaGetErrorString(_e) << " in " #expr " at " << __FILE__ << ":" << __LINE__; \
      throw DistError(_s.str());                                                               \
    }                                                                                          \
  } while (0)

class NcclBuckets;

class NcclComm final : public Comm {
 public:
  NcclComm(const RendezvousOptions& o, int device, cudaStream_t stream)
      : rank_(o.rank), size_(o.world_size), device_(device), stream_(stream) {
    timeout_ = o.timeout;
    store_ = rendezvous(o);
    GPT2_CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId id;
    const std::string key = o.prefix + "/nccl/unique_id";
    if (rank_ == 0) {
      GPT2_NCCL_CHECK(ncclGetUniqueId(&id));
      store_->set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    } else {
      auto v = store_->get(key, timeout_);
      if (v.size() != sizeof(id.internal))
        throw DistError("rank " + std::to_string(rank_) + ": the ncclUniqueId from rank 0 has " +
                        std::to_string(v.size()) + " bytes, expected " + std::to_string(sizeof(id.internal)) +
                        " (different NCCL versions?)");
      std::memcpy(id.internal, v.data(), v.size());
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    GPT2_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size_, id, rank_, &cfg));
    try {
      wait_state("ncclCommInitRank");  // a timeout aborts the half-built communicator (fail)
      GPT2_CUDA_CHECK(cudaMalloc(&one_, sizeof(float)));
      GPT2_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
      GPT2_CUDA_CHECK(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming));
    } catch (...) {  // no destructor runs for a constructor that throws
      abort_comm();
      release_buffers();
      throw;
    }
  }

  // The communicator first (a failed one was already aborted by fail()), then the buffers: cudaFree waits for the
  // device, which must not still run NCCL kernels. Non-blocking communicator: ncclCommFinalize returns
  // ncclInProgress and the state turns ncclSuccess once every rank is quiescent (nccl.h), so poll while it is
  // in progress; an error or the timeout aborts instead.
  ~NcclComm() override {
    if (comm_) {
      ncclResult_t st = ncclCommFinalize(comm_);
      const auto deadline = Clock::now() + timeout_;
      while (st == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess) break;
      }
      if (st == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        std::fprintf(stderr, "gpt2core: NCCL finalize on rank %d did not complete (%s); aborting the communicator\n",
                     rank_, ncclGetErrorString(st));
        ncclCommAbort(comm_);
      }
    }
    release_buffers();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  // Buffers in device or managed memory go to NCCL as they are; host buffers (a loss value, a norm) are
  // staged through device memory.
  void allreduce(float* buf, size_t n, ReduceOp op) override {
    if (n == 0) return;
    Staged s(this, buf, n, "allreduce");
    GPT2_NCCL_CALL(*this, ncclAllReduce(s.p, s.p, n, ncclFloat, red(op), comm_, comm_stream_));
    wait_state("allreduce", comm_stream_);
    s.finish();
  }

  void reduce_scatter(float* host_or_dev, size_t n, ReduceOp op) override {
    if (n == 0) return;
    Staged s(this, host_or_dev, n, "reduce_scatter");
    float* buf = s.p;
    const size_t S = shard_size(n, size_);
    if (S * size_t(size_) == n) {
      GPT2_NCCL_CALL(*this, ncclReduceScatter(buf, buf + S * size_t(rank_), S, ncclFloat, red(op), comm_,
                                               comm_stream_));
    } else {
      GPT2_NCCL_CALL(*this, ncclGroupStart());
      for (int r = 0; r < size_; r++) {
        const size_t lo = shard_lo(n, r), cnt = shard_hi(n, r) - lo;
        if (cnt)
          GPT2_NCCL_CALL(*this, ncclReduce(buf + lo, buf + lo, cnt, ncclFloat, red(op), r, comm_, comm_stream_));
      }
      GPT2_NCCL_CALL(*this, ncclGroupEnd());
    }
    wait_state("reduce_scatter", comm_stream_);
    s.finish();
  }

  void reduce_scatter_v(float* host_or_dev, const std::vector<size_t>& counts, ReduceOp op) override {
    if (counts.size() != size_t(size_))
      throw DistError("reduce_scatter_v: " + std::to_string(counts.size()) + " counts for " +
                      std::to_string(size_) + " ranks");
    size_t n = 0;
    for (size_t c : counts) n += c;
    if (n == 0) return;
    Staged s(this, host_or_dev, n, "reduce_scatter");
    float* buf = s.p;
    GPT2_NCCL_CALL(*this, ncclGroupStart());
    size_t lo = 0;
    for (int r = 0; r < size_; r++) {  // one ncclReduce per piece to its owner, as reduce_scatter's uneven path
      if (counts[r])
        GPT2_NCCL_CALL(*this, ncclReduce(buf + lo, buf + lo, counts[r], ncclFloat, red(op), r, comm_, comm_stream_));
      lo += counts[r];
    }
    GPT2_NCCL_CALL(*this, ncclGroupEnd());
    wait_state("reduce_scatter", comm_stream_);
    s.finish();
  }

  void all_gather(float* host_or_dev, size_t n) override {
    if (n == 0) return;
    Staged s(this, host_or_dev, n, "all_gather");
    float* buf = s.p;
    const size_t S = shard_size(n, size_);
    if (S * size_t(size_) == n) {
      GPT2_NCCL_CALL(*this, ncclAllGather(buf + S * size_t(rank_), buf, S, ncclFloat, comm_, comm_stream_));
    } else {
      GPT2_NCCL_CALL(*this, ncclGroupStart());
      for (int r = 0; r < size_; r++) {
        const size_t lo = shard_lo(n, r), cnt = shard_hi(n, r) - lo;
        if (cnt) GPT2_NCCL_CALL(*this, ncclBroadcast(buf + lo, buf + lo, cnt, ncclFloat, r, comm_, comm_stream_));
      }
      GPT2_NCCL_CALL(*this, ncclGroupEnd());
    }
    wait_state("all_gather", comm_stream_);
    s.finish();
  }

  void broadcast(float* buf, size_t n, int root) override {
    if (root < 0 || root >= size_)
      throw DistError("broadcast: root " + std::to_string(root) + " is outside 0.." + std::to_string(size_ - 1));
    if (n == 0) return;
    Staged s(this, buf, n, "broadcast");
    GPT2_NCCL_CALL(*this, ncclBroadcast(s.p, s.p, n, ncclFloat, root, comm_, comm_stream_));
    wait_state("broadcast", comm_stream_);
    s.finish();
  }

  void barrier() override {
    after_compute("barrier");
    GPT2_NCCL_CALL(*this, ncclAllReduce(one_, one_, 1, ncclFloat, ncclSum, comm_, comm_stream_));
    wait_state("barrier", comm_stream_);
  }

  std::unique_ptr<BucketAllreduce> bucket_allreduce(float* buf, size_t n, void* stream) override;

 private:
  friend class NcclBuckets;
  static ncclRedOp_t red(ReduceOp op) { return op == ReduceOp::Avg ? ncclAvg : ncclSum; }
  static constexpr size_t kKeepStaging = size_t(1) << 20;  // floats of staging kept between calls

  static bool on_device(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }

  // Orders the comm stream after the work the compute stream has queued so far (which produces the buffers),
  // and waits on the host until that work is done: the collective's timeout then counts communication only.
  // Compute waits for the collective on the host (wait_state) before the caller goes on.
  void after_compute(const char* op) {
    if (broken_)
      throw DistError(std::string(op) + " on rank " + std::to_string(rank_) +
                      " (NCCL): the process group is broken by an earlier failure");
    GPT2_CUDA_CHECK(cudaSetDevice(device_));  // the streams and the event are this GPU's, whatever is current
    GPT2_CUDA_CHECK(cudaEventRecord(inputs_ready_, stream_));
    GPT2_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, inputs_ready_, 0));
    GPT2_CUDA_CHECK(cudaEventSynchronize(inputs_ready_));
  }
  void set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }

  // p: the buffer itself, or a device copy of a host buffer (copied on the comm stream), copied back by finish().
  struct Staged {
    NcclComm* c;
    float* host = nullptr;
    float* p;
    size_t n;
    Staged(NcclComm* comm, float* buf, size_t count, const char* op) : c(comm), p(buf), n(count) {
      c->after_compute(op);
      if (on_device(buf)) return;
      if (c->staging_cap_ < n) {
        if (c->staging_) cudaFree(c->staging_);
        c->staging_ = nullptr;
        c->staging_cap_ = 0;
        GPT2_CUDA_CHECK(cudaMalloc(&c->staging_, n * sizeof(float)));
        c->staging_cap_ = n;
      }
      host = buf;
      p = c->staging_;
      GPT2_CUDA_CHECK(cudaMemcpyAsync(p, host, n * sizeof(float), cudaMemcpyHostToDevice, c->comm_stream_));
    }
    void finish() {  // after the collective completed
      if (!host) return;
      GPT2_CUDA_CHECK(cudaMemcpyAsync(host, p, n * sizeof(float), cudaMemcpyDeviceToHost, c->comm_stream_));
      GPT2_CUDA_CHECK(cudaStreamSynchronize(c->comm_stream_));
      if (c->staging_cap_ > kKeepStaging) {  // a large host buffer (a checkpoint gather): do not hold on to it
        cudaFree(c->staging_);
        c->staging_ = nullptr;
        c->staging_cap_ = 0;
      }
    }
  };

  // Polls the communicator (and `stream` unless null: none of its streams is the legacy one) until the operation
  // completed, failed or timed out; on failure or timeout the communicator is aborted (which also unblocks its
  // kernels) and DistError thrown.
  void wait_state(const char* op, cudaStream_t stream = nullptr) {
    if (!comm_) fail(op, "the process group is broken by an earlier failure");
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm_, &st);
      if (st != ncclSuccess && st != ncclInProgress) fail(op, std::string("NCCL reports ") + ncclGetErrorString(st));
      if (st == ncclSuccess) {
        if (!stream) return;
        cudaError_t q = cudaStreamQuery(stream);
        if (q == cudaSuccess) return;
        if (q != cudaErrorNotReady) fail(op, std::string("CUDA reports ") + cudaGetErrorString(q));
      }
      if (Clock::now() >= deadline) {
        std::ostringstream s;
        s << "timed out after " << timeout_.count() / 1000.0 << " s (another rank exited, crashed or stopped responding)";
        fail(op, s.str());
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // A timeout or a peer's error: abort the communicator now ("If an error occurs, destroy the communicator with
  // abort", nccl.h), which ends its kernels still spinning on the device, then throw. Leaving the abort to the
  // destructor would hang: whatever runs first (a cudaFree, a synchronize) waits for those kernels.
  [[noreturn]] void fail(const char* op, const std::string& why) {
    std::ostringstream s;
    s << op << " on rank " << rank_ << " of " << size_ << " (NCCL, GPU " << device_ << "): " << why;
    const char* last = comm_ ? ncclGetLastError(comm_) : nullptr;
    if (last && *last) s << "; " << last;
    abort_comm();
    throw DistError(s.str());
  }
  void abort_comm() {
    broken_ = true;
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  // Never throws (destructors and the constructor's cleanup).
  void release_buffers() {
    if (inputs_ready_) cudaEventDestroy(inputs_ready_);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
    for (float* p : {one_, staging_})
      if (p) cudaFree(p);
    inputs_ready_ = nullptr, comm_stream_ = nullptr, one_ = staging_ = nullptr;
  }

  int rank_, size_, device_;
  cudaStream_t stream_;  // the compute stream (nullptr: the legacy stream, which waits for all blocking streams)
  cudaStream_t comm_stream_ = nullptr;  // the collectives', non-blocking: no implicit sync with compute
  cudaEvent_t inputs_ready_ = nullptr;  // recorded on stream_ before each collective
  std::unique_ptr<TcpStore> store_;
  ncclComm_t comm_ = nullptr;  // null once aborted
  float* one_ = nullptr;
  float* staging_ = nullptr;
  size_t staging_cap_ = 0;
  bool broken_ = false;
};

class NcclBuckets final : public BucketAllreduce {
 public:
  NcclBuckets(NcclComm& comm, float* buf, size_t n, cudaStream_t compute)
      : c_(comm), buf_(buf), n_(n), compute_(compute) {
    if (!NcclComm::on_device(buf))
      throw DistError("bucket_allreduce: NCCL needs the buffer in device (or managed) memory");
    GPT2_CUDA_CHECK(cudaSetDevice(c_.device_));
    GPT2_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    GPT2_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    GPT2_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  // Never waits: a collective still queued behind a dead peer would never end. CUDA releases the stream and
  // events once their queued work has run (or the communicator's abort ended it).
  ~NcclBuckets() override {
    for (cudaEvent_t e : {ready_, done_})
      if (e) cudaEventDestroy(e);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
  }

  void enqueue(const std::vector<std::pair<size_t, size_t>>& ranges) override {
    // adjacent ranges (lnfw + lnfb, wte + wpe) become one call
    std::vector<std::pair<size_t, size_t>> rs;
    size_t values = 0;
    for (auto& r : ranges) {
      if (r.first > r.second || r.second > n_)
        throw std::invalid_argument("bucket_allreduce: range [" + std::to_string(r.first) + ", " +
                                    std::to_string(r.second) + ") is outside the buffer of " + std::to_string(n_) +
                                    " values");
      values += r.second - r.first;
      if (r.first == r.second) continue;
      if (!rs.empty() && rs.back().second == r.first) rs.back().second = r.second;
      else rs.push_back(r);
    }
    stats_.groups++, stats_.ranges += ranges.size(), stats_.values += values;
    if (rs.empty()) return;
    if (c_.broken_) throw DistError("overlapped gradient allreduce on rank " + std::to_string(c_.rank_) +
                                    ": the process group is broken by an earlier failure");
    // the comm stream starts this group once the compute stream has produced its ranges
    GPT2_CUDA_CHECK(cudaEventRecord(ready_, compute_));
    GPT2_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ready_, 0));
    GPT2_NCCL_CALL(c_, ncclGroupStart());
    for (auto& [lo, hi] : rs)
      GPT2_NCCL_CALL(c_, ncclAllReduce(buf_ + lo, buf_ + lo, hi - lo, ncclFloat, ncclAvg, c_.comm_, comm_stream_));
    GPT2_NCCL_CALL(c_, ncclGroupEnd());
    // non-blocking communicator: the group is enqueued once the state leaves ncclInProgress (a host wait for
    // the enqueue, not for the collective)
    c_.wait_state("overlapped gradient allreduce (enqueue)");
    pending_ = true;
  }

  void finish() override {
    stats_.finishes++;
    if (!pending_) return;
    pending_ = false;
    // the device-side order: whatever the compute stream runs next (clip, AdamW, the next zero_grad) waits
    GPT2_CUDA_CHECK(cudaEventRecord(done_, comm_stream_));
    GPT2_CUDA_CHECK(cudaStreamWaitEvent(compute_, done_, 0));
    // and a polled host wait: the step's grad norm reads a value back right after this anyway, and a blocking
    // sync behind a collective whose peer died would never return; polling aborts the group at the timeout
    c_.wait_state("overlapped gradient allreduce", comm_stream_);
  }

 private:
  NcclComm& c_;
  float* buf_;
  size_t n_;
  cudaStream_t compute_;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  bool pending_ = false;  // groups enqueued since the last finish()
};

std::unique_ptr<BucketAllreduce> NcclComm::bucket_allreduce(float* buf, size_t n, void* stream) {
  return std::make_unique<NcclBuckets>(*this, buf, n, static_cast<cudaStream_t>(stream));
}

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(const RendezvousOptions& opts, int device, cudaStream_t stream) {
  return std::make_unique<NcclComm>(opts, device, stream);
}

}  // namespace gpt2::dist
