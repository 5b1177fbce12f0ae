"""What algo='auto' picks on each device (csrc/dispatch.cpp, docs/performance.md), each pick
checked against float64; and the testing hook (fused_ops.testing) that forces a kernel route
or shrinks a size limit inside a `with` block: unknown knobs and values refused by name,
the previous setting restored on exit."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fused_ops
import fused_ops.testing
from conftest import (DEVICES, PATH_MARKS, TOL, TRAIN_PROBLEMS, Problem, check_training,
                      make_input, make_models, paths_seen, relerr)

ROUTES = {"direct": ("mma", "simt"), "s_stage": ("simt",), "contraction": ("gemm",),
          "overlap": ("off",)}
LIMITS = ("slice_bytes", "finalize_terms")


def current_route(knob):
    """The knob's setting, read through the hook (it returns the previous value) and put back."""
    value = torch.ops.fused_ops._set_route(knob, "auto")
    torch.ops.fused_ops._set_route(knob, value)
    return value


def current_limit(name):
    value = torch.ops.fused_ops._set_limit(name, 0)
    torch.ops.fused_ops._set_limit(name, value)
    return value


# --- auto ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("problem", TRAIN_PROBLEMS, ids=Problem.ids)
def test_auto_matches_reference_over_steps(problem, dtype, device):
    """Whatever auto picks: output and statistics against float64 over three steps."""
    check_training(problem, dtype, device, "auto")


@pytest.mark.parametrize("kernel, conv_kwargs, convolution", [
    (2, dict(stride=2), False),        # kernel = stride: one lag, a quarter of the conv's work
    (4, dict(stride=2), False),        # 27 lags, a fifth
    (3, dict(), True),                 # stride 1: 125 lags, three times the conv's work
    (2, dict(stride=2, padding=1), True),  # padding: not covered
], ids=["up2", "st2", "k3", "padding"])
def test_auto_on_cpu_takes_correlation_where_it_is_cheaper(kernel, conv_kwargs, convolution):
    """CPU auto: correlation where its float64 GEMMs have under a third of the convolution's
    multiply-adds, else ATen's convolution (sliced_conv)."""
    p = Problem(4, 16, 32, (8, 8, 8), (kernel,) * 3, conv_kwargs=conv_kwargs)
    ref, fused = make_models(p, torch.float32, "cpu")
    ref.train()
    fused.train()
    x = make_input(p, torch.float32, "cpu")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fused(x)
    assert any("convolution" in e.name for e in prof.events()) == convolution
    with torch.no_grad():
        assert relerr(out, ref(x.double())) <= TOL[torch.float32]


