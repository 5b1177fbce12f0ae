#pragma once
#include <cstdint>

#include "common/macros.h"

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

  // Part of the contraction for (b, co): terms k = first, first + step, ... of
  // the Cig * J terms, so several threads can share one sum. Eight terms' loads are issued
  // at once, unconditionally (a term past the end reads term `first`, and is not added): loads
  // under a condition wait for each other, one term at a time, which bounds the CUDA
  // finalize's time (docs/performance.md).
  FO_HD double conv_sum_part(int64_t b, int64_t co, int64_t first, int64_t step) const {
    const int64_t group = co / out_group_channels, co_g = co % out_group_channels;
    const int64_t terms = in_group_channels * parts, w_parts = w_part_stride ? parts : 1;
    const double* xr = x_red + (b * in_channels + group * in_group_channels) * parts;
    const double* wr = w_red + (group * in_group_channels * out_group_channels + co_g) * w_parts;
    // Term k is (ci, j) = (k / parts, k % parts), ci within the group; both are
    // stepped along with k, without a division per term (J can be large: the
    // channels-last spatial sums split samples into chunks).
    const int64_t ci_step = step / parts, j_step = step % parts, w_ci = out_group_channels * w_parts;
    int64_t ci = first / parts, j = first % parts;
    const int64_t w_first = ci * w_ci + j * w_part_stride;
    constexpr int kBatch = 8;
    double s[kBatch] = {};
    for (int64_t k = first; k < terms;) {
      int64_t xo[kBatch], wo[kBatch];
      bool used[kBatch];
FO_UNROLL
      for (int u = 0; u < kBatch; ++u) {
        used[u] = k < terms;
        xo[u] = k < terms ? k : first;
        wo[u] = k < terms ? ci * w_ci + j * w_part_stride : w_first;
        k += step;
        ci += ci_step;
        j += j_step;
        if (j >= parts) {
          j -= parts;
          ++ci;
        }
      }
      double v[kBatch];
FO_UNROLL
      for (int u = 0; u < kBatch; ++u) v[u] = xr[xo[u]] * wr[wo[u]];
FO_UNROLL
      for (int u = 0; u < kBatch; ++u) s[u] += used[u] ? v[u] : 0.0;
    }
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  }

  // The whole contraction for (b, co) in one thread (the CPU's), without
  // conv_sum_part's divisions per term.
  FO_HD double conv_sum(int64_t b, int64_t co) const {
    const int64_t group = co / out_group_channels, co_g = co % out_group_channels;
    const int64_t w_parts = w_part_stride ? parts : 1;
    const double* xr = x_red + (b * in_channels + group * in_group_channels) * parts;
    const double* wr = w_red + (group * in_group_channels * out_group_channels + co_g) * w_parts;
    double s = 0;
    if (parts == 1) {  // the common case, unrolled so that a CUDA thread has loads in flight
      FO_UNROLL_BY(4)
      for (int64_t ci = 0; ci < in_group_channels; ++ci) s += xr[ci] * wr[ci * out_group_channels];
      return s;
    }
    for (int64_t ci = 0; ci < in_group_channels; ++ci) {
      const double* w_ci = wr + ci * out_group_channels * w_parts;
      for (int64_t j = 0; j < parts; ++j) s += xr[ci * parts + j] * w_ci[j * w_part_stride];
    }
    return s;
  }
};

}  // namespace fused_ops
