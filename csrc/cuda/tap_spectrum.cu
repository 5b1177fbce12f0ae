// The sub-kernels' spectra on the grid M of the cross-spectrum path's contraction
// (docs/math.md §3.5): W(b) = sum_k E_d[b_d, k_d] E_h[b_h, k_h] E_w[b_w, k_w] taps[k], one
// dim at a time. Why: as one float64 GEMM with the product of the three tables it was
// k'd k'h k'w multiply-adds per bin and column (seed: 830M, 58 us per call on the H200,
// docs/performance.md); per dim it is about a fifth of that. A thread takes one column and
// one depth bin b_d <= M_d / 2: its sums over k_d for every (k_h, k_w) in shared memory (its
// own slice: no other thread reads it), then per b_h the k'w values over k_h in registers,
// and per b_w two outputs: W(b) and, the taps being real, W(-b_d, -b_h, b_w), the sum over
// k_w of E_w times the conjugate of those values (the same four real sums of products).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/kernels.h"
#include "cuda/spectrum_common.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 64;
constexpr int kMaxKw = 8;  // the kernel's instantiations: k'w of 1 to 8 (a row in registers)

struct TapArgs {
  const double* taps;    // [kd, kh, kw, cols]
  const double2* dft_d;  // [md, kd], md = 2 kd - 1
  const double2* dft_h;  // [mh, kh]
  const double2* dft_w;  // [bw, kw]
  double* out;           // [md, mh, bw, G, 2, cols / G]
  int64_t cols, group_cols, groups;
  int kd, kh, md, mh, bw;
};

// Shared memory of a block: its threads' planes, then the depth bin's row of dft_d and
// all of dft_h and dft_w.
int64_t smem_bytes(int64_t kd, int64_t kh, int64_t kw, int64_t mh, int64_t bw) {
  return static_cast<int64_t>(sizeof(double2)) * (kh * kw * kThreads + kd + mh * kh + bw * kw);
}

// sum_k e[k] v[k] over the depth taps of one (k_h, k_w), their loads issued together: one
// load at a time, the first version of this kernel took 135 us per seed call.
__device__ __forceinline__ double2 depth_sum(const double* taps, int64_t k_stride, int kd, const double2* e) {
  constexpr int kBatch = 8;
  double2 s{0, 0};
  for (int k0 = 0; k0 < kd; k0 += kBatch) {
    double v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v[k] = k0 + k < kd ? taps[(k0 + k) * k_stride] : 0.0;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (k0 + k >= kd) break;
      s.x = fma(e[k0 + k].x, v[k], s.x);
      s.y = fma(e[k0 + k].y, v[k], s.y);
    }
  }
  return s;
}

__device__ __forceinline__ void store_bin(const TapArgs& a, int64_t bin, int64_t group, int64_t group_col, double re,
                                          double im) {
  double* out = a.out + (bin * a.groups + group) * 2 * a.group_cols + group_col;
  out[0] = re;
  out[a.group_cols] = im;
}

template <int kKw>
__global__ void __launch_bounds__(kThreads) tap_spectrum_kernel(TapArgs a) {
  extern __shared__ double2 smem[];
  const int kh = a.kh, plane_taps = kh * kKw, bd = blockIdx.y;
  double2* plane = smem;                         // [(k_h, k_w)][thread]
  double2* e_d = plane + plane_taps * kThreads;  // [kd]
  double2* e_h = e_d + a.kd;                     // [mh, kh]
  double2* e_w = e_h + a.mh * kh;                // [bw, kKw]
  for (int i = threadIdx.x; i < a.kd; i += kThreads) e_d[i] = a.dft_d[bd * a.kd + i];
  for (int i = threadIdx.x; i < a.mh * kh; i += kThreads) e_h[i] = a.dft_h[i];
  for (int i = threadIdx.x; i < a.bw * kKw; i += kThreads) e_w[i] = a.dft_w[i];
  __syncthreads();
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= a.cols) return;
  const int64_t k_stride = plane_taps * a.cols;
