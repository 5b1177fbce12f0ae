// Registers the CUDA kernel of ct_bn_pool: the shared algorithm with the CUDA
// reductions and kernels.
#include <torch/library.h>

#include "cuda/fft_energy.h"
#include "cuda/kernels.h"

namespace fused_ops {
namespace {

bool fft_applies_cuda(const ConvGeometry& g, at::ScalarType dtype) {
  return dtype == at::kFloat && fft_energy_applies(g);
}

// docs/performance.md: the FFT path where it applies; elsewhere cuDNN (strict
// float32) over batch slices.
EnergyAlgo auto_energy_algo_cuda(const ConvGeometry& g, at::ScalarType dtype) {
  return fft_applies_cuda(g, dtype) ? EnergyAlgo::Fft : EnergyAlgo::SlicedConv;
}

const Backend kCudaBackend = {sample_sums_cuda,      energy_direct_cuda, finalize_cuda,
                              auto_energy_algo_cuda, energy_fft_cuda,    fft_applies_cuda};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) {
  m.impl("ct_bn_pool", &ct_bn_pool_kernel<kCudaBackend>);
  m.impl("ct_bn_pool_stats", &ct_bn_pool_stats_kernel<kCudaBackend>);
  m.impl("ct_bn_pool_apply", &ct_bn_pool_apply_kernel<kCudaBackend>);
}

}  // namespace fused_ops
