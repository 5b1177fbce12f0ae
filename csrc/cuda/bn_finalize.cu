// BN finalize (docs/math.md §3-§4): one block per output channel reduces the
// per-sample means and energies to the batch statistics, updates the running
// stats and writes the pooled output. In eval mode it is the only kernel after
// the two reductions, so the tiny [B, Ci] x [Ci, Co] contraction happens here.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/block/block_reduce.cuh>

#include "cuda/kernels.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 128;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) bn_finalize_kernel(const FinalizeArgs<scalar_t> a) {
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
  finalize_channel(a, blockIdx.x, threadIdx.x, kThreads, block_sum);
}

}  // namespace

void finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  TORCH_CHECK(g.out_channels < (int64_t(1) << 31), "ct_bn_pool: too many output channels");
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "bn_finalize_cuda", [&] {
    bn_finalize_kernel<scalar_t><<<g.out_channels, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        finalize_args<scalar_t>(in, g, out));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace fused_ops
