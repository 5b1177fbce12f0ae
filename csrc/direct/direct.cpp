// The direct algorithm's host side (docs/math.md §3.1): the weight's packing for every
// device, and the CPU's energy, each output position of a tile of channels computed by
// conv_transpose_row, centred on its sample's mean and squared; the conv output is never stored.
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "common/conv_transpose_row.h"
#include "direct/direct.h"

namespace fused_ops {

at::Tensor pack_weight_for_direct(const at::Tensor& weight, const ConvGeometry& g) {
  const int64_t cog = g.out_group_channels();
  const int64_t co_pad = direct_co_pad(g);
  auto w = weight.reshape({g.groups, g.in_group_channels(), cog, g.taps()}).transpose(2, 3);
  return at::constant_pad_nd(w, {0, co_pad - cog}).contiguous();
}

namespace {

template <typename scalar_t>
void energy_direct_cpu_kernel(const at::Tensor& x, const at::Tensor& packed, const SampleSums& sums,
                              const ConvGeometry& g, at::Tensor& energy) {
  constexpr int CT = kDirectTile;
  using acc_t = at::acc_type<scalar_t, /*is_cuda=*/false>;
  const int64_t cog = g.out_group_channels(), co_pad = packed.size(3);
  const int64_t tiles = co_pad / CT, n_out = g.out_spatial();
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = packed.data_ptr<scalar_t>();
  double* ep = energy.data_ptr<double>();
  const int64_t units = g.batch * g.groups * tiles;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t tile = u % tiles, group = (u / tiles) % g.groups, b = u / (tiles * g.groups);
      const int64_t co0 = tile * CT;
      acc_t shift[CT], e[CT] = {};
      for (int j = 0; j < CT; ++j) {
        const int64_t co = group * cog + co0 + j;
        shift[j] = co0 + j < cog ? acc_t(sums.conv_sum(b, co) / n_out) : acc_t(0);
      }
      const scalar_t* x_group =
          xp + (b * g.in_channels + group * g.in_group_channels()) * g.in_spatial();
      const scalar_t* w_tile = wp + group * g.in_group_channels() * g.taps() * co_pad + co0;
      for (int64_t o = 0; o < n_out; ++o) {
        const int64_t ow = o % g.out_size[2], oh = (o / g.out_size[2]) % g.out_size[1],
                      od = o / (g.out_size[2] * g.out_size[1]);
        acc_t y[1][CT];
        conv_transpose_row<CT, 1, int64_t>(x_group, w_tile, g, co_pad, 0, g.kernel[0] * g.kernel[1], 0,
                                           g.in_group_channels(), od, oh, ow, y);
        for (int j = 0; j < CT; ++j) e[j] += (y[0][j] - shift[j]) * (y[0][j] - shift[j]);
      }
      for (int j = 0; j < CT && co0 + j < cog; ++j) {
        ep[b * g.out_channels + group * cog + co0 + j] = static_cast<double>(e[j]);
      }
    }
  });
}

}  // namespace

at::Tensor energy_direct_cpu(const at::Tensor& x, const at::Tensor& weight,
                             const SampleSumTensors& sums, const ConvGeometry& g) {
  const at::Tensor packed = pack_weight_for_direct(weight, g);
  auto energy = at::empty({g.batch, g.out_channels, 1}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "energy_direct_cpu", [&] {
    energy_direct_cpu_kernel<scalar_t>(x, packed, sums.view(g), g, energy);
  });
  return energy;
}

}  // namespace fused_ops
