// The FFT path's core (docs/math.md §3.3): for each frequency f, the complex
// product Y_f = X_f W_f of a [B, Ci] and a [Ci, Co] matrix, reduced at once to
// sum_b |Y_f[b, co]|^2; neither W_f nor Y_f is ever stored. A block owns one
// (fh, fw) pair and a tile of kTileCo output channels and walks every fd:
// W_f for all its fd comes from the same W2[kd] (the weight's spectrum over H
// and W, fft_weight_spectrum.cu) by a kD-tap DFT, done in shared memory for a chunk
// of kChunkCi input channels at a time, while the next chunk is copied in
// (cp.async, double-buffered). Each thread accumulates an 8 x 4 tile of Y
// (samples x channels) for one fd in registers.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "common/cuda/copy_async.cuh"
#include "common/cuda/dynamic_smem.h"
#include "fft/cuda/fft.h"
#include "common/cuda/complex.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kTileCo = 32;   // output channels per block
constexpr int kChunkCi = 8;   // input channels staged at a time
constexpr int kTileB = 16;    // samples per pass (two halves of 8 per fd lane)
constexpr int kLaneThreads = (kTileB / 8) * (kTileCo / 4);  // threads per fd lane: 16
constexpr int kMaxFdLanes = 24;

struct SpectralArgs {
  const float2* x;  // [Ld, Lh, Lwf, B, Ci]
  const float2* w;  // [count, Lwf, Ci, Cog, kD]
  double* energy;   // [Co, Lh * Lwf]
  int64_t batch, ci, cig, cog, co_tiles, kd, dd;
  int64_t Ld, Lh, Lwf, Lw, fh0, fd_lanes;
  double inv_size;  // 1 / (Ld * Lh * Lw)
};

// Shared memory: the x and W2 chunks are double-buffered, so the copies of the
// next chunk (cp.async) run while this one is multiplied.
struct SmemLayout {
  int64_t tw, w2, xs, ws, esum, bytes;  // offsets in bytes; w2 and xs hold two buffers
  int64_t w2_len, xs_len;               // float2 elements per buffer
  // Offsets rounded up to 16 bytes: xs and ws are read as float4.
  __host__ __device__ static int64_t up16(int64_t v) { return (v + 15) / 16 * 16; }
  __host__ __device__ SmemLayout(int64_t fd_lanes, int64_t kd, int64_t Ld) {
    w2_len = kd * kChunkCi * kTileCo;
    xs_len = fd_lanes * kChunkCi * kTileB;
    tw = 0;
    w2 = up16(tw + Ld * kd * sizeof(float2));
    xs = up16(w2 + 2 * w2_len * sizeof(float2));
    ws = up16(xs + 2 * xs_len * sizeof(float2));
    bytes = ws + fd_lanes * kChunkCi * kTileCo * sizeof(float2);
    esum = ws;  // used after the last step only; 2 * fd_lanes * kTileCo doubles fit in ws
  }
};

// Eight samples' values of one channel, as four 16-byte shared-memory loads.
__device__ __forceinline__ void load_eight(const float4* row, float2 xv[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 p = row[i];
    xv[2 * i] = make_float2(p.x, p.y);
    xv[2 * i + 1] = make_float2(p.z, p.w);
  }
}

// Which (fd pass, batch pass, ci chunk) a step of the block's walk is.
struct Step {
  int64_t fd0, b0, c0;
  bool first, last;  // of its (fd pass, batch pass)
};

__device__ __forceinline__ Step step_at(int64_t s, const SpectralArgs& a, int64_t chunks,
                                        int64_t b_passes) {
  const int64_t c = s % chunks, b = (s / chunks) % b_passes, f = s / (chunks * b_passes);
  return {f * a.fd_lanes, b * kTileB, c * kChunkCi, c == 0, c == chunks - 1};
}

