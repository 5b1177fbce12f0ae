// Box sums of x for padding > 0 (docs/math.md §2.2): T[b, ci, tap] in float64, one block
// per (b, ci), in one launch (box_sums.cpp's float64 copy of x and three einsums are several).
// Each tap's mask along a dim is a contiguous range of input indices (landing_range), so T is
// three range sums of x, one dim at a time, in shared memory.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/cuda/copy_async.cuh"
#include "sums/cuda/sums_kernels.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
// A block's staged planes of x and their partial sums: the default limit, so no opt-in; a
// plane of more than about 5000 positions does not fit (box_sums.cpp's einsums take it).
constexpr int64_t kSmemBytes = 48 << 10;

FO_HD int64_t floor_div(int64_t a, int64_t s) { return a >= 0 ? a / s : -((-a + s - 1) / s); }

// Input indices [lo, hi) along `dim` whose tap k lands inside the output: 0 <= i s - p + k d < O.
struct Range {
  int lo, hi;
};
__device__ Range landing_range(const ConvGeometry& g, int dim, int64_t k) {
  const int64_t a = g.padding[dim] - k * g.dilation[dim], s = g.stride[dim];
  const int64_t lo = -floor_div(-a, s), hi = floor_div(g.out_size[dim] - 1 + a, s) + 1;
  const int64_t n = g.in_size[dim];
  return {static_cast<int>(lo < 0 ? 0 : (lo > n ? n : lo)), static_cast<int>(hi < 0 ? 0 : (hi > n ? n : hi))};
}

// Sum of v[i * step] over i in r, of n values: directly where the range is at most half of
// them, else as the total (given) less what lies outside it (the crop leaves out a few indices
// at each end, so that is the short way for the usual ranges).
template <typename T>
__device__ double range_sum(const T* v, int step, int n, Range r, double total) {
  double s = 0;
  if (2 * (r.hi - r.lo) <= n) {
    for (int i = r.lo; i < r.hi; ++i) s += static_cast<double>(v[i * step]);
    return s;
  }
  for (int i = 0; i < r.lo; ++i) s += static_cast<double>(v[i * step]);
  for (int i = r.hi; i < n; ++i) s += static_cast<double>(v[i * step]);
  return total - s;
}

struct BoxPlan {
  int64_t x_stride[5];  // x's strides, elements: any layout is read in place
  int planes;           // depth planes staged at once
  int row_stride;       // W + 1: rows of a plane start in different banks
};

// Shared memory: planes * H rows of x in its dtype (row_stride values each, rounded up to
// whole doubles), then per row its W total and kW range sums, then per plane its kH kW sums
// over the rows, then the taps' running sums; in doubles.
__host__ __device__ inline int64_t box_smem_doubles(const ConvGeometry& g, int64_t planes, int64_t x_bytes) {
  const int64_t rows = planes * g.in_size[1];
  return (rows * (g.in_size[2] + 1) * x_bytes + 7) / 8 + rows * (1 + g.kernel[2]) +
         planes * g.kernel[1] * g.kernel[2] + g.taps();
}

