// Standalone microbenchmark of end-to-end variants of eval mode for the seed
// problem (docs/math.md §2, docs/performance.md "Eval mode"): no torch, plain
// CUDA runtime + CUB, so one run times every variant on the same data.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 scripts/eval_variants.cu -o /tmp/eval_variants
//   /tmp/eval_variants [--iters N] [--warmup N] [--bufs N] [--check] [--selftest] [--only SUBSTR]
//
//   (default)   correctness pass of every variant on every buffer, then timing; exit 1 if a
//               variant's output is off (rel err > 1e-6) or NaN
//   --check     the correctness pass only (no timing); exit 1 on any failure
//   --selftest  CPU only, touches no GPU: index maps, the eval algebra against a brute-force
//               ConvTranspose3d on a tiny problem, the finalize arithmetic per layout
//
// x float32 [16, 64, 16, 32, 32] (64 MiB), weight [64, 128, 5, 5, 5] (4 MB), out [16, 128]:
//   X[b, ci] = sum of x[b, ci], W[ci, co] = sum of weight[ci, co]
//   S[b, co] = sum_ci X[b, ci] W[ci, co]           (conv output sum, bias excluded)
//   z = scale * (S / N + bias),  N = 20 * 36 * 36  (conv-transpose output positions)
//   out = (z - running_mean) / sqrt(running_var + eps) * gamma + beta
// computed as csrc/bn_finalize.h does: shift = running_mean - scale * bias,
// out = (scale * S / N - shift) * inv_std * gamma + beta, in double, rounded once.
//
// Timing: like bench/bench_ct_bn_pool.py, a GPU spin kernel before each call (so the
// call's launches are queued before the GPU reaches it), CUDA events around the call,
// median and min over --iters calls after --warmup calls; call i reads x buffer
// i % bufs and weight copy i % bufs (bufs >= 6 buffers of 64 MiB: x is never L2
// resident, the 60 MB L2 holding less than one).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_reduce.cuh>
#include <cub/warp/warp_reduce.cuh>
#include <functional>
#include <set>
#include <string>
#include <vector>

namespace cg = cooperative_groups;

#define HD __host__ __device__ __forceinline__

#include "cuda_check.cuh"

// ---------------------------------------------------------------------------------------
// Problem (seed shape)
constexpr int B = 16, CI = 64, CO = 128, D = 16, H = 32, W = 32, KS = 5;
constexpr int64_t LEN = int64_t(D) * H * W;  // 16384 elements per (b, ci) row
constexpr int64_t ROWS = int64_t(B) * CI;    // 1024
constexpr int64_t XN = ROWS * LEN;           // 16 Mi floats = 64 MiB
constexpr int64_t TAPS = int64_t(KS) * KS * KS;
constexpr int64_t WROWS = int64_t(CI) * CO;  // 8192 rows of 125 taps
constexpr int64_t WN = WROWS * TAPS;
constexpr double SPATIAL = double(D + KS - 1) * (H + KS - 1) * (W + KS - 1);  // 20*36*36
constexpr double SCALE = 2.0, EPS = 1e-5;
constexpr int T = 256;  // threads of every x block
constexpr int TW = T / 32;
constexpr int MAX_BLOCKS_TRACE = 4096;
// Trace slots per finalize block: 0 start, 1 after its pre-wait reads, 2 after
// griddepcontrol.wait, 3 the SM id, 4 end (after its last store).
constexpr int TRACE_F = 8;

struct Params {
  const float* x;  // this call's x buffer
  const float* w;  // this call's weight copy
  double* xs;      // [B, CI, J] partial row sums of x (J = parts)
  double* ws;      // [CI, CO] weight sums (variants that store them)
  double* ssum;    // [CO, B] scratch of the replica finalize (as csrc)
  const float *bias, *gamma, *beta, *rmean, *rvar;  // [CO]
  float* out;                                       // [B, CO]
  unsigned* counter;                                // [2], zero between calls (V4)
  unsigned long long* trace;  // null, or [2 * 4096 + TRACE_F * CO] timestamps (diagnostic pass)
  int parts;                  // J
  unsigned zero;              // 0, unknown to the compiler (kForce below)
};

// The eval algebra of csrc/bn_finalize.h (eval_channel_norm + write_pooled).
HD float eval_out(double S, float bias, float gamma, float beta, float rm, float rv) {
  const double shift = double(rm) - SCALE * double(bias);
  const double inv_std = 1.0 / sqrt(double(rv) + EPS);
  const double z_mean = SCALE * S / SPATIAL;
  return float((z_mean - shift) * inv_std * double(gamma) + double(beta));
}

// V5: eval_out folded, before the x sums exist, into out = S * alpha + delta (same
// algebra; the products are regrouped, which changes only double rounding).
struct Affine {
  double alpha, delta;
};
HD Affine eval_affine(float bias, float gamma, float beta, float rm, float rv) {
  const double shift = double(rm) - SCALE * double(bias);
  const double g = double(gamma) / sqrt(double(rv) + EPS);
  return {SCALE / SPATIAL * g, double(beta) - shift * g};
}

// V5's finalize map for FT threads: L = FT / B lanes per sample (a power of two, so a
// sample's lanes are an aligned group of a warp); thread t takes sample t / L and the
// NQ = CI / L input channels ci = k * L + t % L, k < NQ (adjacent lanes read adjacent ci:
// each load instruction of a group covers L * J contiguous doubles), all J parts of each.
template <int FT>
struct V5Map {
  static constexpr int L = FT / B, NQ = CI / L;
  static_assert(FT % B == 0 && L >= 1 && L <= 32 && (L & (L - 1)) == 0 && CI % L == 0,
                "V5 needs FT / B lanes per sample, a power of two <= 32 dividing CI");
  HD static int sample(int t) { return t / L; }
  HD static int ci(int t, int k) { return k * L + t % L; }
};

// Terms first, first + step, ... of the contraction for one (b, co) over the CI * J
// partial sums of sample b (xr) and a weight column (wcol[ci * wstride]); the J parts of
// one ci share its weight sum. Same order as csrc SampleSums::conv_sum_part.
HD double contract_part(const double* xr, const double* wcol, int64_t wstride, int J, int first,
                        int step) {
  double s = 0;
  for (int k = first; k < CI * J; k += step) s += xr[k] * wcol[(k / J) * wstride];
  return s;
}

// V4: finalizer f of kfin owns channels [f * NC, (f + 1) * NC); thread t handles channel
// f * NC + t % NC and samples b0 .. b0 + NB - 1.
template <int KFIN>
struct FinMap {
  static constexpr int NC = CO / KFIN, G = T / NC, NB = B / G;
  static_assert(CO % KFIN == 0 && T % NC == 0 && G <= B && B % G == 0, "bad KFIN");
  HD static int channel(int f, int t) { return f * NC + t % NC; }
  HD static int first_sample(int t) { return (t / NC) * NB; }
};

// ---------------------------------------------------------------------------------------
// Device helpers
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {  // butterfly: every lane gets the sum
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double sum4(const float4& v) {
  return (double(v.x) + double(v.y)) + (double(v.z) + double(v.w));
}

using BlockReduceD = cub::BlockReduce<double, T>;

// This thread's share of n4 float4s at p: U loads issued back to back, as spatial_sum.cu.
// ptxas is free to start converting the first vectors before issuing the last loads (it
// does so to stay at 32 registers: the SASS of the u4 kernel has ~3 loads in flight, the
// u8 one ~4, loading the last vector first when told that the others depend on it);
// kForce makes every vector's x, y, z depend on all U vectors (XOR with the AND of their w
// components and a runtime zero), so all U loads are in flight before any is used.
// kGuard false: n4 is a multiple of T * U (every load in range), no bounds checks (fewer
// registers: the extension's x pass, csrc/cuda/spatial_sum_x.cu, checks only a remainder).
template <int U, bool kForce = false, bool kGuard = true>
__device__ __forceinline__ double thread_partial(const float4* __restrict__ p, int64_t n4,
                                                 unsigned zero = 0) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n4; i += int64_t(T) * U) {
    float4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = i + int64_t(u) * T;
      v[u] = !kGuard || k < n4 ? __ldg(p + k) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (kForce) {
      unsigned dep = zero;
#pragma unroll
      for (int u = 0; u < U; ++u) dep &= __float_as_uint(v[u].w);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        v[u].x = __uint_as_float(__float_as_uint(v[u].x) ^ dep);
        v[u].y = __uint_as_float(__float_as_uint(v[u].y) ^ dep);
        v[u].z = __uint_as_float(__float_as_uint(v[u].z) ^ dep);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc += sum4(v[u]);
  }
  return acc;
}

