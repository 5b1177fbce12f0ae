"""ct_bn_pool's backward (docs/math.md §6) against the unfused PyTorch modules run in float64
on the same rounded values: every parameter's gradient and x's, in both modes, for float64,
float32 (within 1e-5) and float16/bfloat16 inputs (each gradient in its tensor's dtype);
gradcheck and gradgradcheck; what is computed when only some inputs require grad; an eval
backward that runs no convolution and makes no tensor of the convolution output's size; and
the running statistics' version counters."""
import contextlib
import math
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd import gradcheck, gradgradcheck
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fused_ops
import fused_ops.testing
from conftest import (DEVICES, GRAD_TOL, HALF_TYPES, Problem, assert_gradients_match,
                      make_dtype_models, make_input, make_models, run_backward)

PROBLEMS = [
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2)),
    Problem(3, 3, 5, (5, 2, 3), (3, 1, 2), scale=-0.75),
    Problem(1, 3, 7, (2, 3, 1), (2, 2, 3), eps=1e-3),  # batch 1
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=2)),
    # Padding crops the output, so the spread gradient is not constant over x's borders.
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(padding=1)),
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(groups=2)),
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(dilation=(2, 1, 3))),
    Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), scale=-2.0, eps=0.1, conv_kwargs=dict(
        stride=(1, 2, 3), padding=(1, 0, 2), output_padding=(0, 1, 2), dilation=(2, 1, 1),
        groups=2)),
    # A kernel wider than x, and padding that keeps some taps from reaching the output.
    Problem(2, 4, 6, (1, 2, 3), (4, 3, 5), conv_kwargs=dict(
        stride=(2, 1, 2), padding=(1, 1, 2), output_padding=(1, 0, 1), dilation=(1, 2, 1))),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(bias=False)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), bn_kwargs=dict(affine=False)),
    # Running statistics None: batch statistics in both module modes.
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), bn_kwargs=dict(track_running_stats=False)),
]
# (conv dtype T of x, weight and bias; BatchNorm dtype P of its parameters and running stats)
DTYPES = [(torch.float64,) * 2, (torch.float32,) * 2] + [
    (t, p) for t in HALF_TYPES for p in (t, torch.float32)]


def dtype_ids(dtypes):
    return "-".join(str(d).removeprefix("torch.") for d in dtypes)


@contextlib.contextmanager
def no_tf32():
    """TF32 off for cuDNN's convolutions and cuBLAS's products inside the block."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_gradients_match_float64(problem, training, dtypes, device):
    """Every gradient against the float64 modules' on the same rounded values, within
    GRAD_TOL of x's dtype (float32: 1e-5; float16/bfloat16: 8 units, the backward's
    convolutions run in x's dtype as PyTorch's own do), each in its tensor's dtype; and the
    forward's update of the running statistics, once. The backward's convolutions follow
    PyTorch's TF32 flags, as PyTorch's own backward does (cuDNN allows TF32 by default:
    about 5e-4 in float32 on CUDA), so they are off here."""
    conv_dtype, bn_dtype = dtypes
    ref, fused = make_dtype_models(problem, conv_dtype, bn_dtype, device)
    ref.train(training)
    fused.train(training)
    x = make_input(problem, conv_dtype)
    grad_out = torch.randn(problem.batch, problem.out_channels, 1, 1, 1,
                           dtype=torch.float64).to(conv_dtype)
    _, want = run_backward(ref, x.double(), grad_out.double())
    with no_tf32():
        _, got = run_backward(fused, x.to(device), grad_out.to(device))
    for name, grad in got.items():
        assert grad.device == x.to(device).device, name
        assert grad.dtype == (bn_dtype if name.startswith("batch_norm.") else conv_dtype), name
    assert set(got) == set(want)
    assert_gradients_match(got, want, GRAD_TOL[conv_dtype])
    if training and fused.conv_transpose.bias is not None:
        # BatchNorm's batch mean removes the bias: its gradient is exactly zero here.
        assert not fused.conv_transpose.bias.grad.any()
    if conv_dtype == torch.float64:
        for key, value in ref.state_dict().items():  # the forward's update, once
            if value.is_floating_point():
                torch.testing.assert_close(fused.state_dict()[key].cpu(), value,
                                           rtol=GRAD_TOL[conv_dtype], atol=0, msg=key)


P = PROBLEMS[0]


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
    tensors, rest = functional_inputs("cpu", training)
    grad_out = torch.randn(P.batch, P.out_channels, 1, 1, 1, dtype=torch.float64)
    everything = torch.autograd.grad(call(tensors, rest), list(tensors.values()), grad_out)
    alone = {k: v.detach().requires_grad_(k == name) for k, v in tensors.items()}
    (grad,) = torch.autograd.grad(call(alone, rest), alone[name], grad_out)
    torch.testing.assert_close(grad, everything[list(tensors).index(name)], rtol=1e-10, atol=0)


class _OpRecorder(TorchDispatchMode):
    """The name and largest tensor output (numel) of every ATen op run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, max(sizes, default=0)))
        return out


