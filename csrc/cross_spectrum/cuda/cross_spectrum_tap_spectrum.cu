// The sub-kernels' spectra on the grid M of the cross-spectrum path's contraction
// (docs/math.md §3.5): W(b) = sum_k E_d[b_d, k_d] E_h[b_h, k_h] E_w[b_w, k_w] taps[k], one
// dim at a time. Why: as one float64 GEMM with the product of the three tables it is
// k'd k'h k'w multiply-adds per bin and column (seed: 830M, docs/performance.md); per dim it
// is about a fifth of that. A block takes a tile of 32
// columns (a lane each) and one depth bin b_d <= M_d / 2. Its warps form the tile's depth
// sums for b_d, the plane (k'h k'w complex values per column), in shared memory; then each
// warp takes a pair of h bins (p, M_h - p): the sums over k_h of the plane with the real
// and with the imaginary parts of row p of the h table, A and B, give both rows' k'w
// values, A + iB and A - iB (half the multiply-adds of two complex sums), and per b_w the
// four real sums of products of a row give W(b_d, b_h, b_w) and, the taps being real,
// W(-b_d, -b_h, b_w). Why so: a thread per column and depth bin with a loop over b_h would
// run few threads (40960 on the seed) of about 2000 dependent float64 operations each at low
// occupancy, and issue several instructions per multiply-add (64-bit store addresses per bin,
// table re-reads, staging a k_h at a time); here the seed's 204800 threads take about 400
// float64 operations each, several blocks share an SM, and each store instruction writes one bin's
// values of 32 adjacent columns (256 bytes, where the tile lies within one complex row of W:
// the seed problem's rows are 128 columns). The rows are a channel's real parts, then its
// imaginary parts, channel after channel (the contraction's interleaved order, §3.5).
// The taps come as the float64 stack (StackTaps, read where they lie: adjacent columns'
// taps adjacent) or, with one phase, as the weight itself in its dtype (WeightTaps, each
// tile's taps staged in shared memory), which spares its cast and permuted copy, two ATen
// kernels per call (docs/performance.md).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda/copy_async.cuh"
#include "common/cuda/dynamic_smem.h"
#include "cross_spectrum/cuda/cross_spectrum_kernels.h"
#include "common/cuda/pdl.cuh"
#include "common/cuda/complex.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kWarp = 32;
constexpr int kTile = kWarp;        // a block's columns, a lane each
constexpr int kMaxWarps = 8;        // a block's warps: one per pair of h bins, in turns past 8
constexpr int kMaxKw = 8;           // the kernel's instantiations: k'w of 1 to 8 (rows in registers)
constexpr int kMaxPlaneTaps = 47;   // k'h k'w: a block's plane within 24 KiB (the tests pin 48 to ATen)
constexpr int64_t kMaxStackSmem = 48 << 10;  // StackTaps' shared memory (the tables grow with k'd, k'h)

template <typename Source>
struct TapArgs {
  const Source* taps;    // as the Taps type of the launch reads them
  const double2* dft_d;  // [md, kd], md = 2 kd - 1
  const double2* dft_h;  // [mh, kh], mh = 2 kh - 1
  const double2* dft_w;  // [kw, kw]: the M_w / 2 + 1 bins of a real DFT
  double* out;           // [md, mh, kw, rows, 2, cols / rows]
  int64_t cols, w_cols;  // w_cols: a complex row's columns, its real parts' and imaginary parts' rows
  // WeightTaps: column col is (col / row_cols, col % row_cols) of the taps' last two dims,
  // whose strides these are
  int64_t row_cols, row_stride, col_stride;
  int kd, kh, md, mh;
};

// n / d, in 32 bits where n fits (the usual case: a 64-bit division is a subroutine call of
// dozens of instructions).
__device__ __forceinline__ int64_t quotient(int64_t n, int64_t d, bool narrow) {
  return narrow ? static_cast<int64_t>(static_cast<uint32_t>(n) / static_cast<uint32_t>(d)) : n / d;
}

// The float64 stack, [kd, kh, kw, cols] contiguous: tap e of column col at e cols + col,
// adjacent columns' taps adjacent, so lanes read them where they lie.
struct StackTaps {
  using Source = double;
  static constexpr int kDepthUnroll = 2;  // the depth sums' loop: two k_d's loads from L2 in flight
  static int64_t staging_bytes(int64_t) { return 0; }
  // The lane's column's taps: tap e at column[e step].
  __device__ static const double* stage(const TapArgs<double>& a, double*, int, int64_t col, int, int) {
    return a.taps + col;
  }
  __device__ static int64_t step(const TapArgs<double>& a) { return a.cols; }
  __device__ static double load(const double* at) { return __ldg(at); }
};

