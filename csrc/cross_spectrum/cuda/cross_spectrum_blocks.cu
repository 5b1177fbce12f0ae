// The cross-spectrum path's last lag step (docs/math.md §3.5): R^ on the grid M from
// the D stage's output Z^ (at the bins g = (g_d, g_w) and the lags m_h >= 0),
// R^(g_d, g_h, g_w) = P + P^H with P = sum_{m_h} phases[g_h, m_h] (Z^(g, m_h) + conj(Z^(-g, m_h))),
// for the bins g_w <= (Mw - 1) / 2 the contraction takes, written as complex values, each once
// (the contraction forms the real matrix it multiplies, §3.5: written here, the real blocks
// would move 53 MB on the seed problem, each value four times, and the contraction would read
// as much back). It replaces R' as a tensor (its real part, its mirrored lags), ATen's
// rfftn of it and the copies around them (docs/performance.md). One thread per (g_d, g_w) and
// (group, i, j): it reads its entry and the transposed one at g and -g once per m_h, and
// every g_h takes its sum from those loads. A thread takes one bin, not g and -g together:
// with g = (g_d, g_w), -g has g_w past the half the contraction keeps. A thread per (i <= j),
// writing (j, i) as the conjugate, is no faster (docs/performance.md).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cross_spectrum/cuda/cross_spectrum_kernels.h"
#include "common/cuda/pdl.cuh"
#include "common/cuda/complex.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 128;
constexpr int kLagChunk = 5;  // lags m_h whose loads are in flight together: k'_h of a kernel of 5

struct BlocksArgs {
  const double2* z;       // [Md, Mw, L, G, Cig, Cig], L the lags m_h >= 0
  const double2* phases;  // [Mh (g_h), L (m_h)]
  double2* out;           // [Md, Mh, Mwh, G, Cig, Cig]
  int64_t md, mw, lags, mh, mwh, entries, cig;
};

// The loads of a chunk of lags are issued together, then each g_h's sum is formed from them
// and written (added, past the first chunk) before the next: no sums held across bins.
__global__ void __launch_bounds__(kThreads) correlation_blocks_kernel(BlocksArgs a) {
  pdl_chain_start();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= a.md * a.mwh * a.entries) return;
  const int64_t e = t % a.entries, bin = t / a.entries;
  const int64_t gd = bin / a.mwh, gw = bin % a.mwh;
  const int64_t gdw = gd * a.mw + gw, neg = ((a.md - gd) % a.md) * a.mw + (a.mw - gw) % a.mw;  // g, -g
  const int64_t cig2 = a.cig * a.cig, group = e / cig2, i = e / a.cig % a.cig, j = e % a.cig;
  const int64_t ij = e, ji = group * cig2 + j * a.cig + i;
  auto at = [&](int64_t dw, int64_t m, int64_t entry) { return __ldg(a.z + (dw * a.lags + m) * a.entries + entry); };
  double2* out = a.out + (gd * a.mh * a.mwh + gw) * a.entries + ij;  // at g_h = 0
  const int64_t out_step = a.mwh * a.entries;                        // from one g_h to the next
  for (int64_t m0 = 0; m0 < a.lags; m0 += kLagChunk) {
    // u at (i, j) and v = conj(u) at (j, i), u = Z^(g) + conj(Z^(-g)); 0 past the lags.
    double2 u[kLagChunk], v[kLagChunk];
#pragma unroll
    for (int k = 0; k < kLagChunk; ++k) {
      const int64_t m = m0 + k;
      const bool in = m < a.lags;
      const double2 zij = in ? at(gdw, m, ij) : double2{0, 0}, nij = in ? at(neg, m, ij) : double2{0, 0};
      const double2 zji = in ? at(gdw, m, ji) : double2{0, 0}, nji = in ? at(neg, m, ji) : double2{0, 0};
      u[k] = double2{zij.x + nij.x, zij.y - nij.y};
      v[k] = double2{zji.x + nji.x, nji.y - zji.y};
    }
    for (int64_t gh = 0; gh < a.mh; ++gh) {
      double2 sum = m0 == 0 ? double2{0, 0} : out[gh * out_step];
#pragma unroll
      for (int k = 0; k < kLagChunk; ++k) {
        if (m0 + k >= a.lags) break;
        const double2 p = __ldg(a.phases + gh * a.lags + m0 + k), pc{p.x, -p.y};
        const double2 pu = cmul(p, u[k]), pv = cmul(pc, v[k]);  // P's term and P^H's
        sum.x += pu.x + pv.x;
        sum.y += pu.y + pv.y;
      }
      out[gh * out_step] = sum;
    }
  }
}

}  // namespace

at::Tensor correlation_blocks_cuda(const at::Tensor& z_hat, const at::Tensor& phases) {
  const c10::cuda::CUDAGuard guard(z_hat.device());
  TORCH_CHECK(z_hat.dim() == 6 && z_hat.scalar_type() == at::kComplexDouble && z_hat.is_contiguous() &&
                  z_hat.size(4) == z_hat.size(5) && phases.scalar_type() == at::kComplexDouble &&
                  phases.is_contiguous() && phases.dim() == 2 && phases.size(1) == z_hat.size(2),
              "ct_bn_pool: correlation_blocks_cuda: inconsistent shapes, dtypes or layouts");
  BlocksArgs a;
  a.md = z_hat.size(0);
  a.mw = z_hat.size(1);
  a.lags = z_hat.size(2);
  a.mh = phases.size(0);
  a.cig = z_hat.size(4);
  a.entries = z_hat.size(3) * a.cig * a.cig;
  TORCH_CHECK(a.md % 2 == 1 && a.mw % 2 == 1,
              "ct_bn_pool: correlation_blocks_cuda: the grid M is 2k' - 1 per dim, odd");
  a.mwh = (a.mw + 1) / 2;
  auto out = at::empty({a.md, a.mh, a.mwh, z_hat.size(3), a.cig, a.cig}, z_hat.options());
  const int64_t threads = a.md * a.mwh * a.entries;
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
