"""Training statistics over several processes (SyncBatchNorm semantics) for ``ct_bn_pool``.

The training step is split in two ops (``docs/math.md`` §4.1): ``ct_bn_pool_stats`` gives
this process's per-sample sums and per-channel ``(count, mean, M2)``; the ``[3, C]`` stats of
every process of the group are gathered in ONE collective, merged here identically on every
rank, and ``ct_bn_pool_apply`` finalizes with the merged (global) statistics, updating the
running statistics from them. When a gradient can flow, an ``autograd.Function`` wraps the
step: its backward, like ``nn.SyncBatchNorm``'s, sums two per-channel sums over the group in
ONE all-reduce (``docs/math.md`` §6.2.1). ``docs/distributed.md`` is the user-facing
description.
"""
import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ._autocast import as_under_autocast

# The differentiable arguments of synced_ct_bn_pool, in order, and its convolution options.
_DIFFERENTIABLE = ("x", "weight", "bias", "bn_weight", "bn_bias")
_CONV = ("stride", "padding", "output_padding", "dilation", "groups")


def check_process_group(process_group) -> None:
    """Raises unless `process_group` is a ProcessGroup this process belongs to."""
    # dist.new_group hands processes outside the group this sentinel (an int) instead.
    if dist.is_available() and process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("ct_bn_pool: this process is not a member of process_group "
                         "(dist.new_group returned GroupMember.NON_GROUP_MEMBER)")
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError("ct_bn_pool: process_group must be a torch.distributed ProcessGroup "
                        f"(e.g. dist.group.WORLD or dist.new_group(...)), got "
                        f"{type(process_group).__name__}")
    # A non-member would skip the collective and silently use only its own batch.
    if dist.get_rank(process_group) < 0:
        raise ValueError("ct_bn_pool: this process is not a member of process_group")


def conv_options(call: dict) -> dict:
    """The convolution options of a call's arguments, by name."""
    return {k: call[k] for k in _CONV}


def out_size(x: Tensor, weight: Tensor, stride, padding, output_padding, dilation) -> list:
    """[Do, Ho, Wo] of the ConvTranspose3d output (docs/math.md, top), from shapes only."""
    return [(x.shape[2 + d] - 1) * stride[d] - 2 * padding[d]
            + dilation[d] * (weight.shape[2 + d] - 1) + output_padding[d] + 1 for d in range(3)]


def out_spatial(x: Tensor, weight: Tensor, stride, padding, output_padding, dilation) -> int:
    """Do * Ho * Wo of the ConvTranspose3d output, from shapes only."""
    depth, height, width = out_size(x, weight, stride, padding, output_padding, dilation)
    return depth * height * width


def all_gather_stats(stats: Tensor, process_group) -> Tensor:
    """[world, 3, C]: every rank's [3, C] stats, in rank order; the call's one collective.

    ``all_gather_into_tensor`` into a contiguous ``[world * 3, C]`` buffer (the concatenated
    form, which gloo supports too, and which every torch this builds against has). With ``async_op=False`` ProcessGroupNCCL launches it on the
    current stream (pytorch/pytorch#150398; before that, on its own stream joined to the
    current one), so the ops that follow are ordered after it without a host wait.
    """
    world = dist.get_world_size(process_group)
    out = stats.new_empty((world * stats.shape[0], stats.shape[1]))
    # Detached: the op has no gradient anyway, and a collective cannot write a tensor
    # that requires grad into `out` (gloo copies through views of it).
    dist.all_gather_into_tensor(out, stats.detach().contiguous(), group=process_group)
    return out.view(world, *stats.shape)


def merge_stats(gathered: Tensor) -> Tensor:
    """(count, mean, M2) [3, C] of the union of the batches whose stats are `gathered`
    [R, 3, C], in float64.

    Folding the parallel-variance formula of docs/math.md §4.1 over the R batches gives
    ``n = sum n_r``, ``mu = sum n_r mu_r / n`` and ``M2 = sum M2_r + sum n_r (mu_r - mu)^2``;
    that closed form is computed here in a fixed number of ops whatever R is. Every term is
    centred, so nothing cancels; every rank runs the same ops on the same tensor and gets
    bit-identical statistics. Batches with count 0 contribute nothing.
    """
    count, mean, m2 = gathered.double().unbind(1)
    total = count.sum(0)
    present = count > 0
    mu = torch.where(present, count * mean, 0).sum(0) / total
    delta = torch.where(present, mean - mu, 0)
    spread = m2.sum(0) + (count * delta * delta).sum(0)
    return torch.stack([total, mu, spread])


def check_count(merged: Tensor, local_count: int) -> None:
    """Raises PyTorch's ValueError when the global batch has one value per channel.

    A process with more than one value makes the global count larger still, so only a
    process with at most one reads the merged count (a device-to-host copy); since every
    process of a group with a global count <= 1 is such a process, all of them raise.
    """
    if local_count > 1:
        return
    count = int(merged[0, 0].item())
    if count <= 1:
        raise ValueError("Expected more than 1 value per channel when training, got "
                         f"{count} value(s) per channel over the process group (this process: "
                         f"{local_count})")


def all_reduce_sums(sums: Tensor, process_group) -> Tensor:
    """`sums` [2, C] summed over the processes of `process_group`: the backward's one
    collective, in place (`sums` is the backward's own buffer). As for the all-gather, with
    ``async_op=False`` NCCL orders it on the current stream, without a host wait."""
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=process_group)
    return sums


