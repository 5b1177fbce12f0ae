"""Fake (meta) kernel of fused_ops::ct_bn_pool, for FakeTensor, torch.compile and export."""
import torch


@torch.library.register_fake("fused_ops::ct_bn_pool")
def _ct_bn_pool_fake(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                     training, momentum=0.1, eps=1e-5, *, stride=(1, 1, 1), padding=(0, 0, 0),
                     output_padding=(0, 0, 0), dilation=(1, 1, 1), groups=1, algo="auto"):
    torch._check(x.dim() == 5, lambda: f"ct_bn_pool: x must be a 5-D tensor, got {x.dim()}-D")
    torch._check(weight.dim() == 5, lambda: f"ct_bn_pool: weight must be 5-D, got {weight.dim()}-D")
    return x.new_empty((x.shape[0], weight.shape[1] * groups, 1, 1, 1))
