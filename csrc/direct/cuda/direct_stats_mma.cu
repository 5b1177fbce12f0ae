// Conv-transpose statistics at stride and dilation 1 on the float64 tensor cores (docs/math.md
// §3.1): the direct algorithm as an implicit GEMM, y[position, co] = sum over (ci, tap) of
// x[ci, position + reach - tap] w[ci, co, tap], each product exact in float64 and each y
// summed in float64, so that the statistics need no shift and no sums of x: a block reduces
// its positions' y to each channel's sum and centred sum of squares, and the blocks of one
// sample and channel tile, a thread block cluster, combine theirs through distributed shared
// memory into the sample's sum and within-sample energy. No box sums, no finalize contraction.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>

#include <algorithm>

#include "common/conv_transpose_row.h"
#include "common/cuda/copy_async.cuh"
#include "common/cuda/reduce.cuh"
#include "common/cuda/dynamic_smem.h"
#include "direct/cuda/direct_kernels.h"
#include "testing_hooks.h"
#include "common/cuda/mma_f64.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int CT = kDirectTile;  // output channels per block: two MMA tiles of 8 columns
constexpr int kRows = 16;        // output positions per MMA tile
constexpr int kMaxMmaTiles = 8;  // a tile of positions: 16, 32, 64 or 128 of them
constexpr int kMaxCluster = 8;   // the portable cluster size
constexpr int kMaxTaps = 1024;   // the tap offsets' table
// x's box and the weights of the staged input channels: two blocks fit a multiprocessor.
constexpr int64_t kStageBytes = int64_t(100) << 10;
// Each staged position holds 8 input channels, c at (c % 4) * 2 + c / 4, so that a lane's
// two A values of a row (channels c and c + 4) are one 8- or 16-byte load; the packed weights
// hold [tap][co tile of 8][n][c % 4][c / 4] per group of 8 channels likewise.
constexpr int kGroup = 8;
constexpr int kWeightsPerTap = CT * kGroup;

// How blocks split one problem (host-computed). A unit (sample, group, tile of CT output
// channels) is `cluster` blocks; its output positions are `tiles` boxes of tile_d x tile_h x
// tile_w, walked in turn by the blocks of its cluster. A tile's positions are m_tiles MMA tiles
// of 16 rows; its warps form m_tiles / mw x k_sets, a warp summing mw MMA tiles of rows over
// one k_sets-th of the (channel group, tap) steps.
struct MmaPlan {
  int tile_d, tile_h, tile_w, m_tiles, mw, k_sets, cluster, per_sm;  // per_sm: blocks a multiprocessor holds
  int bd, bh, bw, box;  // the staged box of x of one channel: (tile + reach) per dim
  int groups8, chunk8;  // channel groups of 8 in the group (padded with zeros), and per stage
  bool keep_weights;    // staged once for all the block's tiles: one chunk, not under the partial y
  int64_t tiles_h, tiles_w, tiles;
  int64_t stage_offset, w_offset, smem_bytes;  // w_offset in values from the stage, the others bytes
};

