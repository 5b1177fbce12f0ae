"""Bad input gets a clear error before anything is mutated: shapes, values, dtypes and
devices, through the functional, the autograd kernel and the module."""
import pytest
import torch

import fused_ops
import fused_ops.testing
from conftest import (DEVICES, Problem, make_dtype_models, make_input, make_models,
                      op_conv_options)
from fused_ops import distributed

P = Problem(2, 4, 6, (3, 4, 5), (2, 3, 2))


def arguments(device, problem=P):
    _, fused = make_models(problem, torch.float32, device)
    bn, conv = fused.batch_norm, fused.conv_transpose
    return dict(x=make_input(problem, torch.float32, device), weight=conv.weight.detach(),
                bias=conv.bias.detach(), scale=2.0, bn_weight=bn.weight.detach(),
                bn_bias=bn.bias.detach(), running_mean=bn.running_mean,
                running_var=bn.running_var, training=True, momentum=0.1, eps=1e-5)


def one_value_per_channel(a):
    a["x"] = a["x"][:1, :, :1, :1, :1].contiguous()
    a["weight"] = a["weight"][:, :, :1, :1, :1].contiguous()


CASES = {
    "x_4d": (lambda a: a.update(x=a["x"][0]), RuntimeError, "x must be a 5-D tensor"),
    "x_int": (lambda a: a.update(x=a["x"].to(torch.int32)), RuntimeError,
              "x must be float16, bfloat16, float32 or float64"),
    # A float16 x is accepted, with a weight of its dtype (tests/test_dtypes.py).
    "x_half": (lambda a: a.update(x=a["x"].half()), RuntimeError,
               r"weight must have the same dtype as x \(float16\), got float32"),
    # (an empty batch is a batch, as nn.BatchNorm3d takes it: tests/test_pytorch_parity.py)
    "x_empty_spatial": (lambda a: a.update(x=a["x"][:, :, :0]), RuntimeError, "non-empty"),
    "weight_4d": (lambda a: a.update(weight=a["weight"][0]), RuntimeError, "weight must be a 5-D"),
    "weight_channels": (lambda a: a.update(weight=a["weight"][:3]), RuntimeError,
                        r"weight.size\(0\) must equal x.size\(1\)"),
    "weight_dtype": (lambda a: a.update(weight=a["weight"].double()), RuntimeError,
                     "weight must have the same dtype as x"),
    "bias_shape": (lambda a: a.update(bias=a["bias"][:5]), RuntimeError, r"bias must have shape \[6\]"),
    "bn_weight_shape": (lambda a: a.update(bn_weight=a["bn_weight"][:5]), RuntimeError, "bn_weight"),
    "bn_bias_dtype": (lambda a: a.update(bn_bias=a["bn_bias"].double()), RuntimeError, "bn_bias"),
    "running_mean_shape": (lambda a: a.update(running_mean=torch.zeros(7, device=a["x"].device)),
                           RuntimeError, "running_mean"),
    "running_var_missing": (lambda a: a.update(running_var=None), ValueError, "together"),
    "running_mean_missing": (lambda a: a.update(running_mean=None), ValueError, "together"),
    "negative_eps": (lambda a: a.update(eps=-1e-3), ValueError, "eps must be positive"),
    # (eps = 0 is accepted in eval mode, as F.batch_norm does)
    "zero_eps_in_training": (lambda a: a.update(eps=0.0), ValueError, "eps must be positive"),
    "one_value_per_channel": (one_value_per_channel, ValueError, "more than 1 value per channel"),
    "eval_without_running_stats": (lambda a: a.update(training=False, running_mean=None,
                                                      running_var=None),
                                   ValueError, "running_mean and running_var are required"),
    "groups_not_dividing": (lambda a: a.update(groups=3), ValueError, "divisible by groups"),
    "stride_zero": (lambda a: a.update(stride=0), ValueError, "stride must be >= 1"),
    "stride_length": (lambda a: a.update(stride=(1, 2)), ValueError, "stride must be an int or 3"),
    "negative_padding": (lambda a: a.update(padding=-1), ValueError, "padding must be >= 0"),
    "output_padding_too_large": (lambda a: a.update(output_padding=1), ValueError,
                                 "output_padding must be smaller"),
    "padding_empties_output": (lambda a: a.update(padding=5), RuntimeError, "output would be empty"),
    "unknown_algo": (lambda a: a.update(algo="winograd"), ValueError, "algo must be one of"),
    "tensor_scale": (lambda a: a.update(scale=torch.tensor(2.0)), TypeError, "scale must be"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autograd", [False, True], ids=["no_grad_input", "weight_requires_grad"])
@pytest.mark.parametrize("case", list(CASES))
def test_rejected_call_mutates_nothing(case, autograd, device):
    """Also through the autograd kernel (fused_ops/_autograd.py), which runs when an input
    requires grad: the same error, nothing modified, no version bump."""
    a = arguments(device)
    mutate, error, message = CASES[case]
    mean, var = a["running_mean"].clone(), a["running_var"].clone()
    kept_mean, kept_var = a["running_mean"], a["running_var"]
    versions = kept_mean._version, kept_var._version
    mutate(a)
    if autograd:
        a["weight"] = a["weight"].detach().requires_grad_()
    with pytest.raises(error, match=message):
        fused_ops.ct_bn_pool(**a)
    assert torch.equal(kept_mean, mean) and torch.equal(kept_var, var)
    assert (kept_mean._version, kept_var._version) == versions


# One tap per output position: the conv-free routes' forward, the op's statistics and then
# ct_bn_pool_apply (fused_ops/_kept_output.py), each with its own checks.
ONE_TAP = Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(stride=2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["bias_shape", "bn_weight_shape", "bn_bias_dtype",
                                  "running_mean_shape", "running_var_missing",
                                  "running_mean_missing", "negative_eps",
                                  "zero_eps_in_training", "one_value_per_channel"])
def test_rejected_call_mutates_nothing_on_a_conv_free_route(case, device):
    """A forward that keeps the statistics for a conv-free backward ("gram", forced) refuses
    as the op does: its message, nothing modified, no version bump."""
    a = arguments(device, ONE_TAP)
    mutate, error, message = CASES[case]
    stats = a["running_mean"], a["running_var"]
    values, versions = [s.clone() for s in stats], [s._version for s in stats]
    mutate(a)
    a["weight"] = a["weight"].detach().requires_grad_()
    with fused_ops.testing.route(backward="gram"), pytest.raises(error, match=message):
        fused_ops.ct_bn_pool(**a, stride=2)
    assert all(torch.equal(s, v) for s, v in zip(stats, values))
    assert [s._version for s in stats] == versions


@pytest.mark.cuda
def test_device_mismatch_is_rejected():
    a = arguments("cuda")
    a["weight"] = a["weight"].cpu()
    mean = a["running_mean"].clone()
    with pytest.raises(RuntimeError, match="weight must be on the same device as x"):
        fused_ops.ct_bn_pool(**a)
    assert torch.equal(a["running_mean"], mean)


@pytest.mark.parametrize("device", DEVICES)
def test_rejected_module_call_does_not_count_a_batch(device):
    _, fused = make_models(P, torch.float32, device)
    fused.train()
    state = {k: v.clone() for k, v in fused.state_dict().items()}
    with pytest.raises(RuntimeError, match="5-D"):
        fused(make_input(P, torch.float32, device)[0])
    for key, value in fused.state_dict().items():
        assert torch.equal(value, state[key]), key


# --- Bad dtype combinations ------------------------------------------------------------------

OPTS = Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), conv_kwargs=dict(
    stride=(1, 2, 3), padding=(1, 0, 2), output_padding=(0, 1, 2), dilation=(2, 1, 1),
    groups=2))  # every conv option
