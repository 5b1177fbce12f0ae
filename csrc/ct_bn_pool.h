#pragma once
#include <ATen/ATen.h>

#include <string>

#include "bn_finalize.h"
#include "geometry.h"
#include "sample_sums.h"
#include "x_spectrum.h"

namespace fused_ops {

// The dtype C in which the finalize reads and writes (FinalizeArgs<C>) and the
// energy algorithms compute, for inputs (x, weight) of dtype T: double for
// float64, float for float32, float16 and bfloat16 (docs/math.md §5). float32
// holds the product of two float16 or bfloat16 values exactly.
inline at::ScalarType compute_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// How the within-sample sum of squares of the conv output is computed in
// training mode (docs/math.md §3).
enum class EnergyAlgo { Direct, SlicedConv, Fft, Correlation, CrossSpectrum, Border };

// The tensors behind SampleSums: x_red [B, Ci, J] and w_red [Ci, Cog, 1 or J], double
// (w_red undefined where the finalize sums the weight itself: SampleSums::w_red null).
// x_red_from_spectrum: x_red is [B, Ci, 1] and not yet written; the training energy's pass
// over x for its spectrum writes it (x_spectrum's channel sums), before anything reads it.
struct SampleSumTensors {
  at::Tensor x_red, w_red;
  bool x_red_from_spectrum = false;
  SampleSums view(const ConvGeometry& g) const;
  // x_red where it is to come from x's spectrum, else undefined (x_spectrum's channel_sums).
  at::Tensor spectrum_channel_sums() const { return x_red_from_spectrum ? x_red : at::Tensor(); }
};

// Tensors and scalars of the finalize step (see FinalizeArgs); undefined
// tensors are absent (null pointers there).
struct FinalizeInputs {
  SampleSumTensors sums;   // w_red undefined: the finalize sums `weight` itself (CUDA eval)
  at::Tensor weight;       // the conv weight, contiguous in T, when sums.w_red is undefined
  at::Tensor sample_sums;  // [B, Co] double, given instead of `sums`
  at::Tensor energy;       // [R, Co, S] double, undefined in eval
  at::Tensor stats_in, stats_out, sample_sums_out;
  at::Tensor bias, gamma, beta, running_mean, running_var;
  double scale = 1, momentum = 0, eps = 1;
  bool batch_stats = true;
};

// What differs between devices; the orchestration in ct_bn_pool.cpp is shared.
struct Backend {
  // For padding 0 (x in any layout, weight contiguous): x_red [B, Ci, J], J
  // partial sums of each x[b, ci] over D, H, W, and w_red [Ci, Cog, 1], each
  // weight[ci, co] summed over its taps; double. x is read in place wherever the
  // device has a strided read of its layout (README, memory formats).
  SampleSumTensors (*sample_sums)(const at::Tensor& x, const at::Tensor& weight);
  // w_red alone (the weight contiguous): where x's sums come from its spectrum's pass
  // (SampleSumTensors::x_red_from_spectrum).
  at::Tensor (*weight_sums)(const at::Tensor& weight);
  // [B, Co, S] double within-sample centred sums of squares of the conv
  // output, computed by the direct kernel from x (contiguous) and the weight
  // (contiguous, x's dtype), which it packs where it needs to.
  at::Tensor (*energy_direct)(const at::Tensor& x, const at::Tensor& weight,
                              const SampleSumTensors& sums, const ConvGeometry& g);
  // Writes out [B, Co] and, in training, updates the running stats.
  void (*finalize)(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out);
  // The algorithm "auto" picks on this device for this problem; `dtype` is the
  // one the energy is computed in (compute_dtype), as for fft_applies.
  EnergyAlgo (*auto_energy_algo)(const ConvGeometry& g, at::ScalarType dtype);
  // The FFT path ([1, Co, S] energy, from x, the weight and x's sums), or null
  // where the device has none; and whether it computes this problem
  // (docs/math.md §3.3).
  at::Tensor (*energy_fft)(const at::Tensor& x, const at::Tensor& weight,
                           const SampleSumTensors& sums, const ConvGeometry& g);
  bool (*fft_applies)(const ConvGeometry& g, at::ScalarType dtype);
  // Eval mode's sums for padding 0, or null where they are sample_sums': may leave
  // w_red undefined, in which case finalize gets the weight (FinalizeInputs::weight)
  // and sums it itself (CUDA: while x is read, docs/performance.md).
  SampleSumTensors (*eval_sample_sums)(const at::Tensor& x, const at::Tensor& weight,
                                       const ConvGeometry& g);
  // The cross-spectrum path's S stage (docs/math.md §3.5) for depth frequencies
  // [fd0, fd0 + count) of x_spec [Ld, Lh, Lwf, B, Ci] (complex64 or complex128):
  // Q[fd - fd0, fw, m, g, i, j] = sum_fh coef[fh, m] sum_b conj(X[f, b, g Cig + i]) X[f, b, g Cig + j]
  // with the DC bin f = 0 left out, [count, Lwf, M, G, Cig, Cig] in x_spec's dtype; coef
  // [Lh, M] complex128.
  at::Tensor (*cross_spectrum_rows)(const at::Tensor& x_spec, int64_t fd0, int64_t count,
                                    const at::Tensor& coef, int64_t groups);
  // The W and D stages after it (§3.5): out[a, m, c] = sum_f coef[f, m] q[a, f, c],
  // added to out if `accumulate`; q [A, F, C] complex64 or complex128, coef [F, M] double
  // (real: lag_spectrum_phases) and out [A, M, C] complex128 (or, without `accumulate`,
  // complex64 where q is: the sums are float64, rounded once as stored), all contiguous.
  void (*lag_stage)(const at::Tensor& q, const at::Tensor& coef, at::Tensor& out, bool accumulate);
  // The stream of `device` that a call's work is queued on, as an id that geometry-only
  // tables may be cached under (table_cache.h), or -1 while that stream is being captured
  // into a CUDA graph.
  int64_t (*table_stream)(const at::Device& device);
  // R^ on the grid M from the D stage's output z_hat [Md, Mw, Lh', G, Cig, Cig]
  // complex128 (Lh' = k'_h: the lags m_h >= 0) and the phases [Mh, Lh'] complex128 of its
  // last step (§3.5): [Md, Mh, Mwh, G, Cig, Cig] complex128 (Mwh = Mw / 2 + 1), contiguous,
  // Hermitian per bin and group.
  at::Tensor (*correlation_blocks)(const at::Tensor& z_hat, const at::Tensor& phases);
  // The contraction's quadratic forms (§3.5): [S, G, C] double, S partial sums to be added,
  // over the bins (g_d, g_h, g_w) and rows k of mirror[g_w] w_hat v at [g_d, g_h, g_w, G, k, c],
  // v = B w_hat per bin and group, B the interleaved real form of blocks (interleaved_real_form);
  // blocks (R^, correlation_blocks) [Md, Mh, Mw, G, Cig, Cig] complex128, w_hat (the
  // sub-kernels' spectra, tap_spectrum's rows) [Md, Mh, Mw, G, 2 Cig, C] double, mirror [Mw]
  // double.
  at::Tensor (*quad_forms)(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror);
  // The sub-kernels' spectra on the grid M (§3.5): taps [k'd, k'h, k'w, R, N], float32 or
  // float64 in any strides (a view of the weight: cross_spectrum_energy.cpp's sub_kernels),
  // its R N columns (r, n) with n fastest, taken as `rows` complex rows of C = R N / rows
  // columns (G Cig: a channel's), and each dim's forward DFT dft_x [bins_x, k'_x] complex128
  // (M_x bins for d and h, M_w / 2 + 1 for w), as [bins, rows, 2, C] double: each complex
  // row's real parts, then its imaginary parts (quad_forms' interleaved order), the bins
  // (b_d, b_h, b_w) with b_w fastest.
  at::Tensor (*tap_spectrum)(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h,
                             const at::Tensor& dft_w, int64_t rows);
  // The float64 GEMM operands of border's lines and corners (border_energy.cpp's
  // group_values_energy, docs/math.md §3.6) for R regions of one problem shape, in the GEMM's
  // layout. line_weight: [R G, k Cig P_in, P_out Cog], entry ((r, g), (t, ci, i), (o, co)) =
  // w_taps[g Cig + ci, co, tap_index[r, i, o, t]], from w_taps [Ci, Cog, taps + 1] (weight_taps)
  // and tap_index [R, P_in, P_out, k] long. line_columns: [R G, n F, k Cig P_in], entry
  // ((r, g), (b, f), (t, ci, i)) = x[b0 + b, g Cig + ci, positions[r, i, l]] with l =
  // columns[f, t], 0 where l = L; x [B, Ci, D H W], positions [R, P_in, L] and columns [F, k]
  // long, contiguous.
  at::Tensor (*line_weight)(const at::Tensor& w_taps, const at::Tensor& tap_index, int64_t groups);
  at::Tensor (*line_columns)(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& columns,
                             int64_t groups, int64_t b0, int64_t n);
  // Padding > 0: box_sums' T [B, Ci, taps] double from x in any layout, in one pass, or
  // undefined where this device's kernel does not take the problem; null: box_sums' einsums.
  at::Tensor (*box_sums)(const at::Tensor& x, const ConvGeometry& g);
  // Training's direct statistics without x's sums: [B, Co, 1] within-sample energy and [B, Co]
  // sample conv sums (bias excluded), both double, from x (contiguous) and the weight
  // (contiguous, x's dtype), or undefined where this device's kernel does not take the problem;
  // null: none (energy_direct with the sums).
  std::pair<at::Tensor, at::Tensor> (*direct_stats)(const at::Tensor& x, const at::Tensor& weight,
                                                    const ConvGeometry& g);
  // x's spectrum's kernels: a DFT without the FFT, or the copies around it (x_spectrum.h).
  SpectrumKernels spectrum_kernels;
};

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
// Backend::weight_sums with ATen's sum (the CPU's).
at::Tensor weight_sums_aten(const at::Tensor& weight);
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
// The weight as the direct kernel reads it (see conv_transpose_row.h).
at::Tensor pack_weight_for_direct(const at::Tensor& weight, const ConvGeometry& g);

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

// ct_bn_pool_apply: the finalize with the given (count, mean, m2) statistics.
at::Tensor ct_bn_pool_apply_forward(const Backend& backend, const at::Tensor& sample_sums,
                                    const at::Tensor& stats, int64_t spatial,
                                    const c10::optional<at::Tensor>& bias, double scale,
                                    const c10::optional<at::Tensor>& bn_weight,
                                    const c10::optional<at::Tensor>& bn_bias,
                                    const c10::optional<at::Tensor>& running_mean,
                                    const c10::optional<at::Tensor>& running_var, double momentum,
                                    double eps, at::ScalarType dtype);

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

// Typed view of FinalizeInputs for one dtype.
template <typename scalar_t>
FinalizeArgs<scalar_t> finalize_args(const FinalizeInputs& in, const ConvGeometry& g,
                                     at::Tensor& out) {
  auto ptr = [](const at::Tensor& t) -> scalar_t* {
    return t.defined() ? t.data_ptr<scalar_t>() : nullptr;
  };
  auto dptr = [](const at::Tensor& t) -> double* {
    return t.defined() ? t.data_ptr<double>() : nullptr;
  };
  FinalizeArgs<scalar_t> a;
  a.sums = in.sums.x_red.defined() ? in.sums.view(g) : SampleSums{};
  a.sample_sums = dptr(in.sample_sums);
  a.energy = dptr(in.energy);
  a.energy_rows = in.energy.defined() ? in.energy.size(0) : 0;
  a.splits = in.energy.defined() ? in.energy.size(2) : 0;
  a.stats_in = dptr(in.stats_in);
  a.stats_out = dptr(in.stats_out);
  a.sample_sums_out = dptr(in.sample_sums_out);
  a.bias = ptr(in.bias);
  a.gamma = ptr(in.gamma);
  a.beta = ptr(in.beta);
  a.running_mean = ptr(in.running_mean);
  a.running_var = ptr(in.running_var);
  a.out = out.data_ptr<scalar_t>();
  a.batch = g.batch;
  a.channels = g.out_channels;
  a.spatial = g.out_spatial();
  a.scale = in.scale;
  a.momentum = in.momentum;
  a.eps = in.eps;
  a.batch_stats = in.batch_stats;
  return a;
}

}  // namespace fused_ops