template <typename scalar_t>
c10::optional<MmaPlan> mma_plan_for(const ConvGeometry& g, int m_tiles) {
  const int64_t Do = g.out_size[0], Ho = g.out_size[1], Wo = g.out_size[2], rows = int64_t(kRows) * m_tiles;
  MmaPlan p;
  p.m_tiles = m_tiles;
  p.mw = m_tiles >= 2 ? 2 : 1;
  p.k_sets = kWarps * p.mw / m_tiles;
  p.tile_w = static_cast<int>(std::min(Wo, rows));
  p.tile_h = static_cast<int>(p.tile_w == Wo ? std::min(Ho, rows / Wo) : 1);
  p.tile_d = static_cast<int>(p.tile_h == Ho ? std::min(Do, rows / (Wo * Ho)) : 1);
  p.tiles_w = ceil_div(Wo, p.tile_w);
  p.tiles_h = ceil_div(Ho, p.tile_h);
  p.tiles = ceil_div(Do, p.tile_d) * p.tiles_h * p.tiles_w;
  p.cluster = static_cast<int>(std::min<int64_t>(kMaxCluster, p.tiles));
  p.bd = static_cast<int>(p.tile_d + g.kernel[0] - 1);
  p.bh = static_cast<int>(p.tile_h + g.kernel[1] - 1);
  p.bw = static_cast<int>(p.tile_w + g.kernel[2] - 1);
  const int64_t box = int64_t(p.bd) * p.bh * p.bw, taps = g.taps();
  const int64_t per_group = (box + taps * CT) * kGroup * int64_t(sizeof(scalar_t));
  p.groups8 = static_cast<int>(ceil_div(g.in_group_channels(), kGroup));
  // One group past kStageBytes (float64 weights of 125 taps: 128 KiB) takes a multiprocessor's
  // whole shared memory, one block on each.
  const int64_t budget = per_group <= kStageBytes ? kStageBytes : dynamic_smem_limit() - kMaxStaticSmem - 4 * kMaxTaps;
  p.per_sm = per_group <= kStageBytes ? 2 : 1;
  const int64_t most = budget / per_group;
  if (most < 1 || taps > kMaxTaps || box > (int64_t(1) << 24)) return c10::nullopt;
  p.box = static_cast<int>(box);
  p.chunk8 = static_cast<int>(ceil_div(p.groups8, ceil_div(p.groups8, most)));  // even chunks
  // [tap offsets][the stage: x's box, then the weights; after the products the k-sets' partial y]
  p.stage_offset = ceil_div(taps * int64_t(sizeof(int)), 16) * 16;
  p.w_offset = int64_t(p.chunk8) * box * kGroup;
  const int64_t stage = (p.w_offset + int64_t(p.chunk8) * taps * kWeightsPerTap) * int64_t(sizeof(scalar_t));
  const int64_t red = int64_t(p.k_sets - 1) * m_tiles * 8 * 32 * int64_t(sizeof(double));
  p.smem_bytes = p.stage_offset + std::max(stage, red);
  p.keep_weights = p.chunk8 == p.groups8 && red <= p.w_offset * int64_t(sizeof(scalar_t));
  return p;
}

// A tile's fixed cost (staging its box, the barriers of its reductions) in MMA tiles of rows:
// the ratio of a tile's cost to an MMA tile of its rows, fitted to the kernel's times for the
// bench's `odd` at tiles of 1 to 8 MMA tiles of rows (docs/performance.md).
constexpr int64_t kTileOverhead = 14;

// The tile size with the least work per block in the busiest wave, fixed costs and masked rows
// included; the larger tile on ties.
template <typename scalar_t>
c10::optional<MmaPlan> mma_plan(const ConvGeometry& g, int64_t units, int64_t sms) {
  c10::optional<MmaPlan> best;
  int64_t best_cost = 0;
  for (int m_tiles = kMaxMmaTiles; m_tiles >= 1; m_tiles /= 2) {
    const auto p = mma_plan_for<scalar_t>(g, m_tiles);
    if (!p || p->smem_bytes > dynamic_smem_limit() - kMaxStaticSmem || units * p->cluster >= (int64_t(1) << 31)) {
      continue;
    }
    const int64_t waves = ceil_div(units * p->cluster, p->per_sm * sms);
    const int64_t cost = waves * ceil_div(p->tiles, p->cluster) * (m_tiles + kTileOverhead);
    if (!best || cost < best_cost) {
      best = p;
      best_cost = cost;
    }
  }
  return best;
}

