// The sub-kernels' spectra on the grid M of the cross-spectrum path's contraction
// (docs/math.md §3.5): W(b) = sum_k E_d[b_d, k_d] E_h[b_h, k_h] E_w[b_w, k_w] taps[k], one
// dim at a time. Why: as one float64 GEMM with the product of the three tables it was
// k'd k'h k'w multiply-adds per bin and column (seed: 830M, 58 us per call on the H200,
// docs/performance.md); per dim it is about a fifth of that. A thread takes one column and
// one depth bin b_d <= M_d / 2: its sums over k_d for every (k_h, k_w) in shared memory (its
// own slice: no other thread reads it), then per b_h the k'w values over k_h in registers,
// and per b_w two outputs: W(b) and, the taps being real, W(-b_d, -b_h, b_w), the sum over
// k_w of E_w times the conjugate of those values (the same four real sums of products).
// The taps come as the float64 stack (StackTaps) or, with one phase, as the weight itself
// in its dtype (WeightTaps): its cast and permuted copy were two ATen kernels of about 17 us
// per seed call on the H200.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/dynamic_smem.h"
#include "cuda/kernels.h"
#include "cuda/spectrum_common.cuh"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kThreads = 64;
constexpr int kWarp = 32;
constexpr int kMaxKw = 8;  // the kernel's instantiations: k'w of 1 to 8 (a row in registers)

template <typename Source>
struct TapArgs {
  const Source* taps;    // [kd, kh, kw, cols] as the Taps type of the launch reads them
  const double2* dft_d;  // [md, kd], md = 2 kd - 1
  const double2* dft_h;  // [mh, kh]
  const double2* dft_w;  // [bw, kw]
  double* out;           // [md, mh, bw, G, 2, cols / G]
  int64_t cols, group_cols, groups;
  // WeightTaps: column col is (col / row_cols, col % row_cols) of the taps' last two dims,
  // whose strides these are
  int64_t row_cols, row_stride, col_stride;
  int kd, kh, md, mh, bw;
};

// sum_k e[k] v[k] over the depth taps of one (k_h, k_w), their loads issued together: one
// load at a time, the first version of this kernel took 135 us per seed call.
template <typename Source>
__device__ __forceinline__ double2 depth_sum(const Source* taps, int64_t k_stride, int kd, const double2* e) {
  constexpr int kBatch = 8;
  double2 s{0, 0};
  for (int k0 = 0; k0 < kd; k0 += kBatch) {
    double v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v[k] = k0 + k < kd ? static_cast<double>(taps[(k0 + k) * k_stride]) : 0.0;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (k0 + k >= kd) break;
      s.x = fma(e[k0 + k].x, v[k], s.x);
      s.y = fma(e[k0 + k].y, v[k], s.y);
    }
  }
  return s;
}

// The float64 stack, [kd, kh, kw, cols] contiguous: adjacent threads' taps adjacent.
struct StackTaps {
  using Source = double;
  static int64_t staging_bytes(int64_t, int64_t) { return 0; }

  template <int kKw>
  __device__ static void plane_sums(const TapArgs<double>& a, double2* plane, const double2* e_d, double*,
                                    int64_t col) {
    if (col >= a.cols) return;
    const int plane_taps = a.kh * kKw;
    const int64_t k_stride = plane_taps * a.cols;
#pragma unroll 4
    for (int t = 0; t < plane_taps; ++t) {
      plane[t * kThreads + threadIdx.x] = depth_sum(a.taps + t * a.cols + col, k_stride, a.kd, e_d);
    }
  }
};

// The weight, Value values: a column's k'd k'h k'w taps together in (d, h, w) order, the
// columns anywhere (a chunk of output channels, any layout of the channels). A thread's own
// taps lie k'd k'h k'w values from its neighbours': each warp stages its columns' taps of one
// k_h at a time in shared memory by loads of adjacent values, and each thread reads its own
// there.
template <typename Value>
struct WeightTaps {
  using Source = Value;
  // A column's staged values, kd kw: an odd count apart, so the warp's reads of one tap
  // from its 32 columns hit 32 banks.
  __host__ __device__ static int64_t staging_stride(int64_t kd, int64_t kw) { return (kd * kw) | 1; }
  static int64_t staging_bytes(int64_t kd, int64_t kw) {
    return kThreads * staging_stride(kd, kw) * static_cast<int64_t>(sizeof(Value));
  }

  template <int kKw>
  __device__ static void plane_sums(const TapArgs<Value>& a, double2* plane, const double2* e_d, Value* staging,
                                    int64_t col) {
    const unsigned lane = threadIdx.x % kWarp;
    const int64_t left = a.cols - (col - lane);  // columns from the warp's first on
    if (left <= 0) return;
    const unsigned columns = left < kWarp ? static_cast<unsigned>(left) : kWarp;
    const int stride = static_cast<int>(staging_stride(a.kd, kKw));
    Value* warp_rows = staging + (threadIdx.x - lane) * stride;
    const Value* taps = a.taps + col / a.row_cols * a.row_stride + col % a.row_cols * a.col_stride;
    for (int h = 0; h < a.kh; ++h) {
      stage_rows<kKw>(taps + h * kKw, a.kd, a.kh * kKw, columns, warp_rows);
      __syncwarp();
      if (lane < columns) {
        for (int w = 0; w < kKw; ++w) {
          plane[(h * kKw + w) * kThreads + threadIdx.x] = depth_sum(warp_rows + lane * stride + w, kKw, a.kd, e_d);
        }
      }
      __syncwarp();  // before the next k_h's values replace these
    }
  }

