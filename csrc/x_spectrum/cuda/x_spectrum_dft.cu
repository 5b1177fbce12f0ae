// x's spectrum (x_spectrum.h) by DFT matrices in shared memory instead of cuFFT
// (docs/math.md §3.3.2). cuFFT needs x zero-padded to the grid and
// writes [B, Ci, F]: a pad copy, three passes and a scatter into [F, B, Ci]
// (docs/performance.md). Here the padding is never stored (a DFT over the
// first D, H, W inputs of a padded axis is the same sum) and the transposes fall out
// of the launches' layouts. Two launches per slice of the batch:
//   plane_dft:  one block per (b, d, 8 channels): the (h, w) plane's real DFT over W,
//               then over H (the W spectrum in shared memory with each H sum's inputs
//               adjacent: spec_offset), written as t [n, D, Lh, Lwf, Ci];
//   depth_dft:  one thread per (b, fh, fw, ci): the DFT over D, written into the
//               spectrum's [Ld, Lh, Lwf, B, Ci].
// With one depth position and frequency (D = Ld = 1: border's plane problems, docs/math.md
// §3.6) the DFT over D is the identity: plane_dft writes the spectrum itself
// (with_spectrum_steps) and depth_dft does not run (it would be a transposing copy of t,
// docs/performance.md).
// t is a slice of the batch small enough to stay in L2 between the two. Where an axis's
// grid is even, its DFT is split once by its inputs' index modulo 2 (H and D: 4 where the
// grid allows): 1/2 (1/4) of the multiply-adds, then an R-point butterfly per R outputs.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/cuda/dynamic_smem.h"
#include "common/cuda/build_apart.h"
#include "x_spectrum/cuda/x_spectrum_kernels.h"
#include "common/cuda/pdl.cuh"
#include "common/cuda/reduce.cuh"
#include "common/cuda/complex.cuh"
#include "message.h"
#include "common/table_cache.h"
#include "common/unit_roots.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPlanes = 8;  // channels per plane_dft block: 64 bytes of t per frequency
constexpr int kRowTile = 2;    // W stage: rows per thread
constexpr int kBinTiles[] = {3, 4, 5};  // W stage: bins per thread, chosen per problem (w_bin_tile)
constexpr int kFreqTile = 3;   // H stage: frequencies x bins per thread
// Bytes of t per launch pair: the slice of the batch whose t stays mostly in L2. Fewer,
// larger launches lose less to their last partial wave than depth_dft loses reading a larger
// t: on the seed problem the two kernels' time falls as the slice grows up to about this size
// (docs/performance.md).
constexpr int64_t kSliceBytes = int64_t(48) << 20;

// Loads in flight per thread where a kernel reads x, t or its tables: a block that loads
// its values one round trip at a time spends most of its time waiting, not multiplying
// (docs/performance.md).
constexpr int kLoads = 8;

// dst[i] = src[i] for i < n, by the block, kLoads loads per thread issued before
// their stores.
template <typename V>
__device__ __forceinline__ void copy_to_shared(V* dst, const V* __restrict__ src, int n) {
  for (int i0 = threadIdx.x; i0 < n; i0 += kThreads * kLoads) {
    V v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (i0 + u * kThreads < n) v[u] = src[i0 + u * kThreads];
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (i0 + u * kThreads < n) dst[i0 + u * kThreads] = v[u];
    }
  }
}

// The block's planes of x, `planes` (at most kMaxPlanes) runs of H W values `stride` apart,
// into rows of `pitch` values in shared memory, V (16 bytes, or one value) per load: a thread
// takes the same piece of every plane, all its loads issued before their stores. With
// kSums, sums[p] gathers the thread's share of plane p's sum in float64 (stage_plane_sums).
template <bool kSums, typename T, typename V>
__device__ __forceinline__ void load_planes(T* rows, const T* __restrict__ x, int64_t stride, int planes, int h,
                                            int w, int pitch, double (&sums)[kMaxPlanes]) {
  static_assert(kMaxPlanes <= kLoads, "a block's planes are one round of loads");
  constexpr int kPer = sizeof(V) / sizeof(T);
  const int per_plane = h * w / kPer;
  for (int q = threadIdx.x; q < per_plane; q += kThreads) {
    const int e = q * kPer;
    T* dst = rows + (e / w) * pitch + e % w;
    V v[kMaxPlanes];
#pragma unroll
    for (int p = 0; p < kMaxPlanes; ++p) {
      if (p < planes) v[p] = reinterpret_cast<const V*>(x + p * stride)[q];
    }
#pragma unroll
    for (int p = 0; p < kMaxPlanes; ++p) {
      if (p >= planes) break;
      const T* values = reinterpret_cast<const T*>(&v[p]);
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        dst[p * h * pitch + k] = values[k];
        if constexpr (kSums) sums[p] += static_cast<double>(values[k]);
      }
    }
  }
}

// Each warp's sums of the planes (load_planes) into red[warp][p], by shuffles; after a barrier,
// write_plane_sums adds the warps' in a fixed order, so the sums do not depend on scheduling.
constexpr int64_t kPlaneSumsSmem = kThreads / 32 * kMaxPlanes * sizeof(double);  // stage_plane_sums' red
__device__ __forceinline__ void stage_plane_sums(const double (&sums)[kMaxPlanes],
                                                 double (&red)[kThreads / 32][kMaxPlanes]) {
#pragma unroll
  for (int p = 0; p < kMaxPlanes; ++p) {
    const double s = warp_sum(sums[p]);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32][p] = s;
  }
}
__device__ __forceinline__ void write_plane_sums(const double (&red)[kThreads / 32][kMaxPlanes], int planes,
                                                 double* out, int64_t stride) {
  if (static_cast<int>(threadIdx.x) >= planes) return;
  double total = 0;
#pragma unroll
  for (int k = 0; k < kThreads / 32; ++k) total += red[k][threadIdx.x];
  out[threadIdx.x * stride] = total;
}