// The weight, Value values: a column's k'd k'h k'w taps together in (d, h, w) order, the
// columns anywhere (a chunk of output channels, any layout of the channels). Adjacent
// columns' taps lie k'd k'h k'w values apart (lanes over columns would read 32 sectors per
// load): the block stages its tile's taps in shared memory by adjacent loads, a column's
// values at an odd stride so that lanes reading one tap of 32 columns hit 32 banks.
template <typename Value>
struct WeightTaps {
  using Source = Value;
  static constexpr int kDepthUnroll = 1;  // shared-memory loads; unrolled, k'w = 5's registers fit fewer blocks per SM
  static int64_t staging_stride(int64_t values) { return values | 1; }
  static int64_t staging_bytes(int64_t values) {
    return kTile * staging_stride(values) * static_cast<int64_t>(sizeof(Value));
  }

  __device__ static const Value* stage(const TapArgs<Value>& a, Value* staged, int values, int64_t col, int warp,
                                       int warps) {
    const int lane = static_cast<int>(threadIdx.x % kWarp);
    const int stride = values | 1;
    const int64_t row = quotient(col, a.row_cols, a.cols <= UINT32_MAX);
    const Value* mine = a.taps + (col < a.cols ? row * a.row_stride + (col - row * a.row_cols) * a.col_stride : 0);
    const int64_t left = a.cols - (col - lane);  // columns from the tile's first on
    const int tile_cols = left < kTile ? static_cast<int>(left) : kTile;
    constexpr unsigned kAll = 0xffffffffu;
    const auto* first = reinterpret_cast<const Value*>(__shfl_sync(kAll, reinterpret_cast<unsigned long long>(mine), 0));
    const bool one_run = stride == values && a.col_stride == values &&
                         __shfl_sync(kAll, row, 0) == __shfl_sync(kAll, row, tile_cols - 1);
    // values begin .. end - 1 of a run at src to shared memory at dst, the lanes over them
    auto copy_run = [&](Value* dst, const Value* src, int begin, int end) {
      for (int e = begin + lane; e < end; e += kWarp) copy_async(dst + e, src + e, true);
    };
    if (one_run) {
      // the tile's columns one after another in one row of the weight (the seed's case): its
      // tile_cols k'd k'h k'w values are one run, in shared memory as there, a part per warp
      // (a column at a time spends most of its instructions per value on loop control)
      const int count = tile_cols * values, part = (count + warps * kWarp - 1) / (warps * kWarp) * kWarp;
      copy_run(staged, first, warp * part, min(count, (warp + 1) * part));
    } else {
      // each warp a column at a time
      for (int j = warp; j < tile_cols; j += warps) {
        const auto* src = reinterpret_cast<const Value*>(
            __shfl_sync(kAll, reinterpret_cast<unsigned long long>(mine), j));
        copy_run(staged + j * stride, src, 0, values);
      }
    }
    copy_async_commit();
    copy_async_wait<0>();
    return staged + lane * stride;
  }
  __device__ static int64_t step(const TapArgs<Value>&) { return 1; }
  __device__ static double load(const Value* at) { return static_cast<double>(*at); }
};

// The plane of the block's depth bin b_d: each warp its rows k_h (warp, warp + warps, ...),
// for each the k'w sums over k_d of dft_d[b_d, k_d] times the lane's taps (k_d, k_h, k_w),
// to plane[(k_h k'w + k_w) 32 + lane].
template <int kKw, typename Taps>
__device__ __forceinline__ void depth_sums(const TapArgs<typename Taps::Source>& a, const typename Taps::Source* column,
                                           const double2* e_d, double2* plane, int warp, int warps) {
  const int64_t step = Taps::step(a);
  const int plane_taps = a.kh * kKw;
  for (int h = warp; h < a.kh; h += warps) {
    double2 sum[kKw];
#pragma unroll
    for (int w = 0; w < kKw; ++w) sum[w] = double2{0, 0};
    const typename Taps::Source* taps = column + h * kKw * step;
#pragma unroll(Taps::kDepthUnroll)
    for (int d = 0; d < a.kd; ++d) {
      double v[kKw];
#pragma unroll
      for (int w = 0; w < kKw; ++w) v[w] = Taps::load(taps + w * step);
      const double2 e = e_d[d];
#pragma unroll
      for (int w = 0; w < kKw; ++w) {
        sum[w].x = fma(e.x, v[w], sum[w].x);
        sum[w].y = fma(e.y, v[w], sum[w].y);
      }
      taps += plane_taps * step;
    }
#pragma unroll
    for (int w = 0; w < kKw; ++w) plane[(h * kKw + w) * kTile] = sum[w];
  }
}

