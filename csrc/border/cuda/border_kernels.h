#pragma once
// Launchers of the border path's CUDA kernels (docs/math.md §3.6).
#include <ATen/ATen.h>

#include "ct_bn_pool.h"

namespace fused_ops {

// Backend::line_weight and Backend::line_columns: border_line_operands.cu, one pass each writing the
// GEMM's layout; line_columns_aten where a block's staged planes of one channel exceed 48 KiB
// (a whole dim of several thousand positions) or x is not contiguous.
at::Tensor line_weight_cuda(const at::Tensor& w_taps, const at::Tensor& tap_index, int64_t groups);
at::Tensor line_columns_cuda(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& columns,
                             int64_t groups, int64_t b0, int64_t n);

}  // namespace fused_ops
