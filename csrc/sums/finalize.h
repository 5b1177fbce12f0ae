#pragma once
#include <cmath>
#include <cstdint>

#include "common/macros.h"
#include "sums/sample_sums.h"

namespace fused_ops {

// isfinite on either side: the CUDA math API's in device code, the standard library's on the host.
FO_HD bool is_finite(double v) {
#if defined(__CUDA_ARCH__)
  return isfinite(v);
#else
  return std::isfinite(v);
#endif
}

// Everything the BN finalize step reads and writes, as raw pointers so the same
// per-channel routine runs in a CPU loop and in a CUDA block.
template <typename scalar_t>
struct FinalizeArgs {
  SampleSums sums;              // contraction giving each sample's conv sum, or...
  const double* sample_sums;    // ...[B, Co] those sums given (bias excluded); null: contract
  const double* energy;         // [R, Co, S] within-sample centred sums of squares, summed over
  int64_t energy_rows, splits;  // R (B, or 1 when summed over the batch) and S; null in eval
  const double* stats_in;       // [3, Co] (count, mean, m2) of the conv output (bias excluded)
                                // to normalize with instead of this batch's (docs/math.md §4.1)
  double* stats_out;            // [3, Co]: when set, this batch's stats are written here...
  double* sample_sums_out;      // ...with [B, Co] its sample sums, and nothing else is done
  const scalar_t* bias;         // conv bias [Co] or null
  const scalar_t* gamma;        // BN weight [Co] or null
  const scalar_t* beta;         // BN bias [Co] or null
  scalar_t* running_mean;       // [Co] or null (not tracked)
  scalar_t* running_var;
  scalar_t* out;  // [B, Co]
  int64_t batch, channels, spatial;
  double scale, momentum, eps;
  bool batch_stats;

