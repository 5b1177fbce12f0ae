"""Autograd for ``fused_ops::ct_bn_pool``: the closed-form backward of ``docs/math.md`` §6.

The backward is made of ATen ops only, so AOTAutograd traces it and ``torch.compile``
compiles modules whose parameters require grad: in eval mode, contractions of x and the
weight with the per-dimension tap masks (``_box_sums.py``; no convolution, nothing of the
convolution output's size); in training mode, by the route ``_backward_routes.py`` picks, a
recomputed transposed convolution, reductions and ``aten.convolution_backward``, or a route
without the convolution output (``_gram_backward.py``, ``_spectral_backward.py``), or the
convolution output that the forward kept (``_kept_output.py``).

Why not ``torch.library.register_autograd``: it refuses operators whose schema mutates an
input ("Cannot register autograd formula for non-functional operator"), and ct_bn_pool
writes ``running_mean``/``running_var`` (``Tensor(a!)?``). So the two kernels that
``register_autograd`` and ``torch.library.custom_op`` would register are registered
directly:

- ``Autograd``: an ``autograd.Function`` around the op when a gradient can flow (Python,
  here), the op alone otherwise (C++; see below);
- ``ADInplaceOrView`` (``csrc/ops.cpp``, in C++ since it runs on every call): bumps the
  running statistics' version counters when the call writes them (``training=True``), as
  every in-place op does, so that autograd detects a saved tensor changed under it. Eval
  mode does not write them and does not bump them: a bump would invalidate, for nothing,
  graphs that saved them.

The Python kernel runs only when a gradient can flow (grad mode on and an input requiring
grad): ct_bn_pool's own Autograd kernel is C++ (``csrc/ops.cpp``), which goes below autograd
at once otherwise and else calls the overload ``_ct_bn_pool_differentiable`` of the same
schema, on which the Python kernel below is registered. Every inference call, also under
``torch.no_grad()``, thus stays in C++ (host time; ``docs/performance.md``).

PyTorch's compile caches (FX graph, AOTAutograd) key on the traced graph, not on these
kernels: after changing this file or ``_box_sums.py``, clear them or set
``TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0``, or a compiled backward of
the old formula may be reused.

Dtypes (docs/math.md §5): tensors of x's or the conv output's size stay in x's dtype, as in
PyTorch's own backward of the unfused modules (eval: the contractions over x's H and W planes,
``_box_sums.py``); per-channel, weight-sized and per-tap quantities are
computed in float32 for float16/bfloat16 inputs (in the inputs' dtype otherwise); each
gradient is returned in its input's dtype (BatchNorm's may be float32 for a float16 x).

``ct_bn_pool_stats`` and ``ct_bn_pool_apply`` (the halves of the synchronized training step)
have no backward (``csrc/ops.cpp``): a backward through the first raises, the second refuses
inputs requiring grad. The synchronized step as a whole is differentiated by ``distributed.py``'s
``autograd.Function``, with the training helpers below given the group's statistics and a
sum over the group (docs/math.md §6.2.1).
"""
import math

import torch
from torch import Tensor

from . import _backward_routes, _box_sums, _gram_backward, _kept_output, _spectral_backward
from ._fake import compute_dtype
from .distributed import conv_options, out_size

_LIB = torch.library.Library("fused_ops", "IMPL")  # kept alive: registrations live as long as it
# Positions in ct_bn_pool's schema (csrc/ops.cpp) of the arguments read here.
_RUNNING_MEAN, _RUNNING_VAR = 6, 7
_DIFFERENTIABLE = ("x", "weight", "bias", "bn_weight", "bn_bias")


def _schema_arguments(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                      training, momentum=0.1, eps=1e-5, *, stride=(1, 1, 1), padding=(0, 0, 0),
                      output_padding=(0, 0, 0), dilation=(1, 1, 1), groups=1, algo="auto"):
    """All of a call's arguments by name; the dispatcher leaves out trailing defaults."""
    return dict(locals())


