#pragma once
// FinalizeInputs as the finalize kernels read it (FinalizeArgs, sums/finalize.h), shared by
// the CPU's and CUDA's finalize.
#include <ATen/ATen.h>

#include "backend.h"

namespace fused_ops {

// Typed view of FinalizeInputs for one dtype.
template <typename scalar_t>
FinalizeArgs<scalar_t> finalize_args(const FinalizeInputs& in, const ConvGeometry& g,
                                     at::Tensor& out) {
  auto ptr = [](const at::Tensor& t) -> scalar_t* {
    return t.defined() ? t.data_ptr<scalar_t>() : nullptr;
  };
  auto dptr = [](const at::Tensor& t) -> double* {
    return t.defined() ? t.data_ptr<double>() : nullptr;
  };
  FinalizeArgs<scalar_t> a;
  a.sums = in.sums.x_red.defined() ? in.sums.view(g) : SampleSums{};
  a.sample_sums = dptr(in.sample_sums);
  a.energy = dptr(in.energy);
  a.energy_rows = in.energy.defined() ? in.energy.size(0) : 0;
  a.splits = in.energy.defined() ? in.energy.size(2) : 0;
  a.stats_in = dptr(in.stats_in);
  a.stats_out = dptr(in.stats_out);
  a.sample_sums_out = dptr(in.sample_sums_out);
  a.bias = ptr(in.bias);
  a.gamma = ptr(in.gamma);
  a.beta = ptr(in.beta);
  a.running_mean = ptr(in.running_mean);
  a.running_var = ptr(in.running_var);
  a.out = out.data_ptr<scalar_t>();
  a.batch = g.batch;
  a.channels = g.out_channels;
  a.spatial = g.out_spatial();
  a.scale = in.scale;
  a.momentum = in.momentum;
  a.eps = in.eps;
  a.batch_stats = in.batch_stats;
  return a;
}

}  // namespace fused_ops
