// The tensor-core version of spectral_energy.cu: the same inputs, outputs and
// walk (docs/math.md §3.3), with the products Y_f = X_f W_f done by
// mma.sync.m16n8k8 on TF32 in the 3xTF32 split, which keeps float32 accuracy.
//
// The complex product as a real one. A chunk of 4 input channels i is one
// k-step of 8: k = i holds Re X[., i], k = 4 + i holds Im X[., i]. The 32
// output channels j of a block's tile are 4 pairs of n-tiles of 8 channels: an
// "Re tile" whose columns are Re Y and an "Im tile" whose columns are Im Y of
// the same 8 channels:
//   Re tile: A = [Re X, -Im X], B = [Re W; Im W]   (Re Y = Re X Re W - Im X Im W)
//   Im tile: A = [Re X,  Im X], B = [Im W; Re W]   (Im Y = Re X Im W + Im X Re W)
// With the m16n8k8 fragments (g = lane / 4, t = lane % 4; PTX ISA "Matrix
// Fragments for mma.m16n8k8", .tf32):
//   A: a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4]
//      -> a0, a2 = X[g][t] and a1, a3 = X[g + 8][t]: two 8-byte loads;
//   B: b0 = B[t][g], b1 = B[t + 4][g]
//      -> both come from W[t][8 p + g]: one 16-byte load serves a pair of tiles;
//   C: c0, c1 = C[g][2t, 2t + 1], c2, c3 = C[g + 8][2t, 2t + 1]
//      -> the same thread holds Re Y (Re tile) and Im Y (Im tile) of the same
//         (sample, channel), so |Y|^2 needs no exchange between threads.
// The negation sits in A (the Re tile's copy of Im X), where it is shared by
// all four pairs, so B needs no sign flips and no selects.
//
// The block: one (fh, fw) pair and a tile of 32 output channels, one warp per fd
// lane (16 samples x 32 channels of Y_f in 32 accumulators per thread). A step
// is a chunk of 4 input channels; the depth DFT W_f = sum_kd W2[kd] tw[fd][kd]
// is done cooperatively by all threads into shared memory, already split into
// TF32 hi and lo parts, one step ahead of the multiplication: in an iteration
// each warp does both the DFT of the next chunk and the MMAs of the current
// one, odd warps in the opposite order, so the FMA pipes (DFT) and the tensor
// cores (MMA) are busy at the same time.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "cuda/fft_energy.h"
#include "cuda/spectrum_common.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kTileCo = kSpectralTileCo;  // output channels per block
constexpr int kTileB = 16;                // samples per batch pass: the MMA's M
constexpr int kChunkCi = 4;               // input channels per step: the MMA's K is 2 * kChunkCi
constexpr int kPairs = kTileCo / 8;       // (Re, Im) n-tile pairs per warp
constexpr int kWarp = 32;
// One warp per fd lane. 20 lanes (640 threads) leave 96 registers a thread, which
// the 32 accumulators, the fragments and the DFT's chains need without spilling
// (24 lanes, as in the SIMT kernel, cap it at 80 and spill); Ld of 21 to 24
// takes two passes.
constexpr int kMaxFdLanes = 20;
// ws rows (one per input channel of the chunk) in 16-byte units: a quarter-warp
// reads 2 consecutive channels of 4 rows, and a row stride of 2 (mod 8) units
// puts those 8 loads on distinct banks.
constexpr int kWsRow = kTileCo + 2;
constexpr int kGenLanes = 4;  // fd lanes per depth-DFT unit (one W2 load serves all four)

