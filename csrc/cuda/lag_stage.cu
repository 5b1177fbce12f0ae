// The cross-spectrum path's H and D stages (docs/math.md §3.5): one dim of
// frequencies reduced to lags, out[a, m, c] (+)= sum_f coef[f, m] q[a, f, c], with
// few lags (2k' - 1) and many columns c (lags of the dims already reduced times
// channel pairs). As a GEMM its M is the lag count, too small for cuBLAS's complex
// kernels (zgemm1x1 took 0.33 ms per seed call, docs/performance.md); it is a
// stream over q instead: one thread per (a, c) holds its column's lags in registers
// and reads q once per launch, coalesced along c.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cuda/kernels.h"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxLags = 9;  // per launch: 2k' - 1 for k' = 5 in one pass

struct StageArgs {
  const void* q;        // [outer, freqs, cols], complex of Tin
  const double2* coef;  // [freqs, lags_total]
  double2* out;         // [outer, lags_total, cols]
  int64_t outer, freqs, cols, lags_total, lag0, lags;
  bool accumulate;
};

template <typename C>
__device__ __forceinline__ double2 widen(const C& v) {
  return double2{static_cast<double>(v.x), static_cast<double>(v.y)};
}

template <typename C, int kLags>
__global__ void __launch_bounds__(kThreads) lag_stage_kernel(StageArgs a) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= a.outer * a.cols) return;
  const int64_t outer = t / a.cols, col = t % a.cols;
  const C* __restrict__ q = static_cast<const C*>(a.q) + outer * a.freqs * a.cols + col;
  double2 acc[kLags];
#pragma unroll
  for (int m = 0; m < kLags; ++m) acc[m] = double2{0, 0};
  // Not unrolled: with four iterations' loads in flight (91 registers, half the blocks
  // per SM) the seed problem's H stage took 89 us per launch against 73 (docs/performance.md).
#pragma unroll 1
  for (int64_t f = 0; f < a.freqs; ++f) {
    const double2 v = widen(q[f * a.cols]);
    const double2* c = a.coef + f * a.lags_total + a.lag0;
#pragma unroll
    for (int m = 0; m < kLags; ++m) {
      if (m < a.lags) {
        const double2 w = __ldg(c + m);  // the same for every thread: a broadcast
        acc[m].x += w.x * v.x - w.y * v.y;
        acc[m].y += w.x * v.y + w.y * v.x;
      }
    }
  }
  double2* out = a.out + (outer * a.lags_total + a.lag0) * a.cols + col;
#pragma unroll
  for (int m = 0; m < kLags; ++m) {
    if (m < a.lags) {
      double2& o = out[m * a.cols];
      o = a.accumulate ? double2{o.x + acc[m].x, o.y + acc[m].y} : acc[m];
    }
  }
}

template <typename C>
void launch_stage(const StageArgs& a) {
  const int64_t blocks = (a.outer * a.cols + kThreads - 1) / kThreads;
  const auto stream = at::cuda::getCurrentCUDAStream();
  // The smallest register budget that holds the launch's lags.
  if (a.lags <= 3) {
    lag_stage_kernel<C, 3><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  } else if (a.lags <= 5) {
    lag_stage_kernel<C, 5><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  } else {
    lag_stage_kernel<C, kMaxLags><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void lag_stage_cuda(const at::Tensor& q, const at::Tensor& coef, at::Tensor& out, bool accumulate) {
  const c10::cuda::CUDAGuard guard(q.device());
  const bool is_double = q.scalar_type() == at::kComplexDouble;
  TORCH_CHECK(is_double || q.scalar_type() == at::kComplexFloat,
              "ct_bn_pool: lag_stage_cuda takes complex64 or complex128 values");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.is_contiguous() && out.is_contiguous() &&
                  out.scalar_type() == at::kComplexDouble && coef.scalar_type() == at::kComplexDouble &&
                  coef.is_contiguous() && coef.size(0) == q.size(1) &&
                  out.size(0) == q.size(0) && out.size(1) == coef.size(1) && out.size(2) == q.size(2),
              "ct_bn_pool: lag_stage_cuda: inconsistent shapes or layouts");
  StageArgs a;
  a.q = q.data_ptr();
  a.coef = reinterpret_cast<const double2*>(coef.data_ptr());
  a.out = reinterpret_cast<double2*>(out.data_ptr());
  a.outer = q.size(0);
  a.freqs = q.size(1);
  a.cols = q.size(2);
  a.lags_total = coef.size(1);
  a.accumulate = accumulate;
  const int64_t blocks = (a.outer * a.cols + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: problem too large for the lag stage (",
              to_str(a.outer * a.cols), " columns)");
  for (a.lag0 = 0; a.lag0 < a.lags_total; a.lag0 += kMaxLags) {
    a.lags = std::min<int64_t>(kMaxLags, a.lags_total - a.lag0);
    if (is_double) {
      launch_stage<double2>(a);
    } else {
      launch_stage<float2>(a);
    }
  }
}

}  // namespace fused_ops
