#pragma once
// Per-(ci, co) sums of the weight over its taps (docs/math.md §2). Rows are
// short (the taps of one kernel), so one warp sums one row. Each block of the
// spatial-sum launch (spatial_sum.cu) sums a few rows after its part of x:
// reading the weight then overlaps the pass over x instead of costing a launch
// (or a wave of blocks) of its own.
#include <cub/warp/warp_reduce.cuh>

namespace fused_ops {

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

}  // namespace fused_ops
