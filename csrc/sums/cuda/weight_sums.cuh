#pragma once
// Per-(ci, co) sums of the weight over its taps (docs/math.md §2). Rows are
// short (the taps of one kernel), so one warp sums one row. Each block of a
// spatial-sum launch (sample_sums.cu, sample_sums_channels_last.cu) sums a few
// rows after its part of x: reading the weight then overlaps the pass over x
// instead of costing a launch (or a wave of blocks) of its own.
#include <ATen/ATen.h>

#include <algorithm>
#include <cub/warp/warp_reduce.cuh>
#include <utility>

#include "ct_bn_pool.h"

namespace fused_ops {

// The weight viewed as [rows, len]; each block of the launch sums `per_block` rows.
struct WeightRows {
  int64_t rows, len, per_block;
  double* out;
};

// The outputs of a spatial-sum launch of `blocks` blocks, x_red [B, Ci, parts] and
// w_red [Ci, Cog, 1] (double), and the weight rows each block sums into w_red.
inline std::pair<SampleSumTensors, WeightRows> spatial_sum_outputs(const at::Tensor& x,
                                                                   const at::Tensor& weight,
                                                                   int64_t parts, int64_t blocks) {
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: x is too large for one launch (",
              blocks, " blocks)");
  const auto opts = x.options().dtype(at::kDouble);
  SampleSumTensors sums{at::empty({x.size(0), x.size(1), parts}, opts),
                        at::empty({weight.size(0), weight.size(1), 1}, opts)};
  const int64_t rows = weight.size(0) * weight.size(1);
  const WeightRows w_rows{rows, weight.size(2) * weight.size(3) * weight.size(4),
                          (rows + blocks - 1) / blocks, sums.w_red.data_ptr<double>()};
  return {sums, w_rows};
}

// Rows [begin, end) of w viewed as [rows, len], one warp per row.
template <typename scalar_t, int kWarps>
__device__ void weight_row_sums(const scalar_t* __restrict__ w, int64_t len, int64_t begin,
                                int64_t end, double* __restrict__ out) {
  using WarpReduce = cub::WarpReduce<double>;
  __shared__ typename WarpReduce::TempStorage tmp[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t row = begin + warp; row < end; row += kWarps) {
    double acc = 0;
    for (int64_t k = lane; k < len; k += 32) acc += static_cast<double>(w[row * len + k]);
    const double total = WarpReduce(tmp[warp]).Sum(acc);
    if (lane == 0) out[row] = total;
  }
}

// Block `block`'s share of the weight rows; called after the block's part of x,
// so that the loads of x start at once.
template <typename scalar_t, int kWarps>
__device__ void weight_block_share(const scalar_t* __restrict__ w, const WeightRows& rows,
                                   int64_t block) {
  const int64_t begin = std::min(rows.rows, block * rows.per_block);
  weight_row_sums<scalar_t, kWarps>(w, rows.len, begin,
                                    std::min(rows.rows, begin + rows.per_block), rows.out);
}

}  // namespace fused_ops
