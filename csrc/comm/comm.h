// The communicator seam for data-parallel training: a narrow interface over a process group of
// `size()` ranks, implemented by Gloo (CPU, TCP; comm_gloo.cpp) and NCCL (GPU; comm_nccl.cpp, built only
// with CUDA + NCCL). Every collective is blocking and bounded by the communicator's timeout: a rank that
// died or hangs makes the others throw DistError instead of waiting forever.
//
// Buffers are `float` in the backend's memory (host memory for Gloo, device memory for NCCL).
// All ranks must call the same collectives in the same order with the same sizes.
//
// Sharding (reduce_scatter / all_gather, ZeRO-1): a buffer of n values is cut into size() contiguous
// shards; rank r owns [shard_lo(n, r), shard_hi(n, r)), S = ceil(n / size()) values each, the last ones
// shorter (or empty when n < size() * S). Both collectives work in place on the full n-value buffer.
//
// Overlap (BucketAllreduce): the one non-blocking operation, for gradients averaged while backward still
// runs. Between its first enqueue() and finish() the caller must not use the Comm otherwise (DataParallel
// calls finish() first; Gloo's blocking collectives also drain the queue first, as a safety net).
#pragma once
#include <chrono>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gpt2::dist {

enum class ReduceOp { Sum, Avg };

// Any failure of the process group: a peer that died (connection reset), a timeout (a peer that hangs
// or never arrived), a rendezvous that could not complete. The message names the operation, this rank
// and, where known, the peer.
// Default visibility: thrown in gpt2core._C_cuda (NCCL) and caught by type in gpt2core._C, two modules built with
// hidden symbols, where the type must be the same one.
class __attribute__((visibility("default"))) DistError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Averages (mean over ranks, in place) groups of ranges of one float buffer in the background: the gradient
// all-reduce, fed by the model's grad-ready hook during the last backward of an optimizer step. Every rank
// must enqueue the same groups in the same order. One enqueue() is one collective: Gloo packs the group's
// ranges into one staging buffer (none when they are contiguous), NCCL issues them in one
// ncclGroupStart/End (adjacent ranges merged).
//   Gloo (CPU): a worker thread takes the groups from a queue; the backward thread only pushes them.
//   NCCL (GPU): the comm stream waits for an event recorded on the compute stream at enqueue time (so the
//   ranges' producing kernels come first), then runs the group's ncclAllReduce(avg) calls.
class BucketAllreduce {
 public:
  virtual ~BucketAllreduce() = default;
  // [lo, hi) offsets into the buffer; their values are final in the compute stream's order now.
  virtual void enqueue(const std::vector<std::pair<size_t, size_t>>& ranges) = 0;
  // Everything enqueued so far is averaged before anything the compute stream runs next; rethrows the first
  // failure as DistError, within the communicator's timeout (a dead or hung peer never makes it hang).
  virtual void finish() = 0;
  // Counters since construction: finish() calls, enqueued groups and the values they covered.
  struct Stats {
    size_t finishes = 0, groups = 0, ranges = 0, values = 0;
  };
  Stats stats() const { return stats_; }

 protected:
  Stats stats_;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;  // "gloo", "nccl"
  std::chrono::milliseconds timeout() const { return timeout_; }

  // buf[0..n) = sum (or mean) over ranks of buf[0..n), identical bits on every rank.
  virtual void allreduce(float* buf, size_t n, ReduceOp op) = 0;
  // In place: afterwards buf[shard_lo(n, rank) .. shard_hi(n, rank)) holds the sum (mean) over ranks of
  // that shard; the rest of buf is scratch (unspecified).
  virtual void reduce_scatter(float* buf, size_t n, ReduceOp op) = 0;
  // The same with pieces of any size: rank r owns counts[r] values starting at counts[0] + .. + counts[r-1]
  // (counts: size() entries, the same on every rank; zeros allowed). Each value is summed in the order the
  // even-shard reduce_scatter sums the values of its owner's shard, so a value reduced here (ZeRO-2, bucket by
  // bucket) has the bits it has when the whole buffer is reduce-scattered at once (ZeRO-1) by the same owner.
  virtual void reduce_scatter_v(float* buf, const std::vector<size_t>& counts, ReduceOp op) = 0;
  // In place: each rank contributes its shard buf[shard_lo(n, rank) .. shard_hi(n, rank)); afterwards
  // every rank holds all n values.
  virtual void all_gather(float* buf, size_t n) = 0;
  // buf[0..n) of rank `root` to every rank.
  virtual void broadcast(float* buf, size_t n, int root) = 0;
  virtual void barrier() = 0;
  // A BucketAllreduce over buf[0..n) (host memory for Gloo, device memory for NCCL). stream: the compute
  // stream that produces buf (cudaStream_t for NCCL, nullptr the legacy default stream; ignored by Gloo).
  // At most one lives per Comm; it must not outlive the Comm.
  virtual std::unique_ptr<BucketAllreduce> bucket_allreduce(float* buf, size_t n, void* stream) = 0;
  // The compute stream the blocking collectives order themselves after (NCCL: its "inputs ready" event is
  // recorded there; a cudaStream_t, nullptr the legacy default stream). DataParallel hands it the model's
  // backend stream; Gloo has no streams and ignores it.
  virtual void set_stream(void* stream) { (void)stream; }

  // Shard boundaries (the same on every backend).
  static size_t shard_size(size_t n, int world) { return (n + size_t(world) - 1) / size_t(world); }
  size_t shard_lo(size_t n, int r) const {
    const size_t lo = shard_size(n, size()) * size_t(r);
    return lo < n ? lo : n;
  }
  size_t shard_hi(size_t n, int r) const {
    const size_t hi = shard_lo(n, r) + shard_size(n, size());
    return hi < n ? hi : n;
  }

 protected:
  std::chrono::milliseconds timeout_{std::chrono::seconds(300)};
};

// Where and how to meet the other ranks. Rank 0 serves a small key-value store on master_port (all
// interfaces); every rank connects to master_addr:master_port.
struct RendezvousOptions {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Address other ranks reach this process at for the data connections ("" = 127.0.0.1 when
  // master_addr is a loopback address, this host's name otherwise).
  std::string hostname;
  std::string iface;     // network interface for the data connections (e.g. "eth0"), overrides hostname
  std::string prefix = "gpt2core";  // key namespace in the store (one per process group)
};

// Is Gloo compiled into this build? make_gloo_comm throws DistError when it is not.
bool have_gloo();
std::unique_ptr<Comm> make_gloo_comm(const RendezvousOptions& opts);

}  // namespace gpt2::dist
