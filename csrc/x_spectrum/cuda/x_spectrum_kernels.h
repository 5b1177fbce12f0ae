#pragma once
// x's spectrum's CUDA kernels (x_spectrum.h's SpectrumKernels).
#include <ATen/ATen.h>

#include "ct_bn_pool.h"
#include "x_spectrum/x_spectrum.h"

namespace fused_ops {

// SpectrumKernels (x_spectrum.h): x_spectrum_dft.cu, and x_spectrum_copies.cu around cuFFT
// where it does not apply (ATen's copies for other layouts).
bool x_spectrum_dft_cuda(const at::Tensor& x, const int64_t grid[3], const at::Tensor& spectrum,
                         const at::Tensor& channel_sums);
void pad_cuda(const at::Tensor& x, const at::Tensor& padded);
void scatter_cuda(const at::Tensor& part, const at::Tensor& spectrum, int64_t b0);
constexpr SpectrumKernels kCudaSpectrumKernels = {x_spectrum_dft_cuda, pad_cuda, scatter_cuda};

}  // namespace fused_ops
