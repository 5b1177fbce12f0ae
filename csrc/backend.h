#pragma once
// The contract between the shared orchestration (ct_bn_pool.cpp) and a device: the types
// that flow between them and the Backend of named hooks (docs/design.md, "Backend").
#include <ATen/ATen.h>

#include <utility>

#include "common/geometry.h"
#include "common/table_cache.h"
#include "sums/finalize.h"
#include "sums/sample_sums.h"
#include "x_spectrum/x_spectrum.h"

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

// The kept route's gradient coefficients (kept/affine_grad.h): grad_out [B, Co], bn_weight [Co]
// (or undefined) in the compute dtype, sample_sums [B, Co] and stats [3, Co] double, all
// contiguous; the outputs, allocated by the caller in the compute dtype, are written (field,
// shift and k undefined where no gradient of y is asked, shift also where it is not needed).
struct AffineGradInputs {
  at::Tensor grad_out, bn_weight, sample_sums, stats;
  at::Tensor g_sum, g_zbar, field, shift, k;
  double scale = 1, eps = 1, positions = 1;
};

// What differs between devices: the hooks a device provides, each named; the orchestration in
// ct_bn_pool.cpp is shared. A device defines its Backend by assigning every hook by name
// (cpu/backend_cpu.cpp, cuda/backend_cuda.cpp); a hook a device does not have is null there,
// with the reason, and the orchestration takes the shared ATen route instead (each hook's
// comment says what null means).
struct Backend {
  // For padding 0 (x in any layout, weight contiguous): x_red [B, Ci, J], J
  // partial sums of each x[b, ci] over D, H, W, and w_red [Ci, Cog, 1], each
  // weight[ci, co] summed over its taps; double. x is read in place wherever the
  // device has a strided read of its layout (README, memory formats).
  SampleSumTensors (*sample_sums)(const at::Tensor& x, const at::Tensor& weight) = nullptr;
  // w_red alone (the weight contiguous): where x's sums come from its spectrum's pass
  // (SampleSumTensors::x_red_from_spectrum).
  at::Tensor (*weight_sums)(const at::Tensor& weight) = nullptr;
  // [B, Co, S] double within-sample centred sums of squares of the conv
  // output, computed by the direct kernel from x (contiguous) and the weight
  // (contiguous, x's dtype), which it packs where it needs to.
  at::Tensor (*energy_direct)(const at::Tensor& x, const at::Tensor& weight,
                              const SampleSumTensors& sums, const ConvGeometry& g) = nullptr;
  // Writes out [B, Co] and, in training, updates the running stats.
  void (*finalize)(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out) = nullptr;
  // The algorithm "auto" picks on this device for this problem; `dtype` is the
  // one the energy is computed in (compute_dtype), as for fft_applies.
  EnergyAlgo (*auto_energy_algo)(const ConvGeometry& g, at::ScalarType dtype) = nullptr;
  // The FFT path ([1, Co, S] energy, from x, the weight and x's sums), or null
  // where the device has none; and whether it computes this problem
  // (docs/math.md §3.3).
  at::Tensor (*energy_fft)(const at::Tensor& x, const at::Tensor& weight,
                           const SampleSumTensors& sums, const ConvGeometry& g) = nullptr;
  bool (*fft_applies)(const ConvGeometry& g, at::ScalarType dtype) = nullptr;
  // Eval mode's sums for padding 0, or null where they are sample_sums': may leave
  // w_red undefined, in which case finalize gets the weight (FinalizeInputs::weight)
  // and sums it itself (CUDA: while x is read, docs/performance.md).
  SampleSumTensors (*eval_sample_sums)(const at::Tensor& x, const at::Tensor& weight,
                                       const ConvGeometry& g) = nullptr;
  // The cross-spectrum path's S stage (docs/math.md §3.5) for depth frequencies
  // [fd0, fd0 + count) of x_spec [Ld, Lh, Lwf, B, Ci] (complex64 or complex128):
  // Q[fd - fd0, fw, m, g, i, j] = sum_fh coef[fh, m] sum_b conj(X[f, b, g Cig + i]) X[f, b, g Cig + j]
  // with the DC bin f = 0 left out, [count, Lwf, M, G, Cig, Cig] in x_spec's dtype; coef
  // [Lh, M] complex128.
  at::Tensor (*cross_spectrum_rows)(const at::Tensor& x_spec, int64_t fd0, int64_t count,
                                    const at::Tensor& coef, int64_t groups) = nullptr;
  // The W and D stages after it (§3.5): out[a, m, c] = sum_f coef[f, m] q[a, f, c],
  // added to out if `accumulate`; q [A, F, C] complex64 or complex128, coef [F, M] double
  // (real: lag_spectrum_phases) and out [A, M, C] complex128 (or, without `accumulate`,
  // complex64 where q is: the sums are float64, rounded once as stored), all contiguous.
  void (*lag_stage)(const at::Tensor& q, const at::Tensor& coef, at::Tensor& out, bool accumulate) = nullptr;
  // Runs a cached table's build apart from the caller's stream and thread (so that no CUDA
  // graph's memory pool takes it), complete on return; false, without running it, while
  // `device`'s current stream is being captured (common/table_cache.h).
  BuildApart build_tables_apart = nullptr;
  // R^ on the grid M from the D stage's output z_hat [Md, Mw, Lh', G, Cig, Cig]
  // complex128 (Lh' = k'_h: the lags m_h >= 0) and the phases [Mh, Lh'] complex128 of its
  // last step (§3.5): [Md, Mh, Mwh, G, Cig, Cig] complex128 (Mwh = Mw / 2 + 1), contiguous,
  // Hermitian per bin and group.
  at::Tensor (*correlation_blocks)(const at::Tensor& z_hat, const at::Tensor& phases) = nullptr;
  // The contraction's quadratic forms (§3.5): [S, G, C] double, S partial sums to be added,
  // over the bins (g_d, g_h, g_w) and rows k of mirror[g_w] w_hat v at [g_d, g_h, g_w, G, k, c],
  // v = B w_hat per bin and group, B the interleaved real form of blocks (interleaved_real_form);
  // blocks (R^, correlation_blocks) [Md, Mh, Mw, G, Cig, Cig] complex128, w_hat (the
  // sub-kernels' spectra, tap_spectrum's rows) [Md, Mh, Mw, G, 2 Cig, C] double, mirror [Mw]
  // double.
  at::Tensor (*quad_forms)(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror) = nullptr;
  // The sub-kernels' spectra on the grid M (§3.5): taps [k'd, k'h, k'w, R, N], float32 or
  // float64 in any strides (a view of the weight: cross_spectrum.cpp's sub_kernels),
  // its R N columns (r, n) with n fastest, taken as `rows` complex rows of C = R N / rows
  // columns (G Cig: a channel's), and each dim's forward DFT dft_x [bins_x, k'_x] complex128
  // (M_x bins for d and h, M_w / 2 + 1 for w), as [bins, rows, 2, C] double: each complex
  // row's real parts, then its imaginary parts (quad_forms' interleaved order), the bins
  // (b_d, b_h, b_w) with b_w fastest.
  at::Tensor (*tap_spectrum)(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h,
                             const at::Tensor& dft_w, int64_t rows) = nullptr;
  // The float64 GEMM operands of border's lines and corners (border.cpp's
  // group_values_energy, docs/math.md §3.6) for R regions of one problem shape, in the GEMM's
  // layout. line_weight: [R G, k Cig P_in, P_out Cog], entry ((r, g), (t, ci, i), (o, co)) =
  // w_taps[g Cig + ci, co, tap_index[r, i, o, t]], from w_taps [Ci, Cog, taps + 1] (weight_taps)
  // and tap_index [R, P_in, P_out, k] long. line_columns: [R G, n F, k Cig P_in], entry
  // ((r, g), (b, f), (t, ci, i)) = x[b0 + b, g Cig + ci, positions[r, i, l]] with l =
  // columns[f, t], 0 where l = L; x [B, Ci, D H W], positions [R, P_in, L] and columns [F, k]
  // long, contiguous.
  at::Tensor (*line_weight)(const at::Tensor& w_taps, const at::Tensor& tap_index, int64_t groups) = nullptr;
  at::Tensor (*line_columns)(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& columns,
                             int64_t groups, int64_t b0, int64_t n) = nullptr;
  // Padding > 0: box_sums' T [B, Ci, taps] double from x in any layout, in one pass, or
  // undefined where this device's kernel does not take the problem; null: box_sums' einsums.
  at::Tensor (*box_sums)(const at::Tensor& x, const ConvGeometry& g) = nullptr;
  // Training's direct statistics without x's sums: [B, Co, 1] within-sample energy and [B, Co]
  // sample conv sums (bias excluded), both double, from x (contiguous) and the weight
  // (contiguous, x's dtype), or undefined where this device's kernel does not take the problem;
  // null: none (energy_direct with the sums).
  std::pair<at::Tensor, at::Tensor> (*direct_stats)(const at::Tensor& x, const at::Tensor& weight,
                                                    const ConvGeometry& g) = nullptr;
  // The kept route (kept/kept.cpp, docs/math.md §6.2.4). sample_moments: y [B, Co, ...]
  // (contiguous, any floating dtype) -> ([B, Co] each sample's sum, [B, Co, 1] its centred sum
  // of squares), double, two passes over y (no cancellation); affine_grad: AffineGradInputs'
  // outputs from its inputs.
  std::pair<at::Tensor, at::Tensor> (*sample_moments)(const at::Tensor& y) = nullptr;
  void (*affine_grad)(const AffineGradInputs& in) = nullptr;
  // x's spectrum's kernels: a DFT without the FFT, or the copies around it (x_spectrum.h).
  SpectrumKernels spectrum_kernels;
};

}  // namespace fused_ops
