// Training mode's "kept" route (docs/math.md §6.2.4, fused_ops/_kept_output.py): where a
// gradient will flow, the forward forms the convolution output y once, takes the batch
// statistics from it and keeps it for the backward, whose gradient of y is affine in y.
// Both halves are here as ATen calls from C++ rather than from Python: on the small layers
// this route serves, the dozens of per-channel ops around the convolution cost more host
// time from Python than the convolution itself.
#include "ct_bn_pool.h"

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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ct_bn_pool_kept_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bn_weight, const at::Tensor& y, const at::Tensor& sample_sums,
    const at::Tensor& stats, double scale, double eps, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, at::IntArrayRef dilation,
    int64_t groups, std::array<bool, 2> output_mask) {
  const at::ScalarType compute = compute_dtype(x.scalar_type());
  const int64_t batch = y.size(0);
  const double n = static_cast<double>(y.size(2) * y.size(3) * y.size(4));  // positions
  const at::Tensor g = grad_out.flatten(1).to(compute);  // [B, C]
  const at::Tensor g_sum = g.sum(0);                      // sum_b g: BatchNorm's bias gradient
  const at::Tensor mean = stats[1], var = stats[2] / stats[0];
  // dzhat / dy = scale / sqrt(var_z + eps), float64 [C]; zbar: each sample's pooled zhat.
  const at::Tensor z_unit = (var * (scale * scale) + eps).rsqrt_().mul_(scale);
  const at::Tensor zbar = (z_unit * (sample_sums / n - mean)).to(compute);  // [B, C]
  at::Tensor grad_bn_weight = (g * zbar).sum(0);
  at::Tensor grad_x, grad_weight;
  if (output_mask[0] || output_mask[1]) {
    // dL/dy = A + K (y - mean) (§6.2.2): A = coef (g - mean_b g),
    // K = -coef mean_b(g zbar) dzhat/dy.
    const at::Tensor z_unit_c = z_unit.to(compute);
    const at::Tensor gain = bn_weight.has_value() && bn_weight->defined()
                                ? bn_weight->to(compute) * z_unit_c : z_unit_c;
    const at::Tensor coef = gain / n;
    const at::Tensor field = coef * (g - g_sum / static_cast<double>(batch));
    const at::Tensor k = -coef * (grad_bn_weight / static_cast<double>(batch)) * z_unit_c;
    const at::Tensor shift = (field - k * mean).to(y.scalar_type()).view({batch, -1, 1, 1, 1});
    const at::Tensor grad_y = at::addcmul(shift, y, k.to(y.scalar_type()).view({1, -1, 1, 1, 1}));
    std::tie(grad_x, grad_weight, std::ignore) = at::convolution_backward(
        grad_y, x, weight, c10::nullopt, stride, padding, dilation, /*transposed=*/true,
        output_padding, groups, {output_mask[0], output_mask[1], false});
  }
  // Contiguous whatever the backend chose (the fake kernel's layout); what is not asked for
  // comes back empty: a schema's Tensor return cannot be None.
  grad_x = grad_x.defined() ? grad_x.contiguous() : at::empty({0}, x.options());
  grad_weight = grad_weight.defined() ? grad_weight.contiguous() : at::empty({0}, weight.options());
  return {grad_x, grad_weight, grad_bn_weight, g_sum};
}

}  // namespace fused_ops
