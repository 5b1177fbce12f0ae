// The cross-spectrum path's S stage (docs/math.md §3.5) on the float64 tensor cores of
// sm_90, for float32 spectra: S_f = sum_b X_f[b]^H X_f[b] by `mma.sync.m16n8k8.f64`,
// reduced at each fh to the h lags' Q[m] = sum_fh coef[fh, m] S_f in float32 registers, as
// cross_spectrum_s_stage.cu does with multiply-adds. Why: that kernel is bound by issuing
// instructions, well below the FMA peak, its diagonal tiles forming 3072 entries of S_f per
// row (seed) for the 2080 the Hermitian symmetry leaves (docs/performance.md); a
// float64 MMA does 1024 multiply-adds per instruction, and the products of float32 values
// are exact in float64.
//
// A warp's task is 16 rows i (block p) by 8 columns j (tile q) of S_f; the tasks with
// some entry on or above the diagonal are those with q >= 2p. A block's four warps take
// four consecutive tiles of one block p (or two tiles of each of two blocks p: BlockPlan) and
// stage, per step of 16 samples of one fh, the 16 row channels and the 32 column channels
// they read (32 and 16 for two blocks p), as float64 real and imaginary planes. An entry
// above the diagonal writes Q at (i, j) and at (j, i) from the four real
// sums of cross_spectrum_s_stage.cu's kMirror tiles; one on it writes once; one below writes
// nothing (the task holding its transpose writes it). A thread's two adjacent entries of a
// row, (i, j) and (i, j + 1), go out as one 16-byte store, so Q's rows are written in whole
// sectors.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "cross_spectrum/cuda/cross_spectrum_kernels.h"
#include "common/cuda/mma_f64.cuh"
#include "common/cuda/pdl.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockRows = 16;                                   // i per task: the MMA's M
constexpr int kTileCols = 8;                                     // j per task: the MMA's N
constexpr int kSamples = 16;                                     // samples per staged step
constexpr int kStaged = kBlockRows + kWarps * kTileCols;         // channels per step: 48
constexpr int kPitch = 52;                                       // = 4 (mod 16): the fragment loads'
                                                                 // 16 (sample, channel) pairs of a
                                                                 // half-warp fall in distinct banks
constexpr int kMaxLags = 5;

struct MmaArgs {
  const float2* x;     // [Ld, Lh, Lwf, B, Ci]
  const float2* coef;  // [Lh, lags_total]
  float2* q;           // [count, Lwf, lags_total, G, Cig, Cig]
  int64_t fd0, lh, lwf, batch, ci, cig, lags_total, lag0, lags;
  int tiles_q, blocks_per_row;
};

// What block `y` of a row computes. A row block p (16 rows) takes its tiles q >= 2p four at a
// time, a warp each. With an even tile count T, the row blocks whose T - 2p tiles are 2 more
// than a multiple of four (every other p) are all left with the same two tiles, T - 2 and
// T - 1: one block takes those of two such p, warps 0 and 1 for the first, 2 and 3 for the
// second, staging both row blocks and the two tiles (48 channels, as a block of four tiles).
// The seed problem's 64 channels (T = 8) then take 5 blocks per row instead of 6, two of which
// would have two idle warps. With an odd T the last block of a p is partial.
struct BlockPlan {
  int p[2];  // row blocks: p[0] for the warps (all, or 0 and 1 of a pair), p[1] for 2 and 3 (-1: none)
  int q0;    // the first column tile staged
  int rows;  // staged row channels, before the columns: 16, or 32 for a pair
};

__host__ __device__ __forceinline__ int full_blocks(int tiles_q, int p) {
  const int tiles = tiles_q - 2 * p;
  return tiles_q % 2 == 0 ? tiles / kWarps : (tiles + kWarps - 1) / kWarps;
}

__host__ __device__ __forceinline__ int paired_blocks(int tiles_q) {
  if (tiles_q % 2 != 0) return 0;
  const int half = tiles_q / 2, first = (half - 1) % 2;
  return ((half - first + 1) / 2 + 1) / 2;  // the p = first, first + 2, ... < half, two per block
}

