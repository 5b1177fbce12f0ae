"""Fake (meta) kernels of the fused_ops ops, for FakeTensor, torch.compile and export."""
import torch


@torch.library.register_fake("fused_ops::ct_bn_pool")
def _ct_bn_pool_fake(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                     training, momentum=0.1, eps=1e-5, *, stride=(1, 1, 1), padding=(0, 0, 0),
                     output_padding=(0, 0, 0), dilation=(1, 1, 1), groups=1, algo="auto"):
    torch._check(x.dim() == 5, lambda: f"ct_bn_pool: x must be a 5-D tensor, got {x.dim()}-D")
    torch._check(weight.dim() == 5, lambda: f"ct_bn_pool: weight must be 5-D, got {weight.dim()}-D")
    # In x's dtype, whatever the batch norm's (float32 for a float16 x, say).
    return x.new_empty((x.shape[0], weight.shape[1] * groups, 1, 1, 1))


@torch.library.register_fake("fused_ops::ct_bn_pool.no_stats")
def _ct_bn_pool_no_stats_fake(x, weight, bias, scale, bn_weight, bn_bias, eps=1e-5, *,
                              stride=(1, 1, 1), padding=(0, 0, 0), output_padding=(0, 0, 0),
                              dilation=(1, 1, 1), groups=1, algo="auto"):
    return _ct_bn_pool_fake(x, weight, bias, scale, bn_weight, bn_bias, None, None, True,
                            eps=eps, groups=groups)


@torch.library.register_fake("fused_ops::ct_bn_pool_stats")
def _ct_bn_pool_stats_fake(x, weight, *, stride=(1, 1, 1), padding=(0, 0, 0),
                           output_padding=(0, 0, 0), dilation=(1, 1, 1), groups=1, algo="auto"):
    torch._check(x.dim() == 5, lambda: f"ct_bn_pool: x must be a 5-D tensor, got {x.dim()}-D")
    torch._check(weight.dim() == 5, lambda: f"ct_bn_pool: weight must be 5-D, got {weight.dim()}-D")
    channels = weight.shape[1] * groups
    # float64 whatever x's dtype: the sums and statistics are accumulated in double.
    return (x.new_empty((x.shape[0], channels), dtype=torch.float64),
            x.new_empty((3, channels), dtype=torch.float64))


@torch.library.register_fake("fused_ops::ct_bn_pool_apply")
def _ct_bn_pool_apply_fake(sample_sums, stats, spatial, bias, scale, bn_weight, bn_bias,
                           running_mean, running_var, momentum, eps, dtype):
    torch._check(sample_sums.dim() == 2,
                 lambda: f"ct_bn_pool: sample_sums must be [B, C_out], got {sample_sums.dim()}-D")
    return sample_sums.new_empty((sample_sums.shape[0], sample_sums.shape[1], 1, 1, 1), dtype=dtype)


@torch.library.register_fake("fused_ops::ct_bn_pool_apply.no_stats")
def _ct_bn_pool_apply_no_stats_fake(sample_sums, stats, spatial, bias, scale, bn_weight, bn_bias,
                                    eps, dtype):
    return _ct_bn_pool_apply_fake(sample_sums, stats, spatial, bias, scale, bn_weight, bn_bias,
                                  None, None, 0.0, eps, dtype)
