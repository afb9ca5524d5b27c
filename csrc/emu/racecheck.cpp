// racecheck.cpp: the emulator's memory checker (see racecheck.h for the rules) and the __tsan_* entry
// points GCC's -fsanitize=thread instrumentation calls from the kernel sources. This file itself is not
// instrumented.
#include "emu/racecheck.h"

#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace gpt2emu::detail {
extern __thread struct ThreadState* t_thread;  // runtime.cpp: read by threadIdx, not shared memory
}

namespace gpt2emu::detail::race {
namespace {

std::atomic<bool> g_instrumented{false};  // some loaded code calls the __tsan_* entry points

bool env_on() {
  static const bool on = [] {
    const char* v = getenv("GPT2CORE_EMU_RACECHECK");
    return !(v && strcmp(v, "0") == 0);
  }();
  return on;
}

// ---------------------------------------------------------------------------------- device memory
// One reserved range of address space; each allocation is 256-byte aligned and followed by at least
// 256 bytes nobody owns. Shadow: 8 bytes per byte, 0 = not addressable, else kAddr | launch << 32 |
// kAtomic (the last write was atomic) | block (the last writer's linear block index, 31 bits).
constexpr size_t kArenaBytes = size_t(32) << 30;
constexpr size_t kAlign = 256;
constexpr uint64_t kAddr = uint64_t(1) << 63, kAtomic = uint64_t(1) << 31, kBlockMask = 0x7fffffffu;

uintptr_t g_arena_lo = 0;  // set once, before the first allocation from the arena is handed out
std::atomic<uint64_t>* g_shadow = nullptr;
std::atomic<uint32_t> g_launch{0};  // tag of the running launch (31 bits, never 0)

struct Arena {
  std::mutex m;
  bool tried = false;
  size_t top = kAlign;                // next unused offset
  std::map<size_t, size_t> spans;     // free spans: offset -> bytes
  std::map<size_t, size_t> live;      // allocations: offset -> requested bytes
  std::map<size_t, size_t> freed;     // freed allocations not reused yet, for messages
};
Arena& arena() {
  static Arena* a = new Arena();  // never destroyed: usable from static destructors
  return *a;
}

size_t span_of(size_t size) { return (std::max<size_t>(size, 1) + 2 * kAlign - 1) / kAlign * kAlign; }

void mark(size_t off, size_t n, uint64_t v) {
  for (size_t i = 0; i < n; ++i) g_shadow[off + i].store(v, std::memory_order_relaxed);
}

// Gives the whole pages inside [off, off + n) of the arena and their shadow back to the system.
void release(size_t off, size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t lo = (off + page - 1) / page * page, hi = (off + n) / page * page;
  if (hi <= lo) return;
  madvise(reinterpret_cast<void*>(g_arena_lo + lo), hi - lo, MADV_DONTNEED);
  madvise(g_shadow + lo, (hi - lo) * sizeof(uint64_t), MADV_DONTNEED);  // shadow 0: not addressable
}

// ---------------------------------------------------------------------------------- per OS thread
enum Kind { kRead, kWrite, kAtomicRead, kAtomicWrite };

struct Cell {              // one byte of shared memory
  uint32_t epoch;          // barrier epoch of the fields below; below the block's first epoch: untouched
  uint32_t rwarps;         // warps that read the byte since the last __syncthreads
  uint16_t writer;         // thread + 1 of the last write since the last __syncthreads (0: none)
  uint16_t reader, first;  // thread + 1 of the last and the first read since then
  uint16_t wsync, rsync;   // that warp's __syncwarp count at the write / last read
  const void* wpc;
  const void* rpc;
  const void* fpc;
  uint16_t async;          // thread + 1 whose cp.async into the byte is in flight (0: none); kept across barriers
  const void* apc;         // where that cp.async was issued
};

struct Region {
  uintptr_t lo = 0;
  size_t n = 0;
  std::vector<Cell> cells;
  const char* what = "";
};

struct Worker {
  int tid = -1;                        // running CUDA thread, -1: none
  uint32_t epoch = 0, first = 0;       // barrier epoch now / at block start (counts on this OS thread)
  uint32_t block = 0;                  // linear block index
  dim3 grid, bdim;
  uint16_t wsync[32] = {};
  Region dyn;                          // DYNAMIC_SMEM of the running block
  Region* st = nullptr;                // the kernel module's thread-local storage: static __shared__
  uintptr_t skip = 0;                  // &t_thread
  std::unordered_map<const void*, Region*> st_by_code;
  std::map<size_t, Region> st_by_module;  // by TLS module id
};
__thread Worker* t_w = nullptr;  // set while a block runs on this OS thread
thread_local Worker* t_own = nullptr;

struct TlsIndex {
  unsigned long module, offset;
};
extern "C" void* __tls_get_addr(TlsIndex*);

// This thread's instance of the thread-local storage of the module holding `code`.
Region* static_region(Worker& w, const void* code) {
  auto it = w.st_by_code.find(code);
  if (it != w.st_by_code.end()) return it->second;
  struct Query {
    uintptr_t code;
    size_t module = 0, size = 0;
  } q{reinterpret_cast<uintptr_t>(code)};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        Query& q = *static_cast<Query*>(data);
        bool holds = false;
        size_t tls = 0;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& ph = info->dlpi_phdr[i];
          const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
          if (ph.p_type == PT_LOAD && q.code >= lo && q.code < lo + ph.p_memsz) holds = true;
          if (ph.p_type == PT_TLS) tls = ph.p_memsz;
        }
        if (!holds) return 0;
        q.module = info->dlpi_tls_modid;
        q.size = tls;
        return 1;
      },
      &q);
  Region* r = nullptr;
  if (q.module && q.size) {
    r = &w.st_by_module[q.module];
    if (r->cells.empty()) {
      TlsIndex ti{q.module, 0};
      r->lo = reinterpret_cast<uintptr_t>(__tls_get_addr(&ti));
      r->n = q.size;
      r->cells.assign(q.size, Cell{});
      r->what = "static __shared__";
    }
  }
  w.st_by_code[code] = r;
  return r;
}