__host__ __device__ __forceinline__ int blocks_per_row(int tiles_q) {
  int n = paired_blocks(tiles_q);
  for (int p = 0; 2 * p < tiles_q; ++p) n += full_blocks(tiles_q, p);
  return n;
}

__device__ __forceinline__ BlockPlan locate(int y, int tiles_q) {
  for (int p = 0; 2 * p < tiles_q; ++p) {
    const int n = full_blocks(tiles_q, p);
    if (y < n) return BlockPlan{{p, -1}, 2 * p + kWarps * y, kBlockRows};
    y -= n;
  }
  const int half = tiles_q / 2, first = (half - 1) % 2 + 4 * y, second = first + 2;
  return BlockPlan{{first, second < half ? second : -1}, tiles_q - 2, 2 * kBlockRows};
}

// re + i im += S of samples k0 .. k0 + K - 1 of a staged step for the warp's task:
// conj(u) v = (ur vr + ui vi) + i (ur vi - ui vr), u the block's row channels, v the warp's 8
// column channels. xs: the step's real plane at this thread's (sample lane%4, staged channel
// lane/4); col: where the warp's columns start past that; every other offset is a constant,
// so each load is one instruction.
template <int k0>
__device__ __forceinline__ void add_samples(const double* xs, int col, double (&re)[4], double (&im)[4]) {
  constexpr int K = kMmaK;
  constexpr int kIm = kSamples * kPitch;  // the imaginary plane, after the real one
  double ur[K / 2], ui[K / 2], vr[K / 4], vi[K / 4];
#pragma unroll
  for (int v = 0; v < K / 2; ++v) {
    const int at = (k0 + 4 * (v / 2)) * kPitch + 8 * (v % 2);
    ur[v] = xs[at];
    ui[v] = xs[kIm + at];
  }
#pragma unroll
  for (int v = 0; v < K / 4; ++v) {
    const int at = (k0 + 4 * v) * kPitch + col;
    vr[v] = xs[at];
    vi[v] = xs[kIm + at];
  }
  mma_f64(re, ur, vr);
  mma_f64(re, ui, vi);
  mma_f64(im, ur, vi);
#pragma unroll
  for (int v = 0; v < K / 2; ++v) ui[v] = -ui[v];
  mma_f64(im, ui, vr);
}

// The step's samples (the staged ones past them are zeros): the second MMA step runs only
// where one reaches it. Two explicit steps instead of a loop: their offsets are constants
// (a loop kept unrolled would hold both steps' operands, past the register budget).
static_assert(kSamples == 2 * kMmaK, "a staged step is two MMA steps");
__device__ __forceinline__ void add_step(const double* xs, int col, int samples, double (&re)[4], double (&im)[4]) {
  add_samples<0>(xs, col, re, im);
  if (samples > kMmaK) add_samples<kMmaK>(xs, col, re, im);
}

// (lo, hi) at `at` and at + 1 (16-byte aligned) as one 16-byte store. In PTX because nvcc
// 13.0 splits the float4 assignment in the kernel's epilogue into two 8-byte stores, and
// __stwb's st.global.wb becomes a strong store in SASS (STG.E.128.STRONG.SM), not the plain one.
__device__ __forceinline__ void store_pair(float2* at, float2 lo, float2 hi) {
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at), "f"(lo.x), "f"(lo.y), "f"(hi.x), "f"(hi.y)
               : "memory");
}

struct Smem {
  double x[2][2][kSamples][kPitch];  // [buffer][real, imaginary][sample][staged channel]
  float2 coef[2][kMaxLags];          // [fh parity][lag]: 0 past the launch's lags
};

// A step's staging: each thread moves kPieces pieces of two adjacent channels (16 bytes of
// x) of kSamples x kStaged values, converted to float64 into the real and imaginary planes.
constexpr int kPieces = kSamples * kStaged / 2 / kThreads;  // 3
static_assert(kSamples * kStaged % (2 * kThreads) == 0, "a step's pieces split evenly over the threads");

