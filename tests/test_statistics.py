"""The batch statistics and the running statistics, seen directly, for every algorithm.

- Each algorithm's per-channel count, mean and variance (ct_bn_pool_stats, the reduction the
  op runs) against float64 on the same rounded values, in every input dtype; and the
  variance the op itself writes: with momentum 1 the running variance is the batch's
  unbiased variance, the running mean the batch mean of z = scale (y + bias).
- Real cancellation: inputs offset so far from zero that E[y^2] / Var(y) >= 1e4 per channel
  (asserted in each test), where a naive E[y^2] - E[y]^2 in float32 would lose about
  1e4 * 2^-24 = 6e-4 of the variance. The convolution output then has one mean over the
  whole grid: kernel 1 (padding 0), or kernel k with padding k - 1 (every output position
  gets all taps from inside x). A path that rounds y, or x's spectrum, to float32 once loses
  about 2^-24 sqrt(E[y^2] / Var(y)) of the variance, and that is the bound asserted there
  (CANCELLATION_TOL); the paths that accumulate in float64 are held to STATS_TOL.
  algo='border' amplifies its terms' rounding by border_amplification (docs/math.md §3.6),
  which an offset grows with its square: on small crops its bound is that.
- momentum 0 (running statistics kept, the count still counted), momentum None (a
  cumulative average), untracked running statistics, beta and gamma applied in training.
"""
import math

import pytest
import torch

import fused_ops
from conftest import (DEVICES, HALF_TYPES, OUT_TOL, SPECIAL, STATS_TOL, TOL, UNIT,
                      Problem, algo_covers, assert_stats_match, border_amplification,
                      make_dtype_models, make_input, make_models, module_conv_options, moment_ratio,
                      op_conv_options, reference_conv, reference_stats, relerr,
                      skip_unless_algo_covers)

TRAIN_ALGOS = ["auto", "direct", "sliced_conv", "fft", "correlation", "cross_spectrum", "border"]
# Accumulate in float64 from x itself on the CPU (no float32 rounding of y or of spectra).
FLOAT64_ON_CPU = {"direct", "correlation"}
STATS_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
STATS_PROBLEMS = SPECIAL + [
    Problem(2, 5, 7, (4, 5, 6), (3, 3, 3), conv_kwargs=dict(padding=(1, 2, 0), stride=(2, 1, 1))),
    # One tap per output position (correlation's single lag, docs/math.md §3.4): kernel =
    # stride with groups; a dilated tap inside a larger stride, with output padding.
    Problem(2, 6, 4, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(stride=2, groups=2)),
    Problem(3, 4, 5, (3, 4, 5), (2, 1, 2), conv_kwargs=dict(
        stride=(3, 2, 2), dilation=(2, 1, 1), output_padding=(1, 0, 1))),
]


def computing_unit(dtype):
    """The unit roundoff of the dtype the paths compute in: float32 for half inputs."""
    return UNIT[torch.float64 if dtype == torch.float64 else torch.float32]


