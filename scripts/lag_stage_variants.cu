// Standalone microbenchmark of ways to run the cross-spectrum path's H stage
// (csrc/cuda/lag_stage.cu, docs/math.md §3.5) on the seed problem's shape: out[a, m, c] =
// sum_f coef[f, m] q[a, f, c] with q complex64 [10, 36, 20480] (59 MB: one chunk of Q), 9 real
// coefficients per frequency, float64 sums rounded to complex64. ncu (docs/performance.md,
// 2026-12-01 14:31 UTC) found csrc's kernel reading Q once at 1.86 TB/s with DRAM 39% busy;
// a 256-byte cp.async ring per thread was no faster. These variants ask what is: threads per
// column, loads in flight, and Q's layout (the W stage writes it, so it could write another).
// No torch: plain CUDA runtime. Run on the H200 on 2026-12-01, 15:47-15:57 UTC (docs/performance.md):
// every design that takes the shape at run time, as csrc's must, took 31.4-33.3 us (csrc's 33.2;
// blocked8 29.8), the tensor-core one 32.8-52.7; the kernels with the shape as constants (csrc,
// ahead8) 27-28; a plain read of Q 18. Since then the seed problem's stage after the S stage
// reads 62 MB with 19 frequencies instead (docs/math.md §3.5); the shape here is the old one.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 scripts/lag_stage_variants.cu -o /tmp/lag_stage_variants
//   /tmp/lag_stage_variants [--iters N] [--warmup N]
//   (or: scripts/gpu_check.sh lag-stage-variants)
//
// Every variant is checked against a host double reference on buffer 0 (max over outputs of
// |out - ref| / max|ref| < 1e-6: the outputs are complex64; exit 1 if one fails), then timed:
// --warmup calls (20), then --iters calls (200), each reading buffer i % 4 (4 x 59 MB: Q is never
// L2-resident), CUDA events around each call, median and min us, TB/s = (Q + out bytes) / median.
//
// Variants:
//   csrc        lag_stage_kernel<float2, float2, 9>'s design with the shape as constants: a
//               thread per column, 4 loads ahead, coefficients in shared memory, 256 threads,
//               3 blocks per SM
//   ahead8      the same with 8 loads ahead (64 bytes per thread)
//   parts4      4 threads per column, each every 4th frequency, sums added by shuffles
//   transposed  Q as [a, c, f] (the frequencies of a column adjacent): a thread per column
//               reads its 36 values as 16-byte pieces
// The shape at run time (Shape), as csrc's kernel takes it:
//   prod        csrc's kernel itself (80 registers, 60 bytes of spills)
//   leanK       rounds of K loads issued together, 32-bit counters, the pointer stepped
//   ringK[/2]   the next round's K loads in flight during this one's (/2: 2 blocks per SM)
//   offsK       32-bit offsets; blockedK: Q stored in blocks of 256 columns ([a, c/256, f, c%256])
//   pairsK      coefficients read as 16-byte pairs; 2colK[p]/2: two columns per thread
//   mmaS[/B]    out^T = coef^T Q on the float64 tensor cores (mma.m16n8k8), S steps of 8
//               frequencies in flight, B blocks per SM
// References: cudaMemcpyAsync D2D of one buffer (read + write counted), a plain read of it and
// of the blocked copy.
// Each variant is the code that was timed, so they repeat each other's bookkeeping rather than
// share helpers (a change to a shared one would change what the recorded figures measured).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda_check.cuh"

constexpr int kOuter = 10, kFreqs = 36, kLags = 9;
constexpr int64_t kCols = 20480;
constexpr int64_t kQ = kOuter * kFreqs * kCols;  // complex values
constexpr int64_t kOut = kOuter * kLags * kCols;
constexpr int kBuffers = 4;
constexpr int kThreads = 256;

__device__ __forceinline__ float2 narrow(double2 v) { return float2{float(v.x), float(v.y)}; }

// csrc's design (lag_stage.cu), all frequencies' coefficients staged at once (36 x 9).
template <int kAhead>
__global__ void __launch_bounds__(kThreads, 3) column_kernel(const float2* q, const double* coef, float2* out) {
  __shared__ double c[kFreqs][kLags];
  for (int i = threadIdx.x; i < kFreqs * kLags; i += kThreads) c[i / kLags][i % kLags] = coef[i];
  __syncthreads();
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= kOuter * kCols) return;
  const int64_t a = t / kCols, col = t % kCols;
  const float2* p = q + a * kFreqs * kCols + col;
  double2 acc[kLags];
