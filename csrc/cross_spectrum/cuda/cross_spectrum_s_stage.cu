// The cross-spectrum path's S stage (docs/math.md §3.5) for float64 spectra, and for float32
// ones where cross_spectrum_s_stage_mma.cu does not run (before sm_90): for each frequency f the
// [Cig, Cig] matrix S_f = sum_b X_f[b]^H X_f[b] of a group, reduced at once to
// the lags m_h >= 0 the sub-kernels span, Q[m] = sum_fh coef[fh, m] S_f, so S_f is never
// stored. A block owns one (fd, fw) row and a tile of (i, j) pairs and walks the
// row's fh; each thread keeps R x R adjacent entries of S_f and their Q for kLags lags
// in registers (more than kMaxLags lags: one launch per kMaxLags of them, each
// recomputing S_f). S_f is Hermitian, so only the tiles on and above the diagonal are
// computed: a diagonal tile gives its own Q, an off-diagonal tile (i < j) gives Q at
// (i, j) and at (j, i), the latter being sum_fh coef conj(S_f[i, j]).
// S_f is formed by multiply-adds in x's dtype, not TF32 tensor cores: a 3xTF32 product is
// faster, but its error grows with the batch, where multiply-adds in x's dtype keep the
// output at its dtype's accuracy (docs/performance.md).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cross_spectrum/cuda/cross_spectrum_kernels.h"
#include "common/cuda/complex.cuh"
#include "message.h"
#include "testing_hooks.h"

namespace fused_ops {
namespace {

constexpr int kSide = 16;        // threads per side of a block's tile: 256 threads
constexpr int kBatchChunk = 16;  // samples of one frequency staged in shared memory at a time

struct RowsArgs {
  const void* x;     // [Ld, Lh, Lwf, B, Ci], complex of T
  const void* coef;  // [Lh, lags_total], complex of T
  void* q;           // [count, Lwf, lags_total, G, Cig, Cig], complex of T
  int64_t fd0, lh, lwf, batch, ci, cig, tiles, lags_total, lag0, lags;
};

// acc += conj(u) v as four fused multiply-adds (add_product's, complex.cuh): written
// as `acc.x += u.x * v.x + u.y * v.y` the compiler keeps a separate multiply and add, twice
// the instructions in a kernel bound by issuing them (ncu, docs/performance.md).
template <typename C>
__device__ __forceinline__ void add_conj_product(C& acc, const C& u, const C& v) {
  acc.x = madd(u.x, v.x, acc.x);
  acc.x = madd(u.y, v.y, acc.x);
  acc.y = madd(u.x, v.y, acc.y);
  acc.y = madd(-u.y, v.x, acc.y);
}

// The kMirror sums of cross_spectrum_kernel: ac += (p a, p b), bd += (q b, q a).
template <typename C>
__device__ __forceinline__ void add_mirror_sums(C& ac, C& bd, const C& s, const C& w) {
  ac.x = madd(w.x, s.x, ac.x);
  ac.y = madd(w.x, s.y, ac.y);
  bd.x = madd(w.y, s.y, bd.x);
  bd.y = madd(w.y, s.x, bd.y);
}

// R consecutive complex values from shared memory (one 16-byte load for two float2).
template <int R, typename C>
__device__ __forceinline__ void load_row(const C* src, C (&dst)[R]) {
  if constexpr (R * sizeof(C) == 16 && R == 2) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    dst[0] = C{v.x, v.y};
    dst[1] = C{v.z, v.w};
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) dst[r] = src[r];
  }
}

// Shared memory of one block: double-buffered, step k + 1's values are stored while
// step k's may still be read. x: [buffer][side i, side j][sample][channel]; coef: the
// lags' coefficients of the fh in flight, [fh parity][lag] (kMaxLags, the most per launch).
constexpr int kMaxLags = 5;
template <typename C, int R>
struct Staged {
  C x[2][2][kBatchChunk][kSide * R];
  C coef[2][kMaxLags];
};