// Weight rows [begin, end) (row = ci * CO + co), one warp per row: weight_sum.cuh.
__device__ __forceinline__ void weight_rows(const float* __restrict__ w, int64_t begin, int64_t end,
                                            double* __restrict__ out) {
  using WarpReduce = cub::WarpReduce<double>;
  __shared__ typename WarpReduce::TempStorage tmp[TW];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t row = begin + warp; row < end; row += TW) {
    double acc = 0;
    for (int64_t k = lane; k < TAPS; k += 32) acc += static_cast<double>(w[row * TAPS + k]);
    const double total = WarpReduce(tmp[warp]).Sum(acc);
    if (lane == 0) out[row] = total;
  }
}

__device__ __forceinline__ void weight_rows_of_block(const Params& a) {
  const int64_t per = (WROWS + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(WROWS, int64_t(blockIdx.x) * per);
  weight_rows(a.w, begin, min(WROWS, begin + per), a.ws);
}

__device__ __forceinline__ void trace_x(const Params& a, int slot) {
  if (a.trace && threadIdx.x == 0 && blockIdx.x < MAX_BLOCKS_TRACE)
    a.trace[slot * MAX_BLOCKS_TRACE + blockIdx.x] = gtime();
}
__device__ __forceinline__ void trace_f(const Params& a, int slot) {
  if (a.trace && threadIdx.x == 0) {
    a.trace[2 * MAX_BLOCKS_TRACE + blockIdx.x * TRACE_F + slot] = gtime();
    if (slot == 0) a.trace[2 * MAX_BLOCKS_TRACE + blockIdx.x * TRACE_F + 3] = smid();
  }
}
// Slot 4 once every thread of the finalize block has stored (a.trace is uniform).
__device__ __forceinline__ void trace_f_end(const Params& a) {
  if (a.trace) {
    __syncthreads();
    trace_f(a, 4);
  }
}

// Round-robin items of the x pass: item it = part (it % J) of row (it / J), n4 float4s.
template <int U, bool kGuard = true>
__device__ __forceinline__ void x_items_loop(const Params& a, BlockReduceD::TempStorage& tmp) {
  const int64_t n4 = LEN / 4 / a.parts, items = ROWS * a.parts;
  const float4* x4 = reinterpret_cast<const float4*>(a.x);
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const double t = BlockReduceD(tmp).Sum(thread_partial<U, true, kGuard>(x4 + it * n4, n4, a.zero));
    if (threadIdx.x == 0) a.xs[it] = t;
    __syncthreads();  // tmp is reused
  }
}

// ---------------------------------------------------------------------------------------
// V0 / V1 / read references: block i sums item i (part i % J of row i / J), then (kWeight)
// a few weight rows; kTrigger: PDL trigger first thing (the finalize may launch).
template <int U, bool kWeight, bool kTrigger, bool kForce = false>
__global__ void __launch_bounds__(T) xw_rows_kernel(const Params a) {
  if (kTrigger) pdl_launch_dependents();
  trace_x(a, 0);
  const int64_t blk = blockIdx.x, n4 = LEN / 4 / a.parts;
  const double acc =
      thread_partial<U, kForce>(reinterpret_cast<const float4*>(a.x) + blk * n4, n4, a.zero);
  __shared__ BlockReduceD::TempStorage tmp;
  const double total = BlockReduceD(tmp).Sum(acc);
  if (threadIdx.x == 0) a.xs[blk] = total;
  if (kWeight) weight_rows_of_block(a);
  if (a.trace) {
    __syncthreads();
    trace_x(a, 1);
  }
}

// Replica of csrc bn_finalize_kernel in eval mode: one block per channel, PDL wait
// first, one warp per sample (cub WarpReduce), the sums through global scratch.
template <bool kPdl>
__global__ void __launch_bounds__(T) finalize_kernel(const Params a) {
  const int c = blockIdx.x;
  trace_f(a, 0);
  if (kPdl) pdl_wait();
  trace_f(a, 2);
  double* sums = a.ssum + int64_t(c) * B;
  using WarpReduce = cub::WarpReduce<double>;
  __shared__ typename WarpReduce::TempStorage warp_tmp[TW];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int b = warp; b < B; b += TW) {
    const double s = WarpReduce(warp_tmp[warp])
                         .Sum(contract_part(a.xs + int64_t(b) * CI * a.parts, a.ws + c, CO,
                                            a.parts, lane, 32));
    if (lane == 0) sums[b] = s;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < B; b += T)
    a.out[int64_t(b) * CO + c] =
        eval_out(sums[b], a.bias[c], a.gamma[c], a.beta[c], a.rmean[c], a.rvar[c]);
  trace_f_end(a);
}

// ---------------------------------------------------------------------------------------
// V2: x pass over round-robin items with a grid that leaves room on every SM for one
// finalize block; PDL trigger first thing. MAXREG caps the registers (at most T threads
// per block) so that the host can size the grid to leave that room.
template <int U, int MAXREG, bool kGuard = true>
__global__ void __maxnreg__(MAXREG) x_items_kernel(const Params a) {
  pdl_launch_dependents();
  trace_x(a, 0);
  __shared__ BlockReduceD::TempStorage tmp;
  x_items_loop<U, kGuard>(a, tmp);
  if (a.trace) trace_x(a, 1);  // x_items_loop ends with __syncthreads
}

// Channel c's outputs from the x partial sums and the channel's weight column in shared
// memory: one warp per sample.
template <int NW>
__device__ __forceinline__ void finalize_channel(const Params& a, int c, const double* wcol) {
  __shared__ double ssum[B];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, J = a.parts;
  for (int b = warp; b < B; b += NW) {
    const double* xr = a.xs + int64_t(b) * CI * J;
    double s = 0;
    for (int k = lane; k < CI * J; k += 32) s += __ldcg(xr + k) * wcol[k / J];
    s = warp_sum(s);
    if (lane == 0) ssum[b] = s;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < B; b += NW * 32)
    a.out[int64_t(b) * CO + c] =
        eval_out(ssum[b], a.bias[c], a.gamma[c], a.beta[c], a.rmean[c], a.rvar[c]);
}

// V2 finalize: sums its weight column (the weight is not written by the x kernel) BEFORE
// griddepcontrol.wait, so that read overlaps the x pass; only the contraction after.
template <int FT, int MINB>
__global__ void __launch_bounds__(FT, MINB) finalize_pre_kernel(const Params a) {
  constexpr int NW = FT / 32;
  const int c = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ double wcol[CI];
  trace_f(a, 0);
  for (int ci = warp; ci < CI; ci += NW) {
    const float* wr = a.w + (int64_t(ci) * CO + c) * TAPS;
    double acc = 0;  // the same terms in the same order as weight_rows
#pragma unroll
    for (int q = 0; q < int((TAPS + 31) / 32); ++q)
      if (lane + 32 * q < TAPS) acc += double(__ldg(wr + lane + 32 * q));
    acc = warp_sum(acc);
    if (lane == 0) wcol[ci] = acc;
  }
  trace_f(a, 1);
  pdl_wait();
  trace_f(a, 2);
  __syncthreads();
  finalize_channel<NW>(a, c, wcol);
  trace_f_end(a);
}

// ---------------------------------------------------------------------------------------
// V5: V2 with the shortest tail after griddepcontrol.wait. Everything the x kernel does not
// write is read and combined before the wait, into shared memory: the weight columns of
// the block's NCH channels (as V2) and each channel's BN map folded into
// out = S * alpha + delta (eval_affine). After the wait: one round of independent loads of
// the x sums (V5Map), the products with the weight sums (shared-memory loads, issued after
// the global ones and hidden under their latency; in registers they made the 32-register
// build spill), a butterfly over the sample's L lanes, one store per (b, c) (lane ch of
// the group stores channel ch).
template <int J>
__device__ __forceinline__ void load_parts(const double* p, double (&v)[J]) {
  if constexpr (J % 2 == 0) {  // 16-byte loads: p is at an even index of the cudaMalloc'd sums
#pragma unroll
    for (int j = 0; j < J; j += 2) {
      const double2 d = __ldcg(reinterpret_cast<const double2*>(p + j));
      v[j] = d.x;
      v[j + 1] = d.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < J; ++j) v[j] = __ldcg(p + j);
  }
}

