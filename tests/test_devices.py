"""Streams and devices: the op runs on the current stream of its tensors' device, whatever
the current device is, and leaves the current device and streams as it found them.

How the stream tests can fail: the input is written on the stream under test *after* a
long ``torch.cuda._sleep`` there, and the op is called right after, on the host. A kernel
launched on that stream waits for the sleep and the write, and sees the new input. A kernel
launched anywhere else (the default stream, the legacy NULL stream, another device's
stream) runs at once and reads the old input: its output and running statistics then match
the reference of the old input, not of the new one, and the test fails. Each test checks
that the sleep was still running when the call returned (``stream.query()`` is False), so
that the race it relies on was real; a call that synchronized the host would fail that check
too, and would also break CUDA graph capture.

The device tests compare with the same call on cuda:0 and with PyTorch's modules in float64.
A call on cuda:1 whose kernels were launched on the current device (cuda:0) instead fails
with an illegal memory access or, with peer access enabled, reads the old input as above.
"""
import contextlib

import pytest
import torch

import fused_ops
from conftest import Problem, assert_gradients_match, make_input, make_models, relerr, two_gpus

pytestmark = pytest.mark.cuda

SLEEP_MS = 200  # much longer than the host time of one call after a warm-up

# The auto algorithm is "fft" on P (stride 1, no padding, float32), "sliced_conv" on
# P_OPTIONS (stride, padding...), which also takes the padded (box-sum) sample sums.
P = Problem(3, 8, 19, (5, 6, 7), (3, 2, 3))
P_OPTIONS = Problem(3, 6, 10, (4, 5, 6), (3, 2, 3), conv_kwargs=dict(
    stride=(2, 1, 2), padding=(1, 0, 1), output_padding=(1, 0, 0), dilation=(1, 2, 1), groups=2))
MODES = [  # (training, algo); eval ignores algo
    (False, "auto"), (True, "auto"), (True, "fft"), (True, "direct"), (True, "sliced_conv")]
CASES = [(P, *m) for m in MODES] + [(P_OPTIONS, *m) for m in MODES if m[1] != "fft"]


def case_id(case):
    problem, training, algo = case
    return f"{'options' if problem is P_OPTIONS else 'plain'}-{'train' if training else 'eval'}-{algo}"


_cycles_per_ms = {}


def sleep_cycles(ms, device):
    """torch.cuda._sleep's argument for about `ms` milliseconds on `device` (calibrated)."""
    device = torch.device(device)
    if device not in _cycles_per_ms:
        with torch.cuda.device(device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # warm-up
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
            end.synchronize()
            _cycles_per_ms[device] = 20_000_000 / max(start.elapsed_time(end), 1e-3)
    return int(_cycles_per_ms[device] * ms)


@contextlib.contextmanager
def current_stream_of_another_device(stream):
    """Makes `stream` the current stream of its device while the current device stays
    what it was (torch.cuda.set_stream also switches the device, so switch it back)."""
    device = torch.cuda.current_device()
    previous = torch.cuda.current_stream(stream.device)
    torch.cuda.set_stream(stream)
    torch.cuda.set_device(device)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)
        torch.cuda.set_device(device)


def check_against_reference(ref, fused, x, out, training):
    """out == ref(x) in float64, and the running statistics (updated once by this call)."""
    with torch.no_grad():
        expected = ref.train(training)(x.double().cpu())
    assert out.device == x.device
    assert relerr(out, expected) <= 1e-6
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= 1e-6, name
    assert int(fused.batch_norm.num_batches_tracked) == int(ref.batch_norm.num_batches_tracked)