// packed [G co_tiles, groups8, taps, CT, 4, 2]: weight [Ci, Cog, taps] in the order of the
// B operand's loads (see kGroup), zeros past the group's channels.
template <typename scalar_t>
__global__ void pack_mma_weights_kernel(const scalar_t* __restrict__ weight, int64_t cig, int64_t cog,
                                        int64_t co_tiles, int64_t groups8, int64_t taps, int64_t total,
                                        scalar_t* __restrict__ packed) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const int64_t c = i % 8 / 2 + 4 * (i % 2), co_t = i / 8 % CT, tap = i / kWeightsPerTap % taps;
  const int64_t ci = i / (kWeightsPerTap * taps) % groups8 * kGroup + c, gt = i / (kWeightsPerTap * taps * groups8);
  const int64_t co = gt % co_tiles * CT + co_t, group = gt / co_tiles;
  packed[i] = ci < cig && co < cog ? weight[((group * cig + ci) * cog + co) * taps + tap] : scalar_t(0);
}

__device__ __forceinline__ double2 load_pair(const float* p) {
  const float2 v = *reinterpret_cast<const float2*>(p);
  return make_double2(v.x, v.y);
}
__device__ __forceinline__ double2 load_pair(const double* p) { return *reinterpret_cast<const double2*>(p); }

// Starts staging channel groups [g0, g0 + n8) of the block's group for the tile at (od0, oh0,
// ow0): x's box at xs, [n8][box][8] (zero outside x and past the group's channels), and, where
// `weights`, their packed weights at ws. The caller waits for the copies.
template <typename scalar_t>
__device__ void stage_chunk(const scalar_t* __restrict__ x_group, const scalar_t* __restrict__ w_unit,
                            const ConvGeometry& g, const MmaPlan& p, int g0, int n8, const int64_t origin[3],
                            bool weights, scalar_t* xs, scalar_t* ws) {
  const int64_t D = g.in_size[0], H = g.in_size[1], W = g.in_size[2], cig = g.in_group_channels();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // A warp stages whole box rows: lane l copies slot l % 8 (channel c) of positions l / 8, + 4, ...
  const int slot = lane % 8, c = slot / 2 + 4 * (slot % 2);
  // Row q of the stage is (g8, d, h) = (q / (bd bh), q / bh % bd, q % bh); a warp's rows are q =
  // warp, warp + kWarps, ..., stepped without divisions.
  int g8 = 0, rd = 0, rh = warp;
  for (; rh >= p.bh; rh -= p.bh) ++rd;
  for (; rd >= p.bd; rd -= p.bd) ++g8;
  for (int q = warp; g8 < n8; q += kWarps) {
    const int64_t ci = int64_t(g0 + g8) * kGroup + c, id = origin[0] + rd, ih = origin[1] + rh;
    const bool row_inside = ci < cig && id >= 0 && id < D && ih >= 0 && ih < H;
    const scalar_t* row = x_group + (row_inside ? (ci * D + id) * H * W + ih * W : 0);
    scalar_t* dst = xs + int64_t(q) * p.bw * kGroup + slot;
    for (int l = lane / 8; l < p.bw; l += 4) {
      const int64_t iw = origin[2] + l;
      const bool inside = row_inside && iw >= 0 && iw < W;
      copy_async(dst + l * kGroup, inside ? row + iw : x_group, inside);
    }
    for (rh += kWarps; rh >= p.bh; rh -= p.bh) {
      if (++rd == p.bd) {
        rd = 0;
        ++g8;
      }
    }
  }
  if (weights) {  // one contiguous run of whole 16-byte vectors
    constexpr int kVec = 16 / sizeof(scalar_t);
    const scalar_t* src = w_unit + int64_t(g0) * g.taps() * kWeightsPerTap;
    const int64_t n = int64_t(n8) * g.taps() * kWeightsPerTap;
    for (int64_t i = threadIdx.x * kVec; i < n; i += kThreads * kVec) copy_async_bytes<16>(ws + i, src + i, true);
  }
  copy_async_commit();
}

