// The float64 GEMM operands of border's lines and corners (Backend::line_weight and
// line_columns, border_energy.cpp's group_values_energy, docs/math.md §3.6), each written
// in the GEMM's layout by one kernel. Why: ATen formed them with index_selects, a zero-filled
// staging tensor and permuting, converting copies: about 216 us of each pad2 call's 484 us of
// lines and corners (docs/performance.md, 2026-12-01 18:23 UTC), for operands of about 130 MB.
//   line_weight:  one thread per entry, Cog fastest, from the weight transposed to
//                 [Ci, taps + 1, Cog] (one small copy) so that a warp reads adjacent values.
//   line_columns: one block per (region, group, sample, chunk of channels): the chunk's input
//                 planes staged in shared memory, a zero appended to each (where no input
//                 lands), read in order of x's positions; then every (f, t) row's run of
//                 (ci, plane) entries written adjacent.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "cuda/kernels.h"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxStagedBytes = 48 << 10;  // line_columns' planes: the default shared memory
// Adjacent entries a line_columns block writes per row, at least (its chunk's channels times
// the planes): fewer channels per block make more blocks, down to runs of this many.
constexpr int64_t kMinRun = 64;

struct WeightArgs {
  const int64_t* tap_index;  // [R, P_in, P_out, k]
  double* out;               // [R, G, k, Cig, P_in, P_out, Cog]
  int64_t total, taps;       // taps: the transposed weight's taps + 1
  int cog, planes_out, planes_in, cig, k, groups;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) line_weight_kernel(const T* __restrict__ w, WeightArgs a) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= a.total) return;
  int64_t q = e;
  const int co = static_cast<int>(q % a.cog);
  q /= a.cog;
  const int o = static_cast<int>(q % a.planes_out);
  q /= a.planes_out;
  const int i = static_cast<int>(q % a.planes_in);
  q /= a.planes_in;
  const int ci = static_cast<int>(q % a.cig);
  q /= a.cig;
  const int t = static_cast<int>(q % a.k);
  q /= a.k;
  const int64_t g = q % a.groups, r = q / a.groups;
  const int64_t tap = a.tap_index[((r * a.planes_in + i) * a.planes_out + o) * a.k + t];
  a.out[e] = static_cast<double>(w[((g * a.cig + ci) * a.taps + tap) * a.cog + co]);
}

struct ColumnArgs {
  const int64_t* positions;  // [R, P_in, L]
  const int64_t* columns;    // [F, k]
  double* out;               // [R G, n F, k Cig P_in]
  int64_t spatial, b0;       // x's D H W; the slice's first sample
  int n, groups, cig, chunk, chunks, planes_in, length, outputs, k;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) line_columns_kernel(const T* __restrict__ x, ColumnArgs a) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  T* planes = reinterpret_cast<T*>(smem_bytes);  // [chunk][P_in][L + 1]
  int unit = blockIdx.x;
  const int part = unit % a.chunks;
  unit /= a.chunks;
  const int b = unit % a.n;
  unit /= a.n;
  const int g = unit % a.groups, r = unit / a.groups;
  const int c0 = part * a.chunk, nc = min(a.chunk, a.cig - c0);
  const int per_channel = a.planes_in * (a.length + 1);
  const T* xb = x + ((a.b0 + b) * (int64_t(a.groups) * a.cig) + int64_t(g) * a.cig + c0) * a.spatial;
  const int64_t* pos = a.positions + int64_t(r) * a.planes_in * a.length;
  for (int e = threadIdx.x; e < nc * per_channel; e += kThreads) {
    const int c = e / per_channel, il = e % per_channel, i = il / (a.length + 1), l = il % (a.length + 1);
    planes[e] = l < a.length ? xb[c * a.spatial + pos[i * a.length + l]] : T(0);
  }
  __syncthreads();
  const int run = nc * a.planes_in;
  const int64_t width = int64_t(a.k) * a.cig * a.planes_in;
  double* rows = a.out + ((int64_t(r) * a.groups + g) * a.n + b) * a.outputs * width + int64_t(c0) * a.planes_in;
  for (int e = threadIdx.x; e < a.outputs * a.k * run; e += kThreads) {
    const int j = e % run, ft = e / run, t = ft % a.k, f = ft / a.k;
    const int c = j / a.planes_in, i = j % a.planes_in;
    const int64_t l = a.columns[ft];
    const T v = planes[(c * a.planes_in + i) * (a.length + 1) + l];
    rows[f * width + int64_t(t) * a.cig * a.planes_in + j] = static_cast<double>(v);
  }
}