// s += conj(u) v over a thread's R x R entries for sample bb of a staged step.
template <int R, typename C>
__device__ __forceinline__ void add_sample(const C (&xs)[2][kBatchChunk][kSide * R], int bb, int ty, int tx,
                                           C (&s)[R][R]) {
  C u[R], v[R];
  load_row<R>(&xs[0][bb][R * ty], u);
  load_row<R>(&xs[1][bb][R * tx], v);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < R; ++c) add_conj_product(s[r][c], u[r], v[c]);
}

// One block's work: row `row`, tile (ti, tj). kMirror: an off-diagonal tile, whose
// lags keep the four real sums A = sum p a, B = sum q b, C = sum p b, D = sum q a of
// coef = p + iq and S_f = a + ib, so that Q[i, j] = (A - B, C + D) and
// Q[j, i] = (A + B, D - C) come from one S_f.
template <typename T, int R, int kLags, bool kMirror, bool kFull>
__device__ __forceinline__ void tile_rows(const RowsArgs& a, Staged<typename ComplexOf<T>::type, R>& st,
                                          int64_t row, int ti, int tj) {
  using C = typename ComplexOf<T>::type;
  constexpr int kTile = kSide * R;
  constexpr int kThreads = kSide * kSide;
  constexpr int kSideValues = kBatchChunk * kTile;
  constexpr int kPerThread = 2 * kSideValues / kThreads;  // values each thread stages per step
  static_assert(2 * kSideValues % kThreads == 0, "a step's values must split evenly over the threads");
  static_assert(kLags <= kMaxLags && kLags <= kThreads, "one thread stages each lag's coefficient");
  // row: (fd - fd0) Lwf + fw
  const int64_t fd = a.fd0 + row / a.lwf, fw = row % a.lwf;
  const int64_t i0 = ti * int64_t(kTile), j0 = tj * int64_t(kTile);
  const int64_t group = blockIdx.z;
  const int ty = threadIdx.x / kSide, tx = threadIdx.x % kSide;  // entries (R ty + r, R tx + c)
  const C* __restrict__ x =
      static_cast<const C*>(a.x) + (fd * a.lh * a.lwf + fw) * a.batch * a.ci + group * a.cig;
  const C* __restrict__ coef = static_cast<const C*>(a.coef) + a.lag0;
  const int lh = static_cast<int>(a.lh), batch = static_cast<int>(a.batch);
  const int chunks = (batch + kBatchChunk - 1) / kBatchChunk;
  const bool dc_row = fd == 0 && fw == 0;  // its fh = 0 is the DC bin, left out (§3.5)

  // A step is one fh and one chunk of samples; its values are loaded into registers a
  // step ahead, so the global loads are in flight while the previous step multiplies.
  // Each thread moves the same kPerThread (sample, channel) slots at every step, and
  // thread m < kLags the step's fh's coefficient of lag m at its first chunk, through
  // shared memory (0 past the launch's lags, so the lag loop needs no bound). The loops
  // count (fh, chunk) in int: a step index split by 64-bit division and modulo is a long
  // instruction sequence per step, in a kernel bound by issuing instructions.
  auto sample = [](int k) { return static_cast<int>((threadIdx.x + k * kThreads) / kTile % kBatchChunk); };
  int offset[kPerThread];  // from the step's first value (a row of B Ci values); -1: no channel
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int e = threadIdx.x + k * kThreads;
    const int64_t channel = (e / kSideValues ? j0 : i0) + e % kTile;
    offset[k] = channel < a.cig ? static_cast<int>(sample(k) * a.ci + channel) : -1;
  }
  C next[kPerThread], next_coef = C{0, 0};
  const int64_t fh_values = a.lwf * a.batch * a.ci;  // from one fh to the next
  auto load = [&](int fh, int chunk) {
    const int b0 = chunk * kBatchChunk;
    const C* base = x + fh * fh_values + b0 * a.ci;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      if constexpr (kFull) {
        next[k] = __ldg(base + offset[k]);
      } else {
        next[k] = offset[k] >= 0 && sample(k) < batch - b0 ? __ldg(base + offset[k]) : C{0, 0};
      }
    }
    if (chunk == 0 && threadIdx.x < kLags) {
      next_coef = threadIdx.x < a.lags ? __ldg(coef + fh * a.lags_total + threadIdx.x) : C{0, 0};
    }
  };
  // acc: the lags' (A, C) under kMirror, else Q itself; mir: (B, D) under kMirror.
  C acc[R][R][kLags], mir[R][R][kMirror ? kLags : 1], s[R][R];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < R; ++c) {
      s[r][c] = C{0, 0};
#pragma unroll
      for (int m = 0; m < kLags; ++m) acc[r][c][m] = C{0, 0};
#pragma unroll
      for (int m = 0; m < (kMirror ? kLags : 1); ++m) mir[r][c][m] = C{0, 0};
    }
  load(0, 0);
  int buf = 0, next_fh = 0, next_chunk = 0;  // the step `next` holds
  for (int fh = 0; fh < lh; ++fh) {
    for (int chunk = 0; chunk < chunks; ++chunk, buf ^= 1) {
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) (&st.x[buf][0][0][0])[threadIdx.x + k * kThreads] = next[k];
      if (chunk == 0 && threadIdx.x < kLags) st.coef[fh & 1][threadIdx.x] = next_coef;
      __syncthreads();
      if (++next_chunk == chunks) next_chunk = 0, ++next_fh;
      if (next_fh < lh) load(next_fh, next_chunk);
      if constexpr (kFull) {
#pragma unroll
        for (int bb = 0; bb < kBatchChunk; ++bb) add_sample<R>(st.x[buf], bb, ty, tx, s);
      } else {
        const int staged = min(batch - chunk * kBatchChunk, kBatchChunk);
#pragma unroll 4
        for (int bb = 0; bb < staged; ++bb) add_sample<R>(st.x[buf], bb, ty, tx, s);
      }
    }
    if (!dc_row || fh != 0) {
#pragma unroll
      for (int m = 0; m < kLags; ++m) {
        const C wm = st.coef[fh & 1][m];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int c = 0; c < R; ++c) {
            if constexpr (kMirror) {
              add_mirror_sums(acc[r][c][m], mir[r][c][m], s[r][c], wm);
            } else {
              add_product(acc[r][c][m], s[r][c], wm);
            }
          }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < R; ++c) s[r][c] = C{0, 0};
  }
  const int64_t entries = static_cast<int64_t>(gridDim.z) * a.cig * a.cig;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int c = 0; c < R; ++c) {
      const int64_t i = i0 + R * ty + r, j = j0 + R * tx + c;
      if (i >= a.cig || j >= a.cig) continue;
      C* q = static_cast<C*>(a.q) + (row * a.lags_total + a.lag0) * entries + group * a.cig * a.cig;
#pragma unroll
      for (int m = 0; m < kLags; ++m) {
        if (m < a.lags) {
          if constexpr (kMirror) {
            const C sums = acc[r][c][m], more = mir[r][c][m];
            q[m * entries + i * a.cig + j] = C{sums.x - more.x, sums.y + more.y};
            q[m * entries + j * a.cig + i] = C{sums.x + more.x, more.y - sums.y};
          } else {
            q[m * entries + i * a.cig + j] = acc[r][c][m];
          }
        }
      }
    }
  }
}

