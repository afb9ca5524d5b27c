// runtime.cpp: the emulator's scheduler (blocks on OS threads, CUDA threads as fibers), its barrier
// and warp-collective semantics, and the CUDA runtime API subset. See cuda_emu.h for the contract.
#include "emu/cuda_emu.h"
#include "emu/fiber.h"
#include "emu/racecheck.h"
#include "emu/runtime_internal.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define GPT2EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GPT2EMU_ASAN 1
#endif
#endif
#if defined(GPT2EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

extern "C" const int warpSize = 32;

namespace gpt2emu {
namespace detail {

__thread ThreadState* t_thread = nullptr;
#if defined(GPT2CORE_EMU_SANITIZE)
ThreadState* current_thread() { return t_thread; }
#endif

namespace {

// ---------------------------------------------------------------------------------- configuration
// Fwd / Rev / Random: every runnable thread runs once before any runs again (warps advance in lock-step).
// Low / High / Ahead: the runnable thread of highest priority runs until it blocks, so its warp runs ahead
// of the others up to the next __syncthreads: priority by thread index (lowest / highest first) or a random
// order of warps (and of lanes in a warp), drawn again at every __syncthreads.
enum class Sched { Fwd, Rev, Random, Low, High, Ahead };
struct Schedule {
  Sched kind = Sched::Fwd;
  uint64_t seed = 0;
};

std::mutex g_config_mutex;
bool g_config_read = false;
Schedule g_sched;
std::string g_trace_path;
std::string g_launch_log_path;
int g_nthreads = 1;
size_t g_stack_bytes = 0;

bool parse_schedule(const char* s, Schedule* out) {
  std::string v = s ? s : "";
  if (v.empty() || v == "fwd") {
    *out = {Sched::Fwd, 0};
  } else if (v == "rev") {
    *out = {Sched::Rev, 0};
  } else if (v == "low") {
    *out = {Sched::Low, 0};
  } else if (v == "high") {
    *out = {Sched::High, 0};
  } else if (v.rfind("random", 0) == 0 || v.rfind("ahead", 0) == 0) {
    const size_t n = v[0] == 'r' ? 6 : 5;
    uint64_t seed = 0;
    if (v.size() > n) {
      if (v[n] != ':') return false;
      char* end = nullptr;
      seed = strtoull(v.c_str() + n + 1, &end, 10);
      if (!end || *end) return false;
    }
    *out = {v[0] == 'r' ? Sched::Random : Sched::Ahead, seed};
  } else {
    return false;
  }
  return true;
}

void read_config_locked() {
  if (g_config_read) return;
  g_config_read = true;
  if (!parse_schedule(getenv("GPT2CORE_EMU_SCHED"), &g_sched)) {
    fprintf(stderr, "gpt2core emu: ignoring bad GPT2CORE_EMU_SCHED='%s' (want fwd, rev, random:<seed>, low, high or "
            "ahead:<seed>)\n",
            getenv("GPT2CORE_EMU_SCHED"));
    g_sched = {};
  }
  if (const char* t = getenv("GPT2CORE_EMU_TRACE")) g_trace_path = t;
  if (const char* t = getenv("GPT2CORE_EMU_LAUNCH_LOG")) g_launch_log_path = t;
  unsigned hw = std::thread::hardware_concurrency();
  g_nthreads = static_cast<int>(std::min(8u, std::max(1u, hw)));
  if (const char* n = getenv("GPT2CORE_EMU_THREADS")) g_nthreads = std::max(1, atoi(n));
#if defined(GPT2EMU_ASAN)
  size_t kb = 256;  // ASan's redzones and fake frames make frames much larger
#else
  size_t kb = 64;
#endif
  if (const char* s = getenv("GPT2CORE_EMU_STACK_KB")) kb = std::max<size_t>(16, strtoull(s, nullptr, 10));
  g_stack_bytes = kb * 1024;
}

uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// ---------------------------------------------------------------------------------- blocks and fibers
enum class St : uint8_t { Ready, Running, WaitBar, WaitWarp, Done };

const char* warp_op_name(WarpOp op) {
  switch (op) {
    case WarpOp::ShflIdx: return "__shfl_sync";
    case WarpOp::ShflUp: return "__shfl_up_sync";
    case WarpOp::ShflDown: return "__shfl_down_sync";
    case WarpOp::ShflXor: return "__shfl_xor_sync";
    case WarpOp::Ballot: return "__ballot_sync";
    case WarpOp::Any: return "__any_sync";
    case WarpOp::All: return "__all_sync";
    case WarpOp::Sync: return "__syncwarp";
    case WarpOp::ReduceAdd: return "__reduce_add_sync";
    case WarpOp::ReduceMin: return "__reduce_min_sync";
    case WarpOp::ReduceMax: return "__reduce_max_sync";
    case WarpOp::ReduceAnd: return "__reduce_and_sync";
    case WarpOp::ReduceOr: return "__reduce_or_sync";
    case WarpOp::ReduceXor: return "__reduce_xor_sync";
  }
  return "?";
}

struct Block;

struct Fiber {
  ThreadState ts;
  Block* blk = nullptr;
  int tid = 0;  // linear thread index in the block
  St st = St::Ready;
  fiber::Context ctx;
  char* stack_lo = nullptr;
  size_t stack_size = 0;
  void* asan_fake = nullptr;
  // where it waits
  const char* file = nullptr;
  int line = 0;
  // __syncthreads
  BarrierOp bar_op = BarrierOp::Sync;
  int pred = 0, bar_result = 0;
  // warp collective
  WarpOp op = WarpOp::Sync;
  unsigned mask = 0;
  int arg = 0, width = 32;
  bool is_signed = false;
  size_t size = 0;
  alignas(16) unsigned char in[16];
  alignas(16) unsigned char out[16];
  // cp.async copies in flight (issue order) and the number of groups committed so far (emu/cuda_emu.h)
  struct AsyncCopy {
    unsigned char* dst;
    int bytes;
    uint32_t group;  // the group it belongs to: the count of committed groups when it was issued
    const void* pc;
    alignas(16) unsigned char data[16];
  };
  std::vector<AsyncCopy> async;
  uint32_t async_groups = 0;
};

struct Job;

struct Block {
  const KernelLaunch* L = nullptr;
  Job* job = nullptr;
  uint3 bidx{};
  int n = 0;
  Fiber* f = nullptr;
  std::deque<int> ready;       // Fwd / Rev / Random: runnable threads in run order
  uint64_t ready_bits[16];     // Low / High / Ahead: runnable threads by priority rank (bit r = rank r)
  uint16_t rank[1024], by_rank[1024];
  int done = 0, at_bar = 0;
  // per warp (at most 32 per block), bit l = lane l
  unsigned warp_exists[32];
  unsigned warp_done[32];
  unsigned warp_waiting[32];  // lanes blocked in a warp collective
  bool failed = false;
  std::string err;
  Schedule sched;
  std::mt19937_64 rng;
  unsigned char* smem = nullptr;
};

struct Worker {  // per OS thread
  std::vector<Fiber> fibers;
  fiber::Context sched_ctx;
  Block* blk = nullptr;
  Fiber* running = nullptr;
  unsigned char* smem = nullptr;
  size_t smem_cap = 0;
  size_t stack_bytes = 0;
  bool stacks_dirty = false;
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  void* sched_fake = nullptr;
};
thread_local Worker* t_worker = nullptr;

Worker& worker() {
  if (!t_worker) t_worker = new Worker();  // lives as long as its thread; never freed
  return *t_worker;
}

// ---- switching, annotated for ASan
void switch_to_fiber(Worker& w, Fiber& f) {
#if defined(GPT2EMU_ASAN)
  __sanitizer_start_switch_fiber(&w.sched_fake, f.stack_lo, f.stack_size);
#endif
  fiber::swap(w.sched_ctx, f.ctx);
#if defined(GPT2EMU_ASAN)
  __sanitizer_finish_switch_fiber(w.sched_fake, nullptr, nullptr);
#endif
}

// From a fiber back to its block's scheduler. `final` when the fiber will never be resumed.
void switch_to_scheduler(Fiber& f, bool final) {
  Worker& w = worker();
#if defined(GPT2EMU_ASAN)
  __sanitizer_start_switch_fiber(final ? nullptr : &f.asan_fake, w.sched_stack_bottom, w.sched_stack_size);
#else
  (void)final;
#endif
  fiber::swap(f.ctx, w.sched_ctx);
#if defined(GPT2EMU_ASAN)
  __sanitizer_finish_switch_fiber(f.asan_fake, nullptr, nullptr);
#endif
}

std::string vformat(const char* fmt, va_list ap) {
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}

std::string where(const Block& b, const Fiber& f) {
  char buf[512];
  snprintf(buf, sizeof buf, "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u)", b.L->name, b.bidx.x, b.bidx.y,
           b.bidx.z, f.ts.thread_idx.x, f.ts.thread_idx.y, f.ts.thread_idx.z);
  return buf;
}

// Records an error for thread `f` of block `b` (from the scheduler or from a fiber).
void block_error(Block& b, const Fiber& f, const char* fmt, ...) {
  if (b.failed) return;
  va_list ap;
  va_start(ap, fmt);
  b.err = where(b, f) + ": " + vformat(fmt, ap);
  va_end(ap);
  b.failed = true;
}

// Called on a fiber after block_error: gives control back for good (the block is abandoned).
[[noreturn]] void abandon(Fiber& f) {
  switch_to_scheduler(f, true);
  __builtin_unreachable();
}

bool run_ahead(const Block& b) { return b.sched.kind >= Sched::Low; }

// Priority ranks for the run-ahead schedules: thread order, reversed, or a random order of warps with a
// random order of lanes in each.
void draw_ranks(Block& b) {
  if (b.sched.kind != Sched::Ahead) {
    for (int i = 0; i < b.n; ++i) b.rank[i] = static_cast<uint16_t>(b.sched.kind == Sched::Low ? i : b.n - 1 - i);
  } else {
    const int nw = (b.n + 31) / 32;
    int warps[32], lanes[32];
    for (int w = 0; w < nw; ++w) warps[w] = w;
    std::shuffle(warps, warps + nw, b.rng);
    int r = 0;
    for (int k = 0; k < nw; ++k) {
      const int w = warps[k], nl = std::min(32, b.n - 32 * w);
      for (int l = 0; l < nl; ++l) lanes[l] = l;
      std::shuffle(lanes, lanes + nl, b.rng);
      for (int l = 0; l < nl; ++l) b.rank[32 * w + lanes[l]] = static_cast<uint16_t>(r++);
    }
  }
  for (int i = 0; i < b.n; ++i) b.by_rank[b.rank[i]] = static_cast<uint16_t>(i);
}

void enqueue_sorted(Block& b, const int* ids, int n) {  // ids ascending
  if (run_ahead(b)) {
    for (int k = 0; k < n; ++k) {
      b.f[ids[k]].st = St::Ready;
      b.ready_bits[b.rank[ids[k]] / 64] |= uint64_t(1) << (b.rank[ids[k]] % 64);
    }
  } else if (b.sched.kind == Sched::Rev) {
    for (int k = n - 1; k >= 0; --k) {
      b.f[ids[k]].st = St::Ready;
      b.ready.push_back(ids[k]);
    }
  } else {
    for (int k = 0; k < n; ++k) {
      b.f[ids[k]].st = St::Ready;
      b.ready.push_back(ids[k]);
    }
  }
}

bool any_ready(const Block& b) {
  if (!run_ahead(b)) return !b.ready.empty();
  for (uint64_t w : b.ready_bits)
    if (w) return true;
  return false;
}

int pick(Block& b) {
  if (run_ahead(b)) {
    for (int k = 0;; ++k) {
      if (!b.ready_bits[k]) continue;
      const int r = 64 * k + __builtin_ctzll(b.ready_bits[k]);
      b.ready_bits[k] &= b.ready_bits[k] - 1;
      return b.by_rank[r];
    }
  }
  size_t k = 0;
  if (b.sched.kind == Sched::Random && b.ready.size() > 1) {
    k = std::uniform_int_distribution<size_t>(0, b.ready.size() - 1)(b.rng);
    std::swap(b.ready[0], b.ready[k]);
  }
  int i = b.ready.front();
  b.ready.pop_front();
  return i;
}

// ---- warp collectives
// PTX shfl.sync source lane (mode, b, c) with c = ((32 - width) << 8) | clamp; returns -1 when the
// lane reads its own value.
int shfl_source(WarpOp op, int lane, int b, int width) {
  const int segmask = (32 - width) & 31;
  const int bval = b & 31;
  const int cval = op == WarpOp::ShflUp ? 0 : 31;
  const int max_lane = (lane & segmask) | (cval & ~segmask);
  const int min_lane = lane & segmask;
  int j = lane;
  bool ok = false;
  switch (op) {
    case WarpOp::ShflUp: j = lane - bval; ok = j >= max_lane; break;
    case WarpOp::ShflDown: j = lane + bval; ok = j <= max_lane; break;
    case WarpOp::ShflXor: j = lane ^ bval; ok = j <= max_lane; break;
    default: j = min_lane | (bval & ~segmask); ok = j <= max_lane; break;
  }
  return ok ? j : -1;
}

template <class T>
void reduce_typed(WarpOp op, Fiber* const* lanes, int nl, void* out) {
  T acc;
  memcpy(&acc, lanes[0]->in, sizeof(T));
  for (int i = 1; i < nl; ++i) {
    T v;
    memcpy(&v, lanes[i]->in, sizeof(T));
    switch (op) {
      case WarpOp::ReduceAdd: acc = T(acc + v); break;
      case WarpOp::ReduceMin: acc = std::min(acc, v); break;
      case WarpOp::ReduceMax: acc = std::max(acc, v); break;
      case WarpOp::ReduceAnd: acc = T(acc & v); break;
      case WarpOp::ReduceOr: acc = T(acc | v); break;
      case WarpOp::ReduceXor: acc = T(acc ^ v); break;
      default: break;
    }
  }
  memcpy(out, &acc, sizeof(T));
}

// Called when every lane named in f's mask waits in a warp collective: checks that they all wait in
// the same one (same operation, mask and width), computes each lane's result and makes them runnable.
// Returns false (with the block failed) on a semantic error.
bool complete_warp(Block& b, Fiber& f) {
  const int warp = f.tid / 32, base = warp * 32;
  Fiber* lanes[32];
  int lane_of[32], ids[32];
  int nl = 0;
  for (unsigned m = f.mask; m; m &= m - 1) {
    const int l = __builtin_ctz(m);
    Fiber& g = b.f[base + l];
    if (g.op != f.op || g.mask != f.mask || g.size != f.size || g.width != f.width) {
      block_error(b, f, "%s (%s:%d) with mask 0x%08x meets lane %d in %s (%s:%d) with mask 0x%08x",
                  warp_op_name(f.op), f.file, f.line, f.mask, l, warp_op_name(g.op), g.file, g.line, g.mask);
      return false;
    }
    lanes[nl] = &g;
    lane_of[nl] = l;
    ids[nl] = g.tid;
    ++nl;
  }
  switch (f.op) {
    case WarpOp::ShflIdx: case WarpOp::ShflUp: case WarpOp::ShflDown: case WarpOp::ShflXor:
      for (int i = 0; i < nl; ++i) {
        Fiber& g = *lanes[i];
        int j = shfl_source(f.op, lane_of[i], g.arg, g.width);
        if (j < 0) j = lane_of[i];
        if (!(f.mask >> j & 1u)) {
          block_error(b, g, "%s (%s:%d) reads lane %d, which is not in mask 0x%08x", warp_op_name(f.op), g.file,
                      g.line, j, f.mask);
          return false;
        }
        memcpy(g.out, b.f[base + j].in, g.size);
      }
      break;
    case WarpOp::Ballot: case WarpOp::Any: case WarpOp::All: {
      unsigned bits = 0;
      for (int i = 0; i < nl; ++i) {
        int p;
        memcpy(&p, lanes[i]->in, sizeof p);
        if (p) bits |= 1u << lane_of[i];
      }
      for (int i = 0; i < nl; ++i) {
        int r = f.op == WarpOp::Any ? bits != 0 : f.op == WarpOp::All ? bits == f.mask : 0;
        if (f.op == WarpOp::Ballot) memcpy(lanes[i]->out, &bits, 4);
        else memcpy(lanes[i]->out, &r, 4);
      }
      break;
    }
    case WarpOp::Sync:
      race::syncwarp(warp);
      break;
    default: {  // integer reductions
      unsigned char res[16];
      if (f.is_signed) reduce_typed<int>(f.op, lanes, nl, res);
      else reduce_typed<unsigned>(f.op, lanes, nl, res);
      for (int i = 0; i < nl; ++i) memcpy(lanes[i]->out, res, f.size);
      break;
    }
  }
  b.warp_waiting[warp] &= ~f.mask;
  enqueue_sorted(b, ids, nl);
  return true;
}

// A lane that exits while warp-mates wait for it in a collective: report the waiting lane.
bool check_exit_against_warp(Block& b, Fiber& f) {
  const int warp = f.tid / 32, base = warp * 32, lane = f.tid % 32;
  b.warp_done[warp] |= 1u << lane;
  for (unsigned m = b.warp_waiting[warp]; m; m &= m - 1) {
    Fiber& g = b.f[base + __builtin_ctz(m)];
    if (g.mask >> lane & 1u) {
      block_error(b, g, "%s (%s:%d) mask 0x%08x names lane %d, which has exited", warp_op_name(g.op), g.file,
                  g.line, g.mask, lane);
      return false;
    }
  }
  return true;
}

void fiber_main(void* p) {
  Fiber& f = *static_cast<Fiber*>(p);
  Block& b = *f.blk;
#if defined(GPT2EMU_ASAN)
  Worker& w = worker();
  __sanitizer_finish_switch_fiber(nullptr, &w.sched_stack_bottom, &w.sched_stack_size);
#endif
  bool threw = false;
  try {
    b.L->invoke(b.L->ctx);
  } catch (const std::exception& e) {
    block_error(b, f, "C++ exception escaped the kernel: %s", e.what());
    threw = true;
  } catch (...) {
    block_error(b, f, "C++ exception escaped the kernel");
    threw = true;
  }
  // Leave the handler first: the C++ runtime's caught-exception stack belongs to the OS thread.
  if (threw) abandon(f);
  f.st = St::Done;
  ++b.done;
  check_exit_against_warp(b, f);
  switch_to_scheduler(f, true);
  abort();  // never resumed
}

Fiber& current_fiber(const char* what) {
  Worker* w = t_worker;
  if (!w || !w->running) {
    fprintf(stderr, "gpt2core emu: %s called outside a kernel\n", what);
    abort();
  }
  return *w->running;
}

}  // namespace

// ---------------------------------------------------------------------------------- device-side entry points
int block_barrier(BarrierOp op, int pred, const char* file, int line) {
  Fiber& f = current_fiber("__syncthreads");
  Block& b = *f.blk;
  f.st = St::WaitBar;
  f.bar_op = op;
  f.pred = pred != 0;
  f.file = file;
  f.line = line;
  ++b.at_bar;
  switch_to_scheduler(f, false);
  return f.bar_result;
}

void warp_collective(WarpOp op, unsigned mask, const void* in, void* out, size_t size, int arg, int width,
                     bool is_signed, const char* file, int line) {
  Fiber& f = current_fiber(warp_op_name(op));
  Block& b = *f.blk;
  const int lane = f.tid % 32;
  if (!(mask >> lane & 1u)) {
    block_error(b, f, "%s (%s:%d) called by lane %d, which is not in its mask 0x%08x", warp_op_name(op), file, line,
                lane, mask);
    abandon(f);
  }
  if (width < 1 || width > 32 || (width & (width - 1))) {
    block_error(b, f, "%s (%s:%d) width %d is not a power of two in [1, 32]", warp_op_name(op), file, line, width);
    abandon(f);
  }
  const int warp = f.tid / 32;
  if (mask & ~b.warp_exists[warp]) {
    block_error(b, f, "%s (%s:%d) mask 0x%08x names lane %d, which does not exist (the block has %d threads)",
                warp_op_name(op), file, line, mask, __builtin_ctz(mask & ~b.warp_exists[warp]), b.n);
    abandon(f);
  }
  if (mask & b.warp_done[warp]) {
    block_error(b, f, "%s (%s:%d) mask 0x%08x names lane %d, which has exited", warp_op_name(op), file, line, mask,
                __builtin_ctz(mask & b.warp_done[warp]));
    abandon(f);
  }
  f.st = St::WaitWarp;
  f.op = op;
  f.mask = mask;
  f.arg = arg;
  f.width = width;
  f.is_signed = is_signed;
  f.size = size;
  f.file = file;
  f.line = line;
  if (size) memcpy(f.in, in, size);
  b.warp_waiting[warp] |= 1u << lane;
  if ((b.warp_waiting[warp] & mask) == mask && !complete_warp(b, f)) abandon(f);
  switch_to_scheduler(f, false);
  if (size) memcpy(out, f.out, size);
}

unsigned char* dynamic_smem() {
  Fiber& f = current_fiber("DYNAMIC_SMEM");
  return f.blk->smem;
}

unsigned active_mask() {
  Fiber& f = current_fiber("__activemask");
  Block& b = *f.blk;
  const int base = f.tid / 32 * 32;
  unsigned m = 0;
  for (int l = 0; l < 32 && base + l < b.n; ++l)
    if (b.f[base + l].st != St::Done) m |= 1u << l;
  return m;
}

void device_trap(const char* what, const char* file, int line) {
  Fiber& f = current_fiber(what);
  block_error(*f.blk, f, "%s at %s:%d", what, file, line);
  abandon(f);
}

// ---- cp.async
void async_copy(void* dst, const void* src, int cp_size, int src_size, const void* pc) {
  Fiber& f = current_fiber("cp.async");
  Block& b = *f.blk;
  const auto fail = [&](const std::string& why) {
    block_error(b, f, "cp.async at @pc:%p@: %s", pc, why.c_str());
    abandon(f);
  };
  if (cp_size != 4 && cp_size != 8 && cp_size != 16) fail(format("copy size %d (4, 8 or 16 bytes)", cp_size));
  if (src_size < 0 || src_size > cp_size) fail(format("source size %d outside 0..%d", src_size, cp_size));
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (d % cp_size || s % cp_size)
    fail(format("%s address %p not aligned to the %d-byte copy", d % cp_size ? "shared" : "global",
                     d % cp_size ? dst : src, cp_size));
  const bool in_dynamic = b.smem && d >= reinterpret_cast<uintptr_t>(b.smem) &&
                          d + cp_size <= reinterpret_cast<uintptr_t>(b.smem) + b.L->smem;
  if (!in_dynamic && race::enabled() && !race::is_shared(dst, cp_size))
    fail(format("destination %p is not the block's shared memory", dst));
  Fiber::AsyncCopy c{static_cast<unsigned char*>(dst), cp_size, f.async_groups, pc, {}};
  if (src_size) {
    race::read_global(src, src_size, pc);
    memcpy(c.data, src, src_size);
  }
  race::async_issue(dst, cp_size, pc);
  static constexpr unsigned char kPoison[4] = {0xf7, 0xff, 0xf7, 0x7f};  // 0x7ff7fff7, as the memory checker's
  for (int i = 0; i < cp_size; ++i) c.dst[i] = kPoison[(d + i) % 4];
  f.async.push_back(c);
}

void async_commit() { ++current_fiber("cp.async.commit_group").async_groups; }

void async_wait(int n, const void* pc) {
  Fiber& f = current_fiber("cp.async.wait_group");
  if (n < 0) {  // wait_all: commit_group, then wait_group 0
    ++f.async_groups;
    n = 0;
  }
  size_t kept = 0;
  for (size_t i = 0; i < f.async.size(); ++i) {
    Fiber::AsyncCopy& c = f.async[i];
    if (c.group + uint32_t(n) < f.async_groups) {  // committed, and not among the n most recent groups: lands
      race::async_land(c.dst, c.bytes, pc);
      memcpy(c.dst, c.data, c.bytes);
    } else {
      f.async[kept++] = c;
    }
  }
  f.async.resize(kept);
}

void race::fail_running_thread(const std::string& msg) {
  Fiber& f = current_fiber("the memory checker");
  block_error(*f.blk, f, "%s", msg.c_str());
  abandon(f);
}

namespace {

// ---------------------------------------------------------------------------------- running a block
void ensure_fibers(Worker& w, int n) {
  if (w.stack_bytes != g_stack_bytes) {  // first use on this thread
    w.stack_bytes = g_stack_bytes;
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  while (static_cast<int>(w.fibers.size()) < n) {
    // vector growth would move Fibers that nobody references between blocks: fine
    w.fibers.emplace_back();
  }
  for (int i = 0; i < n; ++i) {
    Fiber& f = w.fibers[i];
    if (f.stack_lo) continue;
    const size_t total = w.stack_bytes + page;
    void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      fprintf(stderr, "gpt2core emu: cannot map fiber stacks\n");
      abort();
    }
    mprotect(m, page, PROT_NONE);  // guard page below the stack
    f.stack_lo = static_cast<char*>(m) + page;
    f.stack_size = w.stack_bytes;
  }
}

struct Job {
  const KernelLaunch* L = nullptr;
  Schedule sched;
  uint64_t launch_id = 0;
  size_t nblocks = 0;
  std::vector<uint32_t> order;  // random schedule: permutation of block indices
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mutex;
  std::string err;
};

void run_block(Worker& w, Job& job, size_t linear) {
  const KernelLaunch& L = *job.L;
  Block b;
  b.L = &L;
  b.job = &job;
  b.bidx = uint3{static_cast<unsigned>(linear % L.grid.x), static_cast<unsigned>(linear / L.grid.x % L.grid.y),
                 static_cast<unsigned>(linear / (size_t(L.grid.x) * L.grid.y))};
  b.n = static_cast<int>(L.block.x * L.block.y * L.block.z);
  b.sched = job.sched;
  b.rng.seed(mix(job.sched.seed ^ mix(job.launch_id * 0x100000001b3ull + linear)));
  ensure_fibers(w, b.n);
  b.f = w.fibers.data();
  if (L.smem) {
    // exactly the requested size, so ASan sees overflows of it, or with the memory checker's guard zone
    const size_t bytes = L.smem + (race::enabled() ? race::kSmemGuard : 0);
    if (w.smem_cap != bytes) {
      free(w.smem);
      void* m = nullptr;
      if (posix_memalign(&m, 64, bytes) != 0) {
        fprintf(stderr, "gpt2core emu: cannot allocate %zu bytes of dynamic shared memory\n", L.smem);
        abort();
      }
      w.smem = static_cast<unsigned char*>(m);
      w.smem_cap = bytes;
    }
    memset(w.smem, 0xff, L.smem);  // NaN bytes for every float type
    b.smem = w.smem;
  }
#if defined(GPT2EMU_ASAN)
  if (w.stacks_dirty) {  // frames abandoned by a failed block keep their poisoned redzones
    for (Fiber& f : w.fibers) __asan_unpoison_memory_region(f.stack_lo, f.stack_size);
    w.stacks_dirty = false;
  }
#endif
  std::vector<int> ids(b.n);
  for (int wi = 0; wi < 32; ++wi) {
    const int lanes = std::max(0, std::min(32, b.n - 32 * wi));
    b.warp_exists[wi] = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
    b.warp_done[wi] = 0;
    b.warp_waiting[wi] = 0;
  }
  for (int i = 0; i < b.n; ++i) {
    Fiber& f = b.f[i];
    f.blk = &b;
    f.tid = i;
    f.asan_fake = nullptr;
    f.ts.thread_idx = uint3{static_cast<unsigned>(i % L.block.x), static_cast<unsigned>(i / L.block.x % L.block.y),
                            static_cast<unsigned>(i / (L.block.x * L.block.y))};
    f.ts.block_idx = b.bidx;
    f.async.clear();
    f.async_groups = 0;
    f.ts.block_dim = L.block;
    f.ts.grid_dim = L.grid;
    // Stagger the stack tops so the hot frames of different fibers do not all map to the same cache sets.
    const size_t color = size_t(i % 61) * 64 + size_t(i / 61 % 4) * 4096;
    fiber::make(f.ctx, f.stack_lo, f.stack_size - color, fiber_main, &f);
    ids[i] = i;
  }
  memset(b.ready_bits, 0, sizeof b.ready_bits);
  if (run_ahead(b)) draw_ranks(b);
  enqueue_sorted(b, ids.data(), b.n);
  race::block_begin(reinterpret_cast<const void*>(L.invoke), static_cast<uint32_t>(linear), L.grid, L.block, b.smem,
                    L.smem);
  w.blk = &b;
  for (;;) {
    while (any_ready(b) && !b.failed) {
      Fiber& f = b.f[pick(b)];
      f.st = St::Running;
      w.running = &f;
      t_thread = &f.ts;
      race::thread_runs(f.tid);
      switch_to_fiber(w, f);
      race::thread_runs(-1);
      t_thread = nullptr;
      w.running = nullptr;
    }
    if (b.failed || b.done == b.n) break;
    // Nobody can run: a barrier is complete, or the block is stuck.
    const int alive = b.n - b.done;
    if (b.at_bar == alive) {
      const Fiber* first = nullptr;
      for (int i = 0; i < b.n && !first; ++i)
        if (b.f[i].st == St::WaitBar) first = &b.f[i];
      if (b.done > 0) {
        const Fiber* gone = nullptr;
        for (int i = 0; i < b.n && !gone; ++i)
          if (b.f[i].st == St::Done) gone = &b.f[i];
        block_error(b, *first,
                    "__syncthreads (%s:%d) reached by %d of %d threads; %d exited before it (e.g. thread (%u,%u,%u))",
                    first->file, first->line, b.at_bar, b.n, b.done, gone->ts.thread_idx.x, gone->ts.thread_idx.y,
                    gone->ts.thread_idx.z);
        break;
      }
      int count = 0;
      for (int i = 0; i < b.n; ++i) {
        const Fiber& g = b.f[i];
        if (g.file != first->file || g.line != first->line || g.bar_op != first->bar_op) {
          block_error(b, g, "divergent __syncthreads: waits at %s:%d while thread (%u,%u,%u) waits at %s:%d", g.file,
                      g.line, first->ts.thread_idx.x, first->ts.thread_idx.y, first->ts.thread_idx.z, first->file,
                      first->line);
          break;
        }
        count += g.pred;
      }
      if (b.failed) break;
      for (int i = 0; i < b.n; ++i) {
        Fiber& g = b.f[i];
        switch (g.bar_op) {
          case BarrierOp::Sync: g.bar_result = 0; break;
          case BarrierOp::Count: g.bar_result = count; break;
          case BarrierOp::And: g.bar_result = count == b.n; break;
          case BarrierOp::Or: g.bar_result = count > 0; break;
        }
      }
      b.at_bar = 0;
      race::barrier();
      if (b.sched.kind == Sched::Ahead) draw_ranks(b);
      for (int i = 0; i < b.n; ++i) ids[i] = i;
      enqueue_sorted(b, ids.data(), b.n);
      continue;
    }
    // Stuck: describe the first waiter in a warp collective, and what its lanes do instead.
    for (int i = 0; i < b.n && !b.failed; ++i) {
      const Fiber& g = b.f[i];
      if (g.st != St::WaitWarp) continue;
      const int base = g.tid / 32 * 32;
      for (int l = 0; l < 32; ++l) {
        if (!(g.mask >> l & 1u) || base + l >= b.n) continue;
        const Fiber& h = b.f[base + l];
        if (h.st == St::WaitBar) {
          block_error(b, g, "%s (%s:%d) waits for lane %d, which waits at __syncthreads (%s:%d): deadlock",
                      warp_op_name(g.op), g.file, g.line, l, h.file, h.line);
          break;
        }
        if (h.st == St::WaitWarp && (h.op != g.op || h.mask != g.mask)) {
          block_error(b, g, "%s (%s:%d) with mask 0x%08x meets lane %d in %s (%s:%d) with mask 0x%08x: deadlock",
                      warp_op_name(g.op), g.file, g.line, g.mask, l, warp_op_name(h.op), h.file, h.line, h.mask);
          break;
        }
      }
      if (!b.failed)
        block_error(b, g, "%s (%s:%d) with mask 0x%08x never completes: deadlock", warp_op_name(g.op), g.file, g.line,
                    g.mask);
    }
    if (!b.failed) block_error(b, b.f[0], "the block is stuck (emulator bug?)");
    break;
  }
  race::block_end();
  w.blk = nullptr;
  if (b.failed) {
    w.stacks_dirty = true;
    std::lock_guard<std::mutex> lock(job.err_mutex);
    if (!job.failed.exchange(true)) job.err = b.err;
  }
}

void run_job(Job& job) {
  Worker& w = worker();
  for (;;) {
    if (job.failed.load(std::memory_order_relaxed)) return;
    const size_t k = job.next.fetch_add(1);
    if (k >= job.nblocks) return;
    size_t linear = k;
    if (job.sched.kind == Sched::Rev || job.sched.kind == Sched::High) linear = job.nblocks - 1 - k;
    else if (job.sched.kind == Sched::Random || job.sched.kind == Sched::Ahead) linear = job.order[k];
    run_block(w, job, linear);
  }
}

// ---------------------------------------------------------------------------------- worker pool
struct Pool {
  std::mutex m;
  std::condition_variable cv, done_cv;
  std::vector<std::thread> threads;
  Job* job = nullptr;
  uint64_t gen = 0;
  int pending = 0;

