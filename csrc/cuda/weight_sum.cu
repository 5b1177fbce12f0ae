// Per-(ci, co) sums of the weight over its taps (docs/math.md §2). Rows are
// short (the taps of one kernel), so one warp sums one row.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/warp/warp_reduce.cuh>

#include "cuda/kernels.h"

namespace fused_ops {
namespace {

constexpr int kWarps = 8;

template <typename scalar_t>
__global__ void __launch_bounds__(kWarps * 32)
    weight_sum_kernel(const scalar_t* __restrict__ w, int64_t rows, int64_t len,
                      double* __restrict__ out) {
  using WarpReduce = cub::WarpReduce<double>;
  __shared__ typename WarpReduce::TempStorage tmp[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= rows) return;  // whole warps leave together
  double acc = 0;
  for (int64_t k = lane; k < len; k += 32) acc += static_cast<double>(w[row * len + k]);
  const double total = WarpReduce(tmp[warp]).Sum(acc);
  if (lane == 0) out[row] = total;
}

}  // namespace

at::Tensor weight_sum_cuda(const at::Tensor& weight) {
  const c10::cuda::CUDAGuard guard(weight.device());
  const int64_t rows = weight.size(0) * weight.size(1);
  const int64_t len = weight.size(2) * weight.size(3) * weight.size(4);
  auto out = at::empty({weight.size(0), weight.size(1), 1}, weight.options().dtype(at::kDouble));
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: weight has too many rows for one launch");
  AT_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "weight_sum_cuda", [&] {
    weight_sum_kernel<scalar_t><<<blocks, kWarps * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
        weight.data_ptr<scalar_t>(), rows, len, out.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace fused_ops
