// The CUDA backend: gpt2::Backend<float>, Backend<bf16> and Backend<f16> over the kernels of csrc/cuda/*.cuh and the library seams.
// The same source compiles with nvcc (into gpt2core._C) and with g++ against csrc/emu (the test-only
// emulated module), where "device memory" is host memory and kernels run on fibers.
//
// Memory: every buffer the model allocates (parameters, gradients, AdamW moments, activations) is CUDA
// managed memory, so the numpy views the Python layer keeps over parameters and gradients stay valid on
// the host (a host read through a view migrates the pages it touches; the training loop reads none per step).
// That needs concurrent managed access (the host may touch managed memory while kernels run, which the
// asynchronous step allows): Linux on Pascal or newer. Windows and WSL lack it, and there a host access
// during a kernel is an error, so the backend refuses to start on such a device with a message saying why. Kernels run on one stream the backend creates (a blocking one: the synchronous copies of
// to_host & co. wait for it). The ops themselves never wait for the GPU, except those that return values
// or that the host reads after (zero_grad, step_result, cast_params); the model calls synchronize() at the end of
// backward. So forward_backward's ops can be captured into a CUDA graph (capture_begin/end): while capturing,
// any host synchronisation fails, and growing a scratch buffer (which needs one) is refused.
// Out-of-memory is checked before allocating and reported with the size asked for.
#include "cuda/backend_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "cuda/adamw.cuh"
#include "cuda/muon.cuh"
#include "cuda/attention.cuh"
#include "cuda/attention_naive.cuh"
#include "cuda/attention_tc.cuh"
#include "cuda/classifier.cuh"
#include "cuda/common.cuh"
#include "cuda/encoder.cuh"
#include "cuda/fp8.cuh"
#include "cuda/gelu.cuh"
#include "cuda/global_norm.cuh"
#include "cuda/infer.cuh"
#include "cuda/layernorm.cuh"
#include "cuda/matmul.cuh"
#include "cuda/reduce.cuh"
#include "cuda/relu2.cuh"
#include "cuda/residual.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "cuda/seams.h"
#include "model/sampling.h"
#if !GPT2CORE_EMU
#include "cuda/seams_cudnn.h"
#endif

namespace gpt2::cuda {
namespace {

namespace seams = gpt2core::seams;

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

// The kernels' element type for a model type: float, or NVIDIA's __nv_bfloat16 for gpt2::bf16 and __half for
// gpt2::f16 (the same 16 bits).
template <class T>
struct KernelTypeOf {
  using type = float;
};
template <>
struct KernelTypeOf<::gpt2::bf16> {
  using type = __nv_bfloat16;
};
template <>
struct KernelTypeOf<::gpt2::f16> {
  using type = __half;
};

// T: the model's storage type (float, or bf16 / f16 for mixed precision); master weights, gradients, AdamW state
// and statistics are float either way.
template <class T>
class CudaBackend final : public Backend<T> {
  using K = typename KernelTypeOf<T>::type;
  static_assert(sizeof(K) == sizeof(T), "kernel and model element types must have the same size");
  static K* k(T* p) { return reinterpret_cast<K*>(p); }
  static const K* k(const T* p) { return reinterpret_cast<const K*>(p); }

