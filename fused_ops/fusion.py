"""`fuse(model)`: replaces ConvTranspose3d -> scale -> BatchNorm3d -> global average pool
chains in a model by the fused op, with torch.fx.

Each step of a chain has several spellings (a module or a functional call, `* c` or `/ c`
or none, a pool module or `.mean` over the spatial dims); matchers turn each into one
description (`_Conv`, `_Scale`, `_BatchNormModule` / `_BatchNormCall`, `_Pool`) or say why
they do not apply (`_Miss`), and one rewrite replaces the chain by a `_FusedChain` call that
receives the conv's (and a functional batch norm's) tensors, and a batch-norm module, as
get_attr nodes of the fused model: the model's own tensors and modules, never copies.

Every batch norm of the graph is a candidate; fuse reports (`FuseReport`: the fused model's
`meta["fused_ops.fuse"]`, logger `fused_ops.fusion` at INFO, printed with `verbose=True`)
what it fused and, for each candidate next to a transposed conv or an average, why it left
it alone.
"""
import logging
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import fx, nn

from .functional import ct_bn_pool
from .modules import (ConvTransposeBNPool3d, _traced_call, conv_transpose_options,
                      ct_bn_pool_by_module)

_logger = logging.getLogger(__name__)

# Scalings by a Python number: (op, target) -> kind. In-place methods (`y.mul_(c)`) too.
_SCALE_OPS = {
    **{("call_function", f): "mul" for f in (operator.mul, torch.mul, torch.multiply)},
    **{("call_method", m): "mul" for m in ("mul", "mul_", "multiply", "multiply_")},
    **{("call_function", f): "div" for f in (operator.truediv, torch.div, torch.divide,
                                             torch.true_divide)},
    **{("call_method", m): "div" for m in ("div", "div_", "divide", "divide_", "true_divide",
                                           "true_divide_")},
    **{("call_function", f): "neg" for f in (operator.neg, torch.neg, torch.negative)},
    **{("call_method", m): "neg" for m in ("neg", "neg_", "negative", "negative_")},
}
_IN_PLACE_METHODS = {"mul_", "multiply_", "div_", "divide_", "true_divide_", "neg_", "negative_"}

# Functional spellings: parameter names in positional order, and defaults.
_CONV_TRANSPOSE3D = (("input", "weight", "bias", "stride", "padding", "output_padding",
                      "groups", "dilation"),
                     dict(bias=None, stride=1, padding=0, output_padding=0, groups=1,
                          dilation=1))
_BATCH_NORMS = {
    F.batch_norm: (("input", "running_mean", "running_var", "weight", "bias", "training",
                    "momentum", "eps"),
                   dict(weight=None, bias=None, training=False, momentum=0.1, eps=1e-5)),
    torch.batch_norm: (("input", "weight", "bias", "running_mean", "running_var", "training",
                        "momentum", "eps", "cudnn_enabled"), {}),
}
_MEAN = (("input", "dim", "keepdim", "dtype"), dict(dim=None, keepdim=False, dtype=None))
_FLATTEN = (("input", "start_dim", "end_dim"), dict(start_dim=0, end_dim=-1))
_CONV_INTS = ("stride", "padding", "output_padding", "dilation")

# A tensor (or module) of the chain: an existing get_attr node, the path of an attribute for
# which the rewrite makes one (a module's parameter, a batch-norm module), or None.
_TensorSource = Union[fx.Node, str, None]


# --- What the fused model calls ------------------------------------------------------------

class _FusedChain(nn.Module):
    """The fused op in place of one chain: forward(x, conv weight, conv bias, ...).

    torch.fx records a call of it as one call_module node, whatever the tracer's leaf rule
    (`fuse(fuse(model))`, `torch.fx.symbolic_trace` of a fused model)."""

    def __init__(self, scale, conv_options, algo):
        super().__init__()
        self.scale = scale
        self.conv_options = conv_options
        self.algo = algo

    def extra_repr(self):
        options = ", ".join(f"{k}={v}" for k, v in self.conv_options.items())
        return f"scale={self.scale}, {options}, algo={self.algo!r}"


