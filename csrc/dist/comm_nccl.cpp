// Comm over NCCL (see comm_nccl.h).
//
//   allreduce        ncclAllReduce (ncclAvg for Avg)
//   reduce_scatter   ncclReduceScatter in place when size() divides n; otherwise one ncclReduce per
//                    shard to its owner, grouped (same traffic, uneven shards)
//   all_gather       ncclAllGather in place when size() divides n; otherwise grouped ncclBroadcast
//   broadcast        ncclBroadcast;  barrier: an allreduce of one float
// The communicator is non-blocking (config.blocking = 0), so init and every wait can time out.
#include "dist/comm_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "dist/rendezvous.h"

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

 private:
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
  void wait_state(const char* op, bool stream) {
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm_, &st);
      if (st != ncclSuccess && st != ncclInProgress) fail(op, std::string("NCCL reports ") + ncclGetErrorString(st));
      if (st == ncclSuccess) {
        if (!stream) return;
        cudaError_t q = cudaStreamQuery(stream_);
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

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(const RendezvousOptions& opts, int device, cudaStream_t stream) {
  return std::make_unique<NcclComm>(opts, device, stream);
}

}  // namespace gpt2::dist
