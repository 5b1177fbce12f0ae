// Each (sample, channel) row of the kept convolution output y: its sum and its centred sum of
// squares, accumulated in float64 in two passes (the mean first, then the squares about it),
// one block per row. The second pass reads the row again, mostly from L2: one launch and two
// reads of y, where the same as ATen ops (mean, difference, square, sum, conversions) is six
// launches and about five passes.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/block/block_reduce.cuh>

#include "kept/cuda/kept_kernels.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;

// This thread's sum of f(y[p]) over its positions of the row, kUnroll independent loads in
// flight (a few blocks may stream long rows alone: a batch of one, few channels).
template <typename T, typename F>
__device__ __forceinline__ double row_part(const T* __restrict__ r, int64_t positions, F f) {
  double acc[kUnroll] = {0, 0, 0, 0};
  int64_t p = threadIdx.x;
  for (; p + (kUnroll - 1) * kThreads < positions; p += kUnroll * kThreads) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc[u] += f(static_cast<double>(r[p + u * kThreads]));
  }
  for (; p < positions; p += kThreads) acc[0] += f(static_cast<double>(r[p]));
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    sample_moments_kernel(const T* __restrict__ y, int64_t positions, double* __restrict__ sums,
                          double* __restrict__ m2) {
  using BlockReduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename BlockReduce::TempStorage tmp;
  __shared__ double row_mean;
  const int64_t row = blockIdx.x;
  const T* r = y + row * positions;
  const double s = BlockReduce(tmp).Sum(row_part(r, positions, [](double v) { return v; }));
  if (threadIdx.x == 0) {
    sums[row] = s;
    row_mean = s / static_cast<double>(positions);
  }
  __syncthreads();  // row_mean is set, and tmp free again
  const double mean = row_mean;
  const double q = BlockReduce(tmp).Sum(row_part(r, positions, [mean](double v) {
    const double d = v - mean;
    return d * d;
  }));
  if (threadIdx.x == 0) m2[row] = q;
}

}  // namespace

std::pair<at::Tensor, at::Tensor> sample_moments_cuda(const at::Tensor& y) {
  const c10::cuda::CUDAGuard guard(y.device());
  TORCH_CHECK(y.is_contiguous(), "sample_moments_cuda: y must be contiguous");
  const int64_t batch = y.size(0), channels = y.size(1), rows = batch * channels;
  TORCH_CHECK(rows < (int64_t(1) << 31), "_ct_bn_pool_kept_stats: too many (sample, channel) rows");
  const auto opts = y.options().dtype(at::kDouble);
  at::Tensor sums = at::empty({batch, channels}, opts);
  at::Tensor m2 = at::empty({batch, channels, 1}, opts);
  if (rows == 0) return {sums, m2};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "sample_moments_cuda", [&] {
    sample_moments_kernel<scalar_t><<<static_cast<unsigned>(rows), kThreads, 0,
                                      at::cuda::getCurrentCUDAStream()>>>(
        y.const_data_ptr<scalar_t>(), y.numel() / rows, sums.data_ptr<double>(), m2.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {sums, m2};
}

}  // namespace fused_ops
