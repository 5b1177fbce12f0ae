#pragma once
// Launchers of the kept route's kernels (kept/kept.cpp, docs/math.md §6.2.4); each sets the
// device guard, launches on the current stream and checks the launch.
#include <ATen/ATen.h>

#include <utility>

#include "backend.h"

namespace fused_ops {

// Backend::sample_moments: sample_moments.cu, one block per (sample, channel) row of y.
std::pair<at::Tensor, at::Tensor> sample_moments_cuda(const at::Tensor& y);

// Backend::affine_grad: affine_grad.cu, one thread per channel.
void affine_grad_cuda(const AffineGradInputs& in);

}  // namespace fused_ops
