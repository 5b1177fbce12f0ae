#pragma once
// The `auto` rule of each device: which training algorithm computes a problem's statistics,
// and the two orchestration choices that depend on size. docs/dispatch.md states the rule as a
// table, with the measurement behind every threshold; change both together.
#include <ATen/ATen.h>

#include "backend.h"

namespace fused_ops {

// Every threshold of the rule, in one place (docs/dispatch.md names each field).
struct DispatchThresholds {
  // CUDA: most multiply-adds (direct_work) for the direct kernel's one launch, without padding
  // and at stride 1 with padding.
  double direct_max_work = 1e8;
  double padded_direct_max_work = 2e8;
  // CUDA, stride 1: least work for the cross-spectrum over the FFT path, and the most bytes of
  // its D stage's float64 lags.
  double cross_spectrum_min_work = 4e8;
  double max_lag_bytes = 256.0 * (1 << 20);
  // CUDA, padding: least work for `border` over sliced_conv, the least share of the grid its
  // crop keeps (its terms' rounding grows as 1 / share), the most bytes of its terms' weights.
  double border_min_work = 1e11;
  double border_min_crop_fraction = 0.5;
  int64_t max_border_weight_bytes = int64_t(64) << 20;
  // Least bytes of x for the spectral paths to take x's sums from their own pass over x.
  int64_t min_spectrum_sums_bytes = int64_t(32) << 20;
  // Most box-sum terms B Cig taps per output channel that the finalize contracts itself with
  // padding; past it one batched GEMM does (fused_ops.testing.limit(finalize_terms=...)).
  int64_t max_finalize_terms = int64_t(1) << 14;
  // CPU: the correlation path where its float64 GEMMs have less than this share of the
  // convolution's multiply-adds.
  double cpu_correlation_ratio = 1.0 / 3.0;
};
inline constexpr DispatchThresholds kThresholds{};

// Backend::auto_energy_algo of each device; `dtype` is the energy's (compute_dtype).
EnergyAlgo auto_energy_algo_cpu(const ConvGeometry& g, at::ScalarType dtype);
#ifdef WITH_CUDA
EnergyAlgo auto_energy_algo_cuda(const ConvGeometry& g, at::ScalarType dtype);
// Backend::fft_applies on CUDA.
bool fft_applies_cuda(const ConvGeometry& g, at::ScalarType dtype);
#endif

// Whether a padding-0 training call takes x's sums from the spectrum's pass over x (`algo`
// makes one) rather than from a pass of their own; x_bytes: x's size.
bool sums_from_spectrum(EnergyAlgo algo, const ConvGeometry& g, int64_t x_bytes);
// Whether a padded call contracts the box sums into [B, Co] sample sums by a batched GEMM
// before the finalize, rather than in the finalize.
bool box_sums_by_gemm(const ConvGeometry& g);

}  // namespace fused_ops