#pragma unroll
  for (int m = 0; m < kLags; ++m) acc[m] = double2{0, 0};
  float2 ahead[kAhead];
#pragma unroll
  for (int k = 0; k < kAhead; ++k) ahead[k] = p[k * kCols];
  for (int f0 = 0; f0 < kFreqs; f0 += kAhead) {
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      const int f = f0 + k;
      const float2 v = ahead[k];
      ahead[k] = f + kAhead < kFreqs ? p[(f + kAhead) * kCols] : float2{0, 0};
      if (f < kFreqs) {
#pragma unroll
        for (int m = 0; m < kLags; ++m) {
          acc[m].x = fma(c[f][m], double(v.x), acc[m].x);
          acc[m].y = fma(c[f][m], double(v.y), acc[m].y);
        }
      }
    }
  }
  float2* o = out + a * kLags * kCols + col;
#pragma unroll
  for (int m = 0; m < kLags; ++m) o[m * kCols] = narrow(acc[m]);
}

// 4 threads per column: lanes l, l + 8, l + 16, l + 24 of a warp share column l % 8 and take
// frequencies part, part + 4, ... (part = lane / 8); xor shuffles add their sums in a fixed order.
constexpr int kParts = 4, kWarpCols = 32 / kParts, kPartFreqs = kFreqs / kParts;
static_assert(kFreqs % kParts == 0, "whole frequencies per part");
__global__ void __launch_bounds__(kThreads, 3) parts_kernel(const float2* q, const double* coef, float2* out) {
  __shared__ double c[kFreqs][kLags];
  for (int i = threadIdx.x; i < kFreqs * kLags; i += kThreads) c[i / kLags][i % kLags] = coef[i];
  __syncthreads();
  const int lane = threadIdx.x % 32, part = lane / kWarpCols;
  const int64_t t = (int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32) * kWarpCols + lane % kWarpCols;
  const bool active = t < kOuter * kCols;  // the same for a column's four lanes
  const int64_t a = active ? t / kCols : 0, col = active ? t % kCols : 0;
  const float2* p = q + a * kFreqs * kCols + col;
  float2 v[kPartFreqs];
#pragma unroll
  for (int s = 0; s < kPartFreqs; ++s) v[s] = active ? p[(kParts * s + part) * kCols] : float2{0, 0};
  double2 acc[kLags];
#pragma unroll
  for (int m = 0; m < kLags; ++m) {
    acc[m] = double2{0, 0};
#pragma unroll
    for (int s = 0; s < kPartFreqs; ++s) {
      const double w = c[kParts * s + part][m];
      acc[m].x = fma(w, double(v[s].x), acc[m].x);
      acc[m].y = fma(w, double(v[s].y), acc[m].y);
    }
#pragma unroll
    for (int d = kWarpCols; d < 32; d *= 2) {
      acc[m].x += __shfl_xor_sync(0xffffffffu, acc[m].x, d);
      acc[m].y += __shfl_xor_sync(0xffffffffu, acc[m].y, d);
    }
  }
  if (!active) return;
  float2* o = out + a * kLags * kCols + col;
#pragma unroll
  for (int m = 0; m < kLags; ++m) {
    if (m % kParts == part) o[m * kCols] = narrow(acc[m]);
  }
}

// Q as [a, c, f]: a column's 36 values (288 bytes) adjacent, read as 18 16-byte pieces.
__global__ void __launch_bounds__(kThreads, 3) transposed_kernel(const float2* qt, const double* coef, float2* out) {
  __shared__ double c[kFreqs][kLags];
  for (int i = threadIdx.x; i < kFreqs * kLags; i += kThreads) c[i / kLags][i % kLags] = coef[i];
  __syncthreads();
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= kOuter * kCols) return;
  const float4* p = reinterpret_cast<const float4*>(qt + t * kFreqs);
  double2 acc[kLags];
