// fiber.h: the context switch under the emulator's CUDA threads.
//
// x86-64: a hand-written switch that saves the System V callee-saved registers, MXCSR and the x87
// control word on the old stack and swaps stack pointers (about 20x cheaper than swapcontext, which
// makes a sigprocmask system call each time). Elsewhere, or with GPT2CORE_EMU_UCONTEXT defined,
// glibc's ucontext. The caller annotates switches for AddressSanitizer (see runtime.cpp).
#pragma once

#include <cstddef>

#if !defined(__x86_64__) && !defined(GPT2CORE_EMU_UCONTEXT)
#define GPT2CORE_EMU_UCONTEXT 1
#endif

#if defined(GPT2CORE_EMU_UCONTEXT)
#include <ucontext.h>
#endif

namespace gpt2emu::fiber {

struct Context {
#if defined(GPT2CORE_EMU_UCONTEXT)
  ucontext_t uc;
  void (*fn)(void*) = nullptr;
  void* arg = nullptr;
#else
  void* sp = nullptr;
#endif
};

// Prepares `ctx` so that the next switch to it runs fn(arg) on the stack [lo, lo + size).
// fn must never return (it switches away for the last time instead).
void make(Context& ctx, char* lo, size_t size, void (*fn)(void*), void* arg);
// Saves the running context in `from` and resumes `to`.
void swap(Context& from, Context& to);
// "x86-64 asm" or "ucontext"
const char* impl_name();

}  // namespace gpt2emu::fiber