def _tracing(args):
    return any(isinstance(a, fx.Proxy) for a in args)


class _FusedWithBatchNormModule(_FusedChain):
    """The batch norm is a module of the model (nn.BatchNorm3d or nn.SyncBatchNorm), used
    in its own mode as its forward would be. The fused model passes it at each call (a
    get_attr node: where the model holds it), so that replacing it there
    (nn.SyncBatchNorm.convert_sync_batchnorm after fuse) takes effect; this module holds
    no reference to it, nor to the model."""

    def forward(self, x, weight, bias, batch_norm):
        if _tracing((x, weight, bias)):
            return _traced_call(self, (x, weight, bias, batch_norm))
        return ct_bn_pool_by_module(x, weight, bias, self.scale, batch_norm,
                                    batch_norm.training, algo=self.algo, **self.conv_options)


class _FusedWithBatchNormCall(_FusedChain):
    """The batch norm is an F.batch_norm call: training flag (True, False, or None: the
    mode of this module, set by the fused model's train()/eval()), momentum and eps are
    fixed; its tensors come with each call."""

    def __init__(self, scale, conv_options, algo, bn_training, momentum, eps):
        super().__init__(scale, conv_options, algo)
        self.bn_training = bn_training
        self.momentum = momentum
        self.eps = eps

    def forward(self, x, weight, bias, bn_weight, bn_bias, running_mean, running_var):
        args = (x, weight, bias, bn_weight, bn_bias, running_mean, running_var)
        if _tracing(args):
            return _traced_call(self, args)
        training = self.training if self.bn_training is None else self.bn_training
        return ct_bn_pool(x, weight, bias, self.scale, bn_weight, bn_bias, running_mean,
                          running_var, training, self.momentum, self.eps, algo=self.algo,
                          **self.conv_options)

    def extra_repr(self):
        training = "mode" if self.bn_training is None else self.bn_training
        return (f"{super().extra_repr()}, training={training}, momentum={self.momentum}, "
                f"eps={self.eps}")


# --- What fuse did -------------------------------------------------------------------------

@dataclass
class FuseReport:
    """What `fuse` fused (`fused`: (chain, name of the fused submodule)), what it left alone
    and why (`left_alone`: (chain, reason)), and the chains fused before
    (`already_fused`: paths of ConvTransposeBNPool3d modules and fused chains)."""

    fused: List[Tuple[str, str]] = field(default_factory=list)
    left_alone: List[Tuple[str, str]] = field(default_factory=list)
    already_fused: List[str] = field(default_factory=list)

    def lines(self):
        return ([f"fused: {chain} -> {name}" for chain, name in self.fused]
                + [f"already fused: {path}" for path in self.already_fused]
                + [f"left alone: {chain}: {why}" for chain, why in self.left_alone])

    def __str__(self):
        head = (f"fused_ops.fuse: {len(self.fused)} chain(s) fused, "
                f"{len(self.left_alone)} left alone")
        return "\n".join([head] + ["  " + line for line in self.lines()])


# --- Matching ------------------------------------------------------------------------------

class _Miss(Exception):
    """Why a step of a chain does not match (the message is the reason)."""


@dataclass
class _Conv:
    node: fx.Node
    input: fx.Node
    weight: _TensorSource
    bias: _TensorSource
    options: dict  # stride, padding, output_padding, dilation, groups


@dataclass
class _Scale:
    value: float
    nodes: tuple  # the scaling's node (none without a scale), erased with the chain
    spelling: str


@dataclass
class _BatchNormModule:
    node: fx.Node
    input: fx.Node
    path: str  # where the model holds the module

    @property
    def tensors(self):  # the module itself: the fused op reads its tensors and mode
        return (self.path,)

    def fused(self, gm, scale, conv_options, algo):
        module = _FusedWithBatchNormModule(scale, conv_options, algo)
        return module.train(gm.training)  # (its batch norm's mode decides)