// ---------------------------------------------------------------------------------- reports
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string at(const void* pc) { return fmt("@pc:%p@", pc); }

std::string thread_name(const Worker& w, int tid) {
  const unsigned bx = w.bdim.x, by = w.bdim.y;
  return fmt("thread (%u,%u,%u)", tid % bx, tid / bx % by, tid / (bx * by));
}

const char* kind_verb(Kind k) { return k == kRead || k == kAtomicRead ? "reads" : "writes"; }

[[noreturn]] void shared_race(const Worker& w, const Region& r, uintptr_t a, Kind k, const void* pc, int other,
                              bool other_wrote, const void* opc) {
  const bool same_warp = other / 32 == w.tid / 32;
  fail_running_thread(fmt("shared-memory race: %s %s byte %zu at %s, which %s %s at %s with no %s between",
                          kind_verb(k), r.what, size_t(a - r.lo), at(pc).c_str(), thread_name(w, other).c_str(),
                          other_wrote ? "wrote" : "read", opc ? at(opc).c_str() : "(line unknown)",
                          same_warp ? "__syncwarp" : "__syncthreads"));
}

[[noreturn]] void global_report(uintptr_t a, size_t n, Kind k, const void* pc) {
  Arena& ar = arena();
  std::string what = "not inside any allocation";
  {
    std::lock_guard<std::mutex> lock(ar.m);
    const size_t off = a - g_arena_lo;
    auto it = ar.live.upper_bound(off);
    auto fr = ar.freed.upper_bound(off);
    if (fr != ar.freed.begin() && off < std::prev(fr)->first + std::prev(fr)->second) {
      what = fmt("inside a freed %zu-byte allocation (used after cudaFree)", std::prev(fr)->second);
    } else if (it != ar.live.begin() && off < std::prev(it)->first + span_of(std::prev(it)->second)) {
      --it;  // in the guard zone after it
      what = fmt("byte %zu past the end of a %zu-byte allocation", off - it->first - it->second + 1, it->second);
    }
  }
  fail_running_thread(fmt("out-of-bounds device memory access: %s %zu bytes at %s at %p, %s", kind_verb(k), n,
                          at(pc).c_str(), reinterpret_cast<void*>(a), what.c_str()));
}

