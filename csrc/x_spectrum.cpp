#include "x_spectrum.h"

#include <algorithm>

namespace fused_ops {
namespace {

// Bytes of spectrum computed per ATen FFT call.
constexpr int64_t kFftSliceBytes = int64_t(32) << 20;

}  // namespace

at::Tensor x_spectrum(const at::Tensor& x, const int64_t grid[3]) {
  const int64_t batch = x.size(0), channels = x.size(1), lwf = grid[2] / 2 + 1;
  const at::ScalarType complex = x.scalar_type() == at::kDouble ? at::kComplexDouble
                                                                : at::kComplexFloat;
  auto spectrum = at::empty({grid[0], grid[1], lwf, batch, channels}, x.options().dtype(complex));
  const int64_t sample_bytes = grid[0] * grid[1] * lwf * channels * spectrum.element_size();
  const int64_t slice = std::max<int64_t>(1, kFftSliceBytes / sample_bytes);
  for (int64_t b0 = 0; b0 < batch; b0 += slice) {
    const int64_t n = std::min(slice, batch - b0);
    auto part = at::fft_rfftn(x.narrow(0, b0, n), at::IntArrayRef(grid, 3), {2, 3, 4});
    spectrum.narrow(3, b0, n).copy_(part.permute({2, 3, 4, 0, 1}));
  }
  return spectrum;
}

}  // namespace fused_ops