// kTile adjacent table entries: 16 bytes per load, two float2 entries at a time where the tile is
// even (rows of whole tiles keep each pair 16-byte aligned).
template <int kTile>
__device__ __forceinline__ void load_bins(const float2* src, float2 (&dst)[kTile]) {
#pragma unroll
  for (int j = 0; j < kTile; ++j) {
    if constexpr (kTile % 2 == 0) {
      if (j % 2 != 0) continue;
      const float4 v = *reinterpret_cast<const float4*>(src + j);
      dst[j] = float2{v.x, v.y};
      dst[j + 1] = float2{v.z, v.w};
    } else {
      dst[j] = src[j];
    }
  }
}
template <int kTile>
__device__ __forceinline__ void load_bins(const double2* src, double2 (&dst)[kTile]) {
#pragma unroll
  for (int j = 0; j < kTile; ++j) dst[j] = src[j];
}

// One axis's DFT matrix as the kernels read it, split once by a radix R dividing the grid L
// (1: direct): rows j < L / R, columns a < ceil(n / R), entry exp(-2 pi i R a j / L), then
// the twiddles exp(-2 pi i c j / L) for c = 1 .. R - 1 (rows each). Z_c, the sum over the
// inputs c, c + R, ..., times its twiddle is Y_c, and the outputs j + m L / R are the R-point
// DFT of the Y_c: (Y_0 + Y_1, Y_0 - Y_1) for R = 2; for R = 4, sum_c (-i)^(c m) Y_c.
struct AxisDft {
  int64_t grid = 0, inputs = 0, radix = 1;
  int64_t rows() const { return grid / radix; }
  int64_t columns() const { return (inputs + radix - 1) / radix; }
  int64_t twiddles() const { return (radix - 1) * rows(); }
};

// The largest radix of {4, 2} up to `most` that divides the grid, else 1.
AxisDft axis_dft(int64_t grid, int64_t inputs, int64_t most) {
  const int64_t radix = most >= 4 && grid % 4 == 0 ? 4 : most >= 2 && grid % 2 == 0 ? 2 : 1;
  return AxisDft{grid, inputs, radix};
}

// [rows, cols] complex128: exp(-2 pi i ((r * step * c) mod size) / size).
at::Tensor dft_matrix(int64_t size, int64_t rows, int64_t step, int64_t cols, const at::TensorOptions& opts) {
  return unit_roots(size, rows, step, at::arange(cols, opts.dtype(at::kLong)), -1.0);
}

// The twiddles of a split `axis` (radix R > 1), flat [R - 1, rows]: exp(-2 pi i c j / L).
at::Tensor axis_twiddles(const AxisDft& axis, const at::TensorOptions& opts) {
  return dft_matrix(axis.grid, axis.radix, 1, axis.rows(), opts).narrow(0, 1, axis.radix - 1).reshape(-1);
}

// The matrix of `axis` transposed, [cols, rows], with its twiddles appended, flat: the H
// stage's kFreqTile rows of one column are adjacent.
at::Tensor axis_table(const AxisDft& axis, const at::TensorOptions& opts) {
  std::vector<at::Tensor> parts = {
      dft_matrix(axis.grid, axis.rows(), axis.radix, axis.columns(), opts).t().reshape(-1)};
  if (axis.radix > 1) parts.push_back(axis_twiddles(axis, opts));
  return at::cat(parts);
}

// Sizes of one problem's transforms and where their tables sit in one flat tensor
// of x's complex dtype: W [cols, bins] then its twiddles (bins padded to whole tiles), H
// [cols, rows] then its twiddles, D [cols, rows] then its twiddles [R - 1, rows] (D's rows
// padded to whole passes of depth_dft).
struct Plan {
  int64_t d, h, w, ld, lh, lw, lwf;
  AxisDft axis_w, axis_h, axis_d;
  // W's bins: x is real, so its sums past the middle of their rows are conjugates of those
  // before it (w_stage).
  int64_t w_bins, w_bin_tile, w_bins_pad;
  int64_t h_rows_pad;  // H's input rows in shared memory: a multiple of its radix
  int64_t depth_tile;  // depth_dft's accumulator rows per pass (its template)
  int64_t depth_rows_pad;
  int64_t d_off;  // in complex entries: W's and H's tables come first, adjacent
  int64_t w_table() const { return (axis_w.columns() + axis_w.radix - 1) * w_bins_pad; }
  int64_t h_table() const { return axis_h.rows() * axis_h.columns() + axis_h.twiddles(); }
  int64_t d_table() const { return (axis_d.columns() + axis_d.radix - 1) * depth_rows_pad; }
};

constexpr int kDepthTiles[] = {4, 5, 8, 10, 12, 16};
// depth_dft's sums per thread and pass (tile x radix): 64 (radix 4, 16 rows) exhausts the
// registers and spills to the stack in float64.
constexpr int kMaxDepthSums = 32;

// The W stage's bins per thread: its threads take kRowTile rows by that many bins each, in
// rounds of kThreads; the tile that leaves each thread the fewest bins over its rounds. The
// seed problem's 256 rows of 10 bins: 5, one round of 256 items, where 4 takes two rounds
// (384 items, the second half idle) and 8 bins per thread.
int64_t w_bin_tile(int64_t bins, int64_t rows) {
  int64_t best = 0, best_cost = 0;
  for (const int tile : kBinTiles) {
    const int64_t items = (rows + kRowTile - 1) / kRowTile * ((bins + tile - 1) / tile);
    const int64_t cost = (items + kThreads - 1) / kThreads * tile;
    if (best == 0 || cost < best_cost) best = tile, best_cost = cost;
  }
  return best;
}