// ---------------------------------------------------------------------------------- the checks
// The bytes are poisoned with this pattern (by address) before an uninitialised read returns them.
constexpr unsigned char kPoison[4] = {0xf7, 0xff, 0xf7, 0x7f};  // 0x7ff7fff7 little-endian

void shared_access(Worker& w, Region& r, uintptr_t a, size_t n, Kind k, const void* pc) {
  const int t = w.tid, warp = t / 32;
  const uint16_t me = static_cast<uint16_t>(t + 1), s = w.wsync[warp];
  auto conflicts = [&](uint16_t other, uint16_t other_sync) {
    return other && other != me && ((other - 1) / 32 != warp || other_sync == s);
  };
  for (size_t i = 0; i < n; ++i) {
    Cell& c = r.cells[a - r.lo + i];
    if (c.epoch < w.first) {  // untouched in this block
      if (k != kWrite && k != kAtomicWrite) {
        unsigned char* b = reinterpret_cast<unsigned char*>(a + i);
        *b = kPoison[(a + i) % 4];
        fail_running_thread(fmt("uninitialised shared memory: reads %s byte %zu at %s, which no thread of this "
                                "block has written (a missing barrier, or a slot nobody writes)",
                                r.what, size_t(a + i - r.lo), at(pc).c_str()));
      }
      c = Cell{};
      c.epoch = w.epoch;
    } else if (c.epoch != w.epoch) {
      const uint16_t async = c.async;
      const void* apc = c.apc;
      c = Cell{};
      c.epoch = w.epoch;
      c.async = async;
      c.apc = apc;
    }
    if (c.async)
      fail_running_thread(fmt("cp.async in flight: %s %s byte %zu at %s, which %s's cp.async at %s is still copying "
                              "into (a missing cp.async.wait_group / wait_all before the access)",
                              kind_verb(k), r.what, size_t(a + i - r.lo), at(pc).c_str(),
                              c.async == me ? "this thread" : thread_name(w, c.async - 1).c_str(), at(c.apc).c_str()));
    if (k == kAtomicRead || k == kAtomicWrite) continue;  // atomics do not race with each other
    if (k == kWrite) {
      if (conflicts(c.writer, c.wsync)) shared_race(w, r, a + i, k, pc, c.writer - 1, true, c.wpc);
      if (conflicts(c.reader, c.rsync)) shared_race(w, r, a + i, k, pc, c.reader - 1, false, c.rpc);
      if (conflicts(c.first, c.rsync) || (c.rwarps & ~(1u << warp))) {
        if (c.first && (c.first - 1) / 32 != warp) shared_race(w, r, a + i, k, pc, c.first - 1, false, c.fpc);
        fail_running_thread(fmt("shared-memory race: writes %s byte %zu at %s, which threads of warps 0x%08x read "
                                "with no __syncthreads between",
                                r.what, size_t(a + i - r.lo), at(pc).c_str(), c.rwarps & ~(1u << warp)));
      }
      c.writer = me;
      c.wsync = s;
      c.wpc = pc;
    } else {
      if (conflicts(c.writer, c.wsync)) shared_race(w, r, a + i, k, pc, c.writer - 1, true, c.wpc);
      c.rwarps |= 1u << warp;
      if (!c.first) {
        c.first = me;
        c.fpc = pc;
      }
      c.reader = me;
      c.rsync = s;
      c.rpc = pc;
    }
  }
}