#pragma unroll
  for (int m = 0; m < kLags; ++m) acc[m] = double2{0, 0};
  constexpr int kBatch = 6;  // pieces (12 frequencies) in flight
  for (int f0 = 0; f0 < kFreqs; f0 += 2 * kBatch) {
    float4 piece[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) piece[k] = __ldg(p + f0 / 2 + k);
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int f = f0 + 2 * k;
#pragma unroll
      for (int m = 0; m < kLags; ++m) {
        acc[m].x = fma(c[f][m], double(piece[k].x), acc[m].x);
        acc[m].y = fma(c[f][m], double(piece[k].y), acc[m].y);
        acc[m].x = fma(c[f + 1][m], double(piece[k].z), acc[m].x);
        acc[m].y = fma(c[f + 1][m], double(piece[k].w), acc[m].y);
      }
    }
  }
  const int64_t a = t / kCols, col = t % kCols;
  float2* o = out + a * kLags * kCols + col;
#pragma unroll
  for (int m = 0; m < kLags; ++m) o[m * kCols] = narrow(acc[m]);
}
static_assert(kFreqs % 12 == 0, "transposed_kernel reads 12 frequencies at a time");

// The runtime-shaped kernels below take the shape as arguments, as csrc's does (the kernels
// above are fully unrolled over the constant 36 frequencies, which csrc's cannot be).
struct Shape {
  int64_t outer, freqs, cols, lags_total, lag0, lags;
};

// csrc/cuda/lag_stage.cu's lag_stage_kernel<float2, float2, 9> as of 2026-12-01 (7c13e05): 80
// registers with 60 bytes of spills under __launch_bounds__(256, 3).
constexpr int kTile = 64;
__global__ void __launch_bounds__(kThreads, 3) prod_kernel(const float2* q_, const double* coef_, float2* out_, Shape a) {
  __shared__ double coef[kTile][kLags];
  constexpr int kA = 4;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool active = t < a.outer * a.cols;
  const int64_t outer = active ? t / a.cols : 0, col = active ? t % a.cols : 0;
  const float2* __restrict__ q = q_ + outer * a.freqs * a.cols + col;
  double2 acc[kLags];
#pragma unroll
  for (int m = 0; m < kLags; ++m) acc[m] = double2{0, 0};
  float2 ahead[kA];
#pragma unroll
  for (int k = 0; k < kA; ++k) ahead[k] = active && k < a.freqs ? q[k * a.cols] : float2{0, 0};
  for (int64_t f0 = 0; f0 < a.freqs; f0 += kTile) {
    const int tile = static_cast<int>(a.freqs - f0 < kTile ? a.freqs - f0 : kTile);
    const int rows = (tile + kA - 1) / kA * kA;
    __syncthreads();
    for (int i = threadIdx.x; i < rows * kLags; i += kThreads) {
      const int f = i / kLags, m = i % kLags;
      coef[f][m] = m < a.lags && f < tile ? coef_[(f0 + f) * a.lags_total + a.lag0 + m] : 0.0;
    }
    __syncthreads();
    for (int k0 = 0; k0 < rows; k0 += kA) {
#pragma unroll
      for (int k = 0; k < kA; ++k) {
        const int64_t f = f0 + k0 + k;
        const double2 v{double(ahead[k].x), double(ahead[k].y)};
        ahead[k] = active && f + kA < a.freqs ? q[(f + kA) * a.cols] : float2{0, 0};
#pragma unroll
        for (int m = 0; m < kLags; ++m) {
          acc[m].x = fma(coef[k0 + k][m], v.x, acc[m].x);
          acc[m].y = fma(coef[k0 + k][m], v.y, acc[m].y);
        }
      }
    }
  }
  if (!active) return;
  float2* out = out_ + (outer * a.lags_total + a.lag0) * a.cols + col;
#pragma unroll
  for (int m = 0; m < kLags; ++m) {
    if (m < a.lags) out[m * a.cols] = narrow(acc[m]);
  }
}