// Sum over the block's valid rows of each of the tile's CT channels of f(y, channel), in
// channel order at out[0..CT): f applied to the MMA's D values that the k-set 0 warps hold,
// MW tiles of rows each. Every thread calls it; out is read after the barrier it ends with.
template <int MW, typename F>
__device__ __forceinline__ void tile_channel_sums(const double (&d)[MW][2][4], const bool (&valid)[MW][2],
                                                  bool holder, int m_group, int m_groups, double (*parts)[CT],
                                                  double* out, F f) {
  const int lane = threadIdx.x % 32;
  if (holder) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = nt * 8 + 2 * (lane % 4) + e;
        double s = 0;
#pragma unroll
        for (int i = 0; i < MW; ++i) {
          s += (valid[i][0] ? f(d[i][nt][e], j) : 0.0) + (valid[i][1] ? f(d[i][nt][2 + e], j) : 0.0);
        }
        s = butterfly_sum<4, 16>(s);
        if (lane < 4) parts[m_group][nt * 8 + 2 * lane + e] = s;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < CT) {
    double total = 0;
    for (int m = 0; m < m_groups; ++m) total += parts[m][threadIdx.x];
    out[threadIdx.x] = total;
  }
  __syncthreads();
}

// Block: rank r of the cluster of unit (sample b, group, tile of CT channels from co0); it
// computes tiles r, r + cluster, ... of the unit's positions, each warp MW of a tile's MMA
// tiles of rows. Rank 0 writes the unit's within-sample energy [B, Co, 1] and sample sums
// [B, Co] (conv sums, bias excluded).
template <typename scalar_t, int MW>
__global__ void __launch_bounds__(kThreads, 2)
    direct_stats_mma_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ packed,
                            const ConvGeometry g, const MmaPlan p, int64_t co_tiles, double* __restrict__ energy,
                            double* __restrict__ sample_sums) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t unit = blockIdx.x / p.cluster;
  const int64_t cig = g.in_group_channels(), cog = g.out_group_channels();
  const int taps = static_cast<int>(g.taps());
  const int64_t co0 = unit % co_tiles * CT, group = unit / co_tiles % g.groups, b = unit / (co_tiles * g.groups);
  const scalar_t* x_group = x + (b * g.in_channels + group * cig) * g.in_spatial();
  const scalar_t* w_unit = packed + unit % (co_tiles * g.groups) * p.groups8 * taps * kWeightsPerTap;

  extern __shared__ __align__(16) unsigned char smem[];
  int* tap_offset = reinterpret_cast<int*>(smem);
  scalar_t* xs = reinterpret_cast<scalar_t*>(smem + p.stage_offset);
  scalar_t* ws = xs + p.w_offset;
  // the k-sets' partial y, [k_sets - 1][m_groups][MW 8][32], over the stage once it is read
  double* red = reinterpret_cast<double*>(smem + p.stage_offset);
  __shared__ double parts[kMaxMmaTiles][CT], tile_mean[CT], tile_sum[CT], tile_m2[CT];
  __shared__ double unit_stats[3][CT];  // this block's count, sum, centred sum of squares

  // Tap (a, h, c) of output o reads x at o + padding - tap: box offset o - tile origin + reach - tap.
  const int kD = static_cast<int>(g.kernel[0]), kH = static_cast<int>(g.kernel[1]), kW = static_cast<int>(g.kernel[2]);
  for (int t = threadIdx.x; t < taps; t += kThreads) {
    const int a = t / (kH * kW), h = t / kW % kH, c = t % kW;
    tap_offset[t] = ((kD - 1 - a) * p.bh + kH - 1 - h) * p.bw + kW - 1 - c;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int m_groups = p.m_tiles / MW, m_group = warp % m_groups, k_set = warp / m_groups;
  const bool holder = k_set == 0;  // holds the tile's y after the k-sets' reduction
  // This lane's rows of its MMA tiles (lane / 4 and 8 below) as positions of the tile.
  const int plane = p.tile_h * p.tile_w;
  int row_pos[MW][2], row_box[MW][2];
  bool row_in_tile[MW][2];
#pragma unroll
  for (int i = 0; i < MW; ++i) {
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const int m = (m_group * MW + i) * kRows + lane / 4 + 8 * v;
      row_in_tile[i][v] = m < p.tile_d * plane;
      row_pos[i][v] = row_in_tile[i][v] ? m : 0;
      const int td = row_pos[i][v] / plane, th = row_pos[i][v] % plane / p.tile_w, tw = row_pos[i][v] % p.tile_w;
      row_box[i][v] = ((td * p.bh + th) * p.bw + tw) * kGroup + 2 * (lane % 4);
    }
  }
  double n_run = 0, s_run = 0, m2_run = 0;  // threads 0..CT-1: their channel's running stats

  for (int64_t tile = rank; tile < p.tiles; tile += p.cluster) {
    const int64_t od0 = tile / (p.tiles_h * p.tiles_w) * p.tile_d, oh0 = tile / p.tiles_w % p.tiles_h * p.tile_h,
                  ow0 = tile % p.tiles_w * p.tile_w;
    const int64_t origin[3] = {od0 + g.padding[0] - (kD - 1), oh0 + g.padding[1] - (kH - 1),
                               ow0 + g.padding[2] - (kW - 1)};
    double d[MW][2][4] = {};
    for (int g0 = 0; g0 < p.groups8; g0 += p.chunk8) {
      const int n8 = std::min(p.chunk8, p.groups8 - g0);
      __syncthreads();  // the stage is free (and the tap table written, the first time)
      stage_chunk(x_group, w_unit, g, p, g0, n8, origin, !p.keep_weights || tile == rank, xs, ws);
      copy_async_wait<0>();
      __syncthreads();
      // k-set k sums steps [s0, s1) of the chunk's (group, tap) steps; each step's operands
      // are loaded while the step before is multiplied.
      const int steps = n8 * taps, s0 = steps * k_set / p.k_sets, s1 = steps * (k_set + 1) / p.k_sets;
      auto load = [&](int g8, int t, double (&a)[MW][4], double (&bw)[2][2]) {
        const scalar_t* xa = xs + (g8 * p.box + tap_offset[t]) * kGroup;
#pragma unroll
        for (int i = 0; i < MW; ++i) {
          const double2 r0 = load_pair(xa + row_box[i][0]), r1 = load_pair(xa + row_box[i][1]);
          a[i][0] = r0.x;
          a[i][1] = r1.x;
          a[i][2] = r0.y;
          a[i][3] = r1.y;
        }
        const scalar_t* wb = ws + (g8 * taps + t) * kWeightsPerTap + 2 * lane;
        const double2 b0 = load_pair(wb), b1 = load_pair(wb + 8 * kGroup);
        bw[0][0] = b0.x;
        bw[0][1] = b0.y;
        bw[1][0] = b1.x;
        bw[1][1] = b1.y;
      };
      if (s0 < s1) {
        int g8 = s0 / taps, t = s0 % taps;
        double a[MW][4], bw[2][2];
        load(g8, t, a, bw);
        for (int s = s0; s < s1; ++s) {
          if (s + 1 < s1 && ++t == taps) {
            t = 0;
            ++g8;
          }
          double an[MW][4], bn[2][2];
          load(g8, t, an, bn);  // the next step's (this one's again after the last)
#pragma unroll
          for (int i = 0; i < MW; ++i) {
            mma_f64(d[i][0], a[i], bw[0]);
            mma_f64(d[i][1], a[i], bw[1]);
          }
#pragma unroll
          for (int i = 0; i < MW; ++i)
#pragma unroll
            for (int v = 0; v < 4; ++v) a[i][v] = an[i][v];
#pragma unroll
          for (int v = 0; v < 4; ++v) bw[v / 2][v % 2] = bn[v / 2][v % 2];
        }
      }
    }
    // The k-sets' partial y added into k-set 0's fragments.
    constexpr int kValues = MW * 8;
    __syncthreads();  // the stage is read
    if (!holder) {
      double* mine = red + ((k_set - 1) * m_groups + m_group) * kValues * 32 + lane;
#pragma unroll
      for (int v = 0; v < kValues; ++v) mine[v * 32] = d[v / 8][v / 4 % 2][v % 4];
    }
    __syncthreads();
    if (holder) {
      for (int k = 1; k < p.k_sets; ++k) {
        const double* theirs = red + ((k - 1) * m_groups + m_group) * kValues * 32 + lane;
#pragma unroll
        for (int v = 0; v < kValues; ++v) d[v / 8][v / 4 % 2][v % 4] += theirs[v * 32];
      }
    }
    bool valid[MW][2];
#pragma unroll
    for (int i = 0; i < MW; ++i) {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int r = row_pos[i][v];
        valid[i][v] = row_in_tile[i][v] && od0 + r / plane < g.out_size[0] &&
                      oh0 + r % plane / p.tile_w < g.out_size[1] && ow0 + r % p.tile_w < g.out_size[2];
      }
    }
    const double n_tile = static_cast<double>(std::min<int64_t>(p.tile_d, g.out_size[0] - od0) *
                                              std::min<int64_t>(p.tile_h, g.out_size[1] - oh0) *
                                              std::min<int64_t>(p.tile_w, g.out_size[2] - ow0));
    // Centred on the tile's own mean, then merged into the running stats (Chan et al.): no
    // square is ever taken about a mean of another scale.
    tile_channel_sums(d, valid, holder, m_group, m_groups, parts, tile_sum, [](double y, int) { return y; });
    if (threadIdx.x < CT) tile_mean[threadIdx.x] = tile_sum[threadIdx.x] / n_tile;
    __syncthreads();
    tile_channel_sums(d, valid, holder, m_group, m_groups, parts, tile_m2, [&](double y, int j) {
      const double e = y - tile_mean[j];
      return e * e;
    });
    if (threadIdx.x < CT) {
      const double s = tile_sum[threadIdx.x], delta = s / n_tile - (n_run > 0 ? s_run / n_run : 0.0);
      m2_run += tile_m2[threadIdx.x] + (n_run > 0 ? delta * delta * n_run * n_tile / (n_run + n_tile) : 0.0);
      s_run += s;
      n_run += n_tile;
    }
  }

  if (threadIdx.x < CT) {
    unit_stats[0][threadIdx.x] = n_run;
    unit_stats[1][threadIdx.x] = s_run;
    unit_stats[2][threadIdx.x] = m2_run;
  }
  cluster.sync();
  const int valid_channels = static_cast<int>(std::min<int64_t>(CT, cog - co0));
  if (rank == 0 && static_cast<int>(threadIdx.x) < valid_channels) {
    const int j = threadIdx.x;
    double n = 0, s = 0;
    for (int r = 0; r < p.cluster; ++r) {
      const double* theirs = cluster.map_shared_rank(&unit_stats[0][0], r);
      n += theirs[j];
      s += theirs[CT + j];
    }
    const double mean = s / n;
    double e = 0;
    for (int r = 0; r < p.cluster; ++r) {
      const double* theirs = cluster.map_shared_rank(&unit_stats[0][0], r);
      const double delta = theirs[CT + j] / theirs[j] - mean;
      e += theirs[2 * CT + j] + theirs[j] * delta * delta;
    }
    const int64_t out = b * g.out_channels + group * cog + co0 + j;
    energy[out] = e;
    sample_sums[out] = s;
  }
  cluster.sync();  // the other blocks' shared memory is read
