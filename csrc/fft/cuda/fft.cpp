// The FFT path of the training-mode energy (docs/math.md §3.3): the spectrum of
// x once (x_spectrum.h: DFT kernels, over slices of the batch so their temporaries stay
// small), then, for chunks of fh, the weight's spectrum and the fused
// multiply-and-reduce kernel. A strided transposed convolution (or one with
// output padding) is split into phases, stride-1 convolutions of x with
// sub-kernels on one common grid (§3.3.1): x's spectrum is shared, the weight
// part runs once per phase. Peak extra memory: x's spectrum plus one phase's
// sub-kernel and one chunk of its spectrum, each bounded below; on small problems
// no weight spectrum at all (small_kernel_pays).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <vector>

#include "common/cuda/dynamic_smem.h"
#include "fft/cuda/fft.h"
#include "x_spectrum/cuda/x_spectrum_kernels.h"
#include "common/phases.h"
#include "x_spectrum/x_spectrum.h"

namespace fused_ops {
namespace {

// Bytes of the weight's spectrum per chunk.
constexpr int64_t kWeightChunkBytes = int64_t(48) << 20;
// Shared memory a block may use on the GPUs this is built for (sm_80 and later).
constexpr int64_t kMaxSmemBytes = 160 << 10;

// Bytes of taps the small kernel may read in all. Each of its blocks reads its tile's
// taps, so every (fh, fw) pair reads the whole weight: kH kW / 2 times the bytes of the
// W2 that the route below writes and reads back. Under this bound the re-reads, at L2
// bandwidth and spread over the kernel's blocks, take an estimated time about that of
// weight_spectrum_kernel alone on the small problems (docs/performance.md), whose launch
// and w_spec's memory the small kernel spares too. The bench's t8c32, t8c64 and t8k5 re-read
// 6.6, 26.5 and 43 MB; c16 and s8 would re-read 175 and 880 MB (and have 16 samples).
constexpr int64_t kMaxTapRereadBytes = int64_t(48) << 20;

// Whether grid_energy takes the small kernel (fft_spectral_energy.cu) for this phase problem.
bool small_kernel_pays(const ConvGeometry& sub, const SpectrumGeometry& s) {
  const int64_t smem = small_spectral_energy_smem_bytes(sub, s);
  if (smem == 0 || smem > std::min(kMaxSmemBytes, dynamic_smem_limit())) return false;
  const int64_t rereads =
      s.pairs() * sub.in_channels * sub.out_group_channels() * sub.taps() * int64_t(sizeof(float));
  return rereads <= kMaxTapRereadBytes;
}

// Writes energy [1, Co, Lh * Lwf] (double) for the stride-1 full convolution
// `sub` of x with `weight` [Ci, Cog, kD, kH, kW] (contiguous float32): the
// weight's spectrum and the multiply-and-reduce kernel, a chunk of fh at a time,
// or on small problems the one kernel that does both.
void grid_energy(const at::Tensor& x_spec, const at::Tensor& weight, const ConvGeometry& sub,
                 const SpectrumGeometry& s, at::Tensor& energy) {
  if (small_kernel_pays(sub, s)) {
    small_spectral_energy_cuda(x_spec, weight, sub, s, energy);
    return;
  }
  const int64_t fh_bytes = s.Lwf * sub.kernel[0] * sub.in_channels * sub.out_group_channels() * 8;
  const int64_t most = std::clamp<int64_t>(kWeightChunkBytes / fh_bytes, 1, s.L[1]);
  const int64_t chunks = (s.L[1] + most - 1) / most;
  const int64_t chunk = (s.L[1] + chunks - 1) / chunks;  // balanced: no small last chunk
  auto w_spec = at::empty({chunk * fh_bytes / 8}, x_spec.options());
  for (int64_t fh0 = 0; fh0 < s.L[1]; fh0 += chunk) {
    const int64_t count = std::min(chunk, s.L[1] - fh0);
    weight_spectrum_cuda(weight, sub, s, fh0, count, w_spec);
    spectral_energy_cuda(x_spec, w_spec, sub, s, fh0, count, energy);
  }
}

// The phases' energies summed, plus the correction: [1, Co, 1] (§3.3.1).
at::Tensor polyphase_energy(const at::Tensor& x_spec, const at::Tensor& weight,
                            const SampleSumTensors& sums, const ConvGeometry& g,
                            const ConvGeometry& sub, const SpectrumGeometry& s) {
  const at::Tensor slots = tap_slots(g, sub, weight.options().dtype(at::kLong));
  const PhaseTaps taps = phase_taps(weight, g, sub, slots);
  auto total = at::zeros({1, g.out_channels, s.pairs()}, x_spec.options().dtype(at::kDouble));
  auto phase_energy = at::empty_like(total);
  for (const int64_t r : occupied_phases(g)) {
    const at::Tensor sub_kernel = taps.sub_kernel(r);
    grid_energy(x_spec, sub_kernel, sub, s, phase_energy);
    total.add_(phase_energy);
  }
  const at::Tensor correction = phase_sum_correction(weight, sums, g, sub, slots);
  return total.sum(2).add_(correction).view({1, g.out_channels, 1});
}

}  // namespace

bool fft_energy_applies(const ConvGeometry& g) {
  if (g.has_padding()) return false;  // a crop breaks Parseval (§3.3.1)
  const ConvGeometry sub = phase_geometry(g);
  if (sub.kernel[1] > kMaxFftKernel) return false;
  // The shared memory of fft_weight_spectrum.cu (for a chunk of all fh, the most it
  // takes) and of fft_spectral_energy.cu's tiles, for the phases' problem.
  if (weight_spectrum_smem_bytes(sub, sub.out_size[1]) > kMaxSmemBytes) return false;
  return spectral_energy_smem_bytes(sub) <= kMaxSmemBytes;
}

at::Tensor energy_fft_cuda(const at::Tensor& x, const at::Tensor& weight,
                           const SampleSumTensors& sums, const ConvGeometry& g) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ConvGeometry sub = phase_geometry(g);
  SpectrumGeometry s;
  for (int d = 0; d < 3; ++d) s.L[d] = sub.out_size[d];
  s.Lwf = s.L[2] / 2 + 1;
  const at::Tensor x_spec = x_spectrum(x, s.L, kCudaSpectrumKernels, sums.spectrum_channel_sums());
  if (!is_full_convolution(g)) return polyphase_energy(x_spec, weight, sums, g, sub, s);
  auto energy = at::empty({1, g.out_channels, s.pairs()}, x.options().dtype(at::kDouble));
  grid_energy(x_spec, weight, sub, s, energy);
  return energy;
}

}  // namespace fused_ops
