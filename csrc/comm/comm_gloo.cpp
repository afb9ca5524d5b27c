// Comm over Gloo's TCP transport (CPU data parallelism).
//
//   allreduce        gloo::allreduce (ring), then * 1/size for Avg
//   reduce_scatter   ring over Gloo's unbound buffers: size-1 steps, each sending one shard to the right
//                    neighbour and adding the one from the left, so rank r ends with the sum of shard r
//                    (Gloo's own reduce-scatter of this version has no per-call timeout)
//   all_gather       gloo::allgatherv in place (uneven shards)
//   broadcast, barrier  gloo::broadcast, gloo::barrier
//   bucket_allreduce  GlooBuckets: a worker thread that packs each enqueued group of ranges into one staging
//                    buffer (unless they are contiguous), allreduces it (as allreduce: sum, then * 1/size)
//                    and unpacks it, while the caller's thread goes on with backward. The Gloo context is
//                    used by one thread at a time: the blocking collectives first wait for the queue to drain.
// Every call is bounded by the timeout; Gloo's exceptions (peer closed the connection, timed out)
// become DistError naming the operation and this rank.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/comm.h"
#include "comm/rendezvous.h"

#if GPT2CORE_HAS_GLOO
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#endif

namespace gpt2::dist {

#if GPT2CORE_HAS_GLOO

bool have_gloo() { return true; }

namespace {

// Gloo's Store interface over our TcpStore.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(TcpStore& s, std::chrono::milliseconds timeout) : s_(s), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override { s_.set(key, data); }
  std::vector<char> get(const std::string& key) override { return s_.get(key, timeout_); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    auto missing = s_.wait(keys, timeout);
    if (!missing.empty())
      throw DistError("rendezvous store: key '" + missing[0] + "' (published by the rank it names) did not "
                      "appear within " + std::to_string(timeout.count() / 1000.0) + " s");
  }

