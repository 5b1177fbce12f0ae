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
        return self.pool(self.bn(self.ct(x).mul(-1.5)))


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


class ZeroMomentum(nn.Module):
    """momentum=0.0, a module's and a functional batch norm's: the running statistics stay."""

    def __init__(self):
        super().__init__()
        self.a = nn.ConvTranspose3d(3, 4, 2)
        self.a_bn = randomized(nn.BatchNorm3d(4, momentum=0.0))
        self.b = nn.ConvTranspose3d(3, 2, (2, 1, 2), stride=2)
        self.b_bn = BatchNormState(2)

    def forward(self, x):
        first = F.adaptive_avg_pool3d(self.a_bn(self.a(x) * -0.75), 1)
        bn = self.b_bn
        second = F.adaptive_avg_pool3d(F.batch_norm(
            self.b(x) * 1.25, bn.running_mean, bn.running_var, bn.weight, bn.bias, self.training,
            0.0, 1e-5), 1)
        return torch.cat([first, second], dim=1)


class Divides(MethodMul):
    """Division by a number is a scale by its reciprocal."""

    def forward(self, x):
        return self.pool(self.bn(self.ct(x) / 4.0))


class DividesByFunction(MethodMul):
    def forward(self, x):
        return self.pool(self.bn(torch.div(self.ct(x), -2.0)))


class Negates(MethodMul):
    def forward(self, x):
        return self.pool(self.bn(-self.ct(x)))


class DividesWithRounding(MethodMul):
    def forward(self, x):
        return self.pool(self.bn(torch.div(self.ct(x), 2.0, rounding_mode="floor")))


class DividesANumber(MethodMul):
    def forward(self, x):
        return self.pool(self.bn(2.0 / self.ct(x)))


class Adds(MethodMul):
    def forward(self, x):
        return self.pool(self.bn(self.ct(x) + 2.0))


class Subtracts(MethodMul):
    def forward(self, x):
        return self.pool(self.bn(self.ct(x) - 2.0))


class SubtractsFromANumber(MethodMul):
    def forward(self, x):
        return self.pool(self.bn(2.0 - self.ct(x)))


class Powers(MethodMul):
    def forward(self, x):
        return self.pool(self.bn(self.ct(x) ** 2.0))


class BatchNormState(nn.Module):
    """A batch norm's tensors as attributes, for models that call F.batch_norm."""

    def __init__(self, channels):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels).uniform_(0.5, 1.5))
        self.bias = nn.Parameter(torch.randn(channels))
        self.register_buffer("running_mean", torch.randn(channels))
        self.register_buffer("running_var", torch.empty(channels).uniform_(0.5, 2.0))


class ConvTransposeState(nn.Module):
    """A ConvTranspose3d's weight and bias as attributes, for F.conv_transpose3d."""

    def __init__(self, in_channels, out_channels, kernel, groups=1):
        super().__init__()
        conv = nn.ConvTranspose3d(in_channels, out_channels, kernel, groups=groups)
        self.weight, self.bias = conv.weight, conv.bias


class FunctionalConv(nn.Module):
    """F.conv_transpose3d with keyword options, scale on the left, modules after."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(3, 4, 1)
        self.up = ConvTransposeState(4, 6, (2, 3, 2), groups=2)
        self.norm = randomized(nn.BatchNorm3d(6, momentum=None))
        self.pool = nn.AdaptiveAvgPool3d((1, 1, 1))

    def forward(self, x):
        y = F.conv_transpose3d(torch.relu(self.stem(x)), self.up.weight, bias=self.up.bias,
                               stride=(2, 1, 2), padding=1, output_padding=(1, 0, 0),
                               groups=2, dilation=[1, 2, 1])
        return self.pool(self.norm(-1.5 * y)).flatten(1)


class FunctionalBatchNorm(nn.Module):
    """A module conv, F.batch_norm with positional arguments and self.training."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose3d(3, 5, 2, bias=False)
        self.bn = BatchNormState(5)

    def forward(self, x):
        z = F.batch_norm(torch.mul(self.up(x), -0.5), self.bn.running_mean,
                         self.bn.running_var, self.bn.weight, self.bn.bias, self.training,
                         0.3, 1e-3)
        return F.adaptive_avg_pool3d(z, (1, 1, 1))


