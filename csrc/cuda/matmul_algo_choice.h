// The choice of a matmul algorithm among a library's candidates, once per problem: plain C++ (no CUDA), so the
// policy is tested on the CPU with made-up timings (tests/csrc/cuda/test_matmul_algo_choice.py); the cuBLASLt
// seam (seams_cublaslt.cu) supplies the candidates (its heuristic, best first) and the timer (CUDA events).
//
// Policy: a problem's first call gets the candidates. Not tuning (the caller's choice, MatmulParams::tune): the
// first (the heuristic's preference), cached, nothing timed. Tuning: when timing is possible (a GPU, the stream not capturing a
// CUDA graph) each candidate is timed and the fastest is cached for the problem, ties going to the earlier
// (the heuristic's preference); a candidate whose timing failed (time < 0 or NaN) is never chosen. When timing is
// not possible the first candidate is used and nothing is cached, so a later call that can time still chooses
// (the model's first, uncaptured step warms the cache before a graph is captured). A single candidate, or all
// timings failed: the first, cached only in the single-candidate case (a failing one should fail for real).
#pragma once
#include <cstddef>
#include <map>
#include <optional>
#include <vector>

namespace gpt2core::seams {

// Index of the smallest valid time (>= 0; NaN and negative mean "failed"), the earliest among equals; -1 if none.
inline int fastest(const std::vector<float>& times_ms) {
  int best = -1;
  for (size_t i = 0; i < times_ms.size(); i++) {
    const float t = times_ms[i];
    if (!(t >= 0.0f)) continue;  // NaN or negative
    if (best < 0 || t < times_ms[size_t(best)]) best = int(i);
  }
  return best;
}

template <class Key, class Algo>
class AlgoChoice {
 public:
  // The algorithm for key. candidates() -> std::vector<Algo> (best first; empty: none exists) is called only when
  // key has no cached choice; time(const Algo&) -> float milliseconds (< 0: that candidate failed) only when
  // tune and can_time and there are two or more candidates. nullopt when there is no candidate. Keys of tuned and
  // untuned calls must differ (the caller puts tune in the key).
  template <class Candidates, class Time>
  std::optional<Algo> choose(const Key& key, bool tune, bool can_time, Candidates candidates, Time time) {
    if (auto it = chosen_.find(key); it != chosen_.end()) return it->second;
    const std::vector<Algo> c = candidates();
    if (c.empty()) return std::nullopt;
    if (c.size() == 1 || !tune) return chosen_.emplace(key, c[0]).first->second;
    if (!can_time) return c[0];
    std::vector<float> times;
    times.reserve(c.size());
    for (const Algo& a : c) times.push_back(time(a));
    const int best = fastest(times);
    if (best < 0) return c[0];
    return chosen_.emplace(key, c[size_t(best)]).first->second;
  }
  size_t size() const { return chosen_.size(); }

 private:
  std::map<Key, Algo> chosen_;
};

}  // namespace gpt2core::seams