// Leaner bookkeeping: 32-bit frequency counters, the column's pointer stepped by cols, and the
// loads of a round of kA frequencies issued together (kRing: one round ahead, in a second set
// of registers; else at the round's start). Coefficients as above.
template <int kA, bool kRing, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) lean_kernel(const float2* q_, const double* coef_, float2* out_, Shape a) {
  __shared__ double coef[kTile][kLags];
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool active = t < a.outer * a.cols;
  const int64_t outer = active ? t / a.cols : 0, col = active ? t % a.cols : 0;
  const int freqs = static_cast<int>(a.freqs);
  const int64_t step = a.cols;
  const float2* __restrict__ q = q_ + outer * a.freqs * step + col;
  double2 acc[kLags];
#pragma unroll
  for (int m = 0; m < kLags; ++m) acc[m] = double2{0, 0};
  float2 v[kA];
  auto load_round = [&](int f) {
#pragma unroll
    for (int k = 0; k < kA; ++k) v[k] = active && f + k < freqs ? q[(f + k) * step] : float2{0, 0};
  };
  if (kRing) load_round(0);
  for (int f0 = 0; f0 < freqs; f0 += kTile) {
    const int tile = min(freqs - f0, kTile), rows = (tile + kA - 1) / kA * kA;
    __syncthreads();
    for (int i = threadIdx.x; i < rows * kLags; i += kThreads) {
      const int f = i / kLags, m = i % kLags;
      coef[f][m] = m < a.lags && f < tile ? coef_[(f0 + f) * a.lags_total + a.lag0 + m] : 0.0;
    }
    __syncthreads();
    for (int k0 = 0; k0 < rows; k0 += kA) {
      float2 u[kA];
      if (kRing) {
#pragma unroll
        for (int k = 0; k < kA; ++k) u[k] = v[k];
        load_round(f0 + k0 + kA);
      } else {
        load_round(f0 + k0);
#pragma unroll
        for (int k = 0; k < kA; ++k) u[k] = v[k];
      }
#pragma unroll
      for (int k = 0; k < kA; ++k) {
#pragma unroll
        for (int m = 0; m < kLags; ++m) {
          acc[m].x = fma(coef[k0 + k][m], double(u[k].x), acc[m].x);
          acc[m].y = fma(coef[k0 + k][m], double(u[k].y), acc[m].y);
        }
      }
    }
  }
  if (!active) return;
  float2* out = out_ + (outer * a.lags_total + a.lag0) * step + col;
#pragma unroll
  for (int m = 0; m < kLags; ++m) {
    if (m < a.lags) out[m * step] = narrow(acc[m]);
  }
}

// lean_kernel<kA, false> with the offsets of a column's frequencies in 32 bits (kBlocked: Q
// stored by blocks of kThreads columns, [a, c / 256, f, c % 256], so that a block's loads
// cover one contiguous 73 KB slab instead of 36 rows 160 KB apart).
template <int kA, bool kBlocked>
__global__ void __launch_bounds__(kThreads, 3) offs_kernel(const float2* q_, const double* coef_, float2* out_, Shape a) {
  __shared__ double coef[kTile][kLags];
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool active = t < a.outer * a.cols;
  const int64_t outer = active ? t / a.cols : 0, col = active ? t % a.cols : 0;
  const int freqs = static_cast<int>(a.freqs);
  const int step = kBlocked ? kThreads : static_cast<int>(a.cols);
  const float2* __restrict__ q =
      q_ + outer * a.freqs * a.cols + (kBlocked ? (col / kThreads) * kThreads * a.freqs + col % kThreads : col);
  double2 acc[kLags];
#pragma unroll
  for (int m = 0; m < kLags; ++m) acc[m] = double2{0, 0};
  for (int f0 = 0; f0 < freqs; f0 += kTile) {
    const int tile = min(freqs - f0, kTile), rows = (tile + kA - 1) / kA * kA;
    __syncthreads();
    for (int i = threadIdx.x; i < rows * kLags; i += kThreads) {
      const int f = i / kLags, m = i % kLags;
      coef[f][m] = m < a.lags && f < tile ? coef_[(f0 + f) * a.lags_total + a.lag0 + m] : 0.0;
    }
    __syncthreads();
    for (int k0 = 0; k0 < rows; k0 += kA) {
      float2 u[kA];
      const float2* p = q + (f0 + k0) * step;
#pragma unroll
      for (int k = 0; k < kA; ++k) u[k] = active && f0 + k0 + k < freqs ? p[k * step] : float2{0, 0};
#pragma unroll
      for (int k = 0; k < kA; ++k) {
#pragma unroll
        for (int m = 0; m < kLags; ++m) {
          acc[m].x = fma(coef[k0 + k][m], double(u[k].x), acc[m].x);
          acc[m].y = fma(coef[k0 + k][m], double(u[k].y), acc[m].y);
        }
      }
    }
  }
  if (!active) return;
  float2* out = out_ + (outer * a.lags_total + a.lag0) * a.cols + col;
#pragma unroll
  for (int m = 0; m < kLags; ++m) {
    if (m < a.lags) out[m * a.cols] = narrow(acc[m]);
  }
}
static_assert(kCols % kThreads == 0, "the blocked layout's blocks are whole");

