#pragma once
// Pieces shared by the FFT-path kernels: complex arithmetic and DFT twiddles
// (weight_spectrum.cu, spectral_energy*.cu), and the arguments, walk, staging
// copies and final store of the two spectral-energy kernels (the SIMT one,
// spectral_energy.cu, and the tensor-core one, spectral_energy_tc.cu).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/fft_energy.h"

namespace fused_ops {

// acc += a * b
__device__ __forceinline__ void cfma(float2& acc, float2 a, float2 b) {
  acc.x = fmaf(a.x, b.x, fmaf(-a.y, b.y, acc.x));
  acc.y = fmaf(a.x, b.y, fmaf(a.y, b.x, acc.y));
}

// exp(-2 pi i f t / L), reduced exactly in integers first so the float angle is small.
__device__ __forceinline__ float2 twiddle(int64_t f, int64_t t, int64_t L) {
  const int64_t m = (f * t) % L;
  float s, c;
  sincospif(2.0f * static_cast<float>(m) / static_cast<float>(L), &s, &c);
  return make_float2(c, -s);
}

// 8-byte asynchronous copy global -> shared (sm_80+); zero-fills when !valid
// (src must still be a valid address then).
__device__ __forceinline__ void copy_async(float2* dst, const float2* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `Pending` of this thread's newest groups are still in flight.
template <int Pending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// ---- The spectral-energy kernels (docs/math.md §3.3) -----------------------

// Depth frequencies a block handles at a time ("fd lanes"), at most max_lanes
// (each kernel's own bound): as many as fit, balanced over the passes Ld needs.
inline int64_t spectral_fd_lanes(int64_t Ld, int64_t max_lanes) {
  const int64_t passes = (Ld + max_lanes - 1) / max_lanes;
  return (Ld + passes - 1) / passes;
}

// Output channels per block, in both kernels: blocks are (frequency pair, tile of
// kSpectralTileCo channels of one group).
constexpr int kSpectralTileCo = 32;

struct SpectralArgs {
  const float2* x;  // [Ld, Lh, Lwf, B, Ci]
  const float2* w;  // [count, Lwf, Ci, Cog, kD]
  double* energy;   // [Co, Lh * Lwf]
  int64_t batch, ci, cig, cog, co_tiles, kd, dd;
  int64_t Ld, Lh, Lwf, Lw, fh0, fd_lanes;
  double inv_size;  // 1 / (Ld * Lh * Lw)
};

inline SpectralArgs make_spectral_args(const at::Tensor& x_spec, const at::Tensor& w_spec,
                                       const ConvGeometry& g, const SpectrumGeometry& s,
                                       int64_t fh0, at::Tensor& energy, int64_t max_fd_lanes) {
  SpectralArgs a;
  a.x = reinterpret_cast<const float2*>(x_spec.data_ptr());
  a.w = reinterpret_cast<const float2*>(w_spec.data_ptr());
  a.energy = energy.data_ptr<double>();
  a.batch = g.batch;
  a.ci = g.in_channels;
  a.cig = g.in_group_channels();
  a.cog = g.out_group_channels();
  a.co_tiles = g.groups * ((a.cog + kSpectralTileCo - 1) / kSpectralTileCo);
  a.kd = g.kernel[0];
  a.dd = g.dilation[0];
  a.Ld = s.L[0];
  a.Lh = s.L[1];
  a.Lwf = s.Lwf;
  a.Lw = s.L[2];
  a.fh0 = fh0;
  a.fd_lanes = spectral_fd_lanes(a.Ld, max_fd_lanes);
  a.inv_size = 1.0 / static_cast<double>(s.L[0] * s.L[1] * s.L[2]);
  return a;
}

// Which frequency pair, group and channel tile a block owns, and the rfft weight
// of its fw (bins other than 0 and Lw/2 stand for two bins of the full spectrum).
// Indices in 32 bits (each is below a tensor dimension); offsets built from them
// are widened where they are used.
struct SpectralBlock {
  int group, co0, fhc, fh, fw;  // fhc: fh - fh0, the index into W2
  float weight_w;
  __device__ explicit SpectralBlock(const SpectralArgs& a) {
    const int64_t tiles_per_group = (a.cog + kSpectralTileCo - 1) / kSpectralTileCo;
    const int64_t tile = blockIdx.x % a.co_tiles, pair = blockIdx.x / a.co_tiles;
    group = static_cast<int>(tile / tiles_per_group);
    co0 = static_cast<int>(tile % tiles_per_group) * kSpectralTileCo;
    fhc = static_cast<int>(pair / a.Lwf);
    fw = static_cast<int>(pair % a.Lwf);
    fh = static_cast<int>(a.fh0) + fhc;
    weight_w = (fw == 0 || 2 * fw == a.Lw) ? 1.f : 2.f;
  }
  // The DC bin is each sample's sum: it carries the mean, not the spread.
  __device__ bool counts(int64_t fd, const SpectralArgs& a) const {
    return fd < a.Ld && !(fd == 0 && fh == 0 && fw == 0);
  }
};

// Which (fd pass, batch pass, ci chunk) a step of the block's walk is.
struct Step {
  int fd0, b0, c0;
  bool first, last;  // of its (fd pass, batch pass)
};

// The block's walk: ci chunks fastest, then batch passes, then fd passes. In 32
// bits: the step count is far below what an x spectrum that fits in memory gives.
struct SpectralWalk {
  int chunks, b_passes, steps, chunk_ci, tile_b, fd_lanes;
  __device__ SpectralWalk(const SpectralArgs& a, int chunk, int tile)
      : chunks(static_cast<int>((a.cig + chunk - 1) / chunk)),
        b_passes(static_cast<int>((a.batch + tile - 1) / tile)),
        steps(chunks * b_passes * static_cast<int>((a.Ld + a.fd_lanes - 1) / a.fd_lanes)),
        chunk_ci(chunk),
        tile_b(tile),
        fd_lanes(static_cast<int>(a.fd_lanes)) {}
  __device__ Step at(int s) const {
    const int c = s % chunks, b = (s / chunks) % b_passes, f = s / (chunks * b_passes);
    return {f * fd_lanes, b * tile_b, c * chunk_ci, c == 0, c == chunks - 1};
  }
  // st = at(s) -> at(s + 1), without the divisions.
  __device__ void advance(Step& st) const {
    st.c0 += chunk_ci;
    if (st.c0 == chunks * chunk_ci) {
      st.c0 = 0;
      st.b0 += tile_b;
      if (st.b0 == b_passes * tile_b) {
        st.b0 = 0;
        st.fd0 += fd_lanes;
      }
    }
    st.first = st.c0 == 0;
    st.last = st.c0 == (chunks - 1) * chunk_ci;
  }
};

// tw[fd * kD + kd] = exp(-2 pi i fd kd dd / Ld): the depth DFT's twiddles (dd the
// depth dilation), for every fd.
__device__ __forceinline__ void fill_depth_twiddles(const SpectralArgs& a, float2* tw) {
  for (int64_t i = threadIdx.x; i < a.Ld * a.kd; i += blockDim.x) {
    tw[i] = twiddle(i / a.kd, (i % a.kd) * a.dd, a.Ld);
  }
}

// energy[co, fh * Lwf + fw] = (sum over r < rows of esum[r][c]) / L for the
// block's channels c (esum rows of kSpectralTileCo doubles, summed in a fixed
// order). The block may have fewer than kSpectralTileCo threads.
__device__ __forceinline__ void store_tile_energy(const SpectralArgs& a, const SpectralBlock& blk,
                                                  const double* esum, int64_t rows) {
  for (int c = threadIdx.x; c < kSpectralTileCo && blk.co0 + c < a.cog; c += blockDim.x) {
    double total = 0;
    for (int64_t r = 0; r < rows; ++r) total += esum[r * kSpectralTileCo + c];
    const int64_t co = blk.group * a.cog + blk.co0 + c;
    a.energy[co * (a.Lh * a.Lwf) + blk.fh * a.Lwf + blk.fw] = total * a.inv_size;
  }
}

}  // namespace fused_ops
