#pragma once
// What the direct statistics kernels share (docs/math.md §3.1): direct_energy.cu's, for any
// geometry, and direct_energy_stride1.cu's, for stride and dilation 1. A block computes one tile
// of kDirectTile output channels of one sample, centres it on the sample's mean and reduces
// the squares per channel.
#include "common/conv_transpose_row.h"
#include "sums/sample_sums.h"

namespace fused_ops {

// A bound on the static shared memory of a block of either kernel (tile_shift's parts, the
// shift, write_channel_energy's per-warp energies), which their dynamic shared memory must
// leave room for.
constexpr int64_t kDirectStaticSmem = 6 << 10;

// Output positions per thread: each weight loaded serves this many positions (one in
// float64, where the accumulators are twice the registers).
template <typename acc_t>
__host__ __device__ constexpr int positions_per_thread() {
  return sizeof(acc_t) == 4 ? 2 : 1;
}

// The tile's shift: each of its channels' sample mean (docs/math.md §3), the contraction of
// x's and the weight's sums split over all kThreads threads, kThreads / CT terms apart (one
// thread per channel would walk its Cig * J terms alone: hundreds of dependent float64
// multiply-adds for a padded problem's box sums). Channel j of the tile is output channel
// co + j, j < valid. Every thread calls it; `shift` is written by threads 0..CT-1 after a
// barrier, so the caller needs one more before reading it.
template <int kThreads, typename acc_t>
__device__ __forceinline__ void tile_shift(const SampleSums& sums, int64_t b, int64_t co, int valid, double n_out,
                                           acc_t* shift) {
  constexpr int CT = kDirectTile;
  static_assert(CT == 16 && kThreads % 32 == 0, "lanes l and l + 16 share a channel");
  __shared__ double parts[kThreads / 32][CT];
  const int j = threadIdx.x % CT;
  double s = j < valid ? sums.conv_sum_part(b, co + j, threadIdx.x / CT, kThreads / CT) : 0.0;
  s += __shfl_xor_sync(0xffffffffu, s, 16);
  if (threadIdx.x % 32 < CT) parts[threadIdx.x / 32][j] = s;
  __syncthreads();
  if (threadIdx.x < CT) {
    double total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += parts[w][threadIdx.x];
    shift[threadIdx.x] = static_cast<acc_t>(total / n_out);
  }
}

// Threads of one channel: lanes l and l + 16 of every warp. Each thread holds one channel's
// sum, so one shuffle and a table of the warps' sums replace the CT block-wide reductions (CT
// barriers) that a reduction per channel costs. Threads 0..CT-1 write their channel's total
// (those of channels < valid) at out[j * stride].
template <int kThreads>
__device__ __forceinline__ void write_channel_energy(double e, int valid, double* out, int64_t stride) {
  constexpr int CT = kDirectTile;
  static_assert(CT == 16 && kThreads % 32 == 0, "the reduction pairs lanes 16 apart");
  __shared__ double warp_energy[kThreads / 32][CT];
  e += __shfl_xor_sync(0xffffffffu, e, 16);
  if (threadIdx.x % 32 < CT) warp_energy[threadIdx.x / 32][threadIdx.x % CT] = e;
  __syncthreads();
  if (threadIdx.x < CT && static_cast<int>(threadIdx.x) < valid) {
    double total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += warp_energy[w][threadIdx.x];
    out[threadIdx.x * stride] = total;
  }
}

}  // namespace fused_ops