@dataclass
class _BatchNormCall:
    node: fx.Node
    input: fx.Node
    tensors: tuple  # weight, bias, running_mean, running_var: get_attr nodes or None
    training: Optional[bool]  # None: the module's mode
    momentum: float
    eps: float

    def fused(self, gm, scale, conv_options, algo):
        module = _FusedWithBatchNormCall(scale, conv_options, algo, self.training,
                                         self.momentum, self.eps)
        # A flag that is the mode starts as it was traced: the calling module's mode.
        return module.train(gm.training if self.training is not None
                            else _training_arg(self.node))


@dataclass
class _Pool:
    nodes: tuple  # from the batch norm's user to `out`
    out: fx.Node  # the node whose value the fused op's output replaces
    flatten: Optional[int]  # the fused [B, C, 1, 1, 1] output .flatten(this), or as is


@dataclass
class _Chain:
    conv: _Conv
    scale: _Scale
    bn: Union[_BatchNormModule, _BatchNormCall]
    pool: _Pool


def _module(gm, node, *kinds):
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if type(module) in kinds else None


def _is_module_of(gm, node, kind):
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), kind)


def _bind(node, signature):
    """`node`'s arguments by parameter name, for a function of `signature` (names in
    positional order, defaults); None when they do not fit it."""
    names, defaults = signature
    if len(node.args) > len(names) or not set(node.kwargs) <= set(names[len(node.args):]):
        return None
    bound = {**defaults, **dict(zip(names, node.args)), **node.kwargs}
    return bound if len(bound) == len(names) else None


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_attr(value):
    return isinstance(value, fx.Node) and value.op == "get_attr"


def _is_attr_or_none(value):
    return value is None or _is_attr(value)


def _int_or_triple(value):
    """A conv option as the op takes it (an int or 3 ints), or None if it is not one."""
    if _is_int(value):
        return value
    if isinstance(value, (tuple, list)) and all(_is_int(v) for v in value):
        if len(value) == 1:
            return value[0]
        if len(value) == 3:
            return tuple(value)
    return None


def _describe(gm, node):
    """A node as a user recognizes it in their model."""
    if node.op == "call_module":
        return f"{node.target} ({type(gm.get_submodule(node.target)).__name__})"
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        module = getattr(node.target, "__module__", None) or ""
        if module.startswith("torch.nn.functional"):
            return f"F.{name}"
        if module == "_operator":
            return {"mul": "*", "truediv": "/", "add": "+", "sub": "-", "neg": "unary -",
                    "pow": "**", "floordiv": "//"}.get(name, f"operator.{name}")
        return f"torch.{name}" if module.startswith("torch") else name
    return node.name


def _is_conv_transpose(gm, node):
    return (_is_module_of(gm, node, nn.ConvTranspose3d)
            or (node.op == "call_function" and node.target is torch.conv_transpose3d))


# The pool: AdaptiveAvgPool3d(1), F.adaptive_avg_pool3d(z, 1), z.mean((2, 3, 4)) (keepdim or
# not, negative dims, torch.mean), z.flatten(2).mean(-1).

def _is_mean(node):
    return ((node.op == "call_method" and node.target == "mean")
            or (node.op == "call_function" and node.target is torch.mean))


def _is_flatten(node):
    return ((node.op == "call_method" and node.target == "flatten")
            or (node.op == "call_function" and node.target is torch.flatten))


def _looks_like_pool(gm, node):
    return (_is_module_of(gm, node, (nn.AdaptiveAvgPool3d, nn.AvgPool3d)) or _is_mean(node)
            or _is_flatten(node) or (node.op == "call_function" and node.target in (
                F.adaptive_avg_pool3d, F.avg_pool3d)))


def _dims(value, ndim):
    """`value` (an int or ints) as a tuple of dims of a tensor of `ndim` dims, or None."""
    dims = (value,) if _is_int(value) else value
    if not isinstance(dims, (tuple, list)) or not all(_is_int(d) for d in dims):
        return None
    if not all(-ndim <= d < ndim for d in dims):
        return None
    return tuple(d % ndim for d in dims)


