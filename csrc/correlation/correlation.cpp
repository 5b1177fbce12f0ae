// The correlation path of the training-mode energy (docs/math.md §3.4): each
// phase's sum of squares is x's channel cross-correlation at the lags its
// sub-kernel spans, contracted with the sub-kernel's own tap pairs at those lags.
// float64 throughout, ATen ops only, so it runs on every device; its cost grows
// with Cig^2 times the number of lags, not with the output's size.
#include <algorithm>
#include <vector>

#include "common/phases.h"

namespace fused_ops {
namespace {

// Bytes of the block-Toeplitz matrix's rows (sum_of_squares) gathered at once.
constexpr int64_t kGatherBytes = int64_t(64) << 20;

// R[g, n, i, j] = sum_b sum_o x[b, g Cig + i, o] x[b, g Cig + j, o + lag n], x taken
// as 0 outside its extent: [G, lags, Cig, Cig] double. x is zero-padded so that no
// coordinate of a shifted position leaves its padded range (depth: the far side only,
// since only lags from lag 0 on are computed); a lag is then one offset in the
// flattened padded x, and R at that lag one GEMM of two windows of it, views with no
// copy. R(-l) = R(l)^T gives the other half.
at::Tensor cross_correlation(const at::Tensor& x, const ConvGeometry& g, const Lags& lags) {
  const int64_t groups = g.groups, cig = g.in_group_channels();
  // [G, Cig, B, D, H, W]: a channel's values over (b, o) contiguous, a GEMM row.
  const at::Tensor xt =
      x.to(at::kDouble)
          .reshape({g.batch, groups, cig, g.in_size[0], g.in_size[1], g.in_size[2]})
          .permute({1, 2, 0, 3, 4, 5})
          .contiguous();
  int64_t pad[3];
  for (int d = 0; d < 3; ++d) pad[d] = lags.reach[d] * lags.step[d];
  const at::Tensor padded =
      at::constant_pad_nd(xt, {pad[2], pad[2], pad[1], pad[1], 0, pad[0]}).contiguous();
  const int64_t length = padded.numel() / (groups * cig);
  const at::Tensor flat = padded.view({groups, cig, length});
  const int64_t offset_per[3] = {padded.size(4) * padded.size(5), padded.size(5), 1};
  const int64_t count = lags.count(), centre = count / 2;  // lag 0 is the middle one
  auto r = at::empty({groups, count, cig, cig}, xt.options());
  for (int64_t n = centre; n < count; ++n) {
    const auto lag = lags(n);
    int64_t offset = 0;  // >= 0 from lag 0 on (depth lag >= 0, or 0 and height lag >= 0, ...)
    for (int d = 0; d < 3; ++d) offset += lag[d] * lags.step[d] * offset_per[d];
    const at::Tensor first = flat.narrow(2, 0, length - offset);
    const at::Tensor second = flat.narrow(2, offset, length - offset);
    r.select(1, n).copy_(at::bmm(first, second.transpose(1, 2)));
  }
  r.narrow(1, 0, centre).copy_(r.narrow(1, centre + 1, centre).flip({1}).transpose(2, 3));
  return r;
}

// [K', K'] long: the lag number (Lags) of m - m' for sub-kernel positions m, m'
// (flattened, W fastest), built from aranges on `opts`' device.
at::Tensor lag_of_pairs(const Lags& lags, const int64_t kernel[3], const at::TensorOptions& opts) {
  at::Tensor index = at::zeros({1, 1, 1, 1, 1, 1}, opts);
  for (int d = 0; d < 3; ++d) {
    std::vector<int64_t> first(6, 1), second(6, 1);
    first[d] = kernel[d];
    second[3 + d] = kernel[d];
    const at::Tensor m = at::arange(kernel[d], opts);
    const at::Tensor diff = m.view(first) - m.view(second) + lags.reach[d];
    index = index * (2 * lags.reach[d] + 1) + diff;
  }
  const int64_t taps = kernel[0] * kernel[1] * kernel[2];
  return index.reshape({taps, taps});
}

// sum_b sum_o y[b, c, o]^2 over the whole output, [G, Cog] double: for each phase's
// sub-kernel column u = w_r[:, c, :] (over (m, ci)), u^T T u with T the block-Toeplitz
// matrix T[(m, i), (m', j)] = R[m - m'][i, j] (§3.4). T is gathered from R a chunk of
// rows m at a time (at most kGatherBytes), and multiplied into every phase and channel
// at once. stack: [P, G, Cig, Cog, K'] double (K' = k'd k'h k'w).
at::Tensor sum_of_squares(const at::Tensor& r, const at::Tensor& stack, const Lags& lags,
                          const int64_t kernel[3]) {
  const int64_t phases = stack.size(0), groups = stack.size(1), cig = stack.size(2),
                cog = stack.size(3), taps = stack.size(4);
  // u over rows (m, i): [G, K' Cig, P Cog].
  const at::Tensor u =
      stack.permute({1, 4, 2, 0, 3}).reshape({groups, taps * cig, phases * cog});
  const at::Tensor pair_lag = lag_of_pairs(lags, kernel, stack.options().dtype(at::kLong));
  const int64_t row_bytes = groups * cig * taps * cig * 8;  // one m of T
  const int64_t chunk = std::clamp<int64_t>(kGatherBytes / row_bytes, 1, taps);
  auto total = at::zeros({groups, phases * cog}, stack.options());
  for (int64_t m0 = 0; m0 < taps; m0 += chunk) {
    const int64_t n = std::min(chunk, taps - m0);
    const at::Tensor rows = r.index_select(1, pair_lag.narrow(0, m0, n).reshape({-1}))
                                .view({groups, n, taps, cig, cig})
                                .permute({0, 1, 3, 2, 4})
                                .reshape({groups, n * cig, taps * cig});
    total.add_(u.narrow(1, m0 * cig, n * cig).mul(at::bmm(rows, u)).sum(1));
  }
  return total.view({groups, phases, cog}).sum(1);
}

// With one lag (every phase's sub-kernel a single tap, e.g. kernel = stride) T is R itself and
// each tap its own phase: the sum of squares is sum_t w_t^T R w_t over taps and channels, two
// GEMMs with no gathers, padding or index tensors (each of those is an op of host time, and
// this case is the decoders' upsampling at small sizes). R as the samples' Gram matrices
// summed: x needs no permuted copy. [G Cog] double.
at::Tensor single_lag_sum_of_squares(const at::Tensor& x, const at::Tensor& weight,
                                     const ConvGeometry& g) {
  const int64_t groups = g.groups, cig = g.in_group_channels();
  const at::Tensor xs = x.to(at::kDouble).reshape({g.batch * groups, cig, g.in_spatial()});
  const at::Tensor r = at::bmm(xs, xs.transpose(1, 2)).view({g.batch, groups, cig, cig}).sum(0);
  const at::Tensor w = weight.to(at::kDouble).reshape({groups, cig, -1});  // [G, Cig, Cog T]
  return at::bmm(r, w).mul_(w).sum(1).view({g.out_channels, g.taps()}).sum(1);
}

}  // namespace

double correlation_cost_ratio(const ConvGeometry& g) {
  const ConvGeometry sub = phase_geometry(g);
  const Lags lags(sub);
  double padded = static_cast<double>(g.batch);  // positions of the padded x (cross_correlation)
  for (int d = 0; d < 3; ++d) {
    padded *= static_cast<double>(g.in_size[d] + (d == 0 ? 1 : 2) * lags.reach[d] * lags.step[d]);
  }
  const double cig = static_cast<double>(g.in_group_channels());
  const double computed_lags = static_cast<double>(lags.count() / 2 + 1);
  const double correlation = static_cast<double>(g.groups) * cig * cig * computed_lags * padded;
  const double convolution = static_cast<double>(g.batch) * static_cast<double>(g.in_spatial()) *
                             static_cast<double>(g.in_channels) *
                             static_cast<double>(g.out_group_channels()) *
                             static_cast<double>(g.taps());
  return correlation / convolution;
}

at::Tensor energy_correlation(const at::Tensor& x, const at::Tensor& weight,
                              const SampleSumTensors& sums, const ConvGeometry& g) {
  const ConvGeometry sub = phase_geometry(g);
  const Lags lags(sub);
  at::Tensor squares;
  if (lags.count() == 1) {
    squares = single_lag_sum_of_squares(x, weight, g);
  } else {
    const at::Tensor slots = tap_slots(g, sub, weight.options().dtype(at::kLong));
    const int64_t cig = g.in_group_channels(), cog = g.out_group_channels();
    const at::Tensor stack = phase_stack(weight, g, sub, slots)  // [P, G, Cig, Cog, K']
                                 .view({g.groups, cig, cog, phase_count(g), sub.taps()})
                                 .permute({3, 0, 1, 2, 4});
    squares = sum_of_squares(cross_correlation(x, g, lags), stack, lags, sub.kernel);
  }
  // Centred on each sample's mean S / M over the real output, in float64 (§3.4).
  const at::Tensor s = sample_conv_sums(sums, g);  // [B, Co]
  const double m = static_cast<double>(g.out_spatial());
  return squares.view({g.out_channels}).sub(s.square().sum(0).div_(m)).view({1, g.out_channels, 1});
}

}  // namespace fused_ops
