// The FFT path of the training-mode energy (docs/math.md §3.3): the spectrum of
// x once (cuFFT through ATen, over slices of the batch so its temporaries stay
// small), then, for chunks of fh, the weight's spectrum and the fused
// multiply-and-reduce kernel. Peak extra memory: x's spectrum plus one chunk of
// the weight's, each bounded below.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cuda/fft_energy.h"

namespace fused_ops {
namespace {

// Bytes of x's spectrum computed per ATen FFT call, and of weight spectrum per chunk.
constexpr int64_t kFftSliceBytes = int64_t(32) << 20;
constexpr int64_t kWeightChunkBytes = int64_t(48) << 20;
// Shared memory a block may use on the GPUs this is built for (sm_80 and later).
constexpr int64_t kMaxSmemBytes = 160 << 10;

}  // namespace

bool fft_energy_applies(const ConvGeometry& g) {
  for (int d = 0; d < 3; ++d) {
    if (g.stride[d] != 1 || g.padding[d] != 0 || g.output_padding[d] != 0) return false;
  }
  if (g.kernel[1] > kMaxFftKernel) return false;
  // The shared memory of weight_spectrum.cu (for a chunk of all fh, the most it
  // takes) and of spectral_energy.cu's tiles.
  if (weight_spectrum_smem_bytes(g, g.out_size[1]) > kMaxSmemBytes) return false;
  return spectral_energy_smem_bytes(g) <= kMaxSmemBytes;
}

at::Tensor energy_fft_cuda(const at::Tensor& x, const at::Tensor& weight, const ConvGeometry& g) {
  const c10::cuda::CUDAGuard guard(x.device());
  SpectrumGeometry s;
  for (int d = 0; d < 3; ++d) s.L[d] = g.out_size[d];
  s.Lwf = s.L[2] / 2 + 1;
  const auto cplx = x.options().dtype(at::kComplexFloat);

  // x's spectrum as [Ld, Lh, Lwf, B, Ci]: one frequency's [B, Ci] matrix contiguous.
  auto x_spec = at::empty({s.L[0], s.L[1], s.Lwf, g.batch, g.in_channels}, cplx);
  const int64_t sample_bytes = s.L[0] * s.pairs() * g.in_channels * 8;
  const int64_t slice = std::max<int64_t>(1, kFftSliceBytes / sample_bytes);
  for (int64_t b0 = 0; b0 < g.batch; b0 += slice) {
    const int64_t n = std::min(slice, g.batch - b0);
    auto spec = at::fft_rfftn(x.narrow(0, b0, n), at::IntArrayRef(s.L, 3), {2, 3, 4});
    x_spec.narrow(3, b0, n).copy_(spec.permute({2, 3, 4, 0, 1}));
  }

  auto energy = at::empty({1, g.out_channels, s.pairs()}, x.options().dtype(at::kDouble));
  const int64_t fh_bytes = s.Lwf * g.kernel[0] * g.in_channels * g.out_group_channels() * 8;
  const int64_t most = std::clamp<int64_t>(kWeightChunkBytes / fh_bytes, 1, s.L[1]);
  const int64_t chunks = (s.L[1] + most - 1) / most;
  const int64_t chunk = (s.L[1] + chunks - 1) / chunks;  // balanced: no small last chunk
  auto w_spec = at::empty({chunk * fh_bytes / 8}, cplx);
  for (int64_t fh0 = 0; fh0 < s.L[1]; fh0 += chunk) {
    const int64_t count = std::min(chunk, s.L[1] - fh0);
    weight_spectrum_cuda(weight, g, s, fh0, count, w_spec);
    spectral_energy_cuda(x_spec, w_spec, g, s, fh0, count, energy);
  }
  return energy;
}

}  // namespace fused_ops