template <int FT, int NCH, int J, int MINB>
__global__ void __launch_bounds__(FT, MINB) finalize_v5_kernel(const Params a) {
  using M = V5Map<FT>;
  constexpr int NW = FT / 32;
  static_assert(CO % NCH == 0 && NCH <= M::L, "NCH must divide CO, at most L");
  __shared__ double wcol[NCH * CI];  // [channel][ci]
  __shared__ Affine aff[NCH];
  const int c0 = blockIdx.x * NCH, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  trace_f(a, 0);
  for (int r = warp; r < NCH * CI; r += NW) {
    const float* wr = a.w + (int64_t(r % CI) * CO + c0 + r / CI) * TAPS;
    double acc = 0;  // the same terms in the same order as weight_rows
#pragma unroll
    for (int q = 0; q < int((TAPS + 31) / 32); ++q)
      if (lane + 32 * q < TAPS) acc += double(__ldg(wr + lane + 32 * q));
    acc = warp_sum(acc);
    if (lane == 0) wcol[r] = acc;
  }
  const int t = threadIdx.x, b = M::sample(t), g = t % M::L;
  if (t < NCH) {
    const int c = c0 + t;
    aff[t] = eval_affine(a.bias[c], a.gamma[c], a.beta[c], a.rmean[c], a.rvar[c]);
  }
  __syncthreads();
  trace_f(a, 1);
  pdl_wait();
  trace_f(a, 2);
  const double* xr = a.xs + int64_t(b) * CI * J;
  double xv[M::NQ][J];
#pragma unroll
  for (int k = 0; k < M::NQ; ++k) load_parts<J>(xr + M::ci(t, k) * J, xv[k]);
  double xk[M::NQ];
#pragma unroll
  for (int k = 0; k < M::NQ; ++k) {
    xk[k] = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) xk[k] += xv[k][j];
  }
#pragma unroll
  for (int ch = 0; ch < NCH; ++ch) {
    double s = 0;
#pragma unroll
    for (int k = 0; k < M::NQ; ++k) s += xk[k] * wcol[ch * CI + M::ci(t, k)];
#pragma unroll
    for (int o = M::L / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (g == ch) a.out[int64_t(b) * CO + c0 + ch] = float(s * aff[ch].alpha + aff[ch].delta);
  }
  trace_f_end(a);
}

// ---------------------------------------------------------------------------------------
// V3: one cooperative launch, grid = resident blocks: x items round-robin, then weight
// rows spread over the blocks, grid.sync(), then blocks 0..CO-1 finalize one channel each.
template <int U>
__global__ void __launch_bounds__(T) coop_kernel(const Params a) {
  __shared__ BlockReduceD::TempStorage tmp;
  __shared__ double wcol[CI];
  x_items_loop<U>(a, tmp);
  weight_rows_of_block(a);
  cg::this_grid().sync();
  if (blockIdx.x >= CO) return;
  const int c = blockIdx.x;
  for (int ci = threadIdx.x; ci < CI; ci += T) wcol[ci] = __ldcg(a.ws + int64_t(ci) * CO + c);
  __syncthreads();
  finalize_channel<TW>(a, c, wcol);
}

// ---------------------------------------------------------------------------------------
// V4: one launch, last blocks done. Each block: its x item + weight rows (as V0/V1),
// fence, ticket. The KFIN blocks with the last tickets finalize CO / KFIN channels each
// (KFIN > 1: they first wait for the count to reach the grid; the blocks still running
// are resident or can be, since only KFIN blocks spin). The counter is reset by the last
// finalizer, so every call (and a CUDA graph replay) starts from zero.
template <int KFIN>
__device__ __forceinline__ void finalize_split(const Params& a, int f) {
  using M = FinMap<KFIN>;
  __shared__ double xsum[B * CI];  // 8 KiB
  const int J = a.parts;
  for (int i = threadIdx.x; i < B * CI; i += T) {
    double s = 0;
    for (int j = 0; j < J; ++j) s += __ldcg(a.xs + int64_t(i) * J + j);
    xsum[i] = s;
  }
  __syncthreads();
  const int c = M::channel(f, threadIdx.x), b0 = M::first_sample(threadIdx.x);
  double acc[M::NB];
#pragma unroll
  for (int j = 0; j < M::NB; ++j) acc[j] = 0;
#pragma unroll 4
  for (int ci = 0; ci < CI; ++ci) {
    const double w = __ldcg(a.ws + int64_t(ci) * CO + c);
#pragma unroll
    for (int j = 0; j < M::NB; ++j) acc[j] += xsum[(b0 + j) * CI + ci] * w;
  }
#pragma unroll
  for (int j = 0; j < M::NB; ++j)
    a.out[int64_t(b0 + j) * CO + c] =
        eval_out(acc[j], a.bias[c], a.gamma[c], a.beta[c], a.rmean[c], a.rvar[c]);
}

template <int U, int KFIN, int MINB>
__global__ void __launch_bounds__(T, MINB) lastblock_kernel(const Params a) {
  const int64_t blk = blockIdx.x, n4 = LEN / 4 / a.parts;
  const double acc =
      thread_partial<U, true>(reinterpret_cast<const float4*>(a.x) + blk * n4, n4, a.zero);
  __shared__ BlockReduceD::TempStorage tmp;
  const double total = BlockReduceD(tmp).Sum(acc);
  if (threadIdx.x == 0) a.xs[blk] = total;
  weight_rows_of_block(a);
  __threadfence();  // every writer fences its own stores before the block's ticket
  __syncthreads();
  __shared__ unsigned ticket;
  if (threadIdx.x == 0) ticket = atomicAdd(a.counter, 1u);
  __syncthreads();
  const unsigned n = gridDim.x;
  if (ticket < n - KFIN) return;
  const int f = int(ticket - (n - KFIN));
  if (KFIN > 1) {
    if (threadIdx.x == 0)
      while (ld_acquire(a.counter) < n) __nanosleep(64);
    __syncthreads();
  }
  __threadfence();
  finalize_split<KFIN>(a, f);
  if (KFIN == 1) {
    if (threadIdx.x == 0) atomicExch(a.counter, 0u);  // every block has taken its ticket
  } else {
    __syncthreads();
    // All KFIN finalizers have passed their wait once the second count reaches KFIN.
    if (threadIdx.x == 0 && atomicAdd(a.counter + 1, 1u) == unsigned(KFIN - 1)) {
      atomicExch(a.counter, 0u);
      atomicExch(a.counter + 1, 0u);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Timing helpers
__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// ---------------------------------------------------------------------------------------
// Host: data, reference
static inline uint64_t splitmix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static inline float unif(uint64_t seed, uint64_t i) {  // [-1, 1)
  return float(double(splitmix(seed * 0x100000001b3ull + i) >> 40) * 0x1p-23 - 1.0);
}

struct HostParams {
  std::vector<float> bias, gamma, beta, rmean, rvar;
  HostParams() : bias(CO), gamma(CO), beta(CO), rmean(CO), rvar(CO) {
    for (int c = 0; c < CO; ++c) {
      bias[c] = 0.05f * unif(101, c);
      gamma[c] = 1.0f + 0.2f * unif(102, c);
      beta[c] = 0.1f * unif(103, c);
      rmean[c] = 0.2f * unif(104, c);
      rvar[c] = 1.0f + 0.5f * unif(105, c);
    }
  }
};

static void fill_x(int k, std::vector<float>& x) {
  x.resize(XN);
  for (int64_t r = 0; r < ROWS; ++r) {
    const float off = 0.5f * unif(1000 + k, uint64_t(r));  // rows with different means
    for (int64_t i = 0; i < LEN; ++i) x[r * LEN + i] = unif(2000 + k, uint64_t(r * LEN + i)) + off;
  }
}
static void fill_w(int k, std::vector<float>& w) {
  w.resize(WN);
  for (int64_t i = 0; i < WN; ++i) w[i] = 0.03f * unif(3000 + k, uint64_t(i));
}
// Double-precision reference of the eval output (not rounded to float).
static void reference(const std::vector<float>& x, const std::vector<float>& w, const HostParams& p,
                      std::vector<double>& out) {
  std::vector<double> X(ROWS), Wt(WROWS);
  for (int64_t r = 0; r < ROWS; ++r) {
    double s = 0;
    for (int64_t i = 0; i < LEN; ++i) s += x[r * LEN + i];
    X[r] = s;
  }
  for (int64_t r = 0; r < WROWS; ++r) {
    double s = 0;
    for (int64_t i = 0; i < TAPS; ++i) s += w[r * TAPS + i];
    Wt[r] = s;
  }
  out.assign(int64_t(B) * CO, 0);
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < CO; ++c) {
      double S = 0;
      for (int ci = 0; ci < CI; ++ci) S += X[b * CI + ci] * Wt[ci * CO + c];
      // The module's own order: mean of the conv output (bias included), scaled, BN.
      const double z = SCALE * (S / SPATIAL + p.bias[c]);
      out[b * CO + c] = (z - p.rmean[c]) / std::sqrt(double(p.rvar[c]) + EPS) * p.gamma[c] + p.beta[c];
    }
}

struct Err {
  double abs = 0, rel = 0;
  bool nan = false;
};
// rel: |out - ref| / max(|ref|, 1e-3 max|ref|) (the floor keeps a near-zero output from
// dominating; float32 rounding alone gives ~6e-8).
static Err compare(const std::vector<float>& out, const std::vector<double>& ref) {
  double m = 0;
  for (double v : ref) m = std::max(m, std::fabs(v));
  Err e;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) e.nan = true;
    const double d = std::fabs(double(out[i]) - ref[i]);
    e.abs = std::max(e.abs, d);
    e.rel = std::max(e.rel, d / std::max(std::fabs(ref[i]), 1e-3 * m));
  }
  return e;
}