def _mean_args(node, ndim, want):
    """keepdim of `node`, a mean over exactly the dims `want` of a tensor of `ndim` dims,
    in the input's dtype; else _Miss."""
    args = _bind(node, _MEAN)
    if args is None or args["dim"] is None:
        raise _Miss(f"{_describe(None, node)} averages over every dim, not the spatial ones")
    dims = _dims(args["dim"], ndim)
    if dims is None or len(dims) != len(want) or set(dims) != set(want):
        raise _Miss(f"{_describe(None, node)} averages over dims {args['dim']!r}, not the "
                    f"spatial dims {tuple(want)}")
    if args["dtype"] is not None:
        raise _Miss(f"{_describe(None, node)} averages in another dtype ({args['dtype']})")
    if not isinstance(args["keepdim"], bool):
        raise _Miss(f"{_describe(None, node)}'s keepdim is not a constant")
    return args["keepdim"]


def _pool_after(gm, bn_node):
    """The global average pool that is the batch norm's only user, or _Miss."""
    users = list(bn_node.users)
    if len(users) != 1:
        raise _Miss("the batch norm's output is unused" if not users else
                    "the batch norm's output is also used elsewhere (by "
                    + ", ".join(_describe(gm, u) for u in users) + ")")
    node = users[0]
    if node.args[:1] != (bn_node,):
        raise _Miss(f"the batch norm's output goes to {_describe(gm, node)}, not to a global "
                    "average pool")
    pool = _module(gm, node, nn.AdaptiveAvgPool3d)
    if pool is not None or (node.op == "call_function"
                            and node.target is F.adaptive_avg_pool3d):
        if pool is not None:
            size = pool.output_size if len(node.args) == 1 and not node.kwargs else None
        else:
            size = node.kwargs.get("output_size", node.args[1] if len(node.args) > 1 else None)
        if not (size == 1 or (isinstance(size, (tuple, list)) and tuple(size) == (1, 1, 1))):
            raise _Miss(f"{_describe(gm, node)} pools to {size!r}, not to 1 (global)")
        return _Pool((node,), node, None)
    if _is_mean(node):
        keepdim = _mean_args(node, 5, (2, 3, 4))
        return _Pool((node,), node, None if keepdim else 1)
    if _is_flatten(node):
        args = _bind(node, _FLATTEN)
        if args is None or _dims(args["start_dim"], 5) != (2,) or _dims(
                args["end_dim"], 5) != (4,):
            raise _Miss(f"{_describe(gm, node)} is not .flatten(2) before a mean")
        users = list(node.users)
        if len(users) != 1 or not _is_mean(users[0]) or users[0].args[:1] != (node,):
            raise _Miss(".flatten(2) of the batch norm's output is not averaged (alone) by a "
                        "mean over its last dim")
        keepdim = _mean_args(users[0], 3, (2,))
        return _Pool((node, users[0]), users[0], 2 if keepdim else 1)
    raise _Miss(f"the batch norm's output goes to {_describe(gm, node)}, not to a global "
                "average pool")


# The batch norm.

def _batch_norm_module(gm, node):
    """A BatchNorm3d or SyncBatchNorm module called on its input alone."""
    if not _is_module_of(gm, node, nn.modules.batchnorm._BatchNorm):
        return None
    if _module(gm, node, nn.BatchNorm3d, nn.SyncBatchNorm) is None:
        raise _Miss(f"{_describe(gm, node)} is not an nn.BatchNorm3d or nn.SyncBatchNorm "
                    "(a subclass's forward may differ)")
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        raise _Miss(f"{_describe(gm, node)} is called with other arguments than its input")
    return _BatchNormModule(node, node.args[0], node.target)


def _batch_norm_call(node, flags):
    """F.batch_norm / torch.batch_norm with get_attr tensors (or None), a training flag
    known from `flags` (see `_batch_norm_flags`), Python-number momentum and eps."""
    if not _is_batch_norm_call(node):
        return None
    name = _describe(None, node)
    args = _bind(node, _BATCH_NORMS[node.target])
    if args is None or not isinstance(args["input"], fx.Node):
        raise _Miss(f"{name}'s arguments are not those of its signature")
    tensors = tuple(args[key] for key in ("weight", "bias", "running_mean", "running_var"))
    if not all(_is_attr_or_none(t) for t in tensors):
        raise _Miss(f"{name}'s weight, bias or running statistics are computed in the forward "
                    "(not attributes of the model)")
    if not (_is_number(args["momentum"]) and _is_number(args["eps"])):
        raise _Miss(f"{name}'s momentum or eps is not a constant")
    if node not in flags:
        raise _Miss(f"{name}'s training flag is neither a constant nor self.training (or the "
                    "forward's graph differs between train and eval mode)")
    has_running = {args["running_mean"] is not None, args["running_var"] is not None}
    if len(has_running) != 1 or (has_running == {False} and flags[node] is not True):
        # One running statistic, or none to normalize with: F.batch_norm's errors.
        raise _Miss(f"{name} is given one running statistic, or none to normalize with")
    return _BatchNormCall(node, args["input"], tensors, flags[node], float(args["momentum"]),
                          float(args["eps"]))


