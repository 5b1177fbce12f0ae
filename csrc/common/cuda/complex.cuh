#pragma once
// Complex arithmetic and DFT twiddles shared by the kernels of the spectral paths (fft,
// cross_spectrum, x's spectrum).
#include <cuda_runtime.h>

#include <cstdint>

namespace fused_ops {

// x's dtype's complex type, and the 16-byte vector its rows are loaded by.
template <typename T>
struct ComplexOf;
template <>
struct ComplexOf<float> {
  using type = float2;
  using vec16 = float4;
};
template <>
struct ComplexOf<double> {
  using type = double2;
  using vec16 = double2;
};

// a b + c, one rounding (FFMA / DFMA).
__device__ __forceinline__ float madd(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double madd(double a, double b, double c) { return fma(a, b, c); }

// acc += s w as four fused multiply-adds, real part first: written as
// `acc.x += s.x * w.x - s.y * w.y` the compiler keeps separate multiplies and adds
// (ncu on cross_spectrum_s_stage.cu, docs/performance.md).
template <typename C>
__device__ __forceinline__ void add_product(C& acc, const C& s, const C& w) {
  acc.x = madd(s.x, w.x, acc.x);
  acc.x = madd(-s.y, w.y, acc.x);
  acc.y = madd(s.x, w.y, acc.y);
  acc.y = madd(s.y, w.x, acc.y);
}

// a b, complex.
template <typename C>
__device__ __forceinline__ C cmul(const C& a, const C& b) {
  return C{a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x};
}

// acc += a * b (float32 only; the FFT path's own order of the two sums)
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