void global_access(Worker& w, uintptr_t a, size_t n, Kind k, const void* pc) {
  const size_t off = a - g_arena_lo;
  const uint32_t launch = g_launch.load(std::memory_order_relaxed);
  const uint64_t mine = kAddr | uint64_t(launch) << 32 | (k == kAtomicWrite ? kAtomic : 0) | (w.block & kBlockMask);
  for (size_t i = 0; i < n; ++i) {
    std::atomic<uint64_t>& c = g_shadow[off + i];
    const uint64_t v = c.load(std::memory_order_relaxed);
    if (!(v & kAddr)) global_report(a, n, k, pc);
    if (k == kRead || k == kAtomicRead || v == mine) continue;
    const uint64_t old = c.exchange(mine, std::memory_order_relaxed);
    if ((old >> 32 & 0x7fffffffu) == launch && (old & kBlockMask) != (w.block & kBlockMask) &&
        !(k == kAtomicWrite && (old & kAtomic))) {
      const uint32_t ob = static_cast<uint32_t>(old & kBlockMask);
      fail_running_thread(fmt("device-memory race: writes byte %p at %s, which block (%u,%u,%u) of this launch "
                              "also wrote, without an atomic",
                              reinterpret_cast<void*>(a + i), at(pc).c_str(), ob % w.grid.x, ob / w.grid.x % w.grid.y,
                              ob / (w.grid.x * w.grid.y)));
    }
  }
}

__attribute__((noinline)) void check(Worker& w, uintptr_t a, size_t n, Kind k, const void* pc) {
  if (w.dyn.n && a - w.dyn.lo < w.dyn.n + kSmemGuard) {
    if (a + n > w.dyn.lo + w.dyn.n)
      fail_running_thread(fmt("out-of-bounds shared memory access: %s %zu bytes at %s at byte %zu of %zu bytes of "
                              "dynamic shared memory",
                              kind_verb(k), n, at(pc).c_str(), size_t(a - w.dyn.lo), w.dyn.n));
    shared_access(w, w.dyn, a, n, k, pc);
  } else if (w.st && a - w.st->lo < w.st->n) {
    if (a - w.skip < sizeof(void*)) return;
    shared_access(w, *w.st, a, std::min(n, w.st->lo + w.st->n - a), k, pc);
  } else if (g_shadow && a - g_arena_lo < kArenaBytes) {
    global_access(w, a, std::min(n, g_arena_lo + kArenaBytes - a), k, pc);
  }
}

inline void access(const volatile void* p, size_t n, Kind k, const void* pc) {
  Worker* w = t_w;
  if (__builtin_expect(w == nullptr || w->tid < 0, 1)) return;
  check(*w, reinterpret_cast<uintptr_t>(p), n, k, pc);
}

Region* shared_region(Worker& w, uintptr_t a, size_t n) {
  if (w.dyn.n && a >= w.dyn.lo && a + n <= w.dyn.lo + w.dyn.n) return &w.dyn;
  if (w.st && a >= w.st->lo && a + n <= w.st->lo + w.st->n) return w.st;
  return nullptr;
}

Worker* running() {
  Worker* w = t_w;
  return w && w->tid >= 0 ? w : nullptr;
}

}  // namespace

bool is_shared(const void* p, size_t n) {
  Worker* w = running();
  return w && shared_region(*w, reinterpret_cast<uintptr_t>(p), n);
}

void read_global(const void* src, size_t n, const void* pc) {
  if (Worker* w = running()) check(*w, reinterpret_cast<uintptr_t>(src), n, kRead, pc);
}

void async_issue(void* dst, size_t n, const void* pc) {
  Worker* w = running();
  if (!w) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  check(*w, a, n, kWrite, pc);
  if (Region* r = shared_region(*w, a, n))
    for (size_t i = 0; i < n; ++i) {
      Cell& c = r->cells[a - r->lo + i];
      c.async = static_cast<uint16_t>(w->tid + 1);
      c.apc = pc;
    }
}

void async_land(void* dst, size_t n, const void* pc) {
  Worker* w = running();
  if (!w) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
  if (Region* r = shared_region(*w, a, n))
    for (size_t i = 0; i < n; ++i) r->cells[a - r->lo + i].async = 0;
  check(*w, a, n, kWrite, pc);
}

bool enabled() { return g_instrumented.load(std::memory_order_relaxed) && env_on(); }