// Issues the copies of one step's x and W2 chunks into buffer `buf`.
__device__ __forceinline__ void stage_async(const SpectralArgs& a, const Step& st,
                                            const float2* x_pair, const float2* w_pair,
                                            int64_t group, int64_t co0, float2* xs, float2* w2s) {
  // Shared-memory indices in 32 bits; global offsets in 64.
  const int64_t fd_stride = a.Lh * a.Lwf * a.batch * a.ci;
  const int kd_count = static_cast<int>(a.kd), lanes = static_cast<int>(a.fd_lanes);
  for (int i = threadIdx.x; i < lanes * kTileB * kChunkCi; i += blockDim.x) {
    const int k = i % kChunkCi, b = (i / kChunkCi) % kTileB, l = i / (kChunkCi * kTileB);
    const int64_t fd = st.fd0 + l, ci = st.c0 + k, bb = st.b0 + b;
    const bool ok = fd < a.Ld && bb < a.batch && ci < a.cig;
    copy_async(xs + (l * kChunkCi + k) * kTileB + b,
               ok ? x_pair + fd * fd_stride + bb * a.ci + group * a.cig + ci : a.x, ok);
  }
  // W2 rows are (ci, co) with kD contiguous: read in that order, stored as [kd][ci][co].
  for (int i = threadIdx.x; i < kd_count * kChunkCi * kTileCo; i += blockDim.x) {
    const int kd = i % kd_count, co = (i / kd_count) % kTileCo, k = i / (kd_count * kTileCo);
    const bool ok = st.c0 + k < a.cig && co0 + co < a.cog;
    copy_async(w2s + (kd * kChunkCi + k) * kTileCo + co,
               ok ? w_pair + ((group * a.cig + st.c0 + k) * a.cog + co0 + co) * a.kd + kd : a.w, ok);
  }
  copy_async_commit();
}

// ws[l][ci][co] = sum_kd W2[kd][ci][co] exp(-2 pi i fd kd dd / Ld), fd = fd0 + l:
// W_f for every fd lane. A unit is two adjacent channels (one float4) for
// kGenLanes fd lanes: W2 is read once per unit and the lanes' sums are
// independent, so they overlap instead of waiting on one chain.
constexpr int kGenLanes = 4;
__device__ __forceinline__ void depth_dft(const SpectralArgs& a, int64_t fd0, const float2* w2,
                                          const float2* tw, float2* ws) {
  constexpr int kPairs = kChunkCi * kTileCo / 2;
  const int lanes = static_cast<int>(a.fd_lanes), kd_count = static_cast<int>(a.kd);
  const int groups = (lanes + kGenLanes - 1) / kGenLanes;
  for (int u = threadIdx.x; u < kPairs * groups; u += blockDim.x) {
    const int p = u % kPairs, l0 = (u / kPairs) * kGenLanes;
    float4 acc[kGenLanes];
    int tw_row[kGenLanes];
#pragma unroll
    for (int q = 0; q < kGenLanes; ++q) {
      acc[q] = make_float4(0.f, 0.f, 0.f, 0.f);
      tw_row[q] = static_cast<int>(min(fd0 + l0 + q, a.Ld - 1)) * kd_count;
    }
    for (int kd = 0; kd < kd_count; ++kd) {
      const float4 w = reinterpret_cast<const float4*>(w2 + kd * kChunkCi * kTileCo)[p];
#pragma unroll
      for (int q = 0; q < kGenLanes; ++q) {
        const float2 t = tw[tw_row[q] + kd];
        acc[q].x = fmaf(w.x, t.x, fmaf(-w.y, t.y, acc[q].x));
        acc[q].y = fmaf(w.x, t.y, fmaf(w.y, t.x, acc[q].y));
        acc[q].z = fmaf(w.z, t.x, fmaf(-w.w, t.y, acc[q].z));
        acc[q].w = fmaf(w.z, t.y, fmaf(w.w, t.x, acc[q].w));
      }
    }
#pragma unroll
    for (int q = 0; q < kGenLanes; ++q) {
      if (l0 + q < lanes) reinterpret_cast<float4*>(ws + (l0 + q) * kChunkCi * kTileCo)[p] = acc[q];
    }
  }
}