// Shared memory, every buffer doubled: in an iteration, the DFT reads one W2
// buffer and writes one ws buffer while the MMAs read the other ws buffer and
// one x buffer, and the copies for the next iteration fill the remaining W2 and
// x buffers.
struct TcSmemLayout {
  int64_t tw, w2, xs, ws, esum, bytes;  // offsets in bytes
  int64_t w2_len, xs_len, ws_len;       // elements per buffer (float2, float2, uint4)
  int kd_stride;                        // float2 per W2 (ci, co) row: kD, made odd
  __host__ __device__ static int64_t up16(int64_t v) { return (v + 15) / 16 * 16; }
  __host__ __device__ TcSmemLayout(int64_t fd_lanes, int64_t kd, int64_t Ld) {
    // Odd, so that the DFT's W2 loads (one channel per thread, stride kd_stride) are conflict-free.
    kd_stride = static_cast<int>(kd | 1);
    w2_len = int64_t(kChunkCi) * kTileCo * kd_stride;
    xs_len = fd_lanes * kTileB * kChunkCi;
    ws_len = fd_lanes * kChunkCi * kWsRow;
    tw = 0;
    w2 = up16(tw + Ld * kd * sizeof(float2));
    xs = up16(w2 + 2 * w2_len * sizeof(float2));
    ws = up16(xs + 2 * xs_len * sizeof(float2));
    esum = ws + 2 * ws_len * sizeof(uint4);  // 16-byte aligned: ws_len counts uint4
    bytes = esum + fd_lanes * kTileCo * sizeof(double);
  }
};

// ---- TF32 ----------------------------------------------------------------

__device__ __forceinline__ uint32_t to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return r;
}

// v = hi + lo + O(2^-22 |v|), both TF32 (as .b32 bit patterns). The PTX ISA
// calls tf32's register layout implementation-defined; in practice it is the
// float's bit pattern, of which the mma reads the top 19 bits. hi's low 13 bits
// are cleared so that, read as a float, it is exactly the rounded value whose
// remainder lo is (v - hi is then exact), whatever cvt leaves in them.
struct Tf32Pair {
  uint32_t hi, lo;
};
__device__ __forceinline__ Tf32Pair split_tf32(float v) {
  const uint32_t hi = to_tf32(v) & 0xffffe000u;
  return {hi, to_tf32(v - __uint_as_float(hi))};
}

constexpr uint32_t kSignBit = 0x80000000u;

// c += A B for one m16n8k8 tile (TF32 inputs, float32 accumulators).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 3xTF32: c += a_lo b_hi + a_hi b_lo + a_hi b_hi, the small terms first. What
// is dropped (a_lo b_lo, and the rounding of the lo parts) is at most about
// 2^-21 |a b| per product, near float32's own rounding.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const uint32_t (&a_hi)[4],
                                           const uint32_t (&a_lo)[4], Tf32Pair b0, Tf32Pair b1) {
  mma_tf32(c, a_lo, b0.hi, b1.hi);
  mma_tf32(c, a_hi, b0.lo, b1.lo);
  mma_tf32(c, a_hi, b0.hi, b1.hi);
}

// ---- Staging -------------------------------------------------------------

struct BlockSources {
  const float2* x_pair;  // x at (fd = 0, fh, fw)
  const float2* w_pair;  // W2 at (fh - fh0, fw)
  int64_t fd_stride;     // between consecutive fd of x
};

// x chunk of a step: xs[lane][b][i] = X[fd0 + lane][b0 + b][c0 + i] (zero outside
// the problem), each lane's [16 x 4] block contiguous for the A-fragment loads.
__device__ __forceinline__ void stage_x(const SpectralArgs& a, const SpectralBlock& blk,
                                        const BlockSources& src, const Step& st, float2* xs) {
  const int count = static_cast<int>(a.fd_lanes) * kTileB * kChunkCi;
  for (int n = threadIdx.x; n < count; n += blockDim.x) {
    const int i = n % kChunkCi, b = (n / kChunkCi) % kTileB, l = n / (kChunkCi * kTileB);
    const int64_t fd = st.fd0 + l, ci = st.c0 + i, bb = st.b0 + b;
    const bool ok = fd < a.Ld && bb < a.batch && ci < a.cig;
    copy_async(xs + n,
               ok ? src.x_pair + fd * src.fd_stride + bb * a.ci + blk.group * a.cig + ci : a.x, ok);
  }
}