// One b_w of a row: re + i im of W at the row's bin and of its mirror (-b_d, -b_h, b_w),
// from the four real sums of products of e (dft_w's row b_w) and the row.
struct BinPair {
  double rr = 0, ii = 0, ri = 0, ir = 0;  // sums of Re e Re row, Im e Im row, Re e Im row, Im e Re row
  __device__ __forceinline__ void add(const double2& e, const double2& row) {
    rr = fma(e.x, row.x, rr);
    ii = fma(e.y, row.y, ii);
    ri = fma(e.x, row.y, ri);
    ir = fma(e.y, row.x, ir);
  }
  // e row at bin, e conj(row) at mirror: the real part there, the imaginary one im further.
  __device__ __forceinline__ void store(double* bin, double* mirror, int64_t im, bool mirrored) const {
    bin[0] = rr - ii;
    bin[im] = ri + ir;
    if (mirrored) {
      mirror[0] = rr + ii;
      mirror[im] = ir - ri;
    }
  }
};

// The h bins p and, with kPair, M_h - p of the block's b_d for the lane's column: plane is
// the lane's, e_h row p of dft_h; bins[r] is where row r's bin b_w = 0 lies (r = 0: p, r = 1:
// M_h - p), a bin stride apart per b_w, the imaginary parts im further. The mirror of row r,
// -b_h of M_d - b_d, is row 1 - r's bin (or with one row its own: -0 = 0) shifted by
// `mirror` (one offset for both: one pointer fewer per row). Without kPair (p = 0) the row
// is one complex sum over k_h.
template <int kKw, bool kPair>
__device__ __forceinline__ void h_and_w_sums(const double2* plane, const double2* e_h, int kh, const double2* e_w,
                                             double* const (&bins)[2], int64_t mirror, int64_t bin_stride,
                                             int64_t im, bool mirrored) {
  double2 a[kKw], b[kKw];  // kPair: sums with Re e and Im e, then the rows A + iB, A - iB
#pragma unroll
  for (int w = 0; w < kKw; ++w) a[w] = b[w] = double2{0, 0};
#pragma unroll 1
  for (int k = 0; k < kh; ++k) {
    const double2 e = e_h[k];
    const double2* q = plane + k * kKw * kTile;
#pragma unroll
    for (int w = 0; w < kKw; ++w) {
      const double2 v = q[w * kTile];
      if constexpr (kPair) {
        a[w].x = fma(e.x, v.x, a[w].x);
        a[w].y = fma(e.x, v.y, a[w].y);
        b[w].x = fma(e.y, v.x, b[w].x);
        b[w].y = fma(e.y, v.y, b[w].y);
      } else {
        add_product(a[w], v, e);
      }
    }
  }
  if constexpr (kPair) {
#pragma unroll
    for (int w = 0; w < kKw; ++w) {
      const double2 up{a[w].x - b[w].y, a[w].y + b[w].x}, down{a[w].x + b[w].y, a[w].y - b[w].x};
      a[w] = up;
      b[w] = down;
    }
  }
  double* bin0 = bins[0];
  double* bin1 = bins[1];
#pragma unroll 1
  for (int bw = 0; bw < kKw; ++bw) {
    BinPair s0, s1;
#pragma unroll
    for (int w = 0; w < kKw; ++w) {
      const double2 e = e_w[bw * kKw + w];
      s0.add(e, a[w]);
      if constexpr (kPair) s1.add(e, b[w]);
    }
    s0.store(bin0, (kPair ? bin1 : bin0) + mirror, im, mirrored);
    if constexpr (kPair) s1.store(bin1, bin0 + mirror, im, mirrored);
    bin0 += bin_stride;
    if constexpr (kPair) bin1 += bin_stride;
  }
}