 public:
  CudaBackend(int device, const BackendOptions& options)
      : matmul_mode_{options.tf32 && !kIs16Bit<K>, options.matmul_tuning, &bgradb_},
        fused_(options.fused),
        deterministic_(options.deterministic) {
    const std::string why = device_status(device);
    if (!why.empty()) throw std::runtime_error(why);
    CUDA_CHECK(cudaSetDevice(device));
    int concurrent_managed = 0;
    if (cudaDeviceGetAttribute(&concurrent_managed, cudaDevAttrConcurrentManagedAccess, device) != cudaSuccess)
      (void)cudaGetLastError();
    if (!concurrent_managed)
      throw std::runtime_error("cuda:" + std::to_string(device) +
                               " lacks concurrent managed memory access (as on Windows and WSL, or GPUs before Pascal): "
                               "gpt2core's CUDA backend keeps parameters and gradients in managed memory that numpy "
                               "views read while kernels may run, which such a platform forbids; use Linux");
    // 16-bit models need the GPU's tensor cores for their type: bf16 from sm_80 (cuBLASLt has no bf16 GEMMs
    // before, and the bf16 attention kernels' mma instructions trap there), fp16 from sm_70
    if (const int cc = device_capability(device); kIs16Bit<K> && cc >= 0 && cc < (kIsBF16<K> ? 80 : 70))
      throw std::runtime_error(std::string(kIsBF16<K> ? "bf16 mixed precision needs an sm_80+ GPU"
                                                      : "fp16 mixed precision needs an sm_70+ GPU (fp16 tensor cores)") +
                               "; cuda:" + std::to_string(device) + " is sm_" + std::to_string(cc) +
                               (kIsBF16<K> && cc >= 70 ? ": use fp16" : ": use fp32"));
    device_ = device;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device));
    CUDA_CHECK(cudaStreamCreate(&stream_));  // not the legacy default stream, which cannot be captured
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&norm_work_), kNormBlocks * sizeof(double)));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&step_dev_), sizeof(StepState)));
    set_loss_scaler(LossScaler{});  // scale 1: no loss scaling until the model turns it on
    // auto: cuDNN's fused attention for bf16 and fp16 models on an sm_80+ GPU (cuDNN's SDPA needs one) when it
    // is compiled in and agrees with our flash kernel on a small problem (checked here, once); our flash kernel
    // otherwise. An explicit 'cudnn' must pass the same check or the backend refuses to start.
    using A = BackendOptions::Attention;
    attention_ = options.attention == A::Naive ? Attention::Naive
                 : options.attention == A::Cudnn ? Attention::Cudnn : Attention::Flash;
    // the cause is the precision, whatever the build has. Not under the emulator: the attention seam's CPU
    // implementation takes fp32, which is how the emulator tests run the seam's path in fp32 (compare_ops.py)
    if (attention_ == Attention::Cudnn && !kIs16Bit<K> && !GPT2CORE_EMU)
      throw std::runtime_error("attention='cudnn' needs a bf16 or fp16 model: cuDNN's fused SDPA has no fp32 inputs "
                               "(use precision='bf16' on sm_80+ or 'fp16', or attention='flash')");
    if (attention_ == Attention::Cudnn ||
        (options.attention == A::Auto && kIs16Bit<K> && !GPT2CORE_EMU && device_capability(device) >= 80)) {
      const std::string why = check_cudnn_attention();
      if (why.empty()) {
        attention_ = Attention::Cudnn;
      } else if (attention_ == Attention::Cudnn) {
        throw std::runtime_error("attention='cudnn': " + why);
      } else {
        attention_ = Attention::Flash;
        if (why.find("built without") == std::string::npos)
          fprintf(stderr, "gpt2core: cuDNN attention not used (%s); using gpt2core's flash attention\n", why.c_str());
      }
    }
  }
  // Every model entry point (GPT2Model) calls this first: the ops, the library seams (keyed on the current device)
  // and the allocations then use this backend's GPU whatever another model or library made current.
  void make_current() override { CUDA_CHECK(cudaSetDevice(device_)); }
  ~CudaBackend() override {
    // destructors only log
    auto check = [](cudaError_t e, const char* what) {
      if (e != cudaSuccess && e != cudaErrorCudartUnloading)
        fprintf(stderr, "gpt2core: %s failed in ~CudaBackend: %s\n", what, cudaGetErrorString(e));
    };
    for (void* p : {static_cast<void*>(norm_work_), static_cast<void*>(step_dev_), static_cast<void*>(scratch_.p),
                    static_cast<void*>(buckets_.p), static_cast<void*>(tscratch_.p), static_cast<void*>(sample_args_.p),
                    static_cast<void*>(sample_ids_.p)})
      if (p) check(cudaFree(p), "cudaFree");
    for (float* p : rope_tables_) check(cudaFree(p), "cudaFree");
    for (PinnedStaging* st : {&batch_staging_, &step_staging_, &offload_staging_}) {
      if (st->p) check(cudaFreeHost(st->p), "cudaFreeHost");
      if (st->copied) check(cudaEventDestroy(st->copied), "cudaEventDestroy");
    }
#if !GPT2CORE_EMU
    // the library workspaces of this backend's stream (cudaFree waits for the work that uses them)
    seams::release_matmul_stream(stream_);
    seams::release_attention_stream(stream_);
#endif
    if (copy_stream_) check(cudaStreamSynchronize(copy_stream_), "cudaStreamSynchronize");
    if (copy_stream_) check(cudaStreamDestroy(copy_stream_), "cudaStreamDestroy");
    if (grads_final_) check(cudaEventDestroy(grads_final_), "cudaEventDestroy");
    if (stream_) check(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }

  const char* name() const override { return "cuda"; }
  void* native_stream() override { return stream_; }

  T* alloc(size_t n) override { return static_cast<T*>(alloc_bytes(n * sizeof(T))); }
  void free(T* p) override { release(p); }
  float* alloc_master(size_t n) override { return static_cast<float*>(alloc_bytes(n * sizeof(float))); }
  void free_master(float* p) override { release(p); }
  int32_t* alloc_i32(size_t n) override { return static_cast<int32_t*>(alloc_bytes(n * sizeof(int32_t))); }
  void free_i32(int32_t* p) override { release(p); }
  // activation scratch, cleared between ops inside backward: stream-ordered, no host sync
  void zero(T* p, size_t n) override {
    if (n) CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(T), stream_));
  }
  // gradients (zero_grad): synchronised, since the host may read them through numpy views next
  void zero_master(float* p, size_t n) override {
    if (n) CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(float), stream_));
    sync();
  }
  void accumulate_master(float* dst, const float* src, size_t n, bool add) override {
    if (!n) return;
    if (add) cuda::residual_forward(dst, dst, src, n, stream_);  // fp32 in, fp32 out: one rounding, as on the CPU
    else CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  void to_device_i32(int32_t* dst, const int32_t* src, size_t n) override {
    if (dst == bucketed_) bucketed_ = nullptr;  // the token buckets no longer describe dst
    if (n) CUDA_CHECK(cudaMemcpy(dst, src, n * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  void synchronize() override { sync(); }
  // Through pinned staging memory, asynchronously: [inputs | targets | token buckets of the inputs] are
  // written to the staging buffer, then copied to the device on the stream.
  void upload_batch(int32_t* dev_inp, int32_t* dev_targets, const int32_t* inp, const int32_t* targets, int B,
                    int Tn) override {
    const int BT = B * Tn;
    if (BT <= 0) return;
    const size_t nb = cuda::encoder_buckets_size(BT);
    int32_t* host = static_cast<int32_t*>(batch_staging_.reserve((2 * size_t(BT) + nb) * sizeof(int32_t)));
    int* dev_buckets = grow(buckets_, nb);
    std::memcpy(host, inp, BT * sizeof(int32_t));
    if (targets) std::memcpy(host + BT, targets, BT * sizeof(int32_t));
    const size_t used = cuda::encoder_buckets(inp, BT, host + 2 * size_t(BT));
    const cudaMemcpyKind h2d = cudaMemcpyHostToDevice;
    CUDA_CHECK(cudaMemcpyAsync(dev_inp, host, BT * sizeof(int32_t), h2d, stream_));
    if (targets) CUDA_CHECK(cudaMemcpyAsync(dev_targets, host + BT, BT * sizeof(int32_t), h2d, stream_));
    CUDA_CHECK(cudaMemcpyAsync(dev_buckets, host + 2 * size_t(BT), used * sizeof(int), h2d, stream_));
    batch_staging_.sent(stream_);
    bucketed_ = dev_inp;
    bucketed_BT_ = BT;
  }
  void to_host(T* dst, const T* src, size_t n) override {
    if (n) CUDA_CHECK(cudaMemcpy(dst, src, n * sizeof(T), cudaMemcpyDeviceToHost));
  }
  void to_host_master(float* dst, const float* src, size_t n) override {
    if (n) CUDA_CHECK(cudaMemcpy(dst, src, n * sizeof(float), cudaMemcpyDeviceToHost));
  }

  void encoder_forward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn, int C) override {
    cuda::encoder_forward(k(out), inp, k(wte), k(wpe), B, Tn, C, stream_);
  }
  // The token buckets were built when inp was uploaded (upload_batch), so nothing is read back here.
  void encoder_backward(float* dwte, float* dwpe, const T* dout, const int32_t* inp, int B, int Tn, int C) override {
    if (inp != bucketed_ || B * Tn != bucketed_BT_)
      throw std::logic_error("CUDA encoder_backward: the token ids were not uploaded with upload_batch");
    cuda::encoder_backward(dwte, dwpe, k(dout), buckets_.p, B, Tn, C, stream_);
  }
  void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* w, const T* b, int N,
                         int C) override {
    cuda::layernorm_forward(k(out), mean, rstd, k(inp), k(w), k(b), N, C, stream_);
  }
  void layernorm_backward(T* dinp, float* dw, float* db, const T* dout, const T* inp, const T* w, const float* mean,
                          const float* rstd, int N, int C, InputGrad mode) override {
    float* s = scratch(2 * size_t(column_chunks(N, C)) * C);
    cuda::layernorm_backward(k(dinp), dw, db, k(dout), k(inp), k(w), mean, rstd, s, N, C, mode == InputGrad::Add,
                             stream_);
  }
  // fused (default): one kernel reads a and b once and writes the residual and its layernorm;
  // fused=false: the two separate kernels (the "no fusion" rung of the speed ladder).
  void residual_layernorm_forward(T* residual, T* out, float* mean, float* rstd, const T* a, const T* b, const T* w,
                                  const T* bias, int N, int C) override {
    if (!fused_) {
      Backend<T>::residual_layernorm_forward(residual, out, mean, rstd, a, b, w, bias, N, C);
      return;
    }
    cuda::residual_layernorm_forward(k(residual), k(out), mean, rstd, k(a), k(b), k(w), k(bias), N, C, stream_);
  }
  void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) override {
    cuda::matmul_forward(k(out), k(inp), k(w), k(bias), N, C, OC, matmul_mode_, stream_);
  }
  void matmul_backward(T* dinp, float* dw, float* dbias, const T* dout, const T* inp, const T* w, int N, int C,
                       int OC, InputGrad mode) override {
    float* s = dbias ? scratch(size_t(column_chunks(N, OC)) * OC) : nullptr;
    cuda::matmul_backward(k(dinp), dw, dbias, k(dout), k(inp), k(w), s, N, C, OC, mode == InputGrad::Add, matmul_mode_,
                          stream_);
  }
  // fused (default): GELU in the matmul's epilogue (cuBLASLt GELU_AUX_BIAS forward, DGELU backward; tanh GELU,
  // see matmul.cuh), so the (N, 4C) activation is not read back by a separate kernel; fused=false, or a
  // GELU matrix cuBLASLt cannot take (leading dimension not a multiple of 8, unaligned): matmul + GELU kernels.
  // A fused epilogue the library refuses at run time (matmul.cuh) turns fusion of that direction off for this
  // backend, with one message: the first (uncaptured) run of a step finds out, so a graph never holds the attempt.
  void matmul_gelu_forward(T* pre, T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) override {
    if (fused_ && !gelu_refused_[0] && cuda::gelu_epilogue_ok(OC, pre, out)) {
      if (cuda::matmul_gelu_forward(k(pre), k(out), k(inp), k(w), k(bias), N, C, OC, matmul_mode_, stream_)) return;
      refuse_gelu_epilogue(0);
    }
    Backend<T>::matmul_gelu_forward(pre, out, inp, w, bias, N, C, OC);
  }
  void gelu_matmul_backward(T* dpre, float* dw, float* dbias, const T* dout, const T* pre, const T* act, const T* w,
                            T* scratch_t, int N, int C, int OC) override {
    if (fused_ && !gelu_refused_[1] && cuda::gelu_epilogue_ok(C, dpre, pre)) {
      float* s = dbias ? scratch(size_t(column_chunks(N, OC)) * OC) : nullptr;
      if (cuda::gelu_matmul_backward(k(dpre), dw, dbias, k(dout), k(pre), k(act), k(w), s, N, C, OC, matmul_mode_,
                                     stream_))
        return;
      refuse_gelu_epilogue(1);
    }
    Backend<T>::gelu_matmul_backward(dpre, dw, dbias, dout, pre, act, w, scratch_t, N, C, OC);
  }
  // FP8 Linear (backend.h; fp8.cuh quantises with current per-tensor scales, matmul.cuh's fp8_linear_* multiply
  // through the cuBLASLt seam's FP8 path). bf16 models only: the FP8 matmuls write bf16 (or fp32 dW) and take a
  // bf16 bias.
  uint8_t* alloc_fp8(size_t bytes) override { return static_cast<uint8_t*>(alloc_bytes(bytes)); }
  void free_fp8(uint8_t* p) override { release(p); }
  void fp8_quantize(Fp8Tensor out, const T* x, int rows, int cols, Fp8Kind kind) override {
    cuda::fp8_quantize(out.q, out.qt, out.meta, k(x), rows, cols, kind, stream_);
  }
  void fp8_linear_forward(T* out, Fp8Tensor inp8, const T* inp, const Fp8Tensor& w8, const T* bias, int N, int C,
                          int OC) override {
    fp8_needs_bf16();
    cuda::fp8_quantize(inp8.q, inp8.qt, inp8.meta, k(inp), N, C, Fp8Kind::E4M3, stream_);
    cuda::fp8_linear_forward(k(out), inp8.q, inp8.meta, w8.q, w8.meta, k(bias), N, C, OC, matmul_mode_, stream_);
  }
  void fp8_linear_backward(T* dinp, float* dw, float* dbias, Fp8Tensor dout8, const T* dout, const Fp8Tensor& inp8,
                           const Fp8Tensor& w8, int N, int C, int OC, InputGrad mode) override {
    fp8_needs_bf16();
    cuda::fp8_quantize(dout8.q, dout8.qt, dout8.meta, k(dout), N, OC, Fp8Kind::E5M2, stream_);
    cuda::fp8_linear_backward(k(dinp), dw, dout8.q, dout8.qt, dout8.meta, inp8.qt, inp8.meta, w8.qt, w8.meta, N, C,
                              OC, mode == InputGrad::Add, matmul_mode_, stream_);
    if (dbias && N > 0 && OC > 0)  // from the unquantised gradient
      cuda::column_sum_accumulate(dbias, k(dout), scratch(size_t(column_chunks(N, OC)) * OC), N, OC, stream_);
  }
  // flash and cudnn: att is the logsumexp of each query row, (B, NH, T); the T x T matrix never exists.  // flash and cudnn: att is the logsumexp of each query row, (B, NH, T); the T x T matrix never exists.
  // naive: att holds the softmax probabilities (B, NH, T, T), as on the CPU.
  size_t attention_state_size(int B, int NH, int Tn) const override {
    return attention_ == Attention::Naive ? size_t(B) * NH * Tn * Tn : size_t(B) * NH * Tn;
  }
  void attention_forward(T* out, float* att, const T* qkv, int B, int Tn, int C, int NH) override {
    switch (attention_) {
      case Attention::Naive: cuda::attention_naive_forward(k(out), att, k(qkv), B, Tn, C, NH, stream_); return;
      case Attention::Flash:  // 16-bit: tensor cores (attention_tc.cuh) where its tiles fit; fp32: CUDA cores
        if constexpr (kIs16Bit<K>)
          if (cuda::attention_tc_fits(C / NH))
            return cuda::attention_tc_forward(k(out), att, k(qkv), B, Tn, C, NH, stream_);
        cuda::attention_forward(k(out), att, k(qkv), B, Tn, C, NH, stream_);
        return;
      case Attention::Cudnn: check_attention_seam(seams::attention_forward(sdpa_forward(out, att, qkv, B, Tn, C, NH)),
                                                  "forward");
                             return;
    }
  }
  // The attention seam (cuDNN) and the tensor-core kernels write dQ, dK, dV straight into dqkv (seams_cudnn.cu:
  // through strided views of it); the other kernels accumulate, so for them InputGrad::Write clears dqkv first.
  void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const float* att, int B, int Tn, int C,
                          int NH, InputGrad mode) override {
    if constexpr (kIs16Bit<K>)
      if (attention_ == Attention::Flash && cuda::attention_tc_fits(C / NH))
        return cuda::attention_tc_backward(k(dqkv), k(dout), k(qkv), k(out), att,
                                           scratch(cuda::attention_tc_scratch_floats(B, Tn, NH)), B, Tn, C, NH,
                                           mode == InputGrad::Add, stream_);
    if (mode == InputGrad::Write && attention_ != Attention::Cudnn) zero(dqkv, size_t(B) * Tn * 3 * C);
    switch (attention_) {
      case Attention::Naive: {
        float* ds = scratch(size_t(B) * NH * Tn * Tn);
        cuda::attention_naive_backward(k(dqkv), k(dout), k(qkv), att, ds, B, Tn, C, NH, stream_);
        return;
      }
      case Attention::Flash: {  // fp32, or where the tensor-core tiles do not fit: CUDA cores
        float* D = scratch(size_t(B) * NH * Tn);
        cuda::attention_backward(k(dqkv), k(dout), k(qkv), k(out), att, D, B, Tn, C, NH, stream_);
        return;
      }
      case Attention::Cudnn: {
        if (mode == InputGrad::Write) {
          check_attention_seam(seams::attention_backward(sdpa_backward(dqkv, dout, qkv, out, att, B, Tn, C, NH)),
                               "backward");
          return;
        }
        // Add: cuDNN overwrites its output (the seam's contract), so it writes a scratch copy that is then added
        const size_t n = size_t(B) * Tn * 3 * C;
        T* tmp = t_scratch(n);
        check_attention_seam(seams::attention_backward(sdpa_backward(tmp, dout, qkv, out, att, B, Tn, C, NH)),
                             "backward");
        cuda::residual_forward(k(dqkv), k(dqkv), k(tmp), n, stream_);
        return;
      }
    }
  }
  void gelu_forward(T* out, const T* inp, size_t N) override { cuda::gelu_forward(k(out), k(inp), N, stream_); }
  void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N) override {
    cuda::gelu_backward(k(dinp), k(inp), k(dout), N, stream_);
  }
  void residual_forward(T* out, const T* a, const T* b, size_t N) override {
    cuda::residual_forward(k(out), k(a), k(b), N, stream_);
  }
  void crossentropy_forward(float* losses, float* lse, const T* logits, const int32_t* targets, int32_t* n_valid,
                            int N, int V, int Vp) override {
    cuda::crossentropy_forward(losses, lse, k(logits), targets, n_valid, N, V, Vp, stream_);
  }
  void crossentropy_backward(T* logits, const float* lse, const int32_t* targets, const int32_t* n_valid,
                             float grad_scale, int N, int V, int Vp) override {
    cuda::crossentropy_backward(k(logits), lse, targets, n_valid, &step_dev_->scaler.scale, grad_scale, N, V, Vp,
                                stream_);
  }
  void crossentropy_forward_backward(float* losses, float* lse, T* logits, const int32_t* targets, int32_t* n_valid,
                                     float grad_scale, int N, int V, int Vp) override {
    cuda::crossentropy_forward_backward(losses, lse, k(logits), targets, n_valid, &step_dev_->scaler.scale, grad_scale,
                                        N, V, Vp, stream_);
  }
  void loss_accumulate(float* acc, const float* losses, const int32_t* n_valid, int N, float scale) override {
    cuda::loss_accumulate(acc, losses, n_valid, N, scale, stream_);
  }

  // ---- The modern architecture (model/backend.h): rmsnorm.cuh, rope.cuh, relu2.cuh and classifier.cuh's soft-cap.
  void rmsnorm_forward(T* out, float* rstd, const T* inp, int N, int C) override {
    cuda::rmsnorm_forward(k(out), rstd, k(inp), N, C, float(kNormEps), stream_);
  }
  void rmsnorm_backward(T* dinp, const T* dout, const T* inp, const float* rstd, int N, int C,
                        InputGrad mode) override {
    cuda::rmsnorm_backward(k(dinp), k(dout), k(inp), rstd, N, C, mode == InputGrad::Add, stream_);
  }
  // fused (default): one kernel writes the residual and its RMSNorm (as residual_layernorm_forward)
  void residual_rmsnorm_forward(T* residual, T* out, float* rstd, const T* a, const T* b, int N, int C) override {
    if (!fused_) return Backend<T>::residual_rmsnorm_forward(residual, out, rstd, a, b, N, C);
    cuda::residual_rmsnorm_forward(k(residual), k(out), rstd, k(a), k(b), N, C, float(kNormEps), stream_);
  }
  void rope_forward(T* qkv, int B, int Tn, int C, int NH, int t0, float base) override {
    cuda::rope_forward(k(qkv), rope_table(t0 + Tn, C / NH, base), B, Tn, C, NH, t0, stream_);
  }
  void rope_backward(T* dqkv, int B, int Tn, int C, int NH, int t0, float base) override {
    cuda::rope_backward(k(dqkv), rope_table(t0 + Tn, C / NH, base), B, Tn, C, NH, t0, stream_);
  }
  void qk_norm_forward(T* qkv, float* rstd, int B, int Tn, int C, int NH) override {
    cuda::qknorm_forward(k(qkv), rstd, B * Tn, C, NH, float(kNormEps), stream_);
  }
  void qk_norm_backward(T* dqkv, const T* qkv, const float* rstd, int B, int Tn, int C, int NH) override {
    cuda::qknorm_backward(k(dqkv), k(qkv), rstd, B * Tn, C, NH, stream_);
  }
  void relu2_forward(T* out, const T* inp, size_t N) override { cuda::relu2_forward(k(out), k(inp), N, stream_); }
  void relu2_backward(T* dinp, const T* inp, const T* dout, size_t N) override {
    cuda::relu2_backward(k(dinp), k(inp), k(dout), N, true, stream_);
  }
  // cuBLASLt has no ReLU^2 epilogue (relu2.cuh): matmul_relu2_forward is the base class's matmul (bias epilogue) +
  // relu2_forward. The backward writes dL/d act straight into dpre (beta = 0) and turns it into dL/d pre in place:
  // no zero fill, no scratch, one read of pre.
  void relu2_matmul_backward(T* dpre, float* dw, float* dbias, const T* dout, const T* pre, const T* act, const T* w,
                             T* /*scratch*/, int N, int C, int OC) override {
    matmul_backward(dpre, dw, dbias, dout, act, w, N, C, OC, InputGrad::Write);
    cuda::relu2_backward(k(dpre), k(pre), k(dpre), size_t(N) * C, false, stream_);
  }
  void softcap_forward(T* logits, float cap, size_t n) override { cuda::softcap_forward(k(logits), cap, n, stream_); }
  void crossentropy_softcap_backward(T* logits, const float* lse, const int32_t* targets, const int32_t* n_valid,
                                     float grad_scale, float cap, int N, int V, int Vp) override {
    cuda::crossentropy_backward(k(logits), lse, targets, n_valid, &step_dev_->scaler.scale, grad_scale, N, V, Vp,
                                stream_, cap);
  }
  // the fused classifier pass caps the raw logits as it reads them (classifier.cuh)
  void crossentropy_softcap_forward_backward(float* losses, float* lse, T* logits, const int32_t* targets,
                                             int32_t* n_valid, float grad_scale, float cap, int N, int V,
                                             int Vp) override {
    cuda::crossentropy_forward_backward(losses, lse, k(logits), targets, n_valid, &step_dev_->scaler.scale, grad_scale,
                                        N, V, Vp, stream_, cap);
  }

  // ---- KV-cache inference (model/backend.h; kernels in infer.cuh). The cache and the activations are the model's
  // buffers; sampling runs on the device and only the ids (and a flag per row) come back.
  bool has_kv() const override { return true; }
  void encoder_forward_at(T* out, const int32_t* inp, const T* wte, const T* wpe, const int32_t* pos, int B, int Tn,
                          int C) override {
    cuda::encoder_forward_at(k(out), inp, k(wte), k(wpe), pos, B, Tn, C, stream_);
  }
  void attention_kv_forward(T* out, T* kcache, T* vcache, const T* qkv, const int32_t* slot, const int32_t* pos, int B,
                            int Tq, int C, int NH, int maxT) override {
    // split-key decode where the one-block grid leaves SMs idle (cuda::decode_splits); its partials in scratch
    const int splits = cuda::decode_splits(B, Tq, NH, maxT, sms_);
    float* work = splits > 1 ? scratch(cuda::decode_workspace_floats(B, Tq, C, NH, splits)) : nullptr;
    cuda::attention_kv_forward(k(out), k(kcache), k(vcache), k(qkv), slot, pos, B, Tq, C, NH, maxT, splits, work,
                               stream_);
  }
  void gather_rows(T* out, const T* inp, const int32_t* rows, int n, int C) override {
    cuda::gather_rows(k(out), k(inp), rows, n, C, stream_);
  }
  // The table must cover every row's position: the largest pos[b] is read back (B ints, a host sync; decode only)
  void rope_forward_at(T* qkv, const int32_t* pos, int B, int Tn, int C, int NH, float base) override {
    if (B <= 0 || Tn <= 0) return;
    std::vector<int32_t> p(static_cast<size_t>(B));
    CUDA_CHECK(cudaMemcpyAsync(p.data(), pos, p.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    sync();
    int most = 0;
    for (int32_t v : p) most = v > most ? v : most;
    cuda::rope_forward_at(k(qkv), rope_table(most + Tn, C / NH, base), pos, B, Tn, C, NH, stream_);
  }
  // The uniform numbers are model/sampling.h's (sample_uniform, on the host); a row the kernel flags (a nucleus
  // beyond its kSampleCap sorted candidates, or top_k above it) is sampled here from its logits by sample_row.
  void sample_tokens(int32_t* ids, const T* logits, const SampleRow* rows, int n, int V, int Vp) override {
    if (n <= 0) return;
    std::vector<cuda::SampleArgs> args(n);
    for (int i = 0; i < n; i++)
      args[i] = {sample_uniform(rows[i].seed, rows[i].stream, rows[i].step), rows[i].temperature, rows[i].top_k,
                 rows[i].top_p, 0};
    cuda::SampleArgs* dargs = grow(sample_args_, size_t(n));
    int32_t* dout = grow(sample_ids_, 2 * size_t(n));
    CUDA_CHECK(cudaMemcpyAsync(dargs, args.data(), n * sizeof(cuda::SampleArgs), cudaMemcpyHostToDevice, stream_));
    cuda::sample(dout, k(logits), dargs, n, V, Vp, stream_);
    std::vector<int32_t> res(2 * size_t(n));
    CUDA_CHECK(cudaMemcpyAsync(res.data(), dout, res.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    sync();
    std::vector<T> row;
    std::vector<int32_t> idx;
    std::vector<double> p;
    for (int i = 0; i < n; i++) {
      if (!res[size_t(n) + i]) {
        ids[i] = res[i];
        continue;
      }
      row.resize(size_t(V));
      to_host(row.data(), logits + size_t(i) * Vp, size_t(V));
      ids[i] = sample_row(row.data(), V, rows[i], [](T x) {
        if constexpr (std::is_same<T, float>::value) return double(x); else return double(widen(x));
      }, idx, p);
    }
  }

  // CUDA graphs: ThreadLocal capture, so other threads (a communication worker) may keep using CUDA meanwhile.
  bool can_capture() const override { return true; }
  void capture_begin() override {
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
  }
  void* capture_end(bool keep) override {
    capturing_ = false;
    cudaGraph_t graph = nullptr;
    const cudaError_t e = cudaStreamEndCapture(stream_, &graph);
    if (!keep) {  // an op failed inside the capture and its exception is on its way: only clean up
      if (graph) (void)cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      return nullptr;
    }
    if (e != cudaSuccess) {
      const std::string why = cudaGetErrorString(e);
      // CUDA keeps the failed end's error (e.g. cudaErrorStreamCaptureInvalidated or ...Unjoined) as this thread's
      // last error until it is read: read it here, or the first launch check of the direct-run fallback would
      // report it as its own
      (void)cudaGetLastError();
      throw std::runtime_error("CUDA graph capture of the training step failed: " + why);
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t ei = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    CUDA_CHECK(ei);
    return exec;
  }
  void graph_launch(void* graph) override {
    CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), stream_));
  }
  void graph_destroy(void* graph) noexcept override {
    if (cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)) != cudaSuccess) (void)cudaGetLastError();
  }
  // The step's values and the loss scaler, through pinned staging memory into step_dev_ (device memory).
  void set_step_args(const StepArgs& args) override { stage(&step_dev_->args, args); }
  void set_loss_scaler(const LossScaler& scaler) override { stage(&step_dev_->scaler, scaler); }
  void grad_sum_squares(const float* grad, size_t n) override {
    cuda::sum_squares_into(&step_dev_->args.sumsq, grad, n, norm_work_, stream_);
  }
  void loss_scale_update() override { cuda::loss_scale_update(step_dev_, stream_); }
  // the whole model (or a ZeRO-1 shard) in one launch; lr, bias corrections, seed and the gradient scale (clip
  // factor included) come from step_dev_
  void adamw(T* param, float* master, const float* grad, float* m, float* v, size_t base,
             const std::vector<AdamWSegment>& segments, float beta1, float beta2, float eps) override {
    std::vector<AdamWSpan> spans;
    for (const AdamWSegment& s : segments) spans.push_back({s.begin - base, s.end - base, s.decay, s.group});
    AdamWParams p{};
    p.beta1 = beta1, p.beta2 = beta2, p.eps = eps;
    p.offset = base;  // the rounding index of array element i is base + i
    p.step = step_dev_;
    for (size_t i = 0; i < spans.size(); i += kAdamWMaxSegments)
      cuda::adamw_update(k(param), master, grad, m, v, spans.data() + i,
                         int(std::min<size_t>(kAdamWMaxSegments, spans.size() - i)), p, stream_);
  }
  // Muon (model/optimizer.h, cuda/muon.cuh): the step's values from step_dev_; Newton-Schulz in bf16 through
  // the matmul seam
  void muon_momentum(float* grad, float* mom, size_t base, const std::vector<AdamWSegment>& segments,
                     bool nesterov) override {
    std::vector<AdamWSpan> spans;
    for (const AdamWSegment& s : segments) spans.push_back({s.begin - base, s.end - base, 0.0f});
    for (size_t i = 0; i < spans.size(); i += kAdamWMaxSegments)
      cuda::muon_momentum(grad, mom, spans.data() + i, int(std::min<size_t>(kAdamWMaxSegments, spans.size() - i)),
                          nesterov, step_dev_, stream_);
  }
  size_t muon_scratch_size(int rows, int cols) const override { return cuda::muon_ns_scratch_floats(1, rows, cols); }
  void muon_orthogonalize(float* x, float* scratch, int rows, int cols, int steps) override {
    cuda::muon_newton_schulz(x, scratch, 1, rows, cols, steps, norm_work_, step_dev_, stream_);
  }
  // the matrices of one shape in one strided-batched product per step, up to muon_ns_batch_cap at a time (a
  // matrix's bits as alone: cuda/muon.cuh); the products always bf16, whatever `bf16` says
  size_t muon_batch_scratch_size(int batch, int rows, int cols) const override {
    return cuda::muon_ns_scratch_floats(std::min(batch, cuda::muon_ns_batch_cap(rows, cols)), rows, cols);
  }
  void muon_orthogonalize_batch(float* x, float* scratch, int batch, int rows, int cols, int steps,
                                bool /*bf16*/) override {
    const int cap = cuda::muon_ns_batch_cap(rows, cols);
    for (int b = 0; b < batch; b += cap)
      cuda::muon_newton_schulz(x + size_t(b) * rows * cols, scratch, std::min(cap, batch - b), rows, cols, steps,
                               norm_work_, step_dev_, stream_);
  }
  void muon_apply(T* param, float* master, const float* x, size_t n, size_t base, float decay,
                  float scale) override {
    cuda::muon_apply(k(param), master, x, n, base, decay, scale, step_dev_, stream_);
  }
  // Optimizer offload: pinned host memory, and AdamW on the host's cores with adamw_one, the kernel's own per-value
  // function (cuda/adamw.cuh: explicit fmas, so device and host round alike), the rounding of the storage-type
  // copy with round_param (the kernel's); the new parameters go back through pinned staging in one copy.
  bool has_offload() const override { return true; }
  float* alloc_pinned(size_t n) override {
    void* p = nullptr;
    CUDA_CHECK(cudaMallocHost(&p, std::max<size_t>(1, n) * sizeof(float)));
    std::memset(p, 0, std::max<size_t>(1, n) * sizeof(float));
    return static_cast<float*>(p);
  }
  void free_pinned(float* p) override {
    if (p && cudaFreeHost(p) != cudaSuccess) (void)cudaGetLastError();
  }
  void adamw_host(T* param, float* master, const float* grad, float* grad_host, float* m, float* v, size_t base,
                  const std::vector<AdamWSegment>& segments, float beta1, float beta2, float eps,
                  const StepArgs& args, float scale, bool grads_on_host) override {
    if (grads_on_host && copy_stream_) CUDA_CHECK(cudaStreamSynchronize(copy_stream_));  // backward's copies
    if (segments.empty()) return;
    float factor = 0.0f;
    if (!update_factor(args, scale, &factor)) return;  // a non-finite norm writes nothing
    size_t hi = base;
    for (const AdamWSegment& sg : segments) hi = std::max(hi, sg.end);
    const size_t n = hi - base;
    if (!grads_on_host)
      CUDA_CHECK(cudaMemcpyAsync(grad_host, grad, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    sync();
    K* out = static_cast<K*>(offload_staging_.reserve(n * sizeof(K)));
    std::vector<AdamWParams> params(segments.size());  // each segment's values, as the kernel reads them
    for (size_t s = 0; s < segments.size(); s++) {
      AdamWParams& p = params[s];
      p.beta1 = beta1, p.beta2 = beta2, p.eps = eps, p.decay = segments[s].decay, p.grad_scale = factor;
      p.lr = group_lr(args, segments[s].group), p.bc1 = args.bc1, p.bc2 = args.bc2, p.seed = args.seed;
    }
    // one pool for the step: thread t takes the t-th of `threads` equal parts of every segment
    const unsigned threads = std::max(1u, std::min(64u, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; t++)
      pool.emplace_back([&, t] {
        for (size_t s = 0; s < segments.size(); s++) {
          const size_t lo = segments[s].begin - base, len = segments[s].end - segments[s].begin;
          const size_t chunk = (len + threads - 1) / threads, a = lo + std::min(len, t * chunk);
          const size_t b = lo + std::min(len, (t + 1) * chunk);
          for (size_t i = a; i < b; i++) {
            float w = master[i];
            cuda::adamw_one(w, grad_host[i], m[i], v[i], params[s]);
            master[i] = w;
            out[i] = cuda::round_param<K>(w, params[s].seed, base + i);
          }
        }
      });
    for (std::thread& th : pool) th.join();
    CUDA_CHECK(cudaMemcpyAsync(k(param), out, n * sizeof(K), cudaMemcpyHostToDevice, stream_));
    offload_staging_.sent(stream_);
    sync();
  }
  void grads_to_host_async(float* dst, const float* src, size_t n) override {
    if (!copy_stream_) {
      CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
      CUDA_CHECK(cudaEventCreateWithFlags(&grads_final_, cudaEventDisableTiming));
    }
    CUDA_CHECK(cudaEventRecord(grads_final_, stream_));  // after the ops that wrote them
    CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, grads_final_, 0));
    if (n) CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToHost, copy_stream_));
  }
  void params_to_host(T* dst, const T* src, size_t n) override {
    if (n) CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream_));
    sync();
  }
  // sumsq and the scaler behind it (StepArgs ends with sumsq, StepState puts the scaler next): one copy
  StepResult step_result() override {
    static_assert(offsetof(StepArgs, sumsq) + sizeof(double) == sizeof(StepArgs), "sumsq must end StepArgs");
    constexpr size_t from = offsetof(StepState, args) + offsetof(StepArgs, sumsq);
    StepState host{};
    CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(&host) + from, reinterpret_cast<char*>(step_dev_) + from,
                               sizeof(StepState) - from, cudaMemcpyDeviceToHost, stream_));
    sync();  // also: the update is done, the host may read the parameters
    return {host.args.sumsq, host.scaler};
  }
  void cast_params(T* param, const float* master, size_t n, uint32_t seed, size_t offset) override {
    if constexpr (std::is_same_v<T, float>) {
      Backend<T>::cast_params(param, master, n, seed, offset);  // fp32 models have no separate copy
    } else {
      cuda::cast_params(k(param), master, n, seed, offset, stream_);
      sync();
    }
  }

 private:
  enum class Attention { Flash, Naive, Cudnn };
  static constexpr seams::DType kDType = seam_dtype<K>();

  seams::AttentionForwardParams sdpa_forward(T* out, float* stats, const T* qkv, int B, int Tn, int C, int NH) const {
    seams::AttentionForwardParams p;
    p.out = out; p.stats = stats; p.qkv = qkv; p.dtype = kDType;
    p.B = B; p.T = Tn; p.NH = NH; p.HS = C / NH;
    p.scale = 1.0f / sqrtf(float(C / NH));
    p.stream = stream_;
    return p;
  }
  seams::AttentionBackwardParams sdpa_backward(T* dqkv, const T* dout, const T* qkv, const T* out,
                                               const float* stats, int B, int Tn, int C, int NH) const {
    seams::AttentionBackwardParams p;
    p.dqkv = dqkv; p.dout = dout; p.qkv = qkv; p.out = out; p.stats = stats; p.dtype = kDType;
    p.B = B; p.T = Tn; p.NH = NH; p.HS = C / NH;
    p.scale = 1.0f / sqrtf(float(C / NH));
    p.deterministic = deterministic_;
    p.stream = stream_;
    return p;
  }
  static std::string seam_message(cudaError_t e) {
    std::string detail;
#if !GPT2CORE_EMU
    detail = seams::last_attention_error();
#endif
    return std::string(cudaGetErrorString(e)) + (detail.empty() ? "" : " (" + detail + ")");
  }
  static void check_attention_seam(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string("cuDNN attention ") + what + " failed: " + seam_message(e));
  }

  // "" when the attention seam (cuDNN's SDPA on GPUs) agrees with our flash kernel on a small random problem
  // (B=2, T=80, 2 heads of 64: forward output, logsumexp and all of dqkv), else why not.
  std::string check_cudnn_attention() {
    const int B = 2, Tn = 80, NH = 2, C = 128;
    const size_t nqkv = size_t(B) * Tn * 3 * C, nout = size_t(B) * Tn * C, nst = size_t(B) * NH * Tn;
    std::vector<K> h_qkv(nqkv), h_dout(nout);
    uint64_t z = 0x9e3779b97f4a7c15ull;
    auto uniform = [&z]() {  // in [-1, 1)
      z = z * 6364136223846793005ull + 1442695040888963407ull;
      return float(int64_t(z >> 11) % (1 << 20)) / float(1 << 20);
    };
    for (auto& x : h_qkv) x = store_t<K>(2.0f * uniform());
    for (auto& x : h_dout) x = store_t<K>(uniform());
    T *qkv = alloc(nqkv), *dout = alloc(nout), *o1 = alloc(nout), *o2 = alloc(nout), *g1 = alloc(nqkv),
      *g2 = alloc(nqkv);
    float *st1 = alloc_master(nst), *st2 = alloc_master(nst), *D = alloc_master(nst);
    std::string why;
    try {
      CUDA_CHECK(cudaMemcpy(qkv, h_qkv.data(), nqkv * sizeof(K), cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(dout, h_dout.data(), nout * sizeof(K), cudaMemcpyHostToDevice));
      cuda::attention_forward(k(o1), st1, k(qkv), B, Tn, C, NH, stream_);
      cuda::attention_backward(k(g1), k(dout), k(qkv), k(o1), st1, D, B, Tn, C, NH, stream_);
      cudaError_t e = seams::attention_forward(sdpa_forward(o2, st2, qkv, B, Tn, C, NH));
      if (e == cudaSuccess) e = seams::attention_backward(sdpa_backward(g2, dout, qkv, o2, st2, B, Tn, C, NH));
      if (e != cudaSuccess) {
        why = e == cudaErrorNotSupported ? "built without cuDNN frontend: " + seam_message(e) : seam_message(e);
      } else {
        sync();
        // bf16 outputs carry 2^-8 relative rounding and cuDNN rounds P to bf16 for P V: 3e-2 of the largest
        // value (1e-4 for fp32) is far inside that and far from a wrong layout or scale (errors of order 1);
        // fp16 (2^-11) the same multiple of its unit roundoff, 4e-3.
        const double tol = kIsBF16<K> ? 3e-2 : kIsF16<K> ? 4e-3 : 1e-4;
        const double eo = max_rel_diff(o1, o2, nout), eg = max_rel_diff(g1, g2, nqkv);
        const double es = max_rel_diff(st1, st2, nst);
        if (!(eo <= tol && eg <= tol && es <= tol)) {
          char buf[200];
          snprintf(buf, sizeof buf, "it disagrees with the flash kernel (relative max error: out %.3g, dqkv %.3g, "
                   "logsumexp %.3g; tolerance %.3g)", eo, eg, es, tol);
          why = buf;
        }
      }
    } catch (const std::exception& ex) {
      why = ex.what();
    }
    for (T* p : {qkv, dout, o1, o2, g1, g2}) free(p);
    for (float* p : {st1, st2, D}) free_master(p);
    return why;
  }
  // max |a - b| / max |a| over n device values (T or float)
  template <class U>
  double max_rel_diff(const U* a, const U* b, size_t n) {
    using H = std::conditional_t<std::is_same_v<U, float>, float, K>;  // the host view of one value
    std::vector<H> x(n), y(n);
    CUDA_CHECK(cudaMemcpy(x.data(), a, n * sizeof(H), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(y.data(), b, n * sizeof(H), cudaMemcpyDeviceToHost));
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
      d = std::max(d, std::fabs(double(load_f(x[i])) - double(load_f(y[i]))));
      m = std::max(m, std::fabs(double(load_f(x[i]))));
    }
    return m > 0 ? d / m : d;
  }

  void sync() { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  // The rotary table (rope.cuh) of head size HS and base for at least positions [0, rows): computed on the device
  // when first needed, and again (for twice the positions, so a growing KV cache recomputes it a logarithmic number of
  // times) when a longer one or another head size or base is. Never while capturing: the uncaptured first run of a
  // step sizes it. A replaced table is kept until the backend goes (rope_tables_): a graph captured earlier may still
  // read it (its values for its positions do not change).
  const float* rope_table(int rows, int HS, float base) {
    if (rows > rope_rows_ || HS != rope_hs_ || base != rope_base_) {
      if (capturing_) throw std::logic_error("CUDA backend: the rotary table had to be recomputed while capturing a graph");
      int want = HS == rope_hs_ && base == rope_base_ ? std::max(rope_rows_, 1024) : 1024;
      while (want < rows) want *= 2;
      float* t = nullptr;
      CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&t), cuda::rope_table_floats(want, HS) * sizeof(float)));
      rope_tables_.push_back(t);
      cuda::rope_table(t, want, HS, double(base), stream_);
      rope_rows_ = want, rope_hs_ = HS, rope_base_ = base;
    }
    return rope_tables_.back();
  }

  // Remembers (and says once) that the library refused the fused GELU epilogue of direction d (0 forward,
  // 1 backward); the caller runs the separate kernels from now on.
  void refuse_gelu_epilogue(int d) {
    std::string detail;
#if !GPT2CORE_EMU
    detail = seams::last_matmul_error();
#endif
    fprintf(stderr, "gpt2core: the matmul library refused the fused GELU %s epilogue (%s); using matmul + GELU kernels\n",
            d == 0 ? "forward" : "backward", detail.empty() ? "cudaErrorNotSupported" : detail.c_str());
    gelu_refused_[d] = true;
  }

  static constexpr const char* kOomHint = "; try a smaller micro-batch (B) or sequence length (T), or --recompute-gelu";
  void fp8_needs_bf16() const {
    if (!kIsBF16<K>)
      throw std::invalid_argument("FP8 matmuls run in bf16 models (precision fp8 is bf16 mixed precision with FP8 "
                                  "Linear layers); this model is " + std::string(kIsF16<K> ? "fp16" : "fp32"));
  }
  void* alloc_bytes(size_t bytes) {
    const size_t want = bytes ? bytes : 1;
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && want > free_b)
      throw std::runtime_error("CUDA out of memory: asked for " + mib(want) + " with " + mib(free_b) + " free of " +
                               mib(total_b) + " on cuda:" + std::to_string(device_) + kOomHint);
    void* p = nullptr;
    const cudaError_t e = cudaMallocManaged(&p, want, cudaMemAttachGlobal);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw std::runtime_error("CUDA out of memory: asked for " + mib(want) + " on cuda:" + std::to_string(device_) +
                               kOomHint);
    }
    CUDA_CHECK(e);
    // zero-filled before the host may write through a numpy view: cudaMemset alone can return before the GPU
    // has run it, and a late memset would wipe what the host wrote
    CUDA_CHECK(cudaMemsetAsync(p, 0, want, stream_));
    sync();
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
  // Device scratch, reused between ops (one stream, so ordered) and grown when an op needs more.
  template <class U>
  struct Scratch {
    U* p = nullptr;
    size_t cap = 0;
  };
  template <class U>
  U* grow(Scratch<U>& s, size_t n) {
    if (n > s.cap) {
      if (capturing_)  // the run before a capture sizes every buffer: a new size here is a bug, not a retry
        throw std::logic_error("CUDA backend: a scratch buffer had to grow while capturing a graph");
      sync();
      if (s.p) CUDA_CHECK(cudaFree(s.p));
      s.p = nullptr;
      CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&s.p), n * sizeof(U)));
      s.cap = n;
    }
    return s.p;
  }
  // *dst (device memory) = value, copied from step_staging_ in stream order (never while capturing)
  template <class V>
  void stage(V* dst, const V& value) {
    V* host = static_cast<V*>(step_staging_.reserve(sizeof(V)));
    *host = value;
    CUDA_CHECK(cudaMemcpyAsync(dst, host, sizeof(V), cudaMemcpyHostToDevice, stream_));
    step_staging_.sent(stream_);
  }
  float* scratch(size_t n) { return grow(scratch_, n); }
  T* t_scratch(size_t n) { return grow(tscratch_, n); }  // cuDNN attention backward's output (InputGrad::Add only)
  // Pinned host memory that asynchronous host-to-device copies read from. reserve() waits until the copies
  // of the previous use have finished (an event recorded by sent()), so the host runs at most one use ahead
  // of the stream and never overwrites what a copy has yet to read.
  struct PinnedStaging {
    void* p = nullptr;
    size_t cap = 0;
    cudaEvent_t copied = nullptr;
    void* reserve(size_t bytes) {
      if (copied) CUDA_CHECK(cudaEventSynchronize(copied));
      else CUDA_CHECK(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming));
      if (bytes > cap) {
        if (p) CUDA_CHECK(cudaFreeHost(p));
        p = nullptr;
        CUDA_CHECK(cudaMallocHost(&p, bytes));
        cap = bytes;
      }
      return p;
    }
    void sent(cudaStream_t stream) { CUDA_CHECK(cudaEventRecord(copied, stream)); }
  };

  cudaStream_t copy_stream_ = nullptr;  // optimizer offload's gradient copies during backward (grads_to_host_async)
  cudaEvent_t grads_final_ = nullptr;
  int device_ = 0;
  int sms_ = 1;  // the GPU's SM count (the decode attention's split, cuda::decode_splits)
  cuda::BgradbMemo bgradb_;  // the dW shapes whose bias-gradient epilogue the library refused (before matmul_mode_)
  const cuda::MatmulMode matmul_mode_;  // BackendOptions::tf32 (fp32 models) and ::matmul_tuning, for every matmul
  const bool fused_;              // BackendOptions::fused; false: unfused residual + layernorm, matmul + GELU
  const bool deterministic_;      // BackendOptions::deterministic: cuDNN's SDPA backward without atomics
  bool gelu_refused_[2] = {false, false};  // the library refused the fused GELU forward / backward epilogue
  Attention attention_ = Attention::Flash;  // from BackendOptions::attention (auto resolved in the constructor)
  Scratch<T> tscratch_;
  cudaStream_t stream_ = nullptr;
  bool capturing_ = false;
  double* norm_work_ = nullptr;
  Scratch<float> scratch_;
  std::vector<float*> rope_tables_;  // rope_table(): the current table (last) for rope_rows_ positions, and old ones
  int rope_rows_ = 0, rope_hs_ = 0;
  float rope_base_ = 0.0f;
  Scratch<cuda::SampleArgs> sample_args_;  // sample_tokens: the rows' settings
  Scratch<int32_t> sample_ids_;            // sample_tokens: ids, then the host flags
  Scratch<int> buckets_;            // encoder_buckets of the last upload_batch, for encoder_backward
  const int32_t* bucketed_ = nullptr;  // the device token ids buckets_ describes
  int bucketed_BT_ = 0;
  PinnedStaging batch_staging_;     // upload_batch's
  StepState* step_dev_ = nullptr;   // the optimizer step's values (set_step_args) and the loss scaler, device memory
  PinnedStaging step_staging_;
  PinnedStaging offload_staging_;  // adamw_host's new parameters, on their way to the device
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
           std::to_string(minor) + "): " + cudaGetErrorString(k) +
           (major * 10 + minor < 75 && CUDART_VERSION >= 13000
                ? "; CUDA 13 compiles for sm_75 and newer only: build the CUDA 12 package, GPT2CORE_CUDA_MAJOR=12 "
                  "GPT2CORE_CUDA_ARCHS=" + std::to_string(major) + std::to_string(minor) + " (README: Which CUDA major)"
                : "; reinstall with GPT2CORE_CUDA_ARCHS=" + std::to_string(major) + std::to_string(minor));
  }
