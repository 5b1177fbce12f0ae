// Registers the CUDA kernel of ct_bn_pool: the shared algorithm with the CUDA
// reductions and kernels.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "conv_transpose_row.h"
#include "cuda/fft_energy.h"
#include "cuda/kernels.h"
#include "phases.h"

namespace fused_ops {
namespace {

// x's SampleLayout (kernels.h), or nullopt where its D, H, W dims do not step
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

// Eval mode reads x alone and leaves the weight sums to the finalize, which reads the
// weight while x streams (docs/performance.md, microbenchmark V5), where: the
// positions are adjacent (the other layouts keep their kernels), the finalize overlaps
// the x pass (PDL, sm_90+; without it the weight would be read after x), and one
// channel's weight sums fit its shared memory. Elsewhere: the training path's sums.
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

bool fft_applies_cuda(const ConvGeometry& g, at::ScalarType dtype) {
  return dtype == at::kFloat && fft_energy_applies(g);
}

// Whether every phase's sub-kernel is a single tap (kernel <= stride, no dilation
// beyond it): one lag, R is x's channel Gram matrix (docs/math.md §3.4).
bool single_lag(const ConvGeometry& g) { return Lags(phase_geometry(g)).count() == 1; }

// Complex multiply-adds of the cross-spectrum's S stage (S_f and its h lags) per call, every
// (i, j) pair counted (docs/math.md §3.5), and the bytes of its D stage's float64 lags.
double cross_spectrum_work(const ConvGeometry& g) {
  const ConvGeometry sub = phase_geometry(g);
  const double freqs = static_cast<double>(sub.out_size[0] * sub.out_size[1] * (sub.out_size[2] / 2 + 1));
  const double cig = static_cast<double>(g.in_group_channels());
  return freqs * static_cast<double>(g.groups) * cig * cig * static_cast<double>(g.batch + sub.kernel[1]);
}
double cross_spectrum_lag_bytes(const ConvGeometry& g) {
  const Lags lags(phase_geometry(g));
  const double cig = static_cast<double>(g.in_group_channels());
  return 16.0 * static_cast<double>((2 * lags.reach[0] + 1) * (2 * lags.reach[2] + 1) * (lags.reach[1] + 1) *
                                    g.groups) * cig * cig;
}

// At stride 1 the cross-spectrum takes less GPU time than the FFT path where its
// per-frequency work (B + k_h) Cig^2 is below the FFT path's (B + k_d) Cig Cog and its
// work is large enough to cover its fixed costs; it also issues about 1 ms of host work
// per call (several hundred ATen ops), which an eager loop pays whenever its GPU time is
// shorter. docs/performance.md, 14:14 UTC run (multiply-adds: GPU ms against fft's):
// s8 2.3e8: 0.86 against 0.48; b4 5.0e8: 1.16 against 1.72 (issue 0.97 ms); k3 8.6e8:
// 1.10 against 1.72; seed 1.2e9: 1.59 against 2.07. Its lags stay under kMaxLagBytes.
// With one position in the depth the FFT path runs blocks of 16 threads (its threads span
// the depth frequencies), and no minimum applies: `border`'s plane problems (pad2's d
// planes: 2.3e8, 0.41 ms against 2.26; 2026-12-01 17:56 UTC, docs/performance.md).
constexpr double kCrossSpectrumMinWork = 4e8;
constexpr double kMaxLagBytes = 256.0 * (1 << 20);
bool cross_spectrum_beats_fft(const ConvGeometry& g) {
  const ConvGeometry sub = phase_geometry(g);
  const int64_t per_freq_cs = (g.batch + sub.kernel[1]) * g.in_group_channels();
  const int64_t per_freq_fft = (g.batch + sub.kernel[0]) * g.out_group_channels();
  const bool pays = sub.out_size[0] == 1 || cross_spectrum_work(g) >= kCrossSpectrumMinWork;
  return per_freq_cs <= per_freq_fft && pays &&
         cross_spectrum_lag_bytes(g) <= kMaxLagBytes;
}

// Multiply-adds of the direct kernel: every tap at every output position, for the output
// channels rounded up to its tiles (at stride 1 every tap of an interior position lands).
double direct_work(const ConvGeometry& g) {
  return static_cast<double>(g.batch * g.groups * direct_co_pad(g)) * static_cast<double>(g.out_spatial()) *
         static_cast<double>(g.in_group_channels() * g.taps());
}

// Below this work the direct kernel's one launch beats the FFT path's chain of seven
// (docs/performance.md, 2026-12-01 00:0x UTC runs: odd 5.2e6 multiply-adds, direct 0.025 ms
// against fft 0.037 and eager 0.028; t8 5.5e7, 0.041 against 0.044; t8c32 2.2e8, 0.059
// against 0.054). Since the FFT path's small-batch kernel (2026-12-01 06:20 UTC) t8's fft
// takes 0.035 against direct's 0.039 and odd's 0.031 against 0.025: the crossing lies
// between them now. At stride and dilation 1 the direct kernel is ct_stats_stride1.cu's since
// 2026-12-01 21:43 UTC: t8 0.036 against fft's 0.032, odd 0.024 against 0.028, t8c32 (2.2e8)
// 0.072 against 0.036: the bound stands.
constexpr double kDirectMaxWork = 1e8;
// With padding at stride and dilation 1, the direct kernel (ct_stats_mma.cu on sm_90) against
// cuDNN's strict float32 convolution over slices: t8pad1 (1.1e8) 0.034 ms against 0.069
// (docs/performance.md, 2026-12-02 00:05 UTC; ct_stats_stride1.cu's took 0.057); not measured
// between there and this bound.
constexpr double kPaddedDirectMaxWork = 2e8;

// With padding, the border's terms (docs/math.md §3.6) issue hundreds of ATen ops per call
// (pad2: 839, 2.9 ms of host time on the H200's machine, 2026-12-01 18:23 UTC; 550 launches and
// 4.8 ms at 06:38) and run padding-0 paths on composite channels:
// they pay where cuDNN's strict float32 convolution takes longer than that, and where the crop
// keeps most of the grid (the terms it subtracts are about 1 / fraction times its energy,
// their rounding amplified as much). docs/performance.md, 2026-12-01 06:38 UTC: pad2 (2.7e11
// multiply-adds, crop 0.63) 5.9 ms against sliced_conv's 33.0; t8pad1 (1.1e8) 1.31 against
// 0.095. Where between them the two cross was not measured: 1e11 is sliced_conv's 12 ms at
// pad2's rate. Its terms' weights stay under kMaxBorderWeightBytes (pad2's largest: its plane
// problems' of both sides, 6.6 MB), or a large padding on many channels would take more
// memory than the convolution.
constexpr double kBorderMinWork = 1e11;
constexpr int64_t kMaxBorderWeightBytes = int64_t(64) << 20;
bool border_pays(const ConvGeometry& g) {
  return direct_work(g) >= kBorderMinWork && crop_fraction(g) >= 0.5 &&
         border_weight_bytes(g) <= kMaxBorderWeightBytes;
}

// docs/performance.md, training rows of 2026-11-30: with a stride (padding 0) the lags
// of the phases beat Parseval per phase, cuDNN and eager (st2: cross_spectrum 0.38 ms,
// fft 0.88, eager 0.43), and with one lag the Gram matrix's single GEMM beats the
// spectrum (up2: correlation 0.23 ms, cross_spectrum 0.34, eager 0.25). Elsewhere the
// direct kernel on small problems (kDirectMaxWork); then, at stride 1, the FFT path where
// it applies, or the cross-spectrum where cross_spectrum_beats_fft; elsewhere cuDNN
// (strict float32) over batch slices.
EnergyAlgo auto_energy_algo_cuda(const ConvGeometry& g, at::ScalarType dtype) {
  if (!g.has_padding() && phase_count(g) > 1) {
    return single_lag(g) ? EnergyAlgo::Correlation : EnergyAlgo::CrossSpectrum;
  }
  const bool padded_stride1 = g.has_padding() && g.unit_steps();
  if (direct_work(g) <= (padded_stride1 ? kPaddedDirectMaxWork : kDirectMaxWork)) return EnergyAlgo::Direct;
  if (g.has_padding()) return border_pays(g) ? EnergyAlgo::Border : EnergyAlgo::SlicedConv;
  if (!fft_applies_cuda(g, dtype)) return EnergyAlgo::SlicedConv;
  return cross_spectrum_beats_fft(g) ? EnergyAlgo::CrossSpectrum : EnergyAlgo::Fft;
}

const Backend kCudaBackend = {sample_sums_any_layout_cuda, weight_sums_cuda, energy_direct_cuda, finalize_any_cuda,
                              auto_energy_algo_cuda,       energy_fft_cuda,    fft_applies_cuda,
                              eval_sample_sums_cuda,       cross_spectrum_rows_cuda,
                              lag_stage_cuda,              table_stream_cuda,
                              correlation_blocks_cuda,     quad_forms_cuda,
                              tap_spectrum_cuda,           line_weight_cuda,
                              line_columns_cuda,           box_sums_cuda,
                              direct_stats_cuda,           kCudaSpectrumKernels};

}  // namespace

// cudaStreamIsCapturing is one of the calls capture allows.
int64_t table_stream_cuda(const at::Device& device) {
  const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream(device.index());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &status));
  return status == cudaStreamCaptureStatusNone ? stream.id() : -1;
}

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("ct_bn_pool", &ct_bn_pool_kernel<kCudaBackend>);
  m.impl("ct_bn_pool.no_stats", &ct_bn_pool_no_stats_kernel<kCudaBackend>);
  m.impl("ct_bn_pool_stats", &ct_bn_pool_stats_kernel<kCudaBackend>);
  m.impl("ct_bn_pool_apply", &ct_bn_pool_apply_kernel<kCudaBackend>);
  m.impl("ct_bn_pool_apply.no_stats", &ct_bn_pool_apply_no_stats_kernel<kCudaBackend>);
}

}  // namespace fused_ops
