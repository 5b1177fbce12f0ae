#pragma once
// x's spectrum on a grid larger than x (zero-padded), in the layout the
// training-mode energies that multiply per frequency read: one frequency's
// [B, Ci] matrix contiguous. Shared by the FFT path (docs/math.md §3.3) and
// the cross-spectrum path (§3.5).
#include <ATen/ATen.h>

namespace fused_ops {

// What a device does faster than ATen around (or instead of) x's FFT. dft: the whole
// spectrum without the FFT, where it takes the problem (CUDA: x_spectrum_dft.cu, DFT
// matrices in shared memory, for float32 and float64 x), and channel_sums where defined (see
// x_spectrum): returns false, having written nothing, where it does not; nullptr: never.
// Otherwise the FFT, with these copies around it (CUDA: x_spectrum_copies.cu, ATen's copies
// for other layouts). pad: padded[:, :, :D, :H, :W] = x, padded [n, Ci, Ld, Lh, Lw]
// contiguous. scatter: spectrum[f, b0 + k, c] = part[k, c, f] for part [n, Ci, Ld, Lh, Lwf]
// and spectrum [Ld, Lh, Lwf, B, Ci] contiguous, f = (fd, fh, fw).
struct SpectrumKernels {
  bool (*dft)(const at::Tensor& x, const int64_t grid[3], const at::Tensor& spectrum, const at::Tensor& channel_sums);
  void (*pad)(const at::Tensor& x, const at::Tensor& padded);
  void (*scatter)(const at::Tensor& part, const at::Tensor& spectrum, int64_t b0);
};
void pad_aten(const at::Tensor& x, const at::Tensor& padded);
void scatter_aten(const at::Tensor& part, const at::Tensor& spectrum, int64_t b0);
constexpr SpectrumKernels kAtenSpectrumKernels = {nullptr, pad_aten, scatter_aten};

// [Ld, Lh, Lw / 2 + 1, B, Ci]: rfftn of x [B, Ci, D, H, W] (any layout) at size
// grid = (Ld, Lh, Lw) >= (D, H, W), complex64 for float32 x, complex128 for
// float64. Computed over slices of the batch so the temporaries (the DFT's or the
// FFT's) stay small. channel_sums, where defined ([B, Ci, 1] double, contiguous): each
// (b, ci)'s sum over D, H and W, in float64, for training's sample sums (§2): the DFT route
// forms them as it reads x (the planes' sums, then their sum over D beside the D DFT),
// sparing the sums a pass of their own.
at::Tensor x_spectrum(const at::Tensor& x, const int64_t grid[3], const SpectrumKernels& kernels,
                      const at::Tensor& channel_sums = at::Tensor());

}  // namespace fused_ops
