"""The drop-in module for the ConvTranspose3d -> scale -> BatchNorm3d -> global pool pattern."""
import copy
import numbers

import torch
import torch.distributed as dist
from torch import nn

from .distributed import check_process_group
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

    Training statistics over several processes, as :class:`torch.nn.SyncBatchNorm`
    (``docs/distributed.md``): pass ``process_group`` (a torch.distributed ProcessGroup),
    or let ``batch_norm`` be an ``nn.SyncBatchNorm`` (``from_modules``, ``fused_ops.fuse``,
    or ``nn.SyncBatchNorm.convert_sync_batchnorm`` applied to a model holding this module),
    whose ``process_group`` is used, the default group when it is None, once
    torch.distributed is initialized. In training mode every process of the group must call
    the module; eval mode never communicates.

    Output: ``[B, out_channels, 1, 1, 1]``. Trains like the unfused pattern: gradients reach
    the conv's and the batch norm's parameters and x (``docs/math.md`` §6), except with
    statistics synchronized over several processes, which are forward only.
    """

    def __init__(self, in_channels, out_channels, kernel_size, scale_factor, eps=1e-5,
                 momentum=0.1, *, stride=1, padding=0, output_padding=0, groups=1, bias=True,
                 dilation=1, affine=True, track_running_stats=True, algo="auto",
                 process_group=None, device=None, dtype=None):
        super().__init__()
        conv = nn.ConvTranspose3d(in_channels, out_channels, kernel_size, stride=stride,
                                  padding=padding, output_padding=output_padding, groups=groups,
                                  bias=bias, dilation=dilation, device=device, dtype=dtype)
        bn = nn.BatchNorm3d(out_channels, eps=eps, momentum=momentum, affine=affine,
                            track_running_stats=track_running_stats, device=device, dtype=dtype)
        self._setup(conv, scale_factor, bn, algo, process_group)

    @classmethod
    def from_modules(cls, conv_transpose: nn.ConvTranspose3d, scale_factor: float,
                     batch_norm: nn.Module, algo: str = "auto",
                     process_group=None) -> "ConvTransposeBNPool3d":
        """Wraps existing modules; parameters and buffers are shared, not copied.

        ``batch_norm`` is an ``nn.BatchNorm3d`` or an ``nn.SyncBatchNorm``; with the latter
        training statistics are merged over its process group unless ``process_group``
        names another one.
        """
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(conv_transpose, scale_factor, batch_norm, algo, process_group)
        return self

    def _setup(self, conv, scale_factor, bn, algo, process_group):
        if not isinstance(conv, nn.ConvTranspose3d):
            raise TypeError(f"conv_transpose must be an nn.ConvTranspose3d, got {type(conv).__name__}")
        if not isinstance(bn, (nn.BatchNorm3d, nn.SyncBatchNorm)):
            raise TypeError("batch_norm must be an nn.BatchNorm3d or nn.SyncBatchNorm, got "
                            f"{type(bn).__name__}")
        if bn.num_features != conv.out_channels:
            raise ValueError(f"batch_norm has {bn.num_features} features but conv_transpose has "
                             f"{conv.out_channels} output channels")
        if not isinstance(scale_factor, numbers.Real):
            raise TypeError(f"scale_factor must be a Python number, got {type(scale_factor).__name__}")
        self.conv_transpose = conv
        self.batch_norm = bn
        self.scale_factor = float(scale_factor)
        self.algo = algo
        if process_group is not None:
            check_process_group(process_group)
        self.process_group = process_group

    def __deepcopy__(self, memo):
        # A process group is a communication handle, not state (and cannot be copied):
        # the copy talks over the same group.
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def extra_repr(self) -> str:
        pg = self.process_group
        synced = f", process_group=<{pg.size()} processes>" if pg is not None else ""
        return f"scale_factor={self.scale_factor}, algo={self.algo!r}{synced}"

    def sync_group(self):
        """The process group whose batches training mode normalizes over, or None (this
        process's batch): ``process_group`` if set, else that of an ``nn.SyncBatchNorm``
        ``batch_norm`` (see :func:`batch_norm_sync_group`)."""
        return batch_norm_sync_group(self.batch_norm, self.process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv_transpose
        return ct_bn_pool_by_module(x, conv.weight, conv.bias, self.scale_factor,
                                    self.batch_norm, self.training, self.process_group,
                                    algo=self.algo, **conv_transpose_options(conv))


def conv_transpose_options(conv: nn.ConvTranspose3d) -> dict:
    """The options of ``conv`` as :func:`ct_bn_pool` takes them."""
    return dict(stride=conv.stride, padding=conv.padding, output_padding=conv.output_padding,
                dilation=conv.dilation, groups=conv.groups)


def batch_norm_sync_group(bn: nn.Module, process_group=None):
    """The process group whose batches training mode normalizes over, or None (this
    process's batch): ``process_group`` if given, else, once torch.distributed is
    initialized, that of an ``nn.SyncBatchNorm`` ``bn`` (the default group if None), as
    nn.SyncBatchNorm decides."""
    if process_group is not None:
        return process_group
    if isinstance(bn, nn.SyncBatchNorm) and dist.is_available() and dist.is_initialized():
        return bn.process_group if bn.process_group is not None else dist.group.WORLD
    return None


def ct_bn_pool_by_module(x, weight, bias, scale, bn, training, process_group=None, **options):
    """:func:`ct_bn_pool` with the batch norm's arguments taken from ``bn`` (an
    ``nn.BatchNorm3d`` or ``nn.SyncBatchNorm``) as its ``forward`` takes them in mode
    ``training``: ``momentum=None`` is a cumulative average, ``track_running_stats=False``
    always uses batch statistics, ``num_batches_tracked`` counts (once the op has accepted
    the call), and training statistics are synchronized over
    ``batch_norm_sync_group(bn, process_group)``. ``options``: ct_bn_pool's keywords."""
    # The same decisions as nn.BatchNorm3d.forward.
    counting = training and bn.track_running_stats and bn.num_batches_tracked is not None
    if bn.momentum is None:
        factor = 1.0 / float(bn.num_batches_tracked + 1) if counting else 0.0
    else:
        factor = bn.momentum
    use_batch_stats = training or (bn.running_mean is None and bn.running_var is None)
    track = not training or bn.track_running_stats
    out = ct_bn_pool(
        x, weight, bias, scale, bn.weight, bn.bias,
        bn.running_mean if track else None, bn.running_var if track else None,
        use_batch_stats, factor, bn.eps,
        # nn.SyncBatchNorm syncs only in training mode (not for eval without running stats).
        process_group=batch_norm_sync_group(bn, process_group) if training else None,
        **options)
    if counting:
        bn.num_batches_tracked.add_(1)
    return out