# Stride 3 and a wide kernel make the conv output many times the size of x and the weight.
WIDE = Problem(2, 3, 4, (4, 4, 4), (5, 5, 5), conv_kwargs=dict(stride=3, padding=1,
                                                                output_padding=2))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("requested", [("x",), ("weight",), ("bn_weight",),
                                       ("x", "weight", "bias", "bn_weight", "bn_bias")],
                         ids="-".join)
def test_eval_backward_is_conv_free(requested, dtype):
    """docs/math.md §6.1: eval's backward is contractions of x and the weight with the tap
    masks; no convolution, and no op output beyond twice the larger of x and the weight
    (the conv output here is several times that)."""
    _, fused = make_dtype_models(WIDE, dtype, dtype)
    fused.eval()
    x = make_input(WIDE, dtype)
    inputs = _requiring_grad(fused, x, requested)
    out = fused(x)
    bound = 2 * max(x.numel(), fused.conv_transpose.weight.numel())
    assert WIDE.batch * WIDE.out_channels * math.prod(WIDE.out_size()) > 4 * bound
    _assert_conv_free_backward(out, inputs, bound)


def _requiring_grad(fused, x, requested):
    """The inputs named in `requested` (x and fused's parameters), the only ones left
    requiring grad."""
    tensors = dict(x=x, weight=fused.conv_transpose.weight, bias=fused.conv_transpose.bias,
                   bn_weight=fused.batch_norm.weight, bn_bias=fused.batch_norm.bias)
    for name, tensor in tensors.items():
        tensor.requires_grad_(name in requested)
    return [t for n, t in tensors.items() if n in requested]


def _assert_conv_free_backward(out, inputs, bound):
    """out's backward runs no convolution and makes no op output of more than `bound`
    elements."""
    with _OpRecorder() as recorder:
        grads = torch.autograd.grad(out, inputs, torch.randn_like(out))
    names = {name for name, _ in recorder.ops}
    assert not {n for n in names if "convolution" in n}, names
    assert max(size for _, size in recorder.ops) <= bound, recorder.ops
    assert all(g.shape == i.shape for g, i in zip(grads, inputs))


# The training backward's routes (docs/dispatch.md), each on the problems it covers:
# PROBLEMS' and, for "gram" (one tap per output position), its own. "aten" and "kept" cover
# every geometry.
GRAM_PROBLEMS = [
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(stride=2)),
    Problem(3, 4, 6, (3, 2, 4), (2, 1, 3), scale=-0.5, conv_kwargs=dict(
        stride=(2, 3, 3), output_padding=(1, 0, 1), groups=2)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(stride=3, dilation=2)),
    Problem(2, 4, 6, (3, 4, 5), (1, 1, 1)),
]


