// CPU kernels of ct_bn_pool: the same algebra as the CUDA kernels, through the
// shared per-element routines, parallelized with at::parallel_for.
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>

#include "conv_transpose_row.h"
#include "ct_bn_pool.h"

namespace fused_ops {
namespace {

// The dims (Ci, D, H, W) of one sample of x in the order x's strides walk
// memory, outermost first: Ci, D, H, W for contiguous x, D, H, W, Ci for
// channels_last_3d.
struct SampleWalk {
  int64_t size[4], stride[4];
  int channel;  // where Ci is in the walk
};

SampleWalk sample_walk(const at::Tensor& x) {
  std::array<int64_t, 4> dims = {1, 2, 3, 4};
  std::stable_sort(dims.begin(), dims.end(),
                   [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  SampleWalk walk;
  for (int k = 0; k < 4; ++k) {
    walk.size[k] = x.size(dims[k]);
    walk.stride[k] = x.stride(dims[k]);
    if (dims[k] == 1) walk.channel = k;
  }
  return walk;
}

// Adds the sums over D, H, W of the indices [begin, end) of the walk's outermost
// dim of one sample (x) to acc[Ci], in memory order.
template <typename scalar_t>
void add_slab_sums(const scalar_t* x, const SampleWalk& w, int64_t begin, int64_t end,
                   double* acc) {
  int64_t i[3];
  for (i[0] = begin; i[0] < end; ++i[0]) {
    for (i[1] = 0; i[1] < w.size[1]; ++i[1]) {
      for (i[2] = 0; i[2] < w.size[2]; ++i[2]) {
        const scalar_t* run = x + i[0] * w.stride[0] + i[1] * w.stride[1] + i[2] * w.stride[2];
        if (w.channel == 3) {  // channels innermost: one sum per element
          for (int64_t c = 0; c < w.size[3]; ++c) {
            acc[c] += static_cast<double>(run[c * w.stride[3]]);
          }
          continue;
        }
        double sum = 0;
        for (int64_t k = 0; k < w.size[3]; ++k) sum += static_cast<double>(run[k * w.stride[3]]);
        acc[i[w.channel]] += sum;
      }
    }
  }
}

// x_red [B, Ci, J]: sums of x over D, H, W in double, read in place in any
// layout (x.sum(dims, kDouble) would first convert all of x to double). Unit
// (b, j) walks slab j of the outermost dim of sample b; the J slabs add up.
template <typename scalar_t>
at::Tensor spatial_sums_cpu(const at::Tensor& x) {
  const SampleWalk walk = sample_walk(x);
  const int64_t batch = x.size(0), channels = x.size(1);
  const int64_t parts = std::clamp<int64_t>(
      (2 * at::get_num_threads() + batch - 1) / batch, 1, walk.size[0]);
  auto x_red = at::empty({batch, channels, parts}, x.options().dtype(at::kDouble));
  const scalar_t* xp = x.data_ptr<scalar_t>();
  double* out = x_red.data_ptr<double>();
  at::parallel_for(0, batch * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> acc(channels);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / parts, j = unit % parts;
      std::fill(acc.begin(), acc.end(), 0.0);
      add_slab_sums(xp + b * x.stride(0), walk, walk.size[0] * j / parts,
                    walk.size[0] * (j + 1) / parts, acc.data());
      for (int64_t c = 0; c < channels; ++c) out[(b * channels + c) * parts + j] = acc[c];
    }
  });
  return x_red;
}

SampleSumTensors sample_sums_cpu(const at::Tensor& x, const at::Tensor& weight) {
  at::Tensor x_red;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sample_sums_cpu",
                                  [&] { x_red = spatial_sums_cpu<scalar_t>(x); });
  return {x_red, weight.flatten(2).sum({2}, /*keepdim=*/true, at::kDouble)};
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

at::Tensor energy_direct_cpu(const at::Tensor& x, const at::Tensor& weight,
                             const SampleSumTensors& sums, const ConvGeometry& g) {
  const at::Tensor packed = pack_weight_for_direct(weight, g);
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
            args, c, /*first=*/0, /*step=*/1, energy_part(args, c, 0, 1),
            [&](int64_t b) { return args.sample_sum(b, c); },
            [](double v) { return v; });
      }
    });
  });
}

// oneDNN's convolution beats the direct loops on every CPU problem measured, and
// the correlation path beats it where its float64 GEMMs have less than a third of the
// convolution's multiply-adds (measured on 2 cores: 0.19 and 0.25 ran 2.0x and 1.4x
// faster, 2.3 ran 8x slower; docs/performance.md).
constexpr double kCpuCorrelationRatio = 1.0 / 3.0;

EnergyAlgo auto_energy_algo_cpu(const ConvGeometry& g, at::ScalarType) {
  if (!g.has_padding() && correlation_cost_ratio(g) < kCpuCorrelationRatio) {
    return EnergyAlgo::Correlation;
  }
  return EnergyAlgo::SlicedConv;
}

// The CPU runs a call's work as it is issued: one stream.
int64_t table_stream_cpu(const at::Device&) { return 0; }

const Backend kCpuBackend = {sample_sums_cpu,      weight_sums_aten,  energy_direct_cpu, finalize_cpu,
                             auto_energy_algo_cpu, nullptr,           nullptr,
                             nullptr,              cross_spectrum_rows_aten,
                             lag_stage_aten,       table_stream_cpu,
                             correlation_blocks_aten, quad_forms_aten,
                             tap_spectrum_aten,    line_weight_aten,
                             line_columns_aten,    nullptr,
                             nullptr,              kAtenSpectrumKernels};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) {
  m.impl("ct_bn_pool", &ct_bn_pool_kernel<kCpuBackend>);
  m.impl("ct_bn_pool.no_stats", &ct_bn_pool_no_stats_kernel<kCpuBackend>);
  m.impl("ct_bn_pool_stats", &ct_bn_pool_stats_kernel<kCpuBackend>);
  m.impl("ct_bn_pool_apply", &ct_bn_pool_apply_kernel<kCpuBackend>);
  m.impl("ct_bn_pool_apply.no_stats", &ct_bn_pool_apply_no_stats_kernel<kCpuBackend>);
}

}  // namespace fused_ops