// kLag0Real: the launch's first lag is lag 0, whose coefficients are real (exp(0),
// docs/math.md §3.5), so its sums B and D stay 0: 8 multiply-adds and 8 registers fewer.
template <int kLags, bool kLag0Real>
__global__ void __launch_bounds__(kThreads, 3) cross_spectrum_mma_kernel(MmaArgs a) {
  __shared__ __align__(16) Smem st;
  pdl_chain_start();
  const int64_t row = blockIdx.x / a.blocks_per_row;  // (fd - fd0) Lwf + fw
  const BlockPlan plan = locate(static_cast<int>(blockIdx.x % a.blocks_per_row), a.tiles_q);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const bool paired = plan.rows != kBlockRows;
  const int side = paired ? warp / 2 : 0, p = side == 0 ? plan.p[0] : plan.p[1];  // the warp's row block
  const int q = plan.q0 + (paired ? warp % 2 : warp);       // and column tile
  const bool active = p >= 0 && q < a.tiles_q;
  const int64_t fd = a.fd0 + row / a.lwf, fw = row % a.lwf, group = blockIdx.z;
  const int i0 = kBlockRows * p, j0 = kTileCols * plan.q0;
  const int lh = static_cast<int>(a.lh), batch = static_cast<int>(a.batch);
  const int chunks = (batch + kSamples - 1) / kSamples;
  const bool dc_row = fd == 0 && fw == 0;  // its fh = 0 is the DC bin, left out (§3.5)

  // Piece k of this thread: sample e / (kStaged / 2) and pair e % (kStaged / 2) of the step,
  // e = threadIdx.x + k kThreads; the pairs are the block's 16 or 32 row channels, then its 32
  // or 16 column channels. src: its bytes past the step's first value (-1: no such channel); at: its
  // place in a plane of Smem::x (low 16 bits) and its sample (high 16), for the last chunk's bound.
  const char* x = reinterpret_cast<const char*>(a.x + (fd * a.lh * a.lwf + fw) * a.batch * a.ci + group * a.cig);
  int src[kPieces], at[kPieces];
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const int e = threadIdx.x + k * kThreads, sample = e / (kStaged / 2), slot = 2 * (e % (kStaged / 2));
    const int second = plan.p[1] >= 0 ? kBlockRows * (plan.p[1] - 1) + slot : -1;  // slot past 16
    const int channel = slot < kBlockRows ? kBlockRows * plan.p[0] + slot
                        : slot < plan.rows ? second
                                           : j0 + slot - plan.rows;
    src[k] = channel >= 0 && channel < a.cig ? (sample * static_cast<int>(a.ci) + channel) * 8 : -1;
    at[k] = sample << 16 | (sample * kPitch + slot);
  }
  const int64_t step_bytes = a.ci * 8;  // one sample's values
  float4 next[kPieces];
  float2 next_coef = float2{0, 0};
  const int64_t fh_bytes = a.lwf * a.batch * step_bytes;  // from one fh to the next
  auto load = [&](int fh, int chunk) {
    const int b0 = chunk * kSamples;
    const char* base = x + fh * fh_bytes + b0 * step_bytes;
#pragma unroll
    for (int k = 0; k < kPieces; ++k) {
      next[k] = src[k] >= 0 && (at[k] >> 16) < batch - b0 ? __ldg(reinterpret_cast<const float4*>(base + src[k]))
                                                      : float4{0, 0, 0, 0};
    }
    if (chunk == 0 && threadIdx.x < kLags) {
      next_coef = threadIdx.x < a.lags ? __ldg(a.coef + fh * a.lags_total + a.lag0 + threadIdx.x) : float2{0, 0};
    }
  };
  // Per entry e of the thread's four (d0..d3 of the MMA), the lags' sums (A, C) in acc and
  // (B, D) in mir, as cross_spectrum_s_stage.cu's add_mirror_sums keeps them.
  float2 acc[4][kLags], mir[4][kLags];
#pragma unroll
  for (int e = 0; e < 4; ++e)
