#pragma once
// The shared orchestration of the ops (ct_bn_pool.cpp: validate, sums, energy, finalize) and
// the device-independent pieces of the algorithms, written with ATen ops, each defined in its
// algorithm's folder (docs/design.md, file map).
#include <ATen/ATen.h>

#include <array>
#include <string>

#include "backend.h"

namespace fused_ops {

// `t` in `dtype`: `t` itself where it has it (no dispatcher call: the eval call's host time).
at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype);

// Device-independent pieces, written with ATen ops.
// [B, Ci, taps] double: sums of x over the boxes whose taps land inside the
// cropped output (docs/math.md §2.2); used when padding > 0.
at::Tensor box_sums(const Backend& backend, const at::Tensor& x, const ConvGeometry& g);
// [B, Co, 1] double energy via ATen's convolution over slices of the batch
// (docs/math.md §3.2).
at::Tensor energy_sliced_conv(const at::Tensor& x, const at::Tensor& weight, const ConvGeometry& g);
// [1, Co, 1] double energy from x's channel cross-correlation at the phases'
// lags (docs/math.md §3.4); padding 0. `sums`: x's padding-0 sample sums.
at::Tensor energy_correlation(const at::Tensor& x, const at::Tensor& weight,
                              const SampleSumTensors& sums, const ConvGeometry& g);
// Multiply-adds of energy_correlation's cross-correlation (float64 GEMMs over the
// padded x) per multiply-add of the convolution (float32), docs/math.md §3.4.
double correlation_cost_ratio(const ConvGeometry& g);
// [1, Co, 1] double energy from x's cross-spectrum reduced to the phases' lags
// (docs/math.md §3.5); padding 0. `sums`: x's padding-0 sample sums.
at::Tensor energy_cross_spectrum(const Backend& backend, const at::Tensor& x,
                                 const at::Tensor& weight, const SampleSumTensors& sums,
                                 const ConvGeometry& g);
// (R^, X), stride 1 and padding 0, x in the energy's dtype: R^ [Md, Mh, Mw/2 + 1, G, Cig, Cig]
// complex128, the DFT on the lags' grid M = 2k - 1 of x's channel cross-correlation centred
// on its grid mean (docs/math.md §3.5), and X the spectrum it is made from, x_spectrum's on
// the full output's grid. The training backward's weight gradient and x's (§6.2.2).
std::tuple<at::Tensor, at::Tensor> x_lag_spectrum(const Backend& backend, const at::Tensor& x,
                                                  const ConvGeometry& g);
// [1, Co, 1] double energy of a padded problem (padding > 0): the full (padding-0) grid's
// minus that of the planes the padding cuts off, by inclusion–exclusion over the dims, each
// term a padding-0 problem on x's edge planes (docs/math.md §3.6). `sums`: the crop's sums
// (box_sums).
at::Tensor energy_border(const Backend& backend, const at::Tensor& x, const at::Tensor& weight,
                         const SampleSumTensors& sums, const ConvGeometry& g);
// [B, Co] double: each sample's conv sum (bias excluded) from the reductions `sums`, the
// contraction of sample_sums.h as ATen ops.
at::Tensor sample_conv_sums(const SampleSumTensors& sums, const ConvGeometry& g);
// Bytes of the largest weight energy_border forms for one of its terms (a plane problem's
// holds all its regions' weights): the cut dims' planes fold into both channel counts, so it
// grows as Ci Co (ceil(p / s) p)^cut dims.
int64_t border_weight_bytes(const ConvGeometry& g);
// The share of the padding-0 grid's positions that the crop keeps (1 without padding).
double crop_fraction(const ConvGeometry& g);
// The energy by `algo` (x in the energy's dtype, any layout; weight contiguous in it):
// the dispatch `algo` names, shared by the call and energy_border's terms.
at::Tensor energy_of(const Backend& backend, EnergyAlgo algo, const at::Tensor& x,
                     const at::Tensor& weight, const SampleSumTensors& sums, const ConvGeometry& g);
// The sums of a padding-0 problem in training, its energy by `algo` (weight contiguous):
// written by the energy's pass over x for its spectrum where `algo` makes one and that pays
// (x_red_from_spectrum: read them only after energy_of), else Backend::sample_sums'.
// Shared by the call and energy_border's terms.
SampleSumTensors training_sample_sums(const Backend& backend, EnergyAlgo algo, const at::Tensor& x,
                                      const at::Tensor& weight, const ConvGeometry& g);
// Backend::cross_spectrum_rows and Backend::lag_stage with ATen's batched GEMMs (the CPU's).
at::Tensor cross_spectrum_rows_aten(const at::Tensor& x_spec, int64_t fd0, int64_t count,
                                    const at::Tensor& coef, int64_t groups);