// One launch for a row chunk and up to kMaxLags lags. A row's tiles are adjacent
// blocks, so that the row's values are read while they are still in L2 (with the rows
// adjacent instead, a row's tiles would run a launch's rows apart; docs/performance.md); in a
// row the off-diagonal pairs come first (the longer blocks), then the diagonal tiles.
template <typename T, int R, int kLags, bool kFull>
__global__ void __launch_bounds__(kSide* kSide, 2) cross_spectrum_kernel(RowsArgs a) {
  __shared__ __align__(16) Staged<typename ComplexOf<T>::type, R> st;
  const int pairs = static_cast<int>(a.tiles * (a.tiles - 1) / 2);
  const int64_t row_tiles = a.tiles * (a.tiles + 1) / 2;
  const int64_t row = blockIdx.x / row_tiles;
  const int y = static_cast<int>(blockIdx.x % row_tiles);
  if (y < pairs) {
    int pair = y, ti = 0;
    for (; pair >= a.tiles - 1 - ti; ++ti) pair -= static_cast<int>(a.tiles) - 1 - ti;
    tile_rows<T, R, kLags, true, kFull>(a, st, row, ti, ti + 1 + pair);
  } else {
    tile_rows<T, R, kLags, false, kFull>(a, st, row, y - pairs, y - pairs);
  }
}

