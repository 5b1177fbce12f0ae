#pragma once
// Launchers of the CUDA kernels, one translation unit each; every launcher sets
// the device guard, launches on the current stream and checks the launch.
#include <ATen/ATen.h>

#include "ct_bn_pool.h"

namespace fused_ops {

// x sums and weight sums (spatial_sum.cu, weight_sum.cu).
SampleSumTensors sample_sums_cuda(const at::Tensor& x, const at::Tensor& weight);
// Eval mode with padding 0: the same two launches, the finalize in the second's tail.
void eval_pooled_cuda(const at::Tensor& x, const at::Tensor& weight, const FinalizeInputs& in,
                      const ConvGeometry& g, at::Tensor& out);
// w_red [Ci, Cog, 1] double; zeroes `counters` (int32) too when given.
void weight_sums_cuda(const at::Tensor& weight, at::Tensor& w_red, at::Tensor* counters);
at::Tensor energy_direct_cuda(const at::Tensor& x, const at::Tensor& packed_weight,
                              const SampleSumTensors& sums, const ConvGeometry& g);
void finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out);

}  // namespace fused_ops
