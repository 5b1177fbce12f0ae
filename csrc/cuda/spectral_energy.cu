// The FFT path's core (docs/math.md §3.3): for each frequency f, the complex
// product Y_f = X_f W_f of a [B, Ci] and a [Ci, Co] matrix, reduced at once to
// sum_b |Y_f[b, co]|^2; neither W_f nor Y_f is ever stored. A block owns one
// (fh, fw) pair and a tile of kTileCo output channels and walks every fd:
// W_f for all its fd comes from the same W2[kd] (the weight's spectrum over H
// and W, weight_spectrum.cu) by a kD-tap DFT, done in shared memory for a chunk
// of kChunkCi input channels at a time, while the next chunk is copied in
// (cp.async, double-buffered). Each thread accumulates an 8 x 4 tile of Y
// (samples x channels) for one fd in registers.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cuda/fft_energy.h"
#include "cuda/spectrum_common.cuh"
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

// 8-byte asynchronous copy global -> shared (sm_80+); zero-fills when !valid.
__device__ __forceinline__ void copy_async(float2* dst, const float2* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void copy_async_wait_one() {  // all but the newest group done
  asm volatile("cp.async.wait_group 1;\n" ::);
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
    copy_async_wait_one();
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
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 p = xrow[k * (kTileB / 2) + i];
        xv[2 * i] = make_float2(p.x, p.y);
        xv[2 * i + 1] = make_float2(p.z, p.w);
      }
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

}  // namespace fused_ops