__global__ void __launch_bounds__(kMaxFdLanes * kLaneThreads, 1)
    spectral_energy_kernel(const SpectralArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const SmemLayout lay(a.fd_lanes, a.kd, a.Ld);
  double* esum = reinterpret_cast<double*>(smem + lay.esum);  // [fd lane, half][co]
  float2* tw = reinterpret_cast<float2*>(smem + lay.tw);       // [fd][kd]
  float2* w2s = reinterpret_cast<float2*>(smem + lay.w2);      // 2 x [kd][ci][co]
  float2* xs = reinterpret_cast<float2*>(smem + lay.xs);       // 2 x [fd lane][ci][b]
  float2* ws = reinterpret_cast<float2*>(smem + lay.ws);       // [fd lane][ci][co]

  const int64_t tiles_per_group = (a.cog + kTileCo - 1) / kTileCo;
  const int64_t tile = blockIdx.x % a.co_tiles, pair = blockIdx.x / a.co_tiles;
  const int64_t group = tile / tiles_per_group, co0 = (tile % tiles_per_group) * kTileCo;
  const int64_t fhc = pair / a.Lwf, fw = pair % a.Lwf, fh = a.fh0 + fhc;
  const int tid = threadIdx.x, lane_fd = tid / kLaneThreads, t = tid % kLaneThreads;
  const int half = t / (kTileCo / 4), quad = t % (kTileCo / 4);
  // rfft along W: bins other than 0 and Lw/2 stand for two bins of the full spectrum.
  const float weight_w = (fw == 0 || 2 * fw == a.Lw) ? 1.f : 2.f;
  const float2* x_pair = a.x + (fh * a.Lwf + fw) * a.batch * a.ci;
  const float2* w_pair = a.w + (fhc * a.Lwf + fw) * a.ci * a.cog * a.kd;

  for (int64_t i = tid; i < a.Ld * a.kd; i += blockDim.x) {
    tw[i] = twiddle(i / a.kd, (i % a.kd) * a.dd, a.Ld);
  }
  const int64_t chunks = (a.cig + kChunkCi - 1) / kChunkCi;
  const int64_t b_passes = (a.batch + kTileB - 1) / kTileB;
  const int64_t steps = chunks * b_passes * ((a.Ld + a.fd_lanes - 1) / a.fd_lanes);
  stage_async(a, step_at(0, a, chunks, b_passes), x_pair, w_pair, group, co0, xs, w2s);

  double e[4] = {0, 0, 0, 0};
  float2 acc[8][4];
  for (int64_t s = 0; s < steps; ++s) {
    const Step st = step_at(s, a, chunks, b_passes);
    const int buf = s & 1;
    if (s + 1 < steps) {  // the other buffer was released by the barrier ending step s - 1
      stage_async(a, step_at(s + 1, a, chunks, b_passes), x_pair, w_pair, group, co0,
                  xs + (buf ^ 1) * lay.xs_len, w2s + (buf ^ 1) * lay.w2_len);
    } else {
      copy_async_commit();  // an empty group keeps the wait below uniform
    }
    copy_async_wait<1>();
    __syncthreads();  // step s's chunks have landed for every thread
    depth_dft(a, st.fd0, w2s + buf * lay.w2_len, tw, ws);
    __syncthreads();
    if (st.first) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = make_float2(0.f, 0.f);
    }
    const float4* xrow =
        reinterpret_cast<const float4*>(xs + buf * lay.xs_len + lane_fd * kChunkCi * kTileB + half * 8);
    const float4* wrow = reinterpret_cast<const float4*>(ws + lane_fd * kChunkCi * kTileCo + quad * 4);
#pragma unroll
    for (int k = 0; k < kChunkCi; ++k) {
      float2 xv[8], wv[4];
      load_eight(xrow + k * (kTileB / 2), xv);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float4 p = wrow[k * (kTileCo / 2) + j];
        wv[2 * j] = make_float2(p.x, p.y);
        wv[2 * j + 1] = make_float2(p.z, p.w);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) cfma(acc[i][j], xv[i], wv[j]);
    }
    const int64_t fd = st.fd0 + lane_fd;
    // The DC bin is each sample's sum: it carries the mean, not the spread.
    if (st.last && fd < a.Ld && !(fd == 0 && fh == 0 && fw == 0)) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float sq = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += acc[i][j].x * acc[i][j].x + acc[i][j].y * acc[i][j].y;
        e[j] += static_cast<double>(weight_w * sq);
      }
    }
    __syncthreads();  // xs[buf], w2s[buf] and ws are free for the next steps
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) esum[(lane_fd * 2 + half) * kTileCo + quad * 4 + j] = e[j];
  __syncthreads();
  for (int c = tid; c < kTileCo && co0 + c < a.cog; c += blockDim.x) {  // blocks may be < 32 threads
    double total = 0;
    for (int64_t r = 0; r < 2 * a.fd_lanes; ++r) total += esum[r * kTileCo + c];
    const int64_t co = group * a.cog + co0 + c;
    a.energy[co * (a.Lh * a.Lwf) + fh * a.Lwf + fw] = total * a.inv_size;
  }
}

// ---------------------------------------------------------------------------------------
// Small problems (at most 8 samples; fft.cpp decides). There the kernel above waits
// more than it multiplies: one block of 10 warps or fewer per SM, three barriers per 8
// input channels, and with B <= 8 half its products on the zero samples that fill its tile
// of 16. Here a block still owns one (fh, fw) pair and a tile of output channels, but
// - builds its own W2 from the weight's taps (fft_weight_spectrum.cu's arithmetic, for its one
//   pair): no weight_spectrum launch and no W2 in global memory, at the price of reading
//   the tile's taps once per pair (kH kW / 2 times the bytes of its W2; fft.cpp
//   bounds those re-reads);
// - holds W2 and x for all its input channels and fd at once: the taps are staged and
//   turned into W2 first (phase 1), then the products run without a barrier (phase 2);
// - gives a thread all 8 samples x 4 channels of one fd: it does the depth DFT of its own
//   W_f values in registers (each W_f is still computed once per block, as in depth_dft,
//   without the shared buffer and its barrier), and the input channels are dealt over
//   `slices` threads whose partial Y are added in shared memory before squaring, which
//   gives the block enough threads to hide latency with only one fd pass.
constexpr int kSmallTileB = 8;          // samples per thread: the whole batch
constexpr int kSmallMaxThreads = 384;   // 12 warps at the ~128 registers of a thread's tile
constexpr int kSmallMaxKd = 8;          // depth twiddles a thread holds in registers
constexpr int64_t kTapBufferBytes = 32 << 10;  // one of the two staging buffers of taps

