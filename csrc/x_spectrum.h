#pragma once
// x's spectrum on a grid larger than x (zero-padded), in the layout the
// training-mode energies that multiply per frequency read: one frequency's
// [B, Ci] matrix contiguous. Shared by the FFT path (docs/math.md §3.3) and
// the cross-spectrum path (§3.5).
#include <ATen/ATen.h>

namespace fused_ops {

// The two copies around the FFT, which a device may do faster than ATen's strided copies
// (CUDA: x_spectrum_copies.cu). pad: padded[:, :, :D, :H, :W] = x, padded [n, Ci, Ld, Lh,
// Lw] contiguous. scatter: spectrum[f, b0 + k, c] = part[k, c, f] for part [n, Ci, Ld, Lh,
// Lwf] and spectrum [Ld, Lh, Lwf, B, Ci] contiguous, f = (fd, fh, fw).
struct SpectrumCopies {
  void (*pad)(const at::Tensor& x, const at::Tensor& padded);
  void (*scatter)(const at::Tensor& part, const at::Tensor& spectrum, int64_t b0);
};
void pad_aten(const at::Tensor& x, const at::Tensor& padded);
void scatter_aten(const at::Tensor& part, const at::Tensor& spectrum, int64_t b0);
constexpr SpectrumCopies kAtenSpectrumCopies = {pad_aten, scatter_aten};

// [Ld, Lh, Lw / 2 + 1, B, Ci]: rfftn of x [B, Ci, D, H, W] (any layout) at size
// grid = (Ld, Lh, Lw) >= (D, H, W), complex64 for float32 x, complex128 for
// float64. Computed over slices of the batch so the FFT's temporaries stay small.
at::Tensor x_spectrum(const at::Tensor& x, const int64_t grid[3], const SpectrumCopies& copies);

}  // namespace fused_ops