#pragma unroll
    for (int m = 0; m < kLags; ++m) acc[e][m] = mir[e][m] = float2{0, 0};
  double re[4] = {0, 0, 0, 0}, im[4] = {0, 0, 0, 0};
  // add_step: the warp's rows start `rows` channels into the staged ones, its columns `col` past those.
  const int rows = kBlockRows * side, col = plan.rows + kTileCols * (q - plan.q0) - rows;

  load(0, 0);
  int buf = 0, next_fh = 0, next_chunk = 0;
  for (int fh = 0; fh < lh; ++fh) {
    for (int chunk = 0; chunk < chunks; ++chunk, buf ^= 1) {
      double* re_plane = &st.x[buf][0][0][0];
#pragma unroll
      for (int k = 0; k < kPieces; ++k) {
        double* to = re_plane + (at[k] & 0xffff);
        *reinterpret_cast<double2*>(to) = double2{next[k].x, next[k].z};
        *reinterpret_cast<double2*>(to + kSamples * kPitch) = double2{next[k].y, next[k].w};
      }
      if (chunk == 0 && threadIdx.x < kLags) st.coef[fh & 1][threadIdx.x] = next_coef;
      __syncthreads();
      if (++next_chunk == chunks) next_chunk = 0, ++next_fh;
      if (next_fh < lh) load(next_fh, next_chunk);
      if (active) add_step(&st.x[buf][0][t4][g + rows], col, min(batch - chunk * kSamples, kSamples), re, im);
    }
    if (active && (!dc_row || fh != 0)) {
#pragma unroll
      for (int m = 0; m < kLags; ++m) {
        const float2 w = st.coef[fh & 1][m];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float sr = static_cast<float>(re[e]), si = static_cast<float>(im[e]);
          acc[e][m].x = fmaf(w.x, sr, acc[e][m].x);
          acc[e][m].y = fmaf(w.x, si, acc[e][m].y);
          if (kLag0Real && m == 0) continue;
          mir[e][m].x = fmaf(w.y, si, mir[e][m].x);
          mir[e][m].y = fmaf(w.y, sr, mir[e][m].y);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) re[e] = im[e] = 0;
  }
  if (!active) return;
  // The stores, by pairs of entries: e = 2h and 2h + 1 are row i's adjacent columns j and
  // j + 1 (j even), so (i, j) and (i, j + 1) are one 16-byte store and a quad's four lanes
  // write row i's 64 bytes of the tile, two whole sectors (an 8-byte store per entry would
  // write half of each of four; only the diagonal tiles' stores leave sectors partial: ncu and
  // scripts/w_stage_store_check.py, docs/performance.md). The mirrored
  // (j, i) and (j + 1, i) stay 8-byte stores: the eight lanes g of one t4 hold eight
  // consecutive i, two whole sectors already. Cig is even (cross_spectrum_mma_supported):
  // j < Cig covers j + 1, and (i, j)'s offset is even, 16-byte aligned.
  const int64_t entries = static_cast<int64_t>(gridDim.z) * a.cig * a.cig;
  float2* out = a.q + (row * a.lags_total + a.lag0) * entries + group * a.cig * a.cig;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t i = i0 + g + 8 * h, j = int64_t(kTileCols) * q + 2 * t4;
    if (i > j + 1 || j >= a.cig) continue;  // both entries below the diagonal, or past the channels
    float2 *at = out + i * a.cig + j, *mirrored = out + j * a.cig + i;  // (i, j) and (j, i) at lag 0
#pragma unroll
    for (int m = 0; m < kLags; ++m, at += entries, mirrored += entries) {
      if (m >= a.lags) break;
      const float2 s0 = acc[2 * h][m], t0 = mir[2 * h][m], s1 = acc[2 * h + 1][m], t1 = mir[2 * h + 1][m];
      if (i <= j) {
        store_pair(at, float2{s0.x - t0.x, s0.y + t0.y}, float2{s1.x - t1.x, s1.y + t1.y});
        if (i < j) *mirrored = float2{s0.x + t0.x, t0.y - s0.y};
        mirrored[a.cig] = float2{s1.x + t1.x, t1.y - s1.y};  // (j + 1, i)
      } else {
        at[1] = float2{s1.x - t1.x, s1.y + t1.y};  // i = j + 1: (i, j + 1) on the diagonal, (i, j) below it
      }
    }
  }
}