void* device_alloc(size_t size) {
  if (!enabled()) return nullptr;
  Arena& ar = arena();
  std::lock_guard<std::mutex> lock(ar.m);
  if (!ar.tried) {
    ar.tried = true;
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    void* lo = mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE, flags, -1, 0);
    void* sh = mmap(nullptr, kArenaBytes * sizeof(uint64_t), PROT_READ | PROT_WRITE, flags, -1, 0);
    if (lo == MAP_FAILED || sh == MAP_FAILED) {
      fprintf(stderr, "gpt2core emu: cannot reserve the checked device memory arena; device memory is not checked\n");
      if (lo != MAP_FAILED) munmap(lo, kArenaBytes);
      if (sh != MAP_FAILED) munmap(sh, kArenaBytes * sizeof(uint64_t));
    } else {
      g_arena_lo = reinterpret_cast<uintptr_t>(lo);
      g_shadow = static_cast<std::atomic<uint64_t>*>(sh);
    }
  }
  if (!g_shadow) return nullptr;
  const size_t span = span_of(size);
  size_t off = 0;
  auto it = ar.spans.begin();
  while (it != ar.spans.end() && it->second < span) ++it;
  if (it != ar.spans.end()) {
    off = it->first;
    const size_t rest = it->second - span;
    ar.spans.erase(it);
    if (rest) ar.spans[off + span] = rest;
  } else {
    if (ar.top + span > kArenaBytes) return nullptr;
    off = ar.top;
    ar.top += span;
  }
  ar.freed.erase(ar.freed.lower_bound(off), ar.freed.lower_bound(off + span));
  ar.live[off] = size;
  mark(off, size, kAddr);
  return reinterpret_cast<void*>(g_arena_lo + off);
}

bool device_free(void* p) {
  if (!g_shadow) return false;
  const size_t off = reinterpret_cast<uintptr_t>(p) - g_arena_lo;
  if (off >= kArenaBytes) return false;
  Arena& ar = arena();
  std::lock_guard<std::mutex> lock(ar.m);
  auto it = ar.live.find(off);
  if (it == ar.live.end()) return false;
  size_t lo = off, n = span_of(it->second);
  mark(off, it->second, 0);  // freed: any later access is reported
  ar.freed[off] = it->second;
  ar.live.erase(it);
  auto next = ar.spans.find(lo + n);
  if (next != ar.spans.end()) {
    n += next->second;
    ar.spans.erase(next);
  }
  auto prev = ar.spans.lower_bound(lo);
  if (prev != ar.spans.begin() && std::prev(prev)->first + std::prev(prev)->second == lo) {
    --prev;
    lo = prev->first;
    n += prev->second;
    ar.spans.erase(prev);
  }
  ar.spans[lo] = n;
  release(lo, n);
  return true;
}

void launch_begin(uint64_t launch_id) {
  g_launch.store(static_cast<uint32_t>(launch_id % 0x7fffffffu) + 1, std::memory_order_relaxed);
}

void block_begin(const void* kernel_code, uint32_t block_linear, dim3 grid, dim3 block, void* dyn_smem,
                 size_t dyn_bytes) {
  if (!enabled()) return;
  if (!t_own) t_own = new Worker();  // lives as long as its thread; never freed
  Worker& w = *t_own;
  w.tid = -1;
  w.first = w.epoch = w.epoch + 1;
  w.block = block_linear;
  w.grid = grid;
  w.bdim = block;
  memset(w.wsync, 0, sizeof w.wsync);
  w.dyn.lo = reinterpret_cast<uintptr_t>(dyn_smem);
  w.dyn.n = dyn_smem ? dyn_bytes : 0;
  w.dyn.what = "dynamic shared memory";
  if (w.dyn.cells.size() < w.dyn.n) w.dyn.cells.resize(w.dyn.n);
  w.st = static_region(w, kernel_code);
  w.skip = reinterpret_cast<uintptr_t>(&t_thread);
  t_w = &w;
}

void thread_runs(int tid) {
  if (Worker* w = t_w) w->tid = tid;
}

void barrier() {
  if (Worker* w = t_w) {
    ++w->epoch;
    memset(w->wsync, 0, sizeof w->wsync);
  }
}