  FO_HD double sample_sum(int64_t b, int64_t c) const {
    return sample_sums ? sample_sums[b * channels + c] : sums.conv_sum(b, c);
  }
};

// This participant's share (elements first, first + step, ... of its R S) of channel c's
// within-sample energies, where the batch's statistics are computed (else 0). Four loads in
// flight per round and no division where S is 1: summed one dependent load at a time with a
// 64-bit division each, the many rows per channel of the fused contraction's partial sums
// (810 on the seed problem) would lengthen the CUDA finalize markedly (docs/performance.md).
// The CUDA kernel takes its share first, before the sample sums.
template <typename scalar_t>
FO_HD double energy_part(const FinalizeArgs<scalar_t>& a, int64_t c, int64_t first, int64_t step) {
  if (!a.batch_stats || a.stats_in) return 0.0;
  const int64_t n = a.energy_rows * a.splits;
  auto value = [&](int64_t i) {
    return a.splits == 1 ? a.energy[i * a.channels + c]
                         : a.energy[((i / a.splits) * a.channels + c) * a.splits + i % a.splits];
  };
  double q[4] = {0, 0, 0, 0};
  int64_t i = first;
  for (; i + 3 * step < n; i += 4 * step) {
    for (int u = 0; u < 4; ++u) q[u] += value(i + u * step);
  }
  for (; i < n; i += step) q[0] += value(i);
  return (q[0] + q[1]) + (q[2] + q[3]);
}

// Count, mean and centred sum of squares of one channel's conv output (bias
// excluded) over the batch (docs/math.md §3): the within-sample energies (`energy`, this
// participant's energy_part) plus the spread of the sample means, never raw sums of squares
// that cancel.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename scalar_t, typename SampleSum, typename BlockSum>
FO_HD void batch_channel_stats(const FinalizeArgs<scalar_t>& a, int64_t first, int64_t step, double energy,
                               SampleSum sample_sum, BlockSum block_sum, double stats[3]) {
  const double n_sp = static_cast<double>(a.spatial);
  stats[0] = static_cast<double>(a.batch) * n_sp;
  double s = 0;
  for (int64_t b = first; b < a.batch; b += step) s += sample_sum(b);
  stats[1] = block_sum(s) / stats[0];
  double q = energy;
  for (int64_t b = first; b < a.batch; b += step) {
    const double d = sample_sum(b) / n_sp - stats[1];
    q += n_sp * d * d;
  }
  stats[2] = block_sum(q);
}

// How channel c's pooled outputs follow from the samples' conv sums:
// out = (scale * sum / spatial - shift) * inv_std * gamma + beta (docs/math.md §4).
struct ChannelNorm {
  double shift, inv_std, gamma, beta;
};

template <typename scalar_t>
FO_HD ChannelNorm channel_norm(const FinalizeArgs<scalar_t>& a, int64_t c, double shift,
                               double var_z) {
  return {shift, 1.0 / sqrt(var_z + a.eps), a.gamma ? static_cast<double>(a.gamma[c]) : 1.0,
          a.beta ? static_cast<double>(a.beta[c]) : 0.0};
}

// Eval mode: the running statistics, given for z = scale * (conv + bias).
template <typename scalar_t>
FO_HD ChannelNorm eval_channel_norm(const FinalizeArgs<scalar_t>& a, int64_t c) {
  const double bias = a.bias ? static_cast<double>(a.bias[c]) : 0.0;
  return channel_norm(a, c, static_cast<double>(a.running_mean[c]) - a.scale * bias,
                      static_cast<double>(a.running_var[c]));
}

// Eval mode's map of channel c folded into out = sample_sum * alpha + delta, so that
// all of it is known before the sums are (the CUDA eval finalize computes it while x
// is still being read): alpha = scale / spatial * inv_std * gamma, delta = beta -
// shift * inv_std * gamma. write_pooled's arithmetic regrouped (docs/math.md §4); only
// the double rounding differs.
struct EvalAffine {
  double alpha, delta;
};

template <typename scalar_t>
FO_HD EvalAffine eval_affine(const FinalizeArgs<scalar_t>& a, int64_t c) {
  const ChannelNorm n = eval_channel_norm(a, c);
  const double k = n.inv_std * n.gamma;
  return {a.scale / static_cast<double>(a.spatial) * k, n.beta - n.shift * k};
}

template <typename scalar_t>
FO_HD void write_pooled(const FinalizeArgs<scalar_t>& a, const ChannelNorm& n, int64_t b, int64_t c,
                        double sample_sum) {
  const double z_mean = a.scale * sample_sum / static_cast<double>(a.spatial);
  // As in finalize_channel: a non-finite sample mean is NaN, as PyTorch's pool of it.
  const double out = is_finite(z_mean) ? (z_mean - n.shift) * n.inv_std * n.gamma + n.beta : NAN;
  a.out[b * a.channels + c] = static_cast<scalar_t>(out);
}

// Finalizes channel c (docs/math.md §4). Work over the batch is split as
// b = first, first + step, ...; `energy` is this participant's energy_part; `sample_sum(b)`
// gives the conv sum of sample b (the CUDA kernel precomputes them cooperatively); `block_sum`
// must return the sum of its argument over all participants of the split (identity on the
// CPU, a block reduction on CUDA) and is called the same number of times by each.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // the callables are device lambdas on CUDA, host ones on the CPU
#endif
template <typename scalar_t, typename SampleSum, typename BlockSum>
FO_HD void finalize_channel(const FinalizeArgs<scalar_t>& a, int64_t c, int64_t first, int64_t step,
                            double energy, SampleSum sample_sum, BlockSum block_sum) {
  if (!a.batch_stats) {
    const ChannelNorm n = eval_channel_norm(a, c);
    for (int64_t b = first; b < a.batch; b += step) write_pooled(a, n, b, c, sample_sum(b));
    return;
  }
  double stats[3];
  if (a.stats_in) {
    for (int k = 0; k < 3; ++k) stats[k] = a.stats_in[k * a.channels + c];
  } else {
    batch_channel_stats(a, first, step, energy, sample_sum, block_sum, stats);
  }
  if (a.stats_out) {
    for (int64_t b = first; b < a.batch; b += step) {
      a.sample_sums_out[b * a.channels + c] = sample_sum(b);
    }
    if (first == 0) {
      for (int k = 0; k < 3; ++k) a.stats_out[k * a.channels + c] = stats[k];
    }
    return;
  }
  const double count = stats[0];
  double z_mu = a.scale * stats[1];
  double var_z = a.scale * a.scale * stats[2] / count;  // biased: what normalization uses
  // A non-finite input or scale makes the conv output hold infinities of both signs, whose
  // mean and variance are NaN in PyTorch's reductions; the sums' algebra would give an infinity.
  if (!is_finite(z_mu) || !is_finite(var_z)) z_mu = var_z = NAN;
  if (first == 0 && a.running_mean) {
    const double m = a.momentum;
    const double bias = a.bias ? static_cast<double>(a.bias[c]) : 0.0;
    a.running_mean[c] = static_cast<scalar_t>((1 - m) * a.running_mean[c] + m * (z_mu + a.scale * bias));
    a.running_var[c] =
        static_cast<scalar_t>((1 - m) * a.running_var[c] + m * var_z * count / (count - 1));
  }
  // The bias cancels between a sample's mean and the batch mean.
  const ChannelNorm n = channel_norm(a, c, z_mu, var_z);
  for (int64_t b = first; b < a.batch; b += step) write_pooled(a, n, b, c, sample_sum(b));
}

}  // namespace fused_ops