#endif
  return "";
}

int device_capability(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return major * 10 + minor;
}

std::string device_name(int device) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  return prop.name;
}

void bgradb_refusals(long long* shapes, long long* fallbacks) {
  *shapes = bgradb_counts().shapes.load();
  *fallbacks = bgradb_counts().fallbacks.load();
}

void device_mem_info(int device, size_t* free_bytes, size_t* total_bytes) {
  int before = 0;
  cudaError_t e = cudaGetDevice(&before);
  if (e == cudaSuccess) e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMemGetInfo(free_bytes, total_bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaSetDevice(before);
    throw std::runtime_error("cuda:" + std::to_string(device) + ": cannot read its free memory: " +
                             cudaGetErrorString(e));
  }
  (void)cudaSetDevice(before);
}

std::unique_ptr<Backend<float>> make_backend(const std::string& device, const BackendOptions& options) {
  return std::make_unique<CudaBackend<float>>(parse_device_index(device), options);
}

std::unique_ptr<Backend<::gpt2::bf16>> make_backend_bf16(const std::string& device, const BackendOptions& options) {
  return std::make_unique<CudaBackend<::gpt2::bf16>>(parse_device_index(device), options);
}

std::unique_ptr<Backend<::gpt2::f16>> make_backend_f16(const std::string& device, const BackendOptions& options) {
  return std::make_unique<CudaBackend<::gpt2::f16>>(parse_device_index(device), options);
}

}  // namespace gpt2::cuda
