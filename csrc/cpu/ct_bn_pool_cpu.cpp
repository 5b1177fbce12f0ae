// CPU kernels of ct_bn_pool: the same algebra as the CUDA kernels, through the
// shared per-element routines, parallelized with at::parallel_for.
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "conv_transpose_point.h"
#include "ct_bn_pool.h"

namespace fused_ops {
namespace {

SampleSumTensors sample_sums_cpu(const at::Tensor& x, const at::Tensor& weight) {
  return {x.sum({2, 3, 4}, /*keepdim=*/false, at::kDouble).unsqueeze(2),
          weight.flatten(2).sum({2}, /*keepdim=*/true, at::kDouble)};
}

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
        acc_t y[CT];
        conv_transpose_point<CT>(x_group, w_tile, g, co_pad, od, oh, ow, y);
        for (int j = 0; j < CT; ++j) e[j] += (y[j] - shift[j]) * (y[j] - shift[j]);
      }
      for (int j = 0; j < CT && co0 + j < cog; ++j) {
        ep[b * g.out_channels + group * cog + co0 + j] = static_cast<double>(e[j]);
      }
    }
  });
}

at::Tensor energy_direct_cpu(const at::Tensor& x, const at::Tensor& packed,
                             const SampleSumTensors& sums, const ConvGeometry& g) {
  auto energy = at::empty({g.batch, g.out_channels, 1}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "energy_direct_cpu", [&] {
    energy_direct_cpu_kernel<scalar_t>(x, packed, sums.view(g), g, energy);
  });
  return energy;
}

void finalize_cpu(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "bn_finalize_cpu", [&] {
    const auto args = finalize_args<scalar_t>(in, g, out);
    at::parallel_for(0, g.out_channels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        finalize_channel(
            args, c, /*first=*/0, /*step=*/1, [&](int64_t b) { return args.sample_sum(b, c); },
            [](double v) { return v; });
      }
    });
  });
}

// oneDNN's convolution beats the direct loops on every CPU problem measured
// (docs/performance.md), so it is the CPU's default.
EnergyAlgo auto_energy_algo_cpu(const ConvGeometry&, at::ScalarType) {
  return EnergyAlgo::SlicedConv;
}

const Backend kCpuBackend = {sample_sums_cpu,      energy_direct_cpu, finalize_cpu,
                             auto_energy_algo_cpu, nullptr,           nullptr};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("ct_bn_pool", &ct_bn_pool_kernel<kCpuBackend>);
  m.impl("ct_bn_pool_stats", &ct_bn_pool_stats_kernel<kCpuBackend>);
  m.impl("ct_bn_pool_apply", &ct_bn_pool_apply_kernel<kCpuBackend>);
}

}  // namespace fused_ops
