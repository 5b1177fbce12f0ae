#pragma once
#include <cmath>
#include <cstdint>

#include "macros.h"
#include "sample_sums.h"

namespace fused_ops {

// Everything the BN finalize step reads and writes, as raw pointers so the same
// per-channel routine runs in a CPU loop and in a CUDA block.
template <typename scalar_t>
struct FinalizeArgs {
  SampleSums sums;
  const double* energy;  // [B, Co, splits]: within-sample centred sums of squares; null in eval
  int64_t splits;
  const scalar_t* bias;   // conv bias [Co] or null
  const scalar_t* gamma;  // BN weight [Co] or null
  const scalar_t* beta;   // BN bias [Co] or null
  scalar_t* running_mean;  // [Co] or null (not tracked)
  scalar_t* running_var;
  scalar_t* out;  // [B, Co]
  int64_t batch, channels, spatial;
  double scale, momentum, eps;
  bool batch_stats;
};

// Finalizes channel c (docs/math.md §3 and §4). Work over the batch is split as
// b = first, first + step, ...; `sample_sum(b)` gives a.sums.conv_sum(b, c)
// (the CUDA kernel precomputes them cooperatively); `block_sum` must return the
// sum of its argument over all participants of the split (identity on the CPU, a
// block reduction on CUDA) and is called the same number of times by each.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // the callables are device lambdas on CUDA, host ones on the CPU
#endif
template <typename scalar_t, typename SampleSum, typename BlockSum>
FO_HD void finalize_channel(const FinalizeArgs<scalar_t>& a, int64_t c, int64_t first, int64_t step,
                            SampleSum sample_sum, BlockSum block_sum) {
  const double n_sp = static_cast<double>(a.spatial);
  const double count = static_cast<double>(a.batch) * n_sp;
  const double bias = a.bias ? static_cast<double>(a.bias[c]) : 0.0;
  double shift, var_z;  // z's per-sample mean minus shift is the centred value
  if (a.batch_stats) {
    double s = 0;
    for (int64_t b = first; b < a.batch; b += step) s += sample_sum(b);
    const double mu = block_sum(s) / count;  // batch mean of the conv output, bias excluded
    double q = 0;
    for (int64_t b = first; b < a.batch; b += step) {
      const double d = sample_sum(b) / n_sp - mu;
      q += n_sp * d * d;
      const double* e = a.energy + (b * a.channels + c) * a.splits;
      for (int64_t k = 0; k < a.splits; ++k) q += e[k];
    }
    const double var_y = block_sum(q) / count;  // biased: what normalization uses
    shift = a.scale * mu;  // the bias cancels between a sample's mean and the batch mean
    var_z = a.scale * a.scale * var_y;
    if (first == 0 && a.running_mean) {
      const double m = a.momentum, mean_z = a.scale * (mu + bias);
      a.running_mean[c] = static_cast<scalar_t>((1 - m) * a.running_mean[c] + m * mean_z);
      a.running_var[c] =
          static_cast<scalar_t>((1 - m) * a.running_var[c] + m * var_z * count / (count - 1));
    }
  } else {
    shift = static_cast<double>(a.running_mean[c]) - a.scale * bias;
    var_z = static_cast<double>(a.running_var[c]);
  }
  const double inv_std = 1.0 / sqrt(var_z + a.eps);
  const double gamma = a.gamma ? static_cast<double>(a.gamma[c]) : 1.0;
  const double beta = a.beta ? static_cast<double>(a.beta[c]) : 0.0;
  for (int64_t b = first; b < a.batch; b += step) {
    const double z_mean = a.scale * sample_sum(b) / n_sp;
    a.out[b * a.channels + c] = static_cast<scalar_t>((z_mean - shift) * inv_std * gamma + beta);
  }
}

}  // namespace fused_ops
