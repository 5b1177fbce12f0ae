"""torch.library.opcheck on the ops (schema, fake kernel, autograd registration, AOTAutograd
traces), called with the arguments the package itself passes them: the module's and fuse's
batch-norm handling (fused_ops/modules.py, ct_bn_pool_by_module) captured from real calls on
every configuration family, mode and algorithm, with and without inputs requiring grad, in
every dtype; the functional with its optional tensors None; the synchronized step's halves."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

import fused_ops
import fused_ops.testing
from conftest import (DEVICES, FAMILIES, HALF_TYPES, Problem, Reference, make_dtype_models,
                      make_input, make_models, op_conv_options, skip_unless_algo_covers)
from fused_ops import distributed

MODES = [("eval", "auto"), ("train", "auto"), ("train", "direct"), ("train", "sliced_conv"),
         ("train", "fft"), ("train", "correlation"), ("train", "cross_spectrum"),
         ("train", "border")]


class _Capture(TorchFunctionMode):
    """Records each call of a fused_ops op made inside it: (OpOverload, args, kwargs), the
    tensors copied as they were before the call (requires_grad kept)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        overload = func.default if isinstance(func, torch._ops.OpOverloadPacket) else func
        if isinstance(overload, torch._ops.OpOverload) and overload.namespace == "fused_ops":
            self.calls.append((overload, tuple(map(_copy, args)),
                               {k: _copy(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


def captured_calls(model, x):
    with _Capture() as capture:
        model(x)
    assert capture.calls, "the model made no call of a fused_ops op"
    return capture.calls


def opcheck_calls(calls, detach=False):
    """opcheck on each captured call; `detach`: with no tensor requiring grad."""
    def d(v):
        return v.detach() if detach and isinstance(v, torch.Tensor) else v

    for op, args, kwargs in calls:
        torch.library.opcheck(op, tuple(map(d, args)), {k: d(v) for k, v in kwargs.items()})


def family_model(problem, form, mode, device, dtype=torch.float32, bn_dtype=None):
    training, algo = mode[0] == "train", mode[1]
    if bn_dtype is None:
        _, fused = make_models(problem, dtype, device, algo=algo, beta="random")
    else:
        _, fused = make_dtype_models(problem, dtype, bn_dtype, device, algo=algo, beta="random")
    if training and problem.momentum is None:
        fused.batch_norm.num_batches_tracked.fill_(3)  # a momentum of 1/4, not 1
    if form == "fuse":  # the unfused pattern with the same modules, through fuse
        model = Reference(problem.in_channels, problem.out_channels, problem.kernel,
                          problem.scale, problem.eps, problem.momentum, problem.conv_kwargs,
                          problem.bn_kwargs)
        model.conv_transpose, model.batch_norm = fused.conv_transpose, fused.batch_norm
        fused = fused_ops.fuse(model, algo=algo)
    return fused.train(training)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES, ids="-".join)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_module_calls(family, mode, device):
    problem = FAMILIES[family]
    skip_unless_algo_covers(problem, mode[1], device)
    model = family_model(problem, "module", mode, device)
    with torch.no_grad():
        calls = captured_calls(model, make_input(problem, torch.float32, device))
    opcheck_calls(calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["module", "fuse"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_calls_with_inputs_requiring_grad(family, training, form, device):
    """Parameters requiring grad (nn.Module's default) and x: includes
    test_autograd_registration and test_aot_dispatch_dynamic (float64: the backward's
    convolutions follow PyTorch's TF32 flags)."""
    problem = FAMILIES[family]
    model = family_model(problem, form, ("train" if training else "eval", "auto"), device,
                         torch.float64)
    x = make_input(problem, torch.float64, device).requires_grad_()
    calls = captured_calls(model, x)
    assert any(isinstance(a, torch.Tensor) and a.requires_grad for a in calls[0][1])
    opcheck_calls(calls)


def _covers(route, problem):
    conv = {name: problem.triple(name, default) for name, default in (
        ("stride", 1), ("padding", 0), ("output_padding", 0), ("dilation", 1))}
    weight = torch.empty(problem.in_channels, 1, *problem.kernel)
    return fused_ops._backward_routes._COVERS[route][1](conv, weight)


# The problems each conv-free route of the training backward covers (docs/dispatch.md): the
# families' and kernel = stride upsampling, which no family is.
ROUTE_PROBLEMS = {**FAMILIES, "kernel_is_stride": Problem(
    3, 4, 6, (3, 4, 5), (2, 2, 2), scale=-0.75, conv_kwargs=dict(stride=2, groups=2))}
ROUTE_FAMILIES = [(route, name) for route in ("spectral", "gram")
                  for name, p in ROUTE_PROBLEMS.items() if _covers(route, p)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route,family", ROUTE_FAMILIES,
                         ids=[f"{r}-{f}" for r, f in ROUTE_FAMILIES])
def test_training_calls_with_a_conv_free_backward(route, family, device):
    """test_calls_with_inputs_requiring_grad's training calls with the backward's route
    forced (the dispatch takes "gram" on the CPU where it is cheaper, "spectral" nowhere yet)."""
    problem = ROUTE_PROBLEMS[family]
    model = family_model(problem, "module", ("train", "auto"), device, torch.float64)
    x = make_input(problem, torch.float64, device).requires_grad_()
    calls = captured_calls(model, x)
    with fused_ops.testing.route(backward=route):
        opcheck_calls(calls)


def dtype_ids(dtypes):
    return "-".join(str(d).removeprefix("torch.") for d in dtypes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [(t, p) for t in HALF_TYPES for p in (t, torch.float32)],
                         ids=dtype_ids)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
def test_module_calls_in_half_precision(requires_grad, training, dtypes, device):
    problem = FAMILIES["everything"]
    model = family_model(problem, "module", ("train" if training else "eval", "auto"), device,
                         *dtypes)
    x = make_input(problem, dtypes[0], device).requires_grad_(requires_grad)
    with torch.set_grad_enabled(requires_grad):
        calls = captured_calls(model, x)
    opcheck_calls(calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("conv", [{}, dict(stride=[2, 1, 2], padding=[1, 0, 1],
                                           output_padding=[1, 0, 0], dilation=[1, 2, 1])])
@pytest.mark.parametrize("optional", ["given", "none"])
def test_functional_with_optional_tensors(optional, conv, training, device):
    """bias, bn_weight and bn_bias given or None; None running statistics (training only):
    the functional's overload without them."""
    problem = FAMILIES["plain"]
    _, fused = make_models(problem, torch.float64, device)
    c, bn = fused.conv_transpose, fused.batch_norm
    tensors = [c.weight, c.bias, bn.weight, bn.bias]
    if optional == "none":
        tensors = [c.weight, None, None, None]
    weight, bias, bn_weight, bn_bias = (None if t is None else t.detach().clone().requires_grad_()
                                        for t in tensors)
    stats = (bn.running_mean, bn.running_var)
    if optional == "none" and training:
        stats = (None, None)
    x = make_input(problem, torch.float64, device).requires_grad_()
    with _Capture() as capture:
        fused_ops.ct_bn_pool(x, weight, bias, problem.scale, bn_weight, bn_bias, *stats, training,
                             0.1, 1e-5, **conv)
    expected = "ct_bn_pool.no_stats" if stats[0] is None else "ct_bn_pool.default"
    assert [str(op).removeprefix("fused_ops.") for op, _, _ in capture.calls] == [expected]
    opcheck_calls(capture.calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.float64,) * 2] + [
    (t, p) for t in HALF_TYPES for p in (t, torch.float32)], ids=dtype_ids)
@pytest.mark.parametrize("tracked", [True, False], ids=["running_stats", "no_running_stats"])
def test_synchronized_halves(tracked, dtypes, device, monkeypatch):
    """ct_bn_pool_stats and ct_bn_pool_apply (or its no_stats overload) as the synchronized
    training step calls them (fused_ops/distributed.py, the all-gather simulated)."""
    problem = FAMILIES["everything"]
    _, fused = make_dtype_models(problem, *dtypes, device)
    c, bn = fused.conv_transpose, fused.batch_norm
    monkeypatch.setattr(distributed, "all_gather_stats", lambda stats, group: stats[None])
    stats = (bn.running_mean, bn.running_var) if tracked else (None, None)
    with torch.no_grad(), _Capture() as capture:
        distributed.synced_ct_bn_pool(
            make_input(problem, dtypes[0], device), c.weight, c.bias, problem.scale,
            bn.weight, bn.bias, *stats, 0.1, problem.eps, algo="auto", process_group=None,
            **op_conv_options(problem.conv_kwargs))
    names = [str(op).removeprefix("fused_ops.") for op, _, _ in capture.calls]
    assert names == ["ct_bn_pool_stats.default",
                     "ct_bn_pool_apply.default" if tracked else "ct_bn_pool_apply.no_stats"]
    assert capture.calls[1][1][1].dtype == torch.float64  # the merged statistics
    opcheck_calls(capture.calls, detach=True)  # the halves have no backward
