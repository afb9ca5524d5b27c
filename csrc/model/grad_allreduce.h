// Data parallelism overlapped with backward: the gradients of one float32 or bf16 model averaged over the ranks
// of a communicator while its backward still runs (plain data parallel; ZeRO-1 keeps one reduce-scatter after
// backward). backward() runs the model's backward with its grad-ready hook feeding a BucketAllreduce over the
// gradients (ordered after the ops that wrote them, on the backend's stream); finish() waits for all of it.
// The hook is installed for that one backward only. Depends on the communicator interface (comm/comm.h), not
// on any implementation of it.
#pragma once
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#include "comm/comm.h"
#include "model/gpt2.h"

namespace gpt2 {

class GradAllreducer {
 public:
  template <typename T>
  GradAllreducer(dist::Comm& comm, GPT2Model<T>& m)
      : buckets_(comm.bucket_allreduce(m.grads(), m.num_parameters(), m.backend().native_stream())) {
    static_assert(std::is_same_v<Master<T>, float>, "the communicators reduce float32 gradients");
    backward_ = [&m, b = buckets_.get()](float grad_scale) {
      GradReadyHook prev = m.set_grad_ready_hook([b](const GradRanges& r) { b->enqueue(r); });
      try {
        m.backward(grad_scale, /*report_grads=*/true);
      } catch (...) {
        m.set_grad_ready_hook(std::move(prev));
        throw;
      }
      m.set_grad_ready_hook(std::move(prev));
    };
  }
  void backward(float grad_scale) { backward_(grad_scale); }
  void finish() { buckets_->finish(); }
  dist::BucketAllreduce::Stats stats() const { return buckets_->stats(); }

 private:
  std::unique_ptr<dist::BucketAllreduce> buckets_;
  std::function<void(float)> backward_;
};

}  // namespace gpt2
