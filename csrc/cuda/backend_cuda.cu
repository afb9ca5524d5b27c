// The CUDA backend: gpt2::Backend<float> over the kernels of csrc/cuda/*.cuh and the matmul seam.
// The same source compiles with nvcc (into gpt2core._C) and with g++ against csrc/emu (the test-only
// emulated module), where "device memory" is host memory and kernels run on fibers.
//
// Memory: every buffer the model allocates (parameters, gradients, AdamW moments, activations) is CUDA
// managed memory, so the numpy views the Python layer keeps over parameters and gradients stay valid on
// the host; kernels run on one stream, and every op after which the model may hand control back to
// Python (zero, encoder_backward, adamw, the ops that return values) synchronises that stream.
// Out-of-memory is checked before allocating and reported with the size asked for.
#include "cuda/backend_cuda.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda/adamw.cuh"
#include "cuda/attention.cuh"
#include "cuda/attention_naive.cuh"
#include "cuda/classifier.cuh"
#include "cuda/common.cuh"
#include "cuda/encoder.cuh"
#include "cuda/gelu.cuh"
#include "cuda/global_norm.cuh"
#include "cuda/layernorm.cuh"
#include "cuda/matmul.cuh"
#include "cuda/reduce.cuh"
#include "cuda/residual.cuh"

namespace gpt2::cuda {
namespace {

std::string mib(size_t bytes) {
  char buf[64];
  snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / (1024.0 * 1024.0));
  return buf;
}

int parse_device_index(const std::string& device) {
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) == 0 && device.size() > 5 &&
      device.find_first_not_of("0123456789", 5) == std::string::npos)
    return std::atoi(device.c_str() + 5);
  throw std::invalid_argument("device must be 'cuda' or 'cuda:<index>', got '" + device + "'");
}