class FullyFunctional(nn.Module):
    """Every step functional, keyword arguments; weights held by the model itself."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4, 2, 2, 3) * 0.3)
        self.bias = nn.Parameter(torch.randn(4))
        self.bn_weight = nn.Parameter(torch.empty(4).uniform_(0.5, 1.5))
        self.bn_bias = nn.Parameter(torch.randn(4))
        self.register_buffer("running_mean", torch.randn(4))
        self.register_buffer("running_var", torch.empty(4).uniform_(0.5, 2.0))

    def forward(self, x):
        y = F.conv_transpose3d(x, self.weight, self.bias, 1, (0, 1, 0)) * -2.0
        z = F.batch_norm(y, self.running_mean, self.running_var, weight=self.bn_weight,
                         bias=self.bn_bias, training=self.training, momentum=0.05, eps=1e-4)
        return F.adaptive_avg_pool3d(z, output_size=1)


class MixedTwice(nn.Module):
    """Functional conv + module batch norm, and module conv + torch.batch_norm."""

    def __init__(self):
        super().__init__()
        self.a = ConvTransposeState(3, 4, 2)
        self.a_bn = randomized(nn.BatchNorm3d(4))
        self.b = nn.ConvTranspose3d(3, 5, (1, 2, 3), padding=(0, 1, 1))
        self.b_bn = BatchNormState(5)

    def forward(self, x):
        first = self.a_bn(F.conv_transpose3d(x, self.a.weight, self.a.bias).mul(-3))
        second = torch.batch_norm(self.b(x) * 0.7, self.b_bn.weight, self.b_bn.bias,
                                  self.b_bn.running_mean, self.b_bn.running_var,
                                  self.training, 0.1, 1e-5, False)
        return torch.cat([F.adaptive_avg_pool3d(first, 1),
                          nn.functional.adaptive_avg_pool3d(second, 1)], dim=1)


class Block(nn.Module):
    """A submodule whose forward calls F.batch_norm with its own self.training."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.ConvTranspose3d(in_channels, out_channels, 2)
        self.bn = BatchNormState(out_channels)

    def forward(self, x):
        bn = self.bn
        z = F.batch_norm(self.conv(x) * 2.0, bn.running_mean, bn.running_var, bn.weight,
                         bn.bias, self.training)
        return F.adaptive_avg_pool3d(z, 1)


class ConstantFlags(nn.Module):
    """Batch norms whose flag is a constant: always batch statistics without running
    ones (no affine), and always the running statistics."""

    def __init__(self):
        super().__init__()
        self.a = nn.ConvTranspose3d(3, 4, 2)
        self.b = nn.ConvTranspose3d(3, 4, 1)
        self.b_bn = BatchNormState(4)
        self.blocks = nn.ModuleList([Block(3, 2), Block(3, 3)])

    def forward(self, x):
        first = F.adaptive_avg_pool3d(F.batch_norm(-2.0 * self.a(x), None, None, training=True), 1)
        bn = self.b_bn
        second = F.adaptive_avg_pool3d(F.batch_norm(
            self.b(x) * 3.0, bn.running_mean, bn.running_var, bn.weight, bn.bias, False), 1)
        return torch.cat([first, second] + [block(x) for block in self.blocks], dim=1)


class FunctionalIntermediateUsedElsewhere(FullyFunctional):
    def forward(self, x):
        y = F.conv_transpose3d(x, self.weight, self.bias) * 2.0
        z = F.batch_norm(y, self.running_mean, self.running_var, self.bn_weight, self.bn_bias,
                         self.training)
        return F.adaptive_avg_pool3d(z, 1) + z.amax()


class FunctionalPoolNotGlobal(FullyFunctional):
    def forward(self, x):
        y = F.conv_transpose3d(x, self.weight, self.bias) * 2.0
        z = F.batch_norm(y, self.running_mean, self.running_var, self.bn_weight, self.bn_bias,
                         self.training)
        return F.adaptive_avg_pool3d(z, (1, 2, 1))


