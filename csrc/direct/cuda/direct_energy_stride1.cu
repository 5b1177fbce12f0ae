// Conv-transpose statistics, direct algorithm at stride and dilation 1 (docs/math.md §3.1):
// direct_energy.cu's computation for the geometry where each output position's taps read a
// box of x. A block stages the box of its tile of output positions, halo included and
// zero where it falls outside x (padding needs no test per tap), with its channels' weights
// from a copy packed per tile; each thread then sums P positions of one row for the tile's
// CT channels over a share of the input channels, every load from shared memory serving
// P * CT or CT multiply-adds.
#include <ATen/AccumulateType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "common/cuda/copy_async.cuh"
#include "direct/cuda/direct_tile.cuh"
#include "common/cuda/dynamic_smem.h"
#include "direct/cuda/direct_kernels.h"

namespace fused_ops {
namespace {

// Two blocks per multiprocessor (128 registers per thread). 512 threads, one block per
// multiprocessor, with tiles chosen for whole waves, is faster on some padded problems but
// far slower on small ones (docs/performance.md).
constexpr int kThreads = 256;
constexpr int CT = kDirectTile;
// Staged x and weights per block: two blocks (with their static shared memory) fit a
// multiprocessor's 228 KiB.
constexpr int64_t kStageBytes = int64_t(96) << 10;

// How blocks and threads split one problem (host-computed). A block's tile is tile_d x tile_h
// output rows of the whole width, `items` of P positions each (P positions of a row, a
// row_items apart: adjacent threads read adjacent x); its threads form `sets` sets, each
// summing every sets-th input channel of each staged chunk for all the tile's items.
struct Stride1Plan {
  int tile_d, tile_h, row_items, items, sets, chunk;
  int rh, rw, region;  // staged x of one channel: (tile_d + kD - 1) x rh x rw, `region` values
  int64_t tiles_h, tiles, w_offset, smem_bytes;  // w_offset: where the staged weights start
};

template <typename scalar_t>
c10::optional<Stride1Plan> stride1_plan(const ConvGeometry& g, int64_t units, int64_t sms) {
  using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
  constexpr int P = positions_per_thread<acc_t>();
  const int64_t Do = g.out_size[0], Ho = g.out_size[1], Wo = g.out_size[2];
  const int64_t row_items = ceil_div(Wo, P);
  if (row_items > kThreads) return c10::nullopt;
  int64_t tile_h = std::min<int64_t>(Ho, kThreads / row_items);
  int64_t tile_d = tile_h == Ho ? std::min<int64_t>(Do, kThreads / (row_items * Ho)) : 1;
  // Smaller tiles until the blocks fill the multiprocessors: more halo is staged per output
  // position, but a small problem otherwise leaves most of them idle.
  auto tiles = [&] { return ceil_div(Do, tile_d) * ceil_div(Ho, tile_h); };
  while (units * tiles() < sms && (tile_d > 1 || tile_h > 1)) {
    if (tile_d > 1) {
      tile_d = (tile_d + 1) / 2;
    } else {
      tile_h = (tile_h + 1) / 2;
    }
  }
  Stride1Plan p;
  p.tile_d = static_cast<int>(tile_d);
  p.tile_h = static_cast<int>(tile_h);
  p.row_items = static_cast<int>(row_items);
  p.items = static_cast<int>(tile_d * tile_h * row_items);
  p.rh = static_cast<int>(tile_h + g.kernel[1] - 1);
  p.rw = static_cast<int>(row_items * P + g.kernel[2] - 1);
  const int64_t region = (tile_d + g.kernel[0] - 1) * p.rh * p.rw;
  const int64_t align = 16 / sizeof(scalar_t);  // load_tile_weights' 16-byte loads
  const int64_t per_channel = region + g.taps() * CT;
  const int64_t most = kStageBytes / int64_t(sizeof(scalar_t)) / (per_channel + align);
  if (most < 1) return c10::nullopt;
  const int64_t chunk = ceil_div(g.in_group_channels(), ceil_div(g.in_group_channels(), most));  // even chunks
  p.region = static_cast<int>(region);
  p.chunk = static_cast<int>(chunk);
  p.sets = static_cast<int>(std::min<int64_t>(kThreads / p.items, chunk));
  p.tiles_h = ceil_div(Ho, tile_h);
  p.tiles = tiles();
  p.w_offset = ceil_div(chunk * region, align) * align;
  const int64_t stage = (p.w_offset + chunk * g.taps() * CT) * int64_t(sizeof(scalar_t));
  const int64_t shares = int64_t(p.sets) * P * CT * (p.items + 1) * int64_t(sizeof(acc_t));
  p.smem_bytes = std::max(stage, shares);
  if (p.smem_bytes > dynamic_smem_limit() - kDirectStaticSmem || units * p.tiles >= (int64_t(1) << 31)) {
    return c10::nullopt;
  }
  return p;
}

// packed [G co_tiles, Cig, taps, CT]: weight [Ci, Cog, taps] with each tile's CT channels
// adjacent (zeros past the group's), so that a block's weights for a chunk of input channels
// are one contiguous run (read as rows of taps, a block's copies were 32 scattered values per
// warp, each landing on one of two banks).
template <typename scalar_t>
__global__ void pack_tile_weights_kernel(const scalar_t* __restrict__ weight, int64_t cig, int64_t cog,
                                         int64_t co_tiles, int64_t taps, int64_t total,
                                         scalar_t* __restrict__ packed) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const int64_t j = i % CT, tap = i / CT % taps, ci = i / (CT * taps) % cig, gt = i / (CT * taps * cig);
  const int64_t co = gt % co_tiles * CT + j, group = gt / co_tiles;
  packed[i] = co < cog ? weight[((group * cig + ci) * cog + co) * taps + tap] : scalar_t(0);
}

// Starts staging input channels [ci0, ci0 + n) of the block's group: x's box (zero outside
// x) at xs, [n][tile_d + kD - 1][rh][rw], and the tile's packed weights (pack_tile_weights)
// at ws, [n][taps][CT]. The caller waits for the copies.
template <typename scalar_t>
__device__ __forceinline__ void stage_chunk(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w_tile,
                                            const ConvGeometry& g, const Stride1Plan& p, int64_t x_channel0,
                                            int64_t ci0, int n, const int64_t origin[3], scalar_t* xs,
                                            scalar_t* ws) {
  const int64_t D = g.in_size[0], H = g.in_size[1], W = g.in_size[2];
  const int box_rows = p.region / p.rw;  // (d, h) rows of one channel's box
  // A warp stages one (d, h) row of the box for every channel, `width` lanes per row and 32 /
  // width channels at once where the rows are short.
  const int width = p.rw < 32 ? p.rw : 32, per_warp = 32 / width;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, first_ci = lane / width;
  if (first_ci < per_warp) {
    for (int q = warp; q < box_rows; q += kThreads / 32) {
      const int64_t id = origin[0] + q / p.rh, ih = origin[1] + q % p.rh;
      const bool row_inside = id >= 0 && id < D && ih >= 0 && ih < H;
      // this lane's first channel's row, and the step to its next channel's
      const scalar_t* row = x + (((x_channel0 + ci0 + first_ci) * D + (row_inside ? id : 0)) * H +
                                 (row_inside ? ih : 0)) * W;
      const int64_t row_step = per_warp * D * H * W;
      for (int ci = first_ci; ci < n; ci += per_warp, row += row_step) {
        for (int l = lane % width; l < p.rw; l += width) {
          const int64_t iw = origin[2] + l;
          const bool inside = row_inside && iw >= 0 && iw < W;
          copy_async(xs + (ci * box_rows + q) * p.rw + l, inside ? row + iw : x, inside);
        }
      }
    }
  }
  // The chunk's weights are one contiguous run of whole 16-byte vectors (CT values per tap).
  constexpr int kVec = 16 / sizeof(scalar_t);
  const scalar_t* src = w_tile + ci0 * g.taps() * CT;
  for (int i = threadIdx.x * kVec; i < n * static_cast<int>(g.taps()) * CT; i += kThreads * kVec) {
    copy_async_bytes<16>(ws + i, src + i, true);
  }
  copy_async_commit();
}

// Block: sample b, group, tile of CT output channels from co0, tile `tile` of output rows.
// energy [B, Co, tiles]: each tile's centred sum of squares per channel, all centred on the
// sample's mean, so that they add in the finalize.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 2)  // two blocks: at most 128 registers
    energy_direct_stride1_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ packed,
                                 const SampleSums sums, const ConvGeometry g, const Stride1Plan p,
                                 int64_t co_tiles, double* __restrict__ energy) {
  using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
  constexpr int P = positions_per_thread<acc_t>();
  const int64_t cig = g.in_group_channels(), cog = g.out_group_channels();
  const int64_t tile = blockIdx.x % p.tiles, unit = blockIdx.x / p.tiles;
  const int64_t co0 = unit % co_tiles * CT, group = unit / co_tiles % g.groups, b = unit / (co_tiles * g.groups);
  const int64_t od0 = tile / p.tiles_h * p.tile_d, oh0 = tile % p.tiles_h * p.tile_h;
  const int valid = static_cast<int>(std::min<int64_t>(CT, cog - co0));

  __shared__ acc_t shift[CT];
  extern __shared__ __align__(16) unsigned char smem[];
  scalar_t* xs = reinterpret_cast<scalar_t*>(smem);
  scalar_t* ws = xs + p.w_offset;
  // x's index at the box's first value: output index minus the taps' reach (tap k of output o
  // reads input o + pad - k)
  const int64_t origin[3] = {od0 + g.padding[0] - (g.kernel[0] - 1), oh0 + g.padding[1] - (g.kernel[1] - 1),
                             g.padding[2] - (g.kernel[2] - 1)};
  const int kD = static_cast<int>(g.kernel[0]), kH = static_cast<int>(g.kernel[1]), kW = static_cast<int>(g.kernel[2]);
  const int taps = kD * kH * kW;
  const int set = threadIdx.x / p.items, t = threadIdx.x % p.items;
  const int r = t / p.row_items, td = r / p.tile_h, th = r % p.tile_h;
  const int x_base = (td * p.rh + th) * p.rw + t % p.row_items;
  acc_t acc[P][CT];
#pragma unroll
  for (int i = 0; i < P; ++i)
#pragma unroll
    for (int j = 0; j < CT; ++j) acc[i][j] = acc_t(0);

  for (int64_t ci0 = 0; ci0 < cig; ci0 += p.chunk) {
    const int n = static_cast<int>(std::min<int64_t>(p.chunk, cig - ci0));
    __syncthreads();  // the previous chunk is read
    stage_chunk(x, packed + unit % (co_tiles * g.groups) * cig * taps * CT, g, p, b * g.in_channels + group * cig,
                ci0, n, origin, xs, ws);
    if (ci0 == 0) {  // while the first chunk's copies are in flight
      tile_shift<kThreads>(sums, b, group * cog + co0, valid, static_cast<double>(g.out_spatial()), shift);
    }
    copy_async_wait<0>();
    __syncthreads();
    if (set >= p.sets) continue;
    for (int ci = set; ci < n; ci += p.sets) {
      const scalar_t* xc = xs + ci * p.region + x_base;
      const scalar_t* wc = ws + (ci * taps + taps - 1) * CT;  // the loops walk the taps backwards
      for (int a = 0; a < kD; ++a) {
        for (int h = 0; h < kH; ++h) {
          const scalar_t* xr = xc + (a * p.rh + h) * p.rw;
#pragma unroll 3
          for (int c = 0; c < kW; ++c) {
            acc_t xv[P];
#pragma unroll
            for (int i = 0; i < P; ++i) xv[i] = static_cast<acc_t>(xr[c + i * p.row_items]);
            scalar_t wv[CT];
            load_tile_weights<CT>(wc, wv);
            wc -= CT;
#pragma unroll
            for (int i = 0; i < P; ++i)
#pragma unroll
              for (int j = 0; j < CT; ++j) acc[i][j] += xv[i] * static_cast<acc_t>(wv[j]);
          }
        }
      }
    }
  }

  __syncthreads();  // the stage becomes the sets' shares: [set][P][CT][items + 1]
  acc_t* shares = reinterpret_cast<acc_t*>(smem);
  const int row = p.items + 1;
  if (set < p.sets) {
#pragma unroll
    for (int i = 0; i < P; ++i)
#pragma unroll
      for (int j = 0; j < CT; ++j) shares[((set * P + i) * CT + j) * row + t] = acc[i][j];
  }
  __syncthreads();
  const int channel = threadIdx.x % CT;  // whose energy this thread sums
  double e = 0;
  for (int s = threadIdx.x / CT; s < P * p.items; s += kThreads / CT) {
    const int i = s / p.items, u = s % p.items, ur = u / p.row_items;
    const int64_t ow = u % p.row_items + i * p.row_items, od = od0 + ur / p.tile_h, oh = oh0 + ur % p.tile_h;
    if (ow >= g.out_size[2] || od >= g.out_size[0] || oh >= g.out_size[1]) continue;
    acc_t total = 0;
    for (int k = 0; k < p.sets; ++k) total += shares[((k * P + i) * CT + channel) * row + u];
    const acc_t d = total - shift[channel];
    e += static_cast<double>(d) * static_cast<double>(d);
  }
  write_channel_energy<kThreads>(e, valid, energy + (b * g.out_channels + group * cog + co0) * p.tiles + tile,
                                 p.tiles);
}

}  // namespace

