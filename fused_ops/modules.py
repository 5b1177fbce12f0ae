"""The drop-in module for the ConvTranspose3d -> scale -> BatchNorm3d -> global pool pattern."""
import copy
import numbers

import torch
import torch.distributed as dist
from torch import fx, nn

from .distributed import check_process_group
from .functional import call_op


class ConvTransposeBNPool3d(nn.Module):
    r"""``AdaptiveAvgPool3d(1)(BatchNorm3d(ConvTranspose3d(x) * scale_factor))`` as one op.

    Holds real ``conv_transpose`` (:class:`torch.nn.ConvTranspose3d`) and ``batch_norm``
    (:class:`torch.nn.BatchNorm3d`) submodules under the names the unfused pattern uses,
    so ``state_dict`` loads both ways, and follows BatchNorm3d's semantics: ``.train()``
    uses batch statistics and updates the running ones, ``.eval()`` uses the running
    ones, ``num_batches_tracked`` counts, ``momentum=None`` is a cumulative average,
    ``track_running_stats=False`` always uses batch statistics. As in the unfused pattern,
    the mode is ``batch_norm``'s own: freezing it alone (``module.batch_norm.eval()``, or
    the usual loop over a model's ``nn.BatchNorm3d`` modules) makes this module normalize
    with the running statistics and leave them alone.

    torch.fx (``fused_ops.fuse``, ``torch.fx.symbolic_trace``) records a call of this module
    as one ``call_module`` node, as for PyTorch's own modules: nothing is run or modified by
    the trace and the mode stays the batch norm's at each call. Traced by itself (the
    module as the trace's root), the graph calls the op with its submodules, read at each
    call.

    ``algo`` chooses how training mode gets the variance (see :func:`fused_ops.ct_bn_pool`).

    Training statistics over several processes, as :class:`torch.nn.SyncBatchNorm`
    (``docs/distributed.md``): pass ``process_group`` (a torch.distributed ProcessGroup),
    or let ``batch_norm`` be an ``nn.SyncBatchNorm`` (``from_modules``, ``fused_ops.fuse``,
    or ``nn.SyncBatchNorm.convert_sync_batchnorm`` applied to a model holding this module),
    whose ``process_group`` is used, the default group when it is None, once
    torch.distributed is initialized. In training mode every process of the group must call
    the module; eval mode never communicates.

    Output: ``[B, out_channels, 1, 1, 1]``. Trains like the unfused pattern: gradients reach
    the conv's and the batch norm's parameters and x (``docs/math.md`` §6), also with
    statistics synchronized over several processes, as through ``nn.SyncBatchNorm`` (one
    all-reduce per backward; ``docs/distributed.md``).
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
        """Wraps existing modules; parameters and buffers are shared, not copied. The new
        module's ``training`` flag is ``batch_norm``'s (whose mode decides the computation).

        ``batch_norm`` is an ``nn.BatchNorm3d`` or an ``nn.SyncBatchNorm``; with the latter
        training statistics are merged over its process group unless ``process_group``
        names another one.
        """
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(conv_transpose, scale_factor, batch_norm, algo, process_group)
        # The modules' mode: the batch norm's decides the computation (see forward).
        self.training = batch_norm.training
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
        if isinstance(x, fx.Proxy):  # torch.fx is tracing a model that holds this module
            return _traced_call(self, (x,), self._traced_as_root)
        return _ct_bn_pool_modules(x, self.conv_transpose, self.scale_factor, self.batch_norm,
                                   self.algo, self.process_group)

    def _traced_as_root(self, x):
        """The graph of this module traced by itself: its call, with its submodules read
        at each call (the batch norm's mode included), as its forward reads them."""
        if self.process_group is not None:
            raise RuntimeError(
                "ConvTransposeBNPool3d: torch.fx cannot trace this module by itself while it "
                "has a process_group (a graph cannot hold one); trace a model that holds it, "
                "where it is one call_module node")
        tracer = x.tracer
        conv = tracer.create_proxy("get_attr", "conv_transpose", (), {})
        bn = tracer.create_proxy("get_attr", "batch_norm", (), {})
        return tracer.create_proxy("call_function", _ct_bn_pool_modules,
                                   (x, conv, self.scale_factor, bn, self.algo), {})


def _ct_bn_pool_modules(x, conv, scale, bn, algo="auto", process_group=None):
    """ConvTransposeBNPool3d's computation from its modules, in the batch norm's own mode
    (``bn.training``), as the unfused modules compute it: BatchNorm3d's flag decides, so that
    ``bn.eval()`` alone (freezing the batch norm) takes effect.

    The graph of a ConvTransposeBNPool3d traced by itself calls this function; traced again
    (``fuse`` of that graph, or ``torch.load`` of it, which re-traces the saved code), the
    call is recorded as it is, not traced through."""
    if isinstance(x, fx.Proxy):
        return x.tracer.create_proxy("call_function", _ct_bn_pool_modules,
                                     (x, conv, scale, bn, algo), {})
    return ct_bn_pool_by_module(x, conv.weight, conv.bias, scale, bn, bn.training,
                                process_group, algo=algo, **conv_transpose_options(conv))


def _traced_call(module, args, as_root=None):
    """What ``module``'s forward returns when torch.fx traces a call of it (an ``fx.Proxy``
    among ``args``): a ``call_module`` node, as for a leaf module, whatever the tracer's
    leaf rule. Tracing through the forward would bake the mode of the moment into the graph
    and run the running statistics' bookkeeping on proxies (``num_batches_tracked`` counted
    by the trace itself). ``as_root(*args)``: the graph where ``module`` is the traced
    module itself (no path to call); without it that is refused."""
    tracer = next(a for a in args if isinstance(a, fx.Proxy)).tracer
    try:
        path = tracer.path_of_module(module)
    except NameError:
        raise RuntimeError(
            f"{type(module).__name__}: torch.fx traced a call of this module, which is not a "
            "submodule of the module being traced; register it as a submodule (an attribute "
            "of an nn.Module) so that the graph can call it") from None
    if path:
        return tracer.create_proxy("call_module", path, tuple(args), {})
    if as_root is None:
        raise RuntimeError(
            f"{type(module).__name__}: torch.fx cannot trace this module by itself (it is a "
            "part of a model; its graph is one call of it); trace the model that holds it")
    return as_root(*args)


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
        factor = float(bn.momentum)
    use_batch_stats = training or (bn.running_mean is None and bn.running_var is None)
    track = not training or bn.track_running_stats
    # nn.SyncBatchNorm syncs only in training mode (not for eval without running stats).
    group = batch_norm_sync_group(bn, process_group) if training else None
    if group is not None:
        check_process_group(group)
    # The modules' options are ConvTranspose3d's own (checked by it): the op's lean path.
    out = call_op(x, weight, bias, float(scale), bn.weight, bn.bias,
                  bn.running_mean if track else None, bn.running_var if track else None,
                  use_batch_stats, factor, float(bn.eps), options, group)
    if counting:
        bn.num_batches_tracked.add_(1)
    return out

