"""The correlation training path (docs/math.md §3.4): x's channel cross-correlation at the
phases' lags against the sub-kernels' tap pairs, in float64 on any device. Forced on the
problems it covers (every padding-0 configuration: strides, dilation, output padding,
groups, kernels smaller than the stride) against PyTorch's modules in float64, over
several steps; refused with a clear error, and nothing changed, where padding > 0."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import DEVICES, Problem, make_input, make_models, random_problems, relerr
from test_fft_energy import FFT_PROBLEMS, STRIDED_FFT_PROBLEMS

# The FFT path's problems (every padding-0 family, two passes of its tiles, the seed
# problem's channels) and a few where the correlation's lags are few: kernel = stride.
PROBLEMS = FFT_PROBLEMS + STRIDED_FFT_PROBLEMS + [
    Problem(3, 5, 7, (4, 5, 3), (2, 2, 2), conv_kwargs=dict(stride=2)),  # one lag
    Problem(2, 6, 8, (3, 4, 5), (4, 2, 3), conv_kwargs=dict(stride=(2, 2, 3), groups=2)),
    Problem(1, 3, 4, (1, 1, 1), (3, 3, 3), conv_kwargs=dict(stride=2)),  # one input position
] + random_problems(6, seed=11, conv_kwargs=dict(stride=(1, 2, 2), dilation=(2, 1, 1)))
TOL = {torch.float32: 1e-6, torch.float64: 1e-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_correlation_matches_reference_over_steps(problem, device, dtype):
    ref, fused = make_models(problem, dtype, device, algo="correlation")
    with torch.no_grad():
        out = ref.conv_transpose(make_input(problem, torch.float64))
    if out.shape[0] * out[0, 0].numel() == 1:
        pytest.skip("one value per channel: training is refused (tests/test_errors.py)")
    ref.train()
    fused.train()
    for _ in range(3):
        x = make_input(problem, dtype, device)
        with torch.no_grad():
            out = fused(x)
            expected = ref(x.double().cpu())
        assert relerr(out, expected) <= TOL[dtype]
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name),
                      getattr(ref.batch_norm, name)) <= TOL[dtype], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv_kwargs", [dict(), dict(stride=2), dict(stride=2, kernel_size=2),
                                         dict(stride=(2, 1, 3), output_padding=(1, 0, 2))],
                         ids=str)
def test_correlation_survives_a_large_offset(device, conv_kwargs):
    """The mean is subtracted in float64 from a float64 sum of squares (§3.4): an offset 50
    times the spread leaves about 2500 x 1e-16 of it, far below float32's rounding."""
    conv_kwargs = dict(conv_kwargs)
    kernel = conv_kwargs.pop("kernel_size", 3)
    p = Problem(4, 6, 10, (5, 6, 7), (kernel,) * 3, conv_kwargs=conv_kwargs)
    ref, fused = make_models(p, torch.float32, device, algo="correlation")
    x = make_input(p, torch.float32, device) + 50.0
    with torch.no_grad():
        assert relerr(fused(x), ref(x.double().cpu())) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv_kwargs", [dict(padding=1), dict(stride=2, padding=(0, 1, 0))],
                         ids=str)
def test_correlation_refuses_padding(device, conv_kwargs):
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=conv_kwargs)
    _, fused = make_models(p, torch.float32, device, algo="correlation")
    before = fused.batch_norm.running_var.clone()
    with pytest.raises(ValueError, match="algo='correlation' needs padding 0"):
        fused(make_input(p, torch.float32, device))
    assert torch.equal(fused.batch_norm.running_var, before)
    assert int(fused.batch_norm.num_batches_tracked) == 0


@pytest.mark.parametrize("kernel, conv_kwargs, convolution", [
    (2, dict(stride=2), False),        # kernel = stride: one lag, a quarter of the conv's work
    (4, dict(stride=2), False),        # 27 lags, a fifth
    (3, dict(), True),                 # stride 1: 125 lags, three times the conv's work
    (2, dict(stride=2, padding=1), True),  # padding: not covered
], ids=["up2", "st2", "k3", "padding"])
def test_auto_on_cpu_takes_correlation_where_it_is_cheaper(kernel, conv_kwargs, convolution):
    """CPU auto: correlation where its float64 GEMMs have under a third of the
    convolution's multiply-adds (csrc/cpu/ct_bn_pool_cpu.cpp), else ATen's convolution."""
    p = Problem(4, 16, 32, (8, 8, 8), (kernel,) * 3, conv_kwargs=conv_kwargs)
    ref, fused = make_models(p, torch.float32, "cpu")
    ref.train()
    fused.train()
    x = make_input(p, torch.float32, "cpu")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fused(x)
    assert any("convolution" in e.name for e in prof.events()) == convolution
    with torch.no_grad():
        assert relerr(out, ref(x.double())) <= 1e-6