void syncwarp(int warp) {
  if (Worker* w = t_w) ++w->wsync[warp];
}

void block_end() { t_w = nullptr; }

std::string symbolize(const std::string& msg) {
  std::string out;
  size_t pos = 0;
  for (;;) {
    const size_t b = msg.find("@pc:", pos);
    const size_t e = b == std::string::npos ? b : msg.find('@', b + 4);
    if (e == std::string::npos) break;
    out += msg.substr(pos, b - pos);
    pos = e + 1;
    const uintptr_t pc = strtoull(msg.c_str() + b + 4, nullptr, 16);
    Dl_info info{};
    std::string where_ = fmt("%p", reinterpret_cast<void*>(pc));
    if (pc && dladdr(reinterpret_cast<void*>(pc), &info) && info.dli_fname) {
      // return address - 1: the access itself; shared objects and PIEs are mapped at dli_fbase
      const auto* eh = static_cast<const ElfW(Ehdr)*>(info.dli_fbase);
      const uintptr_t rel = pc - 1 - (eh->e_type == ET_DYN ? reinterpret_cast<uintptr_t>(info.dli_fbase) : 0);
      const char* slash = strrchr(info.dli_fname, '/');
      where_ = fmt("%s+0x%zx", slash ? slash + 1 : info.dli_fname, size_t(rel));
      // -i: the inlining chain, innermost first: function / file:line pairs, where the last function is the
      // kernel (the first name addr2line prints is not the innermost function's, so only that one is used)
      const std::string cmd = fmt("addr2line -C -f -i -e '%s' 0x%zx 2>/dev/null", info.dli_fname, size_t(rel));
      if (FILE* p = popen(cmd.c_str(), "r")) {
        std::string chain, func;
        char buf[1024];
        for (int k = 0; fgets(buf, sizeof buf, p); ++k) {
          if (k % 2 == 0) {
            buf[strcspn(buf, "(\n")] = 0;  // the name without its parameter list
            func = strncmp(buf, "void ", 5) == 0 ? buf + 5 : buf;
            continue;
          }
          buf[strcspn(buf, " \n")] = 0;  // drop " (discriminator n)"
          if (buf[0] == '?' || k > 7) continue;
          const char* file = strrchr(buf, '/');
          chain += (chain.empty() ? "" : ", inlined at ") + std::string(file ? file + 1 : buf);
        }
        pclose(p);
        if (!chain.empty()) where_ = chain + " (" + func + ")";
      }
    }
    out += where_;
  }
  return out + msg.substr(pos);
}

}  // namespace gpt2emu::detail::race

namespace gpt2emu {
bool memory_checker_enabled();
}
bool gpt2emu::memory_checker_enabled() { return detail::race::enabled(); }

// ---------------------------------------------------------------------------------- __tsan_* entry points
// What GCC's -fsanitize=thread calls (compiled with --param tsan-instrument-func-entry-exit=0). The
// atomics perform the operation (sequentially consistent, whatever order was asked) after the check.
// Not in the ASan build: nothing is instrumented there, and GCC's built-in declarations of these names
// under -fsanitize=address use other parameter types.
#if !defined(GPT2CORE_EMU_SANITIZE)
using gpt2emu::detail::race::Kind;
namespace {
inline void note(const volatile void* p, size_t n, Kind k, const void* pc) {
  gpt2emu::detail::race::access(p, n, k, pc);
}
}  // namespace

// Hidden: instrumented code in the same module calls them directly, not through the PLT.
#pragma GCC visibility push(hidden)
extern "C" {
#define GPT2EMU_TSAN_RW(N)                                                                                          \
  void __tsan_read##N(void* p) { note(p, N, gpt2emu::detail::race::kRead, __builtin_return_address(0)); }        \
  void __tsan_write##N(void* p) { note(p, N, gpt2emu::detail::race::kWrite, __builtin_return_address(0)); }      \
  void __tsan_unaligned_read##N(void* p) { note(p, N, gpt2emu::detail::race::kRead, __builtin_return_address(0)); } \
  void __tsan_unaligned_write##N(void* p) {                                                                         \
    note(p, N, gpt2emu::detail::race::kWrite, __builtin_return_address(0));                                         \
  }                                                                                                                 \
  void __tsan_volatile_read##N(void* p) { note(p, N, gpt2emu::detail::race::kRead, __builtin_return_address(0)); } \
  void __tsan_volatile_write##N(void* p) {                                                                          \
    note(p, N, gpt2emu::detail::race::kWrite, __builtin_return_address(0));                                         \
  }
