// Comm over NCCL (see comm_nccl.h).
//
//   allreduce        ncclAllReduce (ncclAvg for Avg)
//   reduce_scatter   ncclReduceScatter in place when size() divides n; otherwise one ncclReduce per
//                    shard to its owner, grouped (same traffic, uneven shards)
//   all_gather       ncclAllGather in place when size() divides n; otherwise grouped ncclBroadcast
//   broadcast        ncclBroadcast;  barrier: an allreduce of one float
//   bucket_allreduce NcclBuckets: on a comm stream of its own (non-blocking, so the legacy default stream
//                    does not serialise with it), each group waits for an event recorded on the compute
//                    stream at enqueue time, then runs its ranges' ncclAllReduce(avg) in one
//                    ncclGroupStart/End; finish() makes the compute stream wait for the comm stream
// The communicator is non-blocking (config.blocking = 0), so init and every wait can time out.
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

[[noreturn]] void nccl_fail(ncclResult_t r, ncclComm_t comm, const char* expr, const char* file, int line) {
  std::ostringstream s;
  s << "NCCL error " << int(r) << " (" << ncclGetErrorString(r) << ") in " << expr << " at " << file << ":" << line;
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  if (last && *last) s << ": " << last;
  throw DistError(s.str());
}

#define GPT2_NCCL_CHECK(comm, expr)                                              \
  do {                                                                           \
    ncclResult_t _r = (expr);                                                    \
    if (_r != ncclSuccess && _r != ncclInProgress) nccl_fail(_r, comm, #expr, __FILE__, __LINE__); \
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
      GPT2_NCCL_CHECK(nullptr, ncclGetUniqueId(&id));
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
    GPT2_NCCL_CHECK(nullptr, ncclCommInitRankConfig(&comm_, size_, id, rank_, &cfg));
    wait_state("ncclCommInitRank", false);
    GPT2_CUDA_CHECK(cudaMalloc(&one_, sizeof(float)));
  }

  ~NcclComm() override {
    if (one_) cudaFree(one_);
    if (staging_) cudaFree(staging_);
    if (!comm_) return;
    if (broken_) {
      ncclCommAbort(comm_);
      return;
    }
    ncclResult_t r = ncclCommFinalize(comm_);
    ncclResult_t st = r;
    const auto deadline = Clock::now() + timeout_;
    while (r == ncclSuccess && Clock::now() < deadline) {
      ncclCommGetAsyncError(comm_, &st);
      if (st != ncclInProgress) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (st == ncclSuccess)
      ncclCommDestroy(comm_);
    else {
      std::fprintf(stderr, "gpt2core: NCCL finalize on rank %d did not complete (%s); aborting the communicator\n",
                   rank_, ncclGetErrorString(st));
      ncclCommAbort(comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  // Buffers in device or managed memory go to NCCL as they are; host buffers (a loss value, a norm) are
  // staged through device memory.
  void allreduce(float* buf, size_t n, ReduceOp op) override {
    if (n == 0) return;
    Staged s(this, buf, n);
    GPT2_NCCL_CHECK(comm_, ncclAllReduce(s.p, s.p, n, ncclFloat, red(op), comm_, stream_));
    wait_state("allreduce", true);
    s.finish();
  }

  void reduce_scatter(float* host_or_dev, size_t n, ReduceOp op) override {
    if (n == 0) return;
    Staged s(this, host_or_dev, n);
    float* buf = s.p;
    const size_t S = shard_size(n, size_);
    if (S * size_t(size_) == n) {
      GPT2_NCCL_CHECK(comm_, ncclReduceScatter(buf, buf + S * size_t(rank_), S, ncclFloat, red(op), comm_, stream_));
    } else {
      GPT2_NCCL_CHECK(comm_, ncclGroupStart());
      for (int r = 0; r < size_; r++) {
        const size_t lo = shard_lo(n, r), cnt = shard_hi(n, r) - lo;
        if (cnt) GPT2_NCCL_CHECK(comm_, ncclReduce(buf + lo, buf + lo, cnt, ncclFloat, red(op), r, comm_, stream_));
      }
      GPT2_NCCL_CHECK(comm_, ncclGroupEnd());
    }
    wait_state("reduce_scatter", true);
    s.finish();
  }

  void all_gather(float* host_or_dev, size_t n) override {
    if (n == 0) return;
    Staged s(this, host_or_dev, n);
    float* buf = s.p;
    const size_t S = shard_size(n, size_);
    if (S * size_t(size_) == n) {
      GPT2_NCCL_CHECK(comm_, ncclAllGather(buf + S * size_t(rank_), buf, S, ncclFloat, comm_, stream_));
    } else {
      GPT2_NCCL_CHECK(comm_, ncclGroupStart());
      for (int r = 0; r < size_; r++) {
        const size_t lo = shard_lo(n, r), cnt = shard_hi(n, r) - lo;
        if (cnt) GPT2_NCCL_CHECK(comm_, ncclBroadcast(buf + lo, buf + lo, cnt, ncclFloat, r, comm_, stream_));
      }
      GPT2_NCCL_CHECK(comm_, ncclGroupEnd());
    }
    wait_state("all_gather", true);
    s.finish();
  }

  void broadcast(float* buf, size_t n, int root) override {
    if (root < 0 || root >= size_)
      throw DistError("broadcast: root " + std::to_string(root) + " is outside 0.." + std::to_string(size_ - 1));
    if (n == 0) return;
    Staged s(this, buf, n);
    GPT2_NCCL_CHECK(comm_, ncclBroadcast(s.p, s.p, n, ncclFloat, root, comm_, stream_));
    wait_state("broadcast", true);
    s.finish();
  }

  void barrier() override {
    GPT2_NCCL_CHECK(comm_, ncclAllReduce(one_, one_, 1, ncclFloat, ncclSum, comm_, stream_));
    wait_state("barrier", true);
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

  // p: the buffer itself, or a device copy of a host buffer, copied back by finish().
  struct Staged {
    NcclComm* c;
    float* host = nullptr;
    float* p;
    size_t n;
    Staged(NcclComm* comm, float* buf, size_t count) : c(comm), p(buf), n(count) {
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
      GPT2_CUDA_CHECK(cudaMemcpy(p, host, n * sizeof(float), cudaMemcpyHostToDevice));
    }
    void finish() {  // after the collective completed
      if (!host) return;
      GPT2_CUDA_CHECK(cudaMemcpy(host, p, n * sizeof(float), cudaMemcpyDeviceToHost));
      if (c->staging_cap_ > kKeepStaging) {  // a large host buffer (a checkpoint gather): do not hold on to it
        cudaFree(c->staging_);
        c->staging_ = nullptr;
        c->staging_cap_ = 0;
      }
    }
  };

  // Polls the communicator (and the stream) until the operation completed, failed or timed out; on
  // failure or timeout the communicator is aborted (which also unblocks its kernels) and DistError thrown.
  void wait_state(const char* op, bool stream) { wait_state(op, stream ? stream_ : nullptr, stream); }
  void wait_state(const char* op, cudaStream_t stream_to_wait, bool stream) {
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm_, &st);
      if (st != ncclSuccess && st != ncclInProgress) fail(op, std::string("NCCL reports ") + ncclGetErrorString(st));
      if (st == ncclSuccess) {
        if (!stream) return;
        cudaError_t q = cudaStreamQuery(stream_to_wait);
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

  [[noreturn]] void fail(const char* op, const std::string& why) {
    broken_ = true;
    std::ostringstream s;
    s << op << " on rank " << rank_ << " of " << size_ << " (NCCL, GPU " << device_ << "): " << why;
    const char* last = ncclGetLastError(comm_);
    if (last && *last) s << "; " << last;
    throw DistError(s.str());
  }

  int rank_, size_, device_;
  cudaStream_t stream_;
  std::unique_ptr<TcpStore> store_;
  ncclComm_t comm_ = nullptr;
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
    GPT2_NCCL_CHECK(c_.comm_, ncclGroupStart());
    for (auto& [lo, hi] : rs)
      GPT2_NCCL_CHECK(c_.comm_, ncclAllReduce(buf_ + lo, buf_ + lo, hi - lo, ncclFloat, ncclAvg, c_.comm_, comm_stream_));
    GPT2_NCCL_CHECK(c_.comm_, ncclGroupEnd());
    // non-blocking communicator: the group is enqueued once the state leaves ncclInProgress (a host wait for
    // the enqueue, not for the collective)
    c_.wait_state("overlapped gradient allreduce (enqueue)", nullptr, false);
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
    c_.wait_state("overlapped gradient allreduce", comm_stream_, true);
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