at::Tensor energy_direct_stride1_cuda(const at::Tensor& x, const at::Tensor& weight, const SampleSumTensors& sums,
                                      const ConvGeometry& g) {
  if (!g.unit_steps()) return {};
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t co_tiles = direct_co_pad(g) / CT, units = g.batch * g.groups * co_tiles;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "energy_direct_stride1_cuda", [&] {
    const auto plan = stride1_plan<scalar_t>(g, units, sms);
    if (!plan) return at::Tensor();
    auto energy = at::empty({g.batch, g.out_channels, plan->tiles}, x.options().dtype(at::kDouble));
    const int64_t cig = g.in_group_channels(), taps = g.taps();
    auto packed = at::empty({g.groups * co_tiles, cig, taps, CT}, weight.options());
    const int64_t total = packed.numel();
    const auto stream = at::cuda::getCurrentCUDAStream();
    pack_tile_weights_kernel<scalar_t><<<static_cast<unsigned>(ceil_div(total, kThreads)), kThreads, 0, stream>>>(
        weight.data_ptr<scalar_t>(), cig, g.out_group_channels(), co_tiles, taps, total, packed.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto kernel = energy_direct_stride1_kernel<scalar_t>;
    allow_dynamic_smem(kernel, plan->smem_bytes);
    kernel<<<static_cast<unsigned>(units * plan->tiles), kThreads, static_cast<size_t>(plan->smem_bytes), stream>>>(
        x.data_ptr<scalar_t>(), packed.data_ptr<scalar_t>(), sums.view(g), g, *plan, co_tiles,
        energy.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return energy;
  });
}

}  // namespace fused_ops