  // Taps (d, h, w) of the column on lane j, its (d, h, 0) at row_taps[d plane_taps] there,
  // to rows[j stride + d kKw + w] for every d and w: the warp's kd kKw values per column as
  // (j, e), e = d kKw + w, 32 adjacent ones a turn, (j, e) stepped by 32 without a division;
  // kBatch turns' loads issued together (with one load in flight, a k_h's staging would wait
  // on memory kd kKw times).
  template <int kKw>
  __device__ static void stage_rows(const Value* row_taps, int kd, int plane_taps, unsigned columns, Value* rows) {
    constexpr int kBatch = 16;
    constexpr unsigned kNone = ~0u;
    // unsigned: offsets that need no sign extension
    const unsigned lane = threadIdx.x % kWarp, values = kd * kKw, gap = plane_taps - kKw;
    const unsigned stride = static_cast<unsigned>(staging_stride(kd, kKw));
    const unsigned j_step = kWarp / values, e_step = kWarp % values;
    unsigned j = lane / values, e = lane % values;
    for (unsigned turn0 = 0; turn0 < values; turn0 += kBatch) {
      Value v[kBatch];
      unsigned at[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const auto* column = reinterpret_cast<const Value*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row_taps), static_cast<int>(j)));
        at[b] = turn0 + b < values && j < columns ? j * stride + e : kNone;
        if (at[b] != kNone) v[b] = __ldg(column + e / kKw * gap + e);
        j += j_step;
        e += e_step;
        if (e >= values) {
          e -= values;
          ++j;
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (at[b] != kNone) rows[at[b]] = v[b];
      }
    }
  }
};

// Shared memory of a block: its threads' planes, then the depth bin's row of dft_d, all of
// dft_h and dft_w, and what Taps stages.
template <typename Taps>
int64_t smem_bytes(const at::Tensor& taps, const at::Tensor& dft_h, const at::Tensor& dft_w) {
  const int64_t kd = taps.size(0), kh = taps.size(1), kw = taps.size(2);
  const int64_t tables = kd + dft_h.size(0) * kh + dft_w.size(0) * kw;
  return static_cast<int64_t>(sizeof(double2)) * (kh * kw * kThreads + tables) + Taps::staging_bytes(kd, kw);
}

template <typename Source>
__device__ __forceinline__ void store_bin(const TapArgs<Source>& a, int64_t bin, int64_t group, int64_t group_col,
                                          double re, double im) {
  double* out = a.out + (bin * a.groups + group) * 2 * a.group_cols + group_col;
  out[0] = re;
  out[a.group_cols] = im;
}

