// Per-(b, ci) sums of x over D, H, W (docs/math.md §2) for x whose channels are
// adjacent in memory (channels_last_3d, [B, D, H, W, Ci] in memory; sums/cuda/sums_kernels.h),
// read in place: sample_sums.cu reads runs of adjacent positions, which such x
// only has after a transposing copy. A block takes one sample, a chunk of its
// positions and a slab of its channels (all of them, unless the samples alone
// would leave SMs idle). Each thread owns one 16-byte vector of channels, strides
// over the chunk's positions with kUnroll loads in flight and accumulates each
// channel in double; the block adds up its threads' sums per channel (warp
// shuffles, then shared memory) into x_red[b, ci, chunk]. The chunks are x_red's
// J parts (SampleSums), added up by the finalize. The weight sums follow in the
// same launch (weight_sums.cuh).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <tuple>

#include "sums/cuda/sums_kernels.h"
#include "common/cuda/pdl.cuh"
#include "sums/cuda/weight_sums.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 8;
// Two blocks fit an SM: 64 registers a thread, which the kUnroll 16-byte loads in
// flight need (ptxas, left to itself, chooses fewer and spills).
constexpr int kMinBlocksPerSm = 2;
// A slab of channels spans at least this many bytes, so that blocks still read
// whole 128-byte lines of x.
constexpr int64_t kMinSlabBytes = 128;
// Most terms Ci * J of the finalize's contraction per (b, co): the chunks of
// positions multiply the work of that (latency-bound) loop; slabs do not.
constexpr int64_t kMaxPartTerms = 1024;

// How a launch covers x (strides in elements): block (b, chunk, slab) sums
// `chunk` positions of sample b for one slab of `cols` vectors of channels; its
// threads form `rows` rows of `cols` threads.
struct ChannelsLastPlan {
  int64_t channels, positions, batch_stride, position_stride;
  int64_t chunk, parts, slabs;
  int cols, rows;
};

template <typename scalar_t, int kLanes>
struct alignas(sizeof(scalar_t) * kLanes) Lanes {
  scalar_t v[kLanes];
};

// Vectors of channels a slab holds (a block's columns of threads): all of them
// when the samples alone fill the GPU, else slabs of at least `narrowest`; at
// most kThreads. Slabs come before chunks of positions: they do not lengthen the
// finalize.
int64_t slab_vectors(int64_t vectors, int64_t narrowest, int64_t batch, int64_t sms) {
  const int64_t wanted = std::min(ceil_div(sms, batch), std::max<int64_t>(1, vectors / narrowest));
  const int64_t cols = ceil_div(vectors, std::max(ceil_div(vectors, kThreads), wanted));
  if (cols >= 32) return cols;
  int64_t pow2 = 1;  // narrower than a warp: a power of two, so a warp holds whole rows
  while (pow2 < cols) pow2 *= 2;
  return pow2;
}

// Slabs, then chunks of positions up to about one block per SM.
ChannelsLastPlan plan_launch(const at::Tensor& x, const SampleLayout& layout, int64_t lanes,
                             int64_t sms) {
  ChannelsLastPlan p;
  p.channels = x.size(1);
  p.positions = x.size(2) * x.size(3) * x.size(4);
  p.batch_stride = layout.batch;
  p.position_stride = layout.position;
  const int64_t batch = x.size(0), vectors = ceil_div(p.channels, lanes);
  const int64_t narrowest = std::max<int64_t>(1, kMinSlabBytes / (lanes * x.element_size()));
  p.cols = static_cast<int>(slab_vectors(vectors, narrowest, batch, sms));
  p.rows = kThreads / p.cols;
  p.slabs = ceil_div(vectors, p.cols);
  const int64_t most_parts = std::max<int64_t>(
      1, std::min(p.positions / (p.rows * kUnroll), kMaxPartTerms / p.channels));
  p.parts = std::clamp<int64_t>(ceil_div(sms, batch * p.slabs), 1, most_parts);
  p.chunk = ceil_div(p.positions, p.parts);
  p.parts = ceil_div(p.positions, p.chunk);
  return p;
}