Plan make_plan(const at::Tensor& x, const int64_t grid[3]) {
  Plan p;
  p.d = x.size(2), p.h = x.size(3), p.w = x.size(4);
  p.ld = grid[0], p.lh = grid[1], p.lw = grid[2], p.lwf = grid[2] / 2 + 1;
  p.axis_w = axis_dft(p.lw, p.w, 2);
  p.w_bins = p.axis_w.rows() / 2 + 1;
  p.w_bin_tile = w_bin_tile(p.w_bins, std::min<int64_t>(kMaxPlanes, x.size(1)) * p.h);
  p.w_bins_pad = (p.w_bins + p.w_bin_tile - 1) / p.w_bin_tile * p.w_bin_tile;
  p.axis_h = axis_dft(p.lh, p.h, 4);
  p.axis_d = axis_dft(p.ld, p.d, 4);
  p.h_rows_pad = p.axis_h.columns() * p.axis_h.radix;
  // The smallest tile that takes every row in one pass, else the largest (several passes).
  const int64_t rows = p.axis_d.rows();
  p.depth_tile = 0;
  for (const int tile : kDepthTiles) {
    if (tile * p.axis_d.radix > kMaxDepthSums) break;
    p.depth_tile = tile;
    if (tile >= rows) break;
  }
  p.depth_rows_pad = (rows + p.depth_tile - 1) / p.depth_tile * p.depth_tile;
  p.d_off = p.w_table() + p.h_table();
  return p;
}

// W's table, flat [cols + R - 1, w_bins_pad]: its split's matrix (AxisDft) transposed, to the
// w_bins sums of each row that w_stage computes, then their twiddles.
at::Tensor w_table(const Plan& p, const at::TensorOptions& opts) {
  const AxisDft& axis = p.axis_w;
  const at::Tensor twiddles = dft_matrix(axis.grid, axis.radix, 1, p.w_bins, opts).narrow(0, 1, axis.radix - 1);
  const at::Tensor table = at::cat({dft_matrix(axis.grid, axis.columns(), axis.radix, p.w_bins, opts), twiddles});
  return at::constant_pad_nd(table, {0, p.w_bins_pad - p.w_bins}).reshape(-1);
}

at::Tensor build_tables(const Plan& p, const at::TensorOptions& opts, at::ScalarType complex) {
  const at::Tensor h_table = axis_table(p.axis_h, opts);
  const int64_t pad = p.depth_rows_pad - p.axis_d.rows();
  std::vector<at::Tensor> parts = {w_table(p, opts), h_table,
                                   at::constant_pad_nd(dft_matrix(p.ld, p.axis_d.rows(), p.axis_d.radix,
                                                                  p.axis_d.columns(), opts)
                                                           .t(),
                                                       {0, pad})
                                       .reshape(-1)};
  if (p.axis_d.radix > 1) {
    parts.push_back(
        at::constant_pad_nd(axis_twiddles(p.axis_d, opts).view({p.axis_d.radix - 1, p.axis_d.rows()}), {0, pad})
            .reshape(-1));
  }
  const at::Tensor tables = at::cat(parts).to(complex);
  TORCH_INTERNAL_ASSERT(tables.numel() == p.d_off + p.d_table());
  return tables;
}

// The W stage's work items for a block of `planes` channels: kRowTile rows by w_bin_tile bins.
int64_t w_stage_items(const Plan& p, int64_t planes) {
  return (planes * p.h + kRowTile - 1) / kRowTile * (p.w_bins_pad / p.w_bin_tile);
}

struct PlaneArgs {
  const void* x;     // the slice's x, [n, Ci, D, H, W]
  void* t;           // [n, D, Lh, Lwf, Ci], or the spectrum from the slice's first sample on (with_spectrum_steps)
  const void* table; // Plan::tables
  int64_t ci, planes_per_block;
  int d, h, w, lh, lwf, h_rows_pad, h_rows, h_cols, slice_stride;
  int w_radix, w_cols, w_bins, w_bins_pad;
  // t's steps, in entries, from one (b, d) to the next, from frequency fh to fh + 1, fh to
  // fh + Lh / R (the H stage's radix R), bin fw to fw + 1 and to fw + ceil(Lwf / 2): kernel
  // parameters, so that the H stage's stores take them from constant memory rather than
  // registers.
  int64_t t_sample, t_freq, t_split, t_fw, t_bin;
  bool vector_loads;  // rows of x are whole 16-byte pieces, 16-byte aligned
  bool rows_in_spec;  // x's rows in the plane spectrum's memory (PlaneSmem)
  double* plane_sums;  // the slice's [n, Ci, D] of x_spectrum's plane sums, or null
};

// Shared memory of plane_dft, in units of C (x's rows are T, at the end). Where the W stage
// takes every row in one round, x's rows go in the plane spectrum's memory, which the stage
// writes only after its reads (w_stage): on the seed problem 46 KB instead of 80, so the
// registers (80) rather than the shared memory bound the blocks per SM, three instead of two
// (a small gain: occupancy is not what bounds plane_dft, docs/performance.md).
struct PlaneSmem {
  int64_t tables, planes, x_rows;
  bool rows_in_spec;
  int64_t bytes(int64_t complex_size) const {
    const int64_t rows = x_rows * (complex_size / 2), spec = planes * complex_size;
    return tables * complex_size + (rows_in_spec ? std::max(rows, spec) : rows + spec);
  }
};

// The plane spectrum's rows are `slice_stride` apart, with slice_stride = 2 (mod 16)
// entries of 8 bytes: the H stage's threads (channel fastest, then bin) then read
// distinct banks.
int64_t plane_slice_stride(int64_t rows, int64_t lwf) {
  const int64_t n = rows * lwf;
  return n + ((2 - n % 16) + 16) % 16;
}

