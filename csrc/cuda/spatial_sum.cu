// The spatial-sum reduction (docs/math.md §2): per-(b, ci) sums of x over D, H,
// W. This is the only pass over x in eval mode, so it is written to run at
// memory bandwidth: 16-byte loads, kUnroll of them in flight per thread, one
// block per row (or per part of a row when there are too few rows to fill the
// GPU), double accumulation. The weight sums come from the launch before
// (weight_sum.cu), which this one overlaps (pdl.cuh).
//
// In eval mode the BN finalize runs in this launch's tail: each sample's
// outputs depend on that sample's x sums only (§4), so the last block to finish
// a sample computes its outputs, and no launch, nor a wait for the whole grid
// to drain, follows the pass over x.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cub/block/block_reduce.cuh>

#include "cuda/kernels.h"
#include "cuda/pdl.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename scalar_t>
struct Vec16;  // 16 bytes of scalar_t
template <>
struct Vec16<float> {
  using type = float4;
  static constexpr int n = 4;
  __device__ static double sum(const float4& v) {
    return (double(v.x) + double(v.y)) + (double(v.z) + double(v.w));
  }
};
template <>
struct Vec16<double> {
  using type = double2;
  static constexpr int n = 2;
  __device__ static double sum(const double2& v) { return v.x + v.y; }
};

// What the eval-mode tail needs: the finalize's inputs and, per sample, a count
// of the blocks that have written their sums (zeroed by the weight-sum launch).
template <typename scalar_t>
struct EvalTail {
  FinalizeArgs<scalar_t> args;
  int* done;
  int64_t blocks_per_sample;
};

// Sum of part (block % parts) of row (block / parts) of x viewed as [rows, len];
// a part is `chunk` elements, a multiple of the vector width.
template <typename scalar_t, bool kVector>
__device__ __forceinline__ double row_part_sum(const scalar_t* __restrict__ x, int64_t len,
                                               int64_t chunk, int64_t parts, int64_t block) {
  using V = Vec16<scalar_t>;
  const int64_t row = block / parts, begin = (block % parts) * chunk;
  const int64_t end = std::min(len, begin + chunk);
  const scalar_t* p = x + row * len;
  double acc = 0;
  if (kVector) {
    const auto* pv = reinterpret_cast<const typename V::type*>(p);
    const int64_t vend = end / V::n;
    for (int64_t i = begin / V::n + threadIdx.x; i < vend; i += kThreads * kUnroll) {
      typename V::type v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = i + u * kThreads;
        v[u] = k < vend ? __ldg(pv + k) : typename V::type{};
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) acc += V::sum(v[u]);
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) acc += static_cast<double>(p[i]);
  }
  using BlockReduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename BlockReduce::TempStorage tmp;
  return BlockReduce(tmp).Sum(acc);  // valid in thread 0
}

