"""ct_bn_pool's backward (docs/math.md §6) against the unfused PyTorch modules, under
gradcheck, torch.compile and opcheck, and the version counters of the running statistics."""
import contextlib

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from torch.autograd import gradcheck, gradgradcheck

import fused_ops
from conftest import (DEVICES, Problem, assert_gradients_match, make_input, make_models, relerr,
                      twin_modules)

OP = torch.ops.fused_ops.ct_bn_pool.default
TOLERANCE = 1e-10  # float64 throughout
PROBLEMS = [
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2)),
    Problem(3, 3, 5, (5, 2, 3), (3, 1, 2), scale=-0.75),
    Problem(1, 3, 7, (2, 3, 1), (2, 2, 3), eps=1e-3),  # batch 1
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=2)),
    # Padding crops the output, so the spread gradient is not constant over x's borders.
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(padding=1)),
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(groups=2)),
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(dilation=(2, 1, 3))),
    Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), conv_kwargs=dict(
        stride=(1, 2, 3), padding=(1, 0, 2), output_padding=(0, 1, 2), dilation=(2, 1, 1),
        groups=2)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(bias=False)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), bn_kwargs=dict(affine=False)),
    # Running statistics None: batch statistics in both module modes.
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), bn_kwargs=dict(track_running_stats=False)),
]
P = PROBLEMS[0]


def run_backward(module, x, grad_out):
    """(module(x), {"x": its gradient, parameter name: its gradient}) for grad_out."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad_out)
    # A compiled module's names start with _orig_mod.
    return out.detach(), {"x": x.grad, **{name.removeprefix("_orig_mod."): p.grad
                                          for name, p in module.named_parameters()}}


def reference_and_fused_gradients(problem, training, device):
    ref, fused = make_models(problem, torch.float64, device)
    ref.train(training)
    fused.train(training)
    x = make_input(problem, torch.float64)
    grad_out = torch.randn(problem.batch, problem.out_channels, 1, 1, 1, dtype=torch.float64)
    _, want = run_backward(ref, x, grad_out)
    _, got = run_backward(fused, x.to(device), grad_out.to(device))
    return got, want, (ref, fused)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_gradients_match_reference(problem, training, device):
    got, want, (ref, fused) = reference_and_fused_gradients(problem, training, device)
    assert_gradients_match(got, want, TOLERANCE)
    if training and fused.conv_transpose.bias is not None:
        # BatchNorm's batch mean removes the bias: its gradient is exactly zero here.
        assert not fused.conv_transpose.bias.grad.any()
    for key, value in ref.state_dict().items():  # the forward's update, once
        if value.is_floating_point():
            assert relerr(fused.state_dict()[key], value) <= TOLERANCE, key


def functional_inputs(device, training, requires_grad=("x", "weight", "bias", "bn_weight",
                                                        "bn_bias")):
    _, fused = make_models(P, torch.float64, device)
    c, bn = fused.conv_transpose, fused.batch_norm
    tensors = dict(x=make_input(P, torch.float64, device), weight=c.weight, bias=c.bias,
                   bn_weight=bn.weight, bn_bias=bn.bias)
    tensors = {k: v.detach().clone().requires_grad_(k in requires_grad)
               for k, v in tensors.items()}
    return tensors, dict(scale=P.scale, running_mean=bn.running_mean,
                         running_var=bn.running_var, training=training)


def call_arguments(tensors, rest):
    return (tensors["x"], tensors["weight"], tensors["bias"], rest["scale"], tensors["bn_weight"],
            tensors["bn_bias"], rest["running_mean"], rest["running_var"], rest["training"])


def call(tensors, rest):
    return fused_ops.ct_bn_pool(*call_arguments(tensors, rest))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", ["x", "weight", "bias", "bn_weight", "bn_bias"])
def test_one_input_requiring_grad_gets_the_same_gradient(name, training):
    """The backward computes only what is asked for; what it computes does not change."""
    torch.manual_seed(0)
    tensors, rest = functional_inputs("cpu", training)
    grad_out = torch.randn(P.batch, P.out_channels, 1, 1, 1, dtype=torch.float64)
    everything = torch.autograd.grad(call(tensors, rest), list(tensors.values()), grad_out)
    alone = {k: v.detach().requires_grad_(k == name) for k, v in tensors.items()}
    (grad,) = torch.autograd.grad(call(alone, rest), alone[name], grad_out)
    torch.testing.assert_close(grad, everything[list(tensors).index(name)], rtol=TOLERANCE,
                               atol=0)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_gradcheck(training):
    """Finite differences in float64 on a tiny problem, first and second derivatives.

    gradcheck calls the function many times. Training writes the running statistics in
    place on every call (its output does not read them), eval reads them; each call gets
    fresh copies, so that every call sees the same statistics and the function is a pure
    function of the differentiated inputs, as gradcheck assumes.
    """
    torch.manual_seed(0)
    kw = dict(dtype=torch.float64, requires_grad=True)
    inputs = (torch.randn(2, 2, 2, 3, 2, **kw), torch.randn(2, 3, 2, 1, 2, **kw),
              torch.randn(3, **kw), (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_(),
              torch.randn(3, **kw))
    running_mean, running_var = torch.randn(3, dtype=torch.float64), torch.rand(3).double() + 0.5

    def pooled(x, weight, bias, bn_weight, bn_bias):
        return fused_ops.ct_bn_pool(x, weight, bias, 1.5, bn_weight, bn_bias,
                                    running_mean.clone(), running_var.clone(), training,
                                    stride=(2, 1, 1), padding=(0, 0, 1), groups=1)

    assert gradcheck(pooled, inputs)
    assert gradgradcheck(pooled, inputs)  # the backward is made of differentiable ATen ops


@contextlib.contextmanager
def fresh_compile():
    """No compiled artifact from an earlier run: PyTorch's caches key on the traced graph,
    not on the Python autograd kernel (fused_ops/_autograd.py) that produced its backward."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def assert_compiled_trains_like_eager(problem, training, device, batches, **compile_options):
    eager, module = twin_modules(problem, torch.float64, device, training)
    assert all(p.requires_grad for p in module.parameters())  # nn.Module's default
    with fresh_compile():
        compiled = torch.compile(module, fullgraph=True, **compile_options)
        for batch in batches:
            x = torch.randn(batch, *make_input(problem).shape[1:], dtype=torch.float64,
                            device=device)
            grad_out = torch.randn(batch, problem.out_channels, 1, 1, 1, dtype=torch.float64,
                                   device=device)
            out, grads = run_backward(compiled, x, grad_out)
            eager_out, eager_grads = run_backward(eager, x, grad_out)
            assert relerr(out, eager_out) <= TOLERANCE
            assert_gradients_match(grads, eager_grads, TOLERANCE)
    for key, value in eager.state_dict().items():
        got = module.state_dict()[key]
        assert (relerr(got, value) <= TOLERANCE if value.is_floating_point()
                else torch.equal(got, value)), key
    assert int(module.batch_norm.num_batches_tracked) == (len(batches) if training else 0)


