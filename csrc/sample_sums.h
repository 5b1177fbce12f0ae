#pragma once
#include <cstdint>

#include "macros.h"

namespace fused_ops {

// Reductions of x and of the weight whose contraction gives each sample's
// spatial sum of the conv-transpose output, bias excluded (docs/math.md §2):
//   sum_o y[b, co, o] - N * bias[co] = sum_{ci in group(co)} sum_j x_red[b, ci, j] * w_red[ci, co_g, j]
// With padding 0 the spatial sum of x may arrive split in J partial sums
// (w_j_stride 0: the weight sum is broadcast over j); with padding > 0, j runs
// over the kernel taps and x_red holds box sums (docs/math.md §2.2).
struct SampleSums {
  const double* x_red;  // [B, Ci, J]
  const double* w_red;  // [Ci, Cog, J] or [Ci, Cog, 1]
  int64_t parts;        // J
  int64_t w_part_stride;
  int64_t in_channels, in_group_channels, out_group_channels;

  FO_HD double conv_sum(int64_t b, int64_t co) const {
    const int64_t group = co / out_group_channels, co_g = co % out_group_channels;
    double s = 0;
    for (int64_t ci = group * in_group_channels; ci < (group + 1) * in_group_channels; ++ci) {
      const double* xr = x_red + (b * in_channels + ci) * parts;
      const double* wr = w_red + (ci * out_group_channels + co_g) * (w_part_stride ? parts : 1);
      for (int64_t j = 0; j < parts; ++j) s += xr[j] * wr[j * w_part_stride];
    }
    return s;
  }
};

}  // namespace fused_ops