  void start(int n) {
    for (int i = 0; i < n; ++i) threads.emplace_back([this] { loop(); });
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      Job* j;
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return gen != seen; });
        seen = gen;
        j = job;
      }
      run_job(*j);
      std::lock_guard<std::mutex> lock(m);
      if (--pending == 0) done_cv.notify_all();
    }
  }
  void run(Job& j) {  // the calling thread works too
    {
      std::lock_guard<std::mutex> lock(m);
      job = &j;
      pending = static_cast<int>(threads.size());
      ++gen;
    }
    cv.notify_all();
    run_job(j);
    std::unique_lock<std::mutex> lock(m);
    done_cv.wait(lock, [&] { return pending == 0; });
    job = nullptr;
  }
};
Pool* g_pool = nullptr;  // never destroyed: its threads sleep until the process ends
pid_t g_pool_pid = 0;    // a forked child has none of the parent's pool threads: it starts its own
std::mutex g_launch_mutex;
std::atomic<unsigned long long> g_launches{0};

// ---------------------------------------------------------------------------------- host-side state
struct HostState {
  std::mutex m;
  std::unordered_map<const void*, int> max_dyn_smem;  // cudaFuncSetAttribute
  std::map<const void*, int> streams;  // each stream's device
};
HostState& host() {
  static HostState* h = new HostState();  // never destroyed: usable from static destructors
  return *h;
}