// ---------------------------------------------------------------------------------------
// CPU self-check (no GPU): index maps, algebra, finalize arithmetic per layout.
static int selftest() {
  int fails = 0;
  auto expect = [&](bool ok, const char* what) {
    printf("  %-72s %s\n", what, ok ? "ok" : "FAIL");
    fails += !ok;
  };
  printf("selftest (CPU only)\n");
  // 1. Sum of a brute-force ConvTranspose3d output (stride 1, padding 0) = N bias + X W.
  {
    const int b_ = 2, ci_ = 3, co_ = 2, d_ = 3, h_ = 4, w_ = 2, k_ = 5;
    const int od = d_ + k_ - 1, oh = h_ + k_ - 1, ow = w_ + k_ - 1;
    std::vector<double> x(b_ * ci_ * d_ * h_ * w_), wt(ci_ * co_ * k_ * k_ * k_), bias(co_);
    for (size_t i = 0; i < x.size(); ++i) x[i] = unif(7, i);
    for (size_t i = 0; i < wt.size(); ++i) wt[i] = unif(8, i);
    for (int c = 0; c < co_; ++c) bias[c] = unif(9, c);
    double worst = 0;
    for (int b = 0; b < b_; ++b)
      for (int c = 0; c < co_; ++c) {
        std::vector<double> y(od * oh * ow, bias[c]);
        for (int i = 0; i < ci_; ++i)
          for (int z = 0; z < d_; ++z)
            for (int yy = 0; yy < h_; ++yy)
              for (int xx = 0; xx < w_; ++xx)
                for (int kd = 0; kd < k_; ++kd)
                  for (int kh = 0; kh < k_; ++kh)
                    for (int kw = 0; kw < k_; ++kw)
                      y[((z + kd) * oh + yy + kh) * ow + xx + kw] +=
                          x[(((b * ci_ + i) * d_ + z) * h_ + yy) * w_ + xx] *
                          wt[(((i * co_ + c) * k_ + kd) * k_ + kh) * k_ + kw];
        double mean = 0;
        for (double v : y) mean += v;
        mean /= double(y.size());
        double S = 0;
        for (int i = 0; i < ci_; ++i) {
          double X = 0, Wt = 0;
          for (int j = 0; j < d_ * h_ * w_; ++j) X += x[(b * ci_ + i) * d_ * h_ * w_ + j];
          for (int j = 0; j < k_ * k_ * k_; ++j) Wt += wt[(i * co_ + c) * k_ * k_ * k_ + j];
          S += X * Wt;
        }
        worst = std::max(worst, std::fabs(mean - (S / (od * oh * ow) + bias[c])));
      }
    expect(worst < 1e-12, "conv-transpose output mean = X.W / N + bias (brute force)");
    expect(SPATIAL == 25920.0, "N = 20 * 36 * 36");
  }
  // 2. The shift form of the eval map (eval_out) against the module's order.
  {
    const HostParams p;
    double worst = 0;
    for (int c = 0; c < CO; ++c)
      for (double S : {-5000.0, -3.0, 0.0, 17.0, 9000.0}) {
        const double z = SCALE * (S / SPATIAL + p.bias[c]);
        const double r = (z - p.rmean[c]) / std::sqrt(double(p.rvar[c]) + EPS) * p.gamma[c] + p.beta[c];
        const double o = eval_out(S, p.bias[c], p.gamma[c], p.beta[c], p.rmean[c], p.rvar[c]);
        worst = std::max(worst, std::fabs(o - r) / std::max(1e-3, std::fabs(r)));
      }
    expect(worst < 2e-7, "eval_out (shift form, float) = module order (double)");
  }
  // 3. Index maps: thread loops cover every float4 of an item once; round-robin items
  //    cover every item once; weight rows once; V4 finalizer maps cover (b, co) once.
  {
    bool ok = true;
    for (int parts : {1, 2, 4})
      for (int U : {4, 8}) {
        const int64_t n4 = LEN / 4 / parts;
        std::vector<int> seen(n4, 0);
        for (int t = 0; t < T; ++t)
          for (int64_t i = t; i < n4; i += int64_t(T) * U)
            for (int u = 0; u < U; ++u)
              if (i + int64_t(u) * T < n4) ++seen[i + int64_t(u) * T];
        for (int v : seen) ok &= v == 1;
      }
    expect(ok, "thread_partial covers each float4 of an item once (J = 1, 2, 4; U = 4, 8)");
    ok = true;
    for (int grid : {528, 660, 792, 924, 1056, 1024, 2048, 4096}) {
      std::vector<int> items(ROWS * 4, 0), wrows(WROWS, 0);
      for (int blk = 0; blk < grid; ++blk) {
        for (int64_t it = blk; it < ROWS * 4; it += grid) ++items[it];
        const int64_t per = (WROWS + grid - 1) / grid;
        const int64_t begin = std::min<int64_t>(WROWS, int64_t(blk) * per);
        for (int64_t r = begin; r < std::min<int64_t>(WROWS, begin + per); ++r) ++wrows[r];
      }
      for (int v : items) ok &= v == 1;
      for (int v : wrows) ok &= v == 1;
    }
    expect(ok, "round-robin items and weight rows per block cover each once");
    auto fin_ok = [](auto m) {
      using M = decltype(m);
      std::vector<int> seen(B * CO, 0);
      for (int f = 0; f < CO / M::NC; ++f)
        for (int t = 0; t < T; ++t)
          for (int j = 0; j < M::NB; ++j) ++seen[(M::first_sample(t) + j) * CO + M::channel(f, t)];
      bool ok = true;
      for (int v : seen) ok &= v == 1;
      return ok;
    };
    expect(fin_ok(FinMap<1>{}) && fin_ok(FinMap<2>{}) && fin_ok(FinMap<4>{}) && fin_ok(FinMap<8>{}),
           "V4 finalizer maps cover each (b, co) once (KFIN = 1, 2, 4, 8)");
  }
  // 4. Finalize arithmetic on partial sums in each layout (J = 1, 2, 4) vs the reference,
  //    on a reduced x (first 1024 elements of each row stand for the row).
  {
    const HostParams p;
    const int64_t len = 1024;
    std::vector<double> X(ROWS), Wt(WROWS), xs4(ROWS * 4);
    for (int64_t r = 0; r < ROWS; ++r) {
      double s = 0, part[4] = {0, 0, 0, 0};
      for (int64_t i = 0; i < len; ++i) {
        const double v = unif(11, r * len + i) + 0.5 * unif(12, r);
        s += v;
        part[i / (len / 4)] += v;
      }
      X[r] = s;
      for (int j = 0; j < 4; ++j) xs4[r * 4 + j] = part[j];
    }
    std::vector<double> ws(WROWS);
    for (int64_t r = 0; r < WROWS; ++r) ws[r] = 0.03 * 11.2 * unif(13, r);
    double worst = 0;
    for (int J : {1, 2, 4}) {
      std::vector<double> xs(ROWS * J);
      for (int64_t r = 0; r < ROWS; ++r)
        for (int j = 0; j < J; ++j) {
          double s = 0;
          for (int q = j * (4 / J); q < (j + 1) * (4 / J); ++q) s += xs4[r * 4 + q];
          xs[r * J + j] = s;
        }
      for (int b = 0; b < B; ++b)
        for (int c = 0; c < CO; ++c) {
          double S = 0;  // the warp split: 32 lanes, then their sum
          for (int lane = 0; lane < 32; ++lane)
            S += contract_part(xs.data() + int64_t(b) * CI * J, ws.data() + c, CO, J, lane, 32);
          double Sref = 0;
          for (int ci = 0; ci < CI; ++ci) Sref += X[b * CI + ci] * ws[ci * CO + c];
          const double z = SCALE * (Sref / SPATIAL + p.bias[c]);
          const double r = (z - p.rmean[c]) / std::sqrt(double(p.rvar[c]) + EPS) * p.gamma[c] + p.beta[c];
          const double o = eval_out(S, p.bias[c], p.gamma[c], p.beta[c], p.rmean[c], p.rvar[c]);
          worst = std::max(worst, std::fabs(o - r) / std::max(1e-3, std::fabs(r)));
        }
    }
    char what[100];
    snprintf(what, sizeof what, "finalize contraction + eval map, J = 1, 2, 4 (max rel err %.1e)", worst);
    expect(worst < 1e-6, what);
  }
  // 5. V5: the lane map covers each (b, ci) once with a sample's lanes an aligned group
  //    of one warp; the folded affine map equals eval_out; the one-round tail (per lane,
  //    parts summed, products, butterfly) equals the reference contraction.
  {
    auto map_ok = [](auto m) {
      using M = decltype(m);
      constexpr int FT = M::L * B;
      std::vector<int> seen(B * CI, 0);
      bool ok = true;
      for (int t = 0; t < FT; ++t) {
        const int first = M::sample(t) * M::L;  // the sample's lanes: one warp, t among them
        ok &= first / 32 == (first + M::L - 1) / 32 && t >= first && t < first + M::L;
        for (int k = 0; k < M::NQ; ++k) ++seen[M::sample(t) * CI + M::ci(t, k)];
      }
      for (int v : seen) ok &= v == 1;
      return ok;
    };
    expect(map_ok(V5Map<128>{}) && map_ok(V5Map<256>{}) && map_ok(V5Map<512>{}),
           "V5 lane map covers each (b, ci) once, groups aligned in a warp (FT 128/256/512)");
    const HostParams p;
    double worst = 0;
    for (int c = 0; c < CO; ++c)
      for (double S : {-5000.0, -3.0, 0.0, 17.0, 9000.0}) {
        const Affine f = eval_affine(p.bias[c], p.gamma[c], p.beta[c], p.rmean[c], p.rvar[c]);
        const double o = eval_out(S, p.bias[c], p.gamma[c], p.beta[c], p.rmean[c], p.rvar[c]);
        worst = std::max(worst, std::fabs(double(float(S * f.alpha + f.delta)) - o) / std::max(1e-3, std::fabs(o)));
      }
    expect(worst < 2e-7, "V5 folded affine map (S * alpha + delta) = eval_out");
    // Tail arithmetic for FT 256, J 2 on random sums against the plain contraction.
    using M = V5Map<256>;
    const int J = 2;
    std::vector<double> xs(ROWS * J), ws(WROWS);
    for (size_t i = 0; i < xs.size(); ++i) xs[i] = 1000.0 * unif(21, i);
    for (size_t i = 0; i < ws.size(); ++i) ws[i] = unif(22, i);
    double werr = 0;
    for (int c = 0; c < CO; c += 7)
      for (int b = 0; b < B; ++b) {
        double lanes[M::L];
        for (int g = 0; g < M::L; ++g) {
          const int t = b * M::L + g;
          double s = 0;
          for (int k = 0; k < M::NQ; ++k) {
            const int ci = M::ci(t, k);
            s += (xs[(b * CI + ci) * J] + xs[(b * CI + ci) * J + 1]) * ws[ci * CO + c];
          }
          lanes[g] = s;
        }
        for (int o = M::L / 2; o > 0; o /= 2) {  // the butterfly, all lanes
          double nx[M::L];
          for (int g = 0; g < M::L; ++g) nx[g] = lanes[g] + lanes[g ^ o];
          std::copy(nx, nx + M::L, lanes);
        }
        double ref_s = 0;
        for (int ci = 0; ci < CI; ++ci)
          ref_s += (xs[(b * CI + ci) * J] + xs[(b * CI + ci) * J + 1]) * ws[ci * CO + c];
        for (int g = 0; g < M::L; ++g)
          werr = std::max(werr, std::fabs(lanes[g] - ref_s) / std::max(1.0, std::fabs(ref_s)));
      }
    char what[100];
    snprintf(what, sizeof what, "V5 tail contraction (lanes + butterfly) = plain sum (rel %.1e)", werr);
    expect(werr < 1e-12, what);
  }
  printf("selftest %s\n", fails ? "FAILED" : "passed");
  return fails ? 1 : 0;
}

