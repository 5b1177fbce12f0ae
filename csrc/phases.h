#pragma once
// A strided transposed convolution (or one with output padding) as a set of
// stride-1 full convolutions of x with dense sub-kernels, its phases
// (docs/math.md §3.3.1). Shared by the training-mode energies that work on
// stride-1 problems: the FFT path (§3.3) and the correlation path (§3.4).
#include <ATen/ATen.h>

#include <vector>

#include "ct_bn_pool.h"
#include "geometry.h"

namespace fused_ops {

// Every phase's problem: a stride-1 full convolution of x whose output is the
// common grid. A strided dim gets the dense sub-kernel of k' = floor(d (k - 1) / s) + 1
// positions; a stride-1 dim keeps its kernel and dilation (one phase).
ConvGeometry phase_geometry(const ConvGeometry& g);

int64_t phase_count(const ConvGeometry& g);

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

// [B, Co, P] double: S[b, c, r], the sum of phase r of sample b's output channel
// c (bias excluded): x's sums (padding 0, docs/math.md §2.1) contracted with the
// sums of phase r's taps. Their sum over r is the sample's sum S[b, c].
at::Tensor phase_sample_sums(const at::Tensor& weight, const SampleSumTensors& sums,
                             const ConvGeometry& g, const ConvGeometry& sub,
                             const at::Tensor& slots);

}  // namespace fused_ops
