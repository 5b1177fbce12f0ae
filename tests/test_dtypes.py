"""float16 and bfloat16 inputs, with BatchNorm parameters and running statistics in the same
dtype or in float32 (PyTorch's mixed-precision batch norm), against the unfused PyTorch
pattern run in float64 on the same rounded values, in eval and in training with every
algorithm.

The output of a float16/bfloat16 call is rounded to its dtype at the end: within 2 units of
that dtype of the float64 result (OUT_TOL), and on CUDA, where PyTorch runs the pattern in
that dtype, no worse than PyTorch's own result against the same reference. Ours rounds a value
computed in float32 or better, so where it is the nearest value of the dtype PyTorch's
cannot be nearer; it may not be where the exact value sits within float32 rounding of a
midpoint between two values of the dtype, which moves the norm of the error by far less than
1%, the slack allowed. That final rounding hides the statistics, which are computed in
float32 or better: each training step's batch statistics are checked directly, at STATS_TOL
(about 1e-7), and the running statistics at their own dtype's rounding."""
import copy

import pytest
import torch

from conftest import (DEVICES, HALF_TYPES, OUT_TOL, Problem, assert_stats_match,
                      default_stats_tol, make_dtype_models, make_input, module_conv_options,
                      relerr, skip_unless_algo_covers)

# (conv dtype T of x, weight and bias; BatchNorm dtype P of its parameters and running stats)
DTYPES = [(t, p) for t in HALF_TYPES for p in (t, torch.float32)]
ALGOS = ["auto", "direct", "sliced_conv", "fft", "correlation", "cross_spectrum", "border"]

PROBLEMS = [
    Problem(2, 8, 16, (4, 6, 5), (3, 3, 3)),  # CUDA: 16-byte loads of x (120 values a row)
    Problem(3, 4, 37, (3, 4, 5), (2, 3, 4), scale=-0.75),  # odd channels and row length
    Problem(1, 3, 4, (7, 9, 11), (2, 2, 2)),  # batch 1: the statistics are the check
    Problem(1, 2, 3, (16, 16, 32), (1, 1, 1)),  # CUDA: few long rows, each split in parts
    Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), conv_kwargs=dict(
        stride=(1, 2, 3), padding=(1, 0, 2), output_padding=(0, 1, 2), dilation=(2, 1, 1),
        groups=2)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(bias=False),
            bn_kwargs=dict(affine=False)),
]


def dtype_ids(dtypes):
    return "-".join(str(d).removeprefix("torch.") for d in dtypes)


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
    if x.shape[0] == 1 and ref.training:
        return  # the output is beta: the statistics are the check
    err = relerr(out, expected)
    assert err <= OUT_TOL[x.dtype]
    if x.is_cuda and x.dtype in HALF_TYPES:
        assert err <= 1.01 * pytorch_relerr(ref, x, bn_dtype, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_eval_matches_float64_reference(problem, dtypes, device):
    conv_dtype, bn_dtype = dtypes
    ref, fused = make_dtype_models(problem, conv_dtype, bn_dtype, device, beta="random")
    ref.eval()
    fused.eval()
    x = make_input(problem, conv_dtype, device)
    with torch.no_grad():
        out = fused(x)
        expected = ref(x.double().cpu())
    assert_output_accurate(out, expected, ref, x, bn_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtypes", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_train_matches_float64_reference(problem, dtypes, algo, device):
    """Two steps: outputs, each step's batch statistics, and running statistics kept in their
    dtype and within that dtype's rounding of the float64 update."""
    conv_dtype, bn_dtype = dtypes
    skip_unless_algo_covers(problem, algo, device, conv_dtype)
    ref, fused = make_dtype_models(problem, conv_dtype, bn_dtype, device, algo)
    ref.train()
    fused.train()
    weight, options = fused.conv_transpose.weight.detach(), module_conv_options(fused)
    for _ in range(2):
        x = make_input(problem, conv_dtype, device, offset=0.5)
        before = copy.deepcopy(ref)
        with torch.no_grad():
            out = fused(x)
            expected = ref(x.double().cpu())
        assert_output_accurate(out, expected, before, x, bn_dtype)
        assert_stats_match(x, weight, options, algo, default_stats_tol(algo, x, weight, options))
    fbn, rbn = fused.batch_norm, ref.batch_norm
    if rbn.track_running_stats:
        for name in ("running_mean", "running_var"):
            stat = getattr(fbn, name)
            assert stat.dtype == bn_dtype, name
            assert relerr(stat, getattr(rbn, name)) <= OUT_TOL[bn_dtype], name


# Half-precision x in layouts the sums read in place (test_memory_format.py): channels_last_3d
# with 16-byte loads of 8 channels (16 channels) and with 2-byte loads (6 channels: a position's
# channels are 12 bytes), and a slice along the batch (positions adjacent, batch stride 2x).
HALF_VIEWS = {
    "channels_last_16": (Problem(2, 16, 5, (4, 6, 8), (2, 3, 2)),
                         lambda x: x.contiguous(memory_format=torch.channels_last_3d)),
    "channels_last_6": (Problem(3, 6, 5, (3, 5, 4), (2, 2, 3)),
                        lambda x: x.contiguous(memory_format=torch.channels_last_3d)),
    # x's samples at every other place of a tensor of twice the batch
    "batch_step": (Problem(2, 4, 5, (4, 4, 8), (2, 2, 2)),
                   lambda x: torch.stack([x, x.flip(0)], 1).flatten(0, 1)[::2]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("view", HALF_VIEWS)
def test_half_views_match_float64_reference(view, training, dtype, device):
    p, make_view = HALF_VIEWS[view]
    ref, fused = make_dtype_models(p, dtype, torch.float32, device,
                                   beta="zero" if training else "random")
    ref.train(training)
    fused.train(training)
    x = make_view(make_input(p, dtype, device))
    assert not x.is_contiguous()
    before = copy.deepcopy(ref)
    with torch.no_grad():
        out = fused(x)
        expected = ref(x.double().cpu())
    assert_output_accurate(out, expected, before, x.contiguous(), torch.float32)
    if training:
        weight, options = fused.conv_transpose.weight.detach(), module_conv_options(fused)
        assert_stats_match(x, weight, options, "auto", default_stats_tol("auto", x, weight, options))
        for name in ("running_mean", "running_var"):
            assert relerr(getattr(fused.batch_norm, name),
                          getattr(ref.batch_norm, name)) <= OUT_TOL[torch.float32], name
