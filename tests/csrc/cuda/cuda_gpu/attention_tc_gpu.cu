// The tensor-core attention's test entry (../cuda_emu/attention_tc_ops.cu, the one the emulator tests run) as a C
// function, for a shared library that nvcc builds and tests/csrc/cuda/test_cuda_gpu.py loads with ctypes on a real
// GPU. Returns 0, or 1 with the CUDA error's text in `err` (no exception crosses the C boundary).
#include "cuda_emu/attention_tc_ops.cu"

#include <cstdio>
#include <exception>

extern "C" int gpt2core_test_attention_tc(int f16, uint16_t* out, float* lse, uint16_t* dqkv, const uint16_t* qkv,
                                          const uint16_t* dout, int B, int T, int C, int NH, int misalign,
                                          int accumulate, char* err, int err_len) {
  try {
    gpt2emu_test::attention_tc_16(f16 != 0, out, lse, dqkv, qkv, dout, B, T, C, NH, misalign != 0, accumulate != 0);
    return 0;
  } catch (const std::exception& e) {
    snprintf(err, size_t(err_len), "%s", e.what());
    return 1;
  }
}