// W2 chunk of a step: w2s[i][co][kd] (rows padded to kd_stride), copied in the
// global order (kd fastest), zero outside the problem.
__device__ __forceinline__ void stage_w2(const SpectralArgs& a, const SpectralBlock& blk,
                                         const BlockSources& src, const Step& st, int kd_stride,
                                         float2* w2s) {
  const int kd_count = static_cast<int>(a.kd);
  for (int n = threadIdx.x; n < kChunkCi * kTileCo * kd_count; n += blockDim.x) {
    const int kd = n % kd_count, row = n / kd_count;  // row = i * kTileCo + co
    const int i = row / kTileCo, co = row % kTileCo;
    const bool ok = st.c0 + i < a.cig && blk.co0 + co < a.cog;
    const int64_t w_row = (blk.group * a.cig + st.c0 + i) * a.cog + blk.co0 + co;
    copy_async(w2s + row * kd_stride + kd, ok ? src.w_pair + w_row * a.kd + kd : a.w, ok);
  }
}

// ---- Depth DFT -----------------------------------------------------------

// ws[lane][i][j] = W_f[i][j] for f = (fd0 + lane, fh, fw), as {Re hi, Re lo,
// Im hi, Im lo} in TF32. A unit is one (i, j) for kGenLanes fd lanes: W2 is read
// once per unit, and the lanes' sums are independent chains. A warp's units
// share their lanes, so the twiddle loads are broadcasts.
__device__ __forceinline__ void depth_dft(const SpectralArgs& a, int fd0, int kd_stride,
                                          const float2* w2s, const float2* tw, uint4* ws) {
  constexpr int kCells = kChunkCi * kTileCo;
  const int lanes = static_cast<int>(a.fd_lanes), kd_count = static_cast<int>(a.kd);
  const int last_fd = static_cast<int>(a.Ld) - 1;
  const int units = kCells * ((lanes + kGenLanes - 1) / kGenLanes);
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const int cell = u % kCells, l0 = (u / kCells) * kGenLanes;
    float2 acc[kGenLanes];
    int tw_row[kGenLanes];
#pragma unroll
    for (int q = 0; q < kGenLanes; ++q) {
      acc[q] = make_float2(0.f, 0.f);
      // Lanes past Ld (the last pass) compute something finite that no one counts.
      tw_row[q] = min(fd0 + l0 + q, last_fd) * kd_count;
    }
    const float2* w = w2s + cell * kd_stride;
    for (int kd = 0; kd < kd_count; ++kd) {
      const float2 wv = w[kd];
#pragma unroll
      for (int q = 0; q < kGenLanes; ++q) cfma(acc[q], wv, tw[tw_row[q] + kd]);
    }
    const int i = cell / kTileCo, j = cell % kTileCo;
#pragma unroll
    for (int q = 0; q < kGenLanes; ++q) {
      if (l0 + q < lanes) {
        const Tf32Pair re = split_tf32(acc[q].x), im = split_tf32(acc[q].y);
        ws[((l0 + q) * kChunkCi + i) * kWsRow + j] = make_uint4(re.hi, re.lo, im.hi, im.lo);
      }
    }
  }
}

// ---- Products and energy -------------------------------------------------

