"""float16 and bfloat16 inputs, with BatchNorm parameters and running statistics in the same
dtype or in float32 (PyTorch's mixed-precision batch norm), and float64, against the unfused
PyTorch pattern run in float64 on the same rounded values.

Tolerances follow what the dtype can hold: the output of a float16/bfloat16 call is within
2 units of its rounding of the float64 result, and on CUDA, where PyTorch runs the pattern
in that dtype, no worse than PyTorch's own result against the same reference. float32 and
float64 keep test_correctness.py's bounds.

Both errors are dominated by the final rounding of the pooled output to the dtype: ours
rounds a value computed in float32 or better, so where it is the nearest value of the dtype
PyTorch's cannot be nearer. It may not be where the exact value sits within float32 rounding
of a midpoint between two values of the dtype; such an element moves the norm of the error
by far less than 1%, which is the slack allowed (on the CPU, measured: at most 1.000).
"""
import copy

import pytest
import torch

import fused_ops
from fused_ops import distributed
from conftest import (DEVICES, Problem, assert_gradients_match, make_input, make_models, relerr,
                      skip_unless_algo_covers)

HALF_TYPES = [torch.float16, torch.bfloat16]
# Unit roundoff u: the relative rounding error of one value is at most u.
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
TOLERANCE = {torch.float16: 2 * UNIT[torch.float16], torch.bfloat16: 2 * UNIT[torch.bfloat16],
             torch.float32: 1e-6, torch.float64: 1e-10}
# Gradients: the backward runs the convolutions in x's dtype, as PyTorch's own does (measured
# on the CPU: ours within 3.2 units, PyTorch's unfused backward within 16).
GRAD_TOLERANCE = {torch.float16: 8 * UNIT[torch.float16], torch.bfloat16: 8 * UNIT[torch.bfloat16],
                  torch.float64: 1e-10}
# (conv dtype T of x, weight and bias; BatchNorm dtype P of its parameters and running stats)
DTYPES = [(t, p) for t in HALF_TYPES for p in (t, torch.float32)] + [(torch.float64,) * 2]

PROBLEMS = [
    Problem(2, 8, 16, (4, 6, 5), (3, 3, 3)),  # CUDA: 16-byte loads of x (120 values a row)
    Problem(3, 4, 37, (3, 4, 5), (2, 3, 4), scale=-0.75),  # odd channels and row length
    Problem(1, 3, 4, (7, 9, 11), (2, 2, 2)),  # batch 1
    Problem(1, 2, 3, (16, 16, 32), (1, 1, 1)),  # CUDA: few long rows, each split in parts
    Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), conv_kwargs=dict(
        stride=(1, 2, 3), padding=(1, 0, 2), output_padding=(0, 1, 2), dilation=(2, 1, 1),
        groups=2)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(bias=False),
            bn_kwargs=dict(affine=False)),
]


def dtype_ids(dtypes):
    return "-".join(str(d).removeprefix("torch.") for d in dtypes)


def make_dtype_models(p: Problem, conv_dtype, bn_dtype, device, algo="auto"):
    """(float64 CPU reference holding exactly the fused module's rounded values, fused module
    with its convolution in conv_dtype and its batch norm in bn_dtype on device)."""
    ref, fused = make_models(p, torch.float64, device, algo=algo)
    fused.conv_transpose.to(conv_dtype)
    fused.batch_norm.to(bn_dtype)
    ref.load_state_dict(fused.state_dict())  # the rounded values, back in float64
    return ref, fused


def rounded_input(p: Problem, dtype, device):
    return make_input(p, torch.float64, device).to(dtype)


def pytorch_relerr(ref, x, bn_dtype, expected):
    """The relative error of PyTorch's unfused modules run in x's dtype (batch norm in
    bn_dtype) on x's device, from ref's state (left unchanged), against `expected`."""
    model = copy.deepcopy(ref).to(x.device)
    model.conv_transpose.to(x.dtype)
    model.batch_norm.to(bn_dtype)
    with torch.no_grad():
        return relerr(model(x), expected)


