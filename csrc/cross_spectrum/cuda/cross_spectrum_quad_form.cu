// The cross-spectrum path's contraction (docs/math.md §3.5): for each column c of a
// group (an output channel of a phase), sum over the kept bins g and the rows k of W (the
// real and imaginary parts of each channel's row, interleaved) of
// mirror(g) W[g, k, c] V[g, k, c], V = B W, B R^'s real form in the same order:
// Re(W^H R^ W). On sm_90 cross_spectrum_quad_form_mma.cu does it all in one kernel; elsewhere, or with
// Route contraction='gemm' (fused_ops.testing), V is cuBLAS's batched product and this file's kernel forms the
// sums. As ATen ops it is a product into a
// temporary as large as W, two reductions and a scaling per chunk of columns
// (docs/performance.md); here it is one read of W and V. A block owns 32
// adjacent columns (coalesced loads) and a slice of the bins; the slices' sums are returned
// apart and added later in a fixed order, so the result does not depend on scheduling. The loop
// does not walk the (g, k) rows as one index: splitting it would take a 64-bit division per
// row (docs/performance.md).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "cross_spectrum/cuda/cross_spectrum_kernels.h"
#include "message.h"
#include "testing_hooks.h"

namespace fused_ops {
namespace {

constexpr int kCols = 32;     // columns per block, one per lane
constexpr int kRowLanes = 8;  // warps per block, each striding over the block's rows
constexpr int kThreads = kCols * kRowLanes;

struct QuadArgs {
  const double* w;       // [bins, G, 2 Cig, cols]
  const double* v;       // same
  const double* mirror;  // [mw]: weight of a bin by its last frequency index
  double* partial;       // [slices, G, cols]
  int64_t bins, mw, groups, rows, cols, bins_per_slice;  // rows: 2 Cig
};

__global__ void __launch_bounds__(kThreads) quad_form_kernel(QuadArgs a) {
  __shared__ double sums[kRowLanes][kCols];
  const int lane = static_cast<int>(threadIdx.x % kCols), warp = static_cast<int>(threadIdx.x / kCols);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kCols + lane;
  const int64_t group = blockIdx.z;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * a.bins_per_slice;
  const int64_t b1 = min(a.bins, b0 + a.bins_per_slice);
  double acc = 0;
  if (col < a.cols) {
    for (int64_t bin = b0; bin < b1; ++bin) {
      const int64_t at = (bin * a.groups + group) * a.rows * a.cols + col;
      const double* __restrict__ w = a.w + at;
      const double* __restrict__ v = a.v + at;
      double sum = 0;
#pragma unroll 4
      for (int64_t k = warp; k < a.rows; k += kRowLanes) sum = fma(w[k * a.cols], v[k * a.cols], sum);
      acc = fma(a.mirror[bin % a.mw], sum, acc);
    }
  }
  sums[warp][lane] = acc;
  __syncthreads();
  if (warp != 0 || col >= a.cols) return;
  double total = 0;
#pragma unroll
  for (int k = 0; k < kRowLanes; ++k) total += sums[k][lane];
  a.partial[(static_cast<int64_t>(blockIdx.y) * a.groups + group) * a.cols + col] = total;
}

// The sums of w_hat v (quad_forms_cuda's other route).
at::Tensor forms_of_product(const at::Tensor& w_hat, const at::Tensor& v, const at::Tensor& mirror) {
  const at::Tensor w = w_hat.contiguous(), vc = v.contiguous(), m = mirror.contiguous();  // no-ops here
  QuadArgs a;
  a.bins = w.size(0) * w.size(1) * w.size(2);
  a.mw = w.size(2);
  a.groups = w.size(3);
  a.rows = w.size(4);
  a.cols = w.size(5);
  const int64_t col_tiles = (a.cols + kCols - 1) / kCols;
  // Enough slices of bins for about four blocks per SM.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted =
      std::clamp<int64_t>((4 * sms + col_tiles * a.groups - 1) / (col_tiles * a.groups), 1, a.bins);
  a.bins_per_slice = (a.bins + wanted - 1) / wanted;
  const int64_t slices = (a.bins + a.bins_per_slice - 1) / a.bins_per_slice;
  TORCH_CHECK(col_tiles < (int64_t(1) << 31) && slices < 65536 && a.groups < 65536,
              "ct_bn_pool: problem too large for the cross-spectrum contraction (", to_str(a.cols),
              " columns, ", to_str(a.groups), " groups)");
  auto partial = at::empty({slices, a.groups, a.cols}, w.options().dtype(at::kDouble));
  a.w = w.data_ptr<double>();
  a.v = vc.data_ptr<double>();
  a.mirror = m.data_ptr<double>();
  a.partial = partial.data_ptr<double>();
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(slices),
                  static_cast<unsigned>(a.groups));
  quad_form_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return partial;
}

}  // namespace

at::Tensor quad_forms_cuda(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror) {
  const c10::cuda::CUDAGuard guard(w_hat.device());
  TORCH_CHECK(w_hat.dim() == 6 && blocks.dim() == 6 && blocks.sizes().slice(0, 4) == w_hat.sizes().slice(0, 4) &&
                  blocks.size(4) == blocks.size(5) && 2 * blocks.size(4) == w_hat.size(4) &&
                  w_hat.scalar_type() == at::kDouble && blocks.scalar_type() == at::kComplexDouble &&
                  mirror.scalar_type() == at::kDouble &&
                  mirror.dim() == 1 && mirror.size(0) == w_hat.size(2),
              "ct_bn_pool: quad_forms_cuda: inconsistent shapes or dtypes");
  // Route contraction='gemm' (fused_ops.testing): the product and this file's kernel on sm_90 too.
  if (forced_route(Knob::Contraction) != Route::Gemm && quad_forms_mma_supported(blocks, w_hat)) {
    return quad_forms_mma_cuda(blocks, w_hat, mirror);
  }
  return forms_of_product(w_hat, at::matmul(interleaved_real_form(blocks), w_hat), mirror);
}

}  // namespace fused_ops
