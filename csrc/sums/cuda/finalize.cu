// BN finalize (docs/math.md §3-§4): one block per output channel reduces the
// per-sample means and energies to the batch statistics, updates the running
// stats and writes the pooled output. In eval mode it is the only kernel after
// the reduction launch, so the tiny [B, Ci] x [Ci, Co] contraction happens here,
// one warp per sample (a single thread per dot product would leave the whole
// kernel waiting on one chain of dependent loads). It is launched overlapping
// the reduction (pdl.cuh): its blocks are scheduled as the reduction's blocks
// retire, instead of after a launch gap.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/block/block_reduce.cuh>
#include <cub/warp/warp_reduce.cuh>

#include "sums/cuda/sums_kernels.h"
#include "sums/finalize_args.h"
#include "common/cuda/pdl.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;

constexpr int kWarps = kThreads / 32;

// sample_sums: [Co, B] scratch for this channel's per-sample conv sums.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    bn_finalize_kernel(const FinalizeArgs<scalar_t> a, double* __restrict__ sample_sums) {
  const int64_t c = blockIdx.x;
  pdl_wait();  // everything the kernels before wrote is visible from here on
  const double energy = energy_part(a, c, threadIdx.x, kThreads);
  double* sums = sample_sums + c * a.batch;
  using WarpReduce = cub::WarpReduce<double>;
  __shared__ typename WarpReduce::TempStorage warp_tmp[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (a.sample_sums) {
    for (int64_t b = threadIdx.x; b < a.batch; b += kThreads) sums[b] = a.sample_sums[b * a.channels + c];
  } else {
    for (int64_t b = warp; b < a.batch; b += kWarps) {
      const double s = WarpReduce(warp_tmp[warp]).Sum(a.sums.conv_sum_part(b, c, lane, 32));
      if (lane == 0) sums[b] = s;
    }
  }
  __syncthreads();

  using BlockReduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename BlockReduce::TempStorage tmp;
  __shared__ double total;
  auto block_sum = [&](double v) {
    const double s = BlockReduce(tmp).Sum(v);
    if (threadIdx.x == 0) total = s;
    __syncthreads();
    const double result = total;
    __syncthreads();  // tmp and total are reused by the next call
    return result;
  };
  finalize_channel(
      a, c, threadIdx.x, kThreads, energy, [&](int64_t b) { return sums[b]; }, block_sum);
}

}  // namespace

void finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  TORCH_CHECK(g.out_channels < (int64_t(1) << 31), "ct_bn_pool: too many output channels");
  auto sample_sums = at::empty({g.out_channels, g.batch}, out.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "bn_finalize_cuda", [&] {
    launch_overlapping(bn_finalize_kernel<scalar_t>, dim3(static_cast<unsigned>(g.out_channels)),
                       dim3(kThreads), at::cuda::getCurrentCUDAStream(),
                       finalize_args<scalar_t>(in, g, out), sample_sums.data_ptr<double>());
  });
}

}  // namespace fused_ops
