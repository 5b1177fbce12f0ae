#pragma once
// Per-(ci, co) sums of the weight over its taps (docs/math.md §2). Rows are
// short (the taps of one kernel), so one warp sums one row. It runs as extra
// blocks of the spatial-sum launch (spatial_sum.cu): reading the weight then
// overlaps the pass over x instead of costing a launch of its own.
#include <cub/warp/warp_reduce.cuh>

namespace fused_ops {

// Rows [first_row, first_row + warps) of w viewed as [rows, len], one per warp.
template <typename scalar_t, int kWarps>
__device__ void weight_row_sums(const scalar_t* __restrict__ w, int64_t rows, int64_t len,
                                int64_t first_row, double* __restrict__ out) {
  using WarpReduce = cub::WarpReduce<double>;
  __shared__ typename WarpReduce::TempStorage tmp[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = first_row + warp;
  if (row >= rows) return;  // whole warps leave together
  double acc = 0;
  for (int64_t k = lane; k < len; k += 32) acc += static_cast<double>(w[row * len + k]);
  const double total = WarpReduce(tmp[warp]).Sum(acc);
  if (lane == 0) out[row] = total;
}

}  // namespace fused_ops
