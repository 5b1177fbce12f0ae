"""`fuse(model)`: replaces ConvTranspose3d -> * scalar -> BatchNorm3d -> global average pool
chains in a model by the fused op, with torch.fx.

Each step of a chain has a module and a functional spelling; a matcher turns either into
one description (`_Conv`, `_BatchNormModule` / `_BatchNormCall`), and one rewrite replaces
the chain by a `_FusedChain` call that receives the conv's (and a functional batch norm's)
tensors as get_attr nodes of the fused model: the model's own tensors, never copies.
"""
import numbers
import operator
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

import torch
import torch.nn.functional as F
from torch import fx, nn

from .functional import ct_bn_pool
from .modules import conv_transpose_options, ct_bn_pool_by_module

_MUL_FUNCTIONS = (operator.mul, torch.mul)

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
_CONV_INTS = ("stride", "padding", "output_padding", "dilation")

# A tensor of the chain: an existing get_attr node, the path of an attribute for which the
# rewrite makes one (a module's parameter), or None.
_TensorSource = Union[fx.Node, str, None]


# --- What the fused model calls ------------------------------------------------------------

class _FusedChain(nn.Module):
    """The fused op in place of one chain: forward(x, conv weight, conv bias, ...)."""

    def __init__(self, scale, conv_options, algo):
        super().__init__()
        self.scale = scale
        self.conv_options = conv_options
        self.algo = algo

    def extra_repr(self):
        options = ", ".join(f"{k}={v}" for k, v in self.conv_options.items())
        return f"scale={self.scale}, {options}, algo={self.algo!r}"


class _FusedWithBatchNormModule(_FusedChain):
    """The batch norm is a module of the model (nn.BatchNorm3d or nn.SyncBatchNorm), used
    in its own mode as its forward would be. It is looked up where the model holds it at
    each call, so that replacing it there (nn.SyncBatchNorm.convert_sync_batchnorm after
    fuse) takes effect."""

    def __init__(self, scale, conv_options, algo, bn_parent, bn_name):
        super().__init__(scale, conv_options, algo)
        # Not registered as a child: the model already owns the batch norm.
        object.__setattr__(self, "_bn_slot", (bn_parent, bn_name))

    @property
    def batch_norm(self):
        parent, name = self._bn_slot
        return parent._modules[name]

    def forward(self, x, weight, bias):
        bn = self.batch_norm
        return ct_bn_pool_by_module(x, weight, bias, self.scale, bn, bn.training,
                                    algo=self.algo, **self.conv_options)


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
        training = self.training if self.bn_training is None else self.bn_training
        return ct_bn_pool(x, weight, bias, self.scale, bn_weight, bn_bias, running_mean,
                          running_var, training, self.momentum, self.eps, algo=self.algo,
                          **self.conv_options)

    def extra_repr(self):
        training = "mode" if self.bn_training is None else self.bn_training
        return (f"{super().extra_repr()}, training={training}, momentum={self.momentum}, "
                f"eps={self.eps}")


# --- Matching ------------------------------------------------------------------------------

@dataclass
class _Conv:
    node: fx.Node
    input: fx.Node
    weight: _TensorSource
    bias: _TensorSource
    options: dict  # stride, padding, output_padding, dilation, groups


@dataclass
class _BatchNormModule:
    node: fx.Node
    input: fx.Node
    parent: str  # where the model holds the module
    name: str
    tensors: ClassVar[tuple] = ()  # the fused op reads them from the module

    def fused(self, gm, scale, conv_options, algo):
        module = _FusedWithBatchNormModule(scale, conv_options, algo,
                                           gm.get_submodule(self.parent), self.name)
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


def _module(gm, node, *kinds):
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if type(module) in kinds else None


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
        if isinstance(other, fx.Node) and _is_number(scale):
            return float(scale), other
    return None


def _conv_transpose_module(gm, node):
    """A ConvTranspose3d module called on its input alone (no output_size)."""
    conv = _module(gm, node, nn.ConvTranspose3d)
    if conv is None or len(node.args) != 1 or node.kwargs:
        return None
    bias = f"{node.target}.bias" if conv.bias is not None else None
    return _Conv(node, node.args[0], f"{node.target}.weight", bias,
                 conv_transpose_options(conv))


def _conv_transpose_call(node):
    """F.conv_transpose3d with get_attr weight and bias (or None), constant options."""
    if node.op != "call_function" or node.target is not torch.conv_transpose3d:
        return None
    args = _bind(node, _CONV_TRANSPOSE3D)
    if (args is None or not _is_attr(args["weight"]) or not _is_attr_or_none(args["bias"])
            or not _is_int(args["groups"])):
        return None
    options = {key: _int_or_triple(args[key]) for key in _CONV_INTS}
    if None in options.values():
        return None
    return _Conv(node, args["input"], args["weight"], args["bias"],
                 dict(options, groups=args["groups"]))