template <int kKw, typename Taps>
__global__ void __launch_bounds__(kThreads) tap_spectrum_kernel(TapArgs<typename Taps::Source> a) {
  extern __shared__ double2 smem[];
  const int kh = a.kh, plane_taps = kh * kKw, bd = blockIdx.y;
  double2* plane = smem;                         // [(k_h, k_w)][thread]
  double2* e_d = plane + plane_taps * kThreads;  // [kd]
  double2* e_h = e_d + a.kd;                     // [mh, kh]
  double2* e_w = e_h + a.mh * kh;                // [bw, kKw]
  auto* staging = reinterpret_cast<typename Taps::Source*>(e_w + a.bw * kKw);
  for (int i = threadIdx.x; i < a.kd; i += kThreads) e_d[i] = a.dft_d[bd * a.kd + i];
  for (int i = threadIdx.x; i < a.mh * kh; i += kThreads) e_h[i] = a.dft_h[i];
  for (int i = threadIdx.x; i < a.bw * kKw; i += kThreads) e_w[i] = a.dft_w[i];
  __syncthreads();
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  Taps::template plane_sums<kKw>(a, plane, e_d, staging, col);
  if (col >= a.cols) return;
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

template <int kKw, typename Taps>
void launch(const TapArgs<typename Taps::Source>& a, dim3 grid, int64_t smem, cudaStream_t stream) {
  const auto kernel = tap_spectrum_kernel<kKw, Taps>;
  allow_dynamic_smem(kernel, smem);
  kernel<<<grid, kThreads, static_cast<size_t>(smem), stream>>>(a);
}

template <typename Taps>
void launch(int kw, const TapArgs<typename Taps::Source>& a, dim3 grid, int64_t smem, cudaStream_t stream) {
  switch (kw) {
    case 1: return launch<1, Taps>(a, grid, smem, stream);
    case 2: return launch<2, Taps>(a, grid, smem, stream);
    case 3: return launch<3, Taps>(a, grid, smem, stream);
    case 4: return launch<4, Taps>(a, grid, smem, stream);
    case 5: return launch<5, Taps>(a, grid, smem, stream);
    case 6: return launch<6, Taps>(a, grid, smem, stream);
    case 7: return launch<7, Taps>(a, grid, smem, stream);
    default: return launch<8, Taps>(a, grid, smem, stream);
  }
}

// Whether each column's taps lie together in (d, h, w) order, as in a ConvTranspose3d
// weight: what WeightTaps reads.
bool taps_packed(const at::Tensor& taps) {
  int64_t step = 1;
  for (int d = 2; d >= 0; --d) {
    if (taps.size(d) > 1 && taps.stride(d) != step) return false;
    step *= taps.size(d);
  }
  return true;
}

// Whether WeightTaps<T> reads the taps where they lie: T values, packed, its shared memory
// within what a block may have.
template <typename T>
bool in_place(const at::Tensor& taps, const at::Tensor& dft_h, const at::Tensor& dft_w) {
  return taps.scalar_type() == c10::CppTypeToScalarType<T>::value && taps_packed(taps) &&
         smem_bytes<WeightTaps<T>>(taps, dft_h, dft_w) <= dynamic_smem_limit();
}

template <typename Source>
TapArgs<Source> tap_args(const at::Tensor& taps, const at::Tensor& ed, const at::Tensor& eh, const at::Tensor& ew,
                         int64_t groups) {
  TapArgs<Source> a;
  a.taps = taps.data_ptr<Source>();
  a.dft_d = reinterpret_cast<const double2*>(ed.data_ptr());
  a.dft_h = reinterpret_cast<const double2*>(eh.data_ptr());
  a.dft_w = reinterpret_cast<const double2*>(ew.data_ptr());
  a.row_cols = taps.size(4);
  a.row_stride = taps.stride(3);
  a.col_stride = taps.stride(4);
  a.cols = taps.size(3) * a.row_cols;
  a.groups = groups;
  a.group_cols = a.cols / groups;
  a.kd = static_cast<int>(taps.size(0));
  a.kh = static_cast<int>(taps.size(1));
  a.md = static_cast<int>(ed.size(0));
  a.mh = static_cast<int>(eh.size(0));
  a.bw = static_cast<int>(ew.size(0));
  return a;
}

// The spectra by tap_spectrum_kernel from taps laid out as Taps reads them.
template <typename Taps>
at::Tensor spectrum(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h, const at::Tensor& dft_w,
                    int64_t groups) {
  const at::Tensor ed = dft_d.contiguous(), eh = dft_h.contiguous(), ew = dft_w.contiguous();
  TapArgs<typename Taps::Source> a = tap_args<typename Taps::Source>(taps, ed, eh, ew, groups);
  const int64_t col_blocks = (a.cols + kThreads - 1) / kThreads;
  TORCH_CHECK(col_blocks < (int64_t(1) << 31) && a.kd < 65536,
              "ct_bn_pool: problem too large for the sub-kernels' spectra (", to_str(a.cols), " columns, ",
              to_str(int64_t(a.kd)), " depth taps)");
  const at::Tensor out =
      at::empty({int64_t(a.md) * a.mh * a.bw, groups, 2, a.group_cols}, taps.options().dtype(at::kDouble));
  a.out = out.data_ptr<double>();
  if (out.numel() > 0) {
    // the depth bins b_d <= M_d / 2: the others are their mirrors
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(a.kd));
    launch<Taps>(static_cast<int>(taps.size(2)), a, grid, smem_bytes<Taps>(taps, eh, ew),
                 at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace

at::Tensor tap_spectrum_cuda(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h,
                             const at::Tensor& dft_w, int64_t groups) {
  TORCH_CHECK(taps.dim() == 5 && (taps.size(3) * taps.size(4)) % groups == 0 &&
                  dft_d.scalar_type() == at::kComplexDouble && dft_h.scalar_type() == at::kComplexDouble &&
                  dft_w.scalar_type() == at::kComplexDouble && dft_d.size(1) == taps.size(0) &&
                  dft_d.size(0) == 2 * taps.size(0) - 1 && dft_h.size(1) == taps.size(1) &&
                  dft_w.size(1) == taps.size(2),
              "ct_bn_pool: tap_spectrum_cuda: inconsistent shapes or dtypes");
  if (taps.size(2) > kMaxKw || smem_bytes<StackTaps>(taps, dft_h, dft_w) > (48 << 10)) {
    return tap_spectrum_aten(taps, dft_d, dft_h, dft_w, groups);
  }
  const c10::cuda::CUDAGuard guard(taps.device());
  if (in_place<float>(taps, dft_h, dft_w)) return spectrum<WeightTaps<float>>(taps, dft_d, dft_h, dft_w, groups);
  if (in_place<double>(taps, dft_h, dft_w)) return spectrum<WeightTaps<double>>(taps, dft_d, dft_h, dft_w, groups);
  return spectrum<StackTaps>(taps.to(at::kDouble).contiguous(), dft_d, dft_h, dft_w, groups);
}

}  // namespace fused_ops