def route_covers(route, problem):
    conv = {name: problem.triple(name, default) for name, default in (
        ("stride", 1), ("padding", 0), ("output_padding", 0), ("dilation", 1))}
    weight = torch.empty(problem.in_channels, 1, *problem.kernel)
    covers = fused_ops._backward_routes._COVERS
    return route not in covers or covers[route][1](conv, weight)


# "spectral-gram", "spectral-weight": x's gradient through the weight's Gram kernel or through
# the weight itself (docs/math.md §6.2.2), forced; "-by-row": one frequency row per slab, the
# slab loop and the first slab's centring.
ROUTE_CASES = [(route, p) for route in ("aten", "kept", "spectral-gram", "spectral-gram-by-row",
                                        "spectral-weight-by-row", "gram")
               for p in PROBLEMS + GRAM_PROBLEMS if route_covers(route.split("-")[0], p)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("route,problem", ROUTE_CASES,
                         ids=[f"{r}-{Problem.ids(p)}" for r, p in ROUTE_CASES])
def test_training_backward_routes_match_float64(route, problem, dtypes, device, monkeypatch):
    """Each route of training mode's backward, forced, against the float64 modules, as
    test_gradients_match_float64 (its forward too, which "kept" computes through the
    convolution output); float32/float64 x far from zero mean, where the routes' centering
    matters."""
    if route.startswith("spectral-"):
        variant = route.split("-")
        route = "spectral"
        monkeypatch.setattr(fused_ops._spectral_backward, "X_OPERATOR", variant[1])
        if variant[-1] == "row":
            monkeypatch.setattr(fused_ops._spectral_backward, "SLAB_BYTES", 1)
    conv_dtype, bn_dtype = dtypes
    ref, fused = make_dtype_models(problem, conv_dtype, bn_dtype, device)
    x = make_input(problem, conv_dtype, offset=0.0 if conv_dtype in HALF_TYPES else 3.0)
    grad_out = torch.randn(problem.batch, problem.out_channels, 1, 1, 1,
                           dtype=torch.float64).to(conv_dtype)
    _, want = run_backward(ref, x.double(), grad_out.double())
    with no_tf32(), fused_ops.testing.route(backward=route):
        _, got = run_backward(fused, x.to(device), grad_out.to(device))
    assert set(got) == set(want)
    assert_gradients_match(got, want, GRAD_TOL[conv_dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_spectral_route_builds_its_bases_once_per_geometry(device, monkeypatch):
    """The spectral route's DFT bases depend on the geometry alone (kept per geometry, dtype
    and device): from an empty store, the first step builds them, the second reads them."""
    built = []
    build = fused_ops._spectral_backward._bases
    monkeypatch.setattr(fused_ops._spectral_backward, "_BASES", {})
    monkeypatch.setattr(fused_ops._spectral_backward, "_bases",
                        lambda *args: built.append(args) or build(*args))
    fused = fused_ops.ConvTransposeBNPool3d(3, 4, (2, 3, 2), 2.0).to(device)
    x = torch.randn(2, 3, 3, 4, 5, device=device, requires_grad=True)
    with fused_ops.testing.route(backward="spectral"):
        fused(x).sum().backward()
        assert len(built) == 1
        first = x.grad.clone()
        x.grad = None
        fused(x).sum().backward()
    assert len(built) == 1
    torch.testing.assert_close(x.grad, first)


@pytest.mark.parametrize("device", DEVICES)
def test_spectral_route_inverts_by_slices_of_the_batch(device, monkeypatch):
    """Grid.x_gradient (the spectral route's inverse FFT, cropped to x) by slices of two
    samples of a batch of five, the last slice partial, against one inverse FFT."""
    full, x_size = [5, 6, 7], (3, 4, 5)
    g = torch.randn(5, 3, *full, dtype=torch.float64, device=device)
    spectrum = torch.fft.rfftn(g, dim=(2, 3, 4)).permute(2, 3, 4, 0, 1).contiguous()
    sb = fused_ops._spectral_backward
    per_sample = 3 * full[0] * full[1] * (full[2] // 2 + 1) * spectrum.element_size() * 2
    monkeypatch.setattr(sb, "SLAB_BYTES", 2 * per_sample)
    conv = dict(groups=1, dilation=(1, 1, 1))
    grid = sb.Grid(spectrum, full, conv, torch.ones(1, 1, 1, 1, 1, 1, dtype=torch.float64),
                   (1, 1, 1), 0)
    got = grid.x_gradient(x_size)
    assert got.is_contiguous()
    torch.testing.assert_close(got, g[:, :, :3, :4, :5], rtol=1e-12, atol=1e-12)


def lag_spectrum_reference(x, kernel, dilation, groups):
    """_ct_bn_pool_lag_spectrum in float64 from its definition (docs/math.md §3.5, §6.2.2):
    R[j, i, d] = sum_b sum_p x[b, j, p] x[b, i, p + d dil] by an FFT on the full grid, less
    sum_b s_b[j] s_b[i] / N, at the lags |d| < k on the grid M = 2k - 1 (lag d at d mod M), and
    its real DFT there: [M0, M1, M2 // 2 + 1, G, Cig (j), Cig (i)]."""
    full = [x.shape[2 + d] + dilation[d] * (kernel[d] - 1) for d in range(3)]
    if x.shape[0] == 0:  # R = 0 (an FFT of no sample is refused)
        cig = x.shape[1] // groups
        return torch.zeros(2 * kernel[0] - 1, 2 * kernel[1] - 1, kernel[2], groups, cig, cig,
                           dtype=torch.complex128, device=x.device)
    spectrum = torch.fft.rfftn(x.double(), s=full, dim=(2, 3, 4)).unflatten(1, (groups, -1))
    r = torch.fft.irfftn(torch.einsum("bgj...,bgi...->gji...", spectrum.conj(), spectrum),
                         s=full, dim=(3, 4, 5))
    sums = x.double().sum((2, 3, 4)).unflatten(1, (groups, -1))
    r = r - torch.einsum("bgj,bgi->gji", sums, sums)[..., None, None, None] / math.prod(full)
    for d in range(3):
        m = torch.arange(2 * kernel[d] - 1, device=x.device)
        lag = torch.where(m < kernel[d], m, m - (2 * kernel[d] - 1))
        r = r.index_select(3 + d, (lag * dilation[d]) % full[d])
    return torch.fft.rfftn(r, dim=(3, 4, 5)).permute(3, 4, 5, 0, 1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("problem", [Problem(3, 4, 6, (5, 6, 4), (3, 2, 4)),
                                     Problem(2, 6, 4, (4, 5, 3), (2, 3, 2), conv_kwargs=dict(
                                         groups=2, dilation=(1, 2, 3))),
                                     Problem(0, 4, 6, (3, 4, 5), (2, 3, 2))], ids=Problem.ids)
def test_lag_spectrum_is_the_centred_cross_correlation(problem, dtype, device):
    """_ct_bn_pool_lag_spectrum (the spectral backward's R^, and x's spectrum it is made from)
    against their definitions in float64 on the same rounded x, far from zero mean (the
    centring); opcheck."""
    groups, dilation = problem.conv_kwargs.get("groups", 1), problem.triple("dilation", 1)
    x = (make_input(problem, torch.float64) + 3.0).to(dtype).to(device)
    weight = torch.randn(problem.in_channels, problem.out_channels // groups, *problem.kernel,
                         dtype=dtype, device=device)
    got, got_spectrum = torch.ops.fused_ops._ct_bn_pool_lag_spectrum(
        x, weight, dilation=dilation, groups=groups)
    want = lag_spectrum_reference(x, problem.kernel, dilation, groups)
    assert got.dtype == torch.complex128 and got.shape == want.shape
    # float32 spectra and sums for float32 and bfloat16 x (§3.5): relative to R^'s largest
    # entry.
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    scale = max(want.abs().max().item(), 1.0)
    assert (got - want).abs().max().item() <= tol * scale
    # x's spectrum on the full output's grid, [n0, n1, n2 // 2 + 1, B, Ci], complex in the
    # compute dtype; relative to its largest entry (float32's rounding of x's DFT).
    full = [x.shape[2 + d] + dilation[d] * (problem.kernel[d] - 1) for d in range(3)]
    assert got_spectrum.shape == (*full[:2], full[2] // 2 + 1, *x.shape[:2])
    assert got_spectrum.dtype == (torch.complex128 if dtype == torch.float64
                                  else torch.complex64)
    if x.shape[0]:  # an FFT of no sample is refused
        want_spectrum = torch.fft.rfftn(x.double(), s=full, dim=(2, 3, 4)).permute(2, 3, 4, 0, 1)
        error = (got_spectrum.to(torch.complex128) - want_spectrum).abs().max().item()
        assert error <= (1e-13 if dtype == torch.float64 else 1e-6) * want_spectrum.abs().max().item()
    torch.library.opcheck(torch.ops.fused_ops._ct_bn_pool_lag_spectrum.default, (x, weight),
                          dict(dilation=dilation, groups=groups))


@pytest.mark.parametrize("route", ["aten", "spectral", "gram"])
def test_empty_batch_training_backward_is_zero(route):
    """A batch of no sample: every route's gradients are zeros of the inputs' shapes."""
    _, fused = make_models(GRAM_PROBLEMS[0] if route == "gram" else PROBLEMS[0], torch.float64)
    x = torch.randn(0, fused.conv_transpose.in_channels, 3, 4, 5, dtype=torch.float64,
                    requires_grad=True)
    with fused_ops.testing.route(backward=route), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # var_mean over no value (the aten route)
        fused(x).sum().backward()
    assert x.grad.shape == x.shape
    for name, param in fused.named_parameters():
        assert param.grad is not None and not param.grad.any(), name


def _ops_run(fn) -> list:
    """The names of the ATen and fused_ops ops that `fn` runs (not those inside our kernels)."""
    with _OpRecorder() as recorder:
        fn()
    return [name for name, _ in recorder.ops]


@pytest.mark.parametrize("problem", [PROBLEMS[0], PROBLEMS[7]], ids=Problem.ids)
def test_cpu_training_step_forms_the_convolution_once(problem):
    """docs/dispatch.md: a training step on the CPU ("kept") runs one convolution, in the
    forward instead of the op's statistics (``_ct_bn_pool_kept_stats``), and one
    convolution_backward (``_ct_bn_pool_kept_backward``); forcing "aten" runs the op (its
    statistics cost a convolution there) and the backward's convolution."""
    _, fused = make_models(problem, torch.float32)
    x = make_input(problem, torch.float32).requires_grad_()

    def step():
        fused(x).sum().backward()

    ours = {"ct_bn_pool", "ct_bn_pool_apply", "_ct_bn_pool_kept_stats", "_ct_bn_pool_kept_backward"}
    for route, once in (("auto", {"_ct_bn_pool_kept_stats", "ct_bn_pool_apply",
                                  "_ct_bn_pool_kept_backward"}),
                        ("aten", {"ct_bn_pool", "convolution", "convolution_backward"})):
        with fused_ops.testing.route(backward=route):
            names = _ops_run(step)
        convolutions = {"convolution", "_convolution", "convolution_backward"}
        assert sorted(n for n in names if n in ours | convolutions) == sorted(once), (route, names)


@pytest.mark.parametrize("device", DEVICES)
def test_kept_route_calls_few_aten_ops(device):
    """Host time (docs/performance.md): around their convolution the kept route's two ops run
    two kernels of ours (y's moments, the per-channel gradient coefficients), not the dozens of
    per-channel ATen ops whose dispatcher calls cost the small layers more than the
    convolution. Counted: the ATen ops each op calls itself, in a profiled step."""
    p = PROBLEMS[4]
    _, fused = make_models(p, torch.float32)
    fused = fused.to(device)
    x = make_input(p, torch.float32).to(device).requires_grad_()
    fused(x).sum().backward()  # warm-up: the first call's lazy initialization
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fused(x).sum().backward()
    calls = {}
    for event in prof.events():
        if event.name.startswith("fused_ops::_ct_bn_pool_kept_"):
            calls[event.name] = sorted(child.name for child in event.cpu_children)
    assert set(calls) == {"fused_ops::_ct_bn_pool_kept_stats", "fused_ops::_ct_bn_pool_kept_backward"}
    for name, children in calls.items():
        assert len(children) <= 12, (name, children)
    assert "aten::convolution_backward" in calls["fused_ops::_ct_bn_pool_kept_backward"]


@pytest.mark.parametrize("route", ["gram", "spectral"])
def test_conv_free_step_computes_the_statistics_once(route):
    """A forward whose backward takes a conv-free route keeps the batch's sums and statistics
    (ct_bn_pool_stats, then ct_bn_pool_apply, instead of the op): the backward reads them
    instead of computing them again, and no convolution runs in the step."""
    p = CONV_FREE_WIDE[route]
    _, fused = make_models(p, torch.float64)
    x = make_input(p, torch.float64).requires_grad_()

    def step():
        fused(x).sum().backward()

    with fused_ops.testing.route(backward=route):
        names = _ops_run(step)
    watched = {"ct_bn_pool", "ct_bn_pool_stats", "ct_bn_pool_apply", "convolution",
               "_convolution", "convolution_backward"}
    assert sorted(n for n in names if n in watched) == ["ct_bn_pool_apply", "ct_bn_pool_stats"]


def test_backward_without_y_refuses_several_taps_per_position():
    """_ct_bn_pool_kept_backward without y is x's Gram algebra, exact only where one tap
    reaches each output position: elsewhere it refuses, naming what it needs (its fake kernel
    too)."""
    def call():
        x, weight = torch.randn(2, 3, 4, 4, 4), torch.randn(3, 5, 3, 3, 3)
        sums = torch.randn(2, 5, dtype=torch.float64)
        stats = torch.tensor([[128.0] * 5, [0.0] * 5, [128.0] * 5], dtype=torch.float64)
        torch.ops.fused_ops._ct_bn_pool_kept_backward(
            torch.randn(2, 5, 1, 1, 1), x, weight, None, None, sums, stats, 1.0, 1e-5,
            stride=[2] * 3, padding=[0] * 3, output_padding=[0] * 3, dilation=[1] * 3, groups=1,
            output_mask=[True, True])

    for mode in (contextlib.nullcontext(), FakeTensorMode()):
        with mode, pytest.raises(RuntimeError, match="without y the backward needs padding 0"):
            call()


@pytest.mark.parametrize("case", ["algo", "empty-batch"])
def test_forced_kept_refuses_where_the_forward_cannot_keep(case):
    """"kept" needs a forward that forms the output itself: not a forced algorithm (it
    computes the statistics its own way), not an empty batch (the op's own semantics)."""
    p = PROBLEMS[0]
    _, fused = make_models(p, torch.float64, algo="sliced_conv" if case == "algo" else "auto")
    x = make_input(p, torch.float64)
    if case == "empty-batch":
        x = x[:0]
    with fused_ops.testing.route(backward="kept"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # var_mean over no value (the empty batch)
        out = fused(x.requires_grad_())
        with pytest.raises(RuntimeError, match="backward='kept'\\): the route needs the forward"):
            out.sum().backward()


@pytest.mark.parametrize("route,problem", [("spectral", PROBLEMS[3]), ("gram", PROBLEMS[4])],
                         ids=["spectral-stride", "gram-padding"])
def test_forced_route_refuses_what_it_does_not_cover(route, problem):
    _, fused = make_models(problem, torch.float64)
    out = fused(make_input(problem, torch.float64).requires_grad_())
    with fused_ops.testing.route(backward=route), pytest.raises(
            RuntimeError, match=f"backward='{route}'\\): the route needs"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match="backward must be one of"):
        with fused_ops.testing.route(backward="fast"):
            pass


# Training problems whose conv output is many times x on the output's grid: Co large, and
# a large kernel (spectral) or a large stride (gram).
CONV_FREE_WIDE = {"spectral": Problem(2, 3, 16, (8, 8, 8), (3, 3, 3)),
                  "gram": Problem(2, 3, 16, (6, 6, 6), (2, 2, 2), conv_kwargs=dict(stride=2))}


@pytest.mark.parametrize("requested", [("x",), ("weight",), ("bn_weight",),
                                       ("x", "weight", "bias", "bn_weight", "bn_bias")],
                         ids="-".join)
@pytest.mark.parametrize("route", list(CONV_FREE_WIDE))
def test_training_backward_is_conv_free(route, requested, monkeypatch):
    """docs/math.md §6.2.2, §6.2.3: no convolution, and no op output beyond x on the full
    output's grid or the weight on the lags' grid 2k - 1 (spectral, with one frequency plane
    per slab), or beyond x (gram)."""
    monkeypatch.setattr(fused_ops._spectral_backward, "SLAB_BYTES", 1)
    p = CONV_FREE_WIDE[route]
    _, fused = make_models(p, torch.float64)
    x = make_input(p, torch.float64)
    inputs = _requiring_grad(fused, x, requested)
    out = fused(x)
    grid = p.out_size() if route == "spectral" else p.size
    weight = fused.conv_transpose.weight
    lags = [2 * k - 1 for k in p.kernel] if route == "spectral" else p.kernel
    bound = max(p.batch * p.in_channels * math.prod(grid),
                weight.shape[0] * weight.shape[1] * math.prod(lags))
    assert p.batch * p.out_channels * math.prod(p.out_size()) > 4 * bound
    with fused_ops.testing.route(backward=route):
        _assert_conv_free_backward(out, inputs, bound)


def _float64_inputs(c_out, kernel):
    """(x [2, 2, 2, 3, 2], weight, bias, bn_weight, bn_bias), float64, requiring grad."""
    kw = dict(dtype=torch.float64, requires_grad=True)
    return (torch.randn(2, 2, 2, 3, 2, **kw), torch.randn(2, c_out, *kernel, **kw),
            torch.randn(c_out, **kw),
            (torch.rand(c_out, dtype=torch.float64) + 0.5).requires_grad_(),
            torch.randn(c_out, **kw))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("scale", [1.5, -0.5])
def test_gradcheck(training, scale):
    """Finite differences in float64 on a tiny problem, first and second derivatives.

    gradcheck calls the function many times. Training writes the running statistics in
    place on every call (its output does not read them), eval reads them; each call gets
    fresh copies, so that every call sees the same statistics and the function is a pure
    function of the differentiated inputs, as gradcheck assumes. A large eps (0.3) makes its
    part of each gradient visible.
    """
    inputs = _float64_inputs(3, (2, 1, 2))
    running_mean, running_var = torch.randn(3, dtype=torch.float64), torch.rand(3).double() + 0.5

    def pooled(x, weight, bias, bn_weight, bn_bias):
        return fused_ops.ct_bn_pool(x, weight, bias, scale, bn_weight, bn_bias,
                                    running_mean.clone(), running_var.clone(), training,
                                    eps=0.3, stride=(2, 1, 1), padding=(0, 0, 1), groups=1)

    assert gradcheck(pooled, inputs)
    assert gradgradcheck(pooled, inputs)  # the backward is made of differentiable ATen ops


# (route forced or "auto", conv options): "auto" there takes "gram" in a first backward (one
# tap per position, 8 output channels: docs/dispatch.md's CPU rule), "spectral" is forced.
DOUBLE_BACKWARD_CASES = [("auto", dict(stride=2)), ("gram", dict(stride=2)), ("spectral", dict())]


@pytest.mark.parametrize("route, conv", DOUBLE_BACKWARD_CASES, ids=lambda c: str(c))
def test_double_backward_of_a_conv_free_geometry(route, conv):
    """A backward that is differentiated (create_graph) takes the recomputed convolution where
    a first backward takes a conv-free route (whose statistics have no derivative), so
    gradgradcheck holds under "auto"; a conv-free route forced there refuses with its reason."""
    inputs = _float64_inputs(8, (2, 2, 2))
    running_mean, running_var = torch.randn(8, dtype=torch.float64), torch.rand(8).double() + 0.5
    geometry = {"stride": [conv.get("stride", 1)] * 3, "padding": [0] * 3,
                "output_padding": [0] * 3, "dilation": [1] * 3, "groups": 1}
    if route == "auto":
        assert fused_ops._backward_routes.chosen(geometry, inputs[1], inputs[0]) == "gram"

    def pooled(x, weight, bias, bn_weight, bn_bias):
        return fused_ops.ct_bn_pool(x, weight, bias, 1.5, bn_weight, bn_bias,
                                    running_mean.clone(), running_var.clone(), True, eps=0.3,
                                    **conv)

    with fused_ops.testing.route(backward=route):
        assert gradcheck(pooled, inputs)
        if route == "auto":
            assert gradgradcheck(pooled, inputs)
            return
        with pytest.raises(RuntimeError, match="no double backward"):
            torch.autograd.grad(pooled(*inputs).sum(), inputs[0], create_graph=True)


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


@pytest.mark.parametrize("op", ["stats", "apply"])
def test_backward_through_the_synchronized_halves_raises_naming_the_op(op):
    """ct_bn_pool_stats and ct_bn_pool_apply (the synchronized training step's halves,
    fused_ops/distributed.py) have no backward: a backward through ct_bn_pool_stats raises
    instead of returning wrong gradients, and ct_bn_pool_apply refuses inputs requiring grad
    at the call, before it writes the running statistics (docs/distributed.md)."""
    _, fused = make_models(P, torch.float64)
    c, bn = fused.conv_transpose, fused.batch_norm
    x = make_input(P, torch.float64).requires_grad_(op == "stats")
    sample_sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(x, c.weight.detach())
    message = f"fused_ops::ct_bn_pool_{op} is not implemented"
    if op == "stats":
        with pytest.raises(RuntimeError, match=message):
            sample_sums.sum().backward()
        return
    spatial = math.prod(P.out_size())
    before = [bn.running_mean.clone(), bn.running_var.clone()]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fused_ops.ct_bn_pool_apply(
            sample_sums, stats, spatial, None, 2.0, bn.weight, None, bn.running_mean,
            bn.running_var, 0.1, 1e-5, torch.float64)  # bn.weight requires grad
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])


def test_apply_bumps_the_running_stats_versions():
    """ct_bn_pool_apply writes the running statistics in place: their versions move, so
    autograd refuses a graph that saved them before."""
    _, fused = make_models(P, torch.float64)
    bn = fused.batch_norm
    sample_sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(
        make_input(P, torch.float64), fused.conv_transpose.weight.detach())
    before = [bn.running_mean._version, bn.running_var._version]
    with torch.no_grad():
        torch.ops.fused_ops.ct_bn_pool_apply(
            sample_sums, stats, math.prod(P.out_size()), None, 2.0, bn.weight, None,
            bn.running_mean, bn.running_var, 0.1, 1e-5, torch.float64)
    assert bn.running_mean._version > before[0] and bn.running_var._version > before[1]
