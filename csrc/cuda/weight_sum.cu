// The weight-sum precompute (docs/math.md §2): each weight[ci, co] summed over
// its taps, in a launch of its own ahead of the pass over x, which overlaps it
// (pdl.cuh) and waits for it only in its tail. The two share the SMs and the
// memory bus, so this launch is made short: a block copies a run of whole rows
// (contiguous in the weight) into shared memory with 16-byte loads, all in one
// round of loads, and only then does one warp sum each row. The x blocks that
// wait for SM slots behind it then start early enough to finish with the rest.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cub/warp/warp_reduce.cuh>

#include "cuda/kernels.h"
#include "cuda/pdl.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kStageBytes = 16 << 10;  // shared memory per block

struct WeightSumPlan {
  int64_t rows, len, rows_per_block, blocks;
  bool staged;  // rows go through shared memory (16-byte aligned runs that fit)
};

// Rows of w viewed as [rows, len]; also zeroes `counters` for the launch that follows.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    weight_sum_kernel(const scalar_t* __restrict__ w, const WeightSumPlan p,
                      double* __restrict__ out, int* __restrict__ counters, int64_t n_counters) {
  pdl_launch_dependents();
  if (blockIdx.x == 0) {
    for (int64_t i = threadIdx.x; i < n_counters; i += kThreads) counters[i] = 0;
  }
  __shared__ __align__(16) unsigned char stage_bytes[kStageBytes];
  auto* stage = reinterpret_cast<scalar_t*>(stage_bytes);
  const int64_t row0 = int64_t(blockIdx.x) * p.rows_per_block;
  const int64_t n_rows = std::min(p.rows_per_block, p.rows - row0);
  const scalar_t* src = w + row0 * p.len;
  if (p.staged) {
    // Every run but the last is whole vectors (plan_weight_sum); the last may end in a
    // partial one.
    constexpr int kVec = 16 / sizeof(scalar_t);
    const int64_t n = n_rows * p.len, n_vec = n / kVec;
    for (int64_t i = threadIdx.x; i < n_vec; i += kThreads) {
      reinterpret_cast<float4*>(stage)[i] = __ldg(reinterpret_cast<const float4*>(src) + i);
    }
    for (int64_t i = n_vec * kVec + threadIdx.x; i < n; i += kThreads) stage[i] = src[i];
    __syncthreads();
    src = stage;
  }
  using WarpReduce = cub::WarpReduce<double>;
  __shared__ typename WarpReduce::TempStorage tmp[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t r = warp; r < n_rows; r += kWarps) {
    double acc = 0;
    for (int64_t k = lane; k < p.len; k += 32) acc += static_cast<double>(src[r * p.len + k]);
    const double total = WarpReduce(tmp[warp]).Sum(acc);
    if (lane == 0) out[row0 + r] = total;
  }
}

WeightSumPlan plan_weight_sum(const at::Tensor& weight) {
  WeightSumPlan p;
  p.rows = weight.size(0) * weight.size(1);
  p.len = weight.size(2) * weight.size(3) * weight.size(4);
  const int64_t elt = weight.element_size(), vec = 16 / elt;
  // Runs of rows_per_block rows must be whole vectors and start aligned.
  const int64_t fit = kStageBytes / std::max<int64_t>(1, p.len * elt);
  int64_t per = fit;
  while (per > 0 && (per * p.len) % vec != 0) --per;
  p.staged = per > 0 && reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0;
  p.rows_per_block = p.staged ? per : kWarps;
  p.blocks = std::max<int64_t>(1, (p.rows + p.rows_per_block - 1) / p.rows_per_block);
  return p;
}

}  // namespace

void weight_sums_cuda(const at::Tensor& weight, at::Tensor& w_red, at::Tensor* counters) {
  const c10::cuda::CUDAGuard guard(weight.device());
  const WeightSumPlan p = plan_weight_sum(weight);
  TORCH_CHECK(p.blocks < (int64_t(1) << 31), "ct_bn_pool: weight has too many (C_in, C_out) rows (",
              to_str(p.rows), ") for one launch");
  AT_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "weight_sums_cuda", [&] {
    weight_sum_kernel<scalar_t><<<p.blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        weight.data_ptr<scalar_t>(), p, w_red.data_ptr<double>(),
        counters ? counters->data_ptr<int>() : nullptr, counters ? counters->numel() : 0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace fused_ops