def synced_ct_bn_pool(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                      momentum, eps, *, stride, padding, output_padding, dilation, groups, algo,
                      process_group) -> Tensor:
    """Training-mode ``ct_bn_pool`` normalizing with the statistics of the whole group's batch.

    Arguments as ``fused_ops.ct_bn_pool`` (options as 3-lists). Every rank of
    `process_group` must call it (a collective); x's batch size and spatial size may differ
    between ranks. The running statistics are updated from the global statistics, so they
    stay equal on every rank. Differentiable when a gradient can flow, as the plain op: the
    backward is a collective too (one all-reduce when x's or the weight's gradient is
    needed), so every rank must run it.
    """
    return as_under_autocast(_synced_ct_bn_pool, x, weight, bias, scale, bn_weight, bn_bias,
                             running_mean, running_var, momentum, eps, stride=stride,
                             padding=padding, output_padding=output_padding, dilation=dilation,
                             groups=groups, algo=algo, process_group=process_group)


def _synced_ct_bn_pool(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                       momentum, eps, *, stride, padding, output_padding, dilation, groups, algo,
                       process_group) -> Tensor:
    # Imported here: _autograd imports this module.
    from ._autograd import _reject_grad_on_running_stats, _requires_grad
    call = dict(scale=scale, running_mean=running_mean, running_var=running_var,
                momentum=momentum, eps=eps, stride=stride, padding=padding,
                output_padding=output_padding, dilation=dilation, groups=groups, algo=algo,
                process_group=process_group)
    tensors = (x, weight, bias, bn_weight, bn_bias)
    # In the plain op's argument order, which the checks of _autograd index.
    op_args = (x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var)
    if _requires_grad(op_args):
        _reject_grad_on_running_stats(op_args)
        return _SyncedCtBnPool.apply(call, *tensors)
    return _synced_forward(*tensors, **call)[0]


def _synced_forward(x, weight, bias, bn_weight, bn_bias, *, scale, running_mean, running_var,
                    momentum, eps, stride, padding, output_padding, dilation, groups, algo,
                    process_group):
    """(output, merged [3, C] float64 statistics of the group's convolution output)."""
    sample_sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(
        x, weight, stride=stride, padding=padding, output_padding=output_padding,
        dilation=dilation, groups=groups, algo=algo)
    spatial = out_spatial(x, weight, stride, padding, output_padding, dilation)
    merged = merge_stats(all_gather_stats(stats, process_group))
    # Before apply, which writes the running statistics: a rejected call changes nothing.
    check_count(merged, x.shape[0] * spatial)
    if running_mean is None and running_var is None:
        # Nothing to update: the overload that mutates nothing (csrc/ops.cpp, as the
        # functional's ct_bn_pool.no_stats).
        out = torch.ops.fused_ops.ct_bn_pool_apply.no_stats(
            sample_sums, merged, spatial, bias, scale, bn_weight, bn_bias, eps, x.dtype)
    else:
        out = torch.ops.fused_ops.ct_bn_pool_apply(
            sample_sums, merged, spatial, bias, scale, bn_weight, bn_bias, running_mean,
            running_var, momentum, eps, x.dtype)
    return out, merged


class _SyncedCtBnPool(torch.autograd.Function):
    """The synchronized training step and its backward (docs/math.md §6.2.1): the training
    backward of ``_autograd.py`` with the forward's global statistics, its two per-channel
    sums all-reduced over the group, as ``nn.SyncBatchNorm``'s backward does."""

    @staticmethod
    def forward(ctx, call, x, weight, bias, bn_weight, bn_bias):
        out, merged = _synced_forward(x, weight, bias, bn_weight, bn_bias, **call)
        # The statistics the output was normalized with: recomputing them would take
        # another collective.
        ctx.save_for_backward(x, weight, bias, bn_weight, merged)
        ctx.scale, ctx.eps, ctx.group = call["scale"], call["eps"], call["process_group"]
        ctx.conv = conv_options(call)
        ctx.dtypes = {n: t.dtype for n, t in zip(_DIFFERENTIABLE, (x, weight, bias, bn_weight,
                                                                    bn_bias)) if t is not None}
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True
            # Refused rather than differentiated without the group's part. Not
            # @once_differentiable: that raises only when grad_out requires grad, and
            # otherwise returns gradients without a graph, which a sum with others would
            # silently drop from a second backward.
            raise RuntimeError("ct_bn_pool: with statistics synchronized over a process group "
                               "the backward is not differentiable (its all-reduce has no "
                               "derivative here): create_graph=True is not supported")
        from ._autograd import _training_grads, _in_input_dtypes
        x, weight, bias, bn_weight, merged = ctx.saved_tensors
        needs = dict(zip(_DIFFERENTIABLE, ctx.needs_input_grad[1:]))
        grads = _training_grads(ctx, grad_out, needs, x, weight, bias, bn_weight, stats=merged,
                                all_reduce=functools.partial(all_reduce_sums,
                                                             process_group=ctx.group))
        grads = _in_input_dtypes(grads, needs, ctx.dtypes)
        return (None, *(grads.get(n) for n in _DIFFERENTIABLE))
