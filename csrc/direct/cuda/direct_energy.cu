// Conv-transpose statistics, direct algorithm (docs/math.md §3.1): computes the
// conv-transpose output tile by tile in registers and reduces each sample's
// centred sum of squares; the [B, Co, Do, Ho, Wo] output is never written.
#include <ATen/AccumulateType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <type_traits>

#include "common/conv_transpose_row.h"
#include "direct/cuda/direct_tile.cuh"
#include "common/cuda/dynamic_smem.h"
#include "direct/cuda/direct_kernels.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 512;
constexpr int CT = kDirectTile;
// The sum behind each output value (over taps and a group's input channels) is split
// over up to this many sets of threads, each summing its share of every output value in
// its block; the shares meet in shared memory before the square. Without the split a
// small problem has one thread per output position and tile, each a long serial loop
// over taps and channels, on few blocks (docs/performance.md).
constexpr int kMaxSets = 32;

// Shared memory of the sets' shares: [set][p][channel][thread of the set],
// a row padded by one value so that both the writes (threads along a row) and the reads
// (channels across rows) fall in distinct banks.
template <typename acc_t>
__host__ __device__ int64_t share_values(int sets) {
  const int64_t threads = kThreads / sets;
  return int64_t(sets) * positions_per_thread<acc_t>() * CT * (threads + 1);
}

// Where the staged copy of the weight tile starts after x's: 16-byte aligned, for
// load_tile_weights.
template <typename scalar_t>
__host__ __device__ int64_t staged_weight_offset(const ConvGeometry& g) {
  constexpr int64_t n = 16 / sizeof(scalar_t);
  return (g.in_group_channels() * g.in_spatial() + n - 1) / n * n;
}

template <typename scalar_t>
int64_t direct_smem_bytes(const ConvGeometry& g, int sets, bool staged) {
  using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
  int64_t bytes = share_values<acc_t>(sets) * int64_t(sizeof(acc_t));
  if (staged) {
    bytes += (staged_weight_offset<scalar_t>(g) + g.in_group_channels() * g.taps() * CT) *
             int64_t(sizeof(scalar_t));
  }
  return bytes;
}

// What a block's threads gather from: x of the sample's group and the tile's weights,
// whose taps lie w_stride apart.
template <typename scalar_t>
struct Operands {
  const scalar_t* x;
  const scalar_t* w;
  int64_t w_stride;
};

// kStaged: copies the sample's group of x and the tile's weights into shared memory at
// `stage`, where each thread's gathers find them (from global memory the gathers are the
// kernel's bottleneck: docs/performance.md); `weight` is then
// the caller's [Ci, Cog, taps], packed here as it is copied (a packing pass before the
// kernel would cost two launches, which small problems feel). Otherwise `weight` is
// pack_weight_for_direct's [G, Cig, taps, co_pad], read in place. Ends with a barrier.
template <typename scalar_t, bool kStaged>
__device__ __forceinline__ Operands<scalar_t> stage_operands(const scalar_t* x_group, const scalar_t* weight,
                                                             const ConvGeometry& g, int64_t group,
                                                             int64_t co0, int64_t co_pad, scalar_t* stage) {
  const int64_t cog = g.out_group_channels();
  Operands<scalar_t> o;
  if constexpr (kStaged) {
    const int x_count = static_cast<int>(g.in_group_channels() * g.in_spatial());
    scalar_t* w_stage = stage + staged_weight_offset<scalar_t>(g);
#pragma unroll 4
    for (int i = threadIdx.x; i < x_count; i += kThreads) stage[i] = x_group[i];
    // (ci, tap) rows of CT weights, from [Cig, Cog, taps] of the group
    const int taps = static_cast<int>(g.taps()), w_count = static_cast<int>(g.in_group_channels()) * taps * CT;
    const scalar_t* w_group = weight + group * g.in_group_channels() * cog * g.taps();
#pragma unroll 4
    for (int i = threadIdx.x; i < w_count; i += kThreads) {
      const int j = i % CT, ci = i / CT / taps, tap = i / CT % taps;
      w_stage[i] = co0 + j < cog ? w_group[(ci * cog + co0 + j) * g.taps() + tap] : scalar_t(0);
    }
    o = {stage, w_stage, CT};
  } else {
    o = {x_group, weight + group * g.in_group_channels() * g.taps() * co_pad + co0, co_pad};
  }
  __syncthreads();
  return o;
}

