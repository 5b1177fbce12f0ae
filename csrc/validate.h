#pragma once
#include <ATen/ATen.h>

#include "ct_bn_pool.h"
#include "common/geometry.h"

namespace fused_ops {

// Checks every argument of ct_bn_pool and returns the problem's geometry. It
// throws (RuntimeError for shapes, dtypes and devices; ValueError for bad
// values) before anything is computed or mutated. `one_of_many`: x is one
// process's part of a batch (ct_bn_pool_stats): it may be empty or hold a
// single value per channel, which only the merged count can refuse.
ConvGeometry validate_inputs(const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& bn_weight,
                             const c10::optional<at::Tensor>& bn_bias,
                             const c10::optional<at::Tensor>& running_mean,
                             const c10::optional<at::Tensor>& running_var, bool training, double eps,
                             at::IntArrayRef stride, at::IntArrayRef padding,
                             at::IntArrayRef output_padding, at::IntArrayRef dilation,
                             int64_t groups, bool one_of_many = false);

// Checks the arguments of ct_bn_pool_apply; the geometry it returns has only
// batch, out_channels and out_spatial() set.
ConvGeometry validate_apply_inputs(const at::Tensor& sample_sums, const at::Tensor& stats,
                                   int64_t spatial, const c10::optional<at::Tensor>& bias,
                                   const c10::optional<at::Tensor>& bn_weight,
                                   const c10::optional<at::Tensor>& bn_bias,
                                   const c10::optional<at::Tensor>& running_mean,
                                   const c10::optional<at::Tensor>& running_var, double eps,
                                   at::ScalarType dtype);

// Parses the `algo` argument for inputs of dtype `input_dtype`: "auto" yields
// the backend's choice.
EnergyAlgo parse_energy_algo(c10::string_view algo, const Backend& backend, const ConvGeometry& g,
                             at::ScalarType input_dtype);

}  // namespace fused_ops