// Coefficient loads per multiply-add (the hypothesis: the stage is bound by its shared-memory
// loads, 9 per frequency per column for 18 multiply-adds). kCols2: 2 columns per thread (c and
// c + cols / 2 of its `outer`), each coefficient feeding 4 multiply-adds; kPairs: the
// coefficients read as 16-byte pairs (lags padded to 10).
template <int kA, int kColsPer, bool kPairs, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) reuse_kernel(const float2* q_, const double* coef_, float2* out_, Shape a) {
  constexpr int kPad = kPairs ? kLags + 1 : kLags;
  __shared__ __align__(16) double coef[kTile][kPad];
  const int64_t half = a.cols / kColsPer;  // columns per part (cols % kColsPer == 0 here)
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool active = t < a.outer * half;
  const int64_t outer = active ? t / half : 0, col = active ? t % half : 0;
  const int freqs = static_cast<int>(a.freqs);
  const int step = static_cast<int>(a.cols);
  const float2* __restrict__ q = q_ + outer * a.freqs * a.cols + col;
  double2 acc[kColsPer][kLags];
#pragma unroll
  for (int j = 0; j < kColsPer; ++j)
#pragma unroll
    for (int m = 0; m < kLags; ++m) acc[j][m] = double2{0, 0};
  for (int f0 = 0; f0 < freqs; f0 += kTile) {
    const int tile = min(freqs - f0, kTile), rows = (tile + kA - 1) / kA * kA;
    __syncthreads();
    for (int i = threadIdx.x; i < rows * kPad; i += kThreads) {
      const int f = i / kPad, m = i % kPad;
      coef[f][m] = m < a.lags && f < tile ? coef_[(f0 + f) * a.lags_total + a.lag0 + m] : 0.0;
    }
    __syncthreads();
    for (int k0 = 0; k0 < rows; k0 += kA) {
      float2 u[kColsPer][kA];
      const float2* p = q + (f0 + k0) * step;
#pragma unroll
      for (int k = 0; k < kA; ++k)
#pragma unroll
        for (int j = 0; j < kColsPer; ++j)
          u[j][k] = active && f0 + k0 + k < freqs ? p[k * step + j * half] : float2{0, 0};
#pragma unroll
      for (int k = 0; k < kA; ++k) {
        double w[kPad];
        if (kPairs) {
#pragma unroll
          for (int m = 0; m < kPad; m += 2) {
            const double2 c2 = *reinterpret_cast<const double2*>(&coef[k0 + k][m]);
            w[m] = c2.x;
            w[m + 1] = c2.y;
          }
        } else {
#pragma unroll
          for (int m = 0; m < kLags; ++m) w[m] = coef[k0 + k][m];
        }
#pragma unroll
        for (int j = 0; j < kColsPer; ++j)
#pragma unroll
          for (int m = 0; m < kLags; ++m) {
            acc[j][m].x = fma(w[m], double(u[j][k].x), acc[j][m].x);
            acc[j][m].y = fma(w[m], double(u[j][k].y), acc[j][m].y);
          }
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int j = 0; j < kColsPer; ++j) {
    float2* out = out_ + (outer * a.lags_total + a.lag0) * a.cols + col + j * half;
#pragma unroll
    for (int m = 0; m < kLags; ++m) {
      if (m < a.lags) out[m * a.cols] = narrow(acc[j][m]);
    }
  }
}

// The stage as a product on the float64 tensor cores: out^T [lags, 2 cols] = coef^T [lags,
// freqs] x Q [freqs, 2 cols] (Q's real and imaginary parts as columns), mma.m16n8k8.f64 with
// the lags as M (9 of 16), 8 frequencies as K and 8 real columns as N. A warp owns 16 complex
// columns (4 MMAs per step of 8 frequencies): a thread loads, per step, two 16-byte pieces
// (frequencies k0 + lane%4 and + 4, complex columns 2 (lane/4) and + 1 of the warp's), whose
// four reals are column lane/4 of the four MMAs; so its sums come out as 4 adjacent complex
// columns (4 (lane%4) .. + 3) of lags lane/4 and lane/4 + 8. Coefficients from global (L1).
__device__ __forceinline__ void mma16x8x8(double (&d)[4], const double (&a)[4], const double (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}
template <int kSteps, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) mma_kernel(const float2* q_, const double* coef, float2* out_, Shape a) {
  constexpr int kWarpCols = 16;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t chunks = (a.cols + kWarpCols - 1) / kWarpCols;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (w >= a.outer * chunks) return;  // whole warps
  const int64_t outer = w / chunks, c0 = (w % chunks) * kWarpCols + 2 * g;  // this thread's two columns
  const bool in0 = c0 < a.cols, in1 = c0 + 1 < a.cols;
  const int freqs = static_cast<int>(a.freqs);
  const float2* q = q_ + outer * a.freqs * a.cols + c0;
  double d[4][4] = {};
  float4 v[kSteps][2];
  auto load = [&](int s, int k0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int f = k0 + t + 4 * h;
      const float2* p = q + static_cast<int64_t>(f) * a.cols;
      v[s][h] = f < freqs && in1 ? *reinterpret_cast<const float4*>(p)
                : f < freqs && in0 ? float4{p[0].x, p[0].y, 0.f, 0.f} : float4{0, 0, 0, 0};
    }
  };
#pragma unroll
  for (int s = 0; s < kSteps; ++s) load(s, 8 * s);
  for (int k0 = 0; k0 < freqs; k0 += 8 * kSteps) {
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int k = k0 + 8 * s;
      double c[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int f = k + t + 4 * (u / 2), m = g + 8 * (u % 2);
        c[u] = f < freqs && m < a.lags ? __ldg(coef + f * a.lags_total + a.lag0 + m) : 0.0;
      }
      const double b[4][2] = {{v[s][0].x, v[s][1].x}, {v[s][0].y, v[s][1].y}, {v[s][0].z, v[s][1].z},
                              {v[s][0].w, v[s][1].w}};
      load(s, k + 8 * kSteps);
#pragma unroll
      for (int j = 0; j < 4; ++j) mma16x8x8(d[j], c, b[j]);
    }
  }
  // d[j][0..1]: lag g, real columns 8t + j and 8t + 4 + j of the warp's (complex 4t + j/2 ...):
  // complex column 4t + e/2 (e = 0..3 from d[.][0]) and 4t + 2 + e/2 (from d[.][1]).
  const int64_t cw = (w % chunks) * kWarpCols + 4 * t;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = g + 8 * r;
    if (m >= a.lags) continue;
    float2* o = out_ + (outer * a.lags_total + a.lag0 + m) * a.cols + cw;
    const float2 vals[4] = {float2{float(d[0][2 * r]), float(d[1][2 * r])}, float2{float(d[2][2 * r]), float(d[3][2 * r])},
                            float2{float(d[0][2 * r + 1]), float(d[1][2 * r + 1])},
                            float2{float(d[2][2 * r + 1]), float(d[3][2 * r + 1])}};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (cw + e < a.cols) o[e] = vals[e];
  }
}

