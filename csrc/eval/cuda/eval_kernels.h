#pragma once
// Launchers of eval mode's kernels: the x-only pass and the finalize that sums the weight
// while it runs (docs/math.md §2.1, docs/dispatch.md "Kernel routes").
#include <ATen/ATen.h>

#include "ct_bn_pool.h"
#include "common/cuda/co_resident.h"
#include "sums/cuda/sums_kernels.h"

namespace fused_ops {

// Most terms Cig * J of one (b, co) contraction in eval_finalize_cuda (its weight
// sums, one per term, are in shared memory); so at most this many input channels per
// group there (J >= 1): a larger group takes the training path's sums and finalize.
constexpr int64_t kMaxEvalTerms = 1024;

// Eval mode (docs/dispatch.md, "Kernel routes"; scripts/eval_variants.cu at f692131, V5): the x sums
// alone, from x whose positions are adjacent (layout.position 1, or one position), in a
// persistent launch that leaves one block of `finalize` room on every SM; J <= kMaxEvalTerms /
// in_group_channels. w_red is left undefined: eval_finalize_cuda sums the weight while the x
// pass runs.
SampleSumTensors sample_sums_x_only_cuda(const at::Tensor& x, const SampleLayout& layout,
                                         int64_t in_group_channels,
                                         const KernelFootprint& finalize);

// One eval_finalize_cuda block, for sizing the x pass beside it (weight of that dtype).
KernelFootprint eval_finalize_footprint(at::ScalarType weight_dtype);

// Eval mode's finalize after sample_sums_x_only_cuda: in.weight (contiguous) is summed
// here, before the kernel waits for the x pass.
void eval_finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out);

}  // namespace fused_ops