// Adds this thread's kLanes channels (from x), summed over its positions of chunk
// `part`, to acc.
template <typename scalar_t, int kLanes>
__device__ void add_positions(const scalar_t* __restrict__ x, const ChannelsLastPlan& p,
                              int64_t part, int row, double (&acc)[kLanes]) {
  using L = Lanes<scalar_t, kLanes>;
  auto load = [&](int64_t pos) { return *reinterpret_cast<const L*>(x + pos * p.position_stride); };
  auto add = [&](const L& v) {
#pragma unroll
    for (int e = 0; e < kLanes; ++e) acc[e] += static_cast<double>(v.v[e]);
  };
  const int64_t begin = part * p.chunk, end = std::min(p.positions, begin + p.chunk);
  const int64_t rows = p.rows;
  int64_t pos = begin + row;
  // Whole rounds, unguarded, so that all kUnroll loads are issued before the first add.
  for (; pos + (kUnroll - 1) * rows < end; pos += kUnroll * rows) {
    L v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load(pos + u * rows);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) add(v[u]);
  }
  for (; pos < end; pos += rows) add(load(pos));
}

// Adds acc up over the block's rows of threads and writes x_red[b, ci, part] for
// the slab's channels.
template <int kLanes>
__device__ void store_channel_sums(double (&acc)[kLanes], const ChannelsLastPlan& p, int64_t b,
                                   int64_t part, int64_t slab, double* __restrict__ x_red) {
  __shared__ double partials[kThreads * kLanes];  // [groups][width]
  const int width = p.cols * kLanes, col = threadIdx.x % p.cols, lane = threadIdx.x % 32;
  int group = threadIdx.x / p.cols, groups = p.rows;  // one partial sum per row...
  bool writes = group < p.rows;
  if (p.cols < 32) {  // ...or per warp, its rows added up first
#pragma unroll
    for (int e = 0; e < kLanes; ++e) {
      for (int offset = p.cols; offset < 32; offset *= 2) {
        acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], offset);
      }
    }
    group = threadIdx.x / 32;
    groups = kThreads / 32;
    writes = lane < p.cols;
  }
  if (writes) {
#pragma unroll
    for (int e = 0; e < kLanes; ++e) partials[group * width + col * kLanes + e] = acc[e];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < width; c += kThreads) {
    const int64_t channel = slab * width + c;
    if (channel >= p.channels) break;
    double total = 0;
    for (int k = 0; k < groups; ++k) total += partials[k * width + c];
    x_red[(b * p.channels + channel) * p.parts + part] = total;
  }
}

// Block (b, part, slab), slab fastest so that the slabs of one position are read
// at about the same time.
template <typename scalar_t, int kLanes>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    spatial_sum_channels_last_kernel(const scalar_t* __restrict__ x, const ChannelsLastPlan p,
                                     double* __restrict__ x_red, const scalar_t* __restrict__ w,
                                     const WeightRows w_rows) {
  pdl_launch_dependents();  // the finalize may be scheduled as soon as blocks retire
  const int64_t block = blockIdx.x;
  const int64_t slab = block % p.slabs, part = (block / p.slabs) % p.parts;
  const int64_t b = block / (p.slabs * p.parts);
  const int row = threadIdx.x / p.cols;
  const int64_t first_channel = (slab * p.cols + threadIdx.x % p.cols) * kLanes;
  double acc[kLanes] = {};
  if (row < p.rows && first_channel < p.channels) {
    add_positions<scalar_t, kLanes>(x + b * p.batch_stride + first_channel, p, part, row, acc);
  }
  store_channel_sums<kLanes>(acc, p, b, part, slab, x_red);
  weight_block_share<scalar_t, kThreads / 32>(w, w_rows, block);
}

}  // namespace

SampleSumTensors sample_sums_channels_last_cuda(const at::Tensor& x, const SampleLayout& layout,
                                                const at::Tensor& weight) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t vec = 16 / x.element_size();
  // 16-byte loads: every sample's and every position's channels start on a 16-byte boundary.
  const bool vector_ok = x.size(1) % vec == 0 && layout.position % vec == 0 &&
                         layout.batch % vec == 0 &&
                         reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const ChannelsLastPlan plan = plan_launch(x, layout, vector_ok ? vec : 1, sms);
  const int64_t blocks = x.size(0) * plan.parts * plan.slabs;
  SampleSumTensors sums;
  WeightRows w_rows;
  std::tie(sums, w_rows) = spatial_sum_outputs(x, weight, plan.parts, blocks);
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "sample_sums_channels_last_cuda", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    auto kernel = vector_ok ? spatial_sum_channels_last_kernel<scalar_t, kVec>
                            : spatial_sum_channels_last_kernel<scalar_t, 1>;
    kernel<<<blocks, kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), plan,
                                            sums.x_red.data_ptr<double>(),
                                            weight.data_ptr<scalar_t>(), w_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return sums;
}

}  // namespace fused_ops