// ---------------------------------------------------------------------------------------
// Host: device setup, variants, timing
struct Variant {
  std::string name, note;
  double bytes;  // bytes per call counted for GB/s
  bool checked;  // computes the eval output (compared against the reference)
  std::function<void(int)> call;  // call(i): one call on buffer i % bufs
  std::function<void(unsigned long long*)> traced;  // optional diagnostic run (buffer 0)
  int x_blocks = 0;                                  // for the trace summary
  int f_blocks = CO;                                 // finalize blocks (trace summary)
};

template <typename Kernel, typename... Args>
static void launch_pdl(Kernel kernel, dim3 grid, dim3 block, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct KernelInfo {
  int regs = 0, smem = 0, occ = 0;
};
template <typename Kernel>
static KernelInfo info(Kernel k, int threads) {
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, k));
  KernelInfo r;
  r.regs = fa.numRegs;
  r.smem = int(fa.sharedSizeBytes);
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r.occ, k, threads, 0));
  return r;
}

// Whether kx blocks of kernel X and one block of kernel F fit on one SM together
// (sm_90: 2048 threads, 32 blocks, 64K registers allocated per warp in units of 256,
// shared memory with 1 KiB reserved per block; the same carveout is asked of both kernels).
static bool co_resident(const cudaDeviceProp& p, int kx, int tx, KernelInfo x, int tf, KernelInfo f) {
  auto regs = [](int threads, int r) { return ((threads + 31) / 32) * ((r * 32 + 255) / 256 * 256); };
  auto smem = [](int s) { return (s + 127) / 128 * 128 + 1024; };
  return kx * tx + tf <= p.maxThreadsPerMultiProcessor && kx + 1 <= 32 &&
         int64_t(kx) * regs(tx, x.regs) + regs(tf, f.regs) <= p.regsPerMultiprocessor &&
         int64_t(kx) * smem(x.smem) + smem(f.smem) <= int64_t(p.sharedMemPerMultiprocessor);
}

