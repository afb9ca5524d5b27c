// bf16_roundtrip.cu: float -> bf16 -> float in a kernel against a bit-exact host reference of
// round-to-nearest-even (with NaN, infinities, ties and denormals), bf16x2 packing, bf16 arithmetic
// (computed in fp32 and rounded), and the same round trip for fp16 on exactly representable values.
#include "emu_test.h"

#include <cmath>
#include <cstdint>
#include <cstring>

__global__ void bf16_roundtrip_kernel(float* out, __nv_bfloat16* packed, const float* __restrict__ inp, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __nv_bfloat16 b = __float2bfloat16(inp[i]);
  packed[i] = b;
  out[i] = __bfloat162float(b);
}

// pairs: (a[i], a[i+1]) packed, multiplied and added in bf16x2; low/high extraction.
__global__ void bf16x2_kernel(float* out, const float* __restrict__ a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (2 * i + 1 >= n) return;
  const __nv_bfloat162 p = __floats2bfloat162_rn(a[2 * i], a[2 * i + 1]);
  const __nv_bfloat162 q = __hadd2(__hmul2(p, p), p);
  out[2 * i] = __low2float(q);
  out[2 * i + 1] = __high2float(q);
}

__global__ void fp16_roundtrip_kernel(float* out, const float* __restrict__ inp, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __half2float(__float2half_rn(inp[i]));
}

static uint32_t bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
// Round-to-nearest-even to the top 16 bits; NaN stays NaN.
static uint16_t ref_bf16(float f) {
  const uint32_t u = bits(f);
  if (std::isnan(f)) return 0x7fc0;
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}
static float ref_round(float f) { return from_bits(uint32_t(ref_bf16(f)) << 16); }

int main() {
  std::vector<float> v = random_floats(4000, 3);
  for (float& x : v) x *= 1000.0f;
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN, 1e-40f, -3e-39f, 3.4e38f,
                            from_bits(0x3f808000u),   // exact tie, even: rounds down to 0x3f80
                            from_bits(0x3f818000u),   // exact tie, odd: rounds up to 0x3f82
                            from_bits(0x3f808001u),   // just above a tie
                            from_bits(0x7f7fffffu)};  // FLT_MAX rounds to infinity
  v.insert(v.begin(), std::begin(specials), std::end(specials));
  const int n = static_cast<int>(v.size());
  float* d_in = to_device(v);
  float* d_out = device_alloc<float>(n);
  __nv_bfloat16* d_packed = device_alloc<__nv_bfloat16>(n);
  LAUNCH(bf16_roundtrip_kernel, (n + 255) / 256, 256, 0, 0, d_out, d_packed, d_in, n);
  TEST_CUDA(cudaGetLastError());
  std::vector<float> got = to_host(d_out, n);
  std::vector<__nv_bfloat16> packed = to_host(d_packed, n);
  for (int i = 0; i < n; ++i) {
    uint16_t raw;
    memcpy(&raw, &packed[i], 2);
    if (std::isnan(v[i])) {
      TEST_TRUE(std::isnan(got[i]), "NaN lost at %d", i);
      continue;
    }
    TEST_TRUE(raw == ref_bf16(v[i]), "element %d (%a): bits %04x want %04x", i, v[i], raw, ref_bf16(v[i]));
    TEST_TRUE(bits(got[i]) == bits(ref_round(v[i])), "element %d: %a vs %a", i, got[i], ref_round(v[i]));
  }
  printf("ok bf16_round_nearest_even\n");

  LAUNCH(bf16x2_kernel, (n / 2 + 127) / 128, 128, 0, 0, d_out, d_in + 16, n - 16);
  TEST_CUDA(cudaGetLastError());
  got = to_host(d_out, n - 16);
  for (int i = 0; i + 1 < n - 16; i += 2)
    for (int k = 0; k < 2; ++k) {
      const float p = ref_round(v[16 + i + k]);
      const float want = ref_round(ref_round(p * p) + p);  // each bf16 op rounds its fp32 result
      TEST_TRUE(bits(got[i + k]) == bits(want), "bf16x2 %d: %a vs %a", i + k, got[i + k], want);
    }
  printf("ok bf16x2_arithmetic\n");

  // fp16: values with at most 11 significant bits survive exactly.
  std::vector<float> hv(1000);
  for (int i = 0; i < 1000; ++i) hv[i] = (i - 500) * 0.125f;
  float* d_h = to_device(hv);
  LAUNCH(fp16_roundtrip_kernel, 4, 256, 0, 0, d_out, d_h, 1000);
  TEST_CUDA(cudaGetLastError());
  got = to_host(d_out, 1000);
  for (int i = 0; i < 1000; ++i) TEST_TRUE(got[i] == hv[i], "fp16 %d: %f vs %f", i, got[i], hv[i]);
  printf("ok fp16_roundtrip\n");
  return 0;
}
