// algo_choice.cpp: csrc/cuda/matmul_algo_choice.h's policy with made-up candidates and timings, no GPU.
// Prints one line per failed check and "checks N failed F"; exit status 1 if any failed.
// Run by tests/csrc/cuda/test_matmul_algo_choice.py.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/matmul_algo_choice.h"

using gpt2core::seams::AlgoChoice;
using gpt2core::seams::fastest;

static int checks = 0, failed = 0;
#define CHECK(cond)                                             \
  do {                                                          \
    checks++;                                                   \
    if (!(cond)) {                                              \
      failed++;                                                 \
      std::printf("FAILED line %d: %s\n", __LINE__, #cond);     \
    }                                                           \
  } while (0)

int main() {
  const float nan = std::nanf("");
  // fastest: the smallest valid time, the earliest among equals, failures (negative, NaN) skipped
  CHECK(fastest({}) == -1);
  CHECK(fastest({-1.0f, nan}) == -1);
  CHECK(fastest({3.0f, 1.0f, 2.0f}) == 1);
  CHECK(fastest({2.0f, 1.0f, 1.0f}) == 1);
  CHECK(fastest({nan, 5.0f, -1.0f, 4.0f}) == 3);
  CHECK(fastest({0.0f, 1.0f}) == 0);

  // candidates are strings; timings come from a table; every call to either is counted
  std::vector<std::string> cands = {"heur0", "heur1", "heur2"};
  std::vector<float> table = {2.0f, 0.5f, 1.0f};
  int asked = 0, timed = 0;
  auto candidates = [&] { asked++; return cands; };
  auto time = [&](const std::string& a) {
    timed++;
    for (size_t i = 0; i < cands.size(); i++)
      if (cands[i] == a) return table[i];
    return -1.0f;
  };
  AlgoChoice<int, std::string> ch;

  // can time: the fastest, each candidate timed once, then cached (no more questions, no more timing)
  CHECK(ch.choose(1, true, true, candidates, time) == std::string("heur1"));
  CHECK(asked == 1 && timed == 3);
  table = {0.1f, 9.0f, 9.0f};  // a later, different timing does not change a cached choice
  CHECK(ch.choose(1, true, true, candidates, time) == std::string("heur1"));
  CHECK(asked == 1 && timed == 3 && ch.size() == 1);

  // cannot time (a graph capturing): the heuristic's first, not cached; a later call that can time chooses
  asked = timed = 0;
  CHECK(ch.choose(2, true, false, candidates, time) == std::string("heur0"));
  CHECK(asked == 1 && timed == 0 && ch.size() == 1);
  table = {3.0f, 2.0f, 1.0f};
  CHECK(ch.choose(2, true, true, candidates, time) == std::string("heur2"));
  CHECK(asked == 2 && timed == 3 && ch.size() == 2);
  CHECK(ch.choose(2, true, false, candidates, time) == std::string("heur2"));  // cached: capture replays the winner
  CHECK(asked == 2 && timed == 3);

  // a failed timing is never chosen; all failed: the first, not cached
  asked = timed = 0;
  table = {-1.0f, nan, 4.0f};
  CHECK(ch.choose(3, true, true, candidates, time) == std::string("heur2"));
  table = {-1.0f, nan, -1.0f};
  CHECK(ch.choose(4, true, true, candidates, time) == std::string("heur0"));
  CHECK(ch.size() == 3);
  table = {5.0f, 1.0f, 5.0f};
  CHECK(ch.choose(4, true, true, candidates, time) == std::string("heur1"));

  // one candidate: no timing, cached even when timing is impossible; none: nullopt, nothing cached
  asked = timed = 0;
  cands = {"only"};
  CHECK(ch.choose(5, true, false, candidates, time) == std::string("only"));
  CHECK(timed == 0 && ch.size() == 5);
  cands = {};
  CHECK(!ch.choose(6, true, true, candidates, time).has_value());
  CHECK(ch.size() == 5 && timed == 0);

  // ties go to the heuristic's earlier candidate
  cands = {"a", "b", "c"};
  table = {1.0f, 1.0f, 1.0f};
  CHECK(ch.choose(7, true, true, candidates, time) == std::string("a"));

  // not tuning (the default): the heuristic's first, never timed, cached even when timing is possible
  asked = timed = 0;
  cands = {"h0", "h1", "h2"};
  table = {9.0f, 0.1f, 5.0f};
  CHECK(ch.choose(8, false, true, candidates, time) == std::string("h0"));
  CHECK(ch.choose(8, false, true, candidates, time) == std::string("h0"));
  CHECK(asked == 1 && timed == 0 && ch.size() == 7);
  CHECK(ch.choose(9, false, false, candidates, time) == std::string("h0"));  // capturing: the same first
  CHECK(asked == 2 && timed == 0 && ch.size() == 8);

  std::printf("checks %d failed %d\n", checks, failed);
  return failed ? 1 : 0;
}
