#pragma once
// Launchers of the direct algorithm's CUDA kernels (docs/math.md §3.1).
#include <ATen/ATen.h>

#include "ct_bn_pool.h"
#include "direct/direct.h"

namespace fused_ops {

// Backend::energy_direct: direct_energy_stride1.cu where energy_direct_stride1_cuda takes the
// problem, else direct_energy.cu's kernel (any geometry).
at::Tensor energy_direct_cuda(const at::Tensor& x, const at::Tensor& weight,
                              const SampleSumTensors& sums, const ConvGeometry& g);

// At stride and dilation 1, where a tile of output rows fits the block's threads (Wo of at
// most 512 float32 positions, 256 float64) and one input channel's box and weights its
// shared memory: [B, Co, S] energy; elsewhere undefined.
at::Tensor energy_direct_stride1_cuda(const at::Tensor& x, const at::Tensor& weight,
                                      const SampleSumTensors& sums, const ConvGeometry& g);

// Backend::direct_stats: direct_stats_mma.cu (float64 tensor cores, sm_90) at stride and
// dilation 1 with padding, or for any padding with route direct='mma' (fused_ops.testing);
// undefined elsewhere (then energy_direct_cuda with x's sums: route direct='simt' forces that),
// and where a group of 8 input channels' box of x and weights do not fit a block's shared
// memory (an error if forced).
std::pair<at::Tensor, at::Tensor> direct_stats_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                    const ConvGeometry& g);

// Whether direct_stats_cuda's tensor-core kernel runs this problem (stride and dilation 1, x of
// `dtype`) on the current device, whatever the padding: its dispatch rule (csrc/dispatch.cpp).
bool direct_stats_mma_takes(const ConvGeometry& g, at::ScalarType dtype);

}  // namespace fused_ops
