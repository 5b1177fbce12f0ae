#pragma once
#include <ATen/ATen.h>

#include "ct_bn_pool.h"
#include "geometry.h"

namespace fused_ops {

// Checks every argument of ct_bn_pool and returns the problem's geometry. It
// throws (RuntimeError for shapes, dtypes and devices; ValueError for bad
// values) before anything is computed or mutated.
ConvGeometry validate_inputs(const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& bn_weight,
                             const c10::optional<at::Tensor>& bn_bias,
                             const c10::optional<at::Tensor>& running_mean,
                             const c10::optional<at::Tensor>& running_var, bool training, double eps,
                             at::IntArrayRef stride, at::IntArrayRef padding,
                             at::IntArrayRef output_padding, at::IntArrayRef dilation,
                             int64_t groups);

// Parses the `algo` argument: "auto" yields the backend's choice.
EnergyAlgo parse_energy_algo(c10::string_view algo, const Backend& backend, const ConvGeometry& g);

}  // namespace fused_ops