PlaneSmem plane_smem(const Plan& p, int64_t planes) {
  PlaneSmem s;
  s.tables = p.d_off + p.d_off % 2;  // W's and H's, then an entry to align the plane spectrum to 16 bytes
  s.planes = planes * plane_slice_stride(p.h_rows_pad, p.lwf);
  s.x_rows = planes * p.h * (p.w + 1);
  s.rows_in_spec = w_stage_items(p, planes) <= kThreads;
  return s;
}

// The outputs j + m L / R, m < R, of one split DFT from its sums z[c] over the inputs c,
// c + R, ... (AxisDft); twiddles: the H table's, [R - 1][rows].
template <int kRadix, typename C>
__device__ __forceinline__ void split_outputs(C (&z)[kRadix], const C* twiddles, int rows, int j, C (&out)[kRadix]) {
  C y[kRadix];
  y[0] = z[0];
#pragma unroll
  for (int c = 1; c < kRadix; ++c) y[c] = cmul(twiddles[(c - 1) * rows + j], z[c]);
  if constexpr (kRadix == 1) {
    out[0] = y[0];
  } else if constexpr (kRadix == 2) {
    out[0] = C{y[0].x + y[1].x, y[0].y + y[1].y};
    out[1] = C{y[0].x - y[1].x, y[0].y - y[1].y};
  } else {
    static_assert(kRadix == 4, "radix 1, 2 or 4");
    const C s02{y[0].x + y[2].x, y[0].y + y[2].y}, d02{y[0].x - y[2].x, y[0].y - y[2].y};
    const C s13{y[1].x + y[3].x, y[1].y + y[3].y}, d13{y[1].x - y[3].x, y[1].y - y[3].y};
    out[0] = C{s02.x + s13.x, s02.y + s13.y};
    out[2] = C{s02.x - s13.x, s02.y - s13.y};
    out[1] = C{d02.x + d13.y, d02.y - d13.x};  // y0 - i y1 - y2 + i y3
    out[3] = C{d02.x - d13.y, d02.y + d13.x};  // y0 + i y1 - y2 - i y3
  }
}

// Where the plane spectrum's value (h, fw) lies in its plane's rows: the H stage's radix R
// inputs h = R g + c adjacent, [g][fw][c], so that a thread's R values of one sum are one
// or two 16-byte loads at one address (H stage).
template <int kHRadix>
__device__ __forceinline__ int spec_offset(int h, int fw, int lwf) {
  return (h / kHRadix * lwf + fw) * kHRadix + h % kHRadix;
}

// The W stage: spec[plane][h][fw] = sum_w x[plane][h][w] exp(-2 pi i fw w / Lw), kRowTile
// rows (strided by the tile count, so a warp's rows are adjacent) x kBinTile bins per thread;
// `table`: Plan's W table. Split (kRadix 2, Lw = 2 L2), the sums E over the even w and O over
// the odd ones are DFTs on L2 of real values, so E(L2 - k) = conj E(k), and likewise O; with
// t = exp(-2 pi i / Lw), t^(L2 - k) = -conj t^k, so the w_bins = L2 / 2 + 1 sums k give both
// X(k) = E + t^k O and X(L2 - k) = conj(E - t^k O): about half the direct multiply-adds.
template <int kRadix, int kHRadix, int kBinTile, typename T, typename C>
__device__ __forceinline__ void w_stage(const PlaneArgs& a, const T* rows, int row_pitch, int row_count,
                                        const C* table, C* spec) {
  const int row_tiles = (row_count + kRowTile - 1) / kRowTile, items = row_tiles * (a.w_bins_pad / kBinTile);
  for (int t0 = 0; t0 < items; t0 += kThreads) {  // the same rounds for every thread (the barrier below)
    const int t = t0 + threadIdx.x, tr = t % row_tiles, k0 = (t / row_tiles) * kBinTile;
    const T* row[kRowTile];
#pragma unroll
    for (int i = 0; i < kRowTile; ++i) row[i] = rows + min(tr + i * row_tiles, row_count - 1) * row_pitch;
    C acc[kRowTile][kRadix][kBinTile];  // [row][w mod R][bin]
#pragma unroll
    for (int i = 0; i < kRowTile; ++i)
#pragma unroll
      for (int c = 0; c < kRadix; ++c)
#pragma unroll
        for (int j = 0; j < kBinTile; ++j) acc[i][c][j] = C{0, 0};
    for (int col = 0; col < (t < items ? a.w_cols : 0); ++col) {
      C f[kBinTile];
      load_bins(table + col * a.w_bins_pad + k0, f);
#pragma unroll
      for (int i = 0; i < kRowTile; ++i) {
#pragma unroll
        for (int c = 0; c < kRadix; ++c) {
          const T v = row[i][col * kRadix + c];
#pragma unroll
          for (int j = 0; j < kBinTile; ++j) {
            acc[i][c][j].x = fma(v, f[j].x, acc[i][c][j].x);
            acc[i][c][j].y = fma(v, f[j].y, acc[i][c][j].y);
          }
        }
      }
    }
    if (a.rows_in_spec) __syncthreads();  // x's rows are read; spec overwrites them (PlaneSmem)
    if (t >= items) continue;
    C twiddles[kBinTile];
    if constexpr (kRadix == 2) load_bins(table + a.w_cols * a.w_bins_pad + k0, twiddles);
#pragma unroll
    for (int i = 0; i < kRowTile; ++i) {
      const int r = tr + i * row_tiles;
      if (r >= row_count) continue;
      C* out = spec + (r / a.h) * a.slice_stride + spec_offset<kHRadix>(r % a.h, 0, a.lwf);
#pragma unroll
      for (int j = 0; j < kBinTile; ++j) {
        const int k = k0 + j;
        if (k >= a.w_bins) continue;
        if constexpr (kRadix == 1) {
          out[k * kHRadix] = acc[i][0][j];
        } else {
          const C e = acc[i][0][j], o = cmul(twiddles[j], acc[i][1][j]);
          out[k * kHRadix] = C{e.x + o.x, e.y + o.y};
          if (2 * k != a.lwf - 1) out[(a.lwf - 1 - k) * kHRadix] = C{e.x - o.x, o.y - e.y};  // L2 even: k = L2 / 2 once
        }
      }
    }
  }
}

