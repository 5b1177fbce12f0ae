#pragma once
#include <cstdint>
#include <cstring>

#include "common/geometry.h"
#include "common/macros.h"

namespace fused_ops {

// Channels of one tile of the direct statistics kernel: each output position is
// computed for this many output channels at once, so every x value loaded is
// used CT times (docs/math.md §3.1).
constexpr int kDirectTile = 16;

// The direct kernel reads the weight packed as [G, Cig, taps, co_pad] (co_pad:
// Cog rounded up to a multiple of kDirectTile, zero-filled), so the channels of
// a tile are contiguous; see pack_weight_for_direct().
inline int64_t direct_co_pad(const ConvGeometry& g) {
  return (g.out_group_channels() + kDirectTile - 1) / kDirectTile * kDirectTile;
}

// The CT weights of one (ci, tap) of a tile. On CUDA as 16-byte loads: a tile's
// rows start a multiple of kDirectTile values from a 16-byte aligned base (the packed
// tensor, or a kernel's copy of it), and one load in place of four keeps the direct
// kernel's loop from being bound by shared-memory instructions.
template <int CT, typename scalar_t>
FO_HD void load_tile_weights(const scalar_t* __restrict__ w, scalar_t (&v)[CT]) {
#if defined(__CUDA_ARCH__)
  if constexpr ((CT * sizeof(scalar_t)) % 16 == 0) {
    constexpr int n = 16 / sizeof(scalar_t);
FO_UNROLL
    for (int k = 0; k < CT / n; ++k) {
      const uint4 raw = reinterpret_cast<const uint4*>(w)[k];
      memcpy(&v[k * n], &raw, 16);
    }
  } else  // the host's loop below is also the device's for other sizes
#endif
  {
FO_UNROLL
    for (int j = 0; j < CT; ++j) v[j] = w[j];
  }
}

// Conv-transpose output (no bias) of one sample at the P output positions (od, oh,
// ow0 + p) of one row, for the CT channels of one tile, summed over the taps of the
// (kd, kh) pairs [pair0, pair1) (pair kd * kH + kh; every kw) and the input channels
// [ci0, ci1) of the group: the input positions whose taps land there, gathered.
// Positions past the row's end come out as 0 (Wo - ow0 < P). x_group points at
// x[b, group * Cig], w_tile at the packed weight of the tile's first channel, whose taps
// lie tap_stride apart (co_pad, or CT where a kernel copied the tile alone). Each y value
// is summed over (kd, kh, kw, ci) in that order, whatever P and the ranges. index_t: int
// where every offset fits (a kernel's shared-memory copy), which keeps the channel loop's
// arithmetic to a few 32-bit adds.
template <int CT, int P, typename index_t, typename scalar_t, typename acc_t>
FO_HD void conv_transpose_row(const scalar_t* __restrict__ x_group,
                              const scalar_t* __restrict__ w_tile, const ConvGeometry& g,
                              int64_t tap_stride, int64_t pair0, int64_t pair1, int64_t ci0,
                              int64_t ci1, int64_t od, int64_t oh, int64_t ow0, acc_t (&y)[P][CT]) {
  const int64_t H = g.in_size[1], W = g.in_size[2];
  const index_t in_sp = static_cast<index_t>(g.in_spatial());
  const index_t w_ci_stride = static_cast<index_t>(g.taps() * tap_stride);
FO_UNROLL
  for (int p = 0; p < P; ++p)
FO_UNROLL
    for (int j = 0; j < CT; ++j) y[p][j] = acc_t(0);
  for (int64_t pair = pair0; pair < pair1; ++pair) {
    const int64_t kd = pair / g.kernel[1], kh = pair % g.kernel[1];
    const int64_t id = g.tap_source(0, od, kd), ih = g.tap_source(1, oh, kh);
    if (id < 0 || ih < 0) continue;
    const int64_t row = (id * H + ih) * W + ci0 * g.in_spatial();
    for (int64_t kw = 0; kw < g.kernel[2]; ++kw) {
      // A position that no input reaches through this tap reads its row's first value
      // and multiplies it by 0, so that the channel loop has no branch per position.
      index_t offset[P];
      acc_t reached[P];
      bool any = false;
FO_UNROLL
      for (int p = 0; p < P; ++p) {
        const int64_t iw = ow0 + p < g.out_size[2] ? g.tap_source(2, ow0 + p, kw) : -1;
        reached[p] = iw >= 0 ? acc_t(1) : acc_t(0);
        offset[p] = static_cast<index_t>(row + (iw >= 0 ? iw : 0));
        any = any || iw >= 0;
      }
      if (!any) continue;
      index_t w_offset = static_cast<index_t>((pair * g.kernel[2] + kw) * tap_stride + ci0 * w_ci_stride);
FO_UNROLL_BY(2)
      for (index_t n = static_cast<index_t>(ci1 - ci0); n > 0; --n) {
        acc_t xv[P];
FO_UNROLL
        for (int p = 0; p < P; ++p) {
          xv[p] = reached[p] * static_cast<acc_t>(x_group[offset[p]]);
          offset[p] += in_sp;
        }
        scalar_t wv[CT];
        load_tile_weights<CT>(w_tile + w_offset, wv);
        w_offset += w_ci_stride;
FO_UNROLL
        for (int p = 0; p < P; ++p)
FO_UNROLL
          for (int j = 0; j < CT; ++j) y[p][j] += xv[p] * static_cast<acc_t>(wv[j]);
      }
    }
  }
}

}  // namespace fused_ops
