#pragma once
// 16-byte vectors of x's dtype and their sums in double, for the passes over x
// (sample_sums.cu, eval_x_sums.cu): the loads stay 16 bytes whatever the dtype
// (docs/math.md §5).
#include <ATen/ATen.h>

#include <cstring>

namespace fused_ops {

template <typename scalar_t>
struct Vec16;  // 16 bytes of scalar_t
template <>
struct Vec16<float> {
  using type = float4;
  static constexpr int n = 4;
  __device__ static double sum(const float4& v) {
    return (double(v.x) + double(v.y)) + (double(v.z) + double(v.w));
  }
};
template <>
struct Vec16<double> {
  using type = double2;
  static constexpr int n = 2;
  __device__ static double sum(const double2& v) { return v.x + v.y; }
};
// float16 and bfloat16: 8 values loaded as one uint4, each converted (exactly)
// to double and summed there.
template <typename half_t>
struct Vec16Of8 {
  using type = uint4;
  static constexpr int n = 8;
  __device__ static double sum(const uint4& v) {
    half_t h[8];
    memcpy(h, &v, sizeof(v));
    double pair[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) pair[k] = double(float(h[2 * k])) + double(float(h[2 * k + 1]));
    return (pair[0] + pair[1]) + (pair[2] + pair[3]);
  }
};
template <>
struct Vec16<at::Half> : Vec16Of8<at::Half> {};
template <>
struct Vec16<at::BFloat16> : Vec16Of8<at::BFloat16> {};

// The sum of 16 bytes loaded as raw words, read as Vec16<scalar_t>.
template <typename scalar_t>
__device__ __forceinline__ double sum_raw16(const uint4& raw) {
  typename Vec16<scalar_t>::type v;
  memcpy(&v, &raw, sizeof(raw));
  return Vec16<scalar_t>::sum(v);
}

}  // namespace fused_ops
