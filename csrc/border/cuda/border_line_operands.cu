// The float64 GEMM operands of border's lines and corners (Backend::line_weight and
// line_columns, border.cpp's group_values_energy, docs/math.md §3.6), each written
// in the GEMM's layout by one kernel. Why: as ATen ops they take index_selects, a zero-filled
// staging tensor and permuting, converting copies, several passes over operands that are the
// largest tensors of the lines and corners; one kernel writes each once (docs/performance.md).
//   line_weight:  a warp per row of Cog entries, from the weight transposed to
//                 [Ci, taps + 1, Cog] (one small copy) so that a warp reads adjacent values.
//   line_columns: one block per (region, group, sample, chunk of channels): the chunk's input
//                 planes staged in shared memory, a zero appended to each (where no input
//                 lands), read in order of x's positions; then a warp per (f, t) writes its
//                 run of (ci, plane) entries, adjacent in the output.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "border/cuda/border_kernels.h"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxStagedBytes = 48 << 10;  // line_columns' planes: the default shared memory
// Adjacent entries a line_columns block writes per row, at least (its chunk's channels times
// the planes): fewer channels per block make more blocks, down to runs of this many.
constexpr int64_t kMinRun = 64;

constexpr int kWarps = kThreads / 32;

struct WeightArgs {
  const int64_t* tap_index;  // [R, P_in, P_out, k]
  double* out;               // [R, G, k, Cig, P_in, P_out, Cog]
  int64_t taps;              // the transposed weight's taps + 1
  int rows, cog, planes_out, planes_in, cig, k, groups;
};

// A warp per row (r, g, t, ci, i, o) of Cog entries, its lanes over co: the row's index split
// once, in 32-bit (a thread per entry would split its 64-bit index per entry, a long
// instruction sequence each; docs/performance.md).
template <typename T>
__global__ void __launch_bounds__(kThreads) line_weight_kernel(const T* __restrict__ w, WeightArgs a) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= a.rows) return;
  int q = row;
  const int o = q % a.planes_out;
  q /= a.planes_out;
  const int i = q % a.planes_in;
  q /= a.planes_in;
  const int ci = q % a.cig;
  q /= a.cig;
  const int t = q % a.k;
  q /= a.k;
  const int g = q % a.groups, r = q / a.groups;
  const int64_t tap = a.tap_index[((int64_t(r) * a.planes_in + i) * a.planes_out + o) * a.k + t];
  const T* src = w + ((int64_t(g) * a.cig + ci) * a.taps + tap) * a.cog;
  double* dst = a.out + int64_t(row) * a.cog;
  for (int co = lane; co < a.cog; co += 32) dst[co] = static_cast<double>(src[co]);
}

struct ColumnArgs {
  const int64_t* positions;  // [R, P_in, L]
  const int64_t* columns;    // [F, k]
  double* out;               // [R G, n F, k Cig P_in]
  int64_t spatial, b0;       // x's D H W; the slice's first sample
  int n, groups, cig, chunk, chunks, planes_in, length, pitch, outputs, k;
};

// The block's planes in shared memory as rows j = (c, i) of `pitch` values (L of x, a zero, and
// one more where L + 1 is even, so that a warp's rows fall in distinct banks): entry (f, t, j) of
// the output is row j's value at columns[f, t]; a warp per (f, t), its lanes over j.
template <typename T>
__global__ void __launch_bounds__(kThreads) line_columns_kernel(const T* __restrict__ x, ColumnArgs a) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  T* planes = reinterpret_cast<T*>(smem_bytes);  // [chunk P_in][pitch]
  int unit = blockIdx.x;
  const int part = unit % a.chunks;
  unit /= a.chunks;
  const int b = unit % a.n;
  unit /= a.n;
  const int g = unit % a.groups, r = unit / a.groups;
  const int c0 = part * a.chunk, run = min(a.chunk, a.cig - c0) * a.planes_in;
  const T* xb = x + ((a.b0 + b) * (int64_t(a.groups) * a.cig) + int64_t(g) * a.cig + c0) * a.spatial;
  const int64_t* pos = a.positions + int64_t(r) * a.planes_in * a.length;
  for (int e = threadIdx.x; e < run * a.pitch; e += kThreads) {
    const int j = e / a.pitch, l = e % a.pitch, c = j / a.planes_in, i = j % a.planes_in;
    planes[e] = l < a.length ? xb[c * a.spatial + pos[i * a.length + l]] : T(0);
  }
  __syncthreads();
  const int64_t width = int64_t(a.k) * a.cig * a.planes_in;
  double* rows = a.out + ((int64_t(r) * a.groups + g) * a.n + b) * a.outputs * width + int64_t(c0) * a.planes_in;
  for (int ft = threadIdx.x / 32; ft < a.outputs * a.k; ft += kWarps) {
    const int t = ft % a.k, f = ft / a.k, l = static_cast<int>(a.columns[ft]);
    double* dst = rows + f * width + int64_t(t) * a.cig * a.planes_in;
    for (int j = threadIdx.x % 32; j < run; j += 32) dst[j] = static_cast<double>(planes[j * a.pitch + l]);
  }
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
  const int64_t rows = out.numel() / cog;
  TORCH_CHECK(rows < (int64_t(1) << 31), "ct_bn_pool: border's line weight too large (", to_str(out.sizes()), ")");
  WeightArgs a;
  a.tap_index = index.data_ptr<int64_t>();
  a.out = out.data_ptr<double>();
  a.rows = static_cast<int>(rows);
  a.taps = w.size(1);
  a.cog = static_cast<int>(cog), a.planes_out = static_cast<int>(planes_out);
  a.planes_in = static_cast<int>(planes_in), a.cig = static_cast<int>(cig);
  a.k = static_cast<int>(k), a.groups = static_cast<int>(groups);
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "line_weight_cuda", [&] {
    line_weight_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w.data_ptr<scalar_t>(), a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor line_columns_cuda(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& columns,
                             int64_t groups, int64_t b0, int64_t n) {
  const int64_t planes_in = positions.size(1), length = positions.size(2);
  const int64_t cig = x.size(1) / groups, outputs = columns.size(0), k = columns.size(1);
  const int64_t pitch = (length + 1) | 1;  // odd: line_columns_kernel's rows
  const int64_t channel_bytes = planes_in * pitch * x.element_size();
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
  a.planes_in = static_cast<int>(planes_in), a.length = static_cast<int>(length), a.pitch = static_cast<int>(pitch);
  a.outputs = static_cast<int>(outputs), a.k = static_cast<int>(k);
  const int64_t smem = chunk * channel_bytes;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "line_columns_cuda", [&] {
    const auto grid = static_cast<unsigned>(blocks(chunk));
    line_columns_kernel<scalar_t><<<grid, kThreads, static_cast<size_t>(smem), stream>>>(x.data_ptr<scalar_t>(), a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace fused_ops