struct SmallArgs {
  const float2* x;  // [Ld, Lh, Lwf, B, Ci]
  const float* w;   // [Ci, Cog, kD, kH, kW]
  double* energy;   // [Co, Lh * Lwf]
  int64_t batch, ci, cig, cog, co_tiles;
  int64_t Ld, Lh, Lwf, Lw, dd, dh, dw;
  int kd, kh, kw;
  int tile_co;   // output channels per block (a multiple of 4)
  int slices;    // threads splitting the input channels of one (fd, 4 channels); divides 8
  int piece_ci;  // input channels per staged piece of taps
  int pieces;
  bool vec_taps;  // taps copied 16 bytes at a time (aligned rows)
  double inv_size;
  __host__ __device__ int quads() const { return tile_co / 4; }
  __host__ __device__ int threads() const { return static_cast<int>(Ld) * quads() * slices; }
  __host__ __device__ int taps() const { return kd * kh * kw; }
};

// Shared memory: twiddles, W2 [kd][ci][co] and x [fd][ci][b] for the whole block, the taps
// one piece at a time (two buffers where there are several pieces). After phase 2 the
// threads' partial Y and then their energies reuse it from W2 on.
struct SmallLayout {
  int64_t tw_d, tw_h, tw_w, w2, xs, taps, red, esum, bytes;  // offsets in bytes
  int64_t x_row;         // float2 per fd row of xs: 16 bytes of padding, so that the rows
                         // a warp reads (one per fd) start on different banks
  int64_t piece_floats;  // per buffer of taps
  __host__ __device__ SmallLayout(const SmallArgs& a) {
    x_row = a.cig * kSmallTileB + 2;
    piece_floats = int64_t(a.piece_ci) * a.tile_co * a.taps();
    tw_d = 0;
    tw_h = tw_d + a.Ld * a.kd * sizeof(float2);
    tw_w = tw_h + a.kh * sizeof(float2);
    w2 = SmemLayout::up16(tw_w + a.kw * sizeof(float2));
    xs = SmemLayout::up16(w2 + a.kd * a.cig * a.tile_co * sizeof(float2));
    taps = SmemLayout::up16(xs + a.Ld * x_row * sizeof(float2));
    const int64_t data_end = taps + (a.pieces > 1 ? 2 : 1) * piece_floats * sizeof(float);
    red = w2;
    esum = SmemLayout::up16(red + int64_t(kSmallTileB) * 4 * a.threads() * sizeof(float2));
    const int64_t sums_end = esum + int64_t(a.threads()) * 4 * sizeof(double);
    bytes = data_end > sums_end ? data_end : sums_end;
  }
};

// Block b: output-channel tile b % co_tiles of pair b / co_tiles.
struct SmallBlock {
  int64_t group, co0, fh, fw;
  __device__ explicit SmallBlock(const SmallArgs& a) {
    const int64_t per_group = (a.cog + a.tile_co - 1) / a.tile_co;
    const int64_t tile = blockIdx.x % a.co_tiles, pair = blockIdx.x / a.co_tiles;
    group = tile / per_group;
    co0 = (tile % per_group) * a.tile_co;
    fh = pair / a.Lwf;
    fw = pair % a.Lwf;
  }
};

// Thread fd + Ld * (quad + quads * slice): fd fastest, so a warp's W2 loads are for a
// few channel quads (broadcast over fd) and its x loads one row per fd.
struct SmallThread {
  int fd, quad, slice;
  __device__ explicit SmallThread(const SmallArgs& a) {
    const int t = threadIdx.x, Ld = static_cast<int>(a.Ld);
    fd = t % Ld;
    quad = (t / Ld) % a.quads();
    slice = t / (Ld * a.quads());
  }
};

