// The CPU backend: x's sums and the finalize as loops parallelized with at::parallel_for
// (the same per-element routines as the CUDA kernels), the other hooks by ATen ops.
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>

#include "ct_bn_pool.h"
#include "direct/direct.h"
#include "dispatch.h"
#include "kept/affine_grad_args.h"
#include "sums/finalize_args.h"

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

// The sum of f(r[p]) over a row, in float64 with eight independent partial sums: one sum
// would chain every add on the one before it (the latency of an add per element), slower than
// ATen's vectorized reductions on large rows.
template <typename T, typename F>
double row_sum(const T* r, int64_t n, F f) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) {
    for (int u = 0; u < 8; ++u) acc[u] += f(static_cast<double>(r[p + u]));
  }
  for (; p < n; ++p) acc[0] += f(static_cast<double>(r[p]));
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Backend::weight_sums: each weight[ci, co] summed over its taps in float64, [Ci, Cog, 1]: one
// loop, where ATen's flatten, conversion and sum are six dispatcher calls, most of a small eval
// call's host time.
at::Tensor weight_sums_cpu(const at::Tensor& weight_in) {
  const at::Tensor weight = weight_in.contiguous();  // itself where it is (the callers' weights)
  const int64_t rows = weight.size(0) * weight.size(1), taps = weight.numel() / rows;
  at::Tensor w_red = at::empty({weight.size(0), weight.size(1), 1}, weight.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "weight_sums_cpu", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    double* out = w_red.data_ptr<double>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / taps), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) out[row] = row_sum(w + row * taps, taps, [](double v) { return v; });
    });
  });
  return w_red;
}

SampleSumTensors sample_sums_cpu(const at::Tensor& x, const at::Tensor& weight) {
  at::Tensor x_red;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sample_sums_cpu",
                                  [&] { x_red = spatial_sums_cpu<scalar_t>(x); });
  return {x_red, weight_sums_cpu(weight)};
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

// Backend::sample_moments: each (sample, channel) row of y summed, then its squares about its
// mean, in float64.
std::pair<at::Tensor, at::Tensor> sample_moments_cpu(const at::Tensor& y) {
  TORCH_CHECK(y.is_contiguous(), "sample_moments_cpu: y must be contiguous");
  const int64_t batch = y.size(0), channels = y.size(1), rows = batch * channels;
  const auto opts = y.options().dtype(at::kDouble);
  at::Tensor sums = at::empty({batch, channels}, opts), m2 = at::empty({batch, channels, 1}, opts);
  if (rows == 0) return {sums, m2};
  const int64_t positions = y.numel() / rows;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "sample_moments_cpu", [&] {
    const scalar_t* data = y.const_data_ptr<scalar_t>();
    double* s_out = sums.data_ptr<double>();
    double* q_out = m2.data_ptr<double>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / positions), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* r = data + row * positions;
        const double s = row_sum(r, positions, [](double v) { return v; });
        const double mean = s / static_cast<double>(positions);
        s_out[row] = s;
        q_out[row] = row_sum(r, positions, [mean](double v) { return (v - mean) * (v - mean); });
      }
    });
  });
  return {sums, m2};
}

// Backend::affine_grad: the per-channel routine (kept/affine_grad.h) in a loop.
void affine_grad_cpu(const AffineGradInputs& in) {
  AT_DISPATCH_FLOATING_TYPES(in.grad_out.scalar_type(), "affine_grad_cpu", [&] {
    const auto args = affine_grad_args<scalar_t>(in);
    for (int64_t c = 0; c < args.channels; ++c) affine_grad_channel(args, c);
  });
}

// The CPU runs a call's work as it is issued, and has no graph memory pool to keep out of.
bool build_tables_apart_cpu(const at::Device&, c10::function_ref<void()> build) {
  build();
  return true;
}

// Every hook by name (backend.h); the ones the CPU lacks are null, with the reason.
const Backend kCpuBackend = [] {
  Backend b;
  b.sample_sums = sample_sums_cpu;
  b.weight_sums = weight_sums_cpu;
  b.energy_direct = energy_direct_cpu;
  b.finalize = finalize_cpu;
  b.auto_energy_algo = auto_energy_algo_cpu;
  b.energy_fft = nullptr;  // the FFT path's kernels are CUDA's; algo='fft' is refused on the CPU
  b.fft_applies = nullptr;
  b.eval_sample_sums = nullptr;  // eval's sums are sample_sums'
  b.cross_spectrum_rows = cross_spectrum_rows_aten;
  b.lag_stage = lag_stage_aten;
  b.build_tables_apart = build_tables_apart_cpu;
  b.correlation_blocks = correlation_blocks_aten;
  b.quad_forms = quad_forms_aten;
  b.tap_spectrum = tap_spectrum_aten;
  b.line_weight = line_weight_aten;
  b.line_columns = line_columns_aten;
  b.box_sums = nullptr;  // box_sums' einsums serve the CPU
  b.direct_stats = nullptr;  // the direct energy takes x's sums (energy_direct)
  b.sample_moments = sample_moments_cpu;
  b.affine_grad = affine_grad_cpu;
  b.spectrum_kernels = kAtenSpectrumKernels;
  return b;
}();

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CPU, m) { register_kernels<kCpuBackend>(m); }

}  // namespace fused_ops
