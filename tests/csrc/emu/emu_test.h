// emu_test.h: tiny helpers for the emulator's test programs (compiled by g++ against csrc/emu and,
// for the compile check, by nvcc). Each program prints "ok <name>" per passing check and exits 1 on
// the first failure; schedule-dependent programs print "value <name> <number>" for pytest to judge.
#pragma once

#include "cuda/portable.h"
#include "check.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

#define TEST_CUDA(expr)                                                                  \
  do {                                                                                   \
    cudaError_t e_ = (expr);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      printf("FAIL %s:%d %s -> %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

// Device buffer of n T, copied from / to host vectors.
template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  TEST_CUDA(cudaMalloc(&d, h.size() * sizeof(T)));
  TEST_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <class T>
T* device_alloc(size_t n) {
  T* d = nullptr;
  TEST_CUDA(cudaMalloc(&d, n * sizeof(T)));
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  TEST_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Deterministic pseudo-random floats in [-1, 1).
inline std::vector<float> random_floats(size_t n, unsigned seed) {
  std::vector<float> v(n);
  unsigned s = seed * 2654435761u + 12345u;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    v[i] = static_cast<float>(s >> 8) / 8388608.0f - 1.0f;
  }
  return v;
}
