// The kept route's per-channel gradient coefficients (kept/affine_grad.h): one thread per
// channel, its loads over the batch coalesced across the warp's channels.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "kept/affine_grad_args.h"
#include "kept/cuda/kept_kernels.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 128;

template <typename C>
__global__ void __launch_bounds__(kThreads) affine_grad_kernel(const AffineGradArgs<C> a) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c < a.channels) affine_grad_channel(a, c);
}

}  // namespace

void affine_grad_cuda(const AffineGradInputs& in) {
  const c10::cuda::CUDAGuard guard(in.grad_out.device());
  const int64_t channels = in.grad_out.size(1);
  if (channels == 0) return;
  const auto blocks = static_cast<unsigned>((channels + kThreads - 1) / kThreads);
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (in.grad_out.scalar_type() == at::kDouble) {
    affine_grad_kernel<double><<<blocks, kThreads, 0, stream>>>(affine_grad_args<double>(in));
  } else {
    affine_grad_kernel<float><<<blocks, kThreads, 0, stream>>>(affine_grad_args<float>(in));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fused_ops