CUDA_AUTO_CASES = [
    (4, 4, dict(stride=2), "cross_spectrum"),    # st2: 27 lags from the cross-spectrum
    (2, 4, dict(stride=2), "correlation"),       # up2: one lag, the Gram matrix
    (3, 16, dict(), "fft"),                      # stride 1, 2.2e8 multiply-adds: Parseval
    (3, 4, dict(), "direct"),                    # stride 1, 5.5e7: the direct kernel
    (2, 16, dict(stride=2, padding=1), "sliced_conv"),  # padding, 1.8e8: cuDNN over slices
    (2, 4, dict(stride=2, padding=1), "direct"),        # padding, 4.5e7: the direct kernel
    (3, 16, dict(padding=1), "direct"),          # padding at stride 1, 1.1e8: the direct kernel
    # padding at stride 1, 4.5e8: the direct kernel's float64 tensor cores where they run (sm_90)
    (3, 64, dict(padding=1), "direct_mma"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("kernel, batch, conv_kwargs, expected", CUDA_AUTO_CASES,
                         ids=["st2", "up2", "k3", "k3-small", "padding", "padding-small",
                              "padding-stride1", "padding-stride1-large"])
def test_auto_on_cuda_takes_the_measured_fastest(kernel, batch, conv_kwargs, expected):
    """CUDA auto: with a stride and padding 0 the cross-spectrum, or the correlation's single
    GEMM when every phase has one tap; elsewhere the direct kernel under 1e8 multiply-adds
    (2e8 with padding at stride 1), then at stride 1 the FFT path, with padding at stride 1
    the direct kernel on the tensor cores (sm_90), else cuDNN's convolution."""
    if expected == "direct_mma":
        expected = "direct" if torch.cuda.get_device_capability()[0] >= 9 else "sliced_conv"
    p = Problem(batch, 16, 32, (8, 8, 8), (kernel,) * 3, conv_kwargs=conv_kwargs)
    ref, fused = make_models(p, torch.float32, "cuda")
    ref.train()
    fused.train()
    x = make_input(p, torch.float32, "cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert paths_seen(names) == ({expected} & PATH_MARKS.keys())
    if expected == "correlation":
        assert any(name == "aten::bmm" for name in names)
    with torch.no_grad():
        assert relerr(out, ref(x.double().cpu())) <= TOL[torch.float32]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("batch, size, kernel, expected", [
    (16, (16, 32, 32), (5, 5, 5), "cross_spectrum"),
    (4, (16, 32, 32), (5, 5, 5), "cross_spectrum"),
    (16, (8, 16, 16), (5, 5, 5), "fft"),
    (16, (1, 32, 32), (1, 5, 5), "cross_spectrum"),
], ids=["seed", "b4", "s8", "depth-1"])
def test_auto_on_cuda_at_stride_1_weighs_the_cross_spectrum(batch, size, kernel, expected):
    """At stride 1 CUDA auto takes the cross-spectrum where its work is large enough to beat
    the FFT path (the seed problem and its batch of 4: 1.2e9 and 5.0e8 multiply-adds), else
    the FFT path (s8, 2.3e8); with one position in the depth (border's plane problems) the
    cross-spectrum whatever its work (5.9e7 here). Checked against float64 on the GPU."""
    p = Problem(batch, 64, 128, size, kernel)
    ref, fused = make_models(p, torch.float32, "cuda")
    ref.cuda().train()
    fused.train()
    x = make_input(p, torch.float32, "cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    assert paths_seen([e.name for e in prof.events()]) == {expected}
    with torch.no_grad():
        assert relerr(out, ref(x.double())) <= TOL[torch.float32]


# --- the training backward's route (fused_ops/_backward_routes.py, docs/dispatch.md) --------

BACKWARD_CASES = [
    # (device, B, Ci, Co, spatial, kernel, conv, can_keep, route)
    ("cpu", 4, 16, 16, 12, 2, dict(stride=2), True, "gram"),     # ATen / gram work 11.8
    ("cpu", 4, 32, 16, 8, 2, dict(stride=2), True, "gram"),      # cpu_up2: 5.6
    ("cpu", 2, 128, 64, 4, 2, dict(stride=2), True, "kept"),     # 1.2
    ("cpu", 4, 16, 16, 12, 2, dict(stride=2), False, "gram"),    # no statistics: Cig / (Cog taps) 1/8
    ("cpu", 4, 32, 16, 8, 2, dict(stride=2), False, "aten"),     # no statistics: 1/4
    ("cpu", 4, 16, 32, 8, 3, dict(), True, "kept"),              # cpu_small
    ("cpu", 4, 16, 32, 8, 3, dict(), False, "aten"),             # the forward did not keep y
    ("cuda", 16, 64, 128, (16, 32, 32), 5, dict(), True, "spectral"),  # seed: ratio 78
    ("cuda", 16, 64, 128, (16, 32, 32), 3, dict(), True, "spectral"),  # k3: ratio 24.1
    ("cuda", 16, 64, 128, (16, 32, 32), 2, dict(), True, "aten"),      # ratio 8.9, 5e10
    ("cuda", 8, 32, 32, 8, 5, dict(), True, "aten"),             # t8k5: too small
    ("cuda", 8, 64, 32, 16, 4, dict(stride=2, padding=1), True, "kept"),
    ("cuda", 8, 64, 32, 16, 4, dict(stride=2, padding=1), False, "aten"),
    ("cuda", 8, 64, 32, 16, 2, dict(stride=2), True, "gram"),    # up2: ATen / gram work 6
    ("cuda", 8, 512, 256, 8, 2, dict(stride=2), True, "gram"),   # deep, batch 8: 4.0
    ("cuda", 1, 512, 256, 8, 2, dict(stride=2), True, "aten"),   # deep, batch 1: 1.2
    ("cuda", 1, 32, 16, 16, 2, dict(stride=2), True, "aten"),    # ATen's work 5e7: too small
    ("cuda", 8, 64, 32, 16, 2, dict(stride=2), False, "aten"),   # up2, no statistics kept
]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: "-".join(map(str, c[:6])) + (
    "-" + "-".join(f"{k}{v}" for k, v in c[6].items()) if c[6] else "") + f"-keep{c[7]}")
def test_backward_route_follows_the_measured_rule(case):
    device, batch, ci, co, spatial, kernel, conv, can_keep, route = case
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spatial = spatial if isinstance(spatial, tuple) else (spatial,) * 3
    geometry = {"stride": [conv.get("stride", 1)] * 3, "padding": [conv.get("padding", 0)] * 3,
                "output_padding": [0] * 3, "dilation": [1] * 3, "groups": 1}
    # Shapes are all the rule reads: empty strides of memory on the device (expand).
    x = torch.empty(1, device=device).expand(batch, ci, *spatial)
    weight = torch.empty(1, device=device).expand(ci, co, kernel, kernel, kernel)
    assert fused_ops._backward_routes.chosen(geometry, weight, x, can_keep) == route


@pytest.mark.cuda
def test_traced_cuda_backward_keeps_the_output_too():
    """"kept" forms y in an op of its own, with TF32 off whatever the run's flags: a traced
    CUDA call takes it as an eager one does (its exactness under torch.compile:
    test_compile_export.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    geometry = {"stride": [2] * 3, "padding": [1] * 3, "output_padding": [0] * 3,
                "dilation": [1] * 3, "groups": 1}
    with FakeTensorMode():
        x = torch.empty(8, 64, 16, 16, 16, device="cuda")
        weight = torch.empty(64, 32, 4, 4, 4, device="cuda")
        assert fused_ops._backward_routes.chosen(geometry, weight, x, True) == "kept"


# --- The testing hook --------------------------------------------------------------------------

@pytest.mark.parametrize("knob", list(ROUTES))
def test_route_sets_the_knob_inside_the_block_and_restores_it(knob):
    assert current_route(knob) == "auto"
    for value in ROUTES[knob]:
        with fused_ops.testing.route(**{knob: value}):
            assert current_route(knob) == value
            with fused_ops.testing.route(**{knob: "auto"}):  # nested: the inner one wins
                assert current_route(knob) == "auto"
            assert current_route(knob) == value
        assert current_route(knob) == "auto"
    with pytest.raises(KeyError):  # an error inside the block restores it too
        with fused_ops.testing.route(**{knob: ROUTES[knob][0]}):
            raise KeyError("inside")
    assert current_route(knob) == "auto"


@pytest.mark.parametrize("name", LIMITS)
def test_limit_sets_the_limit_inside_the_block_and_restores_it(name):
    assert current_limit(name) == 0  # the built-in value
    with fused_ops.testing.limit(**{name: 4096}):
        assert current_limit(name) == 4096
        with fused_ops.testing.limit(**{name: 0}):
            assert current_limit(name) == 0
        assert current_limit(name) == 4096
    assert current_limit(name) == 0
    with pytest.raises(KeyError):
        with fused_ops.testing.limit(**{name: 1}):
            raise KeyError("inside")
    assert current_limit(name) == 0


@pytest.mark.parametrize("routes, named", [
    (dict(tensor_cores="on"), "tensor_cores"),          # no such knob
    (dict(direct="tensor_cores"), "tensor_cores"),      # no such value
    (dict(s_stage="mma"), "s_stage"),                   # a value of another knob
    (dict(contraction="simt"), "contraction"),
    (dict(overlap="on"), "overlap"),
    (dict(direct="simt", overlap="sometimes"), "overlap"),  # the first one set, then undone
], ids=["knob", "value", "s_stage", "contraction", "overlap", "second"])
def test_route_refuses_unknown_knobs_and_values_by_name(routes, named):
    with pytest.raises(RuntimeError, match=named):
        with fused_ops.testing.route(**routes):
            pytest.fail("the block ran")
    for knob in ROUTES:
        assert current_route(knob) == "auto", knob


@pytest.mark.parametrize("limits, named", [
    (dict(slice_megabytes=1), "slice_megabytes"),
    (dict(finalize_terms=-1), "finalize_terms"),
    (dict(slice_bytes=1 << 20, terms=5), "terms"),
], ids=["name", "negative", "second"])
def test_limit_refuses_unknown_names_and_negative_values(limits, named):
    with pytest.raises(RuntimeError, match=named):
        with fused_ops.testing.limit(**limits):
            pytest.fail("the block ran")
    for name in LIMITS:
        assert current_limit(name) == 0, name


@pytest.mark.parametrize("routes", [dict(direct="simt"), dict(direct="mma"),
                                    dict(s_stage="simt", contraction="gemm", overlap="off")],
                         ids=str)
def test_routes_leave_the_cpu_results_alone(routes):
    """The routes choose CUDA kernels: on the CPU every result is the same, bit for bit."""
    p = Problem(3, 6, 5, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(padding=1))
    x = make_input(p)
    results = []
    for forced in (False, True):
        torch.manual_seed(1)
        _, fused = make_models(p, algo="direct")
        with torch.no_grad(), fused_ops.testing.route(**(routes if forced else {})):
            results.append([fused.train()(x), fused.batch_norm.running_var.clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_overlapping_launches_off_gives_the_same_bits():
    """route(overlap="off") launches the training chain's kernels one after another (for
    profiling): the same output and running statistics, bit for bit."""
    p = Problem(3, 16, 8, (5, 6, 7), (3, 2, 3))
    x = make_input(p, torch.float32, "cuda", offset=1.0)
    results = []
    for overlap in ("auto", "off"):
        torch.manual_seed(0)  # the same parameters for both
        _, fused = make_models(p, torch.float32, "cuda", algo="cross_spectrum")
        fused.train()
        with torch.no_grad(), fused_ops.testing.route(overlap=overlap):
            out = fused(x)
        results.append([out, fused.batch_norm.running_mean, fused.batch_norm.running_var])
    for a, b in zip(*results):
        assert torch.equal(a, b)