thread_local cudaError_t t_last_error = cudaSuccess;
thread_local cudaError_t t_message_code = cudaSuccess;
thread_local std::string t_last_message;

cudaError_t set_error(cudaError_t e, const std::string& msg = std::string()) {
  if (e != cudaSuccess) {
    t_last_error = e;
    t_message_code = e;
    t_last_message = msg;
  }
  return e;
}

constexpr int kSharedPerBlock = 48 * 1024;
constexpr int kSharedOptin = 227 * 1024;  // sm_90

void append_line(const std::string& path, const std::string& line) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t r = write(fd, line.data(), line.size());
  (void)r;
  close(fd);
}

// The kernel's name as written at the LAUNCH site, without the parentheses around templated ones.
std::string kernel_name(const char* name) {
  std::string s = name;
  if (s.size() > 2 && s.front() == '(' && s.back() == ')') s = s.substr(1, s.size() - 2);
  return s;
}

void trace(const KernelLaunch& L) {
  if (!g_trace_path.empty()) append_line(g_trace_path, kernel_name(L.name) + '\n');
  if (g_launch_log_path.empty()) return;
  char cfg[160];
  snprintf(cfg, sizeof cfg, "\"grid\": [%u, %u, %u], \"block\": [%u, %u, %u], \"smem\": %zu", L.grid.x, L.grid.y,
           L.grid.z, L.block.x, L.block.y, L.block.z, L.smem);
  append_line(g_launch_log_path, "{\"kernel\": \"" + kernel_name(L.name) + "\", \"device\": " +
                                     std::to_string(api_current_device()) + ", " + cfg +
                                     ", \"args\": " + (L.int_args ? L.int_args(L.ctx) : "[]") + "}\n");
}

}  // namespace