// The smallest register budget of lags that holds `lags` (kMaxLags per launch: with
// eight, the off-diagonal tiles' sums spill to local memory). kFull: every step stages a whole
// chunk of samples and every channel of the tile exists (batch a multiple of kBatchChunk,
// Cig of the tile's side), so its loops unroll and its loads need no bounds.
template <typename T, int R, bool kFull>
void launch_rows(const RowsArgs& a, dim3 grid) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (a.lags <= 2) {
    cross_spectrum_kernel<T, R, 2, kFull><<<grid, kSide * kSide, 0, stream>>>(a);
  } else {
    cross_spectrum_kernel<T, R, kMaxLags, kFull><<<grid, kSide * kSide, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int R>
void launch_rows(const RowsArgs& a, dim3 grid) {
  if (a.batch % kBatchChunk == 0 && a.cig % (kSide * R) == 0) {
    launch_rows<T, R, true>(a, grid);
  } else {
    launch_rows<T, R, false>(a, grid);
  }
}

}  // namespace

at::Tensor cross_spectrum_rows_cuda(const at::Tensor& x_spec, int64_t fd0, int64_t count,
                                    const at::Tensor& coef, int64_t groups) {
  const c10::cuda::CUDAGuard guard(x_spec.device());
  const bool is_double = x_spec.scalar_type() == at::kComplexDouble;
  TORCH_CHECK(is_double || x_spec.scalar_type() == at::kComplexFloat,
              "ct_bn_pool: cross_spectrum_rows_cuda takes a complex64 or complex128 spectrum");
  TORCH_CHECK(x_spec.is_contiguous(), "ct_bn_pool: cross_spectrum_rows_cuda: spectrum not contiguous");
  RowsArgs a;
  a.lh = x_spec.size(1);
  a.lwf = x_spec.size(2);
  a.batch = x_spec.size(3);
  a.ci = x_spec.size(4);
  a.cig = a.ci / groups;
  a.fd0 = fd0;
  a.lags_total = coef.size(1);
  // float32 spectra: R = 2 (a 32 x 32 tile, 2 x 2 entries per thread) unless the
  // group fits 16; float64 keeps R = 1 so its accumulators stay in registers.
  const int side = !is_double && a.cig > kSide ? 2 : 1;
  a.tiles = (a.cig + kSide * side - 1) / (kSide * side);
  const int64_t rows = count * a.lwf, row_tiles = a.tiles * (a.tiles + 1) / 2;
  TORCH_CHECK(rows * row_tiles < (int64_t(1) << 31) && groups < 65536,
              "ct_bn_pool: problem too large for the cross-spectrum path (", to_str(rows),
              " rows, ", to_str(row_tiles), " tiles, ", to_str(groups), " groups)");
  const at::Tensor c = coef.to(is_double ? at::kComplexDouble : at::kComplexFloat).contiguous();
  auto q = at::empty({count, a.lwf, a.lags_total, groups, a.cig, a.cig}, x_spec.options());
  // Route s_stage='simt' (fused_ops.testing): this file's kernel for float32 spectra on sm_90 too.
  if (forced_route(Knob::SStage) != Route::Simt && cross_spectrum_mma_supported(x_spec, groups)) {
    cross_spectrum_rows_mma_cuda(x_spec, fd0, count, c, groups, q);
    return q;
  }
  a.x = x_spec.data_ptr();
  a.coef = c.data_ptr();
  a.q = q.data_ptr();
  const dim3 grid(static_cast<unsigned>(rows * row_tiles), 1, static_cast<unsigned>(groups));
  for (a.lag0 = 0; a.lag0 < a.lags_total; a.lag0 += kMaxLags) {
    a.lags = std::min<int64_t>(kMaxLags, a.lags_total - a.lag0);
    if (is_double) {
      launch_rows<double, 1>(a, grid);
    } else if (side == 2) {
      launch_rows<float, 2>(a, grid);
    } else {
      launch_rows<float, 1>(a, grid);
    }
  }
  return q;
}

}  // namespace fused_ops