def _no_stats_arguments(x, weight, bias, scale, bn_weight, bn_bias, eps=1e-5, *,
                        stride=(1, 1, 1), padding=(0, 0, 0), output_padding=(0, 0, 0),
                        dilation=(1, 1, 1), groups=1, algo="auto"):
    """A ``ct_bn_pool.no_stats`` call's arguments by name, with the default overload's
    values for what it leaves out (batch statistics, no running statistics)."""
    return dict(locals(), running_mean=None, running_var=None, training=True, momentum=0.0)


# Each overload of ct_bn_pool (csrc/ops.cpp) and the function naming its arguments.
_OVERLOADS = {
    "default": (torch.ops.fused_ops.ct_bn_pool.default, _schema_arguments),
    "no_stats": (torch.ops.fused_ops.ct_bn_pool.no_stats, _no_stats_arguments),
}


def _redispatch_below_autograd(overload, keyset, args, kwargs):
    op = _OVERLOADS[overload][0]
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)


class _CtBnPoolBackward(torch.autograd.Function):
    """Runs the op (below autograd) and differentiates it with docs/math.md §6."""

    @staticmethod
    def forward(ctx, keyset, overload, kwargs, *args):
        arguments = _OVERLOADS[overload][1]
        call = arguments(*args, **kwargs)
        training = call["training"]
        eval_stats = ()
        if not training:
            # Eval reads the running statistics and never writes them, so the op is given
            # copies, which are saved: the backward uses the values the forward normalized
            # with whatever happens to the buffers in between, and torch.compile sees no
            # mutation of the buffers. Given the buffers themselves, inductor (torch 2.14)
            # saves the reinplaced buffer for the backward and reuses its memory for a
            # gradient there, overwriting running_mean.
            eval_stats = tuple(None if stat is None else stat.clone()  # None: the op refuses
                               for stat in (call["running_mean"], call["running_var"]))
            args = (*args[:_RUNNING_MEAN], *eval_stats, *args[_RUNNING_VAR + 1:])
        ctx.conv = conv_options(call)
        keep = (_backward_routes.keeps(ctx.conv, call["weight"], call["x"])
                if training and _kept_output.can_keep(call) else None)
        if keep == "output":
            out, kept = _kept_output.forward(call)
        elif keep == "statistics":
            out, kept = _kept_output.forward_statistics(call)
        else:
            # Training normalizes with batch statistics: the backward recomputes them from the
            # inputs (the running statistics have been overwritten by then).
            out, kept = _redispatch_below_autograd(overload, keyset, args, kwargs), ()
        ctx.save_for_backward(call["x"], call["weight"], call["bias"], call["bn_weight"],
                              *eval_stats, *kept)
        ctx.training, ctx.scale, ctx.eps = training, call["scale"], call["eps"]
        ctx.names = arguments.__code__.co_varnames[:len(args)]  # of args, in order
        ctx.dtypes = {n: call[n].dtype for n in _DIFFERENTIABLE if call[n] is not None}
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, bn_weight, *rest = ctx.saved_tensors  # rest: eval's stats, or kept
        # needs_input_grad follows forward's inputs: keyset, overload, kwargs, then the op's
        # arguments.
        names = ctx.names
        needs = {n: ctx.needs_input_grad[3 + names.index(n)] for n in _DIFFERENTIABLE}
        saved = dict(x=x, weight=weight, bias=bias, bn_weight=bn_weight)
        if ctx.training:
            grads = _training_grads(ctx, grad_out, needs, **saved, kept=tuple(rest))
        else:
            grads = _eval_grads(ctx, grad_out, needs, running_mean=rest[0],
                                running_var=rest[1], **saved)
        grads = _in_input_dtypes(grads, needs, ctx.dtypes)
        return (None, None, None, *(grads.get(n) for n in names))


