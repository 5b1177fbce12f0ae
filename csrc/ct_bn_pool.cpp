// The operator's algorithm, shared by every device (docs/math.md): reduce x and
// the weight to per-sample output sums, get the within-sample energy in training
// mode, then finalize the batch norm and the pool.
#include "ct_bn_pool.h"

#include "conv_transpose_point.h"
#include "validate.h"

namespace fused_ops {

SampleSums SampleSumTensors::view(const ConvGeometry& g) const {
  SampleSums s;
  s.x_red = x_red.data_ptr<double>();
  s.w_red = w_red.data_ptr<double>();
  s.parts = x_red.size(2);
  s.w_part_stride = w_red.size(2) == 1 ? 0 : 1;
  s.in_channels = g.in_channels;
  s.in_group_channels = g.in_group_channels();
  s.out_group_channels = g.out_group_channels();
  return s;
}

at::Tensor pack_weight_for_direct(const at::Tensor& weight, const ConvGeometry& g) {
  const int64_t cog = g.out_group_channels();
  const int64_t co_pad = (cog + kDirectTile - 1) / kDirectTile * kDirectTile;
  auto w = weight.reshape({g.groups, g.in_group_channels(), cog, g.taps()}).transpose(2, 3);
  return at::constant_pad_nd(w, {0, co_pad - cog}).contiguous();
}

namespace {

SampleSumTensors sample_sums(const Backend& backend, const at::Tensor& x, const at::Tensor& w,
                             const ConvGeometry& g) {
  if (!g.has_padding()) return backend.sample_sums(x, w);
  return {box_sums(x, g),
          w.to(at::kDouble).reshape({g.in_channels, g.out_group_channels(), g.taps()})};
}

at::Tensor optional_contiguous(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->contiguous() : at::Tensor();
}

}  // namespace

at::Tensor ct_bn_pool_forward(const Backend& backend, const at::Tensor& x_in,
                              const at::Tensor& weight_in, const c10::optional<at::Tensor>& bias,
                              double scale, const c10::optional<at::Tensor>& bn_weight,
                              const c10::optional<at::Tensor>& bn_bias,
                              const c10::optional<at::Tensor>& running_mean,
                              const c10::optional<at::Tensor>& running_var, bool training,
                              double momentum, double eps, at::IntArrayRef stride,
                              at::IntArrayRef padding, at::IntArrayRef output_padding,
                              at::IntArrayRef dilation, int64_t groups, c10::string_view algo) {
  const ConvGeometry g =
      validate_inputs(x_in, weight_in, bias, bn_weight, bn_bias, running_mean, running_var,
                      training, eps, stride, padding, output_padding, dilation, groups);
  const EnergyAlgo energy_algo = parse_energy_algo(algo, backend, g);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();

  FinalizeInputs in;
  in.sums = sample_sums(backend, x, weight, g);
  if (training) {
    in.energy = energy_algo == EnergyAlgo::Direct
                    ? backend.energy_direct(x, pack_weight_for_direct(weight, g), in.sums, g)
                    : energy_sliced_conv(x, weight, g);
  }
  in.bias = optional_contiguous(bias);
  in.gamma = optional_contiguous(bn_weight);
  in.beta = optional_contiguous(bn_bias);
  // Running stats are written in place, so they are used as given; a
  // non-contiguous one goes through a contiguous copy that is copied back.
  in.running_mean = optional_contiguous(running_mean);
  in.running_var = optional_contiguous(running_var);
  in.scale = scale;
  in.momentum = momentum;
  in.eps = eps;
  in.batch_stats = training;

  auto out = at::empty({g.batch, g.out_channels, 1, 1, 1}, x.options());
  backend.finalize(in, g, out);
  if (training && running_mean.has_value() && running_mean->defined()) {
    if (!in.running_mean.is_same(*running_mean)) running_mean->copy_(in.running_mean);
    if (!in.running_var.is_same(*running_var)) running_var->copy_(in.running_var);
  }
  return out;
}

}  // namespace fused_ops