void lag_stage_aten(const at::Tensor& q, const at::Tensor& coef, at::Tensor& out, bool accumulate);
// Backend::correlation_blocks and Backend::quad_forms with ATen ops (the CPU's).
at::Tensor correlation_blocks_aten(const at::Tensor& z_hat, const at::Tensor& phases);
at::Tensor quad_forms_aten(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror);
// R^ [..., Cig, Cig] complex128 as the real matrix [..., 2 Cig, 2 Cig] double that quad_forms
// multiplies (§3.5): row and column 2k the real part of index k, 2k + 1 its imaginary part.
// For the routes that form it (ATen's and cuBLAS's products).
at::Tensor interleaved_real_form(const at::Tensor& blocks);
// Backend::tap_spectrum with ATen's GEMMs, one dim at a time (the CPU's).
at::Tensor tap_spectrum_aten(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h,
                             const at::Tensor& dft_w, int64_t rows);
// Backend::line_weight and Backend::line_columns with ATen's gathers and copies (the CPU's).
at::Tensor line_weight_aten(const at::Tensor& w_taps, const at::Tensor& tap_index, int64_t groups);
at::Tensor line_columns_aten(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& columns,
                             int64_t groups, int64_t b0, int64_t n);

at::Tensor ct_bn_pool_forward(const Backend& backend, const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias, double scale,
                              const c10::optional<at::Tensor>& bn_weight,
                              const c10::optional<at::Tensor>& bn_bias,
                              const c10::optional<at::Tensor>& running_mean,
                              const c10::optional<at::Tensor>& running_var, bool training,
                              double momentum, double eps, at::IntArrayRef stride,
                              at::IntArrayRef padding, at::IntArrayRef output_padding,
                              at::IntArrayRef dilation, int64_t groups, c10::string_view algo);

// ct_bn_pool_stats: this batch's per-sample conv sums [B, Co] and per-channel
// (count, mean, m2) [3, Co] of the conv output, bias excluded (docs/math.md §4.1).
std::tuple<at::Tensor, at::Tensor> ct_bn_pool_stats_forward(
    const Backend& backend, const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, at::IntArrayRef dilation,
    int64_t groups, c10::string_view algo);

// _ct_bn_pool_lag_spectrum: x_lag_spectrum of a stride-1, padding-0 problem (the weight gives
// the kernel and the channels).
std::tuple<at::Tensor, at::Tensor> ct_bn_pool_lag_spectrum_forward(
    const Backend& backend, const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef dilation,
    int64_t groups);
// ct_bn_pool_apply: the finalize with the given (count, mean, m2) statistics.
at::Tensor ct_bn_pool_apply_forward(const Backend& backend, const at::Tensor& sample_sums,
                                    const at::Tensor& stats, int64_t spatial,
                                    const c10::optional<at::Tensor>& bias, double scale,
                                    const c10::optional<at::Tensor>& bn_weight,
                                    const c10::optional<at::Tensor>& bn_bias,
                                    const c10::optional<at::Tensor>& running_mean,
                                    const c10::optional<at::Tensor>& running_var, double momentum,
                                    double eps, at::ScalarType dtype);

// _ct_bn_pool_kept_stats (csrc/kept/kept.cpp): the convolution output y [B, Co, ...] (TF32
// off) with ct_bn_pool_stats' two results taken from it.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ct_bn_pool_kept_stats_forward(
    const Backend& backend, const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef output_padding, at::IntArrayRef dilation,
    int64_t groups);

// _ct_bn_pool_kept_backward: the gradients of x and the weight (where output_mask asks; empty
// otherwise), of the BatchNorm weight and of its bias (compute dtype) from the kept y, its
// sample sums and statistics (docs/math.md §6.2.4), or without y from the sums and statistics
// alone where one tap reaches each output position (gram_gradients).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ct_bn_pool_kept_backward(
    const Backend& backend, const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bn_weight, const c10::optional<at::Tensor>& y,
    const at::Tensor& sample_sums, const at::Tensor& stats, double scale, double eps,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef output_padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 2> output_mask);

// Padding 0 and dilation (k - 1) < stride in every dim: no two (input position, tap) pairs
// land on one output position (docs/math.md §6.2.3).
bool one_tap_per_position(const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
                          at::IntArrayRef dilation);
// (x's gradient, the weight's; undefined where output_mask declines) of
// dL/dy = field[b, c] + k[c] (y - mean[c]) where one_tap_per_position, in x's and the
// weight's dtypes (csrc/gram/gram.cpp).
std::tuple<at::Tensor, at::Tensor> gram_gradients(const at::Tensor& field, const at::Tensor& k,
                                                  const at::Tensor& mean, const at::Tensor& x,
                                                  const at::Tensor& weight, int64_t groups,
                                                  std::array<bool, 2> output_mask);

// The ops' kernels on one device: what TORCH_LIBRARY_IMPL registers.
template <const Backend& backend>
at::Tensor ct_bn_pool_kernel(const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, double scale,
                             const c10::optional<at::Tensor>& bn_weight,
                             const c10::optional<at::Tensor>& bn_bias,
                             const c10::optional<at::Tensor>& running_mean,
                             const c10::optional<at::Tensor>& running_var, bool training,
                             double momentum, double eps, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef output_padding,
                             at::IntArrayRef dilation, int64_t groups, c10::string_view algo) {
  return ct_bn_pool_forward(backend, x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                            running_var, training, momentum, eps, stride, padding, output_padding,
                            dilation, groups, algo);
}