// acc += X W for this warp's fd lane and one chunk (one k-step, all 4 pairs).
__device__ __forceinline__ void multiply_chunk(const float2* xs_lane, const uint4* ws_lane, int g,
                                               int t, float (&acc)[2 * kPairs][4]) {
  const float2 x_top = xs_lane[g * kChunkCi + t];          // X[g][t]
  const float2 x_bottom = xs_lane[(g + 8) * kChunkCi + t];  // X[g + 8][t]
  const float a_val[4] = {x_top.x, x_bottom.x, x_top.y, x_bottom.y};
  uint32_t plus_hi[4], plus_lo[4];  // A = [Re X, Im X], the Im tiles' A
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const Tf32Pair s = split_tf32(a_val[r]);
    plus_hi[r] = s.hi;
    plus_lo[r] = s.lo;
  }
  // A = [Re X, -Im X], the Re tiles' A: a2, a3 hold Im X.
  const uint32_t minus_hi[4] = {plus_hi[0], plus_hi[1], plus_hi[2] ^ kSignBit,
                                plus_hi[3] ^ kSignBit};
  const uint32_t minus_lo[4] = {plus_lo[0], plus_lo[1], plus_lo[2] ^ kSignBit,
                                plus_lo[3] ^ kSignBit};
  const uint4* w_row = ws_lane + t * kWsRow + g;  // W[t][8 p + g]
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const uint4 w = w_row[8 * p];
    const Tf32Pair w_re = {w.x, w.y}, w_im = {w.z, w.w};
    mma_3xtf32(acc[2 * p], minus_hi, minus_lo, w_re, w_im);    // Re tile: B = [Re W; Im W]
    mma_3xtf32(acc[2 * p + 1], plus_hi, plus_lo, w_im, w_re);  // Im tile: B = [Im W; Re W]
  }
}

// sum_b |Y[b][j]|^2 over this warp's 16 samples for one channel j per lane, at
// the end of a frequency. The thread holds, per pair p, channels 8p + 2t + h
// (h = 0, 1) for samples g and g + 8; the 8 lanes with the same t hold the same
// 8 channels. A reduce-scatter over them (lane bits 4, 3, 2 = bits 2, 1, 0 of g)
// leaves lane (g, t) value index g, channel energy_channel(g, t). The sums are
// pairwise trees of 32 squares in float (no worse than the SIMT kernel's
// running sums of 16), made double by the caller.
__device__ __forceinline__ float frequency_energy(const float (&acc)[2 * kPairs][4], int lane) {
  float v[2 * kPairs];
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const float* re = acc[2 * p];
    const float* im = acc[2 * p + 1];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      v[2 * p + h] =
          (re[h] * re[h] + im[h] * im[h]) + (re[h + 2] * re[h + 2] + im[h + 2] * im[h + 2]);
    }
  }
#pragma unroll
  for (int half = kPairs; half >= 1; half /= 2) {  // 4, 2, 1 values exchanged
    const int mask = 4 * half;                     // lane bits 4, 3, 2
    const bool upper = (lane & mask) != 0;
#pragma unroll
    for (int m = 0; m < half; ++m) {
      const float send = upper ? v[m] : v[m + half];
      const float keep = upper ? v[m + half] : v[m];
      v[m] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
    }
  }
  return v[0];
}

// The channel (of the tile) whose energy frequency_energy leaves to lane (g, t):
// value index g = 2 p + h.
__device__ __forceinline__ int energy_channel(int g, int t) { return 8 * (g / 2) + 2 * t + g % 2; }

