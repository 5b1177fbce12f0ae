#pragma once
// The per-channel coefficients of training mode's dL/dy = field[b, c] + k[c] (y - mean[c])
// (docs/math.md §6.2.2) and the BatchNorm's gradients, from the pooled output's gradient g and
// the batch's sums and statistics, as one routine per channel that the CPU runs in a loop and
// CUDA in a thread: as per-channel ATen ops it would be dozens of dispatcher calls (and CUDA
// launches), more host time on the small layers than their convolution.
#include <cmath>
#include <cstdint>

#include "common/macros.h"

namespace fused_ops {

// Raw pointers of AffineGradInputs (backend.h) in the compute dtype C.
template <typename C>
struct AffineGradArgs {
  const C* grad_out;           // [B, Co]: the pooled output's gradient g
  const C* bn_weight;          // [Co] gamma, or null (1)
  const double* sample_sums;   // [B, Co]: each sample's conv sum (bias excluded)
  const double* stats;         // [3, Co]: the batch's (count, mean, m2) of the conv output
  C* g_sum;                    // [Co]: sum_b g, the BatchNorm bias's gradient
  C* g_zbar;                   // [Co]: sum_b g zbar, the BatchNorm weight's gradient
  C* k;                        // [Co] -coef mean_b(g zbar) dzhat/dy, or null (no gradient of
                               // y asked: field and shift null too)
  C* field;                    // [B, Co] coef (g - mean_b g), or null
  C* shift;                    // [B, Co] field - k mean, or null
  int64_t batch, channels;
  double scale, eps, positions;
};

// Channel c's coefficients, in float64, rounded once as stored: zbar[b] = dzhat/dy
// (sample_sums[b] / positions - mean) is sample b's pooled zhat, dzhat/dy = scale /
// sqrt(scale^2 var + eps), coef = gamma dzhat/dy / positions.
template <typename C>
FO_HD void affine_grad_channel(const AffineGradArgs<C>& a, int64_t c) {
  const int64_t n = a.channels;
  const double mean = a.stats[n + c];
  const double z_unit = a.scale / sqrt(a.stats[2 * n + c] / a.stats[c] * a.scale * a.scale + a.eps);
  double g_sum = 0, g_zbar = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    const double g = static_cast<double>(a.grad_out[b * n + c]);
    g_sum += g;
    g_zbar += g * (z_unit * (a.sample_sums[b * n + c] / a.positions - mean));
  }
  a.g_sum[c] = static_cast<C>(g_sum);
  a.g_zbar[c] = static_cast<C>(g_zbar);
  if (!a.k) return;
  const double coef = (a.bn_weight ? static_cast<double>(a.bn_weight[c]) : 1.0) * z_unit / a.positions;
  // An empty batch has no gradient of y (k is then 0, not 0 / 0).
  const double g_mean = a.batch ? g_sum / a.batch : 0.0;
  const double k = a.batch ? -coef * (g_zbar / a.batch) * z_unit : 0.0;
  a.k[c] = static_cast<C>(k);
  for (int64_t b = 0; b < a.batch; ++b) {
    const double field = coef * (static_cast<double>(a.grad_out[b * n + c]) - g_mean);
    if (a.field) a.field[b * n + c] = static_cast<C>(field);
    if (a.shift) a.shift[b * n + c] = static_cast<C>(field - k * mean);
  }
}

}  // namespace fused_ops
