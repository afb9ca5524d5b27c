// bf16 GEMM for Muon's Newton-Schulz on the CPU (the GPU's runs in bf16 through cuBLASLt, cuda/muon.cuh):
//   C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) + beta * C      (row-major fp32 in and out, as cpu/blas.h's gemm)
// with every element of op(A) and op(B) rounded to bf16 (nearest even) and the products summed in fp32. On a CPU
// with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later: cpuid at run time, no -march) the inputs are
// packed as bf16 pairs and multiplied by VDPBF16PS (two bf16 products added into an fp32 lane per instruction:
// twice the FMAs of fp32); elsewhere the rounded inputs go through BLAS's sgemm: the same rounding, another
// summation order. Single-threaded: the caller splits work over threads (Newton-Schulz: one matrix per thread).
#pragma once

namespace gpt2::cpu {

// Whether gemm_bf16 runs the AVX512-BF16 kernel on this CPU (false: the rounded inputs through sgemm).
bool has_avx512_bf16();

void gemm_bf16(bool transA, bool transB, int M, int N, int K, float alpha, const float* A, int lda, const float* B,
               int ldb, float beta, float* C, int ldc);

}  // namespace gpt2::cpu