def _conv_transpose(gm, node):
    conv = _conv_transpose_module(gm, node) or _conv_transpose_call(node)
    return conv if conv is not None and isinstance(conv.input, fx.Node) else None


def _batch_norm_module(gm, node):
    """A BatchNorm3d or SyncBatchNorm module called on its input alone."""
    if (_module(gm, node, nn.BatchNorm3d, nn.SyncBatchNorm) is None or len(node.args) != 1
            or node.kwargs):
        return None
    parent, _, name = node.target.rpartition(".")
    return _BatchNormModule(node, node.args[0], parent, name)


def _batch_norm_call(node, flags):
    """F.batch_norm / torch.batch_norm with get_attr tensors (or None), a training flag
    known from `flags` (see `_batch_norm_flags`), Python-number momentum and eps."""
    if not _is_batch_norm_call(node) or node not in flags:
        return None
    args = _bind(node, _BATCH_NORMS[node.target])
    if args is None:
        return None
    tensors = tuple(args[key] for key in ("weight", "bias", "running_mean", "running_var"))
    if (not all(_is_attr_or_none(t) for t in tensors)
            or not (_is_number(args["momentum"]) and _is_number(args["eps"]))):
        return None
    has_running = {args["running_mean"] is not None, args["running_var"] is not None}
    if len(has_running) != 1 or (has_running == {False} and flags[node] is not True):
        return None  # one running statistic, or none to normalize with: F.batch_norm's errors
    return _BatchNormCall(node, args["input"], tensors, flags[node], float(args["momentum"]),
                          float(args["eps"]))


def _batch_norm(gm, node, flags):
    bn = _batch_norm_module(gm, node) or _batch_norm_call(node, flags)
    return bn if bn is not None and isinstance(bn.input, fx.Node) else None


def _only_user_is(node, user):
    return list(node.users) == [user]


@dataclass
class _Chain:
    conv: _Conv
    scale: float
    mul: fx.Node
    bn: Union[_BatchNormModule, _BatchNormCall]
    pool: fx.Node


def _match(gm, pool, flags):
    """The chain ending at `pool`, or None."""
    if not _is_global_pool(gm, pool) or not isinstance(pool.args[0], fx.Node):
        return None
    bn = _batch_norm(gm, pool.args[0], flags)
    if bn is None or not _only_user_is(bn.node, pool):
        return None
    found = _scale_and_input(bn.input)
    if found is None or not _only_user_is(bn.input, bn.node):
        return None
    scale, conv_node = found
    conv = _conv_transpose(gm, conv_node)
    if conv is None or not _only_user_is(conv_node, bn.input):
        return None
    return _Chain(conv, scale, bn.input, bn, pool)


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
    """Replaces `chain` in gm's graph by a call of a new _FusedChain submodule."""
    graph, conv, bn = gm.graph, chain.conv, chain.bn
    module = bn.fused(gm, chain.scale, conv.options, algo)
    name = _free_name(gm, f"{conv.node.name}_fused")
    gm.add_submodule(name, module)
    sources = (conv.weight, conv.bias, *bn.tensors)
    with graph.inserting_before(chain.pool):
        tensors = [_graph_tensor(graph, source) for source in sources]
        fused = graph.call_module(name, (conv.input, *tensors))
    chain.pool.replace_all_uses_with(fused)
    for node in (chain.pool, bn.node, chain.mul, conv.node):
        graph.erase_node(node)
    for node in {s for s in sources if isinstance(s, fx.Node)}:
        if not node.users:  # the get_attr node only the chain's conv or batch norm used
            graph.erase_node(node)


def fuse(model: nn.Module, algo: str = "auto") -> fx.GraphModule:
    """A torch.fx copy of `model` in which every chain

        ConvTranspose3d or F.conv_transpose3d -> multiply by a Python number (either
        order; `*`, `torch.mul` or `.mul`) -> BatchNorm3d, SyncBatchNorm or F.batch_norm
        (torch.batch_norm) -> AdaptiveAvgPool3d((1, 1, 1)) or F.adaptive_avg_pool3d(z, 1)

    runs as one fused op. Functional calls are matched with positional or keyword
    arguments; their weights, biases and running statistics must be attributes of the
    model (parameters or buffers, get_attr nodes to fx) or None, their other arguments
    constants. Nothing is copied: the fused op reads the model's own parameters and
    buffers at each call and updates running statistics in place, so the optimizer, `.to()`
    and state_dict (same keys) keep working.

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
    global, the scale is a tensor, the conv is called with `output_size`, a functional
    argument is computed in the graph, or a functional batch norm's running statistics
    are absent where it normalizes with them.
    """
    gm = fx.symbolic_trace(model)
    flags = _batch_norm_flags(model, gm)
    for pool in list(gm.graph.nodes):
        chain = _match(gm, pool, flags)
        if chain is not None:
            _replace(gm, chain, algo)
    gm.graph.lint()
    gm.recompile()
    return gm
