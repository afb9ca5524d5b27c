// Token sampling: the distribution and the random numbers, the same for every backend (python/gpt2core/model/engine.py
// holds the numpy reference of both: sample_distribution / sample_reference and uniform).
//
// For one row of logits z (V values) and a SampleRow:
//   greedy (temperature 0 or top_k 1): the arg max, lowest id on ties;
//   else z / temperature; the top_k largest kept (0: all; ties towards the lower id), softmax over them (double);
//   then, sorted by decreasing probability (lower id first on ties), the shortest prefix whose probability sum
//   reaches top_p * total (top_p >= 1: all); the id is the inverse CDF over that prefix at u * (its sum), where
//   u = sample_uniform(seed, stream, step) in [0, 1).
// Reproducible: the id depends on the logits and (seed, stream, step) only, not on the batch or threads.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace gpt2 {

struct SampleRow {
  float temperature = 1.0f;  // 0: greedy
  int32_t top_k = 0;         // 0: all
  float top_p = 1.0f;        // 1: off
  uint64_t seed = 0, stream = 0, step = 0;
};

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A uniform number in [0, 1) from a counter-based hash: the top 53 bits of splitmix64(seed ^ splitmix64(stream *
// 0xD1B54A32D192ED03 + step)).
inline double sample_uniform(uint64_t seed, uint64_t stream, uint64_t step) {
  const uint64_t x = splitmix64(seed ^ splitmix64(stream * 0xD1B54A32D192ED03ull + step));
  return double(x >> 11) * (1.0 / 9007199254740992.0);
}

// The host implementation of the rule above over V logits of any float type (F widens to double). idx, p: scratch.
template <typename F, typename Widen>
int32_t sample_row(const F* z, int V, const SampleRow& r, Widen widen, std::vector<int32_t>& idx,
                   std::vector<double>& p) {
  if (r.temperature == 0.0f || r.top_k == 1) {
    int best = 0;
    double bv = widen(z[0]);
    for (int i = 1; i < V; i++) {
      const double v = widen(z[i]);
      if (v > bv) { bv = v; best = i; }
    }
    return best;
  }
  const double inv_t = 1.0 / double(r.temperature);
  auto before = [&](int32_t a, int32_t b) {  // higher logit first, then lower id
    const double za = widen(z[a]), zb = widen(z[b]);
    return za > zb || (za == zb && a < b);
  };
  const int k = (r.top_k > 0 && r.top_k < V) ? r.top_k : V;
  idx.resize(V);
  std::iota(idx.begin(), idx.end(), 0);
  const bool need_order = k < V || r.top_p < 1.0f;
  if (k < V) {
    std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), before);
    idx.resize(k);
  }
  if (need_order) std::sort(idx.begin(), idx.end(), before);
  double zmax = -INFINITY;
  for (int32_t i : idx) zmax = std::max(zmax, double(widen(z[i])));
  p.resize(idx.size());
  double total = 0;
  for (size_t j = 0; j < idx.size(); j++) {
    p[j] = std::exp((double(widen(z[idx[j]])) - zmax) * inv_t);
    total += p[j];
  }
  size_t m = idx.size();
  if (r.top_p < 1.0f) {  // the shortest prefix (in decreasing order) with sum >= top_p * total
    const double want = double(r.top_p) * total;
    double c = 0;
    for (size_t j = 0; j < idx.size(); j++) {
      c += p[j];
      if (c >= want) { m = j + 1; break; }
    }
    total = 0;
    for (size_t j = 0; j < m; j++) total += p[j];
  }
  const double target = sample_uniform(r.seed, r.stream, r.step) * total;
  double c = 0;
  for (size_t j = 0; j < m; j++) {
    c += p[j];
    if (c > target) return idx[j];
  }
  return idx[m - 1];
}

}  // namespace gpt2
