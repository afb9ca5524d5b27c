// mma.cu: the warp-level matrix instructions of csrc/cuda/mma.cuh (emulated under g++: csrc/emu/mma_emu.h) against
// scalar references, for every fragment layout the attention kernels use:
//   - mma m16n8k16 (bf16 and fp16) and m16n8k8 (fp16) with fragments built lane by lane from the PTX ISA's tables
//     (written out here independently of the emulator), D = C + A B against a double-precision product; and
//     mma_m16n8k16_by_k8, sm_75's fp16 m16n8k16 made of two m16n8k8, from the same k16 fragments;
//   - ldmatrix .x4 and .x4.trans: which element every lane receives, from rows at a padded stride;
//   - ldmatrix feeding mma as the flash kernel does: A rows (non-trans), B from row-major K x N (trans, as V) and
//     from N x K rows (non-trans, as K for Q K^T), in bf16 and fp16, and in fp16 through mma_m16n8k16_by_k8.
// Inputs are random 16-bit values (never zeros); C starts random, so the accumulation is checked too.
#include "emu_test.h"

#include "cuda/mma.cuh"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

using gpt2::cuda::ldmatrix_x4;
using gpt2::cuda::ldmatrix_x4_trans;

template <class T>
__device__ inline uint32_t pair(const T* p) {  // two consecutive 16-bit elements, the first in the low half
  uint16_t lo, hi;
  memcpy(&lo, p, 2);
  memcpy(&hi, p + 1, 2);
  return uint32_t(lo) | (uint32_t(hi) << 16);
}
template <class T>
__device__ inline uint32_t col_pair(const T* B, int k, int n, int ldb) {  // B[k][n], B[k + 1][n]
  uint16_t lo, hi;
  memcpy(&lo, B + k * ldb + n, 2);
  memcpy(&hi, B + (k + 1) * ldb + n, 2);
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// D (16x8) = C + A (16x16) B (16x8), row-major in global memory, fragments from the documented layouts. kByK8: through
// mma_m16n8k16_by_k8 (fp16 only).
template <class T, bool kByK8>
__global__ void mma_k16_kernel(float* D, const T* A, const T* B, const float* C) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  const uint32_t a[4] = {pair(A + g * 16 + 2 * t), pair(A + (g + 8) * 16 + 2 * t), pair(A + g * 16 + 2 * t + 8),
                         pair(A + (g + 8) * 16 + 2 * t + 8)};
  const uint32_t b[2] = {col_pair(B, 2 * t, g, 8), col_pair(B, 2 * t + 8, g, 8)};
  float d[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  if constexpr (kByK8) gpt2::cuda::mma_m16n8k16_by_k8(d, a, b);
  else gpt2::cuda::mma_m16n8k16<T>(d, a, b);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// D (16x8) = C + A (16x8) B (8x8), fp16.
__global__ void mma_k8_kernel(float* D, const __half* A, const __half* B, const float* C) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  const uint32_t a[2] = {pair(A + g * 8 + 2 * t), pair(A + (g + 8) * 8 + 2 * t)};
  float d[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  gpt2::cuda::mma_m16n8k8_f16(d, a, col_pair(B, 2 * t, g, 8));
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// out[(2 * j + trans) * 32 + lane] = register j of ldmatrix(.trans) over 32 rows of 8 values at stride 16.
__global__ void ldmatrix_kernel(uint32_t* out, const uint16_t* M) {
  __shared__ __align__(16) uint16_t sm[32 * 16];
  for (int i = threadIdx.x; i < 32 * 16; i += 32) sm[i] = M[i];
  __syncwarp();
  uint32_t r[4], rt[4];
  ldmatrix_x4(r, sm + threadIdx.x * 16);
  ldmatrix_x4_trans(rt, sm + threadIdx.x * 16);
  for (int j = 0; j < 4; j++) {
    out[(2 * j) * 32 + threadIdx.x] = r[j];
    out[(2 * j + 1) * 32 + threadIdx.x] = rt[j];
  }
}

// D (16x16) = A (16x16) B (16x16) through ldmatrix as attention_tc.cuh loads its operands: A by rows; B either
// from B itself (row-major K x N, like V: .trans) or from Bt = B^T (N x K rows, like K in Q K^T: no trans).
// Shared rows padded to 24 elements (48 bytes: 16-byte aligned, as the kernel's padded tiles).
template <class T, bool kFromTranspose, bool kByK8>
__global__ void ldmatrix_mma_kernel(float* D, const T* A, const T* B) {
  constexpr int S = 24;
  DYNAMIC_SMEM(T, tiles);  // As then Bs, 16 x S each
  T* As = tiles;
  T* Bs = tiles + 16 * S;
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  for (int i = lane; i < 256; i += 32) {
    As[(i / 16) * S + i % 16] = A[i];
    Bs[(i / 16) * S + i % 16] = kFromTranspose ? B[(i % 16) * 16 + i / 16] : B[i];
  }
  __syncwarp();
  uint32_t a[4], r[4];
  ldmatrix_x4(a, As + (lane % 16) * S + (lane / 16) * 8);  // {rows 0-7, 8-15} x {cols 0-7, 8-15}
  if (kFromTranspose)  // Bs = B^T (n, k): matrices {n 0-7: k 0-7, k 8-15}, {n 8-15: k 0-7, k 8-15}
    ldmatrix_x4(r, Bs + ((lane / 16) * 8 + lane % 8) * S + ((lane / 8) % 2) * 8);
  else  // Bs = B (k, n): matrices {k 0-7, k 8-15} x {n 0-7, n 8-15}
    ldmatrix_x4_trans(r, Bs + (((lane / 8) % 2) * 8 + lane % 8) * S + (lane / 16) * 8);
  for (int nt = 0; nt < 2; nt++) {
    const uint32_t b[2] = {r[2 * nt], r[2 * nt + 1]};
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (kByK8) gpt2::cuda::mma_m16n8k16_by_k8(d, a, b);
    else gpt2::cuda::mma_m16n8k16<T>(d, a, b);
    D[g * 16 + nt * 8 + 2 * t] = d[0];
    D[g * 16 + nt * 8 + 2 * t + 1] = d[1];
    D[(g + 8) * 16 + nt * 8 + 2 * t] = d[2];
    D[(g + 8) * 16 + nt * 8 + 2 * t + 1] = d[3];
  }
}

template <class T>
static std::vector<T> random16(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<T> v(n);
  for (auto& x : v) {
    float f = 0.f;
    while (f == 0.f) f = dist(rng);
    x = T(f);
  }
  return v;
}

// An fp32 accumulator C for a product: values in [-10, 10] in steps of 0.01.
static std::vector<float> random_accumulator(size_t n, std::mt19937& rng) {
  std::vector<float> C(n);
  for (auto& c : C) c = float(rng() % 2001) / 100.f - 10.f;
  return C;
}

// The float64 reference of D (16, N) = A (16, K) @ B (K, N) + C (16, N), all row-major, and the magnitude
// |C| + sum_k |a b| that bounds its fp32 rounding.
struct Product {
  std::vector<double> ref, mag;
};
template <class T>
static Product reference_product(const std::vector<T>& A, const std::vector<T>& B, const std::vector<float>& C, int N,
                                 int K) {
  Product p{std::vector<double>(C.begin(), C.end()), std::vector<double>(C.size())};
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < N; c++) {
      p.mag[r * N + c] = std::fabs(C[r * N + c]);
      for (int k = 0; k < K; k++) {
        const double ab = double(float(A[r * K + k])) * double(float(B[k * N + c]));
        p.ref[r * N + c] += ab;
        p.mag[r * N + c] += std::fabs(ab);
      }
    }
  return p;
}

// |got - ref| <= 2^-22 (|C| + sum |a b|): fp32 accumulation of exact products (k <= 16 additions).
static void check_product(const char* what, const std::vector<float>& got, const Product& want) {
  for (size_t i = 0; i < got.size(); i++)
    TEST_TRUE(std::fabs(got[i] - want.ref[i]) <= std::ldexp(want.mag[i], -22), "%s element %zu: got %.9g want %.9g",
              what, i, got[i], want.ref[i]);
  printf("ok %s\n", what);
}

template <class T, bool kByK8 = false>
static void test_k16(const char* what, std::mt19937& rng) {
  const auto A = random16<T>(256, rng), B = random16<T>(128, rng);
  const std::vector<float> C = random_accumulator(128, rng);
  float* dD = device_alloc<float>(128);
  LAUNCH((mma_k16_kernel<T, kByK8>), 1, 32, 0, 0, dD, to_device(A), to_device(B), to_device(C));
  TEST_CUDA(cudaDeviceSynchronize());
  check_product(what, to_host(dD, 128), reference_product(A, B, C, 8, 16));
}

static void test_k8(std::mt19937& rng) {
  const auto A = random16<__half>(128, rng), B = random16<__half>(64, rng);
  const std::vector<float> C = random_accumulator(128, rng);
  float* dD = device_alloc<float>(128);
  LAUNCH(mma_k8_kernel, 1, 32, 0, 0, dD, to_device(A), to_device(B), to_device(C));
  TEST_CUDA(cudaDeviceSynchronize());
  check_product("mma_m16n8k8_f16", to_host(dD, 128), reference_product(A, B, C, 8, 8));
}

static void test_ldmatrix() {
  std::vector<uint16_t> M(32 * 16);
  for (int i = 0; i < 32 * 16; i++) M[i] = uint16_t(1000 + i);  // element (row, col) = 1000 + 16 row + col
  uint32_t* d = device_alloc<uint32_t>(8 * 32);
  LAUNCH(ldmatrix_kernel, 1, 32, 0, 0, d, to_device(M));
  TEST_CUDA(cudaDeviceSynchronize());
  const auto got = to_host(d, 8 * 32);
  auto at = [](int j, int row, int col) { return uint32_t(1000 + 16 * (8 * j + row) + col); };
  for (int j = 0; j < 4; j++)
    for (int lane = 0; lane < 32; lane++) {
      const int g = lane / 4, t = lane % 4;
      const uint32_t want = at(j, g, 2 * t) | (at(j, g, 2 * t + 1) << 16);
      const uint32_t want_t = at(j, 2 * t, g) | (at(j, 2 * t + 1, g) << 16);
      TEST_TRUE(got[(2 * j) * 32 + lane] == want, "ldmatrix x4 reg %d lane %d: %08x want %08x", j, lane,
                got[(2 * j) * 32 + lane], want);
      TEST_TRUE(got[(2 * j + 1) * 32 + lane] == want_t, "ldmatrix x4.trans reg %d lane %d: %08x want %08x", j, lane,
                got[(2 * j + 1) * 32 + lane], want_t);
    }
  printf("ok ldmatrix_x4 and ldmatrix_x4_trans\n");
}

template <class T, bool kFromTranspose, bool kByK8 = false>
static void test_ldmatrix_mma(const char* what, std::mt19937& rng) {
  const auto A = random16<T>(256, rng), B = random16<T>(256, rng);
  float* dD = device_alloc<float>(256);
  LAUNCH((ldmatrix_mma_kernel<T, kFromTranspose, kByK8>), 1, 32, 2 * 16 * 24 * sizeof(T), 0, dD, to_device(A),
         to_device(B));
  TEST_CUDA(cudaDeviceSynchronize());
  check_product(what, to_host(dD, 256), reference_product(A, B, std::vector<float>(256, 0.f), 16, 16));
}

int main() {
  std::mt19937 rng(18);
  test_k16<__nv_bfloat16>("mma_m16n8k16 bf16", rng);
  test_k16<__half>("mma_m16n8k16 f16", rng);
  test_k16<__half, true>("mma_m16n8k16_by_k8 f16 (sm_75)", rng);
  test_k8(rng);
  test_ldmatrix();
  test_ldmatrix_mma<__nv_bfloat16, false>("ldmatrix.trans (B rows, as V) -> mma bf16", rng);
  test_ldmatrix_mma<__nv_bfloat16, true>("ldmatrix (B^T rows, as K) -> mma bf16", rng);
  test_ldmatrix_mma<__half, false>("ldmatrix.trans (B rows, as V) -> mma f16", rng);
  test_ldmatrix_mma<__half, true>("ldmatrix (B^T rows, as K) -> mma f16", rng);
  test_ldmatrix_mma<__half, false, true>("ldmatrix.trans (B rows, as V) -> mma_m16n8k16_by_k8", rng);
  test_ldmatrix_mma<__half, true, true>("ldmatrix (B^T rows, as K) -> mma_m16n8k16_by_k8", rng);
  return 0;
}