def _batch_norm(gm, node, flags):
    """The batch norm at `node`, None if `node` is no batch norm, or _Miss."""
    return _batch_norm_module(gm, node) or _batch_norm_call(node, flags)


def _is_batch_norm_like(gm, node):
    return _is_module_of(gm, node, nn.modules.batchnorm._BatchNorm) or _is_batch_norm_call(node)


# The scale.

def _scale_op(node):
    """(factor, tensor operand, spelling) of a scaling of a tensor by a Python number:
    `t * c`, `c * t`, `t / c` (factor 1 / c), `-t`, their torch and method spellings and
    in-place methods; None for any other node; _Miss for a scaling that cannot be fused."""
    kind = _SCALE_OPS.get((node.op, node.target))
    if kind is None:
        return None
    spelling = _describe(None, node)
    if kind == "neg":
        if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            return None
        return -1.0, node.args[0], spelling
    kwargs = dict(node.kwargs)
    if kind == "div" and kwargs.pop("rounding_mode", None) is not None:
        raise _Miss(f"the conv output is divided with rounding ({spelling}, rounding_mode="
                    f"{node.kwargs['rounding_mode']!r})")
    if len(node.args) != 2 or kwargs:
        return None
    a, b = node.args
    if kind == "mul":
        for factor, other in ((b, a), (a, b)):
            if isinstance(other, fx.Node) and _is_number(factor):
                return float(factor), other, f"{spelling} {factor!r}"
        raise _Miss(f"the conv output is scaled by a tensor ({spelling}), not by a Python "
                    "number")
    if not isinstance(a, fx.Node):  # `c / t`: not a scale
        raise _Miss(f"a number is divided by the conv output ({spelling}), not the other way")
    if not _is_number(b):
        raise _Miss(f"the conv output is divided by a tensor ({spelling}), not by a Python "
                    "number")
    divisor = float(b)
    if divisor == 0 or not math.isfinite(divisor):
        raise _Miss(f"the conv output is divided by {b!r}")
    return 1.0 / divisor, a, f"{spelling} {b!r}"


def _in_place(node):
    return node.op == "call_method" and node.target in _IN_PLACE_METHODS


def _conv_and_scale(gm, bn_node, bn_input, order):
    """The transposed conv and the scale (1 without one) before the batch norm, or _Miss."""
    scaling = _scale_op(bn_input)
    conv_node = bn_input if scaling is None else scaling[1]
    conv = _conv_transpose(gm, conv_node)
    if not isinstance(conv.input, fx.Node):
        raise _Miss("the conv's input is not a tensor of the forward")
    others = [user for user in conv_node.users if user is not bn_node and user is not bn_input]
    if scaling is not None:  # bn(conv(x) * s), bn(conv(x).mul_(s))
        if list(bn_input.users) != [bn_node]:
            raise _Miss("the scaled conv output is also used elsewhere (by "
                        + ", ".join(_describe(gm, u) for u in bn_input.users) + ")")
        scale = _Scale(scaling[0], (bn_input,), scaling[2])
    elif len(others) == 1 and _in_place(others[0]):  # y = conv(x); y.mul_(s); bn(y)
        inplace = others[0]
        scaling = _scale_op(inplace)
        if (scaling is not None and scaling[1] is conv_node and not inplace.users
                and order[inplace] < order[bn_node]):
            others, scale = [], _Scale(scaling[0], (inplace,), scaling[2])
    else:
        scale = _Scale(1.0, (), "no scale")
    if others:
        raise _Miss("the conv output is also used elsewhere (by "
                    + ", ".join(_describe(gm, u) for u in others) + ")")
    return conv, scale


