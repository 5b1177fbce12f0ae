// Training mode's "kept" route (docs/math.md §6.2.4, fused_ops/_kept_output.py): where a
// gradient will flow, the forward forms the convolution output y once, takes the batch
// statistics from it and keeps it for the backward, whose gradient of y is affine in y.
// Both halves are here as ATen calls from C++ rather than from Python: on the small layers
// this route serves, the dozens of per-channel ops around the convolution cost more host
// time from Python than the convolution itself. The backward also serves a forward that kept
// only the statistics where one tap reaches each output position: its x and weight gradients
// are then x's Gram algebra (csrc/gram/gram.cpp), the same coefficients.
#include "ct_bn_pool.h"

#include "common/geometry.h"
#include "validate.h"

namespace fused_ops {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ct_bn_pool_kept_stats_forward(
    const Backend& backend, const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, at::IntArrayRef dilation,
    int64_t groups) {
  const ConvGeometry g = validate_inputs(x, weight, {}, {}, {}, {}, {}, /*training=*/true,
                                         /*eps=*/1.0, stride, padding, output_padding, dilation,
                                         groups);
  TORCH_CHECK(g.batch > 0, "_ct_bn_pool_kept_stats: x must hold at least one sample");
  // TF32 off whatever the global flags say: the statistics are float32-exact, as the op's. y
  // contiguous whatever layout the backend chose: what the fake kernel states.
  const auto& ctx = at::globalContext();
  at::Tensor y = at::_convolution(x, weight, {}, stride, padding, dilation, /*transposed=*/true,
                                  output_padding, groups, ctx.benchmarkCuDNN(),
                                  ctx.deterministicCuDNN(), ctx.userEnabledCuDNN(),
                                  /*allow_tf32=*/false)
                     .contiguous();
  // Each sample's mean and centred sum of squares in y's compute dtype (two passes over y, no
  // cancellation); the finalize merges them over the batch as the op's statistics are merged.
  const at::Tensor per_sample = y.flatten(2).to(compute_dtype(y.scalar_type()));
  const at::Tensor mean = per_sample.mean(2, /*keepdim=*/true);
  FinalizeInputs in;
  in.energy = (per_sample - mean).square_().sum(2, /*keepdim=*/true).to(at::kDouble);
  in.sample_sums = mean.squeeze(2).to(at::kDouble) * static_cast<double>(g.out_spatial());
  const auto opts = x.options().dtype(at::kDouble);
  in.stats_out = at::empty({3, g.out_channels}, opts);
  in.sample_sums_out = at::empty({g.batch, g.out_channels}, opts);
  auto unused = at::empty({0}, x.options().dtype(compute_dtype(x.scalar_type())));
  backend.finalize(in, g, unused);
  return {y, in.sample_sums_out, in.stats_out};
}

namespace {

// dL/dy = field[b, c] + k[c] (y - mean[c]) (§6.2.2) and the BatchNorm's gradients, from the
// pooled output's gradient and the batch's sums and statistics: field = coef (g - mean_b g),
// k = -coef mean_b(g zbar) dzhat/dy, coef = gamma dzhat/dy / positions.
struct AffineGrad {
  at::Tensor g_sum, grad_bn_weight;  // sum_b g, sum_b g zbar: [C], compute dtype
  at::Tensor field, k, mean;         // [B, C], [C] compute dtype; [C] float64
};

AffineGrad affine_grad(const at::Tensor& grad_out, const c10::optional<at::Tensor>& bn_weight,
                       const at::Tensor& sample_sums, const at::Tensor& stats, double scale,
                       double eps, double positions, at::ScalarType compute, bool need_field) {
  AffineGrad a;
  const at::Tensor g = grad_out.flatten(1).to(compute);  // [B, C]
  const double batch = static_cast<double>(g.size(0));
  a.g_sum = g.sum(0);
  a.mean = stats[1];
  // dzhat / dy = scale / sqrt(var_z + eps), float64 [C]; zbar: each sample's pooled zhat.
  const at::Tensor z_unit = (stats[2] / stats[0] * (scale * scale) + eps).rsqrt_().mul_(scale);
  const at::Tensor zbar = (z_unit * (sample_sums / positions - a.mean)).to(compute);  // [B, C]
  a.grad_bn_weight = (g * zbar).sum(0);
  if (need_field) {
    const at::Tensor z_unit_c = z_unit.to(compute);
    const at::Tensor gain = bn_weight.has_value() && bn_weight->defined()
                                ? bn_weight->to(compute) * z_unit_c : z_unit_c;
    const at::Tensor coef = gain / positions;
    a.field = coef * (g - a.g_sum / batch);
    a.k = -coef * (a.grad_bn_weight / batch) * z_unit_c;
  }
  return a;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ct_bn_pool_kept_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bn_weight, const c10::optional<at::Tensor>& y,
    const at::Tensor& sample_sums, const at::Tensor& stats, double scale, double eps,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef output_padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 2> output_mask) {
  const bool kept_y = y.has_value() && y->defined();
  TORCH_CHECK(kept_y || one_tap_per_position(weight, stride, padding, dilation),
              "_ct_bn_pool_kept_backward: without y the backward needs padding 0 and one tap per "
              "output position (dilation (k - 1) < stride in every dim)");
  int64_t positions = 1;
  for (int d = 0; d < 3; ++d) {
    positions *= conv_transpose_out_size(x.size(2 + d), weight.size(2 + d), stride[d], padding[d],
                                         dilation[d], output_padding[d]);
  }
  const bool need_field = output_mask[0] || output_mask[1];
  const AffineGrad a = affine_grad(grad_out, bn_weight, sample_sums, stats, scale, eps,
                                   static_cast<double>(positions), compute_dtype(x.scalar_type()),
                                   need_field);
  at::Tensor grad_x, grad_weight;
  if (need_field && kept_y) {
    const int64_t batch = y->size(0);
    const at::Tensor shift = (a.field - a.k * a.mean).to(y->scalar_type()).view({batch, -1, 1, 1, 1});
    const at::Tensor grad_y = at::addcmul(shift, *y, a.k.to(y->scalar_type()).view({1, -1, 1, 1, 1}));
    std::tie(grad_x, grad_weight, std::ignore) = at::convolution_backward(
        grad_y, x, weight, c10::nullopt, stride, padding, dilation, /*transposed=*/true,
        output_padding, groups, {output_mask[0], output_mask[1], false});
  } else if (need_field) {
    std::tie(grad_x, grad_weight) =
        gram_gradients(a.field, a.k, a.mean, x, weight, groups, output_mask);
  }
  // Contiguous whatever the backend chose (the fake kernel's layout); what is not asked for
  // comes back empty: a schema's Tensor return cannot be None.
  grad_x = grad_x.defined() ? grad_x.contiguous() : at::empty({0}, x.options());
  grad_weight = grad_weight.defined() ? grad_weight.contiguous() : at::empty({0}, weight.options());
  return {grad_x, grad_weight, a.grad_bn_weight, a.g_sum};
}

}  // namespace fused_ops
