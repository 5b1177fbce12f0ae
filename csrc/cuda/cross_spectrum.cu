// The cross-spectrum path's W stage (docs/math.md §3.5): for each frequency f the
// [Cig, Cig] matrix S_f = sum_b X_f[b]^H X_f[b] of a group, reduced at once to
// the lags m_w the sub-kernels span, Q[m] = sum_fw coef[fw, m] S_f, so S_f is never
// stored. A block owns one (fd, fh) row and a tile of (i, j) pairs and walks the
// row's fw; each thread keeps R x R adjacent entries of S_f and their Q for kLags lags
// in registers (more than kMaxLags lags: one launch per kMaxLags of them, each
// recomputing S_f).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cuda/kernels.h"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kSide = 16;        // threads per side of a block's tile: 256 threads
constexpr int kBatchChunk = 16;  // samples of one frequency staged in shared memory at a time

template <typename T>
struct ComplexOf;
template <>
struct ComplexOf<float> {
  using type = float2;
};
template <>
struct ComplexOf<double> {
  using type = double2;
};

struct RowsArgs {
  const void* x;     // [Ld, Lh, Lwf, B, Ci], complex of T
  const void* coef;  // [Lwf, lags_total], complex of T
  void* q;           // [count, Lh, lags_total, G, Cig, Cig], complex of T
  int64_t fd0, lh, lwf, batch, ci, cig, tiles, lags_total, lag0, lags;
};

// a b + c, one rounding (FFMA / DFMA).
__device__ __forceinline__ float madd(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double madd(double a, double b, double c) { return fma(a, b, c); }

// acc += conj(u) v, and acc += s w, as four fused multiply-adds each: written as
// `acc.x += u.x * v.x + u.y * v.y` the compiler kept a separate multiply and add
// (ncu on the seed call: 29M FFMA against 59M FMUL/FADD instructions, issue-bound).
template <typename C>
__device__ __forceinline__ void add_conj_product(C& acc, const C& u, const C& v) {
  acc.x = madd(u.x, v.x, acc.x);
  acc.x = madd(u.y, v.y, acc.x);
  acc.y = madd(u.x, v.y, acc.y);
  acc.y = madd(-u.y, v.x, acc.y);
}
template <typename C>
__device__ __forceinline__ void add_product(C& acc, const C& s, const C& w) {
  acc.x = madd(s.x, w.x, acc.x);
  acc.x = madd(-s.y, w.y, acc.x);
  acc.y = madd(s.x, w.y, acc.y);
  acc.y = madd(s.y, w.x, acc.y);
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

template <typename T, int R, int kLags>
__global__ void __launch_bounds__(kSide* kSide, 2) cross_spectrum_kernel(RowsArgs a) {
  using C = typename ComplexOf<T>::type;
  constexpr int kTile = kSide * R;
  constexpr int kThreads = kSide * kSide;
  constexpr int kSideValues = kBatchChunk * kTile;
  constexpr int kPerThread = 2 * kSideValues / kThreads;  // values each thread stages per step
  static_assert(2 * kSideValues % kThreads == 0, "a step's values must split evenly over the threads");
  // Double-buffered: step k + 1's values are stored while step k's may still be read.
  __shared__ __align__(16) C xs[2][2][kBatchChunk][kTile];  // [buffer][side i, side j][sample][channel]
  const int64_t row = blockIdx.x;  // (fd - fd0) Lh + fh
  const int64_t fd = a.fd0 + row / a.lh, fh = row % a.lh;
  const int64_t i0 = (blockIdx.y / a.tiles) * kTile, j0 = (blockIdx.y % a.tiles) * kTile;
  const int64_t group = blockIdx.z;
  const int ty = threadIdx.x / kSide, tx = threadIdx.x % kSide;  // entries (R ty + r, R tx + c)
  const C* __restrict__ x =
      static_cast<const C*>(a.x) + (fd * a.lh + fh) * a.lwf * a.batch * a.ci + group * a.cig;
  const C* __restrict__ coef = static_cast<const C*>(a.coef) + a.lag0;
  const int lwf = static_cast<int>(a.lwf), batch = static_cast<int>(a.batch);
  const int chunks = (batch + kBatchChunk - 1) / kBatchChunk;
  const bool dc_row = fd == 0 && fh == 0;  // its fw = 0 is the DC bin, left out (§3.5)

  // A step is one fw and one chunk of samples; its values are loaded into registers a
  // step ahead, so the global loads are in flight while the previous step multiplies.
  // Each thread moves the same kPerThread (sample, channel) slots at every step. The
  // loops count in int: 64-bit division per step cost more instructions than the products.
  int64_t offset[kPerThread];  // from the step's first value
  int sample[kPerThread];      // within the chunk; kBatchChunk: no channel there
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int e = threadIdx.x + k * kThreads;
    const int side = e / kSideValues, bb = e / kTile % kBatchChunk, t = e % kTile;
    const int64_t channel = (side ? j0 : i0) + t;
    offset[k] = bb * a.ci + channel;
    sample[k] = channel < a.cig ? bb : kBatchChunk;
  }
  C next[kPerThread];
  auto load = [&](int fw, int chunk) {
    const int b0 = chunk * kBatchChunk;
    const C* base = x + (static_cast<int64_t>(fw) * batch + b0) * a.ci;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      next[k] = sample[k] < batch - b0 && sample[k] < kBatchChunk ? __ldg(base + offset[k]) : C{0, 0};
    }
  };
  C acc[R][R][kLags], s[R][R];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < R; ++c) {
      s[r][c] = C{0, 0};
#pragma unroll
      for (int m = 0; m < kLags; ++m) acc[r][c][m] = C{0, 0};
    }
  load(0, 0);
  int buf = 0, next_fw = 0, next_chunk = 0;  // the step `next` holds
  for (int fw = 0; fw < lwf; ++fw) {
    // This fw's coefficients, loaded now so that their latency hides behind S_f's products.
    C w[kLags];
#pragma unroll
    for (int m = 0; m < kLags; ++m) w[m] = m < a.lags ? __ldg(coef + fw * a.lags_total + m) : C{0, 0};
    for (int chunk = 0; chunk < chunks; ++chunk, buf ^= 1) {
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) (&xs[buf][0][0][0])[threadIdx.x + k * kThreads] = next[k];
      __syncthreads();
      if (++next_chunk == chunks) next_chunk = 0, ++next_fw;
      if (next_fw < lwf) load(next_fw, next_chunk);
      const int staged = min(batch - chunk * kBatchChunk, kBatchChunk);
#pragma unroll 4
      for (int bb = 0; bb < staged; ++bb) {
        C u[R], v[R];
        load_row<R>(&xs[buf][0][bb][R * ty], u);
        load_row<R>(&xs[buf][1][bb][R * tx], v);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int c = 0; c < R; ++c) add_conj_product(s[r][c], u[r], v[c]);
      }
    }
    if (!dc_row || fw != 0) {
#pragma unroll
      for (int m = 0; m < kLags; ++m) {
        if (m < a.lags) {
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < R; ++c) add_product(acc[r][c][m], s[r][c], w[m]);
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
#pragma unroll
      for (int m = 0; m < kLags; ++m) {
        if (m < a.lags) {
          const int64_t lag = a.lag0 + m;
          static_cast<C*>(a.q)[(row * a.lags_total + lag) * entries + (group * a.cig + i) * a.cig + j] =
              acc[r][c][m];
        }
      }
    }
  }
}