// x for every fd of the pair, the batch zero-filled to 8. Samples fastest: a warp reads
// 4 adjacent channels of each of 8 samples (whole 32-byte sectors) and writes 256
// adjacent bytes.
__device__ __forceinline__ void stage_x_small(const SmallArgs& a, const SmallLayout& lay,
                                              const float2* x_pair, int64_t group, float2* xs) {
  const int64_t fd_stride = a.Lh * a.Lwf * a.batch * a.ci;
  const int cig = static_cast<int>(a.cig), n = static_cast<int>(a.Ld) * cig * kSmallTileB;
  const int x_row = static_cast<int>(lay.x_row);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int b = i % kSmallTileB, ci = (i / kSmallTileB) % cig, fd = i / (kSmallTileB * cig);
    const bool ok = b < a.batch;
    copy_async(xs + fd * x_row + ci * kSmallTileB + b,
               ok ? x_pair + fd * fd_stride + b * a.ci + group * a.cig + ci : a.x, ok);
  }
}

// Piece p of the tile's taps: input channels [p * piece_ci, +piece_ci) of the group, for
// each the tile's rows of kD kH kW taps, adjacent in the weight (zero past Cog and Cig).
template <int kFloats>
__device__ __forceinline__ void stage_taps(const SmallArgs& a, const SmallBlock& blk, int p,
                                           float* buf) {
  const int c0 = p * a.piece_ci, run = a.tile_co * a.taps();
  const int valid = static_cast<int>(a.cog - blk.co0 < a.tile_co ? a.cog - blk.co0 : a.tile_co) *
                    a.taps();
  const int64_t ci_stride = a.cog * a.taps();
  const float* first = a.w + ((blk.group * a.cig + c0) * a.cog + blk.co0) * a.taps();
  for (int i = threadIdx.x * kFloats; i < a.piece_ci * run; i += blockDim.x * kFloats) {
    const int k = i / run, o = i - k * run;
    const bool ok = c0 + k < a.cig && o < valid;
    const float* src = ok ? first + k * ci_stride + o : a.w;
    if constexpr (kFloats == 4) {
      copy_async_bytes<16>(buf + i, src, ok);
    } else {
      copy_async_bytes<4>(buf + i, src, ok);
    }
  }
}

__device__ __forceinline__ void stage_taps_async(const SmallArgs& a, const SmallBlock& blk, int p,
                                                 float* buf) {
  if (a.vec_taps) {
    stage_taps<4>(a, blk, p, buf);
  } else {
    stage_taps<1>(a, blk, p, buf);
  }
}

// W2[kd][ci][co] for piece p's input channels, with weight_spectrum_kernel's arithmetic (the
// kw sums of each kh row, then over kh) at this block's (fh, fw). A thread per (ci, kd, co),
// co fastest: a warp reads taps kD kH kW floats apart (no bank conflicts where that is odd)
// and writes adjacent W2 values.
__device__ __forceinline__ void build_w2(const SmallArgs& a, const float* buf, const float2* tw_h,
                                         const float2* tw_w, int p, float2* w2) {
  const int cig = static_cast<int>(a.cig), c0 = p * a.piece_ci;
  const int count = (cig - c0 < a.piece_ci ? cig - c0 : a.piece_ci) * a.kd * a.tile_co;
  for (int r = threadIdx.x; r < count; r += blockDim.x) {
    const int co = r % a.tile_co, kd = (r / a.tile_co) % a.kd, k = r / (a.tile_co * a.kd);
    const float* w = buf + (k * a.tile_co + co) * a.taps() + kd * a.kh * a.kw;
    float2 acc = make_float2(0.f, 0.f);
    for (int kh = 0; kh < a.kh; ++kh) {
      float2 row = make_float2(0.f, 0.f);
      for (int kw = 0; kw < a.kw; ++kw) {
        const float v = w[kh * a.kw + kw];
        row.x = fmaf(v, tw_w[kw].x, row.x);
        row.y = fmaf(v, tw_w[kw].y, row.y);
      }
      cfma(acc, row, tw_h[kh]);
    }
    w2[(kd * cig + c0 + k) * a.tile_co + co] = acc;
  }
}