// Three blocks per SM for float32 where the shared memory allows (PlaneSmem): 80 registers, no
// spill; float64's sums need more.
template <typename T, int kRadix, int kBinTile>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 4 ? 3 : 1) plane_dft_kernel(PlaneArgs a) {
  using C = typename ComplexOf<T>::type;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  pdl_chain_start();
  // The block's (b, d, group of channels), fewer than 2^31 (x_spectrum_dft_cuda): 32-bit
  // divisions, and fewer registers held through the stages than 64-bit values.
  const int groups = static_cast<int>((a.ci + a.planes_per_block - 1) / a.planes_per_block);
  const int unit = blockIdx.x, group = unit % groups, bd = unit / groups;  // bd = b D + d
  const int d = bd % a.d, b = bd / a.d;
  const int64_t ci0 = int64_t(group) * a.planes_per_block;
  const int planes = static_cast<int>(a.ci - ci0 < a.planes_per_block ? a.ci - ci0 : a.planes_per_block);
  // The W and H tables, adjacent in Plan::tables, staged together: read through L1 instead,
  // their loads slow plane_dft markedly (docs/performance.md).
  const int w_table_n = (a.w_cols + a.w_radix - 1) * a.w_bins_pad, h_table_n = a.h_rows * (a.h_cols + kRadix - 1);
  C* w_table = reinterpret_cast<C*>(smem_bytes);
  C* h_table = w_table + w_table_n;
  // [planes][slice_stride]: the plane's DFT over W, (h, fw) at spec_offset; 16-byte aligned
  // (PlaneSmem::tables)
  C* spec = h_table + (w_table_n + h_table_n) % 2 + h_table_n;
  copy_to_shared(w_table, static_cast<const C*>(a.table), w_table_n + h_table_n);
  // [planes * H][W + 1]
  T* rows = reinterpret_cast<T*>(a.rows_in_spec ? spec : spec + a.planes_per_block * a.slice_stride);
  const int row_pitch = a.w + 1;  // odd: a warp's rows fall in distinct banks

  const T* x = static_cast<const T*>(a.x) + ((b * a.ci + ci0) * a.d + d) * (a.h * a.w);
  const int64_t plane_stride = int64_t(a.d) * a.h * a.w;
  using V = typename ComplexOf<T>::vec16;
  __shared__ double plane_red[kThreads / 32][kMaxPlanes];
  double sums[kMaxPlanes] = {};
  if (a.plane_sums == nullptr && a.vector_loads) {
    load_planes<false, T, V>(rows, x, plane_stride, planes, a.h, a.w, row_pitch, sums);
  } else if (a.plane_sums == nullptr) {
    load_planes<false, T, T>(rows, x, plane_stride, planes, a.h, a.w, row_pitch, sums);
  } else {
    if (a.vector_loads) {
      load_planes<true, T, V>(rows, x, plane_stride, planes, a.h, a.w, row_pitch, sums);
    } else {
      load_planes<true, T, T>(rows, x, plane_stride, planes, a.h, a.w, row_pitch, sums);
    }
    stage_plane_sums(sums, plane_red);
  }
  // W odd: the split W stage reads x in pairs, the last one's odd input past the row: a zero.
  for (int r = threadIdx.x; r < planes * a.h; r += kThreads) rows[r * row_pitch + a.w] = T(0);
  __syncthreads();
  if (a.plane_sums != nullptr) write_plane_sums(plane_red, planes, a.plane_sums + (b * a.ci + ci0) * a.d + d, a.d);

  if (a.w_radix == 2) {
    w_stage<2, kRadix, kBinTile>(a, rows, row_pitch, planes * a.h, w_table, spec);
  } else {
    w_stage<1, kRadix, kBinTile>(a, rows, row_pitch, planes * a.h, w_table, spec);
  }
  // H not a multiple of the radix: zero rows, the last sums' missing inputs (after the W
  // stage: they may lie over x's rows).
  const int pad_values = (a.h_rows_pad - a.h) * a.lwf;
  for (int i = threadIdx.x; i < planes * pad_values; i += kThreads) {
    const int e = i % pad_values;
    spec[(i / pad_values) * a.slice_stride + spec_offset<kRadix>(a.h + e / a.lwf, e % a.lwf, a.lwf)] = C{0, 0};
  }
  __syncthreads();

  // H stage: kFreqTile frequencies (rows of the H table) x 2 bins per thread, the
  // channel fastest among threads, so that a warp's stores to t are whole 32-byte pieces.
  // Addresses as pointers stepped by block-wide strides, computed once: indexed per load
  // and store, their 64-bit products take most of the stage's instructions (SASS of
  // <float, 4, 5>).
  const int half = (a.lwf + 1) / 2, columns = planes * half;
  const int freq_tiles = (a.h_rows + kFreqTile - 1) / kFreqTile;
  const int group_step = kRadix * a.lwf;  // spec's step per column of the H table (kRadix rows h)
  const C* const twiddles = h_table + a.h_rows * a.h_cols;
  for (int t = threadIdx.x; t < columns * freq_tiles; t += kThreads) {
    const int column = t % columns, j0 = (t / columns) * kFreqTile;
    const int plane = column % planes, fw_a = column / planes, fw_b = min(fw_a + half, a.lwf - 1);
    const C* in_a = spec + plane * a.slice_stride + fw_a * kRadix;
    const C* in_b = in_a + (fw_b - fw_a) * kRadix;
    // The H table's rows j0 .. j0 + kFreqTile - 1 of each column; those past the last row read
    // the next column's, or the twiddles, the alignment entry or the plane spectrum after the
    // last (PlaneSmem): sums that are never stored.
    const C* f_col = h_table + j0;
    C z[2][kFreqTile][kRadix];  // [bin][frequency][sum]
#pragma unroll
    for (int i = 0; i < kFreqTile; ++i)
#pragma unroll
      for (int c = 0; c < kRadix; ++c) z[0][i][c] = z[1][i][c] = C{0, 0};
    for (int col = 0; col < a.h_cols; ++col) {
      C v[2][kRadix];
      load_bins(in_a, v[0]);
      load_bins(in_b, v[1]);
      in_a += group_step;
      in_b += group_step;
#pragma unroll
      for (int i = 0; i < kFreqTile; ++i) {
        const C f = f_col[i];
#pragma unroll
        for (int c = 0; c < kRadix; ++c) {
          add_product(z[0][i][c], f, v[0][c]);
          add_product(z[1][i][c], f, v[1][c]);
        }
      }
      f_col += a.h_rows;
    }
    // t[b, d, j0, fw_a, ci0 + plane]
    C* const out = static_cast<C*>(a.t) + (bd * a.t_sample + ci0 + j0 * a.t_freq + fw_a * a.t_fw + plane);
#pragma unroll
    for (int i = 0; i < kFreqTile; ++i) {
      const int j = j0 + i;
      if (j >= a.h_rows) continue;
      C* const out_j = out + i * a.t_freq;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (k == 1 && fw_a + half >= a.lwf) continue;
        C* const out_jk = k == 0 ? out_j : out_j + a.t_bin;
        C y[kRadix];
        split_outputs<kRadix>(z[k][i], twiddles, a.h_rows, j, y);
#pragma unroll
        for (int m = 0; m < kRadix; ++m) out_jk[m * a.t_split] = y[m];
      }
    }
  }
}

