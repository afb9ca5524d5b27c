// ZeRO-2: the gradients of one float32 / bf16 / fp16 model reduce-scattered over the ranks of a communicator bucket
// by bucket while backward runs, so that no rank ever holds more than its shard of the gradients plus the buckets
// in flight (GPT2Model::set_grad_shard). run(fn) runs fn (the model's forward_backward or backward) with the model's
// bucket hook set: each bucket (the head's, then each layer's from the last one down, then the embeddings') is
// averaged over the ranks with one reduce_scatter_v whose pieces are the bucket's parts in each rank's ZeRO shard,
// and this rank's piece is folded into its shard (GPT2Model::accumulate_grad_shard) before backward reuses the bucket.
//
// Which bits: every value is averaged by the same owner, in the same order, as ZeRO-1's one reduce-scatter of the
// full gradient buffer (Comm::reduce_scatter_v), so one micro-step per optimizer step gives ZeRO-1's gradients bit
// for bit. With gradient accumulation the shard is the sum over micro-steps of each micro-step's average over ranks
// (as DeepSpeed's ZeRO-2), where ZeRO-0/1 average the sum over micro-steps: the same real number, rounded in
// another order (tests/python/test_zero2.py checks both: the bits against the sum in that order, the value
// against ZeRO-1 to fp32 tolerance).
// The collective of each bucket is blocking (the next bucket's backward waits for it): the buckets are what
// overlap in memory, not in time. Depends on the communicator interface (comm/comm.h), not on an implementation.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "model/gpt2.h"

namespace gpt2 {

class GradReduceScatterer {
 public:
  struct Stats {
    size_t backwards = 0, buckets = 0, values = 0;
    double seconds = 0;  // in the bucket hook (the collectives and the folding in), the backward's ops apart
  };

  template <typename T>
  GradReduceScatterer(dist::Comm& comm, GPT2Model<T>& m) {
    static_assert(std::is_same_v<Master<T>, float>, "the communicators reduce float32 gradients");
    const size_t n = m.num_parameters();
    const int world = comm.size(), rank = comm.rank();
    if (!m.grad_sharded() || m.grad_shard_lo() != comm.shard_lo(n, rank) ||
        m.grad_shard_hi() != comm.shard_hi(n, rank))
      throw std::invalid_argument("GradReduceScatterer: the model's gradient shard must be this rank's ZeRO shard [" +
                                  std::to_string(comm.shard_lo(n, rank)) + ", " +
                                  std::to_string(comm.shard_hi(n, rank)) + "): call set_grad_shard first");
    // the bucket hook: reduce-scatter the bucket, fold this rank's piece into the shard
    hook_ = [&comm, &m, n, world, rank, this](float* bucket, const GradRanges& ranges) {
      const auto t0 = std::chrono::steady_clock::now();
      // ranges are in flat order and packed back to back, so each rank's part of the bucket is one run
      std::vector<size_t> counts(size_t(world), 0);
      size_t total = 0;
      for (const auto& [lo, hi] : ranges) {
        total += hi - lo;
        for (int r = 0; r < world; r++) {
          const size_t a = std::max(lo, comm.shard_lo(n, r)), b = std::min(hi, comm.shard_hi(n, r));
          if (a < b) counts[size_t(r)] += b - a;
        }
      }
      comm.reduce_scatter_v(bucket, counts, dist::ReduceOp::Avg);
      size_t at = 0;
      for (int r = 0; r < rank; r++) at += counts[size_t(r)];
      const size_t mine_lo = comm.shard_lo(n, rank), mine_hi = comm.shard_hi(n, rank);
      for (const auto& [lo, hi] : ranges) {
        const size_t a = std::max(lo, mine_lo), b = std::min(hi, mine_hi);
        if (a >= b) continue;
        m.accumulate_grad_shard(bucket + at, a, b - a);
        at += b - a;
      }
      stats_.buckets++;
      stats_.values += total;
      stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    // fn (the model's backward, or its forward_backward) with the hook installed, the previous one back afterwards
    with_hook_ = [&m, this](const std::function<void()>& fn) {
      auto prev = m.set_grad_bucket_hook(hook_);
      try {
        fn();
      } catch (...) {
        m.set_grad_bucket_hook(std::move(prev));
        throw;
      }
      m.set_grad_bucket_hook(std::move(prev));
      stats_.backwards++;
    };
  }
  // fn with the bucket hook installed: fn runs the model's backward or forward_backward (DataParallel runs the
  // fused micro-step this way, as ZeRO-0/1 do)
  void run(const std::function<void()>& fn) { with_hook_(fn); }
  Stats stats() const { return stats_; }

 private:
  std::function<void(float*, const GradRanges&)> hook_;
  std::function<void(const std::function<void()>&)> with_hook_;
  Stats stats_;
};

}  // namespace gpt2