# The transposed convolution.

def _conv_transpose_module(gm, node):
    """A ConvTranspose3d module called on its input alone (no output_size)."""
    if not _is_module_of(gm, node, nn.ConvTranspose3d):
        return None
    conv = _module(gm, node, nn.ConvTranspose3d)
    if conv is None:
        raise _Miss(f"{_describe(gm, node)} is not an nn.ConvTranspose3d (a subclass's "
                    "forward may differ)")
    if len(node.args) != 1 or node.kwargs:
        raise _Miss(f"{_describe(gm, node)} is called with output_size")
    bias = f"{node.target}.bias" if conv.bias is not None else None
    return _Conv(node, node.args[0], f"{node.target}.weight", bias,
                 conv_transpose_options(conv))


def _conv_transpose_call(node):
    """F.conv_transpose3d with get_attr weight and bias (or None), constant options."""
    if node.op != "call_function" or node.target is not torch.conv_transpose3d:
        return None
    args = _bind(node, _CONV_TRANSPOSE3D)
    if args is None:
        raise _Miss("F.conv_transpose3d's arguments are not those of its signature")
    if not _is_attr(args["weight"]) or not _is_attr_or_none(args["bias"]):
        raise _Miss("F.conv_transpose3d's weight or bias is computed in the forward or is an "
                    "input (not an attribute of the model)")
    options = {key: _int_or_triple(args[key]) for key in _CONV_INTS}
    if None in options.values() or not _is_int(args["groups"]):
        raise _Miss("F.conv_transpose3d's options are not constants")
    return _Conv(node, args["input"], args["weight"], args["bias"],
                 dict(options, groups=args["groups"]))


def _conv_transpose(gm, node):
    conv = _conv_transpose_module(gm, node) or _conv_transpose_call(node)
    if conv is None:
        raise _Miss(f"the batch norm's input comes from {_describe(gm, node)}, not from a "
                    "ConvTranspose3d (times or divided by a Python number)")
    return conv


def _near_conv(gm, node):
    """Whether `node` is a transposed conv, or an op on one (a near miss of a scale)."""
    return _is_conv_transpose(gm, node) or any(
        isinstance(a, fx.Node) and _is_conv_transpose(gm, a) for a in node.args)


def _match(gm, bn_node, flags, order):
    """The chain around the batch norm at `bn_node`, or _Miss."""
    bn = _batch_norm(gm, bn_node, flags)
    conv, scale = _conv_and_scale(gm, bn_node, bn.input, order)
    pool = _pool_after(gm, bn_node)
    return _Chain(conv, scale, bn, pool)


def _chain_text(gm, bn_node):
    """The candidate chain around a batch norm, as the report names it."""
    parts = [_describe(gm, bn_node)]
    if bn_node.args and isinstance(bn_node.args[0], fx.Node):
        before = bn_node.args[0]
        if not _is_conv_transpose(gm, before):
            parts.insert(0, _describe(gm, before))
            before = next((a for a in before.args if isinstance(a, fx.Node)), None)
        if before is not None and _is_conv_transpose(gm, before):
            parts.insert(0, _describe(gm, before))
    users = list(bn_node.users)
    if len(users) == 1:
        parts.append(_describe(gm, users[0]))
    return " -> ".join(parts)


def _fused_text(gm, chain):
    parts = [_describe(gm, chain.conv.node)]
    if chain.scale.nodes:
        parts.append(chain.scale.spelling)
    parts += [_describe(gm, chain.bn.node), *(_describe(gm, n) for n in chain.pool.nodes)]
    return f"{' -> '.join(parts)} (scale {chain.scale.value!r})"


# --- Functional batch norms' training flags ------------------------------------------------

def _is_batch_norm_call(node):
    return node.op == "call_function" and node.target in _BATCH_NORMS


def _training_arg(node):
    args = _bind(node, _BATCH_NORMS[node.target])
    return None if args is None else args["training"]