struct DepthArgs {
  const void* t;      // [n, D, Lh, Lwf, Ci]
  void* spectrum;     // [Ld, Lh, Lwf, B, Ci]
  const void* table;  // Plan::tables
  int64_t columns;    // Lh Lwf Ci: one sample's columns
  int64_t threads;    // n columns
  int64_t batch, b0, ci, d_off;
  int d, rows, cols, rows_pad;
  // The slice's [n, Ci, D] plane sums (plane_dft's) and [n, Ci] of x_spectrum's channel sums, or
  // null: the threads of the columns (b, 0, 0, ci) add the planes in order of d. Here, not in the
  // finalize, which contracts each sample's sums with the weight's once per channel (D parts
  // multiply its work), nor in an ATen sum (a launch of its own; docs/performance.md).
  const double* plane_sums;
  double* channel_sums;
};

// One thread per column (b, fh, fw, ci); kTile rows of the split D table (AxisDft) per pass
// over the column's D values, each row's kRadix sums combined by split_outputs.
template <typename T, int kRadix, int kTile>
__global__ void __launch_bounds__(kThreads) depth_dft_kernel(DepthArgs a) {
  using C = typename ComplexOf<T>::type;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  pdl_chain_start();
  C* table = reinterpret_cast<C*>(smem_bytes);  // [cols][rows_pad], then the twiddles [kRadix - 1][rows_pad]
  copy_to_shared(table, static_cast<const C*>(a.table) + a.d_off, (a.cols + kRadix - 1) * a.rows_pad);
  __syncthreads();
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= a.threads) return;
  const int64_t b = e / a.columns, column = e % a.columns;
  if (a.channel_sums != nullptr && column < a.ci) {
    const double* planes = a.plane_sums + (b * a.ci + column) * a.d;
    double s = 0;
    for (int d = 0; d < a.d; ++d) s += planes[d];
    a.channel_sums[b * a.ci + column] = s;
  }
  const C* __restrict__ in = static_cast<const C*>(a.t) + b * a.d * a.columns + column;
  const int64_t pos = column / a.ci, ci = column % a.ci;
  // spectrum[fd][pos][b0 + b][ci], pos = (fh, fw)
  const int64_t positions = a.columns / a.ci;
  C* out = static_cast<C*>(a.spectrum) + (pos * a.batch + a.b0 + b) * a.ci + ci;
  const int64_t fd_stride = positions * a.batch * a.ci;
  constexpr int kChunk = kLoads / kRadix;  // columns of the table per round of loads (kRadix values each)
  static_assert(kChunk >= 1, "a round of loads holds a column's values");
  for (int j0 = 0; j0 < a.rows; j0 += kTile) {
    C z[kTile][kRadix];  // [row][d mod R]
#pragma unroll
    for (int i = 0; i < kTile; ++i)
#pragma unroll
      for (int r = 0; r < kRadix; ++r) z[i][r] = C{0, 0};
    for (int c0 = 0; c0 < a.cols; c0 += kChunk) {
      C v[kChunk][kRadix];
#pragma unroll
      for (int u = 0; u < kChunk; ++u) {
#pragma unroll
        for (int r = 0; r < kRadix; ++r) {
          const int dd = (c0 + u) * kRadix + r;
          v[u][r] = c0 + u < a.cols && dd < a.d ? in[int64_t(dd) * a.columns] : C{0, 0};
        }
      }
#pragma unroll
      for (int u = 0; u < kChunk; ++u) {
        if (c0 + u >= a.cols) break;
        const C* f = table + (c0 + u) * a.rows_pad + j0;
#pragma unroll
        for (int i = 0; i < kTile; ++i) {
#pragma unroll
          for (int r = 0; r < kRadix; ++r) add_product(z[i][r], f[i], v[u][r]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kTile; ++i) {
      const int j = j0 + i;
      if (j >= a.rows) break;
      C y[kRadix];
      split_outputs<kRadix>(z[i], table + a.cols * a.rows_pad, a.rows_pad, j, y);
#pragma unroll
      for (int m = 0; m < kRadix; ++m) out[(j + m * a.rows) * fd_stride] = y[m];
    }
  }
}

template <typename T, int kBinTile>
void launch_plane(int64_t radix, const PlaneArgs& args, int64_t blocks, int64_t smem, cudaStream_t stream) {
  auto kernel = radix == 4   ? plane_dft_kernel<T, 4, kBinTile>
                : radix == 2 ? plane_dft_kernel<T, 2, kBinTile>
                             : plane_dft_kernel<T, 1, kBinTile>;
  allow_dynamic_smem(kernel, smem);
  launch_overlapping(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), static_cast<size_t>(smem), stream,
                     args);
}

template <typename T>
void launch_plane(const Plan& p, const PlaneArgs& args, int64_t blocks, int64_t smem, cudaStream_t stream) {
  static_assert(sizeof(kBinTiles) / sizeof(kBinTiles[0]) == 3, "a launch per tile of kBinTiles");
  switch (p.w_bin_tile) {
    case 3: return launch_plane<T, 3>(p.axis_h.radix, args, blocks, smem, stream);
    case 4: return launch_plane<T, 4>(p.axis_h.radix, args, blocks, smem, stream);
    default: return launch_plane<T, 5>(p.axis_h.radix, args, blocks, smem, stream);
  }
}

template <typename T, int kRadix, int kTile>
void launch_depth_tile(const DepthArgs& args, int64_t blocks, int64_t smem, cudaStream_t stream) {
  if constexpr (kTile * kRadix <= kMaxDepthSums) {
    auto kernel = depth_dft_kernel<T, kRadix, kTile>;
    allow_dynamic_smem(kernel, smem);
    launch_overlapping(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), static_cast<size_t>(smem), stream,
                       args);
  } else {
    TORCH_INTERNAL_ASSERT(false, "depth_dft: no tile of ", kTile, " rows at radix ", kRadix, " (make_plan)");
  }
}

