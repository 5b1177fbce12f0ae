// Eval mode's finalize when the x pass left the weight sums to it (eval_x_sums.cu;
// docs/math.md §2.1, §4; docs/dispatch.md, "Kernel routes"; V5 of scripts/eval_variants.cu at f692131).
// One block per output channel c, launched overlapping the x pass (pdl.cuh) on the room that
// pass leaves on every SM. Before pdl_wait it reads only what the x pass does not write: it
// sums its channel's weight column W[ci, c] (ci in c's group) into shared memory, one copy per
// partial sum of x (so that the tail indexes both alike), and folds the channel's BN map into
// out = S * alpha + delta (eval_affine), while x still streams. After the wait only S[b, c] =
// sum_{ci, j} x_red[b, ci, j] W[ci, c] remains: a few lanes per sample, one round of
// independent loads of the x sums, a butterfly across the lanes, one store per (b, c).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <type_traits>

#include "eval/cuda/eval_kernels.h"
#include "sums/finalize_args.h"
#include "common/cuda/pdl.cuh"
#include "common/cuda/reduce.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// 64 registers: a block fits beside 4 x-pass blocks of 48 (eval_x_sums.cu). The
// microbenchmark's V2/V5 (scripts/eval_variants.cu at f692131) split the SM as 4 x blocks of 56 and a
// finalize of 32, which this general-shape kernel cannot live with (it spills, or leaves the
// tail's loads in two rounds).
constexpr int kMinBlocksPerSm = 4;
// Loads of x sums in flight per lane in the tail.
constexpr int kBatch = 8;

// The finalize's dtype C for a weight (and x) of dtype T (ct_bn_pool.h, compute_dtype).
template <typename weight_t>
using compute_t = std::conditional_t<std::is_same<weight_t, double>::value, double, float>;

// wterm[ci * J + j] = sum of weight[group's ci, c's index in its group, :] (the taps
// are contiguous) for every part j, for the Cig input channels of channel c's group:
// term k of the contraction is x_red[.., k] * wterm[k]. A warp takes kRows rows at a
// time, and each lane issues all its kRows * kLoads predicated loads of a round before
// it adds any: a loop bounded by the runtime tap count leaves the lanes past the last
// whole round in a remainder loop, one load at a time, and the weight read (4 MB on the
// seed problem) then outlasts the x pass (ncu, docs/performance.md).
constexpr int kRows = 2;
constexpr int kLoads = 4;  // per lane and row in a round: 128 taps (k <= 5) in one round

template <typename weight_t>
__device__ void weight_column(const weight_t* __restrict__ w, const SampleSums& s, int64_t c,
                              int64_t taps, double* __restrict__ wterm) {
  const int64_t group = c / s.out_group_channels, co_g = c % s.out_group_channels;
  const int64_t row_stride = s.out_group_channels * taps;  // from input channel ci to ci + 1
  const weight_t* rows = w + (group * s.in_group_channels * s.out_group_channels + co_g) * taps;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t ci0 = warp; ci0 < s.in_group_channels; ci0 += kWarps * kRows) {
    double acc[kRows] = {};
    for (int64_t k0 = 0; k0 < taps; k0 += 32 * kLoads) {
      weight_t v[kRows][kLoads];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t ci = ci0 + r * kWarps;
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t k = k0 + lane + 32 * u;
          v[r][u] = ci < s.in_group_channels && k < taps ? rows[ci * row_stride + k] : weight_t(0);
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int u = 0; u < kLoads; ++u) acc[r] += static_cast<double>(v[r][u]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t ci = ci0 + r * kWarps;  // uniform across the warp, as warp_sum needs
      if (ci >= s.in_group_channels) break;
      const double sum = warp_sum(acc[r]);
      for (int64_t j = lane; j < s.parts; j += 32) wterm[ci * s.parts + j] = sum;
    }
  }
}

// Channel c's x sums: sample b's Cig * J partial sums start at x_red + b * stride
// (computed before the wait: the group's offset needs a 64-bit division).
struct ChannelSums {
  const double* x_red;  // sample 0's sums for c's group
  int64_t stride;       // Ci * J
  int terms;            // Cig * J <= kMaxEvalTerms
};

__device__ __forceinline__ ChannelSums channel_sums(const SampleSums& s, int64_t c) {
  const int64_t group = c / s.out_group_channels;
  return {s.x_red + group * s.in_group_channels * s.parts, s.in_channels * s.parts,
          static_cast<int>(s.in_group_channels * s.parts)};
}

