// The correlation path of the training-mode energy (docs/math.md §3.4): each
// phase's sum of squares is x's channel cross-correlation at the lags its
// sub-kernel spans, contracted with the sub-kernel's own tap pairs at those lags.
// float64 throughout, ATen ops only, so it runs on every device; its cost grows
// with Cig^2 times the number of lags, not with the output's size.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <vector>

#include "phases.h"

namespace fused_ops {
namespace {

// Bytes of shifted copies of x (float64) held at once.
constexpr int64_t kShiftBytes = int64_t(64) << 20;

// The lags of the phases' sub-kernels: -(k' - 1) .. k' - 1 positions per dim.
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

// R[g, n, i, j] = sum_b sum_o x[b, g Cig + i, o] x[b, g Cig + j, o + lag n], x taken
// as 0 outside its extent: [G, lags, Cig, Cig] double. One GEMM per chunk of lags
// over a stack of shifted windows of the padded x.
at::Tensor cross_correlation(const at::Tensor& x, const ConvGeometry& g, const Lags& lags) {
  const int64_t groups = g.groups, cig = g.in_group_channels();
  const int64_t k = g.batch * g.in_spatial();
  // [G, Cig, B, D, H, W]: a channel's values over (b, o) contiguous, a GEMM row.
  const at::Tensor xt =
      x.to(at::kDouble)
          .reshape({g.batch, groups, cig, g.in_size[0], g.in_size[1], g.in_size[2]})
          .permute({1, 2, 0, 3, 4, 5})
          .contiguous();
  int64_t pad[3];
  for (int d = 0; d < 3; ++d) pad[d] = lags.reach[d] * lags.step[d];
  const at::Tensor padded =
      at::constant_pad_nd(xt, {pad[2], pad[2], pad[1], pad[1], pad[0], pad[0]});
  const at::Tensor rows = xt.view({groups, cig, k});
  const int64_t count = lags.count();
  const int64_t chunk =
      std::clamp<int64_t>(kShiftBytes / std::max<int64_t>(1, xt.numel() * 8), 1, count);
  auto r = at::empty({groups, count, cig, cig}, xt.options());
  for (int64_t n0 = 0; n0 < count; n0 += chunk) {
    const int64_t n = std::min(chunk, count - n0);
    std::vector<at::Tensor> shifted;
    for (int64_t i = n0; i < n0 + n; ++i) {
      const auto lag = lags(i);
      at::Tensor window = padded;
      for (int d = 0; d < 3; ++d) {
        window = window.narrow(3 + d, pad[d] + lag[d] * lags.step[d], g.in_size[d]);
      }
      shifted.push_back(window);
    }
    const at::Tensor columns = at::stack(shifted, 1).view({groups, n * cig, k});
    r.narrow(1, n0, n).copy_(
        at::bmm(rows, columns.transpose(1, 2)).view({groups, cig, n, cig}).permute({0, 2, 1, 3}));
  }
  return r;
}

// sum_b sum_o y[b, c, o]^2 over the whole output, [G, Cog] double: for each lag,
// the tap pairs (m, m - lag) of every phase's sub-kernel against x's correlation
// at that lag. stack: [P, G, Cig, Cog, k'd, k'h, k'w] double.
at::Tensor sum_of_squares(const at::Tensor& r, const at::Tensor& stack, const Lags& lags) {
  auto total = at::zeros({stack.size(1), stack.size(3)}, stack.options());
  for (int64_t n = 0; n < lags.count(); ++n) {
    const auto lag = lags(n);
    at::Tensor first = stack, second = stack;
    for (int d = 0; d < 3; ++d) {
      const int64_t len = stack.size(4 + d) - std::abs(lag[d]);
      first = first.narrow(4 + d, std::max<int64_t>(lag[d], 0), len);    // taps at m
      second = second.narrow(4 + d, std::max<int64_t>(-lag[d], 0), len);  // taps at m - lag
    }
    total.add_(at::einsum("pgicxyz,gij,pgjcxyz->gc", {first, r.select(1, n), second}));
  }
  return total;
}

}  // namespace

at::Tensor energy_correlation(const at::Tensor& x, const at::Tensor& weight,
                              const SampleSumTensors& sums, const ConvGeometry& g) {
  const ConvGeometry sub = phase_geometry(g);
  const Lags lags(sub);
  const at::Tensor slots = tap_slots(g, sub, weight.options().dtype(at::kLong));
  const int64_t cig = g.in_group_channels(), cog = g.out_group_channels();
  const at::Tensor stack = phase_taps(weight, g, sub, slots)
                               .all()
                               .to(at::kDouble)
                               .view({g.groups, cig, cog, phase_count(g), sub.kernel[0],
                                      sub.kernel[1], sub.kernel[2]})
                               .permute({3, 0, 1, 2, 4, 5, 6});
  const at::Tensor squares = sum_of_squares(cross_correlation(x, g, lags), stack, lags);
  // Centred on each sample's mean S / M over the real output (§3.4): in float64,
  // whose rounding the subtraction leaves negligible unless the mean exceeds the
  // spread by about 1e4 (docs/math.md §5).
  const at::Tensor s = phase_sample_sums(weight, sums, g, sub, slots).sum(2);  // [B, Co]
  const double m = static_cast<double>(g.out_spatial());
  return squares.view({g.out_channels}).sub(s.square().sum(0).div_(m)).view({1, g.out_channels, 1});
}

}  // namespace fused_ops
