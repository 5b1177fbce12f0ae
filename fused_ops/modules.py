"""The drop-in module for the ConvTranspose3d -> scale -> BatchNorm3d -> global pool pattern."""
import numbers

import torch
from torch import nn

from .functional import ct_bn_pool


class ConvTransposeBNPool3d(nn.Module):
    r"""``AdaptiveAvgPool3d(1)(BatchNorm3d(ConvTranspose3d(x) * scale_factor))`` as one op.

    Holds real ``conv_transpose`` (:class:`torch.nn.ConvTranspose3d`) and ``batch_norm``
    (:class:`torch.nn.BatchNorm3d`) submodules under the names the unfused pattern uses,
    so ``state_dict`` loads both ways, and follows BatchNorm3d's semantics: ``.train()``
    uses batch statistics and updates the running ones, ``.eval()`` uses the running
    ones, ``num_batches_tracked`` counts, ``momentum=None`` is a cumulative average,
    ``track_running_stats=False`` always uses batch statistics.

    ``algo`` chooses how training mode gets the variance (see :func:`fused_ops.ct_bn_pool`).
    Output: ``[B, out_channels, 1, 1, 1]``. Forward only: ``backward`` through it raises.
    """

    def __init__(self, in_channels, out_channels, kernel_size, scale_factor, eps=1e-5,
                 momentum=0.1, *, stride=1, padding=0, output_padding=0, groups=1, bias=True,
                 dilation=1, affine=True, track_running_stats=True, algo="auto", device=None,
                 dtype=None):
        super().__init__()
        conv = nn.ConvTranspose3d(in_channels, out_channels, kernel_size, stride=stride,
                                  padding=padding, output_padding=output_padding, groups=groups,
                                  bias=bias, dilation=dilation, device=device, dtype=dtype)
        bn = nn.BatchNorm3d(out_channels, eps=eps, momentum=momentum, affine=affine,
                            track_running_stats=track_running_stats, device=device, dtype=dtype)
        self._setup(conv, scale_factor, bn, algo)

    @classmethod
    def from_modules(cls, conv_transpose: nn.ConvTranspose3d, scale_factor: float,
                     batch_norm: nn.BatchNorm3d, algo: str = "auto") -> "ConvTransposeBNPool3d":
        """Wraps existing modules; parameters and buffers are shared, not copied."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(conv_transpose, scale_factor, batch_norm, algo)
        return self

    def _setup(self, conv, scale_factor, bn, algo):
        if not isinstance(conv, nn.ConvTranspose3d):
            raise TypeError(f"conv_transpose must be an nn.ConvTranspose3d, got {type(conv).__name__}")
        if not isinstance(bn, nn.BatchNorm3d):
            raise TypeError(f"batch_norm must be an nn.BatchNorm3d, got {type(bn).__name__}")
        if bn.num_features != conv.out_channels:
            raise ValueError(f"batch_norm has {bn.num_features} features but conv_transpose has "
                             f"{conv.out_channels} output channels")
        if not isinstance(scale_factor, numbers.Real):
            raise TypeError(f"scale_factor must be a Python number, got {type(scale_factor).__name__}")
        self.conv_transpose = conv
        self.batch_norm = bn
        self.scale_factor = float(scale_factor)
        self.algo = algo

    def extra_repr(self) -> str:
        return f"scale_factor={self.scale_factor}, algo={self.algo!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, bn = self.conv_transpose, self.batch_norm
        # The same decisions as nn.BatchNorm3d.forward; num_batches_tracked is
        # counted only once the op has accepted the call.
        counting = self.training and bn.track_running_stats and bn.num_batches_tracked is not None
        if bn.momentum is None:
            factor = 1.0 / float(bn.num_batches_tracked + 1) if counting else 0.0
        else:
            factor = bn.momentum
        use_batch_stats = self.training or (bn.running_mean is None and bn.running_var is None)
        track = not self.training or bn.track_running_stats
        out = ct_bn_pool(
            x, conv.weight, conv.bias, self.scale_factor, bn.weight, bn.bias,
            bn.running_mean if track else None, bn.running_var if track else None,
            use_batch_stats, factor, bn.eps,
            stride=conv.stride, padding=conv.padding, output_padding=conv.output_padding,
            dilation=conv.dilation, groups=conv.groups, algo=self.algo,
        )
        if counting:
            bn.num_batches_tracked.add_(1)
        return out
