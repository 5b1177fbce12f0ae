// The cross-spectrum path's last lag step (docs/math.md §3.5): R^ on the grid M from
// the D stage's output Z^, R^(g, g_w) = P + P^H with
// P = sum_{m_w} phases[g_w, m_w] (Z^(g, m_w) + conj(Z^(-g, m_w))),
// written as complex values, each once (the contraction forms the real matrix it multiplies,
// §3.5: the real blocks written here before moved 53 MB on the seed problem, each value
// four times, and read back by the contraction as much). It replaces R' as a tensor (its
// real part, its mirrored lags), ATen's rfftn of it and the copies around them
// (docs/performance.md). One thread per pair of bins (g, -g) of (g_d, g_h), (group, i, j)
// and chunk of g_w: it reads its entry and the transposed one at g and -g once per m_w and
// writes the chunk's bins at both (a thread per bin read them twice: 35.5 us per seed call
// against 22.4, docs/performance.md, 2026-12-01 14:10 UTC); staging the transposed entries
// through shared memory, in 32 x 32 tiles, made it slower (47 and 49 us per seed call
// against 41, 2026-11-30).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/kernels.h"
#include "cuda/pdl.cuh"
#include "cuda/spectrum_common.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 128;  // 5 blocks per SM at the 96 registers of two bins' sums
constexpr int kBinChunk = 5;  // g_w bins per thread: k'_w of a kernel of 5 in one chunk

struct BlocksArgs {
  const double2* z;       // [Md, Mh, Mwh, G, Cig, Cig]
  const double2* phases;  // [Mwh (g_w), Mwh (m_w)]
  double2* out;           // [Md, Mh, Mwh, G, Cig, Cig]
  int64_t md, mh, mwh, groups, cig, chunks, pairs;
};

// A thread takes bin g and its mirror -g together: at -g, u and v are the conjugates of g's
// (u = Z^(g) + conj(Z^(-g))), so the same loads give both bins' sums.
__global__ void __launch_bounds__(kThreads, 5) correlation_blocks_kernel(BlocksArgs a) {
  pdl_chain_start();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t entries = a.groups * a.cig * a.cig;
  if (t >= a.pairs * a.chunks * entries) return;
  const int64_t e = t % entries, chunk = t / entries % a.chunks, pair = t / entries / a.chunks;
  // The pair's first bin: (0, g_h) for g_h <= (Mh - 1) / 2, then every g_h of g_d = 1 .. (Md - 1) / 2
  // (Md, Mh odd: only g = 0 is its own mirror).
  const int64_t half_h = (a.mh + 1) / 2;
  const int64_t gd = pair < half_h ? 0 : 1 + (pair - half_h) / a.mh, gh = pair < half_h ? pair : (pair - half_h) % a.mh;
  const int64_t gdh = gd * a.mh + gh;
  const int64_t neg = ((a.md - gd) % a.md) * a.mh + (a.mh - gh) % a.mh;  // -g
  const int64_t group = e / (a.cig * a.cig), i = e / a.cig % a.cig, j = e % a.cig;
  const int64_t ij = (group * a.cig + i) * a.cig + j, ji = (group * a.cig + j) * a.cig + i;
  auto at = [&](int64_t dh, int64_t mw, int64_t entry) { return a.z[(dh * a.mwh + mw) * entries + entry]; };
  const int64_t gw0 = chunk * kBinChunk;
  double2 acc[kBinChunk], mirrored[kBinChunk];  // at g, and at -g before its conjugation
#pragma unroll
  for (int k = 0; k < kBinChunk; ++k) acc[k] = mirrored[k] = double2{0, 0};
  for (int64_t mw = 0; mw < a.mwh; ++mw) {
    // u at (i, j) and conj(u) at (j, i), u = Z^(g) + conj(Z^(-g)).
    const double2 zij = at(gdh, mw, ij), nij = at(neg, mw, ij), zji = at(gdh, mw, ji), nji = at(neg, mw, ji);
    const double2 u{zij.x + nij.x, zij.y - nij.y}, v{zji.x + nji.x, nji.y - zji.y};
#pragma unroll
    for (int k = 0; k < kBinChunk; ++k) {
      const int64_t gw = gw0 + k;
      if (gw >= a.mwh) break;
      const double2 p = a.phases[gw * a.mwh + mw], pc{p.x, -p.y};
      // g: p u + conj(p) v; -g: p conj(u) + conj(p) conj(v) = conj(conj(p) u + p v).
      const double2 pu = cmul(p, u), pv = cmul(pc, v), qu = cmul(pc, u), qv = cmul(p, v);
      acc[k].x += pu.x + pv.x;
      acc[k].y += pu.y + pv.y;
      mirrored[k].x += qu.x + qv.x;
      mirrored[k].y += qu.y + qv.y;
    }
  }
#pragma unroll
  for (int k = 0; k < kBinChunk; ++k) {
    const int64_t gw = gw0 + k;
    if (gw >= a.mwh) break;
    a.out[(gdh * a.mwh + gw) * entries + ij] = acc[k];
    if (neg != gdh) a.out[(neg * a.mwh + gw) * entries + ij] = double2{mirrored[k].x, -mirrored[k].y};
  }
}

}  // namespace

at::Tensor correlation_blocks_cuda(const at::Tensor& z_hat, const at::Tensor& phases) {
  const c10::cuda::CUDAGuard guard(z_hat.device());
  TORCH_CHECK(z_hat.dim() == 6 && z_hat.scalar_type() == at::kComplexDouble && z_hat.is_contiguous() &&
                  z_hat.size(4) == z_hat.size(5) && phases.scalar_type() == at::kComplexDouble &&
                  phases.is_contiguous() && phases.dim() == 2 && phases.size(0) == z_hat.size(2) &&
                  phases.size(1) == z_hat.size(2),
              "ct_bn_pool: correlation_blocks_cuda: inconsistent shapes, dtypes or layouts");
  BlocksArgs a;
  a.md = z_hat.size(0);
  a.mh = z_hat.size(1);
  a.mwh = z_hat.size(2);
  a.groups = z_hat.size(3);
  a.cig = z_hat.size(4);
  TORCH_CHECK(a.md % 2 == 1 && a.mh % 2 == 1,
              "ct_bn_pool: correlation_blocks_cuda: the grid M is 2k' - 1 per dim, odd");
  a.chunks = (a.mwh + kBinChunk - 1) / kBinChunk;
  a.pairs = (a.md * a.mh + 1) / 2;
  auto out = at::empty({a.md, a.mh, a.mwh, a.groups, a.cig, a.cig}, z_hat.options());
  const int64_t threads = a.pairs * a.chunks * a.groups * a.cig * a.cig;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "ct_bn_pool: problem too large for the correlation's blocks (",
              to_str(threads), " entries)");
  a.z = reinterpret_cast<const double2*>(z_hat.data_ptr());
  a.phases = reinterpret_cast<const double2*>(phases.data_ptr());
  a.out = reinterpret_cast<double2*>(out.data_ptr());
  if (threads > 0) {
    launch_overlapping(correlation_blocks_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                       at::cuda::getCurrentCUDAStream(), a);
  }
  return out;
}

}  // namespace fused_ops