__global__ void __launch_bounds__(kMaxFdLanes * kWarp, 1)
    spectral_energy_tc_kernel(const SpectralArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const TcSmemLayout lay(a.fd_lanes, a.kd, a.Ld);
  // Buffer lengths in 32 bits for shared-memory indexing (the layout is int64 for the host).
  const int w2_len = static_cast<int>(lay.w2_len), xs_len = static_cast<int>(lay.xs_len),
            ws_len = static_cast<int>(lay.ws_len);
  float2* tw = reinterpret_cast<float2*>(smem + lay.tw);   // [fd][kd]
  float2* w2s = reinterpret_cast<float2*>(smem + lay.w2);  // 2 x [ci][co][kd_stride]
  float2* xs = reinterpret_cast<float2*>(smem + lay.xs);   // 2 x [fd lane][b][ci]
  uint4* ws = reinterpret_cast<uint4*>(smem + lay.ws);     // 2 x [fd lane][ci][kWsRow]
  // [fd lane][co]: lane (g, t) of each warp owns channel energy_channel(g, t), kept
  // here rather than in registers, which the loop needs more.
  double* esum = reinterpret_cast<double*>(smem + lay.esum);

  const SpectralBlock blk(a);
  const BlockSources src = {a.x + (blk.fh * a.Lwf + blk.fw) * a.batch * a.ci,
                            a.w + (blk.fhc * a.Lwf + blk.fw) * a.ci * a.cog * a.kd,
                            a.Lh * a.Lwf * a.batch * a.ci};
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int g = lane / 4, t = lane % 4;
  double* energy_slot = esum + warp * kTileCo + energy_channel(g, t);
  *energy_slot = 0;

  fill_depth_twiddles(a, tw);
  const SpectralWalk walk(a, kChunkCi, kTileB);
  // Iteration `it` does the DFT of step it (it < steps) and the MMAs of step
  // it - 1 (it >= 1); what it needs, W2 of step it and x of step it - 1, was
  // copied during iteration it - 1.
  Step cur = walk.at(0);  // step it
  stage_w2(a, blk, src, cur, lay.kd_stride, w2s);
  copy_async_commit();
  Step prev = cur;  // step it - 1 (for it >= 1)

  float acc[2 * kPairs][4];
#pragma unroll
  for (int n = 0; n < 2 * kPairs; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[n][r] = 0.f;
  for (int it = 0; it <= walk.steps; ++it) {
    copy_async_wait<0>();
    // This iteration's copies have landed for every thread, and the last
    // iteration's reads are done: its W2 and x buffers may be refilled.
    __syncthreads();
    Step next = cur;
    walk.advance(next);
    if (it + 1 < walk.steps) {
      stage_w2(a, blk, src, next, lay.kd_stride, w2s + ((it + 1) & 1) * w2_len);
    }
    if (it < walk.steps) stage_x(a, blk, src, cur, xs + (it & 1) * xs_len);
    copy_async_commit();

#pragma unroll 1
    for (int phase = 0; phase < 2; ++phase) {
      if (phase == (warp & 1)) {
        if (it == 0) continue;
        const int buf = (it - 1) & 1;
        __syncwarp();  // mma.sync and the shuffles need the whole warp, converged
        multiply_chunk(xs + buf * xs_len + warp * (kTileB * kChunkCi),
                       ws + buf * ws_len + warp * (kChunkCi * kWsRow), g, t, acc);
        if (prev.last) {  // the next step, if any, starts a new frequency
          if (blk.counts(prev.fd0 + warp, a)) {
            *energy_slot += static_cast<double>(blk.weight_w * frequency_energy(acc, lane));
          }
#pragma unroll
          for (int n = 0; n < 2 * kPairs; ++n)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[n][r] = 0.f;
        }
      } else if (it < walk.steps) {
        depth_dft(a, cur.fd0, lay.kd_stride, w2s + (it & 1) * w2_len, tw, ws + (it & 1) * ws_len);
      }
    }
    prev = cur;
    cur = next;
  }
  __syncthreads();
  store_tile_energy(a, blk, esum, a.fd_lanes);
}

}  // namespace

int64_t spectral_energy_tc_smem_bytes(const ConvGeometry& g) {
  return TcSmemLayout(spectral_fd_lanes(g.out_size[0], kMaxFdLanes), g.kernel[0], g.out_size[0])
      .bytes;
}

void spectral_energy_tc_cuda(const at::Tensor& x_spec, const at::Tensor& w_spec,
                             const ConvGeometry& g, const SpectrumGeometry& s, int64_t fh0,
                             int64_t count, at::Tensor& energy) {
  const c10::cuda::CUDAGuard guard(x_spec.device());
  const SpectralArgs a = make_spectral_args(x_spec, w_spec, g, s, fh0, energy, kMaxFdLanes);
  const TcSmemLayout lay(a.fd_lanes, a.kd, a.Ld);
  const int64_t blocks = count * s.Lwf * a.co_tiles;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: problem too large for the FFT path (",
              to_str(blocks), " blocks)");
  C10_CUDA_CHECK(cudaFuncSetAttribute(spectral_energy_tc_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(lay.bytes)));
  spectral_energy_tc_kernel<<<static_cast<unsigned>(blocks),
                              static_cast<unsigned>(a.fd_lanes * kWarp), lay.bytes,
                              at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fused_ops
