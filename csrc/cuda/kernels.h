#pragma once
// Launchers of the CUDA kernels, one translation unit each; every launcher sets
// the device guard, launches on the current stream and checks the launch.
#include <ATen/ATen.h>

#include "ct_bn_pool.h"

namespace fused_ops {

// Where x's element (b, ci, p) lies, p one of the D*H*W positions: at element
// b * batch + ci * channel + p * position from x's data pointer. It exists when
// x's D, H, W dims, taken in the order of their strides, step through memory
// evenly: contiguous and channels_last_3d x, their slices along B or Ci,
// expanded batches, permutations of D, H, W. A size-1 dim's stride is 0.
struct SampleLayout {
  int64_t batch, channel, position;
};

// Backend::sample_sums of x read in place: spatial_sum.cu for adjacent positions
// (layout.position 1), spatial_sum_channels_last.cu for adjacent channels
// (layout.channel 1).
SampleSumTensors sample_sums_cuda(const at::Tensor& x, const SampleLayout& layout,
                                  const at::Tensor& weight);
SampleSumTensors sample_sums_channels_last_cuda(const at::Tensor& x, const SampleLayout& layout,
                                                const at::Tensor& weight);
at::Tensor energy_direct_cuda(const at::Tensor& x, const at::Tensor& packed_weight,
                              const SampleSumTensors& sums, const ConvGeometry& g);
void finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out);

}  // namespace fused_ops