def late_input_call(fused, problem, stream, call=None):
    """Writes a fresh input on `stream` after a long sleep there, then calls `call(fused, x)`
    (default: under torch.cuda.stream(stream)) at once on the host, and returns (input,
    output) once `stream` is done. Checks that the sleep outlasted the call."""
    device = stream.device
    call = call or (lambda module, x: _call_under_stream(module, x, stream))
    old = make_input(problem, torch.float32, device)  # what a kernel on another stream reads
    new = make_input(problem, torch.float32, device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the module and inputs are ready
    cycles = sleep_cycles(SLEEP_MS, device)
    with torch.no_grad():
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
            old.copy_(new)  # lands after the sleep, on `stream` only
        out = call(fused, old)
        still_sleeping = not stream.query()
    stream.synchronize()
    assert still_sleeping, ("the sleep on the stream under test ended before the call "
                            "returned: the call synchronized the host (or the sleep is too "
                            "short), so this test could not tell streams apart")
    return new, out


def _call_under_stream(module, x, stream):
    with torch.cuda.stream(stream):
        return module(x)


def warm_up(fused, problem, device):
    """One call of the same shapes first (kernel loading, cuFFT plans, cuDNN heuristics),
    on a clone of the state so that the reference's running statistics still match."""
    state = {k: v.clone() for k, v in fused.state_dict().items()}
    with torch.no_grad():
        fused(make_input(problem, torch.float32, device))
    fused.load_state_dict(state)
    torch.cuda.synchronize(device)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_side_stream_on_cuda0(case):
    problem, training, algo = case
    ref, fused = make_models(problem, torch.float32, "cuda:0", algo=algo)
    fused.train(training)
    warm_up(fused, problem, "cuda:0")
    side = torch.cuda.Stream(device="cuda:0")
    default = torch.cuda.current_stream("cuda:0")
    x, out = late_input_call(fused, problem, side)
    assert torch.cuda.current_stream("cuda:0") == default
    check_against_reference(ref, fused, x, out, training)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_side_stream_functional_with_optional_arguments_none(training):
    """bias, bn_weight/bn_bias None; training without running statistics (batch
    statistics only) or eval with them."""
    problem = Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(bias=False),
                      bn_kwargs=dict(affine=False, track_running_stats=not training))
    ref, fused = make_models(problem, torch.float32, "cuda:0")
    ref.train(training)
    fused.train(training)
    side = torch.cuda.Stream(device="cuda:0")
    weight = fused.conv_transpose.weight.detach()
    bn = fused.batch_norm

    class Functional(torch.nn.Module):
        def forward(self, x):
            return fused_ops.ct_bn_pool(x, weight, None, problem.scale, None, None,
                                        bn.running_mean, bn.running_var, training)

    warm_up(Functional(), problem, "cuda:0")
    x, out = late_input_call(Functional(), problem, side)
    with torch.no_grad():
        assert relerr(out, ref(x.double().cpu())) <= 1e-6


@two_gpus
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda1_tensors_while_cuda0_is_current_run_on_cuda1s_current_stream(case):
    """The device guard and the stream together: tensors on cuda:1, current device cuda:0,
    cuda:1's current stream a side stream. The kernels must switch to cuda:1 and launch on
    that stream, and leave the current device and both devices' streams as they were."""
    problem, training, algo = case
    torch.cuda.set_device(0)
    ref, fused = make_models(problem, torch.float32, "cuda:1", algo=algo)
    fused.train(training)
    warm_up(fused, problem, "cuda:1")
    side = torch.cuda.Stream(device="cuda:1")
    default0 = torch.cuda.current_stream(0)

    def call(module, x):
        with current_stream_of_another_device(side):
            assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(1) == side
            out = module(x)
            assert torch.cuda.current_device() == 0, "the call changed the current device"
            assert torch.cuda.current_stream(1) == side, "the call changed cuda:1's stream"
            assert torch.cuda.current_stream(0) == default0, "the call changed cuda:0's stream"
        return out

    x, out = late_input_call(fused, problem, side, call)
    assert torch.cuda.current_device() == 0
    check_against_reference(ref, fused, x, out, training)


def run_on(device, module, x, grad_out, training):
    """(output, running stats, gradients) of one call with backward on `device`."""
    module = module.to(device).train(training)
    x = x.to(device).requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad_out.to(device))
    grads = {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    for name, grad in grads.items():
        assert grad.device == torch.device(device), name
    stats = {n: getattr(module.batch_norm, n) for n in ("running_mean", "running_var")}
    return out.detach(), stats, grads


@two_gpus
@pytest.mark.parametrize("current", [0, 1], ids=["current_cuda0", "current_cuda1"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("problem", [P, P_OPTIONS], ids=["plain", "options"])
def test_other_device_matches_current_device_with_gradients(problem, training, current):
    """Forward, running statistics and backward on the device that is not current equal the
    same call on the current one and PyTorch's modules (float64)."""
    torch.cuda.set_device(current)
    other = 1 - current
    ref, on_current = make_models(problem, torch.float64, f"cuda:{current}")
    _, on_other = make_models(problem, torch.float64, "cpu")
    on_other.load_state_dict(on_current.state_dict())
    x = make_input(problem, torch.float64)
    grad_out = torch.randn(problem.batch, problem.out_channels, 1, 1, 1, dtype=torch.float64)
    try:
        got = run_on(f"cuda:{other}", on_other, x, grad_out, training)
        assert torch.cuda.current_device() == current, "the call changed the current device"
        same = run_on(f"cuda:{current}", on_current, x, grad_out, training)
        ref.train(training)
        x_ref = x.clone().requires_grad_()
        ref_out = ref(x_ref)
        ref_out.backward(grad_out)
        want_grads = {"x": x_ref.grad, **{n: p.grad for n, p in ref.named_parameters()}}
        for want_out, want_stats, want in [same, (ref_out, {
                n: getattr(ref.batch_norm, n) for n in ("running_mean", "running_var")},
                want_grads)]:
            assert relerr(got[0], want_out) <= 1e-10
            for name, value in want_stats.items():
                assert relerr(got[1][name], value) <= 1e-10, name
            assert_gradients_match(got[2], want, 1e-10)
        assert torch.cuda.current_device() == current
    finally:
        torch.cuda.set_device(0)
