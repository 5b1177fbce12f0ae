// The CUDA backend: the shared orchestration over the CUDA kernels, and its registration.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "sums/cuda/sums_kernels.h"
#include "eval/cuda/eval_kernels.h"
#include "direct/cuda/direct_kernels.h"
#include "cross_spectrum/cuda/cross_spectrum_kernels.h"
#include "border/cuda/border_kernels.h"
#include "kept/cuda/kept_kernels.h"
#include "x_spectrum/cuda/x_spectrum_kernels.h"
#include "common/cuda/build_apart.h"
#include "dispatch.h"
#include "fft/cuda/fft.h"

namespace fused_ops {
namespace {

// x's SampleLayout (sums_kernels.h), or nullopt where its D, H, W dims do not step
// through memory evenly.
c10::optional<SampleLayout> sample_layout(const at::Tensor& x) {
  std::vector<int64_t> dims;  // D, H, W dims of more than one position, innermost first
  for (int64_t d = 2; d < 5; ++d) {
    if (x.size(d) > 1) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end(),
            [&](int64_t a, int64_t b) { return x.stride(a) < x.stride(b); });
  const int64_t position = dims.empty() ? 0 : x.stride(dims[0]);
  int64_t step = position;
  for (int64_t d : dims) {
    if (x.stride(d) != step) return c10::nullopt;
    step *= x.size(d);
  }
  return SampleLayout{x.size(0) > 1 ? x.stride(0) : 0, x.size(1) > 1 ? x.stride(1) : 0, position};
}

// x is read in place where its positions or its channels are adjacent in
// memory; any other view is reduced from a contiguous copy (README, memory formats).
SampleSumTensors sample_sums_any_layout_cuda(const at::Tensor& x, const at::Tensor& weight) {
  const auto layout = sample_layout(x);
  const bool one_position = x.size(2) * x.size(3) * x.size(4) == 1;
  if (layout && (layout->position == 1 || one_position)) {
    return sample_sums_cuda(x, *layout, weight);
  }
  if (layout && (layout->channel == 1 || x.size(1) == 1)) {
    return sample_sums_channels_last_cuda(x, *layout, weight);
  }
  const at::Tensor copy = x.contiguous();
  return sample_sums_cuda(copy, *sample_layout(copy), weight);
}

// Eval mode reads x alone and leaves the weight sums to the finalize, which reads the weight
// while x streams (docs/dispatch.md, "Kernel routes"; scripts/eval_variants.cu at f692131, V5), where:
// the positions are adjacent (the other layouts keep their kernels), the finalize overlaps the
// x pass (PDL, sm_90+; without it the weight would be read after x), and one channel's weight
// sums fit its shared memory. Elsewhere: the training path's sums.
SampleSumTensors eval_sample_sums_cuda(const at::Tensor& x, const at::Tensor& weight,
                                       const ConvGeometry& g) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto layout = sample_layout(x);
  const bool adjacent = layout && (layout->position == 1 || x.size(2) * x.size(3) * x.size(4) == 1);
  const bool pdl = at::cuda::getCurrentDeviceProperties()->major >= 9;
  if (!adjacent || !pdl || g.in_group_channels() > kMaxEvalTerms) {
    return sample_sums_any_layout_cuda(x, weight);
  }
  return sample_sums_x_only_cuda(x, *layout, g.in_group_channels(),
                                 eval_finalize_footprint(weight.scalar_type()));
}

// The eval finalize that sums the weight where the sums left it out.
void finalize_any_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out) {
  if (in.sums.x_red.defined() && !in.sums.w_red.defined()) {
    eval_finalize_cuda(in, g, out);
  } else {
    finalize_cuda(in, g, out);
  }
}

// Every hook by name (backend.h); CUDA has them all.
const Backend kCudaBackend = [] {
  Backend b;
  b.sample_sums = sample_sums_any_layout_cuda;
  b.weight_sums = weight_sums_cuda;
  b.energy_direct = energy_direct_cuda;
  b.finalize = finalize_any_cuda;
  b.auto_energy_algo = auto_energy_algo_cuda;
  b.energy_fft = energy_fft_cuda;
  b.fft_applies = fft_applies_cuda;
  b.eval_sample_sums = eval_sample_sums_cuda;
  b.cross_spectrum_rows = cross_spectrum_rows_cuda;
  b.lag_stage = lag_stage_cuda;
  b.build_tables_apart = build_tables_apart_cuda;
  b.correlation_blocks = correlation_blocks_cuda;
  b.quad_forms = quad_forms_cuda;
  b.tap_spectrum = tap_spectrum_cuda;
  b.line_weight = line_weight_cuda;
  b.line_columns = line_columns_cuda;
  b.box_sums = box_sums_cuda;
  b.direct_stats = direct_stats_cuda;
  b.sample_moments = sample_moments_cuda;
  b.affine_grad = affine_grad_cuda;
  b.spectrum_kernels = kCudaSpectrumKernels;
  return b;
}();

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) { register_kernels<kCudaBackend>(m); }

}  // namespace fused_ops