template <typename F>
void dispatch_float(const at::Tensor& t, const char* name, F f) {
  if (t.scalar_type() == at::kDouble) return f(double{});
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": expected float32 or float64, got ", t.scalar_type());
  f(float{});
}

}  // namespace

at::Tensor line_weight_cuda(const at::Tensor& w_taps, const at::Tensor& tap_index, int64_t groups) {
  const c10::cuda::CUDAGuard guard(w_taps.device());
  const int64_t R = tap_index.size(0), planes_in = tap_index.size(1), planes_out = tap_index.size(2),
                k = tap_index.size(3), cig = w_taps.size(0) / groups, cog = w_taps.size(1);
  auto out = at::empty({R * groups, k * cig * planes_in, planes_out * cog}, w_taps.options().dtype(at::kDouble));
  if (out.numel() == 0) return out;
  const at::Tensor w = w_taps.transpose(1, 2).contiguous();  // [Ci, taps + 1, Cog]
  const at::Tensor index = tap_index.contiguous();
  WeightArgs a;
  a.tap_index = index.data_ptr<int64_t>();
  a.out = out.data_ptr<double>();
  a.total = out.numel();
  a.taps = w.size(1);
  a.cog = static_cast<int>(cog), a.planes_out = static_cast<int>(planes_out);
  a.planes_in = static_cast<int>(planes_in), a.cig = static_cast<int>(cig);
  a.k = static_cast<int>(k), a.groups = static_cast<int>(groups);
  const int64_t blocks = (a.total + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: border's line weight too large (", to_str(out.sizes()), ")");
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_float(w, "line_weight_cuda", [&](auto zero) {
    using T = decltype(zero);
    line_weight_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w.data_ptr<T>(), a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor line_columns_cuda(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& columns,
                             int64_t groups, int64_t b0, int64_t n) {
  const int64_t planes_in = positions.size(1), length = positions.size(2);
  const int64_t cig = x.size(1) / groups, outputs = columns.size(0), k = columns.size(1);
  const int64_t channel_bytes = planes_in * (length + 1) * x.element_size();
  if (channel_bytes > kMaxStagedBytes || !x.is_contiguous()) {
    return line_columns_aten(x, positions, columns, groups, b0, n);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t R = positions.size(0);
  auto out = at::empty({R * groups, n * outputs, k * cig * planes_in}, x.options().dtype(at::kDouble));
  if (out.numel() == 0) return out;
  TORCH_CHECK(outputs * k * cig * planes_in < (int64_t(1) << 31) && R * groups * n * cig < (int64_t(1) << 31),
              "ct_bn_pool: border's line columns too large (", to_str(out.sizes()), ")");
  // The most channels the shared memory takes, halved while there would be fewer than two
  // blocks per SM and the runs stay at least kMinRun entries.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t chunk = std::min(cig, kMaxStagedBytes / channel_bytes);
  const auto blocks = [&](int64_t c) { return R * groups * n * ((cig + c - 1) / c); };
  while (chunk > 1 && blocks(chunk) < 2 * sms && (chunk / 2) * planes_in >= kMinRun) chunk /= 2;
  const at::Tensor pos = positions.contiguous(), cols = columns.contiguous();
  ColumnArgs a;
  a.positions = pos.data_ptr<int64_t>();
  a.columns = cols.data_ptr<int64_t>();
  a.out = out.data_ptr<double>();
  a.spatial = x.size(2), a.b0 = b0;
  a.n = static_cast<int>(n), a.groups = static_cast<int>(groups), a.cig = static_cast<int>(cig);
  a.chunk = static_cast<int>(chunk), a.chunks = static_cast<int>((cig + chunk - 1) / chunk);
  a.planes_in = static_cast<int>(planes_in), a.length = static_cast<int>(length);
  a.outputs = static_cast<int>(outputs), a.k = static_cast<int>(k);
  const int64_t smem = chunk * channel_bytes;
  const auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_float(x, "line_columns_cuda", [&](auto zero) {
    using T = decltype(zero);
    line_columns_kernel<T><<<static_cast<unsigned>(blocks(chunk)), kThreads, static_cast<size_t>(smem), stream>>>(
        x.data_ptr<T>(), a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace fused_ops