// Starts copying x's row (W values, `step` apart) to `dst`: straight to shared memory where
// the values are 4 or 8 bytes and adjacent (all the row's loads in flight, none through
// registers), else through registers.
template <typename scalar_t>
__device__ __forceinline__ void stage_row(const scalar_t* src, int64_t step, int W, int lane, scalar_t* dst) {
  if constexpr (sizeof(scalar_t) >= 4) {
    if (step == 1) {
      for (int w = lane; w < W; w += 32) copy_async(dst + w, src + w, true);
      return;
    }
  }
  for (int w = lane; w < W; w += 32) dst[w] = src[w * step];
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    box_sums_kernel(const scalar_t* __restrict__ x, const ConvGeometry g, const BoxPlan plan,
                    double* __restrict__ out) {
  extern __shared__ double smem[];
  const int D = static_cast<int>(g.in_size[0]), H = static_cast<int>(g.in_size[1]), W = static_cast<int>(g.in_size[2]);
  const int kD = static_cast<int>(g.kernel[0]), kH = static_cast<int>(g.kernel[1]), kW = static_cast<int>(g.kernel[2]);
  const int taps = kD * kH * kW, rs = plan.row_stride, slab_rows = plan.planes * H;
  scalar_t* xs = reinterpret_cast<scalar_t*>(smem);                       // [planes * H][rs]
  double* row_sums = smem + (int64_t(slab_rows) * rs * sizeof(scalar_t) + 7) / 8;  // [planes * H][1 + kW]
  double* plane_sums = row_sums + slab_rows * (1 + kW);                  // [planes][kH * kW]
  double* tap_sums = plane_sums + plan.planes * kH * kW;                 // [taps]
  const int64_t b = blockIdx.x / g.in_channels, ci = blockIdx.x % g.in_channels;
  const int64_t* x_stride = plan.x_stride;
  const scalar_t* xc = x + b * x_stride[0] + ci * x_stride[1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int t = threadIdx.x; t < taps; t += kThreads) tap_sums[t] = 0;
  for (int d0 = 0; d0 < D; d0 += plan.planes) {
    const int planes = min(plan.planes, D - d0), rows = planes * H;
    __syncthreads();  // the previous slab's sums are read
    for (int r = warp; r < rows; r += kThreads / 32) {  // a warp per row: coalesced along W
      stage_row(xc + (d0 + r / H) * x_stride[2] + (r % H) * x_stride[3], x_stride[4], W, lane, xs + r * rs);
    }
    copy_async_commit();
    copy_async_wait<0>();
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += kThreads) {
      double s = 0;
      for (int w = 0; w < W; ++w) s += static_cast<double>(xs[r * rs + w]);
      row_sums[r * (1 + kW)] = s;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * kW; i += kThreads) {
      const int r = i / kW, kw = i % kW;
      row_sums[r * (1 + kW) + 1 + kw] = range_sum(xs + r * rs, 1, W, landing_range(g, 2, kw), row_sums[r * (1 + kW)]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < planes * kH * kW; i += kThreads) {
      const int p = i / (kH * kW), kh = i / kW % kH, kw = i % kW;
      const double* col = row_sums + p * H * (1 + kW) + 1 + kw;
      double total = 0;  // the column over all rows: what range_sum subtracts from
      for (int h = 0; h < H; ++h) total += col[h * (1 + kW)];
      plane_sums[i] = range_sum(col, 1 + kW, H, landing_range(g, 1, kh), total);
    }
    __syncthreads();
    for (int t = threadIdx.x; t < taps; t += kThreads) {  // each tap's sum has one owner
      const Range r = landing_range(g, 0, t / (kH * kW));
      const int hw = t % (kH * kW);
      for (int d = max(r.lo, d0); d < min(r.hi, d0 + planes); ++d) {
        tap_sums[t] += plane_sums[(d - d0) * kH * kW + hw];
      }
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < taps; t += kThreads) out[blockIdx.x * int64_t(taps) + t] = tap_sums[t];
}

}  // namespace

at::Tensor box_sums_cuda(const at::Tensor& x, const ConvGeometry& g) {
  const int64_t x_bytes = x.element_size();
  const int64_t per_plane = box_smem_doubles(g, 1, x_bytes) - g.taps();
  const int64_t planes = std::min<int64_t>(g.in_size[0], (kSmemBytes / 8 - g.taps() - 1) / per_plane);
  if (planes < 1 || g.batch * g.in_channels >= (int64_t(1) << 31)) return {};
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({g.batch, g.in_channels, g.taps()}, x.options().dtype(at::kDouble));
  if (out.numel() == 0) return out;
  BoxPlan plan;
  for (int d = 0; d < 5; ++d) plan.x_stride[d] = x.stride(d);
  plan.planes = static_cast<int>(planes);
  plan.row_stride = static_cast<int>(g.in_size[2] + 1);
  const size_t smem = static_cast<size_t>(box_smem_doubles(g, planes, x_bytes) * 8);
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "box_sums_cuda", [&] {
    box_sums_kernel<scalar_t><<<static_cast<unsigned>(g.batch * g.in_channels), kThreads, smem, stream>>>(
        x.data_ptr<scalar_t>(), g, plan, out.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace fused_ops