template <typename T, int kRadix>
void launch_depth(int64_t tile, const DepthArgs& args, int64_t blocks, int64_t smem, cudaStream_t stream) {
  static_assert(sizeof(kDepthTiles) / sizeof(kDepthTiles[0]) == 6, "a launch per tile of kDepthTiles");
  switch (tile) {
    case 4: return launch_depth_tile<T, kRadix, 4>(args, blocks, smem, stream);
    case 5: return launch_depth_tile<T, kRadix, 5>(args, blocks, smem, stream);
    case 8: return launch_depth_tile<T, kRadix, 8>(args, blocks, smem, stream);
    case 10: return launch_depth_tile<T, kRadix, 10>(args, blocks, smem, stream);
    case 12: return launch_depth_tile<T, kRadix, 12>(args, blocks, smem, stream);
    default: return launch_depth_tile<T, kRadix, 16>(args, blocks, smem, stream);
  }
}

template <typename T>
void launch_depth(const Plan& p, const DepthArgs& args, int64_t blocks, int64_t smem, cudaStream_t stream) {
  switch (p.axis_d.radix) {
    case 4: return launch_depth<T, 4>(p.depth_tile, args, blocks, smem, stream);
    case 2: return launch_depth<T, 2>(p.depth_tile, args, blocks, smem, stream);
    default: return launch_depth<T, 1>(p.depth_tile, args, blocks, smem, stream);
  }
}

// The plan's tables on x's device, cached per device (table_cache.h).
at::Tensor tables_for(const Plan& p, const at::Tensor& x, at::ScalarType complex) {
  static auto* cache = new TableCache<at::Tensor>();  // never destroyed: CUDA tensors at exit
  std::vector<int64_t> key = {p.d, p.h, p.w, p.ld, p.lh, p.lw, p.w_bin_tile, static_cast<int64_t>(complex)};
  return cache->get(std::move(key), x.device(), build_tables_apart_cuda,
                    [&] { return build_tables(p, x.options(), complex); });
}

// a's store steps (PlaneArgs) where bin fw + 1 lies t_fw entries past fw and the next (b, d) t_sample past.
void set_store_steps(PlaneArgs& a, const Plan& p, int64_t t_fw, int64_t t_sample) {
  a.t_fw = t_fw;
  a.t_freq = p.lwf * t_fw;
  a.t_sample = t_sample;
  a.t_split = p.axis_h.rows() * a.t_freq;
  a.t_bin = (p.lwf + 1) / 2 * t_fw;
}

PlaneArgs plane_args(const Plan& p, const at::Tensor& tables, const at::Tensor& t, int64_t ci, int64_t planes) {
  PlaneArgs a;
  a.t = t.data_ptr();
  a.table = tables.data_ptr();
  a.ci = ci;
  a.planes_per_block = planes;
  a.d = static_cast<int>(p.d), a.h = static_cast<int>(p.h), a.w = static_cast<int>(p.w);
  a.lh = static_cast<int>(p.lh), a.lwf = static_cast<int>(p.lwf);
  a.w_radix = static_cast<int>(p.axis_w.radix), a.w_cols = static_cast<int>(p.axis_w.columns());
  a.w_bins = static_cast<int>(p.w_bins), a.w_bins_pad = static_cast<int>(p.w_bins_pad);
  a.h_rows_pad = static_cast<int>(p.h_rows_pad);
  a.h_rows = static_cast<int>(p.axis_h.rows()), a.h_cols = static_cast<int>(p.axis_h.columns());
  a.slice_stride = static_cast<int>(plane_slice_stride(p.h_rows_pad, p.lwf));
  set_store_steps(a, p, ci, p.lh * p.lwf * ci);
  a.rows_in_spec = plane_smem(p, planes).rows_in_spec;
  return a;
}

