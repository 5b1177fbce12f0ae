#pragma once
// Complex arithmetic and DFT twiddles shared by the FFT-path kernels.
#include <cuda_runtime.h>

#include <cstdint>

namespace fused_ops {

// acc += a * b
__device__ __forceinline__ void cfma(float2& acc, float2 a, float2 b) {
  acc.x = fmaf(a.x, b.x, fmaf(-a.y, b.y, acc.x));
  acc.y = fmaf(a.x, b.y, fmaf(a.y, b.x, acc.y));
}

// exp(-2 pi i f t / L), reduced exactly in integers first so the float angle is small.
__device__ __forceinline__ float2 twiddle(int64_t f, int64_t t, int64_t L) {
  const int64_t m = (f * t) % L;
  float s, c;
  sincospif(2.0f * static_cast<float>(m) / static_cast<float>(L), &s, &c);
  return make_float2(c, -s);
}

}  // namespace fused_ops
