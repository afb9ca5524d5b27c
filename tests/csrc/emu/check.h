// check.h: TEST_TRUE for the emulator's test programs, kernel programs (emu_test.h) and host-only ones
// (seams.cpp) alike: prints "FAIL file:line cond: message" and exits 1.
#pragma once

#include <cstdio>
#include <cstdlib>

#define TEST_TRUE(cond, ...)                               \
  do {                                                     \
    if (!(cond)) {                                         \
      printf("FAIL %s:%d %s: ", __FILE__, __LINE__, #cond); \
      printf(__VA_ARGS__);                                 \
      printf("\n");                                        \
      exit(1);                                             \
    }                                                      \
  } while (0)