// The thread's part of Y[b][co] (8 samples x its 4 channels, at its fd) over the input
// channels ci = slice (mod slices): per ci its 4 W_f = sum_kd W2[kd] tw[fd][kd] (depth_dft's
// arithmetic), then the 32 products.
__device__ __forceinline__ void multiply_small(const SmallArgs& a, const SmallLayout& lay,
                                               const SmallThread& th, const float2* tw_d,
                                               const float2* w2, const float2* xs,
                                               float2 (&acc)[8][4]) {
  float2 tw[kSmallMaxKd];
#pragma unroll
  for (int kd = 0; kd < kSmallMaxKd; ++kd) {
    tw[kd] = kd < a.kd ? tw_d[th.fd * a.kd + kd] : make_float2(0.f, 0.f);
  }
  const int cig = static_cast<int>(a.cig), w_row = a.tile_co / 2;  // float4 per W2 row
  const float4* xrow = reinterpret_cast<const float4*>(xs + th.fd * lay.x_row);
  const float4* wcol = reinterpret_cast<const float4*>(w2) + th.quad * 2;
  for (int ci = th.slice; ci < cig; ci += a.slices) {
    float2 wv[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) wv[j] = make_float2(0.f, 0.f);
#pragma unroll
    for (int kd = 0; kd < kSmallMaxKd; ++kd) {
      if (kd < a.kd) {
        const float4* row = wcol + (kd * cig + ci) * w_row;
        const float4 lo = row[0], hi = row[1];
        cfma(wv[0], make_float2(lo.x, lo.y), tw[kd]);
        cfma(wv[1], make_float2(lo.z, lo.w), tw[kd]);
        cfma(wv[2], make_float2(hi.x, hi.y), tw[kd]);
        cfma(wv[3], make_float2(hi.z, hi.w), tw[kd]);
      }
    }
    float2 xv[8];
    load_eight(xrow + ci * (kSmallTileB / 2), xv);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) cfma(acc[i][j], xv[i], wv[j]);
  }
}

// e[j]: weight * sum over the thread's share of the samples (8 / slices of them) of
// |Y[b][j]|^2, Y the sum of the slices' parts, added in slice order (deterministic) through
// `red` = [8 * 4][threads] (a thread's values at its index of every row: adjacent threads,
// adjacent addresses). Zero where `keep` is false.
__device__ __forceinline__ void square_slices(const SmallArgs& a, const SmallThread& th,
                                              const float2 (&acc)[8][4], float2* red,
                                              float weight, bool keep, double (&e)[4]) {
  const int threads = a.threads(), Ld = static_cast<int>(a.Ld);
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) red[(i * 4 + j) * threads + threadIdx.x] = acc[i][j];
  __syncthreads();
  const int share = kSmallTileB / a.slices, slice_stride = Ld * a.quads();
  const int first = th.fd + Ld * th.quad;  // the thread of slice 0
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float sq = 0.f;
    for (int b = th.slice * share; b < (th.slice + 1) * share; ++b) {
      const float2* y = red + (b * 4 + j) * threads + first;
      float2 sum = y[0];
      for (int s = 1; s < a.slices; ++s) {
        sum.x += y[s * slice_stride].x;
        sum.y += y[s * slice_stride].y;
      }
      sq += sum.x * sum.x + sum.y * sum.y;
    }
    e[j] = keep ? static_cast<double>(weight * sq) : 0.0;
  }
}

// sum_r v[r * stride] for r < rows, in four chains (rows r = q mod 4) added in a fixed
// order: deterministic, and a quarter of the dependent adds (rows is Ld * slices, up to
// 96 on the small problems).
__device__ __forceinline__ double column_sum(const double* v, int rows, int stride) {
  double part[4] = {0, 0, 0, 0};
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
#pragma unroll
    for (int q = 0; q < 4; ++q) part[q] += v[(r + q) * stride];
  }
  for (; r < rows; ++r) part[0] += v[r * stride];
  return (part[0] + part[1]) + (part[2] + part[3]);
}