// This thread's channel's share of one pass: for each of its slots (position p of item
// first + u), the sets' shares summed, centred on the shift and squared. Positions past
// the block's items or their row's end are skipped.
template <int P, typename acc_t>
__device__ __forceinline__ double centred_squares(const acc_t* shares, int sets, int threads, int channel,
                                                  acc_t shift, int64_t first, int64_t end,
                                                  int64_t row_items, int64_t out_w) {
  const int row = threads + 1;
  double e = 0;
  for (int s = threadIdx.x / CT; s < P * threads; s += kThreads / CT) {
    const int p = s / threads, u = s % threads;
    const int64_t item = first + u;
    if (item >= end || item % row_items * P + p >= out_w) continue;
    acc_t total = 0;
    for (int k = 0; k < sets; ++k) total += shares[((k * P + p) * CT + channel) * row + u];
    const acc_t d = total - shift;
    e += static_cast<double>(d) * static_cast<double>(d);
  }
  return e;
}

// Block (unit, split): sample b, one tile of CT channels of one group, and one
// contiguous range of items, an item being P adjacent positions of an output row.
// Partial energies of the splits share the same shift (the sample mean), so they add up
// in the finalize step. Thread (s, t) sums set s's share of taps and input channels for
// item t of each pass; the sets' shares are added in shared memory, centred and squared
// there. `weight`: see stage_operands.
template <typename scalar_t, bool kStaged>
__global__ void __launch_bounds__(kThreads)
    energy_direct_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ weight,
                         const SampleSums sums, const ConvGeometry g, int64_t co_pad,
                         int ci_sets, int pair_sets, double* __restrict__ energy) {
  using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
  using index_t = std::conditional_t<kStaged, int, int64_t>;  // shared memory: offsets fit int
  constexpr int P = positions_per_thread<acc_t>();
  const int64_t tiles = co_pad / CT, cog = g.out_group_channels(), n_out = g.out_spatial();
  const int64_t row_items = (g.out_size[2] + P - 1) / P, items = g.out_size[0] * g.out_size[1] * row_items;
  const int64_t unit = blockIdx.x, splits = gridDim.y, split = blockIdx.y;
  const int64_t tile = unit % tiles, group = (unit / tiles) % g.groups, b = unit / (tiles * g.groups);
  const int64_t co0 = tile * CT;

  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* shares = reinterpret_cast<acc_t*>(smem);
  __shared__ acc_t shift[CT];
  const int valid = static_cast<int>(std::min<int64_t>(CT, cog - co0));
  tile_shift<kThreads>(sums, b, group * cog + co0, valid, static_cast<double>(n_out), shift);
  const Operands<scalar_t> in = stage_operands<scalar_t, kStaged>(
      x + (b * g.in_channels + group * g.in_group_channels()) * g.in_spatial(), weight, g, group, co0, co_pad,
      reinterpret_cast<scalar_t*>(shares + share_values<acc_t>(ci_sets * pair_sets)));

  const int sets = ci_sets * pair_sets, threads = kThreads / sets;
  const int set = threadIdx.x / threads, t = threadIdx.x % threads;
  const int ci_set = set % ci_sets, pair_set = set / ci_sets;
  const int64_t cig = g.in_group_channels(), pairs = g.kernel[0] * g.kernel[1];
  const int64_t ci0 = cig * ci_set / ci_sets, ci1 = cig * (ci_set + 1) / ci_sets;
  const int64_t pair0 = pairs * pair_set / pair_sets, pair1 = pairs * (pair_set + 1) / pair_sets;
  const int64_t begin = items * split / splits, end = items * (split + 1) / splits;
  const int channel = threadIdx.x % CT;  // whose energy this thread sums
  double e = 0;
  for (int64_t first = begin; first < end; first += threads) {
    acc_t y[P][CT];
    const int64_t item = first + t;
    if (item < end) {
      const int64_t ow0 = item % row_items * P, oh = item / row_items % g.out_size[1],
                    od = item / (row_items * g.out_size[1]);
      conv_transpose_row<CT, P, index_t>(in.x, in.w, g, in.w_stride, pair0, pair1, ci0, ci1, od, oh, ow0, y);
    } else {
#pragma unroll
      for (int p = 0; p < P; ++p)
#pragma unroll
        for (int j = 0; j < CT; ++j) y[p][j] = acc_t(0);
    }
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int j = 0; j < CT; ++j) shares[((set * P + p) * CT + j) * (threads + 1) + t] = y[p][j];
    __syncthreads();
    e += centred_squares<P>(shares, sets, threads, channel, shift[channel], first, end, row_items, g.out_size[2]);
    __syncthreads();  // the shares are rewritten by the next pass
  }
  write_channel_energy<kThreads>(e, valid,
                                 energy + (b * g.out_channels + group * cog + co0) * splits + split, splits);
}