# --- Each algorithm's statistics ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", STATS_DTYPES, ids=str)
@pytest.mark.parametrize("algo", TRAIN_ALGOS)
@pytest.mark.parametrize("problem", STATS_PROBLEMS, ids=Problem.ids)
def test_batch_statistics_match_float64(problem, algo, dtype, device):
    """ct_bn_pool_stats: the count exactly; the variance per channel within STATS_TOL of
    itself (about 1e-7 in float32, whatever the output's other terms); the means within
    STATS_TOL of the spread. x offset by one spread: means far from 0."""
    skip_unless_algo_covers(problem, algo, device, dtype)
    _, fused = make_models(problem, dtype, device, algo=algo)
    x = make_input(problem, dtype, device, offset=1.0)
    weight = fused.conv_transpose.weight.detach()
    tol = STATS_TOL[dtype]
    if algo == "border":  # docs/math.md §3.6: the terms' rounding, amplified
        tol += 2 * computing_unit(dtype) * border_amplification(x, weight, module_conv_options(fused))
    assert_stats_match(x, weight, module_conv_options(fused), algo, tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("algo", TRAIN_ALGOS)
@pytest.mark.parametrize("problem", [
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), scale=-1.5),
    Problem(1, 3, 5, (3, 4, 5), (2, 2, 2)),  # batch 1: the output is beta, the update is not
    Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), scale=0.5, conv_kwargs=dict(
        stride=(1, 2, 3), padding=(1, 0, 2), output_padding=(0, 1, 2), dilation=(2, 1, 1),
        groups=2)),
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=2)),
], ids=Problem.ids)
def test_the_ops_own_variance_through_the_running_statistics(problem, algo, dtype, device):
    """momentum=1: running_var becomes var(z) n / (n - 1) = scale^2 var(y) n / (n - 1) and
    running_mean scale (mean(y) + bias), the statistics the op normalized with; against
    float64 at STATS_TOL (plus the running statistics' own rounding)."""
    skip_unless_algo_covers(problem, algo, device, dtype)
    _, fused = make_models(problem, dtype, device, algo=algo)
    conv, bn = fused.conv_transpose, fused.batch_norm
    x = make_input(problem, dtype, device, offset=0.5)
    options = op_conv_options(problem.conv_kwargs)
    with torch.no_grad():
        fused_ops.ct_bn_pool(x, conv.weight, conv.bias, problem.scale, bn.weight, bn.bias,
                             bn.running_mean, bn.running_var, True, 1.0, problem.eps,
                             algo=algo, **options)
    y = reference_conv(x, conv.weight, options)
    count, mean, var, _ = reference_stats(y)
    bias = 0 if conv.bias is None else conv.bias.detach().double().cpu()
    want_var = problem.scale ** 2 * var * count / (count - 1)
    want_mean = problem.scale * (mean + bias)
    tol = STATS_TOL[dtype] + UNIT[dtype]
    if algo == "border":
        tol += 2 * UNIT[dtype] * border_amplification(x, conv.weight, options)
    assert ((bn.running_var.double().cpu() - want_var).abs() / want_var).max().item() <= tol
    spread = want_var.sqrt()
    assert ((bn.running_mean.double().cpu() - want_mean).abs() / spread).max().item() <= tol


# --- Real cancellation ------------------------------------------------------------------------

def positive_weight(fused):
    """Weights in [0.5, 1.5] / fan-in: every output channel's mean is x's offset times a
    weight sum far from zero, so that an offset makes E[y^2] / Var(y) large in every channel."""
    weight = fused.conv_transpose.weight
    with torch.no_grad():
        fan = weight.shape[0] // fused.conv_transpose.groups * math.prod(weight.shape[2:])
        weight.copy_((torch.rand(weight.shape, dtype=torch.float64) + 0.5) / fan)
    return fused


# (problem, offset): E[y^2] / Var(y) about 2e4 to 4e4 with positive weights.
CANCELLATION = {
    "k1": (Problem(3, 4, 5, (5, 6, 7), (1, 1, 1)), 150.0),
    "k1-dilated": (Problem(2, 4, 5, (5, 6, 7), (1, 1, 1), conv_kwargs=dict(dilation=2)), 150.0),
    "k2-pad1": (Problem(3, 4, 5, (5, 6, 7), (2, 2, 2), conv_kwargs=dict(padding=1)), 45.0),
    "k3-pad2": (Problem(3, 4, 5, (5, 6, 7), (3, 3, 3), conv_kwargs=dict(padding=2)), 18.0),
    "k3x1x2-pad": (Problem(2, 3, 4, (6, 5, 7), (3, 1, 2), scale=-0.5,
                           conv_kwargs=dict(padding=(2, 0, 1))), 40.0),
    # algo='border' without a ramp at the cut: kernel 1, the padding cropping x itself
    "k1-pad1": (Problem(3, 4, 5, (5, 6, 7), (1, 1, 1), conv_kwargs=dict(padding=1)), 150.0),
}
CANCELLATION_CASES = [(case, algo) for case, (p, _) in CANCELLATION.items()
                      for algo in TRAIN_ALGOS
                      if algo_covers(p, algo, "cuda") and not (algo == "border" and p.kernel != (1, 1, 1))]


def cancellation_tol(algo, device, dtype, ratio):
    """The variance's bound: STATS_TOL where the path accumulates in float64 from x itself,
    else plus one rounding of y (or of x's spectrum) to float32 relative to the spread."""
    tol = STATS_TOL[dtype]
    if not (algo in FLOAT64_ON_CPU and torch.device(device).type == "cpu"):
        tol += 3 * computing_unit(dtype) * math.sqrt(ratio)
    return tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32] + HALF_TYPES, ids=str)
