#include "common/phases.h"

namespace fused_ops {

ConvGeometry phase_geometry(const ConvGeometry& g) {
  ConvGeometry p = g;
  for (int d = 0; d < 3; ++d) {
    if (g.stride[d] > 1) {
      p.kernel[d] = g.dilation[d] * (g.kernel[d] - 1) / g.stride[d] + 1;
      p.dilation[d] = 1;
    }
    p.stride[d] = 1;
    p.output_padding[d] = 0;
    p.out_size[d] = conv_transpose_out_size(g.in_size[d], p.kernel[d], 1, 0, p.dilation[d], 0);
  }
  return p;
}

int64_t phase_count(const ConvGeometry& g) { return g.stride[0] * g.stride[1] * g.stride[2]; }

bool is_full_convolution(const ConvGeometry& g) {
  for (int d = 0; d < 3; ++d) {
    if (g.stride[d] != 1 || g.padding[d] != 0 || g.output_padding[d] != 0) return false;
  }
  return true;
}

std::vector<int64_t> occupied_phases(const ConvGeometry& g) {
  std::vector<bool> hit[3];
  for (int d = 0; d < 3; ++d) {
    hit[d].assign(g.stride[d], false);
    for (int64_t t = 0; t < g.kernel[d]; ++t) hit[d][g.dilation[d] * t % g.stride[d]] = true;
  }
  std::vector<int64_t> phases;
  for (int64_t r = 0; r < phase_count(g); ++r) {
    const int64_t rw = r % g.stride[2], rh = r / g.stride[2] % g.stride[1],
                  rd = r / (g.stride[1] * g.stride[2]);
    if (hit[0][rd] && hit[1][rh] && hit[2][rw]) phases.push_back(r);
  }
  return phases;
}

// Phase r = (d t) mod s and position m = (d t) div (s d') per dim, d' the
// sub-kernel's dilation (docs/math.md §3.3.1). Built on the device from aranges:
// no host-to-device copy, nothing to synchronize.
at::Tensor tap_slots(const ConvGeometry& g, const ConvGeometry& sub,
                     const at::TensorOptions& opts) {
  at::Tensor phase = at::zeros({1, 1, 1}, opts), position = at::zeros({1, 1, 1}, opts);
  for (int d = 0; d < 3; ++d) {
    std::vector<int64_t> shape = {1, 1, 1};
    shape[d] = g.kernel[d];
    const at::Tensor dt = at::arange(g.kernel[d], opts).mul_(g.dilation[d]).view(shape);
    phase = phase * g.stride[d] + dt.remainder(g.stride[d]);
    position = position * sub.kernel[d] + at::div(dt, g.stride[d] * sub.dilation[d], "floor");
  }
  return (phase * sub.taps() + position).reshape({-1});
}

at::Tensor PhaseTaps::sub_kernel(int64_t r) const {
  return taps.index_select(1, source.narrow(0, r * positions, positions));
}

at::Tensor PhaseTaps::all() const { return taps.index_select(1, source); }

PhaseTaps phase_taps(const at::Tensor& weight, const ConvGeometry& g, const ConvGeometry& sub,
                     const at::Tensor& slots) {
  PhaseTaps p;
  p.positions = sub.taps();
  const at::TensorOptions longs = slots.options();
  p.source = at::full({phase_count(g) * p.positions}, g.taps(), longs)
                 .index_copy_(0, slots, at::arange(g.taps(), longs));
  p.taps = at::constant_pad_nd(weight.reshape({g.in_channels * g.out_group_channels(), g.taps()}),
                               {0, 1});
  return p;
}

at::Tensor phase_stack(const at::Tensor& weight, const ConvGeometry& g, const ConvGeometry& sub,
                       const at::Tensor& slots) {
  const std::vector<int64_t> shape = {g.groups, g.in_group_channels(), g.out_group_channels(),
                                      phase_count(g), sub.kernel[0], sub.kernel[1], sub.kernel[2]};
  const at::Tensor taps = is_full_convolution(g) ? weight : phase_taps(weight, g, sub, slots).all();
  return taps.to(at::kDouble).reshape(shape);
}

at::Tensor phase_sample_sums(const at::Tensor& weight, const SampleSumTensors& sums,
                             const ConvGeometry& g, const ConvGeometry& sub,
                             const at::Tensor& slots) {
  const int64_t phases = phase_count(g), cig = g.in_group_channels(), cog = g.out_group_channels();
  const at::Tensor phase = at::div(slots, sub.taps(), "floor");
  const at::Tensor one_hot =  // [T, P]: which phase each tap lands in
      phase.unsqueeze(1).eq(at::arange(phases, slots.options())).to(at::kDouble);
  const at::Tensor w_sums =  // [G, Cig, Cog, P]
      at::matmul(weight.reshape({g.groups, cig, cog, g.taps()}).to(at::kDouble), one_hot);
  const at::Tensor x_sums = sums.x_red.sum(2).view({g.batch, g.groups, cig});
  return at::einsum("bgi,giop->bgop", {x_sums, w_sums}).reshape({g.batch, g.out_channels, phases});
}

at::Tensor phase_sum_correction(const at::Tensor& weight, const SampleSumTensors& sums,
                                const ConvGeometry& g, const ConvGeometry& sub,
                                const at::Tensor& slots) {
  const at::Tensor s = phase_sample_sums(weight, sums, g, sub, slots);  // [B, Co, P]
  const double grid = static_cast<double>(sub.out_spatial());
  const double real = static_cast<double>(g.out_spatial());
  return s.square().sum(at::IntArrayRef{0, 2}).div_(grid).sub_(s.sum(2).square_().sum(0).div_(real));
}

}  // namespace fused_ops
