// Eval mode's pass over x (docs/math.md §2.1): the per-(b, ci) sums of x over D, H,
// W and nothing else, for x whose positions are adjacent in memory (sums_kernels.h). The
// weight sums are left to the finalize (eval_finalize.cu), which reads the weight
// before its pdl_wait while this pass runs: that keeps the weight off the critical
// path (docs/dispatch.md, "Kernel routes"; V2/V5 of scripts/eval_variants.cu at f692131).
// Persistent blocks: the grid is what fits beside one finalize block per SM
// (co_resident.h), and the blocks take items (parts of rows) round robin.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cub/block/block_reduce.cuh>

#include "eval/cuda/eval_kernels.h"
#include "common/cuda/pdl.cuh"
#include "common/cuda/vec16.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 8;
// Each block takes about this many items, so that the items' uneven finish evens out.
constexpr int64_t kItemsPerBlock = 4;

// 48 registers (ptxas: no spills, all kUnroll loads in flight): 4 blocks per SM leave
// 16,384 registers, one 256-thread finalize block at 64 (eval_finalize.cu).
#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4))
#define FO_X_PASS_BOUNDS __maxnreg__(48)
#else  // no __maxnreg__: the grid sizing then finds fewer blocks per SM
#define FO_X_PASS_BOUNDS __launch_bounds__(kThreads)
#endif

// x viewed as [rows = B * Ci, len]; item i is part (i % parts) of row (i / parts),
// `chunk` elements (a multiple of the vector width on the vector path).
struct XPassPlan {
  int64_t channels, len, batch_stride, channel_stride;
  int64_t chunk, parts, items;
};

// This thread's share of the 16-byte vectors [begin, end) at p: whole rounds of
// kUnroll loads issued back to back, unguarded, then the rest one at a time. Left to
// itself ptxas starts adding the first vectors before it issues the last loads (fewer
// registers, about half the loads in flight); making every vector depend on all of
// them (their last words ANDed with `zero`, a runtime 0, XORed into the others) keeps
// all kUnroll in flight (the "forced" loads of scripts/eval_variants.cu at f692131).
template <typename scalar_t>
__device__ double vector_partial(const uint4* __restrict__ p, int64_t begin, int64_t end,
                                 unsigned zero) {
  double acc = 0;
  int64_t i = begin + threadIdx.x;
  for (; i + (kUnroll - 1) * kThreads < end; i += kThreads * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(p + i + u * kThreads);
    unsigned dep = zero;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dep &= v[u].w;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      v[u].x ^= dep;
      v[u].y ^= dep;
      v[u].z ^= dep;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc += sum_raw16<scalar_t>(v[u]);
  }
  for (; i < end; i += kThreads) acc += sum_raw16<scalar_t>(__ldg(p + i));
  return acc;
}

template <typename scalar_t>
__device__ double scalar_partial(const scalar_t* __restrict__ p, int64_t begin, int64_t end) {
  double acc = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) acc += static_cast<double>(p[i]);
  return acc;
}

template <typename scalar_t, bool kVector>
__global__ void FO_X_PASS_BOUNDS spatial_sum_x_kernel(const scalar_t* __restrict__ x,
                                                      const XPassPlan p, unsigned zero,
                                                      double* __restrict__ out) {
  using V = Vec16<scalar_t>;
  pdl_launch_dependents();  // every block has started: the finalize may take its room
  using BlockReduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename BlockReduce::TempStorage tmp;
  for (int64_t item = blockIdx.x; item < p.items; item += gridDim.x) {
    const int64_t row = item / p.parts, begin = (item % p.parts) * p.chunk;
    const int64_t end = std::min(p.len, begin + p.chunk);
    const scalar_t* r = x + (row / p.channels) * p.batch_stride + (row % p.channels) * p.channel_stride;
    const double acc =
        kVector ? vector_partial<scalar_t>(reinterpret_cast<const uint4*>(r), begin / V::n, end / V::n, zero)
                : scalar_partial(r, begin, end);
    const double total = BlockReduce(tmp).Sum(acc);
    if (threadIdx.x == 0) out[item] = total;
    __syncthreads();  // tmp is reused by the next item
  }
}

// Parts of whole rounds of loads (kThreads * kUnroll vectors; the seed problem gets
// 2 per row, as V2 of scripts/eval_variants.cu at f692131), enough items for kItemsPerBlock per block,
// at most kMaxEvalTerms / Cig parts (the finalize holds a weight sum per term; its
// tail after pdl_wait reads all Cig * J x sums of each sample).
XPassPlan plan_items(const at::Tensor& x, const SampleLayout& layout, int64_t vec,
                     int64_t in_group_channels, int64_t blocks) {
  XPassPlan p;
  p.channels = x.size(1);
  p.len = x.size(2) * x.size(3) * x.size(4);
  p.batch_stride = layout.batch;
  p.channel_stride = layout.channel;
  const int64_t rows = x.size(0) * p.channels;
  const int64_t most = std::min(ceil_div(p.len, kThreads * kUnroll * vec),
                                std::max<int64_t>(1, kMaxEvalTerms / in_group_channels));
  p.parts = std::clamp<int64_t>(ceil_div(kItemsPerBlock * blocks, rows), 1, std::max<int64_t>(1, most));
  p.chunk = ceil_div(ceil_div(p.len, p.parts), vec) * vec;
  p.parts = ceil_div(p.len, p.chunk);
  p.items = rows * p.parts;
  return p;
}

template <typename scalar_t, bool kVector>
void launch_x_pass(const at::Tensor& x, const SampleLayout& layout, int64_t in_group_channels,
                   const KernelFootprint& finalize, at::Tensor& x_red_out) {
  const auto kernel = spatial_sum_x_kernel<scalar_t, kVector>;
  const void* k = reinterpret_cast<const void*>(kernel);
  const int per_sm = blocks_per_sm_leaving_room(k, kernel_footprint(k, kThreads, 0), finalize);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t vec = kVector ? Vec16<scalar_t>::n : 1;
  const XPassPlan p = plan_items(x, layout, vec, in_group_channels, per_sm * sms);
  x_red_out = at::empty({x.size(0), x.size(1), p.parts}, x.options().dtype(at::kDouble));
  const int64_t grid = std::min<int64_t>(p.items, per_sm * sms);
  kernel<<<static_cast<unsigned>(grid), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<scalar_t>(), p, 0u, x_red_out.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

SampleSumTensors sample_sums_x_only_cuda(const at::Tensor& x, const SampleLayout& layout,
                                         int64_t in_group_channels,
                                         const KernelFootprint& finalize) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t vec = 16 / static_cast<int64_t>(x.element_size());
  const int64_t len = x.size(2) * x.size(3) * x.size(4);
  const bool vector_ok = len % vec == 0 && layout.batch % vec == 0 && layout.channel % vec == 0 &&
                         reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  SampleSumTensors sums;  // w_red stays undefined: the finalize sums the weight
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sample_sums_x_only_cuda", [&] {
    if (vector_ok) {
      launch_x_pass<scalar_t, true>(x, layout, in_group_channels, finalize, sums.x_red);
    } else {
      launch_x_pass<scalar_t, false>(x, layout, in_group_channels, finalize, sums.x_red);
    }
  });
  return sums;
}

}  // namespace fused_ops
