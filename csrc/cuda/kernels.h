#pragma once
// Launchers of the CUDA kernels, one translation unit each; every launcher sets
// the device guard, launches on the current stream and checks the launch.
#include <ATen/ATen.h>

#include "ct_bn_pool.h"
#include "cuda/co_resident.h"

namespace fused_ops {

// Where x's element (b, ci, p) lies, p one of the D*H*W positions: at element
// b * batch + ci * channel + p * position from x's data pointer. It exists when
// x's D, H, W dims, taken in the order of their strides, step through memory
// evenly: contiguous and channels_last_3d x, their slices along B or Ci,
// expanded batches, permutations of D, H, W. A size-1 dim's stride is 0.
struct SampleLayout {
  int64_t batch, channel, position;
};

// Backend::sample_sums of x read in place: spatial_sum.cu for adjacent positions
// (layout.position 1), spatial_sum_channels_last.cu for adjacent channels
// (layout.channel 1).
// Backend::weight_sums: spatial_sum.cu, weight_sum.cuh's rows without x.
at::Tensor weight_sums_cuda(const at::Tensor& weight);
SampleSumTensors sample_sums_cuda(const at::Tensor& x, const SampleLayout& layout,
                                  const at::Tensor& weight);
SampleSumTensors sample_sums_channels_last_cuda(const at::Tensor& x, const SampleLayout& layout,
                                                const at::Tensor& weight);
// Most terms Cig * J of one (b, co) contraction in eval_finalize_cuda (its weight
// sums, one per term, are in shared memory); so at most this many input channels per
// group there (J >= 1): a larger group takes the training path's sums and finalize.
constexpr int64_t kMaxEvalTerms = 1024;
// Eval mode (docs/performance.md, microbenchmark V5): the x sums alone, from x whose
// positions are adjacent (layout.position 1, or one position), in a persistent launch
// that leaves one block of `finalize` room on every SM; J <= kMaxEvalTerms /
// in_group_channels. w_red is left undefined: eval_finalize_cuda sums the weight
// while the x pass runs.
SampleSumTensors sample_sums_x_only_cuda(const at::Tensor& x, const SampleLayout& layout,
                                         int64_t in_group_channels,
                                         const KernelFootprint& finalize);
// One eval_finalize_cuda block, for sizing the x pass beside it (weight of that dtype).
KernelFootprint eval_finalize_footprint(at::ScalarType weight_dtype);
// Eval mode's finalize after sample_sums_x_only_cuda: in.weight (contiguous) is summed
// here, before the kernel waits for the x pass.
void eval_finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out);
// Backend::energy_direct: ct_stats_stride1.cu where energy_direct_stride1_cuda takes the
// problem, else ct_stats.cu's kernel (any geometry).
at::Tensor energy_direct_cuda(const at::Tensor& x, const at::Tensor& weight,
                              const SampleSumTensors& sums, const ConvGeometry& g);
// At stride and dilation 1, where a tile of output rows fits the block's threads (Wo of at
// most 512 float32 positions, 256 float64) and one input channel's box and weights its
// shared memory: [B, Co, S] energy; elsewhere undefined.
at::Tensor energy_direct_stride1_cuda(const at::Tensor& x, const at::Tensor& weight,
                                      const SampleSumTensors& sums, const ConvGeometry& g);
void finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out);
// Backend::cross_spectrum_rows (docs/math.md §3.5): cross_spectrum.cu, one block per
// (fd, fw) row and tile of (i, j) pairs, the h lags' sums added as each fh's matrix is made.
// float32 spectra on sm_90 take cross_spectrum_mma.cu (float64 tensor cores) where
// cross_spectrum_mma_supported, unless FUSED_OPS_S_STAGE=simt; else cross_spectrum.cu.
at::Tensor cross_spectrum_rows_cuda(const at::Tensor& x_spec, int64_t fd0, int64_t count,
                                    const at::Tensor& coef, int64_t groups);
// Whether cross_spectrum_rows_mma_cuda runs for this spectrum: complex64, groups of an
// even number of channels, a binary of compute_90 or later on its device, sizes its int
// offsets hold.
bool cross_spectrum_mma_supported(const at::Tensor& x_spec, int64_t groups);
// Writes q [count, Lwf, lags, G, Cig, Cig] complex64 (coef: complex64, contiguous).
void cross_spectrum_rows_mma_cuda(const at::Tensor& x_spec, int64_t fd0, int64_t count, const at::Tensor& coef,
                                  int64_t groups, const at::Tensor& q);