template <int kKw, typename Taps>
__global__ void __launch_bounds__(kMaxWarps* kWarp) tap_spectrum_kernel(TapArgs<typename Taps::Source> a) {
  extern __shared__ double2 smem[];
  pdl_chain_start();
  const int kd = a.kd, kh = a.kh, bd = blockIdx.y;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  // the plane [k'h k'w][32], row b_d of dft_d, rows 0 .. k'h - 1 of dft_h (the pairs'),
  // dft_w, then what Taps stages
  double2* plane = smem;
  double2* e_d = plane + kh * kKw * kTile;
  double2* e_h = e_d + kd;
  double2* e_w = e_h + kh * kh;
  auto* staged = reinterpret_cast<typename Taps::Source*>(e_w + kKw * kKw);
  for (int i = threadIdx.x; i < kd; i += blockDim.x) e_d[i] = a.dft_d[bd * kd + i];
  for (int i = threadIdx.x; i < kh * kh; i += blockDim.x) e_h[i] = a.dft_h[i];
  for (int i = threadIdx.x; i < kKw * kKw; i += blockDim.x) e_w[i] = a.dft_w[i];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + lane;
  const auto* column = Taps::stage(a, staged, kd * kh * kKw, col, warp, warps);
  __syncthreads();
  const bool valid = col < a.cols;
  if (valid) depth_sums<kKw, Taps>(a, column, e_d, plane + lane, warp, warps);
  __syncthreads();
  if (!valid) return;
  const int64_t row = quotient(col, a.w_cols, a.cols <= UINT32_MAX);
  double* const out = a.out + col + row * a.w_cols;  // (bin 0, row, Re, the column in the row)
  const int64_t bin_stride = 2 * a.cols;
  const bool mirrored = bd != 0;  // b_d = 0 is its own mirror
  const int mh = a.mh, mirror_d = mirrored ? a.md - bd : 0;
  // (b_d, b_h, 0) at out + bin_stride (b_d M_h + b_h) k'w; (M_d - b_d, b_h, 0) mirror further
  const int64_t row_stride = mh * kKw * bin_stride, mirror = (mirror_d - bd) * row_stride;
  double* const rows = out + bd * row_stride;
  for (int p = warp; p < kh; p += warps) {
    // rows p and M_h - p of b_d, whose mirrors are -p = M_h - p and p of M_d - b_d
    if (p == 0) {
      double* const bins[2] = {rows, rows};
      h_and_w_sums<kKw, false>(plane + lane, e_h, kh, e_w, bins, mirror, bin_stride, a.w_cols, mirrored);
    } else {
      double* const bins[2] = {rows + p * kKw * bin_stride, rows + (mh - p) * kKw * bin_stride};
      h_and_w_sums<kKw, true>(plane + lane, e_h + p * kh, kh, e_w, bins, mirror, bin_stride, a.w_cols,
                              mirrored);
    }
  }
}

template <int kKw, typename Taps>
void launch(const TapArgs<typename Taps::Source>& a, dim3 grid, dim3 block, int64_t smem, cudaStream_t stream) {
  const auto kernel = tap_spectrum_kernel<kKw, Taps>;
  allow_dynamic_smem(kernel, smem);
  launch_overlapping(kernel, grid, block, static_cast<size_t>(smem), stream, a);
}

template <typename Taps>
void launch(int kw, const TapArgs<typename Taps::Source>& a, dim3 grid, dim3 block, int64_t smem,
            cudaStream_t stream) {
  switch (kw) {
    case 1: return launch<1, Taps>(a, grid, block, smem, stream);
    case 2: return launch<2, Taps>(a, grid, block, smem, stream);
    case 3: return launch<3, Taps>(a, grid, block, smem, stream);
    case 4: return launch<4, Taps>(a, grid, block, smem, stream);
    case 5: return launch<5, Taps>(a, grid, block, smem, stream);
    case 6: return launch<6, Taps>(a, grid, block, smem, stream);
    case 7: return launch<7, Taps>(a, grid, block, smem, stream);
    default: return launch<8, Taps>(a, grid, block, smem, stream);
  }
}

// A block's shared memory (tap_spectrum_kernel's layout).
template <typename Taps>
int64_t smem_bytes(const at::Tensor& taps) {
  const int64_t kd = taps.size(0), kh = taps.size(1), kw = taps.size(2);
  const int64_t complex_values = kh * kw * kTile + kd + kh * kh + kw * kw;
  return static_cast<int64_t>(sizeof(double2)) * complex_values + Taps::staging_bytes(kd * kh * kw);
}

// Whether each column's taps lie together in (d, h, w) order, as in a ConvTranspose3d
// weight: what WeightTaps reads.
bool taps_packed(const at::Tensor& taps) {
  int64_t step = 1;
  for (int d = 2; d >= 0; --d) {
    if (taps.size(d) > 1 && taps.stride(d) != step) return false;
    step *= taps.size(d);
  }
  return true;
}