 private:
  TcpStore& s_;
  std::chrono::milliseconds timeout_;
};

constexpr uint64_t kReduceScatterSlot = 0x6770743272730000ull;  // "gpt2rs": our ring's messages

class GlooBuckets;

class GlooComm final : public Comm {
 public:
  explicit GlooComm(const RendezvousOptions& o) : rank_(o.rank), size_(o.world_size) {
    timeout_ = o.timeout;
    store_ = rendezvous(o);
    try {
      GlooStore adapter(*store_, o.timeout);
      gloo::rendezvous::PrefixStore prefixed(o.prefix + "/gloo", adapter);
      gloo::transport::tcp::attr attr;
      if (!o.iface.empty())
        attr.iface = o.iface;
      else
        attr.hostname = local_address(o);
      device_ = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
      ctx->setTimeout(o.timeout);
      ctx->connectFullMesh(prefixed, device_);
      ctx_ = ctx;
    } catch (const DistError&) {
      throw;
    } catch (const std::exception& e) {
      throw DistError("rank " + std::to_string(rank_) + ": connecting to the other " +
                      std::to_string(size_ - 1) + " rank(s) through Gloo failed: " + e.what());
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "gloo"; }

  void allreduce(float* buf, size_t n, ReduceOp op) override {
    if (size_ == 1 || n == 0) return;
    quiesce();
    guarded("allreduce", n, [&] {
      gloo::AllreduceOptions opts(ctx_);
      opts.setOutput(buf, n);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setTimeout(timeout_);
      gloo::allreduce(opts);
    });
    if (op == ReduceOp::Avg) scale(buf, n);
  }

  std::unique_ptr<BucketAllreduce> bucket_allreduce(float* buf, size_t n, void* stream) override;

  void reduce_scatter(float* buf, size_t n, ReduceOp op) override {
    std::vector<size_t> counts(size_);
    for (int r = 0; r < size_; r++) counts[r] = shard_hi(n, r) - shard_lo(n, r);
    reduce_scatter_v(buf, counts, op);
  }

  void reduce_scatter_v(float* buf, const std::vector<size_t>& counts, ReduceOp op) override {
    if (counts.size() != size_t(size_))
      throw DistError("reduce_scatter_v: " + std::to_string(counts.size()) + " counts for " +
                      std::to_string(size_) + " ranks");
    std::vector<size_t> at(size_ + 1, 0);
    for (int r = 0; r < size_; r++) at[r + 1] = at[r] + counts[r];
    const size_t n = at[size_];
    if (size_ == 1 || n == 0) return;
    quiesce();
    const size_t S = *std::max_element(counts.begin(), counts.end());
    if (scratch_.size() < S) scratch_.resize(S);
    guarded("reduce_scatter", n, [&] {
      auto out = ctx_->createUnboundBuffer(buf, n * sizeof(float));
      auto tmp = ctx_->createUnboundBuffer(scratch_.data(), S * sizeof(float));
      const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
      for (int s = 0; s < size_ - 1; s++) {
        // send the piece we finished adding into last step; receive the left neighbour's partial sum of
        // the next one. At the last step the received piece is our own: it then holds the full sum.
        const int send_idx = ((rank_ - s - 1) % size_ + size_) % size_;
        const int recv_idx = ((rank_ - s - 2) % size_ + size_) % size_;
        const size_t slo = at[send_idx], scount = counts[send_idx];
        const size_t rlo = at[recv_idx], rcount = counts[recv_idx];
        if (scount) out->send(right, kReduceScatterSlot, slo * sizeof(float), scount * sizeof(float));
        if (rcount) {
          tmp->recv(left, kReduceScatterSlot, 0, rcount * sizeof(float));
          tmp->waitRecv(timeout_);
          float* dst = buf + rlo;
          const float* src = scratch_.data();
          for (size_t i = 0; i < rcount; i++) dst[i] += src[i];
        }
        if (scount) out->waitSend(timeout_);
      }
    });
    if (op == ReduceOp::Avg) scale(buf + at[rank_], counts[rank_]);
  }

  void all_gather(float* buf, size_t n) override {
    if (size_ == 1 || n == 0) return;
    quiesce();
    guarded("all_gather", n, [&] {
      std::vector<size_t> counts(size_);
      for (int r = 0; r < size_; r++) counts[r] = shard_hi(n, r) - shard_lo(n, r);
      gloo::AllgathervOptions opts(ctx_);
      opts.setOutput(buf, counts);
      opts.setTimeout(timeout_);
      gloo::allgatherv(opts);
    });
  }

  void broadcast(float* buf, size_t n, int root) override {
    if (root < 0 || root >= size_)
      throw DistError("broadcast: root " + std::to_string(root) + " is outside 0.." + std::to_string(size_ - 1));
    if (size_ == 1 || n == 0) return;
    quiesce();
    guarded("broadcast", n, [&] {
      gloo::BroadcastOptions opts(ctx_);
      opts.setOutput(buf, n);
      opts.setRoot(root);
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  void barrier() override {
    if (size_ == 1) return;
    quiesce();
    guarded("barrier", 0, [&] {
      gloo::BarrierOptions opts(ctx_);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  friend class GlooBuckets;
  void quiesce();  // wait until the live GlooBuckets (if any) has no work queued or running

  void scale(float* p, size_t n) const {
    const float f = 1.0f / float(size_);
    for (size_t i = 0; i < n; i++) p[i] *= f;
  }

  template <typename F>
  void guarded(const char* op, size_t n, F&& fn) {
    if (broken_) throw DistError(std::string(op) + " on rank " + std::to_string(rank_) + ": " + broken_msg_);
    try {
      fn();
    } catch (const std::exception& e) {
      std::ostringstream s;
      s << op << " of " << n << " floats failed on rank " << rank_ << " of " << size_ << ": " << e.what()
        << " (another rank exited, crashed or stopped responding for longer than the timeout of "
        << timeout_.count() / 1000.0 << " s)";
      broken_ = true;
      broken_msg_ = "the process group is broken by an earlier failure: " + s.str();
      throw DistError(s.str());
    }
  }

  int rank_, size_;
  std::unique_ptr<TcpStore> store_;  // kept: rank 0 serves it for as long as the group lives
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> ctx_;
  std::vector<float> scratch_;
  bool broken_ = false;  // written by whichever thread runs a collective; the queue's mutex orders the two
  std::string broken_msg_;
  GlooBuckets* buckets_ = nullptr;  // the live bucket allreduce, if any
};

class GlooBuckets final : public BucketAllreduce {
 public:
  GlooBuckets(GlooComm& comm, float* buf, size_t n) : c_(comm), buf_(buf), n_(n) {
    if (c_.buckets_) throw DistError("bucket_allreduce: this process group already has a live one (one overlapped gradient "
                                         "allreduce per group: one DataParallel with overlap per Comm)");
    if (c_.size_ > 1) worker_ = std::thread([this] { run(); });
    c_.buckets_ = this;
  }
  ~GlooBuckets() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;  // groups still queued are dropped; the one in flight ends within the timeout
    }
    work_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    c_.buckets_ = nullptr;
  }

  void enqueue(const std::vector<std::pair<size_t, size_t>>& ranges) override {
    size_t values = 0;
    for (auto& [lo, hi] : ranges) {
      if (lo > hi || hi > n_)
        throw std::invalid_argument("bucket_allreduce: range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                    ") is outside the buffer of " + std::to_string(n_) + " values");
      values += hi - lo;
    }
    stats_.groups++, stats_.ranges += ranges.size(), stats_.values += values;
    if (c_.size_ == 1 || values == 0) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(ranges);
    }
    work_cv_.notify_one();
  }

  void finish() override {
    std::exception_ptr err;
    {
      std::unique_lock<std::mutex> lk(mu_);
      idle_cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
      stats_.finishes++;
      std::swap(err, error_);
    }
    if (err) std::rethrow_exception(err);
  }

  void drain() {  // finish() without rethrowing: the failure stays for finish() (and broke the group)
    std::unique_lock<std::mutex> lk(mu_);
    idle_cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
  }

 private:
  void run() {
    for (;;) {
      std::vector<std::pair<size_t, size_t>> group;
      bool skip;
      {
        std::unique_lock<std::mutex> lk(mu_);
        work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        group = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
        skip = stop_ || error_;  // after a failure the group is broken: drop the rest, finish() reports it
      }
      if (!skip) {
        try {
          reduce(group);
        } catch (...) {
          std::lock_guard<std::mutex> lk(mu_);
          if (!error_) error_ = std::current_exception();
        }
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        busy_ = false;
      }
      idle_cv_.notify_all();
    }
  }

  // One group, one allreduce (sum) then * 1/size: the same arithmetic per value as GlooComm::allreduce(Avg)
  // of the whole buffer. Ranges are packed into the staging buffer (and unpacked), unless they form one
  // contiguous range (wte + wpe, lnfw + lnfb), which is reduced in place.
  void reduce(const std::vector<std::pair<size_t, size_t>>& ranges) {
    std::vector<std::pair<size_t, size_t>> group;
    size_t total = 0;
    for (auto& r : ranges) {
      if (r.first == r.second) continue;
      total += r.second - r.first;
      if (!group.empty() && group.back().second == r.first) group.back().second = r.second;
      else group.push_back(r);
    }
    float* data = buf_ + group.front().first;
    if (group.size() > 1) {
      if (staging_.size() < total) staging_.resize(total);
      data = staging_.data();
      float* s = data;
      for (auto& [lo, hi] : group) {
        std::memcpy(s, buf_ + lo, (hi - lo) * sizeof(float));
        s += hi - lo;
      }
    }
    c_.guarded("overlapped gradient allreduce", total, [&] {
      gloo::AllreduceOptions opts(c_.ctx_);
      opts.setOutput(data, total);
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setTimeout(c_.timeout_);
      gloo::allreduce(opts);
    });
    const float f = 1.0f / float(c_.size_);
    const float* s = data;
    for (auto& [lo, hi] : group) {
      float* d = buf_ + lo;
      for (size_t i = 0; i < hi - lo; i++) d[i] = s[i] * f;
      s += hi - lo;
    }
  }

  GlooComm& c_;
  float* buf_;
  size_t n_;
  std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<std::vector<std::pair<size_t, size_t>>> queue_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::vector<float> staging_;  // the worker's only
  std::thread worker_;
};

void GlooComm::quiesce() {
  if (buckets_) buckets_->drain();
}

std::unique_ptr<BucketAllreduce> GlooComm::bucket_allreduce(float* buf, size_t n, void* /*stream*/) {
  return std::make_unique<GlooBuckets>(*this, buf, n);
}

}  // namespace

std::unique_ptr<Comm> make_gloo_comm(const RendezvousOptions& opts) { return std::make_unique<GlooComm>(opts); }

#else  // !GPT2CORE_HAS_GLOO

bool have_gloo() { return false; }

std::unique_ptr<Comm> make_gloo_comm(const RendezvousOptions&) {
  throw DistError("this build of gpt2core has no Gloo: CPU multi-process training needs it. Install it "
                  "(Debian/Ubuntu: apt-get install libgloo-dev) and reinstall gpt2core from source");
}

#endif

}  // namespace gpt2::dist
