"""Edge cases where the op must do what the unfused PyTorch modules do: an empty batch, eps = 0,
non-finite inputs and scales."""
import copy
import math

import pytest
import torch
from torch import nn

import fused_ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class _Chain(nn.Module):
    def __init__(self, scale=2.0, eps=1e-5):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(3, 4, 3, stride=2, padding=1)
        self.scale = scale
        self.batch_norm = nn.BatchNorm3d(4, eps=eps)
        self.pool = nn.AdaptiveAvgPool3d(1)

    def forward(self, x):
        return self.pool(self.batch_norm(self.conv_transpose(x) * self.scale))


def _pair(device, **kwargs):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    chain = _Chain(**kwargs).double().to(device)
    with torch.no_grad():
        chain.batch_norm.running_mean.uniform_(-1, 1)
        chain.batch_norm.running_var.uniform_(0.5, 2)
    fused = fused_ops.ConvTransposeBNPool3d.from_modules(
        copy.deepcopy(chain.conv_transpose), chain.scale, copy.deepcopy(chain.batch_norm))
    return chain, fused


def _buffers(m):
    bn = m.batch_norm
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_empty_batch(device, training):
    chain, fused = _pair(device)
    chain.train(training)
    fused.train(training)
    x = torch.randn(0, 3, 4, 5, 6, dtype=torch.float64, device=device)
    expected, out = chain(x), fused(x)
    assert out.shape == expected.shape == (0, 4, 1, 1, 1)
    for got, want in zip(_buffers(fused), _buffers(chain)):
        assert torch.equal(got, want)  # unchanged statistics, the same count


@pytest.mark.parametrize("device", DEVICES)
def test_eps_zero(device):
    chain, fused = _pair(device, eps=0.0)
    chain.eval()
    fused.eval()
    x = torch.randn(2, 3, 4, 5, 6, dtype=torch.float64, device=device)
    try:
        expected = chain(x)
    except ValueError:  # some torch versions (2.11) refuse eps = 0 in eval too: so does the module
        with pytest.raises(ValueError, match="eps"):
            fused(x)
    else:
        torch.testing.assert_close(fused(x), expected, rtol=1e-12, atol=1e-12)
    chain.train()
    fused.train()
    with pytest.raises(ValueError, match="eps"):
        fused(x)
    with pytest.raises((ValueError, RuntimeError), match="eps"):
        chain(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_infinite_input_gives_nan_as_pytorch(device, training):
    chain, fused = _pair(device)
    chain.train(training)
    fused.train(training)
    x = torch.randn(2, 3, 4, 5, 6, dtype=torch.float64, device=device)
    x[0, 1, 2, 2, 2] = math.inf
    expected, out = chain(x), fused(x)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.isnan(expected).any()
    for got, want in zip(_buffers(fused), _buffers(chain)):
        assert torch.equal(torch.isnan(got), torch.isnan(want))


@pytest.mark.parametrize("device", DEVICES)
def test_infinite_scale_gives_nan_statistics_as_pytorch(device):
    chain, fused = _pair(device, scale=math.inf)
    x = torch.randn(2, 3, 4, 5, 6, dtype=torch.float64, device=device)
    expected, out = chain(x), fused(x)
    assert torch.isnan(expected).all() and torch.isnan(out).all()
    for got, want in zip(_buffers(fused)[:2], _buffers(chain)[:2]):
        assert torch.isnan(want).all() and torch.isnan(got).all()


def test_eps_zero_in_eval_follows_this_torch(monkeypatch):
    """Where the installed F.batch_norm refuses eps = 0 in eval (torch 2.11), the module and the
    functional refuse it with PyTorch's message, before anything runs; where it accepts it,
    they compute (test_eps_zero)."""
    import fused_ops.functional

    monkeypatch.setattr(fused_ops.functional, "_EVAL_ACCEPTS_ZERO_EPS", False)
    _, fused = _pair("cpu", eps=0.0)
    fused.eval()
    with pytest.raises(ValueError, match="batch_norm eps must be positive, but got 0.0"):
        fused(torch.randn(2, 3, 4, 5, 6, dtype=torch.float64))
