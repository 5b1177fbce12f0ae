// The cross-spectrum path's W and D stages (docs/math.md §3.5): one dim of
// frequencies reduced to the DFT of its lags, out[a, m, c] (+)= sum_f coef[f, m] q[a, f, c],
// with few outputs m (2k' - 1, called lags below) and many columns c (those of the dims
// already reduced times channel pairs). As a GEMM its M is the lag count, too small for cuBLAS's complex
// kernels (docs/performance.md); it is a
// stream over q instead: one thread per (a, c) holds its column's lags in registers
// and reads q once per launch, coalesced along c.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cross_spectrum/cuda/cross_spectrum_kernels.h"
#include "common/cuda/pdl.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxLags = 9;  // per launch: 2k' - 1 for k' = 5 in one pass

struct StageArgs {
  const void* q;        // [outer, freqs, cols], complex of Tin
  const double* coef;   // [freqs, lags_total], real (lag_spectrum_phases)
  void* out;            // [outer, lags_total, cols], complex128, or complex64 where q is
  int64_t outer, freqs, cols, lags_total, lag0, lags;
  bool accumulate;
};

template <typename C>
__device__ __forceinline__ double2 widen(const C& v) {
  return double2{static_cast<double>(v.x), static_cast<double>(v.y)};
}
__device__ __forceinline__ double2 narrow_to(double2 v, double2) { return v; }
__device__ __forceinline__ float2 narrow_to(double2 v, float2) {
  return float2{static_cast<float>(v.x), static_cast<float>(v.y)};
}

// Q's loads are issued kAhead<C> frequencies before their use (32 bytes in flight per thread)
// and the coefficients are read from shared memory: with one load of Q in flight per thread,
// and the coefficients loaded beside it, the stage would spend most of its stalls waiting on
// them with DRAM far from busy (ncu, docs/performance.md). Deeper prefetching, several threads per
// column, Q transposed or in blocks of columns and the float64 tensor cores do no better on the
// seed shape; only a kernel compiled for the exact shape is faster
// (scripts/lag_stage_variants.cu at f692131). The coefficients are real, so each
// product is two DFMAs.
template <typename C>
constexpr int kAhead = 32 / sizeof(C);
constexpr int kFreqTile = 64;  // coefficients staged per pass: kFreqTile x kLags

// Cout: the sums' type as stored, float2 for the W stage of float32 spectra (its float64
// sums rounded once, as Q's are).
template <typename C, typename Cout, int kLags>
__global__ void __launch_bounds__(kThreads, 3) lag_stage_kernel(StageArgs a) {
  __shared__ double coef[kFreqTile][kLags];
  pdl_chain_start();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool active = t < a.outer * a.cols;  // every thread takes part in the staging
  const int64_t outer = active ? t / a.cols : 0, col = active ? t % a.cols : 0;
  const C* __restrict__ q = static_cast<const C*>(a.q) + outer * a.freqs * a.cols + col;
  double2 acc[kLags];
#pragma unroll
  for (int m = 0; m < kLags; ++m) acc[m] = double2{0, 0};
  C ahead[kAhead<C>];
#pragma unroll
  for (int k = 0; k < kAhead<C>; ++k) ahead[k] = active && k < a.freqs ? q[k * a.cols] : C{0, 0};
  for (int64_t f0 = 0; f0 < a.freqs; f0 += kFreqTile) {
    const int tile = static_cast<int>(a.freqs - f0 < kFreqTile ? a.freqs - f0 : kFreqTile);
    // The tile's rows rounded up to whole rounds of kAhead, zero past its frequencies: the
    // inner loop then has no exit in the middle (with one, ptxas moves the sums to local
    // memory around it).
    const int rows = (tile + kAhead<C> - 1) / kAhead<C> * kAhead<C>;
    __syncthreads();  // the previous tile's coefficients are no longer read
    for (int i = threadIdx.x; i < rows * kLags; i += kThreads) {
      const int f = i / kLags, m = i % kLags;
      coef[f][m] = m < a.lags && f < tile ? a.coef[(f0 + f) * a.lags_total + a.lag0 + m] : 0.0;
    }
    __syncthreads();
    for (int k0 = 0; k0 < rows; k0 += kAhead<C>) {
#pragma unroll
      for (int k = 0; k < kAhead<C>; ++k) {
        const int64_t f = f0 + k0 + k;
        const double2 v = widen(ahead[k]);
        ahead[k] = active && f + kAhead<C> < a.freqs ? q[(f + kAhead<C>) * a.cols] : C{0, 0};
#pragma unroll
        for (int m = 0; m < kLags; ++m) {
          acc[m].x = fma(coef[k0 + k][m], v.x, acc[m].x);
          acc[m].y = fma(coef[k0 + k][m], v.y, acc[m].y);
        }
      }
    }
  }
  if (!active) return;
  Cout* out = static_cast<Cout*>(a.out) + (outer * a.lags_total + a.lag0) * a.cols + col;
#pragma unroll
  for (int m = 0; m < kLags; ++m) {
    if (m < a.lags) {
      Cout& o = out[m * a.cols];
      o = narrow_to(a.accumulate ? double2{o.x + acc[m].x, o.y + acc[m].y} : acc[m], Cout{});
    }
  }
}

template <typename C, typename Cout>
void launch_stage(const StageArgs& a) {
  const int64_t blocks = (a.outer * a.cols + kThreads - 1) / kThreads;
  const auto stream = at::cuda::getCurrentCUDAStream();
  // The smallest register budget that holds the launch's lags.
  if (a.lags <= 3) {
    launch_overlapping(lag_stage_kernel<C, Cout, 3>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream, a);
  } else if (a.lags <= 5) {
    launch_overlapping(lag_stage_kernel<C, Cout, 5>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream, a);
  } else {
    launch_overlapping(lag_stage_kernel<C, Cout, kMaxLags>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                       stream, a);
  }
}

}  // namespace

void lag_stage_cuda(const at::Tensor& q, const at::Tensor& coef, at::Tensor& out, bool accumulate) {
  const c10::cuda::CUDAGuard guard(q.device());
  const bool is_double = q.scalar_type() == at::kComplexDouble;
  TORCH_CHECK(is_double || q.scalar_type() == at::kComplexFloat,
              "ct_bn_pool: lag_stage_cuda takes complex64 or complex128 values");
  const bool narrow_out = out.scalar_type() == at::kComplexFloat;
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.is_contiguous() && out.is_contiguous() &&
                  (out.scalar_type() == at::kComplexDouble || (narrow_out && !is_double && !accumulate)) &&
                  coef.scalar_type() == at::kDouble &&
                  coef.is_contiguous() && coef.size(0) == q.size(1) &&
                  out.size(0) == q.size(0) && out.size(1) == coef.size(1) && out.size(2) == q.size(2),
              "ct_bn_pool: lag_stage_cuda: inconsistent shapes or layouts");
  StageArgs a;
  a.q = q.data_ptr();
  a.coef = coef.data_ptr<double>();
  a.out = out.data_ptr();
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
      launch_stage<double2, double2>(a);
    } else if (narrow_out) {
      launch_stage<float2, float2>(a);
    } else {
      launch_stage<float2, double2>(a);
    }
  }
}

}  // namespace fused_ops
