"""`fuse(model)`: replaces ConvTranspose3d -> * scalar -> BatchNorm3d -> global average pool
chains in a model by the fused op, with torch.fx."""
import numbers
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from .modules import ConvTransposeBNPool3d

_MUL_FUNCTIONS = (operator.mul, torch.mul)


class _FusedChain(nn.Module):
    """Calls the fused op on the chain's own submodules, which stay registered where the
    model had them: parameters, buffers and state_dict keys are the original ones."""

    def __init__(self, conv, scale, bn_parent, bn_name, algo):
        super().__init__()
        # Not registered as children: the model already owns these modules. The batch norm
        # is looked up where the model holds it at each call, so that replacing it there
        # (nn.SyncBatchNorm.convert_sync_batchnorm after fuse) takes effect.
        object.__setattr__(self, "_bn_slot", (bn_parent, bn_name))
        object.__setattr__(self, "_fused", ConvTransposeBNPool3d.from_modules(
            conv, scale, bn_parent._modules[bn_name], algo))

    def forward(self, x):
        parent, name = self._bn_slot
        fused = self._fused
        if parent._modules[name] is not fused.batch_norm:
            fused = ConvTransposeBNPool3d.from_modules(
                fused.conv_transpose, fused.scale_factor, parent._modules[name], fused.algo)
            object.__setattr__(self, "_fused", fused)
        fused.training = self.training
        return fused(x)

    def extra_repr(self):
        return self._fused.extra_repr()


def _module(gm, node, *kinds):
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if type(module) in kinds else None


def _is_global_pool(gm, node):
    pool = _module(gm, node, nn.AdaptiveAvgPool3d)
    if pool is not None:
        size = pool.output_size
    elif node.op == "call_function" and node.target is F.adaptive_avg_pool3d:
        size = node.kwargs.get("output_size", node.args[1] if len(node.args) > 1 else None)
    else:
        return False
    return size == 1 or (isinstance(size, (tuple, list)) and tuple(size) == (1, 1, 1))


def _scale_and_input(node):
    """(scale, other operand) of a multiplication by a Python number, else None."""
    is_mul = (node.op == "call_function" and node.target in _MUL_FUNCTIONS) or (
        node.op == "call_method" and node.target == "mul")
    if not is_mul or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    for scale, other in ((b, a), (a, b)):
        if isinstance(other, fx.Node) and isinstance(scale, numbers.Real) and not isinstance(
                scale, bool):
            return float(scale), other
    return None


def _only_user_is(node, user):
    return list(node.users) == [user]


def _match(gm, pool):
    """The chain's (conv node, scale, bn node) ending at `pool`, or None."""
    if not _is_global_pool(gm, pool) or not isinstance(pool.args[0], fx.Node):
        return None
    bn = pool.args[0]
    if _module(gm, bn, nn.BatchNorm3d, nn.SyncBatchNorm) is None or not _only_user_is(bn, pool):
        return None
    mul = bn.args[0]
    found = _scale_and_input(mul) if isinstance(mul, fx.Node) else None
    if found is None or not _only_user_is(mul, bn):
        return None
    scale, conv = found
    if (_module(gm, conv, nn.ConvTranspose3d) is None or not _only_user_is(conv, mul)
            or len(conv.args) != 1 or conv.kwargs):
        return None
    return conv, scale, bn


def fuse(model: nn.Module, algo: str = "auto") -> fx.GraphModule:
    """A torch.fx copy of `model` in which every chain

        ConvTranspose3d -> multiply by a Python number (either order; `*`, `torch.mul` or
        `.mul`) -> BatchNorm3d or SyncBatchNorm -> AdaptiveAvgPool3d((1, 1, 1)) (module or
        functional)

    runs as one fused op. The original submodules are shared, not copied: parameters,
    buffers, the optimizer's view of them and state_dict keys stay those of `model`.
    A SyncBatchNorm keeps its semantics: in training mode the statistics are merged over
    its process group (docs/distributed.md); so are those of a BatchNorm3d that
    `nn.SyncBatchNorm.convert_sync_batchnorm` replaces in the fused model.
    A chain is left alone when an intermediate result is used elsewhere, the pool is not
    global, the scale is a tensor, or the conv is called with `output_size`.
    """
    gm = fx.symbolic_trace(model)
    for pool in list(gm.graph.nodes):
        chain = _match(gm, pool)
        if chain is None:
            continue
        conv, scale, bn = chain
        name = f"{conv.target.replace('.', '_')}_fused"
        bn_parent, _, bn_name = bn.target.rpartition(".")
        fused_chain = _FusedChain(gm.get_submodule(conv.target), scale,
                                  gm.get_submodule(bn_parent), bn_name, algo)
        # In the model's mode: a new module starts in training mode whatever the model's is.
        gm.add_submodule(name, fused_chain.train(gm.training))
        with gm.graph.inserting_before(pool):
            fused = gm.graph.call_module(name, (conv.args[0],))
        pool.replace_all_uses_with(fused)
        mul = bn.args[0]
        for node in (pool, bn, mul, conv):
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm
