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

// acc += conj(u) v
template <typename C>
__device__ __forceinline__ void add_conj_product(C& acc, const C& u, const C& v) {
  acc.x += u.x * v.x + u.y * v.y;
  acc.y += u.x * v.y - u.y * v.x;
}

// acc += s w
template <typename C>
__device__ __forceinline__ void add_product(C& acc, const C& s, const C& w) {
  acc.x += s.x * w.x - s.y * w.y;
  acc.y += s.x * w.y + s.y * w.x;
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
  constexpr int kStaged = 2 * kBatchChunk * kTile;  // values of one step: both sides' rows
  constexpr int kPerThread = kStaged / kThreads;
  static_assert(kStaged % kThreads == 0, "a step's values must split evenly over the threads");
  // Double-buffered: step k + 1's values are stored while step k's may still be read.
  __shared__ __align__(16) C xi[2][kBatchChunk][kTile];
  __shared__ __align__(16) C xj[2][kBatchChunk][kTile];
  const int64_t row = blockIdx.x;  // (fd - fd0) Lh + fh
  const int64_t fd = a.fd0 + row / a.lh, fh = row % a.lh;
  const int64_t i0 = (blockIdx.y / a.tiles) * kTile, j0 = (blockIdx.y % a.tiles) * kTile;
  const int64_t group = blockIdx.z;
  const int ty = threadIdx.x / kSide, tx = threadIdx.x % kSide;  // entries (R ty + r, R tx + c)
  const C* x = static_cast<const C*>(a.x) + (fd * a.lh + fh) * a.lwf * a.batch * a.ci + group * a.cig;
  const C* coef = static_cast<const C*>(a.coef);
  const int64_t chunks = (a.batch + kBatchChunk - 1) / kBatchChunk, steps = a.lwf * chunks;

  // A step is one fw and one chunk of samples; its values are loaded into registers a
  // step ahead, so the global loads are in flight while the previous step multiplies.
  // Each thread moves the same kPerThread (sample, channel) slots at every step.
  int64_t offset[kPerThread];  // from the step's first value
  int sample[kPerThread];      // within the chunk; kBatchChunk: no channel there
  int slot[kPerThread];        // in the shared tiles: side * kBatchChunk * kTile + bb * kTile + t
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int e = threadIdx.x + k * kThreads;
    const int side = e / (kBatchChunk * kTile), bb = e / kTile % kBatchChunk, t = e % kTile;
    const int64_t channel = (side ? j0 : i0) + t;
    offset[k] = bb * a.ci + channel;
    sample[k] = channel < a.cig ? bb : kBatchChunk;
    slot[k] = e;
  }
  C next[kPerThread];
  auto load = [&](int64_t step) {
    const int64_t fw = step / chunks, b0 = step % chunks * kBatchChunk;
    const C* base = x + (fw * a.batch + b0) * a.ci;
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      next[k] = sample[k] < a.batch - b0 && sample[k] < kBatchChunk ? base[offset[k]] : C{0, 0};
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
  load(0);
  for (int64_t step = 0; step < steps; ++step) {
    const int buf = static_cast<int>(step & 1);
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      constexpr int kSideValues = kBatchChunk * kTile;
      C* dst = slot[k] < kSideValues ? &xi[buf][0][0] + slot[k] : &xj[buf][0][0] + (slot[k] - kSideValues);
      *dst = next[k];
    }
    __syncthreads();
    if (step + 1 < steps) load(step + 1);
    const int64_t fw = step / chunks, b0 = step % chunks * kBatchChunk;
    const int staged = a.batch - b0 < kBatchChunk ? static_cast<int>(a.batch - b0) : kBatchChunk;
    for (int bb = 0; bb < staged; ++bb) {
      C u[R], v[R];
      load_row<R>(&xi[buf][bb][R * ty], u);
      load_row<R>(&xj[buf][bb][R * tx], v);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < R; ++c) add_conj_product(s[r][c], u[r], v[c]);
    }
    if (b0 + kBatchChunk < a.batch) continue;  // S_f needs the row's other samples
    if (fd != 0 || fh != 0 || fw != 0) {       // the DC bin is left out (§3.5)
#pragma unroll
      for (int m = 0; m < kLags; ++m) {
        if (m < a.lags) {
          const C w = coef[fw * a.lags_total + a.lag0 + m];
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < R; ++c) add_product(acc[r][c][m], s[r][c], w);
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
