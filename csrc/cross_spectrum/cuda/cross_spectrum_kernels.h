#pragma once
// Launchers of the cross-spectrum path's CUDA stages (docs/math.md §3.5).
#include <ATen/ATen.h>

#include "ct_bn_pool.h"

namespace fused_ops {

// Backend::cross_spectrum_rows (docs/math.md §3.5): cross_spectrum_s_stage.cu, one block per
// (fd, fw) row and tile of (i, j) pairs, the h lags' sums added as each fh's matrix is made.
// float32 spectra on sm_90 take cross_spectrum_s_stage_mma.cu (float64 tensor cores) where
// cross_spectrum_mma_supported, unless route s_stage='simt' (fused_ops.testing); else cross_spectrum_s_stage.cu.
at::Tensor cross_spectrum_rows_cuda(const at::Tensor& x_spec, int64_t fd0, int64_t count,
                                    const at::Tensor& coef, int64_t groups);

// Whether cross_spectrum_rows_mma_cuda runs for this spectrum: complex64, groups of an
// even number of channels, a binary of compute_90 or later on its device, sizes its int
// offsets hold.
bool cross_spectrum_mma_supported(const at::Tensor& x_spec, int64_t groups);

// Writes q [count, Lwf, lags, G, Cig, Cig] complex64 (coef: complex64, contiguous).
void cross_spectrum_rows_mma_cuda(const at::Tensor& x_spec, int64_t fd0, int64_t count, const at::Tensor& coef,
                                  int64_t groups, const at::Tensor& q);

// Backend::lag_stage: cross_spectrum_lag_stage.cu, one thread per column.
void lag_stage_cuda(const at::Tensor& q, const at::Tensor& coef, at::Tensor& out, bool accumulate);

// Backend::correlation_blocks: cross_spectrum_blocks.cu, one thread per entry and chunk of bins.
at::Tensor correlation_blocks_cuda(const at::Tensor& z_hat, const at::Tensor& phases);

// Backend::quad_forms: cross_spectrum_quad_form_mma.cu (float64 tensor cores, the product never stored) where
// quad_forms_mma_supported, unless route contraction='gemm'; else cuBLAS's batched product
// and cross_spectrum_quad_form.cu, one read of w_hat and the product.
at::Tensor quad_forms_cuda(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror);

// Whether quad_forms_mma_cuda runs for these operands: contiguous, aligned for its copies, a
// binary of compute_90 or later on their device, sizes its int offsets hold.
bool quad_forms_mma_supported(const at::Tensor& blocks, const at::Tensor& w_hat);

// Backend::quad_forms with S = bins x tiles of 64 rows: one partial sum per (bin, row tile).
at::Tensor quad_forms_mma_cuda(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror);

// Backend::tap_spectrum: cross_spectrum_tap_spectrum.cu, a block per tile of 32 columns and depth bin b_d <= M_d / 2
// (the taps are real: the other bins are mirrors); tap_spectrum_aten where k'w exceeds 8
// (its instantiations) or a block's planes of k'h k'w values per thread and tables exceed
// 48 KiB of shared memory (k'h k'w >= 48). Taps whose columns each hold their k'd k'h k'w
// values together (the weight), float32 or float64, are read in place where the block's
// staging of them fits its shared memory; others as a float64 copy in [k'd, k'h, k'w, cols].
at::Tensor tap_spectrum_cuda(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h,
                             const at::Tensor& dft_w, int64_t rows);

}  // namespace fused_ops