// Whether this block is the last of its sample to have written its sum; the
// sums of the sample's other blocks are visible to it when it is.
__device__ __forceinline__ bool last_block_of_sample(int* done, int64_t blocks_per_sample) {
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();  // this block's sum is visible to whichever block turns out last
    last = atomicAdd(done, 1) == blocks_per_sample - 1;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// Sample b's pooled outputs, one thread per channel: each thread's loads (its
// weight sums, its BN parameters) are independent of the other threads', so
// the block waits for about two rounds of loads rather than one per channel.
// Not inlined: it runs in one block per sample, and its registers must not
// crowd the pass over x.
template <typename scalar_t>
__device__ __noinline__ void finalize_sample(const FinalizeArgs<scalar_t>& a, int64_t b) {
  for (int64_t c = threadIdx.x; c < a.channels; c += kThreads) {
    write_pooled(a, eval_channel_norm(a, c), b, c, a.sums.conv_sum(b, c));
  }
}

// Eight blocks per SM (32 registers): a grid of 1024 rows, as in the seed
// problem, then runs as one wave on a 132-SM GPU rather than one and a bit.
template <typename scalar_t, bool kVector, bool kEvalTail>
__global__ void __launch_bounds__(kThreads, 8)
    spatial_sum_kernel(const scalar_t* __restrict__ x, int64_t len, int64_t chunk, int64_t parts,
                       double* __restrict__ out,
                       const __grid_constant__ EvalTail<scalar_t> tail) {
  pdl_launch_dependents();
  const int64_t block = blockIdx.x;
  const double total = row_part_sum<scalar_t, kVector>(x, len, chunk, parts, block);
  if (threadIdx.x == 0) out[block] = total;
  // The weight-sum launch is complete from here on: its sums and zeroed counts
  // are visible, and this launch cannot complete before it.
  pdl_wait();
  if constexpr (kEvalTail) {
    const int64_t b = block / tail.blocks_per_sample;
    if (last_block_of_sample(tail.done + b, tail.blocks_per_sample)) finalize_sample(tail.args, b);
  }
}

// How x's rows are split over blocks.
struct SpatialSumPlan {
  int64_t rows, len, parts, chunk, blocks;
  bool vector;
};

SpatialSumPlan plan_spatial_sum(const at::Tensor& x) {
  SpatialSumPlan p;
  p.rows = x.size(0) * x.size(1);
  p.len = x.size(2) * x.size(3) * x.size(4);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int vec = 16 / static_cast<int>(x.element_size());
  // Enough rows fill the GPU with one block each; fewer rows are split into
  // parts of at least one vector per thread.
  p.parts = 1;
  if (p.rows < 4 * sms) {
    const int64_t most = std::max<int64_t>(1, p.len / (kThreads * vec));
    p.parts = std::min(most, (8 * sms + p.rows - 1) / p.rows);
  }
  p.chunk = (p.len + p.parts - 1) / p.parts;
  p.chunk = (p.chunk + vec - 1) / vec * vec;
  p.parts = (p.len + p.chunk - 1) / p.chunk;
  p.blocks = p.rows * p.parts;
  TORCH_CHECK(p.blocks < (int64_t(1) << 31), "ct_bn_pool: x has too many (batch, channel) rows (",
              to_str(p.rows), ") for one launch");
  p.vector = p.len % vec == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  return p;
}

// The weight sums, then the pass over x (with the eval tail when `finalize` is given).
SampleSumTensors launch_sample_sums(const at::Tensor& x, const at::Tensor& weight,
                                    const FinalizeInputs* finalize, const ConvGeometry* g,
                                    at::Tensor* pooled) {
  const c10::cuda::CUDAGuard guard(x.device());
  const SpatialSumPlan p = plan_spatial_sum(x);
  const auto dopts = x.options().dtype(at::kDouble);
  SampleSumTensors sums{at::empty({x.size(0), x.size(1), p.parts}, dopts),
                        at::empty({weight.size(0), weight.size(1), 1}, dopts)};
  at::Tensor done;
  if (finalize) done = at::empty({x.size(0)}, x.options().dtype(at::kInt));
  weight_sums_cuda(weight, sums.w_red, finalize ? &done : nullptr);
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "spatial_sum_cuda", [&] {
    EvalTail<scalar_t> tail{};
    if (finalize) {
      FinalizeInputs in = *finalize;
      in.sums = sums;
      tail = {finalize_args<scalar_t>(in, *g, *pooled), done.data_ptr<int>(), x.size(1) * p.parts};
    }
    auto launch = [&](auto kernel) {
      launch_overlapping(kernel, dim3(static_cast<unsigned>(p.blocks)), dim3(kThreads), stream,
                         x.data_ptr<scalar_t>(), p.len, p.chunk, p.parts,
                         sums.x_red.data_ptr<double>(), tail);
    };
    if (finalize) {
      p.vector ? launch(spatial_sum_kernel<scalar_t, true, true>)
               : launch(spatial_sum_kernel<scalar_t, false, true>);
    } else {
      p.vector ? launch(spatial_sum_kernel<scalar_t, true, false>)
               : launch(spatial_sum_kernel<scalar_t, false, false>);
    }
  });
  return sums;
}

}  // namespace

SampleSumTensors sample_sums_cuda(const at::Tensor& x, const at::Tensor& weight) {
  return launch_sample_sums(x, weight, nullptr, nullptr, nullptr);
}

void eval_pooled_cuda(const at::Tensor& x, const at::Tensor& weight, const FinalizeInputs& in,
                      const ConvGeometry& g, at::Tensor& out) {
  launch_sample_sums(x, weight, &in, &g, &out);
}

}  // namespace fused_ops
