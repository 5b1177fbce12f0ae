// The FFT path of the training-mode energy (docs/math.md §3.3): the spectrum of
// x once (cuFFT through ATen, over slices of the batch so its temporaries stay
// small), then, for chunks of fh, the weight's spectrum and the fused
// multiply-and-reduce kernel. A strided transposed convolution (or one with
// output padding) is split into phases, stride-1 convolutions of x with
// sub-kernels on one common grid (§3.3.1): x's spectrum is shared, the weight
// part runs once per phase. Peak extra memory: x's spectrum plus one phase's
// sub-kernel and one chunk of its spectrum, each bounded below.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <vector>

#include "cuda/fft_energy.h"

namespace fused_ops {
namespace {

// Bytes of x's spectrum computed per ATen FFT call, and of weight spectrum per chunk.
constexpr int64_t kFftSliceBytes = int64_t(32) << 20;
constexpr int64_t kWeightChunkBytes = int64_t(48) << 20;
// Shared memory a block may use on the GPUs this is built for (sm_80 and later).
constexpr int64_t kMaxSmemBytes = 160 << 10;

// One phase whose grid is the whole output: §3.3 as it stands, nothing to correct.
bool is_full_convolution(const ConvGeometry& g) {
  for (int d = 0; d < 3; ++d) {
    if (g.stride[d] != 1 || g.padding[d] != 0 || g.output_padding[d] != 0) return false;
  }
  return true;
}

// Every phase's problem (docs/math.md §3.3.1): a stride-1 full convolution of x
// whose output is the common grid L. A strided dim gets the dense sub-kernel of
// k' = floor(d (k - 1) / s) + 1 positions; a stride-1 dim keeps its kernel and
// dilation (one phase, as in §3.3).
ConvGeometry phase_geometry(const ConvGeometry& g) {
  ConvGeometry p = g;
  for (int d = 0; d < 3; ++d) {
    if (g.stride[d] > 1) {
      p.kernel[d] = g.dilation[d] * (g.kernel[d] - 1) / g.stride[d] + 1;
      p.dilation[d] = 1;
    }
    p.stride[d] = 1;
    p.output_padding[d] = 0;
    p.out_size[d] = conv_transpose_out_size(g.in_size[d], p.kernel[d], 1, 0, p.dilation[d], 0);
  }
  return p;
}

int64_t phase_count(const ConvGeometry& g) { return g.stride[0] * g.stride[1] * g.stride[2]; }

// The phases some tap lands in (k < s leaves some empty: their energy and sums
// are 0, so they are skipped). Known from the geometry: no device round trip.
std::vector<int64_t> occupied_phases(const ConvGeometry& g) {
  std::vector<bool> hit[3];
  for (int d = 0; d < 3; ++d) {
    hit[d].assign(g.stride[d], false);
    for (int64_t t = 0; t < g.kernel[d]; ++t) hit[d][g.dilation[d] * t % g.stride[d]] = true;
  }
  std::vector<int64_t> phases;
  for (int64_t r = 0; r < phase_count(g); ++r) {
    const int64_t rw = r % g.stride[2], rh = r / g.stride[2] % g.stride[1],
                  rd = r / (g.stride[1] * g.stride[2]);
    if (hit[0][rd] && hit[1][rh] && hit[2][rw]) phases.push_back(r);
  }
  return phases;
}

// [T] long: where each tap (kd, kh, kw order) lands in the stack of the phases'
// sub-kernels, [P, k'd, k'h, k'w] flattened: phase r = (d t) mod s and position
// m = (d t) div (s d') per dim, d' the sub-kernel's dilation (§3.3.1). Built on
// the device from aranges: no host-to-device copy, nothing to synchronize.
at::Tensor tap_slots(const ConvGeometry& g, const ConvGeometry& sub,
                     const at::TensorOptions& opts) {
  at::Tensor phase = at::zeros({1, 1, 1}, opts), position = at::zeros({1, 1, 1}, opts);
  for (int d = 0; d < 3; ++d) {
    std::vector<int64_t> shape = {1, 1, 1};
    shape[d] = g.kernel[d];
    const at::Tensor dt = at::arange(g.kernel[d], opts).mul_(g.dilation[d]).view(shape);
    phase = phase * g.stride[d] + dt.remainder(g.stride[d]);
    position = position * sub.kernel[d] + at::div(dt, g.stride[d] * sub.dilation[d], "floor");
  }
  return (phase * sub.taps() + position).reshape({-1});
}

// x's spectrum at the grid size, as [Ld, Lh, Lwf, B, Ci]: one frequency's
// [B, Ci] matrix contiguous.
at::Tensor x_spectrum(const at::Tensor& x, const ConvGeometry& sub, const SpectrumGeometry& s) {
  auto x_spec = at::empty({s.L[0], s.L[1], s.Lwf, sub.batch, sub.in_channels},
                          x.options().dtype(at::kComplexFloat));
  const int64_t sample_bytes = s.L[0] * s.pairs() * sub.in_channels * 8;
  const int64_t slice = std::max<int64_t>(1, kFftSliceBytes / sample_bytes);
  for (int64_t b0 = 0; b0 < sub.batch; b0 += slice) {
    const int64_t n = std::min(slice, sub.batch - b0);
    auto spec = at::fft_rfftn(x.narrow(0, b0, n), at::IntArrayRef(s.L, 3), {2, 3, 4});
    x_spec.narrow(3, b0, n).copy_(spec.permute({2, 3, 4, 0, 1}));
  }
  return x_spec;
}

// Writes energy [1, Co, Lh * Lwf] (double) for the stride-1 full convolution
// `sub` of x with `weight` [Ci, Cog, kD, kH, kW] (contiguous float32): the
// weight's spectrum and the multiply-and-reduce kernel, a chunk of fh at a time.
void grid_energy(const at::Tensor& x_spec, const at::Tensor& weight, const ConvGeometry& sub,
                 const SpectrumGeometry& s, at::Tensor& energy) {
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

// [Co] double: sum_b (sum_r S[b, r]^2 / |grid| - S[b]^2 / M), the terms that
// turn the phases' energies (each centred on its own grid mean) into the
// energy of the real output centred on the sample's mean (§3.3.1). S[b, r] is
// the contraction of x's sums with the sums of phase r's taps (§2.1).
at::Tensor phase_sum_correction(const at::Tensor& weight, const SampleSumTensors& sums,
                                const ConvGeometry& g, const ConvGeometry& sub,
                                const at::Tensor& slots) {
  const int64_t phases = phase_count(g), cig = g.in_group_channels(), cog = g.out_group_channels();
  const at::Tensor phase = at::div(slots, sub.taps(), "floor");
  const at::Tensor one_hot =  // [T, P]: which phase each tap lands in
      phase.unsqueeze(1).eq(at::arange(phases, slots.options())).to(at::kDouble);
  const at::Tensor w_sums =  // [G, Cig, Cog, P]
      at::matmul(weight.reshape({g.groups, cig, cog, g.taps()}).to(at::kDouble), one_hot);
  const at::Tensor x_sums = sums.x_red.sum(2).view({g.batch, g.groups, cig});
  const at::Tensor s = at::einsum("bgi,giop->bgop", {x_sums, w_sums})
                           .reshape({g.batch, g.out_channels, phases});  // [B, Co, P]
  const double grid = static_cast<double>(sub.out_spatial());
  const double real = static_cast<double>(g.out_spatial());
  return s.square().sum(at::IntArrayRef{0, 2}).div_(grid).sub_(s.sum(2).square_().sum(0).div_(real));
}

// The phases' energies summed, plus the correction: [1, Co, 1] (§3.3.1).
at::Tensor polyphase_energy(const at::Tensor& x_spec, const at::Tensor& weight,
                            const SampleSumTensors& sums, const ConvGeometry& g,
                            const ConvGeometry& sub, const SpectrumGeometry& s) {
  const int64_t positions = sub.taps();
  const at::TensorOptions longs = weight.options().dtype(at::kLong);
  const at::Tensor slots = tap_slots(g, sub, longs);
  // Each slot of the stack names the tap that lands there, or the zero column T
  // appended to the weight where none does; phase r's sub-kernel is then one gather.
  const at::Tensor source = at::full({phase_count(g) * positions}, g.taps(), longs)
                                .index_copy_(0, slots, at::arange(g.taps(), longs));
  const at::Tensor taps = at::constant_pad_nd(
      weight.reshape({g.in_channels * g.out_group_channels(), g.taps()}), {0, 1});
  auto total = at::zeros({1, g.out_channels, s.pairs()}, x_spec.options().dtype(at::kDouble));
  auto phase_energy = at::empty_like(total);
  for (const int64_t r : occupied_phases(g)) {
    const at::Tensor sub_kernel = taps.index_select(1, source.narrow(0, r * positions, positions));
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
  // The shared memory of weight_spectrum.cu (for a chunk of all fh, the most it
  // takes) and of spectral_energy.cu's tiles, for the phases' problem.
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
  const at::Tensor x_spec = x_spectrum(x, sub, s);
  if (!is_full_convolution(g)) return polyphase_energy(x_spec, weight, sums, g, sub, s);
  auto energy = at::empty({1, g.out_channels, s.pairs()}, x.options().dtype(at::kDouble));
  grid_energy(x_spec, weight, sub, s, energy);
  return energy;
}

}  // namespace fused_ops
