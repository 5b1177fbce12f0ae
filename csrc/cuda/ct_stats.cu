// Conv-transpose statistics, direct algorithm (docs/math.md §3.1): computes the
// conv-transpose output tile by tile in registers and reduces each sample's
// centred sum of squares; the [B, Co, Do, Ho, Wo] output is never written.
#include <ATen/AccumulateType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cub/block/block_reduce.cuh>

#include "conv_transpose_point.h"
#include "cuda/dynamic_smem.h"
#include "cuda/kernels.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int CT = kDirectTile;

// Block (unit, split): sample b, one tile of CT channels of one group, and one
// contiguous range of output positions. Partial energies of the splits share the
// same shift (the sample mean), so they add up in the finalize step.
// kStaged: the block first copies the sample's group of x and the tile's weights into
// shared memory. On small problems each thread gathers only a few output positions,
// and from global memory every tap waits a full load latency: 69 us for the `odd`
// bench problem, 33 us staged (docs/performance.md, 2026-11-30 16:05-16:39 UTC).
template <typename scalar_t, bool kStaged>
__global__ void __launch_bounds__(kThreads)
    energy_direct_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ packed,
                         const SampleSums sums, const ConvGeometry g, int64_t co_pad,
                         double* __restrict__ energy) {
  using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
  const int64_t tiles = co_pad / CT, cog = g.out_group_channels(), n_out = g.out_spatial();
  const int64_t unit = blockIdx.x, splits = gridDim.y, split = blockIdx.y;
  const int64_t tile = unit % tiles, group = (unit / tiles) % g.groups, b = unit / (tiles * g.groups);
  const int64_t co0 = tile * CT;

  __shared__ acc_t shift[CT];
  if (threadIdx.x < CT) {
    const int64_t co_g = co0 + threadIdx.x;
    shift[threadIdx.x] = co_g < cog ? static_cast<acc_t>(sums.conv_sum(b, group * cog + co_g) / n_out)
                                    : acc_t(0);
  }
  __syncthreads();

  const scalar_t* x_group = x + (b * g.in_channels + group * g.in_group_channels()) * g.in_spatial();
  const scalar_t* w_tile = packed + group * g.in_group_channels() * g.taps() * co_pad + co0;
  int64_t w_stride = co_pad;  // between the taps of w_tile
  if constexpr (kStaged) {
    extern __shared__ __align__(16) unsigned char stage_bytes[];
    scalar_t* x_stage = reinterpret_cast<scalar_t*>(stage_bytes);
    const int64_t x_count = g.in_group_channels() * g.in_spatial();
    scalar_t* w_stage = x_stage + x_count;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < x_count; i += kThreads) x_stage[i] = x_group[i];
    const int64_t w_rows = g.in_group_channels() * g.taps();  // (ci, tap) rows of CT weights
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < w_rows * CT; i += kThreads) w_stage[i] = w_tile[(i / CT) * co_pad + i % CT];
    __syncthreads();
    x_group = x_stage;
    w_tile = w_stage;
    w_stride = CT;
  }
  const int64_t begin = n_out * split / splits, end = n_out * (split + 1) / splits;
  acc_t e[CT];
#pragma unroll
  for (int j = 0; j < CT; ++j) e[j] = acc_t(0);
  for (int64_t o = begin + threadIdx.x; o < end; o += kThreads) {
    const int64_t ow = o % g.out_size[2], oh = (o / g.out_size[2]) % g.out_size[1],
                  od = o / (g.out_size[2] * g.out_size[1]);
    acc_t y[CT];
    conv_transpose_point<CT>(x_group, w_tile, g, w_stride, od, oh, ow, y);
#pragma unroll
    for (int j = 0; j < CT; ++j) {
      const acc_t d = y[j] - shift[j];
      e[j] += d * d;
    }
  }

  using BlockReduce = cub::BlockReduce<acc_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage tmp;
#pragma unroll
  for (int j = 0; j < CT; ++j) {
    const acc_t total = BlockReduce(tmp).Sum(e[j]);
    if (threadIdx.x == 0 && co0 + j < cog) {
      energy[(b * g.out_channels + group * cog + co0 + j) * splits + split] = total;
    }
    __syncthreads();  // tmp is reused
  }
}

int64_t direct_stage_bytes(const ConvGeometry& g, int64_t element_size) {
  return (g.in_spatial() + g.taps() * CT) * g.in_group_channels() * element_size;
}

}  // namespace

at::Tensor energy_direct_cuda(const at::Tensor& x, const at::Tensor& packed,
                              const SampleSumTensors& sums, const ConvGeometry& g) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t co_pad = packed.size(3), units = g.batch * g.groups * (co_pad / CT);
  TORCH_CHECK(units < (int64_t(1) << 31), "ct_bn_pool: problem too large for the direct kernel");
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // Split the output positions until there are a few blocks per multiprocessor.
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(65535, g.out_spatial() / kThreads));
  const int64_t splits = std::min(max_splits, std::max<int64_t>(1, (4 * sms + units - 1) / units));
  auto energy = at::empty({g.batch, g.out_channels, splits}, x.options().dtype(at::kDouble));
  const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(splits));
  const int64_t stage_need = direct_stage_bytes(g, x.element_size());
  const bool staged = stage_need <= dynamic_smem_limit();
  const size_t stage_bytes = staged ? static_cast<size_t>(stage_need) : 0;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "energy_direct_cuda", [&] {
    auto kernel = staged ? energy_direct_kernel<scalar_t, true> : energy_direct_kernel<scalar_t, false>;
    allow_dynamic_smem(kernel, static_cast<int64_t>(stage_bytes));
    kernel<<<grid, kThreads, stage_bytes, stream>>>(x.data_ptr<scalar_t>(), packed.data_ptr<scalar_t>(),
                                                    sums.view(g), g, co_pad, energy.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return energy;
}

}  // namespace fused_ops
