"""ConvTransposeBNPool3d as a drop-in replacement for the unfused pattern: state_dict both
ways, shared modules, its modes, its options reaching the op, the running statistics written
in place. (Its calls of the op under opcheck: tests/test_opcheck.py.)"""
import pytest
import torch
from torch import nn

import fused_ops
from conftest import (DEVICES, TOL, Problem, Reference, make_input, make_models, randomize,
                      relerr)

P = Problem(3, 4, 6, (3, 4, 5), (2, 3, 2))


def test_state_dict_loads_both_ways():
    ref = randomize(Reference(4, 6, 3, 2.0), beta="random")
    fused = fused_ops.ConvTransposeBNPool3d(4, 6, 3, 2.0)
    fused.load_state_dict(ref.state_dict())
    back = Reference(4, 6, 3, 2.0)
    back.load_state_dict(fused.state_dict())
    for key, value in ref.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert set(fused.state_dict()) == set(ref.state_dict())


def test_from_modules_shares_parameters_and_buffers():
    conv, bn = nn.ConvTranspose3d(4, 6, 3), nn.BatchNorm3d(6)
    fused = fused_ops.ConvTransposeBNPool3d.from_modules(conv, 2.0, bn)
    assert fused.conv_transpose is conv and fused.batch_norm is bn
    fused.train()
    fused(torch.randn(2, 4, 3, 3, 3))
    assert int(bn.num_batches_tracked) == 1
    assert not torch.equal(bn.running_mean, torch.zeros(6))
    with torch.no_grad():
        conv.weight.mul_(2)  # an in-place change is seen by the fused module
    assert fused.conv_transpose.weight.data_ptr() == conv.weight.data_ptr()


def test_from_modules_rejects_mismatched_modules():
    with pytest.raises(ValueError, match="features"):
        fused_ops.ConvTransposeBNPool3d.from_modules(nn.ConvTranspose3d(4, 6, 3), 2.0,
                                                     nn.BatchNorm3d(5))
    with pytest.raises(TypeError, match="ConvTranspose3d"):
        fused_ops.ConvTransposeBNPool3d.from_modules(nn.Conv3d(4, 6, 3), 2.0, nn.BatchNorm3d(6))
    with pytest.raises(TypeError, match="scale_factor"):
        fused_ops.ConvTransposeBNPool3d.from_modules(nn.ConvTranspose3d(4, 6, 3),
                                                     torch.tensor(2.0), nn.BatchNorm3d(6))


@pytest.mark.parametrize("device", DEVICES)
def test_train_eval_switching_follows_reference(device):
    ref, fused = make_models(P, torch.float64, device, beta="random")
    for mode in ["train", "eval", "train", "train", "eval"]:
        ref.train(mode == "train")
        fused.train(mode == "train")
        x = make_input(P, torch.float64, device)
        with torch.no_grad():
            assert relerr(fused(x), ref(x.cpu())) <= TOL[torch.float64], mode
    assert int(fused.batch_norm.num_batches_tracked) == 3
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= TOL[torch.float64]


@pytest.mark.parametrize("module_training, bn_training", [(True, False), (False, True)],
                         ids=["frozen-bn", "bn-training-in-eval-module"])
def test_the_batch_norms_own_mode_decides(module_training, bn_training):
    """As in the unfused pattern, where BatchNorm3d's forward reads its own `training`: the
    usual way to freeze batch norms (bn.eval() on each, the model in training) must work."""
    ref, fused = make_models(P, torch.float64, beta="random")
    for model in (ref, fused):
        model.train(module_training)
        model.batch_norm.train(bn_training)
    x = make_input(P, torch.float64)
    with torch.no_grad():
        assert relerr(fused(x), ref(x)) <= TOL[torch.float64]
    assert int(fused.batch_norm.num_batches_tracked) == int(ref.batch_norm.num_batches_tracked)


def test_running_stats_are_updated_in_place():
    _, fused = make_models(P, torch.float32)
    mean, var = fused.batch_norm.running_mean, fused.batch_norm.running_var
    before = mean.clone(), var.clone()
    fused.train()
    fused(make_input(P))
    assert fused.batch_norm.running_mean is mean and fused.batch_norm.running_var is var
    assert not torch.equal(mean, before[0]) and not torch.equal(var, before[1])


@pytest.mark.parametrize("device", DEVICES)
def test_strided_running_stats_are_updated_in_place(device):
    """Running stats that are views with a stride are written through, not replaced."""
    ref, fused = make_models(P, torch.float64, device)
    big = torch.zeros(2 * P.out_channels, 2, dtype=torch.float64, device=device)
    mean, var = big[:P.out_channels, 0], big[P.out_channels:, 1]
    mean.copy_(fused.batch_norm.running_mean)
    var.copy_(fused.batch_norm.running_var)
    assert not mean.is_contiguous()
    x = make_input(P, torch.float64, device)
    out = fused_ops.ct_bn_pool(
        x, fused.conv_transpose.weight.detach(), fused.conv_transpose.bias.detach(), P.scale,
        fused.batch_norm.weight.detach(), fused.batch_norm.bias.detach(), mean, var, True)
    ref.train()
    with torch.no_grad():
        assert relerr(out, ref(x.cpu())) <= TOL[torch.float64]
    assert relerr(big[:P.out_channels, 0], ref.batch_norm.running_mean) <= TOL[torch.float64]
    assert relerr(big[P.out_channels:, 1], ref.batch_norm.running_var) <= TOL[torch.float64]


def test_eval_leaves_running_stats_alone():
    _, fused = make_models(P, torch.float32)
    fused.eval()
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    fused(make_input(P))
    for key, value in fused.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_output_follows_in_place_weight_changes(training, device):
    """Nothing derived from the weight is cached between calls."""
    ref, fused = make_models(P, torch.float64, device, beta="random")
    ref.train(training)
    fused.train(training)
    for _ in range(2):
        with torch.no_grad():
            fused.conv_transpose.weight.mul_(-1.5).add_(0.02)
            ref.conv_transpose.weight.copy_(fused.conv_transpose.weight)
            x = make_input(P, torch.float64, device)
            assert relerr(fused(x), ref(x.cpu())) <= TOL[torch.float64]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_module_options_reach_the_op(training):
    """Every constructor option against the unfused modules built with the same options."""
    kwargs = dict(eps=1e-3, momentum=0.2)
    conv_kwargs = dict(stride=(2, 1, 2), padding=(1, 0, 1), output_padding=(1, 0, 0), groups=2,
                       bias=False, dilation=(1, 2, 1))
    fused = fused_ops.ConvTransposeBNPool3d(4, 6, (3, 2, 3), -0.5, **kwargs, **conv_kwargs,
                                            affine=False, algo="direct").double()
    ref = randomize(Reference(4, 6, (3, 2, 3), -0.5, conv_kwargs=conv_kwargs,
                              bn_kwargs=dict(affine=False), **kwargs)).double()
    fused.load_state_dict(ref.state_dict())
    assert fused.conv_transpose.stride == (2, 1, 2) and fused.conv_transpose.bias is None
    assert fused.batch_norm.weight is None and fused.batch_norm.eps == 1e-3
    assert "algo='direct'" in repr(fused) and "scale_factor=-0.5" in repr(fused)
    for model in (fused, ref):
        model.train(training)
    for _ in range(2):
        x = torch.randn(2, 4, 3, 3, 3, dtype=torch.float64)
        with torch.no_grad():
            assert relerr(fused(x), ref(x)) <= TOL[torch.float64]
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= TOL[torch.float64]
