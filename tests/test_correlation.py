"""algo='correlation' (docs/math.md §3.4): x's channel cross-correlation at the few lags a
strided kernel's phases span, by GEMMs in float64, on any device and dtype. Forced on every
padding-0 configuration (strides, dilation, output padding, groups, kernels smaller than the
stride) against PyTorch's modules in float64, output and statistics over three steps;
refused with a clear error, and nothing changed, where padding > 0."""
import pytest
import torch

from conftest import (CORRELATION_PROBLEMS, DEVICES, Problem, assert_no_host_sync,
                      assert_refused_unchanged, check_training, make_input, make_models,
                      problem_params)

ALGO = "correlation"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem", problem_params(CORRELATION_PROBLEMS))
def test_matches_reference_over_steps(problem, device, dtype):
    if problem.values_per_channel() == 1:
        pytest.skip("one value per channel: training is refused (tests/test_errors.py)")
    check_training(problem, dtype, device, ALGO)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv_kwargs", [dict(padding=1), dict(stride=2, padding=(0, 1, 0))],
                         ids=str)
def test_refuses_padding(device, conv_kwargs):
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=conv_kwargs)
    assert_refused_unchanged(p, device, ALGO, f"algo='{ALGO}' needs padding 0")


@pytest.mark.cuda
def test_no_host_sync_on_cuda():
    """The lags' tables are built on the device: nothing waits."""
    p = Problem(3, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=(2, 1, 3)))
    _, fused = make_models(p, torch.float32, "cuda", algo=ALGO)
    assert_no_host_sync(fused, make_input(p, torch.float32, "cuda"))
