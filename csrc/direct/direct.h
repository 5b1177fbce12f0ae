#pragma once
// The direct algorithm's host side (docs/math.md §3.1): the weight in the layout its kernels
// read, and the CPU's energy. The CUDA kernels' launchers are in direct/cuda/direct_kernels.h.
#include <ATen/ATen.h>

#include "backend.h"

namespace fused_ops {

// The weight as the direct kernels read it (see common/conv_transpose_row.h).
at::Tensor pack_weight_for_direct(const at::Tensor& weight, const ConvGeometry& g);

// Backend::energy_direct on the CPU: [B, Co, 1] double.
at::Tensor energy_direct_cpu(const at::Tensor& x, const at::Tensor& weight,
                             const SampleSumTensors& sums, const ConvGeometry& g);

}  // namespace fused_ops