@pytest.mark.parametrize("case, algo", CANCELLATION_CASES, ids=["-".join(c) for c in CANCELLATION_CASES])
def test_offset_inputs_do_not_cancel(case, algo, dtype, device):
    """Training output and statistics over two steps with x offset far from zero."""
    problem, offset = CANCELLATION[case]
    skip_unless_algo_covers(problem, algo, device, dtype)
    # float16 and bfloat16 x with a float32 batch norm (PyTorch's mixed precision)
    ref, fused = make_dtype_models(problem, dtype, torch.float32 if dtype in HALF_TYPES else dtype,
                                   device, algo=algo)
    ref.load_state_dict(positive_weight(fused).state_dict())
    ref.train()
    fused.train()
    weight = fused.conv_transpose.weight.detach()
    for _ in range(2):
        x = make_input(problem, dtype, device, offset=offset)
        ratio = moment_ratio(reference_conv(x, weight, module_conv_options(fused)))
        assert ratio >= 1e4, ratio  # the cancellation a naive formula would suffer
        tol = cancellation_tol(algo, device, dtype, ratio)
        assert_stats_match(x, weight, module_conv_options(fused), algo, tol)
        with torch.no_grad():
            out = fused(x)
            expected = ref(x.double().cpu())
        # beta = 0: the output is gamma zhat, whose error is half the variance's, plus the
        # output's own rounding
        assert relerr(out, expected) <= OUT_TOL[dtype] + tol / 2
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= (
            OUT_TOL[torch.float32] + cancellation_tol(algo, device, dtype, 1e5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["fft", "correlation", "cross_spectrum"])
@pytest.mark.parametrize("conv_kwargs", [dict(), dict(stride=2), dict(stride=2, kernel_size=2),
                                         dict(stride=(2, 1, 3), output_padding=(1, 0, 2))],
                         ids=str)
def test_offset_with_strides(conv_kwargs, algo, device):
    """An offset 50 times x's spread through the phases of a stride (docs/math.md §3.3.1):
    the phases' zero grid positions and the terms of their sums. Not cancellation in the
    sense above (the phases' means differ), but every term of the offset must come out:
    output and statistics at the float32 tolerance."""
    conv_kwargs = dict(conv_kwargs)
    kernel = conv_kwargs.pop("kernel_size", 3)
    problem = Problem(4, 6, 10, (5, 6, 7), (kernel,) * 3, conv_kwargs=conv_kwargs)
    skip_unless_algo_covers(problem, algo, device)
    ref, fused = make_models(problem, torch.float32, device, algo=algo)
    x = make_input(problem, torch.float32, device, offset=50.0)
    ref.train()
    fused.train()
    with torch.no_grad():
        assert relerr(fused(x), ref(x.double().cpu())) <= TOL[torch.float32]
    assert_stats_match(x, fused.conv_transpose.weight.detach(), module_conv_options(fused), algo,
                       STATS_TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["k2-pad1", "k3-pad2", "k3x1x2-pad"])
def test_border_on_small_crops_within_its_bound(case, dtype, device):
    """algo='border' with an offset and padding k - 1: the planes the padding cuts hold partial
    sums, far from the crop's mean, so the full grid's energy is thousands of times the crop's
    (border_amplification, asserted >= 100 here) and the terms' float32 rounding is amplified
    as much (docs/math.md §3.6). Its statistics within that bound, no better is claimed."""
    problem, offset = CANCELLATION[case]
    _, fused = make_models(problem, dtype, device, algo="border")
    positive_weight(fused)
    weight = fused.conv_transpose.weight.detach()
    x = make_input(problem, dtype, device, offset=offset)
    options = module_conv_options(fused)
    amplification = border_amplification(x, weight, options)
    assert amplification >= 100, amplification
    assert_stats_match(x, weight, options, "border",
                       STATS_TOL[dtype] + 2 * UNIT[torch.float32] * amplification)


# --- Running statistics -----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("form", ["module", "functional"])
def test_momentum_0_keeps_the_running_statistics(form, dtype, device):
    """momentum=0.0 is a factor of 0, not None's cumulative average: the running statistics
    stay exactly as they were (PyTorch's modules: the same), num_batches_tracked counts, and
    the output uses the batch statistics."""
    p = Problem(3, 4, 6, (3, 4, 5), (2, 3, 2), momentum=0.0)
    ref, fused = make_models(p, dtype, device)
    ref.train()
    fused.train()
    bn = fused.batch_norm
    before = [bn.running_mean.clone(), bn.running_var.clone()]
    conv = fused.conv_transpose
    for step in range(3):
        x = make_input(p, dtype, device)
        with torch.no_grad():
            if form == "module":
                out = fused(x)
            else:
                out = fused_ops.ct_bn_pool(x, conv.weight, conv.bias, p.scale, bn.weight,
                                           bn.bias, bn.running_mean, bn.running_var, True, 0.0,
                                           p.eps)
            expected = ref(x.double().cpu())
        assert relerr(out, expected) <= TOL[dtype]
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert torch.equal(ref.batch_norm.running_mean, before[0].double().cpu())
    if form == "module":
        assert int(bn.num_batches_tracked) == int(ref.batch_norm.num_batches_tracked) == 3
    fused.eval()
    ref.eval()
    x = make_input(p, dtype, device)
    with torch.no_grad():
        assert relerr(fused(x), ref(x.double().cpu())) <= TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_momentum_none_is_a_cumulative_average(device):
    p = Problem(3, 4, 6, (3, 4, 5), (2, 3, 2), momentum=None)
    ref, fused = make_models(p, torch.float64, device)
    for mode in ["train", "train", "eval", "train"]:
        ref.train(mode == "train")
        fused.train(mode == "train")
        x = make_input(p, torch.float64, device)
        with torch.no_grad():
            assert relerr(fused(x), ref(x.cpu())) <= TOL[torch.float64]
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= TOL[torch.float64]
    assert int(fused.batch_norm.num_batches_tracked) == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_untracked_running_stats_use_batch_stats(training, device):
    p = Problem(3, 4, 6, (3, 4, 5), (2, 3, 2), bn_kwargs=dict(track_running_stats=False))
    ref, fused = make_models(p, torch.float64, device)
    ref.train(training)
    fused.train(training)
    x = make_input(p, torch.float64, device)
    with torch.no_grad():
        assert relerr(fused(x), ref(x.cpu())) <= TOL[torch.float64]
    assert fused.batch_norm.running_mean is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_running_stats_present_but_not_tracked(training, device):
    """track_running_stats switched off after construction, the buffers kept: as
    nn.BatchNorm3d, training uses batch statistics and leaves the buffers alone, eval
    normalizes with the buffers."""
    p = Problem(3, 4, 6, (3, 4, 5), (2, 3, 2))
    ref, fused = make_models(p, torch.float64, device, beta="random")
    for model in (ref, fused):
        model.batch_norm.track_running_stats = False
        model.train(training)
    before = [fused.batch_norm.running_mean.clone(), fused.batch_norm.running_var.clone()]
    x = make_input(p, torch.float64, device)
    with torch.no_grad():
        assert relerr(fused(x), ref(x.cpu())) <= TOL[torch.float64]
    assert torch.equal(fused.batch_norm.running_mean, before[0])
    assert torch.equal(fused.batch_norm.running_var, before[1])
    assert int(fused.batch_norm.num_batches_tracked) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("problem", [Problem(3, 4, 6, (3, 4, 5), (2, 3, 2), scale=-1.5),
                                     Problem(1, 4, 6, (3, 4, 5), (2, 3, 2))], ids=Problem.ids)
def test_training_applies_beta_and_gamma(problem, dtype, device):
    """With a random beta: the whole output against float64 (one sample: exactly beta)."""
    ref, fused = make_models(problem, dtype, device, beta="random")
    ref.train()
    fused.train()
    x = make_input(problem, dtype, device)
    with torch.no_grad():
        out = fused(x)
        expected = ref(x.double().cpu())
    assert relerr(out, expected) <= TOL[dtype]
    if problem.batch == 1:
        beta = fused.batch_norm.bias.detach().view(1, -1, 1, 1, 1)
        assert torch.equal(out, beta.expand_as(out).to(out.dtype))
