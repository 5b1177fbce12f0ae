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

// The sums and, in training, the energy: everything the finalize needs from x.
void reduce_input(const Backend& backend, const at::Tensor& x_in, const at::Tensor& weight_in,
                  const ConvGeometry& g, bool training, c10::string_view algo, FinalizeInputs& in) {
  const EnergyAlgo energy_algo = parse_energy_algo(algo, backend, g, x_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  in.sums = sample_sums(backend, x, weight, g);
  if (!training) return;
  switch (energy_algo) {
    case EnergyAlgo::Direct:
      in.energy = backend.energy_direct(x, pack_weight_for_direct(weight, g), in.sums, g);
      break;
    case EnergyAlgo::SlicedConv:
      in.energy = energy_sliced_conv(x, weight, g);
      break;
    case EnergyAlgo::Fft:
      in.energy = backend.energy_fft(x, weight, in.sums, g);
      break;
  }
}

// Sets the BN parameters, running stats and scalars of `in`.
void set_bn_inputs(const c10::optional<at::Tensor>& bias, double scale,
                   const c10::optional<at::Tensor>& bn_weight,
                   const c10::optional<at::Tensor>& bn_bias,
                   const c10::optional<at::Tensor>& running_mean,
                   const c10::optional<at::Tensor>& running_var, double momentum, double eps,
                   FinalizeInputs& in) {
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
}

void copy_back_running_stats(const FinalizeInputs& in, const c10::optional<at::Tensor>& running_mean,
                             const c10::optional<at::Tensor>& running_var) {
  if (!in.batch_stats || !running_mean.has_value() || !running_mean->defined()) return;
  if (!in.running_mean.is_same(*running_mean)) running_mean->copy_(in.running_mean);
  if (!in.running_var.is_same(*running_var)) running_var->copy_(in.running_var);
}

}  // namespace

at::Tensor ct_bn_pool_forward(const Backend& backend, const at::Tensor& x,
                              const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                              double scale, const c10::optional<at::Tensor>& bn_weight,
                              const c10::optional<at::Tensor>& bn_bias,
                              const c10::optional<at::Tensor>& running_mean,
                              const c10::optional<at::Tensor>& running_var, bool training,
                              double momentum, double eps, at::IntArrayRef stride,
                              at::IntArrayRef padding, at::IntArrayRef output_padding,
                              at::IntArrayRef dilation, int64_t groups, c10::string_view algo) {
  const ConvGeometry g =
      validate_inputs(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, training,
                      eps, stride, padding, output_padding, dilation, groups);
  FinalizeInputs in;
  reduce_input(backend, x, weight, g, training, algo, in);
  set_bn_inputs(bias, scale, bn_weight, bn_bias, running_mean, running_var, momentum, eps, in);
  in.batch_stats = training;
  auto out = at::empty({g.batch, g.out_channels, 1, 1, 1}, x.options());
  backend.finalize(in, g, out);
  copy_back_running_stats(in, running_mean, running_var);
  return out;
}

std::tuple<at::Tensor, at::Tensor> ct_bn_pool_stats_forward(
    const Backend& backend, const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, at::IntArrayRef dilation,
    int64_t groups, c10::string_view algo) {
  const ConvGeometry g = validate_inputs(x, weight, {}, {}, {}, {}, {}, /*training=*/true,
                                         /*eps=*/1.0, stride, padding, output_padding, dilation,
                                         groups, /*one_of_many=*/true);
  const auto opts = x.options().dtype(at::kDouble);
  if (g.batch == 0) return {at::zeros({0, g.out_channels}, opts), at::zeros({3, g.out_channels}, opts)};
  FinalizeInputs in;
  reduce_input(backend, x, weight, g, /*training=*/true, algo, in);
  in.stats_out = at::empty({3, g.out_channels}, opts);
  in.sample_sums_out = at::empty({g.batch, g.out_channels}, opts);
  auto unused = at::empty({0}, x.options());
  backend.finalize(in, g, unused);
  return {in.sample_sums_out, in.stats_out};
}

at::Tensor ct_bn_pool_apply_forward(const Backend& backend, const at::Tensor& sample_sums,
                                    const at::Tensor& stats, int64_t spatial,
                                    const c10::optional<at::Tensor>& bias, double scale,
                                    const c10::optional<at::Tensor>& bn_weight,
                                    const c10::optional<at::Tensor>& bn_bias,
                                    const c10::optional<at::Tensor>& running_mean,
                                    const c10::optional<at::Tensor>& running_var, double momentum,
                                    double eps, at::ScalarType dtype) {
  const ConvGeometry g = validate_apply_inputs(sample_sums, stats, spatial, bias, bn_weight,
                                               bn_bias, running_mean, running_var, eps, dtype);
  FinalizeInputs in;
  in.sample_sums = sample_sums.contiguous();
  in.stats_in = stats.contiguous();
  set_bn_inputs(bias, scale, bn_weight, bn_bias, running_mean, running_var, momentum, eps, in);
  auto out = at::empty({g.batch, g.out_channels, 1, 1, 1}, sample_sums.options().dtype(dtype));
  backend.finalize(in, g, out);
  copy_back_running_stats(in, running_mean, running_var);
  return out;
}

}  // namespace fused_ops
