"""Under torch.autocast the fused module returns what the unfused chain returns: the same dtype,
values within the autocast dtype's rounding, gradients of every parameter likewise, and the
running statistics updated as the chain updates them."""
import copy

import pytest
import torch
from torch import nn

import fused_ops

CASES = [("cpu", torch.bfloat16), ("cpu", torch.float16),
         pytest.param("cuda", torch.float16, marks=pytest.mark.cuda),
         pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda)]
# Relative error of a chain run at the autocast dtype against itself in float32: the conv's
# inputs are rounded to 8 (bfloat16) or 11 (float16) bits.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _chain(device):
    torch.manual_seed(0)
    conv = nn.ConvTranspose3d(4, 6, 3, stride=2, padding=1).to(device)
    bn = nn.BatchNorm3d(6).to(device)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.zero_()  # the output is then the normalized part alone
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    unfused = nn.Sequential(conv, _Scale(2.0), bn, nn.AdaptiveAvgPool3d(1))
    fused = fused_ops.ConvTransposeBNPool3d.from_modules(copy.deepcopy(conv), 2.0, copy.deepcopy(bn))
    return unfused, fused


class _Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def _relerr(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_autocast_matches_the_unfused_chain(device, dtype, training):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    unfused, fused = _chain(device)
    unfused.train(training)
    fused.train(training)
    x = torch.randn(5, 4, 5, 6, 7, device=device, requires_grad=True)
    with torch.autocast(device, dtype=dtype):
        expected = unfused(x)
        out = fused(x)
    assert out.dtype == expected.dtype
    assert _relerr(out, expected) < TOLERANCE[dtype]
    # Gradients of x and of every parameter, through the autocast casts.
    loss_expected = (expected.float() ** 2).sum()
    loss = (out.float() ** 2).sum()
    params = [x, unfused[0].weight, unfused[0].bias, unfused[2].weight]
    fused_params = [x, fused.conv_transpose.weight, fused.conv_transpose.bias, fused.batch_norm.weight]
    grads = torch.autograd.grad(loss, fused_params)
    expected_grads = torch.autograd.grad(loss_expected, params)
    for i, (g, g_expected) in enumerate(zip(grads, expected_grads)):
        if training and i == 2:  # the conv bias under batch statistics: zero in exact arithmetic
            assert (g - g_expected).abs().max() < TOLERANCE[dtype] * expected_grads[1].abs().max()
        else:
            assert _relerr(g, g_expected) < 4 * TOLERANCE[dtype]
    for name in ("running_mean", "running_var"):
        got, want = getattr(fused.batch_norm, name), getattr(unfused[2], name)
        assert got.dtype == want.dtype == torch.float32
        assert _relerr(got, want) < TOLERANCE[dtype]


def test_autocast_leaves_float64_alone():
    unfused, fused = _chain("cpu")
    unfused.double()
    fused.double()
    x = torch.randn(3, 4, 5, 6, 7, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        out, expected = fused(x), unfused(x)
    assert out.dtype == expected.dtype == torch.float64
    assert _relerr(out, expected) < 1e-12