def assert_output_accurate(out, expected, ref, x, bn_dtype):
    assert out.dtype == x.dtype and out.device == x.device and out.shape == expected.shape
    err = relerr(out, expected)
    assert err <= TOLERANCE[x.dtype]
    if x.is_cuda and x.dtype in HALF_TYPES:
        assert err <= 1.01 * pytorch_relerr(ref, x, bn_dtype, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_eval_matches_float64_reference(problem, dtypes, device):
    conv_dtype, bn_dtype = dtypes
    ref, fused = make_dtype_models(problem, conv_dtype, bn_dtype, device)
    ref.eval()
    fused.eval()
    x = rounded_input(problem, conv_dtype, device)
    with torch.no_grad():
        out = fused(x)
        expected = ref(x.double().cpu())
    assert_output_accurate(out, expected, ref, x, bn_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["auto", "direct", "sliced_conv", "correlation", "cross_spectrum",
                                  "border"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_train_matches_float64_reference(problem, dtypes, algo, device):
    """Two steps: outputs, and running statistics kept in their dtype and within that
    dtype's tolerance of the float64 update."""
    skip_unless_algo_covers(problem, algo)
    conv_dtype, bn_dtype = dtypes
    ref, fused = make_dtype_models(problem, conv_dtype, bn_dtype, device, algo)
    ref.train()
    fused.train()
    for _ in range(2):
        x = rounded_input(problem, conv_dtype, device)
        before = copy.deepcopy(ref)
        with torch.no_grad():
            out = fused(x)
            expected = ref(x.double().cpu())
        assert_output_accurate(out, expected, before, x, bn_dtype)
    fbn, rbn = fused.batch_norm, ref.batch_norm
    if rbn.track_running_stats:
        for name in ("running_mean", "running_var"):
            stat = getattr(fbn, name)
            assert stat.dtype == bn_dtype, name
            assert relerr(stat, getattr(rbn, name)) <= TOLERANCE[bn_dtype], name


# Half-precision x in layouts the sums read in place (test_memory_format.py): channels_last_3d
# with 16-byte loads of 8 channels (16 channels) and with 2-byte loads (6 channels: a position's
# channels are 12 bytes), and a slice along the batch (positions adjacent, batch stride 2x).
HALF_VIEWS = {
    "channels_last_16": (Problem(2, 16, 5, (4, 6, 8), (2, 3, 2)),
                         lambda x: x.contiguous(memory_format=torch.channels_last_3d)),
    "channels_last_6": (Problem(3, 6, 5, (3, 5, 4), (2, 2, 3)),
                        lambda x: x.contiguous(memory_format=torch.channels_last_3d)),
    "batch_step": (Problem(2, 4, 5, (4, 4, 8), (2, 2, 2)), lambda x: torch.cat([x, x])[::2]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("view", HALF_VIEWS)
def test_half_views_match_float64_reference(view, training, dtype, device):
    p, make_view = HALF_VIEWS[view]
    ref, fused = make_dtype_models(p, dtype, torch.float32, device)
    ref.train(training)
    fused.train(training)
    x = make_view(rounded_input(p, dtype, device))
    assert not x.is_contiguous()
    before = copy.deepcopy(ref)
    with torch.no_grad():
        out = fused(x)
        expected = ref(x.double().cpu())
    assert_output_accurate(out, expected, before, x.contiguous(), torch.float32)
    if training:
        for name in ("running_mean", "running_var"):
            assert relerr(getattr(fused.batch_norm, name),
                          getattr(ref.batch_norm, name)) <= TOLERANCE[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("p", [PROBLEMS[0], PROBLEMS[4]], ids=Problem.ids)
def test_gradients_in_their_own_dtypes(p, training, dtypes, device):
    """The backward (fused_ops/_autograd.py) returns each gradient in its tensor's dtype,
    close to the float64 gradients of the same rounded values."""
    conv_dtype, bn_dtype = dtypes
    ref, fused = make_dtype_models(p, conv_dtype, bn_dtype, device)
    ref.train(training)
    fused.train(training)
    x = rounded_input(p, conv_dtype, device)
    grad_out = torch.randn(p.batch, p.out_channels, 1, 1, 1, dtype=torch.float64).to(conv_dtype)
    got = gradients(fused, x, grad_out.to(device))
    want = gradients(ref, x.double().cpu(), grad_out.double())
    for name, grad in got.items():
        expected_dtype = bn_dtype if name.startswith("batch_norm.") else conv_dtype
        assert grad.dtype == expected_dtype, name
    assert_gradients_match(got, want, GRAD_TOLERANCE[conv_dtype])


def gradients(module, x, grad_out):
    x = x.detach().clone().requires_grad_()
    module(x).backward(grad_out)
    return {"x": x.grad, **{name: q.grad for name, q in module.named_parameters()}}


# --- Bad dtype combinations ----------------------------------------------------------------------

OPTS = PROBLEMS[4]  # every conv option


def conv_options(p: Problem) -> dict:
    """The problem's conv options as ct_bn_pool's keywords."""
    triple = lambda v: [v] * 3 if isinstance(v, int) else list(v)  # noqa: E731
    return {k: v if k == "groups" else triple(v) for k, v in p.conv_kwargs.items() if k != "bias"}


def arguments(device, conv_dtype, bn_dtype):
    """ct_bn_pool's tensor and number arguments for OPTS (conv_options(OPTS) are the rest)."""
    _, fused = make_dtype_models(OPTS, conv_dtype, bn_dtype, device)
    bn, conv = fused.batch_norm, fused.conv_transpose
    return dict(x=rounded_input(OPTS, conv_dtype, device), weight=conv.weight.detach(),
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
    a = arguments(device, conv_dtype, bn_dtype)
    kept = a["running_mean"], a["running_var"]
    values, versions = [s.clone() for s in kept], [s._version for s in kept]
    mutate(a)
    if autograd and a["weight"].is_floating_point():
        a["weight"] = a["weight"].detach().requires_grad_()
    with pytest.raises(RuntimeError, match=message):
        fused_ops.ct_bn_pool(**a, **conv_options(OPTS))
    assert all(torch.equal(s, v) for s, v in zip(kept, values))
    assert [s._version for s in kept] == versions


def split_op_arguments(a):
    """ct_bn_pool_apply's arguments but the dtype, after ct_bn_pool_stats, for arguments(...)."""
    sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(a["x"], a["weight"], **conv_options(OPTS))
    spatial = distributed.out_spatial(a["x"], a["weight"], **{
        k: v for k, v in conv_options(OPTS).items() if k != "groups"})
    return [sums, stats, spatial, a["bias"], 2.0, a["bn_weight"], a["bn_bias"],
            a["running_mean"], a["running_var"], 0.1, 1e-5]


@pytest.mark.parametrize("device", DEVICES)
def test_apply_checks_dtypes_against_its_dtype_argument(device):
    a = arguments(device, half, f32)
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


# --- The synchronized-statistics halves and PyTorch's tooling ------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtype_ids)
def test_split_ops_equal_the_plain_op(dtypes, device, monkeypatch):
    """fused_ops/distributed.py's path for a group of one (the all-gather simulated)."""
    a = arguments(device, *dtypes)
    twin = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    monkeypatch.setattr(distributed, "all_gather_stats", lambda stats, group: stats[None])
    with torch.no_grad():
        out = distributed.synced_ct_bn_pool(
            a["x"], a["weight"], a["bias"], 2.0, a["bn_weight"], a["bn_bias"],
            a["running_mean"], a["running_var"], 0.1, 1e-5, algo="auto", process_group=None,
            **conv_options(OPTS))
        plain = fused_ops.ct_bn_pool(**twin, **conv_options(OPTS))
    assert out.dtype == dtypes[0]
    assert relerr(out, plain) <= TOLERANCE[dtypes[0]]
    for name in ("running_mean", "running_var"):
        assert a[name].dtype == dtypes[1]
        assert relerr(a[name], twin[name]) <= TOLERANCE[dtypes[1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES[:-1], ids=dtype_ids)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
def test_opcheck(requires_grad, training, dtypes, device):
    a = arguments(device, *dtypes)
    for name in ("x", "weight", "bias", "bn_weight", "bn_bias"):
        a[name] = a[name].detach().requires_grad_(requires_grad)
    a["training"] = training
    torch.library.opcheck(torch.ops.fused_ops.ct_bn_pool.default, tuple(a.values()),
                          conv_options(OPTS))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES[:-1], ids=dtype_ids)
def test_split_ops_pass_opcheck(dtypes, device):
    a = arguments(device, *dtypes)
    torch.library.opcheck(torch.ops.fused_ops.ct_bn_pool_stats.default, (a["x"], a["weight"]),
                          conv_options(OPTS))
    args = split_op_arguments(a)
    assert args[0].dtype == args[1].dtype == torch.float64
    torch.library.opcheck(torch.ops.fused_ops.ct_bn_pool_apply.default, (*args, a["x"].dtype))
