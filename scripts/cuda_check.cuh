#pragma once
// Error checks for the standalone CUDA microbenchmarks in scripts/ (no torch): a failed
// call or launch prints where and why, and the program exits 2.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(call)                                                                          \
  do {                                                                                    \
    const cudaError_t err_ = (call);                                                      \
    if (err_ != cudaSuccess) {                                                            \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call,                \
              cudaGetErrorString(err_));                                                  \
      exit(2);                                                                            \
    }                                                                                     \
  } while (0)
#define CK_LAUNCH() CK(cudaGetLastError())
