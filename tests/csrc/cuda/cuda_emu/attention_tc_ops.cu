// Test-only entry to csrc/cuda/attention_tc.cuh (tests/csrc/cuda/test_cuda_emu_attention_tc.py): the tensor-core
// forward then backward on host arrays of 16-bit values, floatX = __half or __nv_bfloat16 picked at run time,
// without a backend (so the kernels are tested for either storage type on their own). Device buffers are poisoned
// before the kernels run (all-ones bits: NaN in both 16-bit types and in fp32); accumulate: dqkv starts from the
// given values and the backward adds into it, else it starts poisoned and the backward writes it. misalign: buffers start one element into their allocation (the kernels'
// scalar path instead of 16-byte packs).
#include "cuda/attention_tc.cuh"

#include <cstdint>
#include <cstring>
#include <vector>

namespace gpt2emu_test {

namespace {
template <class E>
E* device_copy(const E* host, size_t n, int shift, bool poison) {
  E* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, (n + shift) * sizeof(E)));
  CUDA_CHECK(cudaMemset(d, 0xff, (n + shift) * sizeof(E)));
  if (!poison) CUDA_CHECK(cudaMemcpy(d + shift, host, n * sizeof(E), cudaMemcpyHostToDevice));
  return d + shift;
}

template <class X>
void run(uint16_t* out, float* lse, uint16_t* dqkv, const uint16_t* qkv, const uint16_t* dout, int B, int T, int C,
         int NH, bool misalign, bool accumulate) {
  const int s = misalign ? 1 : 0;
  const size_t n3 = size_t(B) * T * 3 * C, n1 = size_t(B) * T * C, ns = size_t(B) * NH * T;
  X* d_qkv = reinterpret_cast<X*>(device_copy(qkv, n3, s, false));
  X* d_dout = reinterpret_cast<X*>(device_copy(dout, n1, s, false));
  X* d_dqkv = reinterpret_cast<X*>(device_copy(dqkv, n3, s, !accumulate));
  X* d_out = reinterpret_cast<X*>(device_copy(out, n1, s, true));
  float* d_lse = device_copy(lse, ns, 0, true);
  const size_t nscratch = gpt2::cuda::attention_tc_scratch_floats(B, T, NH);
  std::vector<float> none(nscratch);
  float* d_scratch = device_copy(none.data(), nscratch, 0, true);
  gpt2::cuda::attention_tc_forward(d_out, d_lse, d_qkv, B, T, C, NH, nullptr);
  gpt2::cuda::attention_tc_backward(d_dqkv, d_dout, d_qkv, d_out, d_lse, d_scratch, B, T, C, NH, accumulate, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(out, d_out, n1 * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(lse, d_lse, ns * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(dqkv, d_dqkv, n3 * 2, cudaMemcpyDeviceToHost));
  for (void* p : {static_cast<void*>(d_qkv - s), static_cast<void*>(d_dout - s), static_cast<void*>(d_dqkv - s),
                  static_cast<void*>(d_out - s), static_cast<void*>(d_lse), static_cast<void*>(d_scratch)})
    CUDA_CHECK(cudaFree(p));
}
}  // namespace

// out (B, T, C), lse (B, NH, T): written; dqkv (B, T, 3C): accumulated into or written; qkv, dout: inputs. f16: __half, else
// __nv_bfloat16 (the raw 16-bit patterns either way).
void attention_tc_16(bool f16, uint16_t* out, float* lse, uint16_t* dqkv, const uint16_t* qkv, const uint16_t* dout,
                     int B, int T, int C, int NH, bool misalign, bool accumulate) {
  if (f16) run<__half>(out, lse, dqkv, qkv, dout, B, T, C, NH, misalign, accumulate);
  else run<__nv_bfloat16>(out, lse, dqkv, qkv, dout, B, T, C, NH, misalign, accumulate);
}

}  // namespace gpt2emu_test
