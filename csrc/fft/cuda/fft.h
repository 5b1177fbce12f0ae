#pragma once
// The FFT/Parseval training-mode energy (docs/math.md §3.3), CUDA only: the
// spectra of x (x_spectrum.h) and of the weight (fft_weight_spectrum.cu), and
// the kernel that multiplies them per frequency and reduces |Y_f|^2 without
// storing either product (fft_spectral_energy.cu).
#include <ATen/ATen.h>

#include "ct_bn_pool.h"
#include "common/geometry.h"

namespace fused_ops {

// Whether the FFT path computes this problem: padding 0 (any stride, dilation
// and output_padding: docs/math.md §3.3.1), a phase sub-kernel height of at
// most kMaxFftKernel, and tiles that fit the kernels' shared memory.
constexpr int64_t kMaxFftKernel = 16;
bool fft_energy_applies(const ConvGeometry& g);

// The within-sample centred sums of squares of the conv output, summed over the
// batch: [1, Co, Lh * Lwf] double (per (fh, fw) frequency pair) for a full
// convolution (stride 1, no output_padding), else [1, Co, 1]. `sums`: the
// padding-0 sample sums of x (x_red) that the phases' sums are contracted from.
at::Tensor energy_fft_cuda(const at::Tensor& x, const at::Tensor& weight,
                           const SampleSumTensors& sums, const ConvGeometry& g);

// Sizes of the spectra: L the FFT size (the full convolution's output; the
// phases' common grid, docs/math.md §3.3.1), Lwf = Lw / 2 + 1 bins kept of the last axis.
struct SpectrumGeometry {
  int64_t L[3], Lwf;
  int64_t pairs() const { return L[1] * Lwf; }
};

// Dynamic shared memory the spectral-energy kernel needs for this problem.
int64_t spectral_energy_smem_bytes(const ConvGeometry& g);

// W2[fh - fh0, fw, ci, co_g, kd] (complex64): the weight's DFT over H and W at
// size (Lh, Lw), for fh in [fh0, fh0 + count); out must hold count * Lwf * Ci * Cog * kD.
int64_t weight_spectrum_smem_bytes(const ConvGeometry& g, int64_t fh_count);
void weight_spectrum_cuda(const at::Tensor& weight, const ConvGeometry& g,
                          const SpectrumGeometry& s, int64_t fh0, int64_t count, at::Tensor& out);

// Adds, for the frequency pairs (fh, fw) with fh in [fh0, fh0 + count), the
// weighted |Y_f|^2 / L of every frequency f = (fd, fh, fw) except f = 0 into
// energy[0, co, fh * Lwf + fw] (written, not accumulated). x_spec: [Ld, Lh, Lwf, B, Ci]
// complex64; w_spec: weight_spectrum_cuda's output for the same fh range.
void spectral_energy_cuda(const at::Tensor& x_spec, const at::Tensor& w_spec,
                          const ConvGeometry& g, const SpectrumGeometry& s, int64_t fh0,
                          int64_t count, at::Tensor& energy);

// The variant for small problems (fft_spectral_energy.cu): each block computes its own W2 from
// `weight` [Ci, Cog, kD, kH, kW] (contiguous float32), so neither weight_spectrum_cuda nor
// w_spec is needed; writes energy for every (fh, fw) pair at once. Its dynamic shared
// memory for this problem, or 0 where it does not apply (more than 8 samples, kD > 8, an
// fd count too large for one block).
int64_t small_spectral_energy_smem_bytes(const ConvGeometry& g, const SpectrumGeometry& s);
void small_spectral_energy_cuda(const at::Tensor& x_spec, const at::Tensor& weight,
                                const ConvGeometry& g, const SpectrumGeometry& s,
                                at::Tensor& energy);

}  // namespace fused_ops