def _trace_in_mode(model, training):
    """fx's graph of `model` with every module's `training` set to `training`; the modes,
    and the model's attributes (fx adds `_tensor_constant*` ones), are restored."""
    modes = {m: m.training for m in model.modules()}
    attributes = set(vars(model))
    try:
        for m in modes:  # (not model.train(): a model may override it)
            m.training = training
        return fx.Tracer().trace(model)
    finally:
        for m, mode in modes.items():
            m.training = mode
        for name in set(vars(model)) - attributes:
            delattr(model, name)


def _same_structure(a, b):
    """Whether graphs `a` and `b` make the same calls in the same order (get_attr targets
    may differ: fx names each trace's tensor constants anew)."""
    a, b = list(a.nodes), list(b.nodes)
    return len(a) == len(b) and all(
        x.op == y.op and (x.op == "get_attr" or x.target == y.target) for x, y in zip(a, b))


def _batch_norm_flags(model, gm):
    """{functional batch-norm node of gm: its training flag}, True or False for a constant
    flag, None for `self.training` (the calling module's mode).

    fx bakes `self.training` into the graph as the constant it is at trace time, so the
    model is traced again with every module in training mode and with every module in eval
    mode: a flag that is True and False there is the mode, one that is the same in both
    and in gm a constant. Calls whose flag is anything else (a tensor, `not
    self.training`, ...) are left out, and so are all calls if tracing in either mode fails
    or gives a graph of other structure (the forward branches on the mode)."""
    calls = [node for node in gm.graph.nodes if _is_batch_norm_call(node)]
    if not calls:
        return {}
    try:
        graphs = [_trace_in_mode(model, training) for training in (True, False)]
    except Exception:  # noqa: BLE001  (any error of the user's forward in the other mode)
        return {}
    if not all(_same_structure(gm.graph, graph) for graph in graphs):
        return {}
    # Equal structure: a node of gm is the node at its position in the other graphs.
    same_node = dict(zip(gm.graph.nodes, zip(*(g.nodes for g in graphs))))
    flags = {}
    for node in calls:
        here = _training_arg(node)
        train, evaluate = (_training_arg(other) for other in same_node[node])
        if not all(isinstance(flag, bool) for flag in (here, train, evaluate)):
            continue
        if here == train == evaluate:
            flags[node] = here
        elif train and not evaluate:
            flags[node] = None
    return flags


# --- Rewriting -----------------------------------------------------------------------------

def _free_name(gm, base):
    name, n = base, 1
    while hasattr(gm, name):
        name, n = f"{base}_{n}", n + 1
    return name


def _graph_tensor(graph, source):
    return graph.get_attr(source) if isinstance(source, str) else source


def _replace(gm, chain, algo):
    """Replaces `chain` in gm's graph by a call of a new _FusedChain submodule; its name."""
    graph, conv, bn, pool = gm.graph, chain.conv, chain.bn, chain.pool
    module = bn.fused(gm, chain.scale.value, conv.options, algo)
    name = _free_name(gm, f"{conv.node.name}_fused")
    gm.add_submodule(name, module)
    sources = (conv.weight, conv.bias, *bn.tensors)
    with graph.inserting_before(pool.out):
        tensors = [_graph_tensor(graph, source) for source in sources]
        fused = graph.call_module(name, (conv.input, *tensors))
        if pool.flatten is not None:  # the pool's shape: [B, C] or [B, C, 1]
            fused = graph.call_method("flatten", (fused, pool.flatten))
    pool.out.replace_all_uses_with(fused)
    for node in (*reversed(pool.nodes), bn.node, *chain.scale.nodes, conv.node):
        graph.erase_node(node)
    for node in {s for s in sources if isinstance(s, fx.Node)}:
        if not node.users:  # the get_attr node only the chain's conv or batch norm used
            graph.erase_node(node)
    return name


def _already_fused(gm):
    return [node.target for node in gm.graph.nodes if node.op == "call_module" and isinstance(
        gm.get_submodule(node.target), (ConvTransposeBNPool3d, _FusedChain))]


