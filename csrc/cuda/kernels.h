#pragma once
// Launchers of the CUDA kernels, one translation unit each; every launcher sets
// the device guard, launches on the current stream and checks the launch.
#include <ATen/ATen.h>

#include "ct_bn_pool.h"

namespace fused_ops {

SampleSumTensors sample_sums_cuda(const at::Tensor& x, const at::Tensor& weight);
at::Tensor energy_direct_cuda(const at::Tensor& x, const at::Tensor& packed_weight,
                              const SampleSumTensors& sums, const ConvGeometry& g);
void finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out);

}  // namespace fused_ops