template <typename T, int R, int kLags>
void launch_rows(const RowsArgs& a, dim3 grid) {
  cross_spectrum_kernel<T, R, kLags>
      <<<grid, kSide * kSide, 0, at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The smallest register budget of lags that holds `lags` (kMaxLags per launch).
constexpr int kMaxLags = 8;
template <typename T, int R>
void launch_lags(const RowsArgs& a, dim3 grid) {
  if (a.lags <= 2) return launch_rows<T, R, 2>(a, grid);
  if (a.lags <= 5) return launch_rows<T, R, 5>(a, grid);
  launch_rows<T, R, kMaxLags>(a, grid);
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
  const int64_t rows = count * a.lh;
  TORCH_CHECK(rows < (int64_t(1) << 31) && a.tiles * a.tiles < 65536 && groups < 65536,
              "ct_bn_pool: problem too large for the cross-spectrum path (", to_str(rows),
              " rows, ", to_str(a.tiles * a.tiles), " tiles, ", to_str(groups), " groups)");
  const at::Tensor c = coef.to(is_double ? at::kComplexDouble : at::kComplexFloat).contiguous();
  auto q = at::empty({count, a.lh, a.lags_total, groups, a.cig, a.cig}, x_spec.options());
  a.x = x_spec.data_ptr();
  a.coef = c.data_ptr();
  a.q = q.data_ptr();
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(a.tiles * a.tiles),
                  static_cast<unsigned>(groups));
  for (a.lag0 = 0; a.lag0 < a.lags_total; a.lag0 += kMaxLags) {
    a.lags = std::min<int64_t>(kMaxLags, a.lags_total - a.lag0);
    if (is_double) {
      launch_lags<double, 1>(a, grid);
    } else if (side == 2) {
      launch_lags<float, 2>(a, grid);
    } else {
      launch_lags<float, 1>(a, grid);
    }
  }
  return q;
}

}  // namespace fused_ops