#else
  __trap();  // direct_stats_cuda launches it only from a compute_90 binary
#endif
}

// The tile plan and the kernel of its warp layout for `units` (sample, group, channel tile)
// units on `device`, and whether that kernel runs there: a plan fits, and the binary has the
// kernel's compute_90 code.
template <typename scalar_t>
struct MmaLaunch {
  c10::optional<MmaPlan> plan;
  decltype(&direct_stats_mma_kernel<scalar_t, 1>) kernel;
  bool runs;
};

template <typename scalar_t>
MmaLaunch<scalar_t> mma_launch(const ConvGeometry& g, int64_t units, at::Device device) {
  const int64_t sms = at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
  const auto plan = mma_plan<scalar_t>(g, units, sms);
  auto kernel = plan && plan->mw == 2 ? direct_stats_mma_kernel<scalar_t, 2> : direct_stats_mma_kernel<scalar_t, 1>;
  return {plan, kernel, plan && compiled_for_sm90(reinterpret_cast<const void*>(kernel), device)};
}

int64_t mma_units(const ConvGeometry& g) { return g.batch * g.groups * (direct_co_pad(g) / CT); }

bool sm90(at::Device device) { return at::cuda::getDeviceProperties(device.index())->major >= 9; }

}  // namespace

bool direct_stats_mma_takes(const ConvGeometry& g, at::ScalarType dtype) {
  const at::Device device(at::kCUDA, at::cuda::current_device());
  if (!g.unit_steps() || !sm90(device)) return false;
  return AT_DISPATCH_FLOATING_TYPES(dtype, "direct_stats_mma_takes", [&] {
    return mma_launch<scalar_t>(g, mma_units(g), device).runs;
  });
}

