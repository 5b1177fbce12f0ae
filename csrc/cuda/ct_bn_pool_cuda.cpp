// Registers the CUDA kernel of ct_bn_pool: the shared algorithm with the CUDA
// reductions and kernels.
#include <torch/library.h>

#include "cuda/kernels.h"

namespace fused_ops {
namespace {

EnergyAlgo auto_energy_algo_cuda(const ConvGeometry&) { return EnergyAlgo::SlicedConv; }

const Backend kCudaBackend = {sample_sums_cuda, energy_direct_cuda, finalize_cuda,
                              auto_energy_algo_cuda};

}  // namespace

TORCH_LIBRARY_IMPL(fused_ops, CUDA, m) { m.impl("ct_bn_pool", &ct_bn_pool_kernel<kCudaBackend>); }

}  // namespace fused_ops