template <const Backend& backend>
at::Tensor ct_bn_pool_no_stats_kernel(const at::Tensor& x, const at::Tensor& weight,
                                      const c10::optional<at::Tensor>& bias, double scale,
                                      const c10::optional<at::Tensor>& bn_weight,
                                      const c10::optional<at::Tensor>& bn_bias, double eps,
                                      at::IntArrayRef stride, at::IntArrayRef padding,
                                      at::IntArrayRef output_padding, at::IntArrayRef dilation,
                                      int64_t groups, c10::string_view algo) {
  return ct_bn_pool_forward(backend, x, weight, bias, scale, bn_weight, bn_bias, {}, {},
                            /*training=*/true, /*momentum=*/0.0, eps, stride, padding,
                            output_padding, dilation, groups, algo);
}

template <const Backend& backend>
std::tuple<at::Tensor, at::Tensor> ct_bn_pool_stats_kernel(
    const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef output_padding, at::IntArrayRef dilation, int64_t groups,
    c10::string_view algo) {
  return ct_bn_pool_stats_forward(backend, x, weight, stride, padding, output_padding, dilation,
                                  groups, algo);
}

template <const Backend& backend>
std::tuple<at::Tensor, at::Tensor> ct_bn_pool_lag_spectrum_kernel(const at::Tensor& x,
                                                                  const at::Tensor& weight,
                                                                  at::IntArrayRef dilation,
                                                                  int64_t groups) {
  return ct_bn_pool_lag_spectrum_forward(backend, x, weight, dilation, groups);
}
template <const Backend& backend>
at::Tensor ct_bn_pool_apply_kernel(const at::Tensor& sample_sums, const at::Tensor& stats,
                                   int64_t spatial, const c10::optional<at::Tensor>& bias,
                                   double scale, const c10::optional<at::Tensor>& bn_weight,
                                   const c10::optional<at::Tensor>& bn_bias,
                                   const c10::optional<at::Tensor>& running_mean,
                                   const c10::optional<at::Tensor>& running_var, double momentum,
                                   double eps, at::ScalarType dtype) {
  return ct_bn_pool_apply_forward(backend, sample_sums, stats, spatial, bias, scale, bn_weight,
                                  bn_bias, running_mean, running_var, momentum, eps, dtype);
}

template <const Backend& backend>
at::Tensor ct_bn_pool_apply_no_stats_kernel(const at::Tensor& sample_sums, const at::Tensor& stats,
                                            int64_t spatial, const c10::optional<at::Tensor>& bias,
                                            double scale, const c10::optional<at::Tensor>& bn_weight,
                                            const c10::optional<at::Tensor>& bn_bias, double eps,
                                            at::ScalarType dtype) {
  return ct_bn_pool_apply_forward(backend, sample_sums, stats, spatial, bias, scale, bn_weight,
                                  bn_bias, {}, {}, /*momentum=*/0.0, eps, dtype);
}

template <const Backend& backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> ct_bn_pool_kept_stats_kernel(
    const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef output_padding, at::IntArrayRef dilation, int64_t groups) {
  return ct_bn_pool_kept_stats_forward(backend, x, weight, stride, padding, output_padding,
                                       dilation, groups);
}

template <const Backend& backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ct_bn_pool_kept_backward_kernel(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bn_weight, const c10::optional<at::Tensor>& y,
    const at::Tensor& sample_sums, const at::Tensor& stats, double scale, double eps,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef output_padding,
    at::IntArrayRef dilation, int64_t groups, std::array<bool, 2> output_mask) {
  return ct_bn_pool_kept_backward(backend, grad_out, x, weight, bn_weight, y, sample_sums, stats,
                                  scale, eps, stride, padding, output_padding, dilation, groups,
                                  output_mask);
}

// Registers the ops' kernels of one device (TORCH_LIBRARY_IMPL of each backend; Library:
// torch::Library, whose header only the backends' registration units include).
template <const Backend& backend, typename Library>
void register_kernels(Library& m) {
  m.impl("ct_bn_pool", &ct_bn_pool_kernel<backend>);
  m.impl("ct_bn_pool.no_stats", &ct_bn_pool_no_stats_kernel<backend>);
  m.impl("ct_bn_pool_stats", &ct_bn_pool_stats_kernel<backend>);
  m.impl("ct_bn_pool_apply", &ct_bn_pool_apply_kernel<backend>);
  m.impl("ct_bn_pool_apply.no_stats", &ct_bn_pool_apply_no_stats_kernel<backend>);
  m.impl("_ct_bn_pool_kept_stats", &ct_bn_pool_kept_stats_kernel<backend>);
  m.impl("_ct_bn_pool_kept_backward", &ct_bn_pool_kept_backward_kernel<backend>);
  m.impl("_ct_bn_pool_lag_spectrum", &ct_bn_pool_lag_spectrum_kernel<backend>);
}

}  // namespace fused_ops