class FunctionalTensorScale(FullyFunctional):
    def forward(self, x):
        y = F.conv_transpose3d(x, self.weight, self.bias) * self.bn_weight[:1]
        z = F.batch_norm(y, self.running_mean, self.running_var, self.bn_weight, self.bn_bias,
                         self.training)
        return F.adaptive_avg_pool3d(z, 1)


class ComputedWeight(FullyFunctional):
    def forward(self, x):
        y = F.conv_transpose3d(x, self.weight * 1.0, self.bias) * 2.0
        z = F.batch_norm(y, self.running_mean, self.running_var, self.bn_weight, self.bn_bias,
                         self.training)
        return F.adaptive_avg_pool3d(z, 1)


class InvertedFlag(FullyFunctional):
    def forward(self, x):
        y = F.conv_transpose3d(x, self.weight, self.bias) * 2.0
        z = F.batch_norm(y, self.running_mean, self.running_var, self.bn_weight, self.bn_bias,
                         not self.training)
        return F.adaptive_avg_pool3d(z, 1)


class FlagFromModeBranch(FullyFunctional):
    """The forward branches on the mode: the flag cannot be told from a constant."""

    def forward(self, x):
        if self.training:
            x = x + 1.0
        y = F.conv_transpose3d(x, self.weight, self.bias) * 2.0
        z = F.batch_norm(y, self.running_mean, self.running_var, self.bn_weight, self.bn_bias,
                         self.training)
        return F.adaptive_avg_pool3d(z, 1)


class EvalWithoutRunningStats(FullyFunctional):
    def forward(self, x):
        y = F.conv_transpose3d(x, self.weight, self.bias) * 2.0
        return F.adaptive_avg_pool3d(F.batch_norm(y, None, None, training=self.training), 1)


# The Python numbers each model's chains multiply by.
SCALES = {AmongOtherLayers: [2.0], TwoOccurrences: [-0.5, 3.0], MethodMul: [-1.5],
          FunctionalConv: [-1.5], FunctionalBatchNorm: [-0.5], FullyFunctional: [-2.0],
          MixedTwice: [-3.0, 0.7], ConstantFlags: [-2.0, 3.0, 2.0, 2.0], ZeroMomentum: [-0.75, 1.25],
          Divides: [0.25], DividesByFunction: [-0.5], Negates: [-1.0]}


def fused_chains(gm):
    return [m for m in gm.modules() if isinstance(m, _FusedChain)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused_in", ["train", "eval"])
@pytest.mark.parametrize("model_cls, chains", [
    (AmongOtherLayers, 1), (TwoOccurrences, 2), (MethodMul, 1), (FunctionalConv, 1),
    (FunctionalBatchNorm, 1), (FullyFunctional, 1), (MixedTwice, 2), (ConstantFlags, 4),
    (ZeroMomentum, 2), (Divides, 1), (DividesByFunction, 1), (Negates, 1)])
def test_fused_model_matches_the_original(model_cls, chains, fused_in, device):
    torch.manual_seed(0)
    model = model_cls().double().to(device).train(fused_in == "train")
    reference = copy.deepcopy(model)
    fused = fused_ops.fuse(model)
    assert len(fused_chains(fused)) == chains
    # The scale each chain was fused with, sign included, is the one the model multiplies by.
    assert sorted(m.scale for m in fused_chains(fused)) == sorted(SCALES[model_cls])
    assert not [n for n in fused.graph.nodes if n.target in (
        F.batch_norm, torch.batch_norm, torch.conv_transpose3d)]
    assert fused.state_dict().keys() == model.state_dict().keys()
    # The model's own parameters and buffers, not copies.
    assert {id(p) for p in fused.parameters()} == {id(p) for p in model.parameters()}
    assert {id(b) for b in fused.buffers()} == {id(b) for b in model.buffers()}
    for step, mode in enumerate((fused_in, "train", "eval", "train")):
        if step > 0:  # first as fuse left it
            fused.train(mode == "train")
            reference.train(mode == "train")
        x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64, device=device)
        with torch.no_grad():
            assert relerr(fused(x), reference(x)) <= 1e-10, mode
    for key, value in reference.state_dict().items():
        got = fused.state_dict()[key]
        assert got.data_ptr() == model.state_dict()[key].data_ptr(), key
        assert (relerr(got, value) <= 1e-10 if value.is_floating_point()
                else torch.equal(got, value)), key


