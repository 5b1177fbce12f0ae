// The operator's algorithm, shared by every device (docs/math.md): reduce x and
// the weight to per-sample output sums, get the within-sample energy in training
// mode, then finalize the batch norm and the pool.
#include "ct_bn_pool.h"

#include "common/conv_transpose_row.h"
#include "dispatch.h"
#include "validate.h"

namespace fused_ops {

at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

SampleSums SampleSumTensors::view(const ConvGeometry& g) const {
  SampleSums s;
  s.x_red = x_red.data_ptr<double>();
  s.w_red = w_red.defined() ? w_red.data_ptr<double>() : nullptr;
  s.parts = x_red.size(2);
  s.w_part_stride = w_red.defined() && w_red.size(2) != 1 ? 1 : 0;
  s.in_channels = g.in_channels;
  s.in_group_channels = g.in_group_channels();
  s.out_group_channels = g.out_group_channels();
  return s;
}

at::Tensor sample_conv_sums(const SampleSumTensors& sums, const ConvGeometry& g) {
  const int64_t G = g.groups, cig = g.in_group_channels(), cog = g.out_group_channels();
  // x's parts summed where the weight's sums are whole (padding 0), else contracted with the
  // weight's: one GEMM, batched over the groups (einsum's chain of views, permutes and copies
  // is dozens of ATen ops a call: a padded eval call's host time is mostly ops like these).
  const bool whole = sums.w_red.size(2) == 1;
  const int64_t parts = whole ? 1 : sums.x_red.size(2);
  const at::Tensor x_red = whole ? sums.x_red.sum(2) : sums.x_red.view({g.batch, g.in_channels * parts});
  const at::Tensor w_red = whole ? sums.w_red.view({G, cig, cog})
                                 : sums.w_red.view({G, cig, cog, parts}).transpose(2, 3).reshape({G, cig * parts, cog});
  if (G == 1) return at::mm(x_red, w_red[0]);
  return at::bmm(x_red.view({g.batch, G, cig * parts}).transpose(0, 1), w_red)
      .transpose(0, 1)
      .reshape({g.batch, g.out_channels});
}

at::Tensor energy_of(const Backend& backend, EnergyAlgo algo, const at::Tensor& x,
                     const at::Tensor& weight, const SampleSumTensors& sums, const ConvGeometry& g) {
  switch (algo) {
    case EnergyAlgo::Direct:
      return backend.energy_direct(x.contiguous(), weight, sums, g);
    case EnergyAlgo::SlicedConv:
      return energy_sliced_conv(x, weight, g);
    case EnergyAlgo::Fft:
      return backend.energy_fft(x, weight, sums, g);
    case EnergyAlgo::Correlation:
      return energy_correlation(x, weight, sums, g);
    case EnergyAlgo::CrossSpectrum:
      return energy_cross_spectrum(backend, x, weight, sums, g);
    case EnergyAlgo::Border:
      return energy_border(backend, x, weight, sums, g);
  }
  TORCH_INTERNAL_ASSERT(false, "ct_bn_pool: unknown energy algorithm");
  return {};
}

SampleSumTensors training_sample_sums(const Backend& backend, EnergyAlgo algo, const at::Tensor& x,
                                      const at::Tensor& weight, const ConvGeometry& g) {
  // x's sums out of the spectrum's pass over x (x_spectrum's channel sums) where it pays.
  if (!sums_from_spectrum(algo, g, x.numel() * x.element_size())) return backend.sample_sums(x, weight);
  SampleSumTensors sums;
  sums.x_red = at::empty({g.batch, g.in_channels, 1}, x.options().dtype(at::kDouble));
  sums.w_red = backend.weight_sums(weight);
  sums.x_red_from_spectrum = true;
  return sums;
}

namespace {

SampleSumTensors sample_sums(const Backend& backend, const at::Tensor& x, const at::Tensor& w,
                             const ConvGeometry& g) {
  if (!g.has_padding()) return backend.sample_sums(x, w);
  return {box_sums(backend, x, g),
          w.to(at::kDouble).reshape({g.in_channels, g.out_group_channels(), g.taps()})};
}

// A contiguous tensor of `t`'s values in `dtype`: `t` itself where it is one.
at::Tensor contiguous_as(const c10::optional<at::Tensor>& t, at::ScalarType dtype) {
  return t.has_value() && t->defined() ? as_dtype(*t, dtype).contiguous() : at::Tensor();
}

// The sums and, in training, the energy: everything the finalize needs from x.
// x keeps its layout (memory format, strides) wherever the step reading it takes
// any: the sums, ATen's convolution and FFT; only the direct kernel needs it
// contiguous.
void reduce_input(const Backend& backend, const at::Tensor& x_in, const at::Tensor& weight_in,
                  const ConvGeometry& g, bool training, c10::string_view algo, FinalizeInputs& in) {
  const EnergyAlgo energy_algo = parse_energy_algo(algo, backend, g, x_in.scalar_type());
  const at::ScalarType energy_dtype = compute_dtype(x_in.scalar_type());
  // The sums read x and the weight in their own dtype, x in its own layout.
  const at::Tensor weight_c = weight_in.contiguous();
  if (!training && !g.has_padding() && backend.eval_sample_sums) {
    in.sums = backend.eval_sample_sums(x_in, weight_c, g);
    if (!in.sums.w_red.defined()) in.weight = weight_c;  // the finalize sums it
    return;
  }
  // The direct statistics that need no sums of x, where the device has them.
  if (training && energy_algo == EnergyAlgo::Direct && backend.direct_stats) {
    auto [energy, sample_sums] =
        backend.direct_stats(as_dtype(x_in, energy_dtype).contiguous(), contiguous_as(weight_in, energy_dtype), g);
    if (energy.defined()) {
      in.energy = std::move(energy);
      in.sample_sums = std::move(sample_sums);
      return;
    }
  }
  in.sums = training && !g.has_padding() ? training_sample_sums(backend, energy_algo, x_in, weight_c, g)
                                          : sample_sums(backend, x_in, weight_c, g);
  // The box sums' contraction: as one batched GEMM here, or in the finalize (dispatch.h).
  if (box_sums_by_gemm(g)) in.sample_sums = sample_conv_sums(in.sums, g);
  if (!training) return;
  const at::Tensor x = as_dtype(x_in, energy_dtype);  // same layout
  const at::Tensor weight = contiguous_as(weight_in, energy_dtype);
  in.energy = energy_of(backend, energy_algo, x, weight, in.sums, g);
}

// Sets the BN parameters, running stats and scalars of `in`, as contiguous
// tensors of dtype `dtype` (the finalize's C).
void set_bn_inputs(const c10::optional<at::Tensor>& bias, double scale,
                   const c10::optional<at::Tensor>& bn_weight,
                   const c10::optional<at::Tensor>& bn_bias,
                   const c10::optional<at::Tensor>& running_mean,
                   const c10::optional<at::Tensor>& running_var, double momentum, double eps,
                   at::ScalarType dtype, FinalizeInputs& in) {
  in.bias = contiguous_as(bias, dtype);
  in.gamma = contiguous_as(bn_weight, dtype);
  in.beta = contiguous_as(bn_bias, dtype);
  // Running stats are written in place where they are contiguous and already
  // of that dtype; any other goes through a copy that copy_back_running_stats
  // writes back.
  in.running_mean = contiguous_as(running_mean, dtype);
  in.running_var = contiguous_as(running_var, dtype);
  in.scale = scale;
  in.momentum = momentum;
  in.eps = eps;
}

// Writes the updated running stats into the caller's tensors, in their own
// dtype, where the finalize updated copies (see set_bn_inputs).
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
  const at::ScalarType finalize_dtype = compute_dtype(x.scalar_type());
  // An empty batch: an empty output, the running statistics untouched (as nn.BatchNorm3d).
  if (g.batch == 0) return at::empty({0, g.out_channels, 1, 1, 1}, x.options());
  FinalizeInputs in;
  // The BN inputs first: their copies (another dtype, non-contiguous) must not run
  // between the sums and the finalize, which reads them before its pdl_wait on CUDA
  // (csrc/common/cuda/pdl.cuh).
  set_bn_inputs(bias, scale, bn_weight, bn_bias, running_mean, running_var, momentum, eps,
                finalize_dtype, in);
  reduce_input(backend, x, weight, g, training, algo, in);
  in.batch_stats = training;
  auto out = at::empty({g.batch, g.out_channels, 1, 1, 1}, x.options().dtype(finalize_dtype));
  backend.finalize(in, g, out);
  copy_back_running_stats(in, running_mean, running_var);
  return as_dtype(out, x.scalar_type());
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
  auto unused = at::empty({0}, x.options().dtype(compute_dtype(x.scalar_type())));
  backend.finalize(in, g, unused);
  return {in.sample_sums_out, in.stats_out};
}

std::tuple<at::Tensor, at::Tensor> ct_bn_pool_lag_spectrum_forward(
    const Backend& backend, const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef dilation,
    int64_t groups) {
  const std::array<int64_t, 3> ones = {1, 1, 1}, zeros = {0, 0, 0};
  const ConvGeometry g = validate_inputs(x, weight, {}, {}, {}, {}, {}, /*training=*/true,
                                         /*eps=*/1.0, ones, zeros, zeros, dilation, groups,
                                         /*one_of_many=*/true);
  const at::Tensor x_c = as_dtype(x, compute_dtype(x.scalar_type()));
  if (g.batch > 0) return x_lag_spectrum(backend, x_c, g);
  const int64_t cig = g.in_group_channels();
  const at::ScalarType spectrum = x_c.scalar_type() == at::kDouble ? at::kComplexDouble : at::kComplexFloat;
  return {at::zeros({2 * g.kernel[0] - 1, 2 * g.kernel[1] - 1, g.kernel[2], g.groups, cig, cig},
                    x.options().dtype(at::kComplexDouble)),
          at::empty({g.out_size[0], g.out_size[1], g.out_size[2] / 2 + 1, 0, g.in_channels},
                    x.options().dtype(spectrum))};
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
  const at::ScalarType finalize_dtype = compute_dtype(dtype);
  FinalizeInputs in;
  in.sample_sums = sample_sums.contiguous();
  in.stats_in = stats.contiguous();
  set_bn_inputs(bias, scale, bn_weight, bn_bias, running_mean, running_var, momentum, eps,
                finalize_dtype, in);
  auto out = at::empty({g.batch, g.out_channels, 1, 1, 1},
                       sample_sums.options().dtype(finalize_dtype));
  backend.finalize(in, g, out);
  copy_back_running_stats(in, running_mean, running_var);
  return as_dtype(out, dtype);
}

}  // namespace fused_ops