// The smallest register budget of lags that holds the launch's (2 or kMaxLags).
template <int kLags>
void launch(const MmaArgs& a, dim3 grid, cudaStream_t stream) {
  if (a.lag0 == 0) {
    launch_overlapping(cross_spectrum_mma_kernel<kLags, true>, grid, dim3(kThreads), stream, a);
  } else {
    launch_overlapping(cross_spectrum_mma_kernel<kLags, false>, grid, dim3(kThreads), stream, a);
  }
}

void launch(const MmaArgs& a, dim3 grid, cudaStream_t stream) {
  if (a.lags <= 2) {
    launch<2>(a, grid, stream);
  } else {
    launch<kMaxLags>(a, grid, stream);
  }
}

}  // namespace

bool cross_spectrum_mma_supported(const at::Tensor& x_spec, int64_t groups) {
  // The staging reads 16-byte pieces of two channels: an even group size (so Ci is even
  // and every group starts a piece) and a 16-byte aligned spectrum.
  // Its staging offsets within a step (kSamples samples of Ci values, in bytes) are int.
  const int64_t cig = x_spec.size(4) / groups;
  if (x_spec.scalar_type() != at::kComplexFloat || cig % 2 != 0 ||
      reinterpret_cast<std::uintptr_t>(x_spec.data_ptr()) % 16 != 0 ||
      x_spec.size(4) * kSamples * 8 >= (int64_t(1) << 31) || x_spec.size(3) >= (int64_t(1) << 31)) {
    return false;
  }
  return compiled_for_sm90(reinterpret_cast<const void*>(cross_spectrum_mma_kernel<kMaxLags, true>), x_spec.device());
}

void cross_spectrum_rows_mma_cuda(const at::Tensor& x_spec, int64_t fd0, int64_t count, const at::Tensor& coef,
                                  int64_t groups, const at::Tensor& q) {
  const c10::cuda::CUDAGuard guard(x_spec.device());
  MmaArgs a;
  a.x = static_cast<const float2*>(x_spec.data_ptr());
  a.coef = static_cast<const float2*>(coef.data_ptr());
  a.q = static_cast<float2*>(q.data_ptr());
  // The kernel stores two entries of Q at a time, 16 bytes (q: at::empty, cross_spectrum_s_stage.cu).
  TORCH_CHECK(q.is_contiguous() && reinterpret_cast<std::uintptr_t>(a.q) % 16 == 0,
              "ct_bn_pool: the cross-spectrum path's S stage needs a contiguous, 16-byte aligned output");
  a.fd0 = fd0;
  a.lh = x_spec.size(1);
  a.lwf = x_spec.size(2);
  a.batch = x_spec.size(3);
  a.ci = x_spec.size(4);
  a.cig = a.ci / groups;
  a.lags_total = coef.size(1);
  const int64_t tiles_q = (a.cig + kTileCols - 1) / kTileCols;
  TORCH_CHECK(tiles_q < (int64_t(1) << 16), "ct_bn_pool: too many channels per group for the cross-spectrum path's S stage (",
              to_str(a.cig), ")");
  const int64_t per_row = blocks_per_row(static_cast<int>(tiles_q));
  const int64_t rows = count * a.lwf;
  TORCH_CHECK(rows * per_row < (int64_t(1) << 31) && groups < 65536,
              "ct_bn_pool: problem too large for the cross-spectrum path's S stage (", to_str(rows), " rows, ",
              to_str(per_row), " blocks per row, ", to_str(groups), " groups)");
  a.tiles_q = static_cast<int>(tiles_q);
  a.blocks_per_row = static_cast<int>(per_row);
  const dim3 grid(static_cast<unsigned>(rows * per_row), 1, static_cast<unsigned>(groups));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (a.lag0 = 0; a.lag0 < a.lags_total; a.lag0 += kMaxLags) {
    a.lags = std::min<int64_t>(kMaxLags, a.lags_total - a.lag0);
    launch(a, grid, stream);  // launch_overlapping checks the launch
  }
}

}  // namespace fused_ops
