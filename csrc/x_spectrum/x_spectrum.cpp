#include "x_spectrum/x_spectrum.h"

#include <algorithm>

namespace fused_ops {
namespace {

// Bytes of spectrum computed per ATen FFT call.
constexpr int64_t kFftSliceBytes = int64_t(32) << 20;

}  // namespace

void pad_aten(const at::Tensor& x, const at::Tensor& padded) {
  padded.narrow(2, 0, x.size(2)).narrow(3, 0, x.size(3)).narrow(4, 0, x.size(4)).copy_(x);
}

void scatter_aten(const at::Tensor& part, const at::Tensor& spectrum, int64_t b0) {
  spectrum.narrow(3, b0, part.size(0)).copy_(part.permute({2, 3, 4, 0, 1}));
}

at::Tensor x_spectrum(const at::Tensor& x, const int64_t grid[3], const SpectrumKernels& kernels,
                      const at::Tensor& channel_sums) {
  const int64_t batch = x.size(0), channels = x.size(1), lwf = grid[2] / 2 + 1;
  const at::ScalarType complex = x.scalar_type() == at::kDouble ? at::kComplexDouble
                                                                : at::kComplexFloat;
  auto spectrum = at::empty({grid[0], grid[1], lwf, batch, channels}, x.options().dtype(complex));
  if (kernels.dft && kernels.dft(x, grid, spectrum, channel_sums)) return spectrum;
  if (channel_sums.defined()) {
    // [B, Ci] view of channel_sums [B, Ci, 1]: sum_out writes its storage without resizing it
    at::Tensor out = channel_sums.view({batch, channels});
    at::sum_out(out, x, at::IntArrayRef{2, 3, 4}, false, at::kDouble);
  }
  const int64_t sample_bytes = grid[0] * grid[1] * lwf * channels * spectrum.element_size();
  const int64_t slice = std::min(batch, std::max<int64_t>(1, kFftSliceBytes / sample_bytes));
  // The zero padding is written once: each slice of samples overwrites only the region
  // x fills (letting the FFT pad each slice would write the whole padded slice every time).
  auto padded = at::zeros({slice, channels, grid[0], grid[1], grid[2]}, x.options());
  for (int64_t b0 = 0; b0 < batch; b0 += slice) {
    const int64_t n = std::min(slice, batch - b0);
    const at::Tensor in = padded.narrow(0, 0, n);
    kernels.pad(x.narrow(0, b0, n), in);
    kernels.scatter(at::fft_rfftn(in, c10::nullopt, {2, 3, 4}), spectrum, b0);
  }
  return spectrum;
}

}  // namespace fused_ops