#pragma unroll 4
  for (int t = 0; t < plane_taps; ++t) {
    plane[t * kThreads + threadIdx.x] = depth_sum(a.taps + t * a.cols + col, k_stride, a.kd, e_d);
  }
  const int64_t group = col / a.group_cols, group_col = col % a.group_cols;
  for (int bh = 0; bh < a.mh; ++bh) {
    double2 row[kKw];
#pragma unroll
    for (int w = 0; w < kKw; ++w) row[w] = double2{0, 0};
    for (int h = 0; h < kh; ++h) {
      const double2 e = e_h[bh * kh + h];
      const double2* p = plane + h * kKw * kThreads + threadIdx.x;
#pragma unroll
      for (int w = 0; w < kKw; ++w) add_product(row[w], p[w * kThreads], e);
    }
    const int64_t bin = (static_cast<int64_t>(bd) * a.mh + bh) * a.bw;
    const int64_t mirror = (static_cast<int64_t>(a.md - bd) * a.mh + (a.mh - bh) % a.mh) * a.bw;
    for (int bw = 0; bw < a.bw; ++bw) {
      double rr = 0, ii = 0, ri = 0, ir = 0;  // sums of Re e Re row, Im e Im row, Re e Im row, Im e Re row
#pragma unroll
      for (int w = 0; w < kKw; ++w) {
        const double2 e = e_w[bw * kKw + w];
        rr = fma(e.x, row[w].x, rr);
        ii = fma(e.y, row[w].y, ii);
        ri = fma(e.x, row[w].y, ri);
        ir = fma(e.y, row[w].x, ir);
      }
      store_bin(a, bin + bw, group, group_col, rr - ii, ri + ir);                 // e row
      if (bd != 0) store_bin(a, mirror + bw, group, group_col, rr + ii, ir - ri);  // e conj(row)
    }
  }
}

template <int kKw>
void launch(const TapArgs& a, dim3 grid, int64_t smem, cudaStream_t stream) {
  tap_spectrum_kernel<kKw><<<grid, kThreads, static_cast<size_t>(smem), stream>>>(a);
}

void launch(int kw, const TapArgs& a, dim3 grid, int64_t smem, cudaStream_t stream) {
  switch (kw) {
    case 1: return launch<1>(a, grid, smem, stream);
    case 2: return launch<2>(a, grid, smem, stream);
    case 3: return launch<3>(a, grid, smem, stream);
    case 4: return launch<4>(a, grid, smem, stream);
    case 5: return launch<5>(a, grid, smem, stream);
    case 6: return launch<6>(a, grid, smem, stream);
    case 7: return launch<7>(a, grid, smem, stream);
    default: return launch<8>(a, grid, smem, stream);
  }
}

}  // namespace

at::Tensor tap_spectrum_cuda(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h,
                             const at::Tensor& dft_w, int64_t groups) {
  TORCH_CHECK(taps.dim() == 4 && taps.scalar_type() == at::kDouble && taps.size(3) % groups == 0 &&
                  dft_d.scalar_type() == at::kComplexDouble && dft_h.scalar_type() == at::kComplexDouble &&
                  dft_w.scalar_type() == at::kComplexDouble && dft_d.size(1) == taps.size(0) &&
                  dft_d.size(0) == 2 * taps.size(0) - 1 && dft_h.size(1) == taps.size(1) &&
                  dft_w.size(1) == taps.size(2),
              "ct_bn_pool: tap_spectrum_cuda: inconsistent shapes or dtypes");
  const int64_t smem = smem_bytes(taps.size(0), taps.size(1), taps.size(2), dft_h.size(0), dft_w.size(0));
  if (taps.size(2) > kMaxKw || smem > (48 << 10)) return tap_spectrum_aten(taps, dft_d, dft_h, dft_w, groups);
  const c10::cuda::CUDAGuard guard(taps.device());
  const at::Tensor t = taps.contiguous(), ed = dft_d.contiguous(), eh = dft_h.contiguous(),
                   ew = dft_w.contiguous();
  TapArgs a;
  a.cols = t.size(3);
  a.groups = groups;
  a.group_cols = a.cols / groups;
  a.kd = static_cast<int>(t.size(0));
  a.kh = static_cast<int>(t.size(1));
  a.md = static_cast<int>(ed.size(0));
  a.mh = static_cast<int>(eh.size(0));
  a.bw = static_cast<int>(ew.size(0));
  const int64_t col_blocks = (a.cols + kThreads - 1) / kThreads;
  TORCH_CHECK(col_blocks < (int64_t(1) << 31) && a.kd < 65536,
              "ct_bn_pool: problem too large for the sub-kernels' spectra (", to_str(a.cols), " columns, ",
              to_str(int64_t(a.kd)), " depth taps)");
  auto out = at::empty({int64_t(a.md) * a.mh * a.bw, groups, 2, a.group_cols}, t.options());
  a.taps = t.data_ptr<double>();
  a.dft_d = reinterpret_cast<const double2*>(ed.data_ptr());
  a.dft_h = reinterpret_cast<const double2*>(eh.data_ptr());
  a.dft_w = reinterpret_cast<const double2*>(ew.data_ptr());
  a.out = out.data_ptr<double>();
  if (out.numel() > 0) {
    // the depth bins b_d <= M_d / 2: the others are their mirrors
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(a.kd));
    launch(static_cast<int>(t.size(2)), a, grid, smem, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace fused_ops
