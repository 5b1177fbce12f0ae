// Training mode's "kept" route (docs/math.md §6.2.4, fused_ops/_kept_output.py): where a
// gradient will flow, the forward forms the convolution output y once, takes the batch
// statistics from it and keeps it for the backward, whose gradient of y is affine in y.
// Both halves are here in C++ rather than in Python, and what surrounds the convolution is two
// kernels of the backend's (y's per-sample moments, the per-channel gradient coefficients of
// kept/affine_grad.h) rather than ATen ops: on the small layers this route serves, dozens of
// per-channel ops around the convolution would cost more host time than the convolution
// itself, from Python or from C++. The backward also serves a forward that kept
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
  // Each sample's sum and centred sum of squares (float64, two passes over y: no
  // cancellation); the finalize merges them over the batch as the op's statistics are merged.
  FinalizeInputs in;
  std::tie(in.sample_sums, in.energy) = backend.sample_moments(y);
  const auto opts = x.options().dtype(at::kDouble);
  in.stats_out = at::empty({3, g.out_channels}, opts);
  in.sample_sums_out = at::empty({g.batch, g.out_channels}, opts);
  auto unused = at::empty({0}, x.options().dtype(compute_dtype(x.scalar_type())));
  backend.finalize(in, g, unused);
  return {y, in.sample_sums_out, in.stats_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ct_bn_pool_kept_backward(
    const Backend& backend, const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
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
  // dL/dy = field[b, c] + k[c] (y - mean[c]) (§6.2.2) and the BatchNorm's gradients, one
  // routine per channel (kept/affine_grad.h); with y the convolution's backward takes
  // shift + k y, shift = field - k mean.
  const bool need_field = output_mask[0] || output_mask[1];
  const at::ScalarType compute = compute_dtype(x.scalar_type());
  // The kernels read these through raw pointers: what the forward gave, checked.
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 3 && stats.scalar_type() == at::kDouble &&
                  stats.device() == x.device(),
              "_ct_bn_pool_kept_backward: stats must be a float64 [3, C] tensor on x's device");
  const int64_t batch = x.size(0), channels = stats.size(1);
  TORCH_CHECK(sample_sums.dim() == 2 && sample_sums.size(0) == batch && sample_sums.size(1) == channels &&
                  sample_sums.scalar_type() == at::kDouble && sample_sums.device() == x.device(),
              "_ct_bn_pool_kept_backward: sample_sums must be a float64 [B, C] tensor on x's device");
  TORCH_CHECK(grad_out.numel() == batch * channels && grad_out.device() == x.device(),
              "_ct_bn_pool_kept_backward: grad_out must hold [B, C] values on x's device");
  TORCH_CHECK(!bn_weight.has_value() || !bn_weight->defined() ||
                  (bn_weight->numel() == channels && bn_weight->device() == x.device()),
              "_ct_bn_pool_kept_backward: bn_weight must hold C values on x's device");
  AffineGradInputs in;
  in.grad_out = as_dtype(grad_out, compute).reshape({batch, channels}).contiguous();
  if (bn_weight.has_value() && bn_weight->defined()) in.bn_weight = as_dtype(*bn_weight, compute).contiguous();
  in.sample_sums = sample_sums.contiguous();
  in.stats = stats.contiguous();
  const auto opts = in.grad_out.options();
  in.g_sum = at::empty({channels}, opts);
  in.g_zbar = at::empty({channels}, opts);
  if (need_field) {
    in.k = at::empty({channels}, opts);
    (kept_y ? in.shift : in.field) = at::empty({batch, channels}, opts);
  }
  in.scale = scale;
  in.eps = eps;
  in.positions = static_cast<double>(positions);
  backend.affine_grad(in);
  at::Tensor grad_x, grad_weight;
  if (need_field && kept_y) {
    const at::ScalarType dtype = y->scalar_type();
    const at::Tensor grad_y = at::addcmul(as_dtype(in.shift, dtype).view({batch, channels, 1, 1, 1}), *y,
                                          as_dtype(in.k, dtype).view({1, channels, 1, 1, 1}));
    std::tie(grad_x, grad_weight, std::ignore) = at::convolution_backward(
        grad_y, x, weight, c10::nullopt, stride, padding, dilation, /*transposed=*/true,
        output_padding, groups, {output_mask[0], output_mask[1], false});
  } else if (need_field) {
    std::tie(grad_x, grad_weight) =
        gram_gradients(in.field, in.k, stats[1], x, weight, groups, output_mask);
  }
  // Contiguous whatever the backend chose (the fake kernel's layout); what is not asked for
  // comes back empty: a schema's Tensor return cannot be None.
  grad_x = grad_x.defined() ? grad_x.contiguous() : at::empty({0}, x.options());
  grad_weight = grad_weight.defined() ? grad_weight.contiguous() : at::empty({0}, weight.options());
  return {grad_x, grad_weight, in.g_zbar, in.g_sum};
}

}  // namespace fused_ops
