#pragma once
#include <cstdint>

#include "geometry.h"
#include "macros.h"

namespace fused_ops {

// Channels of one tile of the direct statistics kernel: each output position is
// computed for this many output channels at once, so every x value loaded is
// used CT times (docs/math.md §3.1).
constexpr int kDirectTile = 16;

// The direct kernel reads the weight packed as [G, Cig, taps, co_pad] (co_pad:
// Cog rounded up to a multiple of kDirectTile, zero-filled), so the channels of
// a tile are contiguous; see pack_weight_for_direct().

// Conv-transpose output (no bias) of one sample at output position (od, oh, ow)
// for the CT channels of one tile, gathered from the input positions whose taps
// land there. x_group points at x[b, group * Cig], w_tile at the packed weight
// of the tile's first channel, whose taps lie tap_stride apart (co_pad, or CT where
// a kernel copied the tile alone).
template <int CT, typename scalar_t, typename acc_t>
FO_HD void conv_transpose_point(const scalar_t* __restrict__ x_group,
                                const scalar_t* __restrict__ w_tile, const ConvGeometry& g,
                                int64_t tap_stride, int64_t od, int64_t oh, int64_t ow, acc_t (&y)[CT]) {
  const int64_t H = g.in_size[1], W = g.in_size[2], in_sp = g.in_spatial();
  const int64_t w_ci_stride = g.taps() * tap_stride, cig = g.in_group_channels();
FO_UNROLL
  for (int j = 0; j < CT; ++j) y[j] = acc_t(0);
  for (int64_t kd = 0; kd < g.kernel[0]; ++kd) {
    const int64_t id = g.tap_source(0, od, kd);
    if (id < 0) continue;
    for (int64_t kh = 0; kh < g.kernel[1]; ++kh) {
      const int64_t ih = g.tap_source(1, oh, kh);
      if (ih < 0) continue;
      for (int64_t kw = 0; kw < g.kernel[2]; ++kw) {
        const int64_t iw = g.tap_source(2, ow, kw);
        if (iw < 0) continue;
        const scalar_t* xp = x_group + (id * H + ih) * W + iw;
        const scalar_t* wp = w_tile + ((kd * g.kernel[1] + kh) * g.kernel[2] + kw) * tap_stride;
        for (int64_t ci = 0; ci < cig; ++ci) {
          const acc_t xv = static_cast<acc_t>(xp[ci * in_sp]);
          const scalar_t* wc = wp + ci * w_ci_stride;
FO_UNROLL
          for (int j = 0; j < CT; ++j) y[j] += xv * static_cast<acc_t>(wc[j]);
        }
      }
    }
  }
}

}  // namespace fused_ops