class CudaBackend final : public Backend<float> {
 public:
  explicit CudaBackend(int device) {
    const std::string why = device_status(device);
    if (!why.empty()) throw std::runtime_error(why);
    CUDA_CHECK(cudaSetDevice(device));
    device_ = device;
#if !GPT2CORE_EMU
    const char* tf32 = std::getenv("GPT2CORE_CUDA_TF32");
    gpt2core::seams::set_matmul_tf32(tf32 && tf32[0] == '1');
#endif
    const char* att = std::getenv("GPT2CORE_CUDA_ATTENTION");
    if (att && std::string(att) == "naive") naive_attention_ = true;
    else if (att && *att && std::string(att) != "flash")
      throw std::invalid_argument(std::string("GPT2CORE_CUDA_ATTENTION must be 'flash' (default) or 'naive', got '") +
                                  att + "'");
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&norm_work_), (kNormBlocks + 1) * sizeof(double)));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&valid_), sizeof(int)));
  }
  ~CudaBackend() override {
    // destructors only log
    for (void* p : {static_cast<void*>(norm_work_), static_cast<void*>(valid_), static_cast<void*>(scratch_),
                    static_cast<void*>(iwork_)})
      if (p) {
        const cudaError_t e = cudaFree(p);
        if (e != cudaSuccess && e != cudaErrorCudartUnloading)
          fprintf(stderr, "gpt2core: cudaFree failed in ~CudaBackend: %s\n", cudaGetErrorString(e));
      }
  }

  const char* name() const override { return "cuda"; }

  float* alloc(size_t n) override { return static_cast<float*>(alloc_bytes(n * sizeof(float))); }
  void free(float* p) override { release(p); }
  int32_t* alloc_i32(size_t n) override { return static_cast<int32_t*>(alloc_bytes(n * sizeof(int32_t))); }
  void free_i32(int32_t* p) override { release(p); }
  void zero(float* p, size_t n) override {
    if (n) CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(float), stream_));
    sync();  // zero_grad may be followed by host reads of the gradients
  }
  void to_device_i32(int32_t* dst, const int32_t* src, size_t n) override {
    if (n) CUDA_CHECK(cudaMemcpy(dst, src, n * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  void to_host(float* dst, const float* src, size_t n) override {
    if (n) CUDA_CHECK(cudaMemcpy(dst, src, n * sizeof(float), cudaMemcpyDeviceToHost));
  }

  void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T,
                       int C) override {
    cuda::encoder_forward(out, inp, wte, wpe, B, T, C, stream_);
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T,
                        int C) override {
    const size_t BT = size_t(B) * T;
    std::vector<int32_t> host(BT);
    if (BT) CUDA_CHECK(cudaMemcpy(host.data(), inp, BT * sizeof(int32_t), cudaMemcpyDeviceToHost));
    cuda::encoder_backward(dwte, dwpe, dout, host.data(), int_work(3 * BT + 1), B, T, C, stream_);
    sync();  // the last op of backward
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b, int N,
                         int C) override {
    cuda::layernorm_forward(out, mean, rstd, inp, w, b, N, C, stream_);
  }
  void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                          const float* mean, const float* rstd, int N, int C) override {
    float* s = scratch(2 * size_t(column_chunks(N)) * C);
    cuda::layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, s, N, C, stream_);
  }
  void matmul_forward(float* out, const float* inp, const float* w, const float* bias, int N, int C, int OC) override {
    cuda::matmul_forward(out, inp, w, bias, N, C, OC, stream_);
  }
  void matmul_backward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp, const float* w, int N,
                       int C, int OC) override {
    float* s = dbias ? scratch(size_t(column_chunks(N)) * OC) : nullptr;
    cuda::matmul_backward(dinp, dw, dbias, dout, inp, w, s, N, C, OC, stream_);
  }
  // flash (default): att is the logsumexp of each query row, (B, NH, T); the T x T matrix never exists.
  // naive: att holds the softmax probabilities (B, NH, T, T), as on the CPU.
  size_t attention_state_size(int B, int NH, int T) const override {
    return naive_attention_ ? size_t(B) * NH * T * T : size_t(B) * NH * T;
  }
  void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) override {
    if (naive_attention_) {
      cuda::attention_naive_forward(out, att, qkv, B, T, C, NH, stream_);
      return;
    }
    cuda::attention_forward(out, att, qkv, B, T, C, NH, stream_);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* att, int B,
                          int T, int C, int NH) override {
    if (naive_attention_) {
      float* ds = scratch(size_t(B) * NH * T * T);
      cuda::attention_naive_backward(dqkv, dout, qkv, att, ds, B, T, C, NH, stream_);
      return;
    }
    float* D = scratch(size_t(B) * NH * T);
    cuda::attention_backward(dqkv, dout, qkv, out, att, D, B, T, C, NH, stream_);
  }
  void gelu_forward(float* out, const float* inp, size_t N) override { cuda::gelu_forward(out, inp, N, stream_); }
  void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N) override {
    cuda::gelu_backward(dinp, inp, dout, N, stream_);
  }
  void residual_forward(float* out, const float* a, const float* b, size_t N) override {
    cuda::residual_forward(out, a, b, N, stream_);
  }
  long crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int N, int V,
                            int Vp) override {
    return cuda::crossentropy_forward(losses, lse, logits, targets, valid_, N, V, Vp, stream_);
  }
  void crossentropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, float dloss, int N, int V,
                                     int Vp) override {
    cuda::crossentropy_backward_inplace(logits, lse, targets, dloss, N, V, Vp, stream_);
  }
  double sum_squares(const float* p, size_t n) override { return cuda::sum_squares(p, n, norm_work_, stream_); }
  void adamw(float* param, const float* grad, float* m, float* v, size_t n, float lr, float beta1, float beta2,
             float eps, float decay, float grad_scale, float bc1, float bc2) override {
    cuda::adamw_update(param, nullptr, grad, m, v, n, AdamWParams{lr, beta1, beta2, eps, decay, grad_scale, bc1, bc2, 0, 0}, stream_);
    sync();  // parameters are read on the host through numpy views
  }

 private:
  void sync() { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  void* alloc_bytes(size_t bytes) {
    const size_t want = bytes ? bytes : 1;
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && want > free_b)
      throw std::runtime_error("CUDA out of memory: asked for " + mib(want) + " with " + mib(free_b) + " free of " +
                               mib(total_b) + " on cuda:" + std::to_string(device_) +
                               "; try a smaller micro-batch (B) or sequence length (T)");
    void* p = nullptr;
    const cudaError_t e = cudaMallocManaged(&p, want, cudaMemAttachGlobal);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw std::runtime_error("CUDA out of memory: asked for " + mib(want) + " on cuda:" + std::to_string(device_) +
                               "; try a smaller micro-batch (B) or sequence length (T)");
    }
    CUDA_CHECK(e);
    CUDA_CHECK(cudaMemset(p, 0, want));
    return p;
  }
  // Never throws: the model frees from its destructor (at interpreter exit the CUDA runtime may already be
  // unloading, which is not worth a message).
  void release(void* p) {
    if (!p) return;
    cudaError_t e = cudaStreamSynchronize(stream_);
    if (e == cudaSuccess) e = cudaFree(p);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      if (e != cudaErrorCudartUnloading)
        fprintf(stderr, "gpt2core: freeing CUDA memory failed: %s\n", cudaGetErrorString(e));
    }
  }
  // Device scratch of at least n floats / ints, reused between ops (one stream, so ordered).
  float* scratch(size_t n) {
    if (n > scratch_cap_) {
      sync();
      if (scratch_) CUDA_CHECK(cudaFree(scratch_));
      scratch_ = nullptr;
      CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_), n * sizeof(float)));
      scratch_cap_ = n;
    }
    return scratch_;
  }
  int* int_work(size_t n) {
    if (n > iwork_cap_) {
      sync();
      if (iwork_) CUDA_CHECK(cudaFree(iwork_));
      iwork_ = nullptr;
      CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&iwork_), n * sizeof(int)));
      iwork_cap_ = n;
    }
    return iwork_;
  }

  int device_ = 0;
  bool naive_attention_ = false;  // GPT2CORE_CUDA_ATTENTION=naive: materialised T x T attention
  cudaStream_t stream_ = nullptr;  // the default stream
  double* norm_work_ = nullptr;
  int* valid_ = nullptr;
  float* scratch_ = nullptr;
  size_t scratch_cap_ = 0;
  int* iwork_ = nullptr;
  size_t iwork_cap_ = 0;
};

}  // namespace