GPT2EMU_TSAN_RW(1)
GPT2EMU_TSAN_RW(2)
GPT2EMU_TSAN_RW(4)
GPT2EMU_TSAN_RW(8)
GPT2EMU_TSAN_RW(16)
#undef GPT2EMU_TSAN_RW
void __tsan_read_range(void* p, unsigned long n) {
  note(p, n, gpt2emu::detail::race::kRead, __builtin_return_address(0));
}
void __tsan_write_range(void* p, unsigned long n) {
  note(p, n, gpt2emu::detail::race::kWrite, __builtin_return_address(0));
}
void __tsan_vptr_update(void** p, void*) { note(p, sizeof(void*), gpt2emu::detail::race::kWrite, __builtin_return_address(0)); }
void __tsan_vptr_read(void** p) { note(p, sizeof(void*), gpt2emu::detail::race::kRead, __builtin_return_address(0)); }
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_init() { gpt2emu::detail::race::g_instrumented.store(true); }
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

#define GPT2EMU_TSAN_ATOMIC(N, T)                                                                                  \
  T __tsan_atomic##N##_load(const volatile T* a, int) {                                                            \
    note(a, sizeof(T), gpt2emu::detail::race::kAtomicRead, __builtin_return_address(0));                           \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                                   \
  }                                                                                                                \
  void __tsan_atomic##N##_store(volatile T* a, T v, int) {                                                         \
    note(a, sizeof(T), gpt2emu::detail::race::kAtomicWrite, __builtin_return_address(0));                          \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                                      \
  }                                                                                                                \
  T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                                         \
    note(a, sizeof(T), gpt2emu::detail::race::kAtomicWrite, __builtin_return_address(0));                          \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                            \
  }                                                                                                                \
  GPT2EMU_TSAN_FETCH(N, T, add) GPT2EMU_TSAN_FETCH(N, T, sub) GPT2EMU_TSAN_FETCH(N, T, and)                        \
  GPT2EMU_TSAN_FETCH(N, T, or) GPT2EMU_TSAN_FETCH(N, T, xor) GPT2EMU_TSAN_FETCH(N, T, nand)                        \
  int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {                             \
    note(a, sizeof(T), gpt2emu::detail::race::kAtomicWrite, __builtin_return_address(0));                          \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                        \
  }                                                                                                                \
  int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {                               \
    note(a, sizeof(T), gpt2emu::detail::race::kAtomicWrite, __builtin_return_address(0));                          \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                         \
  }                                                                                                                \
  T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                                   \
    note(a, sizeof(T), gpt2emu::detail::race::kAtomicWrite, __builtin_return_address(0));                          \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                              \
    return c;                                                                                                      \
  }
#define GPT2EMU_TSAN_FETCH(N, T, OP)                                                                               \
  T __tsan_atomic##N##_fetch_##OP(volatile T* a, T v, int) {                                                       \
    note(a, sizeof(T), gpt2emu::detail::race::kAtomicWrite, __builtin_return_address(0));                          \
    return __atomic_fetch_##OP(a, v, __ATOMIC_SEQ_CST);                                                            \
  }
GPT2EMU_TSAN_ATOMIC(8, unsigned char)
GPT2EMU_TSAN_ATOMIC(16, unsigned short)
GPT2EMU_TSAN_ATOMIC(32, unsigned int)
GPT2EMU_TSAN_ATOMIC(64, unsigned long long)
#undef GPT2EMU_TSAN_ATOMIC
#undef GPT2EMU_TSAN_FETCH
}  // extern "C"
#pragma GCC visibility pop
#endif  // !GPT2CORE_EMU_SANITIZE