@pytest.mark.parametrize("model_cls", [
    IntermediateUsedElsewhere, PoolNotGlobal, TensorScale, FunctionalIntermediateUsedElsewhere,
    FunctionalPoolNotGlobal, FunctionalTensorScale, ComputedWeight, InvertedFlag,
    FlagFromModeBranch, EvalWithoutRunningStats, DividesANumber, DividesWithRounding, Adds,
    Subtracts, SubtractsFromANumber, Powers])
def test_near_misses_are_left_alone(model_cls):
    # Traced in eval mode: what fuse leaves alone keeps fx's trace-time self.training.
    model = model_cls().double().eval()
    fused = fused_ops.fuse(model)
    assert fused_chains(fused) == []
    x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64)
    if model_cls is EvalWithoutRunningStats:  # F.batch_norm's own error, in eval mode
        with pytest.raises(RuntimeError, match="running_mean must be defined"):
            fused(x)
        return
    with torch.no_grad():
        assert torch.equal(fused(x), model(x))
    if isinstance(model, MethodMul):  # a module batch norm: the left-alone graph follows its mode
        model.train()
        with torch.no_grad():
            assert torch.equal(fused(x), model(x))


def test_near_miss_with_an_input_weight_is_left_alone():
    class InputWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = randomized(nn.BatchNorm3d(4))

        def forward(self, x, weight):
            return F.adaptive_avg_pool3d(self.bn(F.conv_transpose3d(x, weight) * 2.0), 1)

    assert fused_chains(fused_ops.fuse(InputWeight())) == []


@pytest.mark.parametrize("model_cls, frozen", [(ConstantFlags, "blocks.1"), (MixedTwice, "a_bn")])
def test_mode_of_each_module_is_kept(model_cls, frozen):
    """One submodule in eval mode in a model in train mode (a frozen batch norm; a block
    calling F.batch_norm(self.training)): its chain runs in eval mode as the model's would,
    and fuse leaves every module's mode as it was."""
    torch.manual_seed(0)
    model = model_cls().double()
    model.get_submodule(frozen).eval()
    modes = [m.training for m in model.modules()]
    reference = copy.deepcopy(model)
    fused = fused_ops.fuse(model)
    assert [m.training for m in model.modules()] == modes
    x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64)
    with torch.no_grad():
        assert relerr(fused(x), reference(x)) <= 1e-10
    for key, value in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[key], value, rtol=1e-10, atol=0), key


def test_fuse_adds_no_attributes_to_the_model():
    """Tracing again in each mode leaves no tensor constants behind (fx's own trace adds
    one per tensor the forward makes, as fx.symbolic_trace does)."""
    class MakesATensor(FullyFunctional):
        def forward(self, x):
            return super().forward(x) + torch.tensor(1.0)

    model = MakesATensor()
    attributes = set(vars(model))
    fused = fused_ops.fuse(model)
    assert len(fused_chains(fused)) == 1
    assert set(vars(model)) - attributes == {"_tensor_constant0"}


def test_fused_model_reads_the_tensors_at_each_call():
    """`.to()` after fuse replaces the buffers: the fused op uses the new ones."""
    torch.manual_seed(0)
    model = FullyFunctional()
    reference = copy.deepcopy(model).double()
    fused = fused_ops.fuse(model).double()
    x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64)
    for mode in (True, False):
        with torch.no_grad():
            assert relerr(fused.train(mode)(x), reference.train(mode)(x)) <= 1e-10
    assert relerr(fused.running_var, reference.running_var) <= 1e-10


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
