#pragma once
// Error checks for the standalone CUDA microbenchmarks in scripts/ (no torch): a failed
// call or launch prints where and why, and the program exits 2.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

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

// Microseconds between start[i] and end[i] for each timed call (events already synchronized).
inline std::vector<double> elapsed_us(const std::vector<cudaEvent_t>& start,
                                      const std::vector<cudaEvent_t>& end) {
  std::vector<double> us(start.size());
  for (size_t i = 0; i < start.size(); ++i) {
    float ms;
    CK(cudaEventElapsedTime(&ms, start[i], end[i]));
    us[i] = ms * 1e3;
  }
  return us;
}