__global__ void __launch_bounds__(kSmallMaxThreads, 1)
    small_spectral_energy_kernel(const SmallArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const SmallLayout lay(a);
  float2* tw_d = reinterpret_cast<float2*>(smem + lay.tw_d);  // [fd][kd]
  float2* tw_h = reinterpret_cast<float2*>(smem + lay.tw_h);  // [kh]
  float2* tw_w = reinterpret_cast<float2*>(smem + lay.tw_w);  // [kw]
  float2* w2 = reinterpret_cast<float2*>(smem + lay.w2);      // [kd][ci][co]
  float2* xs = reinterpret_cast<float2*>(smem + lay.xs);      // [fd][ci][b]
  float* taps = reinterpret_cast<float*>(smem + lay.taps);    // 1 or 2 x [ci][co][taps]
  float2* red = reinterpret_cast<float2*>(smem + lay.red);    // [b][co][thread], after phase 2
  double* esum = reinterpret_cast<double*>(smem + lay.esum);  // [fd + Ld slice][co]
  const SmallBlock blk(a);
  const SmallThread th(a);

  for (int i = threadIdx.x; i < a.Ld * a.kd; i += blockDim.x) {
    tw_d[i] = twiddle(i / a.kd, (i % a.kd) * a.dd, a.Ld);
  }
  for (int i = threadIdx.x; i < a.kh; i += blockDim.x) tw_h[i] = twiddle(blk.fh, i * a.dh, a.Lh);
  for (int i = threadIdx.x; i < a.kw; i += blockDim.x) tw_w[i] = twiddle(blk.fw, i * a.dw, a.Lw);
  // Phase 1: x in one group of copies, then the taps piece by piece, each turned into W2
  // while the next one is copied.
  stage_x_small(a, lay, a.x + (blk.fh * a.Lwf + blk.fw) * a.batch * a.ci, blk.group, xs);
  copy_async_commit();
  stage_taps_async(a, blk, 0, taps);
  copy_async_commit();
  for (int p = 0; p < a.pieces; ++p) {
    // The other buffer was released by the barrier ending piece p - 1.
    if (p + 1 < a.pieces) stage_taps_async(a, blk, p + 1, taps + ((p + 1) & 1) * lay.piece_floats);
    copy_async_commit();  // empty after the last piece: keeps the wait below uniform
    copy_async_wait<1>();
    __syncthreads();  // piece p (with x and the twiddles at p = 0) is there for every thread
    build_w2(a, taps + (p & 1) * lay.piece_floats, tw_h, tw_w, p, w2);
    __syncthreads();
  }
  // Phase 2.
  float2 acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = make_float2(0.f, 0.f);
  multiply_small(a, lay, th, tw_d, w2, xs, acc);
  __syncthreads();  // every thread is done with W2 and x: red and esum overwrite them
  // rfft along W: bins other than 0 and Lw/2 stand for two bins of the full spectrum. The
  // DC bin is each sample's sum: it carries the mean, not the spread.
  const float weight_w = (blk.fw == 0 || 2 * blk.fw == a.Lw) ? 1.f : 2.f;
  const bool dc = th.fd == 0 && blk.fh == 0 && blk.fw == 0;
  double e[4];
  square_slices(a, th, acc, red, weight_w, !dc, e);
  const int row = th.fd + static_cast<int>(a.Ld) * th.slice;
#pragma unroll
  for (int j = 0; j < 4; ++j) esum[row * a.tile_co + th.quad * 4 + j] = e[j];
  __syncthreads();
  const int rows = static_cast<int>(a.Ld) * a.slices;
  for (int c = threadIdx.x; c < a.tile_co && blk.co0 + c < a.cog; c += blockDim.x) {
    const int64_t co = blk.group * a.cog + blk.co0 + c;
    a.energy[co * (a.Lh * a.Lwf) + blk.fh * a.Lwf + blk.fw] =
        column_sum(esum + c, rows, a.tile_co) * a.inv_size;
  }
}

// The small kernel's tiling of this problem (everything in `a` but the pointers), or false
// where it does not apply: more than 8 samples, more depth taps than kSmallMaxKd, or an
// fd count whose threads would not fit one block even with 8 channels per tile.
bool small_plan(const ConvGeometry& g, const SpectrumGeometry& s, int64_t sms, SmallArgs& a) {
  if (g.batch > kSmallTileB || g.kernel[0] > kSmallMaxKd) return false;
  a.batch = g.batch;
  a.ci = g.in_channels;
  a.cig = g.in_group_channels();
  a.cog = g.out_group_channels();
  a.Ld = s.L[0];
  a.Lh = s.L[1];
  a.Lwf = s.Lwf;
  a.Lw = s.L[2];
  a.dd = g.dilation[0];
  a.dh = g.dilation[1];
  a.dw = g.dilation[2];
  a.kd = static_cast<int>(g.kernel[0]);
  a.kh = static_cast<int>(g.kernel[1]);
  a.kw = static_cast<int>(g.kernel[2]);
  a.inv_size = 1.0 / static_cast<double>(s.L[0] * s.L[1] * s.L[2]);
  // Output channels per block: the group's, rounded up to a power of two, at most 32;
  // halved (not below 8) while the blocks still fit one wave. A block has a whole SM to
  // itself (kSmallMaxThreads threads), so halving its tile halves each block's products
  // and taps, and so the kernel's time, until blocks must wait for a second wave.
  const auto blocks = [&](int64_t tile) {
    return s.pairs() * g.groups * ((a.cog + tile - 1) / tile);
  };
  int64_t tile = 4;
  while (tile < 32 && tile < a.cog) tile *= 2;
  while (tile > 8 && blocks(tile / 2) <= sms) tile /= 2;
  const int64_t per_slice = a.Ld * (tile / 4);
  if (per_slice > kSmallMaxThreads) return false;
  a.tile_co = static_cast<int>(tile);
  a.co_tiles = g.groups * ((a.cog + tile - 1) / tile);
  // As many slices of the input channels as the block's threads allow (none left empty).
  a.slices = kSmallTileB;
  while (a.slices > 1 && (per_slice * a.slices > kSmallMaxThreads || a.slices > a.cig)) {
    a.slices /= 2;
  }
  // All the taps in one piece where they fit both buffers, else pieces of one buffer.
  const int64_t ci_bytes = tile * g.taps() * int64_t(sizeof(float));
  int64_t piece = a.cig;
  if (a.cig * ci_bytes > 2 * kTapBufferBytes) {
    const int64_t most = std::max<int64_t>(1, kTapBufferBytes / ci_bytes);
    const int64_t count = (a.cig + most - 1) / most;
    piece = (a.cig + count - 1) / count;  // balanced: no small last piece
  }
  a.piece_ci = static_cast<int>(piece);
  a.pieces = static_cast<int>((a.cig + piece - 1) / piece);
  a.vec_taps = a.cog * g.taps() % 4 == 0;  // and an aligned weight: checked at the launch
  return true;
}