// Backend::lag_stage: lag_stage.cu, one thread per column.
void lag_stage_cuda(const at::Tensor& q, const at::Tensor& coef, at::Tensor& out, bool accumulate);
// Backend::correlation_blocks: correlation_blocks.cu, one thread per entry and chunk of bins.
at::Tensor correlation_blocks_cuda(const at::Tensor& z_hat, const at::Tensor& phases);
// Backend::quad_forms: quad_form_mma.cu (float64 tensor cores, the product never stored) where
// quad_forms_mma_supported, unless FUSED_OPS_CONTRACTION=gemm; else cuBLAS's batched product
// and quad_form.cu, one read of w_hat and the product.
at::Tensor quad_forms_cuda(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror);
// Whether quad_forms_mma_cuda runs for these operands: contiguous, aligned for its copies, a
// binary of compute_90 or later on their device, sizes its int offsets hold.
bool quad_forms_mma_supported(const at::Tensor& blocks, const at::Tensor& w_hat);
// Backend::quad_forms with S = bins x tiles of 64 rows: one partial sum per (bin, row tile).
at::Tensor quad_forms_mma_cuda(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror);
// Backend::tap_spectrum: tap_spectrum.cu, a block per tile of 32 columns and depth bin b_d <= M_d / 2
// (the taps are real: the other bins are mirrors); tap_spectrum_aten where k'w exceeds 8
// (its instantiations) or a block's planes of k'h k'w values per thread and tables exceed
// 48 KiB of shared memory (k'h k'w >= 48). Taps whose columns each hold their k'd k'h k'w
// values together (the weight), float32 or float64, are read in place where the block's
// staging of them fits its shared memory; others as a float64 copy in [k'd, k'h, k'w, cols].
at::Tensor tap_spectrum_cuda(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h,
                             const at::Tensor& dft_w, int64_t rows);
// Backend::line_weight and Backend::line_columns: line_operands.cu, one pass each writing the
// GEMM's layout; line_columns_aten where a block's staged planes of one channel exceed 48 KiB
// (a whole dim of several thousand positions) or x is not contiguous.
at::Tensor line_weight_cuda(const at::Tensor& w_taps, const at::Tensor& tap_index, int64_t groups);
at::Tensor line_columns_cuda(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& columns,
                             int64_t groups, int64_t b0, int64_t n);
// Backend::box_sums: box_sums.cu, a block per (sample, input channel) with its planes of x in
// shared memory; undefined where one plane and its sums exceed 48 KiB.
at::Tensor box_sums_cuda(const at::Tensor& x, const ConvGeometry& g);
// Backend::direct_stats: ct_stats_mma.cu (float64 tensor cores, sm_90) at stride and dilation
// 1 with padding, or for any padding with FUSED_OPS_DIRECT=mma; undefined elsewhere (then
// energy_direct_cuda with x's sums: FUSED_OPS_DIRECT=simt forces that), and where a group of 8
// input channels' box of x and weights do not fit a block's shared memory (an error if forced).
std::pair<at::Tensor, at::Tensor> direct_stats_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                    const ConvGeometry& g);
// SpectrumKernels (x_spectrum.h): x_spectrum_dft.cu, and x_spectrum_copies.cu around cuFFT
// where it does not apply (ATen's copies for other layouts).
bool x_spectrum_dft_cuda(const at::Tensor& x, const int64_t grid[3], const at::Tensor& spectrum,
                         const at::Tensor& channel_sums);
void pad_cuda(const at::Tensor& x, const at::Tensor& padded);
void scatter_cuda(const at::Tensor& part, const at::Tensor& spectrum, int64_t b0);
constexpr SpectrumKernels kCudaSpectrumKernels = {x_spectrum_dft_cuda, pad_cuda, scatter_cuda};
// Backend::table_stream on CUDA (ct_bn_pool_cuda.cpp).
int64_t table_stream_cuda(const at::Device& device);

}  // namespace fused_ops
