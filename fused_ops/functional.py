"""The functional form of the fused operator."""
import numbers
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from . import distributed

IntOrTriple = Union[int, Sequence[int]]

def _triple(value: IntOrTriple, name: str) -> tuple:
    if type(value) is tuple and len(value) == 3 and all(type(v) is int for v in value):
        return value  # ConvTranspose3d's own form: the common case, checked cheaply
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * 3
    items = tuple(value)
    if len(items) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"ct_bn_pool: {name} must be an int or 3 ints (D, H, W), got {value!r}")
    return items


def ct_bn_pool(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    scale: float,
    bn_weight: Optional[Tensor],
    bn_bias: Optional[Tensor],
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    stride: IntOrTriple = 1,
    padding: IntOrTriple = 0,
    output_padding: IntOrTriple = 0,
    dilation: IntOrTriple = 1,
    groups: int = 1,
    algo: str = "auto",
    process_group=None,
) -> Tensor:
    r"""``adaptive_avg_pool3d(batch_norm(scale * conv_transpose3d(x, weight, bias, ...)), 1)``.

    Computes the pooled output, shape ``[B, C_out, 1, 1, 1]``, without forming the
    convolution output (``docs/math.md``). Results match PyTorch's modules to the
    rounding of ``x``'s dtype.

    Args:
        x: input ``[B, C_in, D, H, W]``: float16, bfloat16, float32 or float64. The
            output has its dtype.
        weight: ConvTranspose3d weight ``[C_in, C_out / groups, kD, kH, kW]``, x's dtype.
        bias: conv bias ``[C_out]`` or None, x's dtype.
        scale: the Python number the conv output is multiplied by.
        bn_weight, bn_bias: BatchNorm affine parameters ``[C_out]`` or None (``affine=False``).
            They and the running statistics share one dtype: x's, or float32 for a float16
            or bfloat16 x (as PyTorch's batch norm allows).
        running_mean, running_var: BatchNorm running statistics ``[C_out]``, or None for
            ``track_running_stats=False``. Updated in place, in their own dtype, when
            ``training`` is True.
        training: True normalizes with the batch statistics (biased variance over
            ``B * Do * Ho * Wo`` values per channel) and updates the running statistics;
            False normalizes with the running statistics, which are then required.
        momentum: running-stat update factor, as ``F.batch_norm``'s (for
            ``momentum=None`` in a module pass ``1 / num_batches_tracked``).
        eps: added to the variance; must be > 0 in training, >= 0 in eval where this
            torch's ``F.batch_norm`` accepts 0 (torch 2.11 refuses it in eval too).
        stride, padding, output_padding, dilation: ConvTranspose3d options, an int or 3 ints.
        groups: ConvTranspose3d groups.
        algo: how training mode gets the per-channel variance, never forming the conv
            output (``docs/math.md`` §3): ``"auto"`` (default) picks per device and problem by
            the rule in ``docs/dispatch.md``; or one of ``"direct"``, ``"sliced_conv"``,
            ``"fft"`` (CUDA only), ``"correlation"``, ``"cross_spectrum"``, ``"border"``
            (the README's algorithm table says what each computes and where it applies). Each
            is as accurate as the input dtype's rounding allows; ``docs/math.md`` §5 and §3.6
            bound the error for inputs far from zero mean. A forced algorithm where it does
            not apply raises ValueError. Eval mode needs no convolution and ignores it.
        process_group: a ``torch.distributed`` ProcessGroup, or None (the default: this
            process's batch only). With a group and ``training=True`` the batch statistics
            are those of the union of the batches of all the group's processes, as
            ``nn.SyncBatchNorm`` computes them (``docs/distributed.md``): every process of
            the group must make the call (one all-gather of ``[3, C_out]`` float64 per call),
            batch sizes may differ, and the running statistics are updated from the global
            statistics. ``training=False`` never communicates; a group of one process is the
            plain op.

    Raises:
        RuntimeError: for mismatched shapes, dtypes or devices.
        ValueError: for bad values (negative eps, unknown ``algo``, training with one value
            per channel, ...). Nothing is modified by a rejected call.

    Autograd: gradients flow to ``x``, ``weight``, ``bias``, ``bn_weight`` and ``bn_bias``
    (closed form, ``docs/math.md`` §6; traced by ``torch.compile``). Eval mode's backward
    runs no convolution; training mode's takes the route of ``docs/dispatch.md`` (a
    recomputed convolution output and ATen's ``convolution_backward``, or a route without
    the convolution output). ``running_mean``/``running_var`` are not differentiable (one
    that requires grad is refused). With ``process_group`` over several
    processes in training mode the backward is ``nn.SyncBatchNorm``'s (``docs/math.md``
    §6.2.1): a collective too (one all-reduce of ``[2, C_out]`` when x's or ``weight``'s
    gradient is needed), which every process of the group must run; the parameters'
    gradients are this process's part (DDP averages them); no ``create_graph=True``.
    """
    if not isinstance(scale, numbers.Real):
        raise TypeError(f"ct_bn_pool: scale must be a Python number, got {type(scale).__name__}")
    conv = dict(stride=_triple(stride, "stride"), padding=_triple(padding, "padding"),
                output_padding=_triple(output_padding, "output_padding"),
                dilation=_triple(dilation, "dilation"), groups=int(groups), algo=algo)
    if process_group is not None:
        distributed.check_process_group(process_group)
    return call_op(x, weight, bias, float(scale), bn_weight, bn_bias, running_mean, running_var,
                   bool(training), float(momentum), float(eps), conv, process_group)


def _eval_accepts_zero_eps() -> bool:
    """Whether this torch's F.batch_norm takes eps = 0 in eval mode (the op then does too,
    as the modules it replaces; older versions refuse it in both modes)."""
    one = torch.ones(1)
    try:
        torch.nn.functional.batch_norm(torch.zeros(2, 1), one - 1, one, training=False, eps=0.0)
    except (ValueError, RuntimeError):
        return False
    return True


_EVAL_ACCEPTS_ZERO_EPS = _eval_accepts_zero_eps()
_OP = torch.ops.fused_ops.ct_bn_pool.default
_OP_NO_STATS = torch.ops.fused_ops.ct_bn_pool.no_stats


def call_op(x, weight, bias, scale: float, bn_weight, bn_bias, running_mean, running_var,
            training: bool, momentum: float, eps: float, conv: dict, process_group=None):
    """The op for checked arguments (:func:`ct_bn_pool`'s, ``conv`` its keywords from
    ``stride`` to ``algo``): the path every call takes, kept lean (host time, docs/performance.md)."""
    if eps == 0.0 and not training and not _EVAL_ACCEPTS_ZERO_EPS:
        raise ValueError(f"batch_norm eps must be positive, but got {eps}")
    if process_group is not None and training and torch.distributed.get_world_size(process_group) > 1:
        return distributed.synced_ct_bn_pool(
            x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
            momentum, eps, process_group=process_group, **conv)
    if training and running_mean is None and running_var is None:
        # Nothing to update: the overload without running statistics (csrc/ops.cpp).
        return _OP_NO_STATS(x, weight, bias, scale, bn_weight, bn_bias, eps, **conv)
    return _OP(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var, training,
               momentum, eps, **conv)