std::pair<at::Tensor, at::Tensor> direct_stats_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                    const ConvGeometry& g) {
  // auto: padded problems, where the other route needs the box sums and their contraction (three
  // more launches); without padding direct_energy_stride1.cu's shorter tiles win on small
  // problems (docs/dispatch.md, "Kernel routes").
  const Route forced = forced_route(Knob::Direct);
  if (!g.unit_steps() || forced == Route::Simt || (forced == Route::Auto && !g.has_padding())) return {};
  TORCH_CHECK(sm90(x.device()) || forced == Route::Auto,
              "ct_bn_pool: route direct='mma' needs a GPU of compute capability 9.0 or later");
  if (!sm90(x.device())) return {};
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t co_tiles = direct_co_pad(g) / CT, units = mma_units(g);
  return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "direct_stats_cuda", [&]() -> std::pair<at::Tensor, at::Tensor> {
    const auto launch = mma_launch<scalar_t>(g, units, x.device());
    const auto& plan = launch.plan;
    const auto kernel = launch.kernel;
    const bool runs = launch.runs;
    TORCH_CHECK(runs || forced == Route::Auto, "ct_bn_pool: route direct='mma': the tensor cores' direct kernel does not ",
                "take this problem (a channel group's box of x and weights past its shared memory, or a binary ",
                "without compute_90)");
    if (!runs) return {};
    const auto opts = x.options().dtype(at::kDouble);
    auto energy = at::empty({g.batch, g.out_channels, 1}, opts);
    auto sample_sums = at::empty({g.batch, g.out_channels}, opts);
    if (units == 0 || plan->groups8 == 0) return {energy.zero_(), sample_sums.zero_()};  // nothing to launch
    const int64_t taps = g.taps();
    auto packed = at::empty({g.groups * co_tiles, plan->groups8, taps, kWeightsPerTap}, weight.options());
    const int64_t total = packed.numel();
    const auto stream = at::cuda::getCurrentCUDAStream();
    pack_mma_weights_kernel<scalar_t><<<static_cast<unsigned>(ceil_div(total, kThreads)), kThreads, 0, stream>>>(
        weight.data_ptr<scalar_t>(), g.in_group_channels(), g.out_group_channels(), co_tiles, plan->groups8, taps,
        total, packed.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    allow_dynamic_smem(kernel, plan->smem_bytes);
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(units * plan->cluster));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = static_cast<size_t>(plan->smem_bytes);
    config.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(plan->cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<const scalar_t*>(x.data_ptr<scalar_t>()),
                                      static_cast<const scalar_t*>(packed.data_ptr<scalar_t>()), g, *plan, co_tiles,
                                      energy.data_ptr<double>(), sample_sums.data_ptr<double>()));
    return {energy, sample_sums};
  });
}

}  // namespace fused_ops
