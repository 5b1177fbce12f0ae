// The reductions behind the per-sample sums (docs/math.md §2), in one launch:
// per-(b, ci) sums of x over D, H, W and the weight sums (weight_sums.cuh), a
// few rows per block, for x whose positions are adjacent in memory (contiguous x
// and its slices along B or Ci; sums/cuda/sums_kernels.h). Training mode's sums (but on the spectral paths,
// whose pass over x for its spectrum takes x's, x_spectrum_dft.cu: there the weight's sums
// alone, weight_sums_cuda), and eval mode's where eval_x_sums.cu does not apply
// (backend_cuda.cpp). Written to run at memory bandwidth: 16-byte loads, kUnroll of them in
// flight per thread, one block per row (or per part of a row when there are too few rows to
// fill the GPU), double accumulation.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cub/block/block_reduce.cuh>
#include <tuple>

#include "sums/cuda/sums_kernels.h"
#include "common/cuda/pdl.cuh"
#include "common/cuda/vec16.cuh"
#include "sums/cuda/weight_sums.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// Block i sums part (i % parts) of row (i / parts) of x viewed as [B * Ci, len],
// row (b, ci) starting at element b * layout.batch + ci * layout.channel, then
// its share of the weight rows; a part is `chunk` elements, a multiple of the
// vector width.
template <typename scalar_t, bool kVector>
__global__ void __launch_bounds__(kThreads)
    spatial_sum_kernel(const scalar_t* __restrict__ x, const SampleLayout layout, int64_t channels,
                       int64_t len, int64_t chunk, int64_t parts, double* __restrict__ out,
                       const scalar_t* __restrict__ w, const WeightRows w_rows) {
  using V = Vec16<scalar_t>;
  pdl_launch_dependents();  // the finalize may be scheduled as soon as blocks retire
  const int64_t block = blockIdx.x;
  const int64_t row = block / parts, begin = (block % parts) * chunk;
  const int64_t end = std::min(len, begin + chunk);
  const scalar_t* p = x + (row / channels) * layout.batch + (row % channels) * layout.channel;
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
  const double total = BlockReduce(tmp).Sum(acc);
  if (threadIdx.x == 0) out[block] = total;
  weight_block_share<scalar_t, kThreads / 32>(w, w_rows, block);
}

// The weight's rows alone, a warp each (weight_row_sums): where x's sums come from its
// spectrum's pass (SampleSumTensors::x_red_from_spectrum) and no pass over x takes them.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    weight_sum_kernel(const scalar_t* __restrict__ w, int64_t rows, int64_t len, double* __restrict__ out) {
  constexpr int kWarps = kThreads / 32;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kWarps;
  weight_row_sums<scalar_t, kWarps>(w, len, begin, std::min(rows, begin + kWarps), out);
}

}  // namespace

at::Tensor weight_sums_cuda(const at::Tensor& weight) {
  const c10::cuda::CUDAGuard guard(weight.device());
  TORCH_CHECK(weight.is_contiguous(), "ct_bn_pool: weight_sums_cuda takes a contiguous weight");
  const int64_t rows = weight.size(0) * weight.size(1), taps = weight.size(2) * weight.size(3) * weight.size(4);
  auto out = at::empty({weight.size(0), weight.size(1), 1}, weight.options().dtype(at::kDouble));
  const int64_t blocks = (rows + kThreads / 32 - 1) / (kThreads / 32);
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: weight too large for one launch (", rows, " rows)");
  if (blocks == 0) return out;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "weight_sums_cuda", [&] {
    weight_sum_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(weight.data_ptr<scalar_t>(), rows, taps,
                                                                 out.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

SampleSumTensors sample_sums_cuda(const at::Tensor& x, const SampleLayout& layout,
                                  const at::Tensor& weight) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0) * x.size(1), len = x.size(2) * x.size(3) * x.size(4);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int vec = 16 / static_cast<int>(x.element_size());
  // Enough rows fill the GPU with one block each; fewer rows are split into
  // parts of at least one vector per thread.
  int64_t parts = 1;
  if (rows < 4 * sms) {
    const int64_t most = std::max<int64_t>(1, len / (kThreads * vec));
    parts = std::min(most, (8 * sms + rows - 1) / rows);
  }
  int64_t chunk = (len + parts - 1) / parts;
  chunk = (chunk + vec - 1) / vec * vec;
  parts = (len + chunk - 1) / chunk;
  const int64_t blocks = rows * parts;
  SampleSumTensors sums;
  WeightRows w_rows;
  std::tie(sums, w_rows) = spatial_sum_outputs(x, weight, parts, blocks);
  const bool vector_ok = len % vec == 0 && layout.batch % vec == 0 && layout.channel % vec == 0 &&
                         reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sample_sums_cuda", [&] {
    auto kernel = vector_ok ? spatial_sum_kernel<scalar_t, true> : spatial_sum_kernel<scalar_t, false>;
    kernel<<<blocks, kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), layout, x.size(1), len, chunk,
                                            parts, sums.x_red.data_ptr<double>(),
                                            weight.data_ptr<scalar_t>(), w_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return sums;
}

}  // namespace fused_ops