// Lane g's share of sample b's contraction: terms g, g + kLanes, ... (adjacent lanes
// read adjacent sums), in the order of SampleSums::conv_sum_part(b, c, g, kLanes).
template <int kLanes>
__device__ __forceinline__ double contract_lane(const ChannelSums& cs, int64_t b,
                                                const double* __restrict__ wterm, int g) {
  const double* xr = cs.x_red + b * cs.stride;
  double sum = 0;
  // Whole batches unguarded, kBatch loads issued before the products (a plain loop,
  // even unrolled, waits for each load in turn); a compile-time kLanes makes their
  // addresses one pointer plus constants. The seed problem's lanes have 8 terms: one
  // batch, one L2 round trip. x_red is read through L2 (__ldcg): the x pass wrote it,
  // and L1 is not coherent with those writes.
  int k = g;
  for (; k + (kBatch - 1) * kLanes < cs.terms; k += kBatch * kLanes) {
    double v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) v[u] = __ldcg(xr + k + u * kLanes);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) sum += v[u] * wterm[k + u * kLanes];
  }
  for (; k < cs.terms; k += kLanes) sum += __ldcg(xr + k) * wterm[k];
  return sum;
}

// Channel c's outputs (after pdl_wait): kLanes lanes per sample (an aligned group of
// a warp), kThreads / kLanes samples per round; every thread runs the same rounds (b
// past the batch adds 0), so whole warps shuffle. Lane 0 of a group stores.
template <int kLanes, typename scalar_t>
__device__ void write_channel(const FinalizeArgs<scalar_t>& a, int64_t c, const ChannelSums& cs,
                              const double* __restrict__ wterm, const EvalAffine& affine) {
  const int g = threadIdx.x % kLanes;
  for (int64_t b0 = 0; b0 < a.batch; b0 += kThreads / kLanes) {
    const int64_t b = b0 + threadIdx.x / kLanes;
    const double sum = butterfly_sum<1, kLanes / 2>(b < a.batch ? contract_lane<kLanes>(cs, b, wterm, g) : 0.0);
    if (g == 0 && b < a.batch) {
      const double v = is_finite(sum * a.scale) ? sum * affine.alpha + affine.delta : NAN;  // as write_pooled
      a.out[b * a.channels + c] = static_cast<scalar_t>(v);
    }
  }
}

template <typename weight_t, typename scalar_t>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    eval_finalize_kernel(const FinalizeArgs<scalar_t> a, const weight_t* __restrict__ w,
                         int64_t taps, int lanes) {
  __shared__ double wterm[kMaxEvalTerms];
  __shared__ EvalAffine affine;
  const int64_t c = blockIdx.x;
  // Before the wait: nothing the x pass writes (pdl.cuh).
  weight_column(w, a.sums, c, taps, wterm);
  if (threadIdx.x == 0) affine = eval_affine(a, c);
  const ChannelSums cs = channel_sums(a.sums, c);
  __syncthreads();
  pdl_wait();  // x_red is complete and visible from here on
  switch (lanes) {  // uniform: a kernel argument
    case 32: write_channel<32>(a, c, cs, wterm, affine); break;
    case 16: write_channel<16>(a, c, cs, wterm, affine); break;
    case 8: write_channel<8>(a, c, cs, wterm, affine); break;
    case 4: write_channel<4>(a, c, cs, wterm, affine); break;
    case 2: write_channel<2>(a, c, cs, wterm, affine); break;
    default: write_channel<1>(a, c, cs, wterm, affine); break;
  }
}

// Lanes per sample: the largest power of two <= 32 that leaves every sample of a
// round its own lanes (kThreads / lanes samples per round), at least 1.
int lanes_per_sample(int64_t batch) {
  int lanes = 32;
  while (lanes > 1 && static_cast<int64_t>(lanes) * batch > kThreads) lanes /= 2;
  return lanes;
}

}  // namespace

KernelFootprint eval_finalize_footprint(at::ScalarType weight_dtype) {
  KernelFootprint f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight_dtype, "eval_finalize_footprint", [&] {
    const auto kernel = eval_finalize_kernel<scalar_t, compute_t<scalar_t>>;
    f = kernel_footprint(reinterpret_cast<const void*>(kernel), kThreads, 0);
  });
  return f;
}

void eval_finalize_cuda(const FinalizeInputs& in, const ConvGeometry& g, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  TORCH_CHECK(g.out_channels < (int64_t(1) << 31), "ct_bn_pool: too many output channels");
  TORCH_CHECK(in.weight.defined() && in.weight.is_contiguous() && !in.sums.w_red.defined() &&
                  g.in_group_channels() * in.sums.x_red.size(2) <= kMaxEvalTerms,
              "ct_bn_pool: internal error: eval finalize without its weight or with too many sums");
  const int lanes = lanes_per_sample(g.batch);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.weight.scalar_type(), "eval_finalize_cuda", [&] {
    using compute = compute_t<scalar_t>;
    TORCH_CHECK(out.scalar_type() == c10::CppTypeToScalarType<compute>::value,
                "ct_bn_pool: internal error: eval finalize output dtype");
    launch_overlapping(eval_finalize_kernel<scalar_t, compute>,
                       dim3(static_cast<unsigned>(g.out_channels)), dim3(kThreads),
                       at::cuda::getCurrentCUDAStream(), finalize_args<compute>(in, g, out),
                       in.weight.data_ptr<scalar_t>(), g.taps(), lanes);
  });
}

}  // namespace fused_ops