int64_t sm_count() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

}  // namespace

// Lanes over fd: as many as fit, balanced over the passes Ld needs.
int64_t spectral_fd_lanes(int64_t Ld) {
  const int64_t passes = (Ld + kMaxFdLanes - 1) / kMaxFdLanes;
  return (Ld + passes - 1) / passes;
}

int64_t spectral_energy_smem_bytes(const ConvGeometry& g) {
  return SmemLayout(spectral_fd_lanes(g.out_size[0]), g.kernel[0], g.out_size[0]).bytes;
}

void spectral_energy_cuda(const at::Tensor& x_spec, const at::Tensor& w_spec,
                          const ConvGeometry& g, const SpectrumGeometry& s, int64_t fh0,
                          int64_t count, at::Tensor& energy) {
  const c10::cuda::CUDAGuard guard(x_spec.device());
  SpectralArgs a;
  a.x = reinterpret_cast<const float2*>(x_spec.data_ptr());
  a.w = reinterpret_cast<const float2*>(w_spec.data_ptr());
  a.energy = energy.data_ptr<double>();
  a.batch = g.batch;
  a.ci = g.in_channels;
  a.cig = g.in_group_channels();
  a.cog = g.out_group_channels();
  a.co_tiles = g.groups * ((a.cog + kTileCo - 1) / kTileCo);
  a.kd = g.kernel[0];
  a.dd = g.dilation[0];
  a.Ld = s.L[0];
  a.Lh = s.L[1];
  a.Lwf = s.Lwf;
  a.Lw = s.L[2];
  a.fh0 = fh0;
  a.fd_lanes = spectral_fd_lanes(a.Ld);
  a.inv_size = 1.0 / static_cast<double>(s.L[0] * s.L[1] * s.L[2]);
  const SmemLayout lay(a.fd_lanes, a.kd, a.Ld);
  const int64_t blocks = count * s.Lwf * a.co_tiles;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: problem too large for the FFT path (",
              to_str(blocks), " blocks)");
  C10_CUDA_CHECK(cudaFuncSetAttribute(spectral_energy_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(lay.bytes)));
  spectral_energy_kernel<<<static_cast<unsigned>(blocks),
                           static_cast<unsigned>(a.fd_lanes * kLaneThreads), lay.bytes,
                           at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t small_spectral_energy_smem_bytes(const ConvGeometry& g, const SpectrumGeometry& s) {
  SmallArgs a;
  return small_plan(g, s, sm_count(), a) ? SmallLayout(a).bytes : 0;
}

void small_spectral_energy_cuda(const at::Tensor& x_spec, const at::Tensor& weight,
                                const ConvGeometry& g, const SpectrumGeometry& s,
                                at::Tensor& energy) {
  const c10::cuda::CUDAGuard guard(x_spec.device());
  SmallArgs a;
  TORCH_CHECK(small_plan(g, s, sm_count(), a), "ct_bn_pool: small spectral-energy kernel refused");
  a.x = reinterpret_cast<const float2*>(x_spec.data_ptr());
  a.w = weight.data_ptr<float>();
  a.energy = energy.data_ptr<double>();
  a.vec_taps = a.vec_taps && reinterpret_cast<uintptr_t>(a.w) % 16 == 0;
  const SmallLayout lay(a);
  const int64_t blocks = s.pairs() * a.co_tiles;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: problem too large for the FFT path (",
              to_str(blocks), " blocks)");
  allow_dynamic_smem(small_spectral_energy_kernel, lay.bytes);
  small_spectral_energy_kernel<<<static_cast<unsigned>(blocks), static_cast<unsigned>(a.threads()),
                                 lay.bytes, at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fused_ops