OPTS_OPTIONS = op_conv_options(OPTS.conv_kwargs)


def dtype_arguments(device, conv_dtype, bn_dtype):
    """ct_bn_pool's tensor and number arguments for OPTS (OPTS_OPTIONS are the rest)."""
    _, fused = make_dtype_models(OPTS, conv_dtype, bn_dtype, device)
    bn, conv = fused.batch_norm, fused.conv_transpose
    return dict(x=make_input(OPTS, conv_dtype, device), weight=conv.weight.detach(),
                bias=conv.bias.detach(), scale=2.0, bn_weight=bn.weight.detach(),
                bn_bias=bn.bias.detach(), running_mean=bn.running_mean,
                running_var=bn.running_var, training=True, momentum=0.1, eps=1e-5)


def to(dtype, *names):
    def mutate(a):
        a.update({n: a[n].to(dtype) for n in names})
    return mutate


BN = ("bn_weight", "bn_bias", "running_mean", "running_var")
half, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
BAD_DTYPES = {  # (x's dtype, BatchNorm's dtype, change, message)
    "weight_f32_x_f16": (half, half, to(f32, "weight"), r"weight must have the same dtype as x"),
    "bias_f32_x_f16": (half, f32, to(f32, "bias"), r"bias must have the same dtype as x"),
    "bn_f64_x_f16": (half, half, to(f64, *BN),
                     r"bn_weight must have the same dtype as x \(float16\) or be float32"),
    "bn_f16_x_bf16": (bf16, bf16, to(half, *BN),
                      r"bn_weight must have the same dtype as x \(bfloat16\) or be float32"),
    "bn_f16_x_f32": (f32, f32, to(half, *BN),
                     r"bn_weight must have the same dtype as x \(float32\), got float16"),
    "bn_bias_f16_bn_weight_f32": (half, f32, to(half, "bn_bias"),
                                  r"bn_bias must have the same dtype as bn_weight \(float32\)"),
    "running_var_f16_bn_f32": (half, f32, to(half, "running_var"),
                               r"running_var must have the same dtype as bn_weight \(float32\)"),
    "running_mean_f32_bn_f16": (half, half, to(f32, "running_mean"),
                                r"running_mean must have the same dtype as bn_weight \(float16\)"),
    "no_affine_running_stats_f64": (
        half, half, lambda a: (a.update(bn_weight=None, bn_bias=None), to(f64, *BN[2:])(a)),
        r"running_mean must have the same dtype as x \(float16\) or be float32"),
    "x_int": (f32, f32, to(torch.int32, "x", "weight", "bias"),
              r"x must be float16, bfloat16, float32 or float64, got Int"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autograd", [False, True], ids=["no_grad_input", "weight_requires_grad"])
@pytest.mark.parametrize("case", list(BAD_DTYPES))
def test_bad_dtypes_are_named_and_mutate_nothing(case, autograd, device):
    conv_dtype, bn_dtype, mutate, message = BAD_DTYPES[case]
    a = dtype_arguments(device, conv_dtype, bn_dtype)
    kept = a["running_mean"], a["running_var"]
    values, versions = [s.clone() for s in kept], [s._version for s in kept]
    mutate(a)
    if autograd and a["weight"].is_floating_point():
        a["weight"] = a["weight"].detach().requires_grad_()
    with pytest.raises(RuntimeError, match=message):
        fused_ops.ct_bn_pool(**a, **OPTS_OPTIONS)
    assert all(torch.equal(s, v) for s, v in zip(kept, values))
    assert [s._version for s in kept] == versions


def split_op_arguments(a):
    """ct_bn_pool_apply's arguments but the dtype, after ct_bn_pool_stats, for arguments(...)."""
    sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(a["x"], a["weight"], **OPTS_OPTIONS)
    spatial = distributed.out_spatial(a["x"], a["weight"], **{
        k: v for k, v in OPTS_OPTIONS.items() if k != "groups"})
    return [sums, stats, spatial, a["bias"], 2.0, a["bn_weight"], a["bn_bias"],
            a["running_mean"], a["running_var"], 0.1, 1e-5]


@pytest.mark.parametrize("device", DEVICES)
def test_apply_checks_dtypes_against_its_dtype_argument(device):
    a = dtype_arguments(device, half, f32)
    args = split_op_arguments(a)
    mean = a["running_mean"].clone()
    apply = torch.ops.fused_ops.ct_bn_pool_apply
    with pytest.raises(RuntimeError, match=r"bias must have the same dtype as the dtype "
                                           r"argument \(bfloat16\), got float16"):
        apply(*args, torch.bfloat16)
    args[3] = None  # bias
    with pytest.raises(RuntimeError, match=r"bn_weight must have the same dtype as the dtype "
                                           r"argument \(float64\), got float32"):
        apply(*args, torch.float64)
    with pytest.raises(RuntimeError, match="dtype must be float16, bfloat16, float32 or float64"):
        apply(*args, torch.int64)
    assert torch.equal(a["running_mean"], mean)
