// The `auto` rule (dispatch.h); docs/dispatch.md has it as a table with the measurements.
#include "dispatch.h"

#include "common/conv_transpose_row.h"
#include "common/phases.h"
#include "ct_bn_pool.h"
#include "testing_hooks.h"
#ifdef WITH_CUDA
#include "direct/cuda/direct_kernels.h"
#include "fft/cuda/fft.h"
#endif

namespace fused_ops {
namespace {

const DispatchThresholds& T = kThresholds;

#ifdef WITH_CUDA
// Multiply-adds of the direct kernel: every tap at every output position, for the output
// channels rounded up to its tiles (at stride 1 every tap of an interior position lands).
double direct_work(const ConvGeometry& g) {
  return static_cast<double>(g.batch * g.groups * direct_co_pad(g)) * static_cast<double>(g.out_spatial()) *
         static_cast<double>(g.in_group_channels() * g.taps());
}

// Whether every phase's sub-kernel is a single tap (kernel <= stride, no dilation beyond it):
// one lag, R is x's channel Gram matrix (docs/math.md §3.4).
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

// At stride 1 the cross-spectrum's per-frequency work is (B + k_h) Cig^2 against the FFT
// path's (B + k_d) Cig Cog; it wins where that is smaller and its work covers its fixed costs
// (several hundred ATen ops of host time per call). With one position in the depth the FFT
// path runs blocks of 16 threads (its threads span the depth frequencies), and no minimum
// applies (`border`'s plane problems).
bool cross_spectrum_beats_fft(const ConvGeometry& g) {
  const ConvGeometry sub = phase_geometry(g);
  const int64_t per_freq_cs = (g.batch + sub.kernel[1]) * g.in_group_channels();
  const int64_t per_freq_fft = (g.batch + sub.kernel[0]) * g.out_group_channels();
  const bool pays = sub.out_size[0] == 1 || cross_spectrum_work(g) >= T.cross_spectrum_min_work;
  return per_freq_cs <= per_freq_fft && pays && cross_spectrum_lag_bytes(g) <= T.max_lag_bytes;
}

// `border`'s terms (docs/math.md §3.6) issue hundreds of ATen ops per call and run padding-0
// paths on composite channels: they pay where cuDNN's strict float32 convolution takes longer,
// where the crop keeps most of the grid (the terms it subtracts are about 1 / fraction times
// its energy, their rounding amplified as much), and where their weights stay small (a large
// padding on many channels would take more memory than the convolution).
bool border_pays(const ConvGeometry& g) {
  return direct_work(g) >= T.border_min_work && crop_fraction(g) >= T.border_min_crop_fraction &&
         border_weight_bytes(g) <= T.max_border_weight_bytes;
}
#endif

}  // namespace

// oneDNN's convolution beats the direct loops on every CPU problem measured; the correlation
// path beats it where its float64 GEMMs do less work (docs/dispatch.md).
EnergyAlgo auto_energy_algo_cpu(const ConvGeometry& g, at::ScalarType) {
  if (!g.has_padding() && correlation_cost_ratio(g) < T.cpu_correlation_ratio) return EnergyAlgo::Correlation;
  return EnergyAlgo::SlicedConv;
}

#ifdef WITH_CUDA
bool fft_applies_cuda(const ConvGeometry& g, at::ScalarType dtype) {
  return dtype == at::kFloat && fft_energy_applies(g);
}

// With a stride (padding 0) the phases' lags beat Parseval per phase, and with one lag the
// Gram matrix's single GEMM beats the spectrum. Elsewhere the direct kernel's one launch on
// small problems; then, at stride 1, the FFT path where it applies, or the cross-spectrum
// where it beats it; with padding `border` where it pays, then at stride 1 the direct kernel on
// the float64 tensor cores (where it runs: its exact products beat cuDNN's strict float32
// convolution on most padded layers measured); elsewhere cuDNN (strict float32) over batch
// slices.
EnergyAlgo auto_energy_algo_cuda(const ConvGeometry& g, at::ScalarType dtype) {
  if (!g.has_padding() && phase_count(g) > 1) {
    return single_lag(g) ? EnergyAlgo::Correlation : EnergyAlgo::CrossSpectrum;
  }
  const bool padded_stride1 = g.has_padding() && g.unit_steps();
  if (direct_work(g) <= (padded_stride1 ? T.padded_direct_max_work : T.direct_max_work)) return EnergyAlgo::Direct;
  if (g.has_padding()) {
    if (border_pays(g)) return EnergyAlgo::Border;
    return padded_stride1 && direct_stats_mma_takes(g, dtype) ? EnergyAlgo::Direct : EnergyAlgo::SlicedConv;
  }
  if (!fft_applies_cuda(g, dtype)) return EnergyAlgo::SlicedConv;
  return cross_spectrum_beats_fft(g) ? EnergyAlgo::CrossSpectrum : EnergyAlgo::Fft;
}
#endif

// The spectral paths read all of x for its spectrum; taking x's sums from that pass saves a
// pass of their own where x is large, and costs two small launches (the weight's sums, the
// planes' sum over D) where it is small. With one position in the depth there is no sum over
// D: one small launch against one.
bool sums_from_spectrum(EnergyAlgo algo, const ConvGeometry& g, int64_t x_bytes) {
  return (algo == EnergyAlgo::Fft || algo == EnergyAlgo::CrossSpectrum) &&
         (g.in_size[0] == 1 || x_bytes >= T.min_spectrum_sums_bytes);
}

// The contraction has B Cig taps terms per output channel: in the finalize (a warp per
// sample) it saves the GEMM's launches where they are few, as one GEMM where they are many.
bool box_sums_by_gemm(const ConvGeometry& g) {
  return g.has_padding() &&
         g.batch * g.in_group_channels() * g.taps() > limit_or(Limit::FinalizeTerms, T.max_finalize_terms);
}

}  // namespace fused_ops