// Whether WeightTaps<T> reads the taps where they lie: T values, packed, its shared memory
// within what a block may have.
template <typename T>
bool in_place(const at::Tensor& taps) {
  return taps.scalar_type() == c10::CppTypeToScalarType<T>::value && taps_packed(taps) &&
         smem_bytes<WeightTaps<T>>(taps) <= dynamic_smem_limit();
}

template <typename Source>
TapArgs<Source> tap_args(const at::Tensor& taps, const at::Tensor& ed, const at::Tensor& eh, const at::Tensor& ew,
                         int64_t rows) {
  TapArgs<Source> a;
  a.taps = taps.data_ptr<Source>();
  a.dft_d = reinterpret_cast<const double2*>(ed.data_ptr());
  a.dft_h = reinterpret_cast<const double2*>(eh.data_ptr());
  a.dft_w = reinterpret_cast<const double2*>(ew.data_ptr());
  a.row_cols = taps.size(4);
  a.row_stride = taps.stride(3);
  a.col_stride = taps.stride(4);
  a.cols = taps.size(3) * a.row_cols;
  a.w_cols = a.cols / rows;
  a.kd = static_cast<int>(taps.size(0));
  a.kh = static_cast<int>(taps.size(1));
  a.md = static_cast<int>(ed.size(0));
  a.mh = static_cast<int>(eh.size(0));
  return a;
}

// The spectra by tap_spectrum_kernel from taps laid out as Taps reads them.
template <typename Taps>
at::Tensor spectrum(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h, const at::Tensor& dft_w,
                    int64_t rows) {
  const at::Tensor ed = dft_d.contiguous(), eh = dft_h.contiguous(), ew = dft_w.contiguous();
  TapArgs<typename Taps::Source> a = tap_args<typename Taps::Source>(taps, ed, eh, ew, rows);
  const int64_t tiles = (a.cols + kTile - 1) / kTile;
  TORCH_CHECK(tiles < (int64_t(1) << 31) && a.kd < 65536,
              "ct_bn_pool: problem too large for the sub-kernels' spectra (", to_str(a.cols), " columns, ",
              to_str(int64_t(a.kd)), " depth taps)");
  const int64_t kw = taps.size(2);
  const at::Tensor out =
      at::empty({int64_t(a.md) * a.mh * kw, rows, 2, a.w_cols}, taps.options().dtype(at::kDouble));
  a.out = out.data_ptr<double>();
  if (out.numel() > 0) {
    // the depth bins b_d <= M_d / 2 (the others are their mirrors); a warp per pair of h bins
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.kd));
    const dim3 block(static_cast<unsigned>(kWarp * std::min(a.kh, kMaxWarps)));
    launch<Taps>(static_cast<int>(kw), a, grid, block, smem_bytes<Taps>(taps), at::cuda::getCurrentCUDAStream());
  }
  return out;
}

}  // namespace

at::Tensor tap_spectrum_cuda(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h,
                             const at::Tensor& dft_w, int64_t rows) {
  TORCH_CHECK(taps.dim() == 5 && (taps.size(3) * taps.size(4)) % rows == 0 &&
                  dft_d.scalar_type() == at::kComplexDouble && dft_h.scalar_type() == at::kComplexDouble &&
                  dft_w.scalar_type() == at::kComplexDouble && dft_d.size(1) == taps.size(0) &&
                  dft_d.size(0) == 2 * taps.size(0) - 1 && dft_h.size(1) == taps.size(1) &&
                  dft_w.size(1) == taps.size(2),
              "ct_bn_pool: tap_spectrum_cuda: inconsistent shapes or dtypes");
  const int64_t kh = taps.size(1), kw = taps.size(2);
  // the kernel's tables: M_h = 2 k'h - 1 bins of h (pairs p, M_h - p) and the k'w of a real DFT of w
  const bool tables = dft_h.size(0) == 2 * kh - 1 && dft_w.size(0) == kw;
  if (!tables || kw > kMaxKw || kh * kw > kMaxPlaneTaps || smem_bytes<StackTaps>(taps) > kMaxStackSmem) {
    return tap_spectrum_aten(taps, dft_d, dft_h, dft_w, rows);
  }
  const c10::cuda::CUDAGuard guard(taps.device());
  if (in_place<float>(taps)) return spectrum<WeightTaps<float>>(taps, dft_d, dft_h, dft_w, rows);
  if (in_place<double>(taps)) return spectrum<WeightTaps<double>>(taps, dft_d, dft_h, dft_w, rows);
  return spectrum<StackTaps>(taps.to(at::kDouble).contiguous(), dft_d, dft_h, dft_w, rows);
}

}  // namespace fused_ops