def _in_input_dtypes(grads: dict, needs: dict, dtypes: dict) -> dict:
    """The gradients asked for (``needs``), each in its input's dtype (``dtypes``)."""
    return {n: grad.to(dtypes[n]) for n, grad in grads.items() if needs.get(n) and grad is not None}


def _per_weight(per_channel: Tensor, weight: Tensor, groups: int) -> Tensor:
    """A per-output-channel [C_out] vector laid out like weight [C_in, C_out/G, 1, 1, 1]."""
    c_in, c_out_group = weight.shape[:2]
    by_group = per_channel.view(groups, 1, c_out_group)
    return by_group.expand(groups, c_in // groups, c_out_group).reshape(c_in, c_out_group, 1, 1, 1)


def _per_channel(weight_like: Tensor, groups: int) -> Tensor:
    """[C_out]: sums of a weight-shaped tensor over its input channels and taps."""
    c_in, c_out_group = weight_like.shape[:2]
    return weight_like.sum((2, 3, 4)).view(groups, c_in // groups, c_out_group).sum(1).reshape(-1)


def _convolution_backward(ctx, grad_y, x, weight, need_x, need_weight):
    c = ctx.conv
    return torch.ops.aten.convolution_backward.default(
        grad_y, x, weight, None, c["stride"], c["padding"], c["dilation"], True,
        c["output_padding"], c["groups"], [need_x, need_weight, False])[:2]


def _grouped(per_sample: Tensor, groups: int) -> Tensor:
    """[B, C, ...] as [B, groups, C / groups, ...]."""
    return per_sample.unflatten(1, (groups, -1))


def _weight_gradient_sums(g: Tensor, taps: Tensor, weight: Tensor, groups: int) -> Tensor:
    """G[ci, c, k] = sum_b g[b, c] T[b, ci, k] over the pairs (ci, c) of a group, laid out
    like the weight."""
    sums = torch.einsum("bgo,bgik->giok", _grouped(g, groups), _grouped(taps.flatten(2), groups))
    return sums.reshape(weight.shape)


def _input_gradient_taps(gk: Tensor, weight: Tensor, groups: int) -> Tensor:
    """H[b, ci, k] = sum_c gk[b, c] weight[ci, c, k] over a group's output channels:
    [B, Ci, kD, kH, kW]."""
    by_group = weight.flatten(2).unflatten(0, (groups, -1))  # [G, Ci/G, Co/G, K]
    taps = torch.einsum("bgo,giok->bgik", _grouped(gk, groups), by_group)
    return taps.reshape(gk.shape[0], weight.shape[0], *weight.shape[2:])


def _eval_grads(ctx, grad_out, needs, x, weight, bias, bn_weight, running_mean, running_var):
    """docs/math.md §6.1: the gradient wrt y is constant over positions, per (b, c), so x's
    and the weight's come from x's box sums per tap and their transpose, no convolution."""
    compute, groups = compute_dtype(x.dtype), ctx.conv["groups"]
    g = grad_out.flatten(1).to(compute)  # [B, C]
    size = out_size(x, weight, ctx.conv["stride"], ctx.conv["padding"],
                    ctx.conv["output_padding"], ctx.conv["dilation"])
    positions = size[0] * size[1] * size[2]
    inv_std = torch.rsqrt(running_var.to(compute) + ctx.eps)
    # gamma / sqrt(var + eps)
    gain = inv_std if bn_weight is None else bn_weight.to(compute) * inv_std
    coef = gain * (ctx.scale / positions)  # d out[b, c] / d y[b, c, o]
    g_sum = g.sum(0)
    grads = {"bn_bias": g_sum, "bias": g_sum * gain * ctx.scale}
    need_sums = needs["weight"] or needs["bn_weight"]
    if not (needs["x"] or need_sums):
        return grads
    masks = _box_sums.tap_masks(x, weight, size, ctx.conv, compute)
    weight_c = weight.to(compute)
    if needs["x"]:
        taps = _input_gradient_taps(g * coef, weight_c, groups)
        grads["x"] = _box_sums.spread(taps, masks, x.dtype)
    if need_sums:
        tap_sums = _weight_gradient_sums(g, _box_sums.box_sums(x, masks, compute), weight,
                                         groups)
        if needs["weight"]:
            grads["weight"] = tap_sums * _per_weight(coef, weight, groups)
        if needs["bn_weight"]:
            g_dot_sums = _per_channel(weight_c * tap_sums, groups)  # sum_b g S
            mean = running_mean.to(compute)
            shift = -mean if bias is None else bias.to(compute) * ctx.scale - mean
            grads["bn_weight"] = inv_std * (g_dot_sums * (ctx.scale / positions) + shift * g_sum)
    return grads


def _training_grads(ctx, grad_out, needs, x, weight, bias, bn_weight, stats=None,
                    all_reduce=None, kept=()):
    """docs/math.md §6.2: batch statistics, so the convolution output is needed: recomputed,
    kept by the forward (``kept``: y, its per-sample sums and statistics, §6.2.4) or not
    formed (§6.2.2, §6.2.3).

    The batch is x's own (``stats`` and ``all_reduce`` None) or, synchronized (§6.2.1), that
    of a process group: ``stats`` the float64 ``[3, C]`` (count, mean, M2) of the
    convolution output over the group's batch, which the forward normalized with, and
    ``all_reduce`` a function summing a ``[2, C]`` tensor over the group. The gradients of
    the BatchNorm parameters are this process's part, as ``nn.SyncBatchNorm`` returns them.
    """
    grads = {}
    if bias is not None:
        grads["bias"] = torch.zeros_like(bias)  # the batch mean removes it
    route = None
    if needs["x"] or needs["weight"] or needs["bn_weight"]:
        # A double backward (create_graph) differentiates this backward: what the forward kept
        # is a constant to autograd, so y and its statistics are recomputed from x and the
        # weight.
        create_graph = torch.is_grad_enabled()
        if create_graph:
            kept = ()
        route = _backward_routes.chosen(ctx.conv, weight, x, can_keep=len(kept) == 3,
                                        has_statistics=bool(kept), create_graph=create_graph)
    # Only a process's own batch keeps y or its statistics; "gram" from them runs in C++.
    if route == "kept" or (route == "gram" and len(kept) == 2):
        grads.update(_kept_output.backward(ctx, grad_out, needs, x, weight, bn_weight, kept))
        return grads
    g_sum = grad_out.to(compute_dtype(x.dtype)).sum(0).flatten()  # sum_b g
    grads["bn_bias"] = g_sum
    if route == "aten":
        grads.update(_normalized_output_grads(ctx, grad_out, needs, x, weight, bn_weight, g_sum,
                                              stats, all_reduce))
    elif route is not None:
        own = kept if len(kept) == 2 else None  # the forward's (sums, statistics)
        grads.update(_affine_output_grads(route, ctx, grad_out, needs, x, weight, bn_weight,
                                          g_sum, stats, all_reduce, own))
    return grads


def _batch_means(sums: Tensor, batch: int, positions, stats, all_reduce) -> Tensor:
    """[mean_b g, mean_b g zbar] from this process's [sum_b g, sum_b g zbar] ``sums``: over x's
    batch, or over the group's (§6.2.1), each sample weighted by its share N / n."""
    if all_reduce is not None:
        sums = all_reduce(sums)
    if stats is None:
        return sums / batch
    return sums * (positions / stats[0]).to(sums.dtype)


def _z_unit(ctx, var: Tensor) -> Tensor:
    """scale / sqrt(var_z + eps) for y's variance `var`: dzhat / dy."""
    return ctx.scale * torch.rsqrt(var * ctx.scale ** 2 + ctx.eps)


def _affine_output_grads(route, ctx, grad_out, needs, x, weight, bn_weight, g_sum,
                         stats=None, all_reduce=None, kept=None):
    """§6.2.2–§6.2.3: the gradients of :func:`_normalized_output_grads` from
    dL/dy = A + K (y - mean), a constant field and a K part, without the convolution output
    (``route`` "spectral" or "gram"; "kept", §6.2.4, is ``_kept_output.backward``).
    ``kept``: the forward's (sums, statistics) of x's batch, else computed here."""
    compute, c = compute_dtype(x.dtype), ctx.conv
    groups = c["groups"]
    # The sums and statistics of y (without bias), float64: [B, C] and [3, C].
    sums, own = kept if kept is not None else torch.ops.fused_ops.ct_bn_pool_stats(
        x, weight, stride=c["stride"], padding=c["padding"],
        output_padding=c["output_padding"], dilation=c["dilation"], groups=groups)
    count, mean, m2 = (own if stats is None else stats).unbind(0)
    var = m2 / count
    size = out_size(x, weight, c["stride"], c["padding"], c["output_padding"], c["dilation"])
    n = math.prod(size)
    z_unit = _z_unit(ctx, var)  # float64 [C]
    zbar = (z_unit * (sums / n - mean)).to(compute)  # [B, C]
    g = grad_out.flatten(1).to(compute)
    grads = {"bn_weight": (g * zbar).sum(0)}
    if not (needs["x"] or needs["weight"]):
        return grads
    means = _batch_means(torch.stack([g_sum, grads["bn_weight"]]), x.shape[0], n, stats,
                         all_reduce)  # every process of a group takes part, samples or not
    if x.shape[0] == 0:  # no sample here: nothing flows back to x or the weight
        grads.update({name: torch.zeros_like(t) for name, t in (("x", x), ("weight", weight))
                      if needs[name]})
        return grads
    z_unit = z_unit.to(compute)
    gain = z_unit if bn_weight is None else bn_weight.to(compute) * z_unit
    coef = gain / n
    field = coef * (g - means[0])  # A[b, c]
    k = -coef * means[1] * z_unit  # K_c
    if route == "gram":
        k_x, k_weight = _gram_backward.k_part(x, weight, k, mean, groups, needs["x"],
                                              needs["weight"])
    else:
        k_x, k_weight = _spectral_backward.k_part(x, weight, k, sums - n * mean, c, compute,
                                                  needs["x"], needs["weight"])
    # Both routes have padding 0: every tap reaches every position of x (§2.1), so the field's
    # contractions take x's and the weight's sums, and its x gradient is constant per (b, ci).
    if needs["x"]:
        w_sums = weight.to(compute).sum((2, 3, 4), keepdim=True)
        # k_x is the route's own: the field added in place, no second x-sized tensor.
        grads["x"] = k_x.add_(_input_gradient_taps(field, w_sums, groups))
    if needs["weight"]:
        x_sums = x.sum((2, 3, 4), dtype=compute)[..., None, None, None]
        tap_sums = x_sums.expand(-1, -1, *weight.shape[2:])
        grads["weight"] = _weight_gradient_sums(field, tap_sums, weight, groups) + k_weight
    return grads


def _normalized_conv_output(ctx, x, weight, stats=None):
    """(zhat, scale / sqrt(var_z + eps)): z = scale * conv_transpose3d(x, weight) recomputed
    and normalized, zhat = (z - mean_z) / sqrt(var_z + eps), with its batch statistics, or
    with the convolution output's (count, mean, M2) ``stats`` when given."""
    c = ctx.conv
    # The conv bias shifts z and its batch mean alike: it cancels, and is left out.
    y = torch.ops.aten.convolution.default(x, weight, None, c["stride"], c["padding"],
                                           c["dilation"], True, c["output_padding"], c["groups"])
    compute = compute_dtype(y.dtype)
    if stats is None:
        var, mean = torch.var_mean(y, dim=(0, 2, 3, 4), correction=0, keepdim=True)
    else:
        count, mean, m2 = stats.unbind(0)
        var = m2 / count
    var, mean = (v.to(compute).view(1, -1, 1, 1, 1) for v in (var, mean))
    z_unit = _z_unit(ctx, var)
    # One more [B, C, Do, Ho, Wo], in y's dtype.
    return torch.addcmul((-mean * z_unit).to(y.dtype), y, z_unit.to(y.dtype)), z_unit


def _normalized_output_grads(ctx, grad_out, needs, x, weight, bn_weight, g_sum, stats=None,
                             all_reduce=None):
    """Training mode's gradients that need zhat (§6.2; `stats`, `all_reduce`: as
    :func:`_training_grads`'s, g_sum: this process's sum_b g)."""
    zhat, z_unit = _normalized_conv_output(ctx, x, weight, stats)
    compute = z_unit.dtype
    g = grad_out.to(compute)  # [B, C, 1, 1, 1]
    g_zbar = g * zhat.mean((2, 3, 4), keepdim=True, dtype=compute)  # g * (pooled zhat)
    grads = {"bn_weight": g_zbar.sum(0).flatten()}
    if needs["x"] or needs["weight"]:
        positions = zhat.shape[2] * zhat.shape[3] * zhat.shape[4]  # N (zhat may have B = 0)
        # [2, C]: sum_b g, sum_b g zbar, then their means over the batch
        means = _batch_means(torch.stack([g_sum, grads["bn_weight"]]), zhat.shape[0], positions,
                             stats, all_reduce).view(2, 1, -1, 1, 1, 1)
        gamma = None if bn_weight is None else bn_weight.to(compute).view(1, -1, 1, 1, 1)
        gain = z_unit if gamma is None else gamma * z_unit
        coef = gain / positions  # gamma scale / (sqrt(var_z + eps) N)
        # grad_y = coef * (g - mean_b g - mean_b(g zbar) zhat): one more buffer, zhat freed.
        grad_y = torch.addcmul((coef * (g - means[0])).to(zhat.dtype), zhat,
                               (-coef * means[1]).to(zhat.dtype))
        del zhat
        grads["x"], grads["weight"] = _convolution_backward(ctx, grad_y, x, weight, needs["x"],
                                                            needs["weight"])
    return grads


def _reject_grad_on_running_stats(args) -> None:
    for index, name in ((_RUNNING_MEAN, "running_mean"), (_RUNNING_VAR, "running_var")):
        stat = args[index]
        if stat is not None and stat.requires_grad:
            # As F.batch_norm: statistics are not differentiable inputs.
            raise RuntimeError(f"ct_bn_pool is not differentiable with respect to {name}; "
                               f"it cannot have requires_grad=True")


def _requires_grad(args) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad
                                           for a in args)


def _ct_bn_pool_autograd(keyset, *args, **kwargs):
    if _requires_grad(args):
        _reject_grad_on_running_stats(args)
        return _CtBnPoolBackward.apply(keyset, "default", kwargs, *args)
    return _redispatch_below_autograd("default", keyset, args, kwargs)


def _ct_bn_pool_no_stats_autograd(keyset, *args, **kwargs):
    if _requires_grad(args):
        return _CtBnPoolBackward.apply(keyset, "no_stats", kwargs, *args)
    return _redispatch_below_autograd("no_stats", keyset, args, kwargs)


# ct_bn_pool's own Autograd kernel (csrc/ops.cpp) calls these overloads when a gradient can
# flow, and goes below autograd in C++ otherwise.
_LIB.impl("_ct_bn_pool_differentiable", _ct_bn_pool_autograd, "Autograd", with_keyset=True)
_LIB.impl("_ct_bn_pool_differentiable.no_stats", _ct_bn_pool_no_stats_autograd, "Autograd",
          with_keyset=True)