// a's stores into the spectrum [1, Lh, Lwf, B, Ci] instead of t (D = Ld = 1): (b, fh, fw, ci)
// at ((fh Lwf + fw) B + b) Ci + ci from the spectrum's start.
void with_spectrum_steps(PlaneArgs& a, const Plan& p, int64_t batch) { set_store_steps(a, p, batch * a.ci, a.ci); }

DepthArgs depth_args(const Plan& p, const at::Tensor& tables, const at::Tensor& t, const at::Tensor& spectrum) {
  DepthArgs a;
  a.t = t.data_ptr();
  a.spectrum = spectrum.data_ptr();
  a.table = tables.data_ptr();
  a.batch = spectrum.size(3);
  a.ci = spectrum.size(4);
  a.columns = p.lh * p.lwf * a.ci;
  a.d_off = p.d_off;
  a.d = static_cast<int>(p.d);
  a.rows = static_cast<int>(p.axis_d.rows()), a.cols = static_cast<int>(p.axis_d.columns());
  a.rows_pad = static_cast<int>(p.depth_rows_pad);
  return a;
}

}  // namespace

bool x_spectrum_dft_cuda(const at::Tensor& x, const int64_t grid[3], const at::Tensor& spectrum,
                         const at::Tensor& channel_sums) {
  const bool is_double = x.scalar_type() == at::kDouble;
  if (!(is_double || x.scalar_type() == at::kFloat)) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t csize = is_double ? 16 : 8;
  const Plan p = make_plan(x, grid);
  const int64_t batch = x.size(0), ci = x.size(1), columns = p.lh * p.lwf * ci;
  const bool planes_only = p.d == 1 && p.ld == 1;  // plane_dft writes the spectrum (with_spectrum_steps)
  // Without t, one launch for the batch, unless x is to be copied (another layout): a slice at a time.
  const int64_t slice = planes_only && x.is_contiguous()
                            ? batch
                            : std::clamp<int64_t>(kSliceBytes / (p.d * columns * csize), 1, batch);
  // Blocks of up to kMaxPlanes channels, fewer where their shared memory does not fit or
  // where there would be fewer than two blocks per SM (small problems: latency-bound);
  // a plane that does not fit at all leaves x to cuFFT.
  const int64_t limit = dynamic_smem_limit() - kPlaneSumsSmem;  // plane_dft's static shared memory
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t planes = std::min<int64_t>(kMaxPlanes, ci);
  while (planes > 1 && (plane_smem(p, planes).bytes(csize) > limit ||
                        slice * p.d * ((ci + planes - 1) / planes) < 2 * sms)) {
    planes = (planes + 1) / 2;
  }
  const int64_t plane_bytes = plane_smem(p, planes).bytes(csize), depth_bytes = p.d_table() * csize;
  if (plane_bytes > limit || depth_bytes > limit + kPlaneSumsSmem) return false;
  TORCH_INTERNAL_ASSERT(!channel_sums.defined() ||
                        (channel_sums.scalar_type() == at::kDouble && channel_sums.is_contiguous() &&
                         channel_sums.sizes() == at::IntArrayRef({x.size(0), x.size(1), 1})));
  if (x.numel() == 0) return true;

  const int64_t groups = (ci + planes - 1) / planes;
  TORCH_CHECK(slice * p.d * groups < (int64_t(1) << 31) && (slice * columns + kThreads - 1) / kThreads < (int64_t(1) << 31),
              "ct_bn_pool: x too large for its spectrum's DFT launches (", to_str(x.sizes()), ")");
  const at::Tensor tables = tables_for(p, x, spectrum.scalar_type());
  const at::Tensor t = at::empty({planes_only ? 0 : slice * p.d * columns}, spectrum.options());
  PlaneArgs pa = plane_args(p, tables, t, ci, planes);
  DepthArgs da = depth_args(p, tables, t, spectrum);
  if (planes_only) with_spectrum_steps(pa, p, batch);
  const at::Tensor plane_sums =  // each (b, ci, d) plane's sum, for channel_sums: themselves where D = 1
      !channel_sums.defined() || planes_only ? channel_sums
                                             : at::empty({x.size(0), ci, p.d}, channel_sums.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  for (int64_t b0 = 0; b0 < batch; b0 += slice) {
    const int64_t n = std::min(slice, batch - b0);
    // Another layout of x is copied a slice at a time, so the copy stays as small as t.
    const at::Tensor xs = x.narrow(0, b0, n).contiguous();
    pa.x = xs.data_ptr();
    if (planes_only) pa.t = static_cast<char*>(spectrum.data_ptr()) + b0 * ci * csize;
    pa.vector_loads = p.w % (16 / x.element_size()) == 0 && reinterpret_cast<std::uintptr_t>(pa.x) % 16 == 0;
    pa.plane_sums = plane_sums.defined() ? plane_sums.data_ptr<double>() + b0 * ci * p.d : nullptr;
    da.plane_sums = pa.plane_sums;
    da.channel_sums = channel_sums.defined() ? channel_sums.data_ptr<double>() + b0 * ci : nullptr;
    da.b0 = b0;
    da.threads = n * columns;
    const int64_t depth_blocks = (da.threads + kThreads - 1) / kThreads;
    if (is_double) {
      launch_plane<double>(p, pa, n * p.d * groups, plane_bytes, stream);
      if (!planes_only) launch_depth<double>(p, da, depth_blocks, depth_bytes, stream);
    } else {
      launch_plane<float>(p, pa, n * p.d * groups, plane_bytes, stream);
      if (!planes_only) launch_depth<float>(p, da, depth_blocks, depth_bytes, stream);
    }
  }
  return true;
}

}  // namespace fused_ops
