// Training mode's backward without the convolution output where each output position is
// reached by at most one tap (padding 0, dilation (k - 1) < stride: kernel = stride
// upsampling among them; docs/math.md §6.2.3). A tap t and an input position i name one output
// position, y[b, c, (i, t)] = sum_ci x[b, ci, i] W_t[ci, c], so the gradients of
// dL/dy = field[b, c] + K_c (y - mean_c) are products with x's channel Gram matrix R or with
// M = sum_t W_t diag(K) W_t^T: GEMMs of x's size, never a tensor of the output's. Float64
// throughout: R carries x's mean, which the difference with mean_c Xsum cancels.
// fused_ops/_gram_backward.py is the same algebra in differentiable ATen ops (double backward,
// synchronized statistics).
#include "ct_bn_pool.h"

namespace fused_ops {

bool one_tap_per_position(const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
                          at::IntArrayRef dilation) {
  for (int d = 0; d < 3; ++d) {
    if (padding[d] != 0 || dilation[d] * (weight.size(2 + d) - 1) >= stride[d]) return false;
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> gram_gradients(const at::Tensor& field, const at::Tensor& k,
                                                  const at::Tensor& mean, const at::Tensor& x,
                                                  const at::Tensor& weight, int64_t groups,
                                                  std::array<bool, 2> output_mask) {
  const int64_t batch = x.size(0), cig = x.size(1) / groups, cog = weight.size(1);
  const at::Tensor xs = x.to(at::kDouble).reshape({batch, groups, cig, -1});  // [B, G, I, P]
  const at::Tensor w = weight.to(at::kDouble).reshape({groups, cig, cog, -1});  // [G, I, O, T]
  const at::Tensor kd = k.to(at::kDouble).view({groups, cog});
  const at::Tensor fd = field.to(at::kDouble).view({batch, groups, cog});
  const at::Tensor k_mean = kd * mean.to(at::kDouble).view({groups, cog});  // [G, O]
  at::Tensor grad_x, grad_weight;
  if (output_mask[0]) {
    // M x plus, per (b, ci), sum_c W_sum[ci, c] (field[b, c] - K_c mean_c).
    const at::Tensor w_rows = w.reshape({groups, cig, -1});
    const at::Tensor m = at::bmm(w.mul(kd.view({groups, 1, cog, 1})).reshape({groups, cig, -1}),
                                 w_rows.transpose(1, 2));
    const at::Tensor constant = at::matmul(w.sum(3), (fd - k_mean).unsqueeze(-1));  // [B, G, I, 1]
    grad_x = at::matmul(m, xs).add_(constant).view(x.sizes()).to(x.scalar_type());
  }
  if (output_mask[1]) {
    // K_c (R W_t - mean_c Xsum) plus, on every tap, sum_b field[b, c] x_sum[b, ci].
    const at::Tensor flat = xs.reshape({batch * groups, cig, -1});
    const at::Tensor r = at::bmm(flat, flat.transpose(1, 2)).view({batch, groups, cig, cig}).sum(0);
    const at::Tensor x_sums = xs.sum(3);  // [B, G, I]
    const at::Tensor per_pair = at::bmm(x_sums.permute({1, 2, 0}), fd.transpose(0, 1))  // [G, I, O]
                                    .sub_(x_sums.sum(0).unsqueeze(2) * k_mean.unsqueeze(1));
    grad_weight = at::matmul(r, w.reshape({groups, cig, -1}))
                      .view(w.sizes())
                      .mul_(kd.view({groups, 1, cog, 1}))
                      .add_(per_pair.unsqueeze(3))
                      .view(weight.sizes())
                      .to(weight.scalar_type());
  }
  return {grad_x, grad_weight};
}

}  // namespace fused_ops