cudaError_t api_set_error(cudaError_t e, const char* msg) { return set_error(e, msg ? msg : ""); }
cudaError_t api_take_error() {
  cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}
cudaError_t api_peek_error() { return t_last_error; }
const char* api_message_for(cudaError_t e) {
  return e != cudaSuccess && e == t_message_code && !t_last_message.empty() ? t_last_message.c_str() : nullptr;
}
bool api_register_stream(const void* s, bool add, int device) {
  HostState& h = host();
  std::lock_guard<std::mutex> lock(h.m);
  if (add) return h.streams.emplace(s, device).second;
  return h.streams.erase(s) > 0;
}
void api_set_max_dyn_smem(const void* func, int bytes) {
  HostState& h = host();
  std::lock_guard<std::mutex> lock(h.m);
  h.max_dyn_smem[func] = bytes;
}

namespace {

// The launch configuration checks CUDA makes when a kernel is launched (or captured).
cudaError_t check_launch(const KernelLaunch& L) {
  char buf[512];
  const uint64_t nthr = uint64_t(L.block.x) * L.block.y * L.block.z;
  if (L.block.x == 0 || L.block.y == 0 || L.block.z == 0 || L.block.x > 1024 || L.block.y > 1024 ||
      L.block.z > 64 || nthr > 1024 || L.grid.x == 0 || L.grid.y == 0 || L.grid.z == 0 || L.grid.x > 2147483647u ||
      L.grid.y > 65535 || L.grid.z > 65535) {
    snprintf(buf, sizeof buf, "kernel '%s': invalid launch configuration grid (%u,%u,%u) block (%u,%u,%u)", L.name,
             L.grid.x, L.grid.y, L.grid.z, L.block.x, L.block.y, L.block.z);
    return set_error(cudaErrorInvalidConfiguration, buf);
  }
  HostState& h = host();
  std::lock_guard<std::mutex> lock(h.m);
  int limit = kSharedPerBlock;
  auto it = h.max_dyn_smem.find(L.func);
  if (it != h.max_dyn_smem.end()) limit = it->second;
  if (L.smem > static_cast<size_t>(limit)) {
    snprintf(buf, sizeof buf,
             "kernel '%s': %zu bytes of dynamic shared memory exceed the %d allowed (above 48 KiB needs "
             "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize))",
             L.name, L.smem, limit);
    return set_error(cudaErrorInvalidValue, buf);
  }
  const void* s = L.stream;
  if (s != nullptr && s != cudaStreamLegacy && s != cudaStreamPerThread) {
    const auto st = h.streams.find(s);
    if (st == h.streams.end()) {
      snprintf(buf, sizeof buf, "kernel '%s': launched on a stream that does not exist", L.name);
      return set_error(cudaErrorInvalidResourceHandle, buf);
    }
    // CUDA: "a kernel launch will fail if it is issued to a stream that is not associated to the current device"
    if (const int cur = api_current_device(); st->second != cur) {
      snprintf(buf, sizeof buf, "kernel '%s': launched on a stream of device %d while device %d is current",
               L.name, st->second, cur);
      return set_error(cudaErrorInvalidResourceHandle, buf);
    }
  }
  return cudaSuccess;
}

// Runs the grid now: counted and traced here, so a captured launch counts each time a graph runs it.
cudaError_t run_kernel(const KernelLaunch& L) {
  std::lock_guard<std::mutex> launch_lock(g_launch_mutex);
  Schedule sched;
  {
    std::lock_guard<std::mutex> lock(g_config_mutex);
    read_config_locked();
    sched = g_sched;
  }
  const unsigned long long id = g_launches.fetch_add(1);
  trace(L);
  Job job;
  job.L = &L;
  job.sched = sched;
  job.launch_id = id;
  job.nblocks = size_t(L.grid.x) * L.grid.y * L.grid.z;
  race::launch_begin(id);
  if (sched.kind == Sched::Random || sched.kind == Sched::Ahead) {
    job.order.resize(job.nblocks);
    for (size_t i = 0; i < job.nblocks; ++i) job.order[i] = static_cast<uint32_t>(i);
    std::mt19937_64 rng(mix(sched.seed ^ mix(id)));
    std::shuffle(job.order.begin(), job.order.end(), rng);
  }
  if (g_nthreads <= 1 || job.nblocks == 1) {
    run_job(job);
  } else {
    if (!g_pool || g_pool_pid != getpid()) {
      g_pool = new Pool();
      g_pool_pid = getpid();
      g_pool->start(g_nthreads - 1);
    }
    g_pool->run(job);
  }
  if (job.failed) return set_error(cudaErrorLaunchFailure, race::symbolize(job.err));
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_kernel(const KernelLaunch& L) {
  if (const cudaError_t e = check_launch(L); e != cudaSuccess) {
    // A bad launch into a capturing stream invalidates the capture, as on CUDA.
    return stream_capturing(L.stream) ? refuse_in_capture(L.stream, e, t_last_message) : e;
  }
  if (!capture_active()) return run_kernel(L);
  // Some stream captures, perhaps this one: copy the arguments now, as CUDA does for a captured launch.
  KernelLaunch node = L;
  std::shared_ptr<void> args = L.copy_ctx(L.ctx);
  node.ctx = args.get();
  const std::string what = std::string("kernel '") + L.name + "'";
  return enqueue(L.stream, what.c_str(), [node, args] { return run_kernel(node); });
}

}  // namespace detail

const char* last_error_message() { return detail::t_message_code != cudaSuccess ? detail::t_last_message.c_str() : ""; }

void set_schedule(const char* spec) {
  std::lock_guard<std::mutex> lock(detail::g_config_mutex);
  detail::read_config_locked();
  if (!detail::parse_schedule(spec, &detail::g_sched)) {
    fprintf(stderr, "gpt2core emu: ignoring bad schedule '%s'\n", spec ? spec : "");
  }
}

unsigned long long launch_count() { return detail::g_launches.load(); }

void log_launch(const std::string& json_line) {
  std::string path;
  {
    std::lock_guard<std::mutex> lock(detail::g_config_mutex);
    detail::read_config_locked();
    path = detail::g_launch_log_path;
  }
  if (!path.empty()) detail::append_line(path, json_line + '\n');
}

}  // namespace gpt2emu
