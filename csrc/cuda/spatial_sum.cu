// The reductions behind the per-sample sums (docs/math.md §2), in one launch:
// per-(b, ci) sums of x over D, H, W and the weight sums (weight_sum.cuh), a
// few rows per block. This is the only pass over x in eval mode, so it is written
// to run at memory bandwidth: 16-byte loads, kUnroll of them in flight per
// thread, one block per row (or per part of a row when there are too few rows to
// fill the GPU), double accumulation.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstring>
#include <cub/block/block_reduce.cuh>

#include "cuda/kernels.h"
#include "message.h"
#include "cuda/pdl.cuh"
#include "cuda/weight_sum.cuh"

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
// float16 and bfloat16: 8 values loaded as one uint4, each converted (exactly)
// to double and summed there.
template <typename half_t>
struct Vec16Of8 {
  using type = uint4;
  static constexpr int n = 8;
  __device__ static double sum(const uint4& v) {
    half_t h[8];
    memcpy(h, &v, sizeof(v));
    double pair[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) pair[k] = double(float(h[2 * k])) + double(float(h[2 * k + 1]));
    return (pair[0] + pair[1]) + (pair[2] + pair[3]);
  }
};
template <>
struct Vec16<at::Half> : Vec16Of8<at::Half> {};
template <>
struct Vec16<at::BFloat16> : Vec16Of8<at::BFloat16> {};

struct WeightRows {
  int64_t rows, len, per_block;
  double* out;
};

// Block i sums part (i % parts) of row (i / parts) of x viewed as [rows, len],
// then `per_block` rows of the weight; a part is `chunk` elements, a multiple of
// the vector width.
template <typename scalar_t, bool kVector>
__global__ void __launch_bounds__(kThreads)
    spatial_sum_kernel(const scalar_t* __restrict__ x, int64_t len, int64_t chunk, int64_t parts,
                       double* __restrict__ out, const scalar_t* __restrict__ w,
                       const WeightRows w_rows) {
  using V = Vec16<scalar_t>;
  pdl_launch_dependents();  // the finalize may be scheduled as soon as blocks retire
  const int64_t block = blockIdx.x;
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
  const double total = BlockReduce(tmp).Sum(acc);
  if (threadIdx.x == 0) out[block] = total;
  // Last, so that the loads of x start at once.
  const int64_t w_begin = std::min(w_rows.rows, block * w_rows.per_block);
  weight_row_sums<scalar_t, kThreads / 32>(w, w_rows.len, w_begin,
                                           std::min(w_rows.rows, w_begin + w_rows.per_block),
                                           w_rows.out);
}

}  // namespace

SampleSumTensors sample_sums_cuda(const at::Tensor& x, const at::Tensor& weight) {
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
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: x has too many (batch, channel) rows (",
              to_str(rows), ") for one launch");
  SampleSumTensors sums{at::empty({x.size(0), x.size(1), parts}, x.options().dtype(at::kDouble)),
                        at::empty({weight.size(0), weight.size(1), 1}, x.options().dtype(at::kDouble))};
  const int64_t w_rows = weight.size(0) * weight.size(1);
  const WeightRows w_out{w_rows, weight.size(2) * weight.size(3) * weight.size(4),
                         (w_rows + blocks - 1) / blocks, sums.w_red.data_ptr<double>()};
  const bool vector_ok = len % vec == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sample_sums_cuda", [&] {
    auto kernel = vector_ok ? spatial_sum_kernel<scalar_t, true> : spatial_sum_kernel<scalar_t, false>;
    kernel<<<blocks, kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), len, chunk, parts,
                                            sums.x_red.data_ptr<double>(),
                                            weight.data_ptr<scalar_t>(), w_out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return sums;
}

}  // namespace fused_ops