// A plain read of a buffer, 16-byte pieces, summed so that the loads are not dropped.
__global__ void read_kernel(const float4* q, int64_t n, float* sink) {
  float s = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = __ldg(q + i);
    s += v.x + v.y + v.z + v.w;
  }
  if (s == 1234.5f) *sink = s;  // practically never: keeps the sum live
}

int main(int argc, char** argv) {
  int iters = 200, warmup = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--warmup")) warmup = atoi(argv[i + 1]);
  }
  std::vector<float2> hq(kQ);
  std::vector<double> hc(kFreqs * kLags);
  uint64_t s = 12345;
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return float((s >> 40) & 0xffffff) / float(1 << 24) - 0.5f;
  };
  for (auto& v : hq) v = float2{next(), next()};
  for (auto& v : hc) v = double(next());
  std::vector<float2> hqt(kQ);  // [a, c, f]
  for (int a = 0; a < kOuter; ++a)
    for (int f = 0; f < kFreqs; ++f)
      for (int64_t col = 0; col < kCols; ++col)
        hqt[(a * kCols + col) * kFreqs + f] = hq[(int64_t(a) * kFreqs + f) * kCols + col];
  std::vector<float2> hqb(kQ);  // [a, c / 256, f, c % 256]
  for (int a = 0; a < kOuter; ++a)
    for (int f = 0; f < kFreqs; ++f)
      for (int64_t col = 0; col < kCols; ++col)
        hqb[(int64_t(a) * kCols + col / kThreads * kThreads) * kFreqs + f * kThreads + col % kThreads] =
            hq[(int64_t(a) * kFreqs + f) * kCols + col];
  std::vector<double> ref(2 * kOut, 0.0);
  double ref_max = 0;
  for (int a = 0; a < kOuter; ++a)
    for (int m = 0; m < kLags; ++m)
      for (int64_t col = 0; col < kCols; ++col) {
        double re = 0, im = 0;
        for (int f = 0; f < kFreqs; ++f) {
          const float2 v = hq[(int64_t(a) * kFreqs + f) * kCols + col];
          re += hc[f * kLags + m] * v.x;
          im += hc[f * kLags + m] * v.y;
        }
        const int64_t o = (int64_t(a) * kLags + m) * kCols + col;
        ref[2 * o] = re;
        ref[2 * o + 1] = im;
        ref_max = std::max(ref_max, std::max(std::fabs(re), std::fabs(im)));
      }

  float2 *q[kBuffers], *qt[kBuffers], *qb[kBuffers], *out, *scratch;
  double* coef;
  float* sink;
  for (int b = 0; b < kBuffers; ++b) {
    CK(cudaMalloc(&q[b], kQ * sizeof(float2)));
    CK(cudaMalloc(&qt[b], kQ * sizeof(float2)));
    CK(cudaMemcpy(q[b], hq.data(), kQ * sizeof(float2), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(qt[b], hqt.data(), kQ * sizeof(float2), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&qb[b], kQ * sizeof(float2)));
    CK(cudaMemcpy(qb[b], hqb.data(), kQ * sizeof(float2), cudaMemcpyHostToDevice));
  }
  CK(cudaMalloc(&out, kOut * sizeof(float2)));
  CK(cudaMalloc(&scratch, kQ * sizeof(float2)));
  CK(cudaMalloc(&coef, hc.size() * sizeof(double)));
  CK(cudaMalloc(&sink, sizeof(float)));
  CK(cudaMemcpy(coef, hc.data(), hc.size() * sizeof(double), cudaMemcpyHostToDevice));

  const Shape shape{kOuter, kFreqs, kCols, kLags, 0, kLags};
  const unsigned column_blocks = unsigned((kOuter * kCols + kThreads - 1) / kThreads);
  const unsigned parts_blocks = unsigned((kOuter * kCols * kParts + kThreads - 1) / kThreads);
  struct Variant {
    std::string name;
    std::function<void(int)> run;  // buffer
    bool checked;
  };
  std::vector<Variant> variants = {
      {"csrc", [&](int b) { column_kernel<4><<<column_blocks, kThreads>>>(q[b], coef, out); }, true},
      {"ahead8", [&](int b) { column_kernel<8><<<column_blocks, kThreads>>>(q[b], coef, out); }, true},
      {"parts4", [&](int b) { parts_kernel<<<parts_blocks, kThreads>>>(q[b], coef, out); }, true},
      {"transposed", [&](int b) { transposed_kernel<<<column_blocks, kThreads>>>(qt[b], coef, out); }, true},
      {"prod", [&](int b) { prod_kernel<<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"lean4", [&](int b) { lean_kernel<4, false, 3><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"lean8", [&](int b) { lean_kernel<8, false, 3><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"lean12", [&](int b) { lean_kernel<12, false, 3><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"ring4", [&](int b) { lean_kernel<4, true, 3><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"ring6", [&](int b) { lean_kernel<6, true, 3><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"ring8/2", [&](int b) { lean_kernel<8, true, 2><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"offs4", [&](int b) { offs_kernel<4, false><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"offs8", [&](int b) { offs_kernel<8, false><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"blocked4", [&](int b) { offs_kernel<4, true><<<column_blocks, kThreads>>>(qb[b], coef, out, shape); }, true},
      {"blocked8", [&](int b) { offs_kernel<8, true><<<column_blocks, kThreads>>>(qb[b], coef, out, shape); }, true},
      {"blk-read", [&](int b) { read_kernel<<<132 * 8, 512>>>(reinterpret_cast<const float4*>(qb[b]), kQ / 2, sink); }, false},
      {"pairs4", [&](int b) { reuse_kernel<4, 1, true, 3><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"pairs8", [&](int b) { reuse_kernel<8, 1, true, 3><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"2col4/2", [&](int b) { reuse_kernel<4, 2, false, 2><<<column_blocks / 2, kThreads>>>(q[b], coef, out, shape); }, true},
      {"2col4p/2", [&](int b) { reuse_kernel<4, 2, true, 2><<<column_blocks / 2, kThreads>>>(q[b], coef, out, shape); }, true},
      {"mma1", [&](int b) { mma_kernel<1, 1><<<unsigned(kOuter * kCols / 16 / 8), kThreads>>>(q[b], coef, out, shape); }, true},
      {"mma2", [&](int b) { mma_kernel<2, 1><<<unsigned(kOuter * kCols / 16 / 8), kThreads>>>(q[b], coef, out, shape); }, true},
      {"mma3", [&](int b) { mma_kernel<3, 1><<<unsigned(kOuter * kCols / 16 / 8), kThreads>>>(q[b], coef, out, shape); }, true},
      {"mma1/3", [&](int b) { mma_kernel<1, 3><<<unsigned(kOuter * kCols / 16 / 8), kThreads>>>(q[b], coef, out, shape); }, true},
      {"mma2/2", [&](int b) { mma_kernel<2, 2><<<unsigned(kOuter * kCols / 16 / 8), kThreads>>>(q[b], coef, out, shape); }, true},
      {"lean12/2", [&](int b) { lean_kernel<12, false, 2><<<column_blocks, kThreads>>>(q[b], coef, out, shape); }, true},
      {"memcpy D2D", [&](int b) { CK(cudaMemcpyAsync(scratch, q[b], kQ * sizeof(float2), cudaMemcpyDeviceToDevice)); },
       false},
      {"read", [&](int b) { read_kernel<<<132 * 8, 512>>>(reinterpret_cast<const float4*>(q[b]), kQ / 2, sink); },
       false},
  };
  int failed = 0;
  std::vector<float2> got(kOut);
  printf("%-12s %10s %10s %8s %10s\n", "variant", "median_us", "min_us", "TB/s", "max_err");
  for (auto& v : variants) {
    double err = 0;
    if (v.checked) {
      CK(cudaMemset(out, 0xff, kOut * sizeof(float2)));  // NaNs where a variant writes nothing
      v.run(0);
      CK_LAUNCH();
      CK(cudaMemcpy(got.data(), out, kOut * sizeof(float2), cudaMemcpyDeviceToHost));
      for (int64_t o = 0; o < kOut; ++o) {
        const double e = std::max(std::fabs(got[o].x - ref[2 * o]), std::fabs(got[o].y - ref[2 * o + 1]));
        err = std::isnan(e) ? INFINITY : std::max(err, e / ref_max);
      }
      if (!(err < 1e-6)) ++failed;
    }
    for (int i = 0; i < warmup; ++i) v.run(i % kBuffers);
    CK_LAUNCH();
    std::vector<cudaEvent_t> start(iters), end(iters);
    for (int i = 0; i < iters; ++i) {
      CK(cudaEventCreate(&start[i]));
      CK(cudaEventCreate(&end[i]));
      CK(cudaEventRecord(start[i]));
      v.run(i % kBuffers);
      CK(cudaEventRecord(end[i]));
    }
    CK_LAUNCH();
    CK(cudaDeviceSynchronize());
    std::vector<double> us = elapsed_us(start, end);
    for (int i = 0; i < iters; ++i) {
      CK(cudaEventDestroy(start[i]));
      CK(cudaEventDestroy(end[i]));
    }
    std::sort(us.begin(), us.end());
    const double median = us[us.size() / 2];
    const double bytes = v.name == "read" || v.name == "blk-read" ? kQ * 8.0 : v.name == "memcpy D2D" ? 2 * kQ * 8.0 : (kQ + kOut) * 8.0;
    printf("%-12s %10.1f %10.1f %8.2f %10.1e%s\n", v.name.c_str(), median, us[0], bytes / median * 1e-6, err,
           v.checked && !(err < 1e-6) ? "  FAILED" : "");
  }
  return failed ? 1 : 0;
}