// Sets of threads per block: the largest power of two (up to kMaxSets) that keeps
// units * items * sets, the threads with work, within one block of kThreads per
// multiprocessor; the input channels are split first (their shares cost no index
// arithmetic), then the (kd, kh) pairs of taps.
struct Sets {
  int ci = 1, pairs = 1;
};
Sets sets_for(const ConvGeometry& g, int64_t units, int64_t items, int64_t sms) {
  const double target = double(sms) * kThreads / (double(units) * double(items));
  int total = 1;
  while (total * 2 <= kMaxSets && total * 2 <= target) total *= 2;
  Sets s;
  while (s.ci * 2 <= total && s.ci * 2 <= g.in_group_channels()) s.ci *= 2;
  while (s.ci * s.pairs * 2 <= total && s.pairs * 2 <= g.kernel[0] * g.kernel[1]) s.pairs *= 2;
  return s;
}

}  // namespace

at::Tensor energy_direct_cuda(const at::Tensor& x, const at::Tensor& weight,
                              const SampleSumTensors& sums, const ConvGeometry& g) {
  if (at::Tensor energy = energy_direct_stride1_cuda(x, weight, sums, g); energy.defined()) return energy;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t co_pad = direct_co_pad(g), units = g.batch * g.groups * (co_pad / CT);
  TORCH_CHECK(units < (int64_t(1) << 31), "ct_bn_pool: problem too large for the direct kernel");
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto stream = at::cuda::getCurrentCUDAStream();
  return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "energy_direct_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    constexpr int P = positions_per_thread<acc_t>();
    const int64_t items = g.out_size[0] * g.out_size[1] * ((g.out_size[2] + P - 1) / P);
    const Sets sets = sets_for(g, units, items, sms);
    const int64_t threads = kThreads / (sets.ci * sets.pairs);
    // Split the items until there are two blocks per multiprocessor, each with at least
    // one item per thread.
    const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(65535, (items + threads - 1) / threads));
    const int64_t splits = std::min(max_splits, std::max<int64_t>(1, (2 * sms + units - 1) / units));
    auto energy = at::empty({g.batch, g.out_channels, splits}, x.options().dtype(at::kDouble));
    const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(splits));
    // (the limit holds the static shared memory too: kDirectStaticSmem bounds it)
    const bool staged = direct_smem_bytes<scalar_t>(g, sets.ci * sets.pairs, true) <= dynamic_smem_limit() - kDirectStaticSmem;
    const int64_t smem = direct_smem_bytes<scalar_t>(g, sets.ci * sets.pairs, staged);
    auto kernel = staged ? energy_direct_kernel<scalar_t, true> : energy_direct_kernel<scalar_t, false>;
    const at::Tensor w = staged ? weight : pack_weight_for_direct(weight, g);
    allow_dynamic_smem(kernel, smem);
    kernel<<<grid, kThreads, static_cast<size_t>(smem), stream>>>(
        x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), sums.view(g), g, co_pad, sets.ci, sets.pairs,
        energy.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return energy;
  });
}

}  // namespace fused_ops
