// How a backend computes, chosen by the user and passed down as an argument: GPT2(precision=..., attention=...,
// fused=..., matmul_tuning=..., deterministic=...) -> the binding -> make_backend (backends.h) -> the backend, which hands the per-call part to the ops
// and the library seams (TF32: a field of each matmul's seam params). Never the process environment, so two
// models in one process can differ.
#pragma once
#include <string>

namespace gpt2 {

struct BackendOptions {
  enum class Attention { Auto, Flash, Cudnn, Naive };
  // fp32 matmuls on TF32 tensor cores (CUDA, float32 models; bf16 models compute their matmuls in bf16 anyway)
  bool tf32 = false;
  // CUDA attention: Auto = cuDNN's fused SDPA for bf16 models when it is built and agrees with the flash kernel
  // on a small problem, else flash; Flash = gpt2core's flash kernel (no T x T matrix); Cudnn = cuDNN or refuse
  // to start; Naive = the materialised softmax (the reference rung of the speed ladder). The CPU backend always
  // materialises attention (Auto or Naive).
  Attention attention = Attention::Auto;
  // CUDA: residual + layernorm in one kernel and GELU in the matmul epilogues; false runs the separate kernels
  // (the unfused rung of the speed ladder). The CPU backend has nothing to fuse and ignores it.
  bool fused = true;
  // CUDA: time cuBLASLt's candidate algorithms (up to 8 from its heuristic) once per matmul shape and keep the
  // fastest, as cudnn.benchmark does in PyTorch; false takes the heuristic's first, as llm.c does. The timed choice
  // is per process: a resumed run may pick other algorithms than the run it continues and round differently,
  // so bit-exact resume on a GPU needs false. The CPU backend has no library algorithms to choose and ignores it.
  bool matmul_tuning = false;
  // CUDA: every kernel and library call gives the same bits for the same inputs, so two identical runs (and a
  // resumed one) agree bit for bit. Today this is cuDNN's SDPA backward, which cudnn-frontend builds
  // non-deterministic unless asked (its Hopper path may accumulate dQ with atomics): true builds that graph with
  // set_deterministic_algorithm(true); false lets cuDNN pick the (possibly faster) atomic path. gpt2core's own
  // kernels and cuBLASLt's heuristic-first matmuls are deterministic either way. The CPU backend ignores it.
  bool deterministic = true;
};

inline const char* attention_name(BackendOptions::Attention a) {
  switch (a) {
    case BackendOptions::Attention::Flash: return "flash";
    case BackendOptions::Attention::Cudnn: return "cudnn";
    case BackendOptions::Attention::Naive: return "naive";
    default: return "auto";
  }
}

// "auto", "flash", "cudnn" or "naive"; false for anything else.
inline bool parse_attention(const std::string& s, BackendOptions::Attention* out) {
  for (auto a : {BackendOptions::Attention::Auto, BackendOptions::Attention::Flash, BackendOptions::Attention::Cudnn,
                 BackendOptions::Attention::Naive})
    if (s == attention_name(a)) {
      *out = a;
      return true;
    }
  return false;
}

}  // namespace gpt2
