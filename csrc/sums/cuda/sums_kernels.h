#pragma once
// Launchers of the sums and finalize kernels (docs/math.md §2, §4); every launcher sets the
// device guard, launches on the current stream and checks the launch.
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

// Backend::sample_sums of x read in place: sample_sums.cu for adjacent positions
// (layout.position 1), sample_sums_channels_last.cu for adjacent channels
// (layout.channel 1).
// Backend::weight_sums: sample_sums.cu, weight_sums.cuh's rows without x.
at::Tensor weight_sums_cuda(const at::Tensor& weight);
SampleSumTensors sample_sums_cuda(const at::Tensor& x, const SampleLayout& layout,
                                  const at::Tensor& weight);
SampleSumTensors sample_sums_channels_last_cuda(const at::Tensor& x, const SampleLayout& layout,
                                                const at::Tensor& weight);

// Backend::finalize: finalize.cu, one block per output channel.
void finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out);

// Backend::box_sums: box_sums.cu, a block per (sample, input channel) with its planes of x in
// shared memory; undefined where one plane and its sums exceed 48 KiB.
at::Tensor box_sums_cuda(const at::Tensor& x, const ConvGeometry& g);

}  // namespace fused_ops