COMPILE_PROBLEM = Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(stride=2, padding=1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_compiled_module_with_parameters_requiring_grad_trains(training, device):
    assert_compiled_trains_like_eager(COMPILE_PROBLEM, training, device, batches=(2, 2),
                                      backend="inductor")


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_compiled_backward_with_dynamic_shapes(training):
    assert_compiled_trains_like_eager(COMPILE_PROBLEM, training, "cpu", batches=(2, 3, 5),
                                      backend="inductor", dynamic=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("conv", [{}, dict(stride=[2, 1, 2], padding=[1, 0, 1],
                                           output_padding=[1, 0, 0], dilation=[1, 2, 1])])
@pytest.mark.parametrize("optional", ["given", "none"])
def test_opcheck_with_inputs_requiring_grad(optional, conv, training, device):
    """Includes test_autograd_registration and test_aot_dispatch_dynamic (AOTAutograd traces
    the forward and the backward and compares gradients with eager)."""
    tensors, rest = functional_inputs(device, training)
    if optional == "none":  # bias=False, affine=False, track_running_stats=False
        tensors.update(bias=None, bn_weight=None, bn_bias=None)
        rest.update(running_mean=None, running_var=None, training=True)
    torch.library.opcheck(OP, (*call_arguments(tensors, rest), 0.1, 1e-5), conv)


def test_training_bumps_the_running_stats_versions_and_eval_does_not():
    tensors, rest = functional_inputs("cpu", training=True)
    stats = rest["running_mean"], rest["running_var"]
    for training, grad_enabled, bumped in [(True, True, True), (True, False, True),
                                           (False, True, False), (False, False, False)]:
        before = [s._version for s in stats]
        rest["training"] = training
        with torch.set_grad_enabled(grad_enabled):
            call(tensors, rest)
        assert [s._version > v for s, v in zip(stats, before)] == [bumped] * 2


def test_rejected_call_leaves_the_versions_alone():
    tensors, rest = functional_inputs("cpu", training=True)
    before = rest["running_mean"]._version
    with pytest.raises(ValueError):
        fused_ops.ct_bn_pool(*call_arguments(tensors, rest), eps=-1.0)
    assert rest["running_mean"]._version == before


def test_autograd_sees_the_in_place_update():
    """A graph that saved a running statistic cannot backpropagate after training writes it."""
    tensors, rest = functional_inputs("cpu", training=True)
    factor = torch.ones(P.out_channels, dtype=torch.float64, requires_grad=True)
    saved = rest["running_mean"] * factor  # mul saves running_mean for factor's gradient
    call(tensors, rest)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_eval_backward_uses_the_statistics_of_its_forward():
    """Eval normalizes with the running statistics; changing them after the forward (here
    by a training call) does not change that forward's gradients, nor raise."""
    tensors, rest = functional_inputs("cpu", training=False)
    grad_out = torch.randn(P.batch, P.out_channels, 1, 1, 1, dtype=torch.float64)
    expected = torch.autograd.grad(call(tensors, rest), list(tensors.values()), grad_out)
    out = call(tensors, rest)
    with torch.no_grad():
        call(tensors, {**rest, "training": True})  # writes the running statistics
    got = torch.autograd.grad(out, list(tensors.values()), grad_out)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.parametrize("name", ["running_mean", "running_var"])
def test_running_stats_requiring_grad_are_rejected(name):
    tensors, rest = functional_inputs("cpu", training=False)
    rest[name] = rest[name].clone().requires_grad_()
    with pytest.raises(RuntimeError, match=f"not differentiable with respect to {name}"):
        call(tensors, rest)
    with torch.no_grad():  # no graph, nothing to differentiate
        call(tensors, rest)
