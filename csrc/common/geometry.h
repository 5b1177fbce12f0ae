#pragma once
#include <cstdint>

#include "common/macros.h"

namespace fused_ops {

// Sizes of one ConvTranspose3d problem. Everything is int64 so that index
// arithmetic stays exact past 2^31 elements.
struct ConvGeometry {
  int64_t batch, in_channels, out_channels, groups;
  int64_t in_size[3];   // D, H, W
  int64_t out_size[3];  // Do, Ho, Wo
  int64_t kernel[3];
  int64_t stride[3], padding[3], dilation[3], output_padding[3];

  FO_HD int64_t in_group_channels() const { return in_channels / groups; }
  FO_HD int64_t out_group_channels() const { return out_channels / groups; }
  FO_HD int64_t in_spatial() const { return in_size[0] * in_size[1] * in_size[2]; }
  FO_HD int64_t out_spatial() const { return out_size[0] * out_size[1] * out_size[2]; }
  FO_HD int64_t taps() const { return kernel[0] * kernel[1] * kernel[2]; }
  bool has_padding() const { return padding[0] != 0 || padding[1] != 0 || padding[2] != 0; }
  // Stride and dilation 1 in every dim: each output position's taps read a box of x.
  bool unit_steps() const {
    for (int d = 0; d < 3; ++d) {
      if (stride[d] != 1 || dilation[d] != 1) return false;
    }
    return true;
  }

  // Input index along `dim` whose tap `k` lands on output index `o`, or -1.
  // A transposed convolution scatters input i to output i*s - p + k*d.
  FO_HD int64_t tap_source(int dim, int64_t o, int64_t k) const {
    const int64_t t = o + padding[dim] - k * dilation[dim];
    if (stride[dim] == 1) return t >= 0 && t < in_size[dim] ? t : -1;  // no 64-bit division
    if (t < 0 || t % stride[dim] != 0) return -1;
    const int64_t i = t / stride[dim];
    return i < in_size[dim] ? i : -1;
  }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t conv_transpose_out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d,
                                       int64_t op) {
  return (in - 1) * s - 2 * p + d * (k - 1) + op + 1;
}

}  // namespace fused_ops
