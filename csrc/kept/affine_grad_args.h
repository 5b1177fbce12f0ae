#pragma once
// AffineGradInputs as the per-channel routine reads it (AffineGradArgs, kept/affine_grad.h),
// shared by the CPU's loop and CUDA's kernel.
#include <ATen/ATen.h>

#include "backend.h"
#include "kept/affine_grad.h"

namespace fused_ops {

template <typename C>
AffineGradArgs<C> affine_grad_args(const AffineGradInputs& in) {
  auto ptr = [](const at::Tensor& t) -> C* { return t.defined() ? t.data_ptr<C>() : nullptr; };
  AffineGradArgs<C> a;
  a.grad_out = in.grad_out.data_ptr<C>();
  a.bn_weight = ptr(in.bn_weight);
  a.sample_sums = in.sample_sums.data_ptr<double>();
  a.stats = in.stats.data_ptr<double>();
  a.g_sum = in.g_sum.data_ptr<C>();
  a.g_zbar = in.g_zbar.data_ptr<C>();
  a.field = ptr(in.field);
  a.shift = ptr(in.shift);
  a.k = ptr(in.k);
  a.batch = in.grad_out.size(0);
  a.channels = in.grad_out.size(1);
  a.scale = in.scale;
  a.eps = in.eps;
  a.positions = in.positions;
  return a;
}

}  // namespace fused_ops