def fuse(model: nn.Module, algo: str = "auto", *, verbose: bool = False) -> fx.GraphModule:
    """A torch.fx copy of `model` in which every chain

        ConvTranspose3d or F.conv_transpose3d
        -> optionally a scale by a Python number c: `* c` (either order), `/ c` (c nonzero,
           finite: the scale 1 / c), unary `-`; their torch and method spellings
           (torch.mul, .mul, torch.div, .div, ...), in-place ones included (`.mul_(c)`,
           whether its result or the conv's output is used next)
        -> BatchNorm3d, SyncBatchNorm or F.batch_norm (torch.batch_norm)
        -> a global average pool: AdaptiveAvgPool3d(1) or ((1, 1, 1)),
           F.adaptive_avg_pool3d(z, 1), z.mean((2, 3, 4)) (any order, negative dims,
           keepdim or not; torch.mean), z.flatten(2).mean(-1)

    runs as one fused op, the output of the shape the pool gives. Chains inside
    nn.Sequential (or any container fx traces through) are found as well. Functional calls
    are matched with positional or keyword arguments; their weights, biases and running
    statistics must be attributes of the model (parameters or buffers, get_attr nodes to
    fx) or None, their other arguments constants. Nothing is copied: the fused op reads the
    model's own parameters and buffers (and batch-norm modules) at each call and updates
    running statistics in place, so the optimizer, `.to()` and state_dict (same keys) keep
    working. Modules only the fused chains used (the pool module) are not in the fused
    model. ConvTransposeBNPool3d modules and chains fused before (`fuse(fuse(model))`)
    stay as they are: each one call.

    Training mode: a batch-norm module is used in its own mode, as its forward would be
    (momentum=None, track_running_stats, num_batches_tracked included). A SyncBatchNorm
    keeps its semantics: in training mode the statistics are merged over its process group
    (docs/distributed.md); so are those of a BatchNorm3d that
    `nn.SyncBatchNorm.convert_sync_batchnorm` replaces in the fused model. fx bakes an
    F.batch_norm's `training=self.training` into the graph at trace time; fuse tells it
    apart from a constant by tracing the model again in train and in eval mode (see
    `_batch_norm_flags`). A constant flag stays that constant; a `self.training` flag
    follows the fused model's train()/eval() (at first: the calling module's mode at fuse
    time). A flag that is neither (computed otherwise, or when the forward's graph
    differs between the modes) leaves that chain alone. Outside fused chains fx's
    trace-time constants remain (e.g. F.dropout(training=self.training)).

    A chain is left alone when an intermediate result is used elsewhere, the pool is not
    global (or averages over other dims, or in another dtype), the scale is a tensor or
    anything but a product or quotient by a number (`+ c`, `- c`, `c / t`, ...), the conv
    is called with `output_size`, a functional argument is computed in the graph, or a
    functional batch norm's running statistics are absent where it normalizes with them.

    What was fused and what was left alone, and why: the returned model's
    `meta["fused_ops.fuse"]` (a `FuseReport`), logged to the `fused_ops.fusion` logger at
    INFO level, and printed with `verbose=True`. Left alone are reported the batch norms
    that follow a transposed conv (or an op on one) or precede an average.
    """
    gm = fx.symbolic_trace(model)
    report = FuseReport(already_fused=_already_fused(gm))
    flags = _batch_norm_flags(model, gm)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for bn_node in [n for n in gm.graph.nodes if _is_batch_norm_like(gm, n)]:
        text = _chain_text(gm, bn_node)
        try:
            chain = _match(gm, bn_node, flags, order)
        except _Miss as miss:
            users = list(bn_node.users)
            if (bn_node.args and isinstance(bn_node.args[0], fx.Node)
                    and _near_conv(gm, bn_node.args[0])) or any(
                        _looks_like_pool(gm, u) for u in users):
                report.left_alone.append((text, str(miss)))
            continue
        report.fused.append((_fused_text(gm, chain), _replace(gm, chain, algo)))
    gm.graph.lint()
    gm.delete_all_unused_submodules()  # the pool modules, ...
    gm.recompile()
    gm.meta["fused_ops.fuse"] = report
    for line in report.lines():
        _logger.info("fused_ops.fuse: %s", line)
    if verbose:
        print(report)
    return gm