int main(int argc, char** argv) {
  int iters = 300, warmup = 30, bufs = 8;
  bool check_only = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--selftest") return selftest();
    if (a == "--check") check_only = true;
    else if (a == "--iters" && i + 1 < argc) iters = atoi(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc) warmup = atoi(argv[++i]);
    else if (a == "--bufs" && i + 1 < argc) bufs = atoi(argv[++i]);
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--iters N] [--warmup N] [--bufs N] [--check] [--selftest] [--only SUBSTR]\n", argv[0]);
      return 2;
    }
  }
  if (iters < 1 || warmup < 0 || bufs < 1) {
    fprintf(stderr, "bad --iters/--warmup/--bufs\n");
    return 2;
  }
  if (selftest() != 0) return 1;

  int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  const int sms = prop.multiProcessorCount;
  printf("\ndevice %s, %d SMs, L2 %.0f MB, cc %d.%d; %d x buffers of %.0f MiB, %d weight copies\n",
         prop.name, sms, prop.l2CacheSize / 1e6, prop.major, prop.minor, bufs, XN * 4 / 1048576.0, bufs);
  if (prop.major < 9) {
    fprintf(stderr, "needs sm_90 (PDL, griddepcontrol)\n");
    return 2;
  }
  if (bufs < 6) printf("warning: fewer than 6 x buffers, x may be partly L2 resident\n");
  int coop_ok = 0;
  CK(cudaDeviceGetAttribute(&coop_ok, cudaDevAttrCooperativeLaunch, dev));

  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

  // Data: bufs different x buffers and weight copies, each with its own reference.
  const HostParams hp;
  std::vector<float*> dx(bufs), dw(bufs);
  std::vector<std::vector<double>> ref(bufs);
  {
    std::vector<float> hx, hw;
    for (int k = 0; k < bufs; ++k) {
      fill_x(k, hx);
      fill_w(k, hw);
      reference(hx, hw, hp, ref[k]);
      CK(cudaMalloc(&dx[k], XN * sizeof(float)));
      CK(cudaMalloc(&dw[k], WN * sizeof(float)));
      CK(cudaMemcpy(dx[k], hx.data(), XN * sizeof(float), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dw[k], hw.data(), WN * sizeof(float), cudaMemcpyHostToDevice));
    }
  }
  float* dparams;
  CK(cudaMalloc(&dparams, 5 * CO * sizeof(float)));
  CK(cudaMemcpy(dparams + 0 * CO, hp.bias.data(), CO * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dparams + 1 * CO, hp.gamma.data(), CO * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dparams + 2 * CO, hp.beta.data(), CO * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dparams + 3 * CO, hp.rmean.data(), CO * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dparams + 4 * CO, hp.rvar.data(), CO * 4, cudaMemcpyHostToDevice));
  double *dxs, *dws, *dssum;
  CK(cudaMalloc(&dxs, ROWS * 8 * sizeof(double)));
  CK(cudaMalloc(&dws, WROWS * sizeof(double)));
  CK(cudaMalloc(&dssum, int64_t(CO) * B * sizeof(double)));
  float* dout;
  CK(cudaMalloc(&dout, int64_t(B) * CO * sizeof(float)));
  unsigned* dcounter;
  CK(cudaMalloc(&dcounter, 2 * sizeof(unsigned)));
  CK(cudaMemset(dcounter, 0, 2 * sizeof(unsigned)));
  const size_t trace_n = 2 * MAX_BLOCKS_TRACE + TRACE_F * CO;
  unsigned long long* dtrace;
  CK(cudaMalloc(&dtrace, trace_n * sizeof(unsigned long long)));
  float* dcopy[2];
  for (auto& p : dcopy) CK(cudaMalloc(&p, XN * sizeof(float)));
  float* dred;
  CK(cudaMalloc(&dred, sizeof(float)));
  size_t cub_bytes = 0;
  CK(cub::DeviceReduce::Sum(nullptr, cub_bytes, dx[0], dred, XN, st));
  void* dcub;
  CK(cudaMalloc(&dcub, cub_bytes));

  auto params = [&](int i, int parts) {
    Params a;
    a.x = dx[i % bufs];
    a.w = dw[i % bufs];
    a.xs = dxs;
    a.ws = dws;
    a.ssum = dssum;
    a.bias = dparams;
    a.gamma = dparams + CO;
    a.beta = dparams + 2 * CO;
    a.rmean = dparams + 3 * CO;
    a.rvar = dparams + 4 * CO;
    a.out = dout;
    a.counter = dcounter;
    a.trace = nullptr;
    a.parts = parts;
    a.zero = 0;
    return a;
  };
  const double xbytes = double(XN) * 4, wbytes = double(WN) * 4;

  // V2's two kernels ask for the same carveout: blocks of kernels with different
  // shared-memory configurations cannot share an SM, which would defeat the co-residency.
  // (The other variants keep the driver's default, as the extension does.)
  auto carve = [](auto k) { CK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, 100)); };

  std::vector<Variant> vs;
  // ---- references
  vs.push_back({"copy: cudaMemcpyAsync D2D 64 MiB", "GB/s counts read + write", 2 * xbytes, false,
                [&](int i) {
                  CK(cudaMemcpyAsync(dcopy[i % 2], dx[i % bufs], XN * sizeof(float), cudaMemcpyDeviceToDevice, st));
                }});
  vs.push_back({"read: cub::DeviceReduce::Sum (float)", "x only", xbytes, false, [&](int i) {
                  CK(cub::DeviceReduce::Sum(dcub, cub_bytes, dx[i % bufs], dred, XN, st));
                }});
  auto add_read_rows = [&](auto kernel, const char* name, int parts) {
    vs.push_back({name, "x only, 1 item per block", xbytes, false, [=, &params](int i) {
                    kernel<<<unsigned(ROWS * parts), T, 0, st>>>(params(i, parts));
                    CK_LAUNCH();
                  }});
  };
  add_read_rows(xw_rows_kernel<4, false, false>, "read: row blocks u4", 1);
  add_read_rows(xw_rows_kernel<4, false, false, true>, "read: row blocks u4 forced", 1);
  add_read_rows(xw_rows_kernel<8, false, false, true>, "read: row blocks u8 forced", 1);
  add_read_rows(xw_rows_kernel<8, false, false, true>, "read: half-row blocks u8 forced", 2);
  {  // persistent x-only pass, all resident blocks, round-robin 32 KiB items
    const KernelInfo xi = info(x_items_kernel<8, 64>, T);
    const unsigned grid = unsigned(xi.occ * sms);
    vs.push_back({"read: items u8, " + std::to_string(xi.occ) + "/SM persistent", "x only, 2 items/row",
                  xbytes, false, [=, &params](int i) {
                    x_items_kernel<8, 64><<<grid, T, 0, st>>>(params(i, 2));
                    CK_LAUNCH();
                  }});
  }

  // ---- V0 / V1: rows (or parts) + weight rows, then the replica finalize with PDL
  auto add_v01 = [&](auto kernel, std::string name, int parts, bool pdl) {
    const unsigned grid = unsigned(ROWS * parts);
    Variant v{name, std::to_string(grid) + " x blocks", xbytes + wbytes, true, nullptr};
    v.call = [=, &params](int i) {
      const Params a = params(i, parts);
      kernel<<<grid, T, 0, st>>>(a);
      CK_LAUNCH();
      if (pdl) launch_pdl(finalize_kernel<true>, dim3(CO), dim3(T), st, a);
      else {
        finalize_kernel<false><<<CO, T, 0, st>>>(a);
        CK_LAUNCH();
      }
    };
    v.traced = [=, &params](unsigned long long* tr) {
      Params a = params(0, parts);
      a.trace = tr;
      kernel<<<grid, T, 0, st>>>(a);
      CK_LAUNCH();
      launch_pdl(finalize_kernel<true>, dim3(CO), dim3(T), st, a);
    };
    v.x_blocks = int(grid);
    vs.push_back(v);
  };
  add_v01(xw_rows_kernel<4, true, true>, "V0  current: rows u4 + w, PDL finalize", 1, true);
  add_v01(xw_rows_kernel<4, true, false>, "V0' current without PDL", 1, false);
  add_v01(xw_rows_kernel<4, true, true, true>, "V1  rows u4 forced + w, PDL", 1, true);
  add_v01(xw_rows_kernel<8, true, true>, "V1  rows u8 + w, PDL", 1, true);
  add_v01(xw_rows_kernel<8, true, true, true>, "V1  rows u8 forced + w, PDL", 1, true);
  add_v01(xw_rows_kernel<4, true, true, true>, "V1  2 parts/row u4 forced + w, PDL", 2, true);
  add_v01(xw_rows_kernel<8, true, true, true>, "V1  2 parts/row u8 forced + w, PDL", 2, true);
  add_v01(xw_rows_kernel<4, true, true, true>, "V1  4 parts/row u4 forced + w, PDL", 4, true);
  add_v01(xw_rows_kernel<8, true, true, true>, "V1  4 parts/row u8 forced + w, PDL", 4, true);

  // ---- V2: x-only pass leaving room for one finalize block per SM
  std::vector<std::string> occ_lines;
  // V2's and V5's call: the x launch, then the finalize with PDL; traced (buffer 0) when
  // `tr` is not null.
  auto x_then_finalize = [&](Variant& v, auto xk, auto fk, unsigned grid, unsigned fgrid, int ft,
                             int parts) {
    auto run = [=, &params](int i, unsigned long long* tr) {
      Params a = params(i, parts);
      a.trace = tr;
      xk<<<grid, T, 0, st>>>(a);
      CK_LAUNCH();
      launch_pdl(fk, dim3(fgrid), dim3(ft), st, a);
    };
    v.call = [run](int i) { run(i, nullptr); };
    v.traced = [run](unsigned long long* tr) { run(0, tr); };
    v.x_blocks = int(grid);
    v.f_blocks = int(fgrid);
  };
  auto add_v2 = [&](auto xk, auto fk, int ft, int u, const char* tag, bool room) {
    carve(xk);
    carve(fk);
    const KernelInfo xi = info(xk, T), fi = info(fk, ft);
    const int parts = int(LEN / 4 / (int64_t(T) * u));  // one item = T * u float4s
    int kx = xi.occ;
    if (room)
      while (kx > 1 && !co_resident(prop, kx, T, xi, ft, fi)) --kx;
    const bool fits = co_resident(prop, kx, T, xi, ft, fi);
    char line[300];
    snprintf(line, sizeof line,
             "%-6s x kernel: %d regs, %d B smem, occupancy %d blocks/SM -> grid %d x %d = %d; "
             "finalize (%d thr): %d regs, %d B smem, occupancy %d; 1 finalize block co-resident "
             "with %d x blocks: %s",
             tag, xi.regs, xi.smem, xi.occ, kx, sms, kx * sms, ft, fi.regs, fi.smem, fi.occ, kx,
             fits ? "yes" : "no");
    occ_lines.push_back(line);
    const unsigned grid = unsigned(kx * sms);
    std::string name = std::string(tag) + " x items u" + std::to_string(u) + ", " + std::to_string(kx) +
                       "/SM; fin " + std::to_string(ft) + " thr, w before wait";
    Variant v{name, std::to_string(parts) + " items/row", xbytes + wbytes, true, nullptr};
    x_then_finalize(v, xk, fk, grid, unsigned(CO), ft, parts);
    vs.push_back(v);
  };
  add_v2(x_items_kernel<4, 32>, finalize_pre_kernel<256, 8>, 256, 4, "V2", true);
  add_v2(x_items_kernel<4, 32>, finalize_pre_kernel<128, 8>, 128, 4, "V2", true);
  add_v2(x_items_kernel<8, 56>, finalize_pre_kernel<256, 8>, 256, 8, "V2", true);
  add_v2(x_items_kernel<4, 32>, finalize_pre_kernel<256, 8>, 256, 4, "V2ctl", false);  // no room

  // ---- V5: V2's x pass; finalize with everything but the x sums read before the wait and a
  // one-round tail (finalize_v5_kernel). fk's J must be the x pass's parts per row.
  auto add_v5 = [&](auto xk, auto fk, int ft, int nch, int J, int u) {
    carve(xk);
    carve(fk);
    const KernelInfo xi = info(xk, T), fi = info(fk, ft);
    const int parts = int(LEN / 4 / (int64_t(T) * u));
    if (parts != J) {
      fprintf(stderr, "V5: finalize J %d != x parts %d\n", J, parts);
      exit(2);
    }
    int kx = xi.occ;
    while (kx > 1 && !co_resident(prop, kx, T, xi, ft, fi)) --kx;
    const bool fits = co_resident(prop, kx, T, xi, ft, fi);
    const unsigned grid = unsigned(kx * sms), fgrid = unsigned(CO / nch);
    char line[300];
    snprintf(line, sizeof line,
             "V5     x kernel u%d: %d regs, occupancy %d -> grid %d x %d = %u; finalize (%d thr, %d ch, "
             "%u blocks): %d regs, %d B smem, occupancy %d; co-resident with %d x blocks: %s",
             u, xi.regs, xi.occ, kx, sms, grid, ft, nch, fgrid, fi.regs, fi.smem, fi.occ, kx, fits ? "yes" : "no");
    occ_lines.push_back(line);
    std::string name = "V5 x u" + std::to_string(u) + " " + std::to_string(xi.regs) + "r " + std::to_string(kx) +
                       "/SM; fin " + std::to_string(ft) + " thr " + std::to_string(nch) + " ch " +
                       std::to_string(fi.regs) + "r";
    Variant v{name, std::to_string(parts) + " items/row", xbytes + wbytes, true, nullptr};
    x_then_finalize(v, xk, fk, grid, fgrid, ft, parts);
    vs.push_back(v);
  };
  // 256 threads under 32 registers (MINB 8) or 128 under 64: what 4 u8 or 7 u4 x blocks
  // (57,344 registers) leave of an SM's 65,536.
  add_v5(x_items_kernel<8, 56>, finalize_v5_kernel<256, 1, 2, 8>, 256, 1, 2, 8);
  add_v5(x_items_kernel<8, 56>, finalize_v5_kernel<256, 2, 2, 8>, 256, 2, 2, 8);
  add_v5(x_items_kernel<8, 56>, finalize_v5_kernel<128, 1, 2, 8>, 128, 1, 2, 8);
  add_v5(x_items_kernel<4, 32>, finalize_v5_kernel<256, 1, 4, 8>, 256, 1, 4, 4);
  add_v5(x_items_kernel<4, 32>, finalize_v5_kernel<256, 2, 4, 8>, 256, 2, 4, 4);
  // The extension's split (csrc/cuda/spatial_sum_x.cu, eval_finalize.cu): x at 48, the
  // finalize at 64 (MINB 4).
  // The items are exactly one round of loads here (parts = LEN / 4 / (T * u)), so unguarded.
  add_v5(x_items_kernel<8, 48, false>, finalize_v5_kernel<256, 1, 2, 4>, 256, 1, 2, 8);

  // ---- V3: cooperative, one launch
  auto add_v3 = [&](auto kernel, int u) {
    const KernelInfo ki = info(kernel, T);
    const int parts = int(LEN / 4 / (int64_t(T) * u));
    const unsigned grid = unsigned(ki.occ * sms);
    char line[200];
    snprintf(line, sizeof line, "V3 u%d cooperative kernel: %d regs, %d B smem, occupancy %d blocks/SM -> grid %u",
             u, ki.regs, ki.smem, ki.occ, grid);
    occ_lines.push_back(line);
    if (!coop_ok || grid < unsigned(CO)) {
      occ_lines.push_back("  (skipped: no cooperative launch or grid < Co)");
      return;
    }
    Variant v{"V3  coop: items u" + std::to_string(u) + " + w, grid.sync, fin",
              std::to_string(grid) + " blocks", xbytes + wbytes, true, nullptr};
    v.call = [=, &params](int i) {
      Params a = params(i, parts);
      void* args[] = {&a};
      CK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(grid), dim3(T), args, 0, st));
    };
    vs.push_back(v);
  };
  add_v3(coop_kernel<4>, 4);
  add_v3(coop_kernel<8>, 8);

  // ---- V4: one launch, last blocks finalize
  auto add_v4 = [&](auto kernel, int u, int parts, int kfin) {
    const unsigned grid = unsigned(ROWS * parts);
    const KernelInfo ki = info(kernel, T);
    char line[200];
    snprintf(line, sizeof line, "V4 u%d KFIN %d: %d regs, %d B smem, occupancy %d blocks/SM (%d slots for %u blocks)",
             u, kfin, ki.regs, ki.smem, ki.occ, ki.occ * sms, grid);
    occ_lines.push_back(line);
    Variant v{"V4  last-block: rows/" + std::to_string(parts) + " u" + std::to_string(u) + " + w, " +
                  std::to_string(kfin) + " finalizer" + (kfin > 1 ? "s" : ""),
              std::to_string(grid) + " blocks", xbytes + wbytes, true, nullptr};
    v.call = [=, &params](int i) {
      kernel<<<grid, T, 0, st>>>(params(i, parts));
      CK_LAUNCH();
    };
    vs.push_back(v);
  };
  // MINB: u4 at 32 registers (8 blocks/SM: the 1024 row blocks in one wave), u8 at 48 (5).
  add_v4(lastblock_kernel<4, 1, 8>, 4, 1, 1);
  add_v4(lastblock_kernel<4, 8, 8>, 4, 1, 8);
  add_v4(lastblock_kernel<4, 4, 8>, 4, 2, 4);
  add_v4(lastblock_kernel<8, 1, 5>, 8, 1, 1);
  add_v4(lastblock_kernel<8, 8, 5>, 8, 1, 8);
  add_v4(lastblock_kernel<8, 8, 5>, 8, 2, 8);

  {
    const KernelInfo r0 = info(xw_rows_kernel<4, true, true>, T), r1 = info(xw_rows_kernel<8, true, true>, T),
                     r2 = info(xw_rows_kernel<4, true, true, true>, T),
                     r3 = info(xw_rows_kernel<8, true, true, true>, T), f0 = info(finalize_kernel<true>, T);
    printf("occupancy (cudaOccupancyMaxActiveBlocksPerMultiprocessor, blocks/SM; %d SMs):\n", sms);
    printf("V0/V1 rows + w: u4 %d regs occ %d | u8 %d regs occ %d | u4 forced %d regs occ %d | u8 forced %d regs occ %d\n",
           r0.regs, r0.occ, r1.regs, r1.occ, r2.regs, r2.occ, r3.regs, r3.occ);
    printf("V0/V1 replica finalize: %d regs, occ %d\n", f0.regs, f0.occ);
    for (auto& l : occ_lines) printf("%s\n", l.c_str());
  }

  // ---- correctness pass: every variant on every buffer
  bool all_ok = true;
  std::vector<Err> errs(vs.size());
  std::vector<float> hout(int64_t(B) * CO);
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    auto& v = vs[vi];
    if (!only.empty() && v.name.find(only) == std::string::npos) continue;
    if (!v.checked) continue;
    Err worst;
    for (int k = 0; k < bufs; ++k) {
      CK(cudaMemsetAsync(dout, 0xff, hout.size() * sizeof(float), st));  // NaN: catches unwritten outputs
      v.call(k);
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(hout.data(), dout, hout.size() * sizeof(float), cudaMemcpyDeviceToHost));
      const Err e = compare(hout, ref[k]);
      worst.abs = std::max(worst.abs, e.abs);
      worst.rel = std::max(worst.rel, e.rel);
      worst.nan |= e.nan;
    }
    errs[vi] = worst;
    const bool ok = !worst.nan && worst.rel <= 1e-6;
    all_ok &= ok;
    printf("check %-50s max abs %.2e  max rel %.2e %s\n", v.name.c_str(), worst.abs, worst.rel,
           ok ? "ok" : (worst.nan ? "FAIL (NaN/unwritten)" : "FAIL"));
  }
  unsigned hc[2];
  CK(cudaMemcpy(hc, dcounter, sizeof hc, cudaMemcpyDeviceToHost));
  if (hc[0] != 0 || hc[1] != 0) {
    printf("FAIL: V4 counter not reset (%u, %u)\n", hc[0], hc[1]);
    all_ok = false;
  }
  if (check_only) {
    printf("%s\n", all_ok ? "check passed" : "check FAILED");
    return all_ok ? 0 : 1;
  }

  // ---- timing
  long long spin_cycles = 0;
  {  // calibrate a ~40 us spin (covers the host cost of queueing one call)
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    const long long c = 1000000;
    spin_kernel<<<1, 1, 0, st>>>(c);
    CK_LAUNCH();
    CK(cudaEventRecord(a, st));
    spin_kernel<<<1, 1, 0, st>>>(c);
    CK_LAUNCH();
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    spin_cycles = (long long)(c * 0.040 / ms);
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
  }
  std::vector<cudaEvent_t> ev0(iters), ev1(iters);
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventCreate(&ev0[i]));
    CK(cudaEventCreate(&ev1[i]));
  }
  struct Row {
    double med, mn, batch;
  };
  std::vector<Row> rows(vs.size(), Row{0, 0, 0});
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    auto& v = vs[vi];
    if (!only.empty() && v.name.find(only) == std::string::npos) continue;
    for (int i = 0; i < warmup; ++i) v.call(i);
    CK(cudaStreamSynchronize(st));
    for (int i = 0; i < iters; ++i) {
      spin_kernel<<<1, 1, 0, st>>>(spin_cycles);
      CK_LAUNCH();
      CK(cudaEventRecord(ev0[i], st));
      v.call(warmup + i);
      CK(cudaEventRecord(ev1[i], st));
    }
    CK(cudaStreamSynchronize(st));
    const std::vector<double> us = elapsed_us(ev0, ev1);
    // Back to back (no spin): events around the whole batch, per call.
    CK(cudaEventRecord(ev0[0], st));
    for (int i = 0; i < iters; ++i) v.call(i);
    CK(cudaEventRecord(ev1[0], st));
    CK(cudaStreamSynchronize(st));
    float ms;
    CK(cudaEventElapsedTime(&ms, ev0[0], ev1[0]));
    rows[vi] = {median(us), *std::min_element(us.begin(), us.end()), ms * 1e3 / iters};
  }
  CK(cudaMemcpy(hc, dcounter, sizeof hc, cudaMemcpyDeviceToHost));
  if (hc[0] != 0 || hc[1] != 0) {
    printf("FAIL: V4 counter not reset after timing (%u, %u)\n", hc[0], hc[1]);
    all_ok = false;
  }

  printf("\n%d calls per variant (median/min: events around each call after a GPU spin; "
         "b2b: back-to-back batch / calls); GB/s on the bytes of the call at the median\n", iters);
  printf("%-52s %8s %8s %8s %8s %9s %9s  %s\n", "variant", "med us", "min us", "b2b us", "GB/s",
         "abs err", "rel err", "note");
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    const auto& v = vs[vi];
    if (!only.empty() && v.name.find(only) == std::string::npos) continue;
    const Row& r = rows[vi];
    char ea[16] = "-", er[16] = "-";
    if (v.checked) {
      snprintf(ea, sizeof ea, "%.2e", errs[vi].abs);
      snprintf(er, sizeof er, "%.2e", errs[vi].rel);
    }
    printf("%-52s %8.2f %8.2f %8.2f %8.0f %9s %9s  %s\n", v.name.c_str(), r.med, r.mn, r.batch,
           v.bytes / (r.med * 1e-6) / 1e9, ea, er, v.note.c_str());
  }

  // ---- diagnostic: when do the finalize blocks start, relative to the x pass? (PDL variants)
  printf("\nPDL timeline (one traced call, globaltimer, us relative to the last x block's end; "
         "finalize blocks: start / after the pre-wait reads / after griddepcontrol.wait / after the "
         "last store, median [min, max])\n");
  std::vector<unsigned long long> ht(trace_n);
  for (auto& v : vs) {
    if (!v.traced || (!only.empty() && v.name.find(only) == std::string::npos)) continue;
    CK(cudaMemsetAsync(dtrace, 0, trace_n * sizeof(unsigned long long), st));
    v.traced(dtrace);
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(ht.data(), dtrace, trace_n * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    const int nx = std::min(v.x_blocks, MAX_BLOCKS_TRACE);
    unsigned long long x0 = ~0ull, x1 = 0;
    for (int i = 0; i < nx; ++i) {
      x0 = std::min(x0, ht[i]);
      x1 = std::max(x1, ht[MAX_BLOCKS_TRACE + i]);
    }
    auto rel = [&](int slot, double& med, double& mn, double& mx) {
      std::vector<double> t;
      for (int c = 0; c < v.f_blocks; ++c) {
        const unsigned long long s = ht[2 * MAX_BLOCKS_TRACE + c * TRACE_F + slot];
        if (s) t.push_back((double(s) - double(x1)) * 1e-3);
      }
      if (t.empty()) {
        med = mn = mx = NAN;
        return;
      }
      med = median(t);
      mn = *std::min_element(t.begin(), t.end());
      mx = *std::max_element(t.begin(), t.end());
    };
    double m0, a0, b0, m1, a1, b1, m2, a2, b2, m4, a4, b4;
    rel(0, m0, a0, b0);
    rel(1, m1, a1, b1);
    rel(2, m2, a2, b2);
    rel(4, m4, a4, b4);
    std::set<unsigned long long> smset;
    for (int c = 0; c < v.f_blocks; ++c) smset.insert(ht[2 * MAX_BLOCKS_TRACE + c * TRACE_F + 3]);
    printf("%-52s x span %6.2f | start %6.2f [%6.2f,%6.2f] | w %6.2f | wait %6.2f [%6.2f,%6.2f] | "
           "end %6.2f [%6.2f,%6.2f] | %zu SMs\n",
           v.name.c_str(), (double(x1) - double(x0)) * 1e-3, m0, a0, b0, m1, m2, a2, b2, m4, a4, b4,
           smset.size());
  }
  printf("\n%s\n", all_ok ? "all variants within rel err 1e-6" : "SOME VARIANTS FAILED the check");
  return all_ok ? 0 : 1;
}
