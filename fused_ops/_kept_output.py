"""Training mode's "kept" route (docs/dispatch.md, docs/math.md §6.2.4): when a gradient will
flow, the forward forms the convolution output y once with ATen's convolution, takes the
batch statistics from it, and keeps it for the backward.

Where the backward's only route is ``convolution_backward`` of a field affine in y, it needs
y; the op's own forward never forms it, so the ``aten`` route computes it again. On the CPU
the op's statistics cost a convolution themselves (``sliced_conv``) or about as much
(``correlation``), so a step there ran two convolutions and a ``convolution_backward``
against the unfused modules' one and one. Keeping y costs what the unfused modules keep (the
BatchNorm's input), and the backward's field is one pass over it.

Both halves are ops of their own (``csrc/kept/kept.cpp``; opaque to AOTAutograd, with fake
kernels): ``_ct_bn_pool_kept_stats`` forms y (TF32 off on CUDA, as the op's statistics are
float32-exact) with its statistics, accumulated as the op's (float64), and
``_ct_bn_pool_kept_backward`` the gradients. Written in Python, their few dozen per-channel
ATen ops cost the small layers this route serves more host time than the convolution; y is
contiguous, in x's dtype, as the unfused modules' convolution gives it.

The conv-free routes ("gram", "spectral", docs/math.md §6.2.2–§6.2.3) need no y, only the
batch's per-sample sums and statistics; a forward that knows its backward takes one keeps
those (``forward_statistics``), so the backward does not compute them again. From them
``_ct_bn_pool_kept_backward`` also runs "gram" (its coefficients are the kept route's; x's
Gram algebra replaces ``convolution_backward``).
"""
import math

import torch
from torch import Tensor

from . import _fake
from .distributed import conv_options, out_size


def can_keep(call: dict) -> bool:
    """Only ``algo="auto"`` (a forced algorithm computes the statistics its way), 5-D x and
    weight (the route is chosen from their sizes; other ranks are the op's to refuse, with its
    message) and a non-empty batch (the op's own empty-batch semantics)."""
    x, weight = call["x"], call["weight"]
    return call["algo"] == "auto" and x.dim() == 5 and weight.dim() == 5 and x.shape[0] > 0


def _check(call: dict) -> None:
    """The op's checks (its fake kernel's statement of csrc/validate.cpp)."""
    _fake._validate_inputs(
        call["x"], call["weight"], call["bias"], call["bn_weight"], call["bn_bias"],
        call["running_mean"], call["running_var"], call["training"], call["eps"],
        call["stride"], call["padding"], call["output_padding"], call["dilation"],
        call["groups"])


def _apply(call: dict, sums: Tensor, stats: Tensor, positions: int) -> Tensor:
    """The op's output and running-statistics update from the batch's ``sums`` and
    ``stats`` (ct_bn_pool_apply); ``positions``: the convolution output's spatial size."""
    args = (sums, stats, positions, call["bias"], call["scale"], call["bn_weight"],
            call["bn_bias"])
    try:
        # Both None: the overload without them; one alone goes to apply, which refuses it.
        if call["running_mean"] is None and call["running_var"] is None:
            return torch.ops.fused_ops.ct_bn_pool_apply.no_stats(*args, call["eps"],
                                                                 call["x"].dtype)
        return torch.ops.fused_ops.ct_bn_pool_apply(
            *args, call["running_mean"], call["running_var"], call["momentum"], call["eps"],
            call["x"].dtype)
    except (RuntimeError, ValueError) as error:
        refused = error
    _check(call)  # the op's own message where the op refuses the call, not chained to apply's
    raise refused


def forward(call: dict) -> tuple:
    """(out, (y, sample_sums, stats)): the op's output and running-statistics update, computed
    through y, and what the backward keeps.

    Bad input fails as the op fails, and nothing is written: the statistics' op checks x, the
    weight and the geometry as the op does (csrc/validate.cpp), ct_bn_pool_apply the rest
    before it writes the running statistics, and where it refuses, :func:`_check` raises the
    op's own wording (apply's names its own arguments). Checks in Python up front would cost
    every call their host time."""
    y, sums, stats = torch.ops.fused_ops._ct_bn_pool_kept_stats(
        call["x"], call["weight"], **conv_options(call))
    return _apply(call, sums, stats, y.shape[2] * y.shape[3] * y.shape[4]), (y, sums, stats)


def forward_statistics(call: dict) -> tuple:
    """(out, (sample_sums, stats)): the op's output and running-statistics update from its own
    statistics (ct_bn_pool_stats, the algorithm ``auto`` picks), which the backward keeps;
    checked as :func:`forward`, but for one value per channel, which the statistics' op takes
    (a process's share of a synchronized batch may be one value) and the op refuses."""
    conv = conv_options(call)
    sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(call["x"], call["weight"], **conv)
    positions = math.prod(out_size(call["x"], call["weight"], conv["stride"], conv["padding"],
                                   conv["output_padding"], conv["dilation"]))
    if call["x"].shape[0] * positions == 1:
        _check(call)
    return _apply(call, sums, stats, positions), (sums, stats)


def backward(ctx, grad_out: Tensor, needs: dict, x: Tensor, weight: Tensor, bn_weight,
             kept: tuple) -> dict:
    """The gradients of x, the weight (as ``needs`` asks) and the BatchNorm's parameters from
    dL/dy = A + K (y - mean) (docs/math.md §6.2.2): over the kept y (``kept`` = (y, sums,
    stats)), or from the kept statistics alone (``kept`` = (sums, stats)) where one tap
    reaches each output position ("gram", §6.2.3); in the compute dtype."""
    y, sums, stats = kept if len(kept) == 3 else (None, *kept)
    c = ctx.conv
    kept_backward = torch.ops.fused_ops._ct_bn_pool_kept_backward
    grad_x, grad_weight, grad_bn_weight, grad_bn_bias = kept_backward(
        grad_out, x, weight, bn_weight, y, sums, stats, ctx.scale, ctx.eps, stride=c["stride"],
        padding=c["padding"], output_padding=c["output_padding"], dilation=c["dilation"],
        groups=c["groups"], output_mask=[needs["x"], needs["weight"]])
    grads = {"bn_weight": grad_bn_weight, "bn_bias": grad_bn_bias}
    if needs["x"]:
        grads["x"] = grad_x
    if needs["weight"]:
        grads["weight"] = grad_weight
    return grads
