// fiber.cpp: see fiber.h.
#include "emu/fiber.h"

#include <cstdint>
#include <cstdlib>

#if defined(GPT2CORE_EMU_UCONTEXT)

namespace gpt2emu::fiber {

static void trampoline(unsigned hi, unsigned lo) {
  Context* c = reinterpret_cast<Context*>((uintptr_t(hi) << 32) | uintptr_t(lo));
  c->fn(c->arg);
  abort();  // fn never returns
}

void make(Context& ctx, char* lo, size_t size, void (*fn)(void*), void* arg) {
  ctx.fn = fn;
  ctx.arg = arg;
  getcontext(&ctx.uc);
  ctx.uc.uc_stack.ss_sp = lo;
  ctx.uc.uc_stack.ss_size = size;
  ctx.uc.uc_link = nullptr;
  uintptr_t p = reinterpret_cast<uintptr_t>(&ctx);
  makecontext(&ctx.uc, reinterpret_cast<void (*)()>(trampoline), 2, unsigned(p >> 32), unsigned(p & 0xffffffffu));
}

void swap(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

const char* impl_name() { return "ucontext"; }

}  // namespace gpt2emu::fiber

#else

// void gpt2emu_fiber_switch(void** save_sp /* rdi */, void* new_sp /* rsi */)
// Frame pushed on the old stack, lowest address first: [mxcsr | x87 cw], r15, r14, r13, r12, rbx,
// rbp, return address. A new fiber's first frame has r12 = arg, r13 = fn and returns into
// gpt2emu_fiber_entry, which calls fn(arg) with a 16-byte aligned stack.
asm(R"(
  .text
  .p2align 4
  .globl gpt2emu_fiber_switch
  .hidden gpt2emu_fiber_switch
  .type gpt2emu_fiber_switch, @function
gpt2emu_fiber_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size gpt2emu_fiber_switch, .-gpt2emu_fiber_switch

  .p2align 4
  .globl gpt2emu_fiber_entry
  .hidden gpt2emu_fiber_entry
  .type gpt2emu_fiber_entry, @function
gpt2emu_fiber_entry:
  .cfi_startproc
  .cfi_undefined rip
  movq %r12, %rdi
  callq *%r13
  ud2
  .cfi_endproc
  .size gpt2emu_fiber_entry, .-gpt2emu_fiber_entry
)");

extern "C" void gpt2emu_fiber_switch(void** save_sp, void* new_sp);
extern "C" void gpt2emu_fiber_entry();

namespace gpt2emu::fiber {

void make(Context& ctx, char* lo, size_t size, void (*fn)(void*), void* arg) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + size) & ~uintptr_t(15);
  uint64_t* f = reinterpret_cast<uint64_t*>(top) - 8;
  uint32_t csr[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
  f[0] = uint64_t(csr[0]) | (uint64_t(csr[1] & 0xffffu) << 32);
  f[1] = 0;                                         // r15
  f[2] = 0;                                         // r14
  f[3] = reinterpret_cast<uint64_t>(fn);            // r13
  f[4] = reinterpret_cast<uint64_t>(arg);           // r12
  f[5] = 0;                                         // rbx
  f[6] = 0;                                         // rbp
  f[7] = reinterpret_cast<uint64_t>(&gpt2emu_fiber_entry);  // return address
  ctx.sp = f;
}

void swap(Context& from, Context& to) { gpt2emu_fiber_switch(&from.sp, to.sp); }

const char* impl_name() { return "x86-64 asm"; }

}  // namespace gpt2emu::fiber

#endif
