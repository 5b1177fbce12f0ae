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

constexpr int kTileCo = kSpectralTileCo;  // output channels per block
constexpr int kChunkCi = 8;   // input channels staged at a time
constexpr int kTileB = 16;    // samples per pass (two halves of 8 per fd lane)
constexpr int kLaneThreads = (kTileB / 8) * (kTileCo / 4);  // threads per fd lane: 16
constexpr int kMaxFdLanes = 24;

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

  const SpectralBlock blk(a);
  const int64_t group = blk.group, co0 = blk.co0;
  const int tid = threadIdx.x, lane_fd = tid / kLaneThreads, t = tid % kLaneThreads;
  const int half = t / (kTileCo / 4), quad = t % (kTileCo / 4);
  const float2* x_pair = a.x + (blk.fh * a.Lwf + blk.fw) * a.batch * a.ci;
  const float2* w_pair = a.w + (blk.fhc * a.Lwf + blk.fw) * a.ci * a.cog * a.kd;

  fill_depth_twiddles(a, tw);
  const SpectralWalk walk(a, kChunkCi, kTileB);
  const int steps = walk.steps;
  stage_async(a, walk.at(0), x_pair, w_pair, group, co0, xs, w2s);

  double e[4] = {0, 0, 0, 0};
  float2 acc[8][4];
  for (int s = 0; s < steps; ++s) {
    const Step st = walk.at(s);
    const int buf = s & 1;
    if (s + 1 < steps) {  // the other buffer was released by the barrier ending step s - 1
      stage_async(a, walk.at(s + 1), x_pair, w_pair, group, co0,
                  xs + (buf ^ 1) * lay.xs_len, w2s + (buf ^ 1) * lay.w2_len);
    } else {
      copy_async_commit();  // an empty group keeps the wait below uniform
    }
    copy_async_wait<1>();  // all but the newest group done
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
    if (st.last && blk.counts(st.fd0 + lane_fd, a)) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float sq = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) sq += acc[i][j].x * acc[i][j].x + acc[i][j].y * acc[i][j].y;
        e[j] += static_cast<double>(blk.weight_w * sq);
      }
    }
    __syncthreads();  // xs[buf], w2s[buf] and ws are free for the next steps
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) esum[(lane_fd * 2 + half) * kTileCo + quad * 4 + j] = e[j];
  __syncthreads();
  store_tile_energy(a, blk, esum, 2 * a.fd_lanes);
}

}  // namespace

int64_t spectral_energy_smem_bytes(const ConvGeometry& g) {
  return SmemLayout(spectral_fd_lanes(g.out_size[0], kMaxFdLanes), g.kernel[0], g.out_size[0])
      .bytes;
}

void spectral_energy_cuda(const at::Tensor& x_spec, const at::Tensor& w_spec,
                          const ConvGeometry& g, const SpectrumGeometry& s, int64_t fh0,
                          int64_t count, at::Tensor& energy) {
  const c10::cuda::CUDAGuard guard(x_spec.device());
  const SpectralArgs a = make_spectral_args(x_spec, w_spec, g, s, fh0, energy, kMaxFdLanes);
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
