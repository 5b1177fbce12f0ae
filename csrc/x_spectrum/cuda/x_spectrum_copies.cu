// The copies around x's FFT (x_spectrum.h). ATen's strided copies of x into the padded
// buffer and of the FFT's output into the spectrum's [F, B, Ci] layout run well below the
// memory bandwidth (docs/performance.md); these kernels read and write whole rows (16-byte
// pieces) and transpose through shared memory. Layouts they do not cover take ATen's copies.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "x_spectrum/cuda/x_spectrum_kernels.h"
#include "message.h"

namespace fused_ops {
namespace {

constexpr int kPadThreads = 256;

struct PadArgs {
  int64_t pieces;  // rows (n Ci D H) times pieces per row
  int64_t d, h, row_pieces, lh, lw_pieces, ld;
};

// One thread per piece (V elements) of a row of x, stored at its place in the padded row.
template <typename V>
__global__ void __launch_bounds__(kPadThreads) pad_kernel(const V* __restrict__ x, V* __restrict__ padded,
                                                          PadArgs a) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kPadThreads + threadIdx.x;
  if (t >= a.pieces) return;
  const int64_t row = t / a.row_pieces, piece = t % a.row_pieces;
  const int64_t h = row % a.h, d = (row / a.h) % a.d, plane = row / (a.h * a.d);  // plane: (b, ci)
  padded[((plane * a.ld + d) * a.lh + h) * a.lw_pieces + piece] = x[t];
}

template <typename V>
void launch_pad(const at::Tensor& x, const at::Tensor& padded, int64_t elements_per_piece) {
  PadArgs a;
  a.d = x.size(2);
  a.h = x.size(3);
  a.row_pieces = x.size(4) / elements_per_piece;
  a.ld = padded.size(2);
  a.lh = padded.size(3);
  a.lw_pieces = padded.size(4) / elements_per_piece;
  a.pieces = x.numel() / elements_per_piece;
  const int64_t blocks = (a.pieces + kPadThreads - 1) / kPadThreads;
  pad_kernel<V><<<static_cast<unsigned>(blocks), kPadThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const V*>(x.data_ptr()), static_cast<V*>(padded.data_ptr()), a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0; }

constexpr int kTile = 32, kTileRows = 8;  // kTile x kTile elements, kTile x kTileRows threads

// spectrum[f, col0 + k] = part[k, f]: part [K, F], spectrum rows of `ld` elements.
template <typename C>
__global__ void __launch_bounds__(kTile* kTileRows)
    scatter_kernel(const C* __restrict__ part, C* __restrict__ spectrum, int64_t K, int64_t F,
                   int64_t ld, int64_t col0) {
  __shared__ C tile[kTile][kTile + 1];
  const int64_t f0 = static_cast<int64_t>(blockIdx.x) * kTile, k0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int tx = static_cast<int>(threadIdx.x % kTile), ty = static_cast<int>(threadIdx.x / kTile);
  for (int j = ty; j < kTile; j += kTileRows) {
    const int64_t k = k0 + j, f = f0 + tx;
    if (k < K && f < F) tile[j][tx] = part[k * F + f];
  }
  __syncthreads();
  for (int j = ty; j < kTile; j += kTileRows) {
    const int64_t f = f0 + j, k = k0 + tx;
    if (k < K && f < F) spectrum[f * ld + col0 + k] = tile[tx][j];
  }
}

}  // namespace

void pad_cuda(const at::Tensor& x, const at::Tensor& padded) {
  const c10::cuda::CUDAGuard guard(x.device());
  const bool is_float = x.scalar_type() == at::kFloat;
  if (!x.is_contiguous() || !padded.is_contiguous() || !(is_float || x.scalar_type() == at::kDouble) ||
      padded.scalar_type() != x.scalar_type()) {
    pad_aten(x, padded);
    return;
  }
  if (x.numel() == 0) return;
  const int64_t per16 = is_float ? 4 : 2;  // elements in 16 bytes
  const bool wide = x.size(4) % per16 == 0 && padded.size(4) % per16 == 0 && aligned16(x) && aligned16(padded);
  const int64_t pieces = x.numel() / (wide ? per16 : 1);
  TORCH_CHECK((pieces + kPadThreads - 1) / kPadThreads < (int64_t(1) << 31),
              "ct_bn_pool: x too large for the spectrum's padding copy");
  if (wide) {
    launch_pad<float4>(x, padded, per16);
  } else if (is_float) {
    launch_pad<float>(x, padded, 1);
  } else {
    launch_pad<double>(x, padded, 1);
  }
}

void scatter_cuda(const at::Tensor& part, const at::Tensor& spectrum, int64_t b0) {
  const c10::cuda::CUDAGuard guard(part.device());
  const bool is_double = part.scalar_type() == at::kComplexDouble;
  if (!part.is_contiguous() || !spectrum.is_contiguous() || spectrum.scalar_type() != part.scalar_type() ||
      !(is_double || part.scalar_type() == at::kComplexFloat)) {
    scatter_aten(part, spectrum, b0);
    return;
  }
  if (part.numel() == 0) return;
  const int64_t channels = part.size(1), K = part.size(0) * channels;
  const int64_t F = part.numel() / K, ld = spectrum.size(3) * channels;
  const int64_t tiles_f = (F + kTile - 1) / kTile, tiles_k = (K + kTile - 1) / kTile;
  TORCH_CHECK(tiles_f < (int64_t(1) << 31) && tiles_k < 65536,
              "ct_bn_pool: spectrum too large for its scatter (", to_str(F), " frequencies, ",
              to_str(K), " rows)");
  const dim3 grid(static_cast<unsigned>(tiles_f), static_cast<unsigned>(tiles_k));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (is_double) {
    scatter_kernel<double2><<<grid, kTile * kTileRows, 0, stream>>>(
        static_cast<const double2*>(part.data_ptr()), static_cast<double2*>(spectrum.data_ptr()), K, F, ld,
        b0 * channels);
  } else {
    scatter_kernel<float2><<<grid, kTile * kTileRows, 0, stream>>>(
        static_cast<const float2*>(part.data_ptr()), static_cast<float2*>(spectrum.data_ptr()), K, F, ld,
        b0 * channels);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fused_ops