std::string device_status(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no usable CUDA device: cudaGetDeviceCount failed with ") + cudaGetErrorName(e) + " (" +
           cudaGetErrorString(e) + ")";
  }
  if (count == 0) return "no CUDA device found (cudaGetDeviceCount returned 0)";
  if (device < 0) return "";  // no kernel-image check: it would create a context on the current device
  if (device >= count)
    return "device 'cuda:" + std::to_string(device) + "' does not exist (" + std::to_string(count) +
           " CUDA device(s) visible)";
#if !GPT2CORE_EMU
  // a GPU this build has no kernels for (e.g. sm_75 with the default archs) fails here, not at the first launch
  if (const cudaError_t e2 = cudaSetDevice(device); e2 != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("cudaSetDevice(") + std::to_string(device) + ") failed: " + cudaGetErrorString(e2);
  }
  cudaFuncAttributes attr;
  const cudaError_t k = cudaFuncGetAttributes(&attr, residual_forward_kernel<float>);
  if (k != cudaSuccess) {
    (void)cudaGetLastError();
    int major = 0, minor = 0;
    (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    return "this build of gpt2core has no CUDA kernels for this GPU (sm_" + std::to_string(major) +
           std::to_string(minor) + "): " + cudaGetErrorString(k) + "; reinstall with GPT2CORE_CUDA_ARCHS=" +
           std::to_string(major) + std::to_string(minor);
  }
#endif
  return "";
}

std::unique_ptr<Backend<float>> make_backend(const std::string& device) {
  return std::make_unique<CudaBackend>(parse_device_index(device));
}

}  // namespace gpt2::cuda
