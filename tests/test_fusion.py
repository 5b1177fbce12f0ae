"""fused_ops.fuse: the pattern in users' models, replaced in place; near-misses left alone."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_ops
from conftest import DEVICES, assert_gradients_match, relerr
from fused_ops.fusion import _FusedChain


def randomized(bn):
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    return bn


class AmongOtherLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(3, 4, 1)
        self.up = nn.ConvTranspose3d(4, 6, 3, stride=2)
        self.norm = randomized(nn.BatchNorm3d(6))
        self.pool = nn.AdaptiveAvgPool3d((1, 1, 1))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        y = self.pool(self.norm(self.up(torch.relu(self.stem(x))) * 2.0))
        return self.head(y.flatten(1))


class TwoOccurrences(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.ConvTranspose3d(3, 5, 2))
        self.a_bn = randomized(nn.BatchNorm3d(5))
        self.b = nn.ConvTranspose3d(3, 4, (1, 2, 3), padding=(0, 1, 1))
        self.b_bn = randomized(nn.BatchNorm3d(4, momentum=None))

    def forward(self, x):
        first = F.adaptive_avg_pool3d(self.a_bn(-0.5 * self.a(x)), 1)
        second = F.adaptive_avg_pool3d(self.b_bn(torch.mul(self.b(x), 3)), (1, 1, 1))
        return torch.cat([first, second], dim=1)


class MethodMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.ct = nn.ConvTranspose3d(3, 4, 2)
        self.bn = randomized(nn.BatchNorm3d(4))
        self.pool = nn.AdaptiveAvgPool3d(1)

    def forward(self, x):
        return self.pool(self.bn(self.ct(x).mul(1.5)))


class IntermediateUsedElsewhere(MethodMul):
    def forward(self, x):
        y = self.ct(x)
        return self.pool(self.bn(y * 2.0)) + y.mean()


class PoolNotGlobal(MethodMul):
    def forward(self, x):
        return F.adaptive_avg_pool3d(self.bn(self.ct(x) * 2.0), 2)


class TensorScale(MethodMul):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.pool(self.bn(self.ct(x) * self.scale))


def fused_chains(gm):
    return [m for m in gm.modules() if isinstance(m, _FusedChain)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_cls, chains", [(AmongOtherLayers, 1), (TwoOccurrences, 2),
                                                (MethodMul, 1)])
def test_fused_model_matches_the_original(model_cls, chains, device):
    torch.manual_seed(0)
    model = model_cls().double().to(device)
    reference = copy.deepcopy(model)
    fused = fused_ops.fuse(model)
    assert len(fused_chains(fused)) == chains
    assert fused.state_dict().keys() == model.state_dict().keys()
    assert {id(p) for p in fused.parameters()} == {id(p) for p in model.parameters()}
    for mode in ("train", "eval", "train"):
        fused.train(mode == "train")
        reference.train(mode == "train")
        x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64, device=device)
        with torch.no_grad():
            assert relerr(fused(x), reference(x)) <= 1e-10, mode
    for key, value in reference.state_dict().items():
        got = fused.state_dict()[key]
        assert (relerr(got, value) <= 1e-10 if value.is_floating_point()
                else torch.equal(got, value)), key


@pytest.mark.parametrize("model_cls", [IntermediateUsedElsewhere, PoolNotGlobal, TensorScale])
def test_near_misses_are_left_alone(model_cls):
    model = model_cls().double()
    fused = fused_ops.fuse(model)
    assert fused_chains(fused) == []
    x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64)
    model.eval()
    fused.eval()
    with torch.no_grad():
        assert torch.equal(fused(x), model(x))


def test_fused_chain_starts_in_the_models_mode():
    """A model fused in eval mode normalizes with its running statistics from the first call."""
    model = AmongOtherLayers().double().eval()
    unfused = copy.deepcopy(model)
    fused = fused_ops.fuse(model)
    x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64)
    with torch.no_grad():
        assert relerr(fused(x), unfused(x)) <= 1e-10
    assert torch.equal(model.norm.running_mean, unfused.norm.running_mean)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fused_model_trains_like_the_unfused_one(training):
    """Gradients flow through the fused op to every parameter, as through the pattern."""
    model = AmongOtherLayers().double().train(training)
    unfused = copy.deepcopy(model)
    fused = fused_ops.fuse(model)
    x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64)
    fused(x).sum().backward()
    unfused(x).sum().backward()
    assert_gradients_match({n: p.grad for n, p in model.named_parameters()},
                           {n: p.grad for n, p in unfused.named_parameters()}, 1e-10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.up.weight.clone()
    optimizer.step()
    assert not torch.equal(model.up.weight, before)
    assert fused.head.weight is model.head.weight
