#pragma once
// A strided transposed convolution (or one with output padding) as a set of
// stride-1 full convolutions of x with dense sub-kernels, its phases
// (docs/math.md §3.3.1). Shared by the training-mode energies that work on
// stride-1 problems: the FFT (§3.3), correlation (§3.4) and cross-spectrum (§3.5)
// paths.
#include <ATen/ATen.h>

#include <array>
#include <vector>

#include "ct_bn_pool.h"
#include "common/geometry.h"

namespace fused_ops {

// Every phase's problem: a stride-1 full convolution of x whose output is the
// common grid. A strided dim gets the dense sub-kernel of k' = floor(d (k - 1) / s) + 1
// positions; a stride-1 dim keeps its kernel and dilation (one phase).
ConvGeometry phase_geometry(const ConvGeometry& g);

int64_t phase_count(const ConvGeometry& g);

// One phase whose grid is the whole output (stride 1, padding 0, no output padding):
// §3.3 as it stands, its energy already centred on the sample's mean, nothing for
// phase_sum_correction to add.
bool is_full_convolution(const ConvGeometry& g);

// The phases some tap lands in (k < s leaves some empty: their energy and sums
// are 0). Known from the geometry: no device round trip.
std::vector<int64_t> occupied_phases(const ConvGeometry& g);

// [T] long, on `opts`' device: where each tap (kd, kh, kw order) lands in the
// stack of the phases' sub-kernels, [P, k'd, k'h, k'w] flattened.
at::Tensor tap_slots(const ConvGeometry& g, const ConvGeometry& sub, const at::TensorOptions& opts);

// The phases' sub-kernels gathered from the weight: the taps [Ci * Cog, T + 1]
// with a zero column T appended, and for each slot of the stack the column it
// takes (the zero column where no tap lands).
struct PhaseTaps {
  at::Tensor taps;    // [Ci * Cog, T + 1], the weight's dtype
  at::Tensor source;  // [P * positions] long
  int64_t positions;  // taps of one sub-kernel: sub.taps()
  // Phase r's sub-kernel, [Ci * Cog, positions].
  at::Tensor sub_kernel(int64_t r) const;
  // Every phase's, [Ci * Cog, P * positions].
  at::Tensor all() const;
};
PhaseTaps phase_taps(const at::Tensor& weight, const ConvGeometry& g, const ConvGeometry& sub,
                     const at::Tensor& slots);

// Every phase's sub-kernel in float64, [G, Cig, Cog, P, k'd, k'h, k'w]: for one phase
// covering the output (is_full_convolution) the weight itself, without the gather.
at::Tensor phase_stack(const at::Tensor& weight, const ConvGeometry& g, const ConvGeometry& sub,
                       const at::Tensor& slots);

// [B, Co, P] double: S[b, c, r], the sum of phase r of sample b's output channel
// c (bias excluded): x's sums (padding 0, docs/math.md §2.1) contracted with the
// sums of phase r's taps. Their sum over r is the sample's sum S[b, c].
at::Tensor phase_sample_sums(const at::Tensor& weight, const SampleSumTensors& sums,
                             const ConvGeometry& g, const ConvGeometry& sub,
                             const at::Tensor& slots);

// The lags of the phases' sub-kernels: -(k' - 1) .. k' - 1 positions per dim
// (docs/math.md §3.4), shared by every phase.
struct Lags {
  int64_t reach[3];  // k' - 1
  int64_t step[3];   // elements of x per position: the sub-kernel's dilation

  explicit Lags(const ConvGeometry& sub) {
    for (int d = 0; d < 3; ++d) {
      reach[d] = sub.kernel[d] - 1;
      step[d] = sub.dilation[d];
    }
  }
  int64_t count() const { return (2 * reach[0] + 1) * (2 * reach[1] + 1) * (2 * reach[2] + 1); }
  // Lag n (W fastest) in positions per dim.
  std::array<int64_t, 3> operator()(int64_t n) const {
    std::array<int64_t, 3> lag{};
    for (int d = 2; d >= 0; --d) {
      const int64_t width = 2 * reach[d] + 1;
      lag[d] = n % width - reach[d];
      n /= width;
    }
    return lag;
  }
};

// [Co] double: sum_b (sum_r S[b, r]^2 / |grid| - S[b]^2 / M), the terms that
// turn the phases' energies (each centred on its own grid mean) into the
// energy of the real output centred on the sample's mean (§3.3.1).
at::Tensor phase_sum_correction(const at::Tensor& weight, const SampleSumTensors& sums,
                                const ConvGeometry& g, const ConvGeometry& sub,
                                const at::Tensor& slots);

}  // namespace fused_ops
