"""Shared test helpers: the unfused reference pattern, problem generators, float64 reference
statistics, tolerances, markers, and the CUDA kernel names the profiling tests look for.

Every accuracy check compares with PyTorch's modules (or F.conv_transpose3d) run in float64 on
the same rounded values. Two things keep those checks sharp:

- In training BatchNorm's output is ``gamma * zhat + beta``; a random beta would make up most
  of the output's norm, so that a relative bound on the whole output would say little about
  zhat, which carries the batch statistics. ``make_models`` therefore sets beta to 0 unless
  asked otherwise (``beta="random"``, for the tests of beta's handling and of eval mode), and
  gamma to +-[0.5, 1.5] (signs mixed, so that a lost sign shows).
- Each training step is also checked on the statistics themselves: the per-channel count,
  mean and variance of ``ct_bn_pool_stats`` (the same reduction the op runs) against float64,
  at ``STATS_TOL``. With a batch of one the output is exactly beta and checks nothing: the
  statistics are the check there.
"""
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
# The source tree's package (with `_C` built in place): `pytest tests/` and `python -m pytest
# tests/` import the same fused_ops, an editable install or not, and a copy of the tree
# (scripts/mutation_check.py) imports its own.
sys.path.insert(0, str(REPO))

import fused_ops  # noqa: E402
from fused_ops.modules import conv_transpose_options  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: takes more than a few seconds (CI runs it too)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA devices (tensors on cuda:1 while cuda:0 is "
                                     "current)")

# --- Tolerances ------------------------------------------------------------------------------

# Outputs: relative error of the whole output (beta = 0: the normalized part) against float64.
TOL = {torch.float64: 1e-10, torch.float32: 1e-6}
# float16 and bfloat16 outputs are rounded to their dtype at the end: within 2 units of it.
HALF_TYPES = [torch.float16, torch.bfloat16]
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24,
        torch.float64: 2.0 ** -53}
OUT_TOL = {**TOL, torch.float16: 2 * UNIT[torch.float16], torch.bfloat16: 2 * UNIT[torch.bfloat16]}
# The batch statistics (ct_bn_pool_stats, float64 results) against float64 on the same rounded
# inputs, per channel: the variance relative to itself, the mean relative to the spread. The
# paths that form the convolution output or spectra in float32 (x float32, float16 or bfloat16)
# round each value once: about 1e-7 of the variance.
STATS_TOL = {torch.float64: 1e-11, torch.float32: 2e-7, torch.float16: 2e-7,
             torch.bfloat16: 2e-7}
# Gradients against float64 gradients of the same rounded values. float16/bfloat16: the
# backward forms zhat in x's dtype, as PyTorch's own backward of the unfused modules does,
# and gamma's gradient sums it against the pooled output's gradient, which cancels: 16 units,
# what PyTorch's own float16 backward reaches.
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 16 * UNIT[torch.float16],
            torch.bfloat16: 16 * UNIT[torch.bfloat16]}

# --- CUDA kernel names (the profiling tests' one list: kernels get renamed) --------------------

KERNELS = dict(
    direct="energy_direct_kernel",                  # csrc/direct/cuda/direct_energy.cu
    direct_stride1="energy_direct_stride1_kernel",  # direct_energy_stride1.cu
    direct_mma="direct_stats_mma_kernel",           # direct_stats_mma.cu
    box_sums="box_sums_kernel",
    spectral_energy="spectral_energy_kernel",       # the FFT path (both kernels)
    small_spectral_energy="small_spectral_energy_kernel",
    weight_spectrum="weight_spectrum_kernel",
    cross_spectrum="cross_spectrum_",               # any of the cross-spectrum path's kernels
    s_stage="cross_spectrum_kernel<float",
    s_stage_mma="cross_spectrum_mma_kernel",
    quad_form="quad_form_kernel",
    quad_form_mma="quad_form_mma_kernel",
    tap_spectrum="tap_spectrum_kernel",
    lag_stage="lag_stage_kernel",
    plane_dft="plane_dft",
    depth_dft="depth_dft",
    spatial_sum="spatial_sum",
    spatial_sum_plain="spatial_sum_kernel",
    eval_x_sums="spatial_sum_x_kernel",
    eval_finalize="eval_finalize_kernel",
    bn_finalize="bn_finalize_kernel",
    channels_last_sums="spatial_sum_channels_last_kernel",
)
# What each training path leaves in a profile: our kernels by name, sliced_conv's
# aten::_convolution (csrc/sliced_conv/sliced_conv.cpp calls it directly).
PATH_MARKS = {"cross_spectrum": (KERNELS["cross_spectrum"],),
              "fft": (KERNELS["spectral_energy"],),
              "direct": ("energy_direct_", KERNELS["direct_mma"]),
              "sliced_conv": ("aten::_convolution",)}


def paths_seen(names):
    """The training paths whose marks appear among the profiled event names."""
    return {path for path, marks in PATH_MARKS.items()
            if any(m in name for m in marks for name in names)}


# --- The reference pattern and problems --------------------------------------------------------

class Reference(nn.Module):
    """The pattern as users write it (the reference for every test)."""

    def __init__(self, in_channels, out_channels, kernel_size, scale_factor, eps=1e-5,
                 momentum=0.1, conv_kwargs=None, bn_kwargs=None):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(in_channels, out_channels, kernel_size,
                                                 **(conv_kwargs or {}))
        self.scale_factor = scale_factor
        self.batch_norm = nn.BatchNorm3d(out_channels, eps=eps, momentum=momentum,
                                         **(bn_kwargs or {}))
        self.global_avg_pool = nn.AdaptiveAvgPool3d((1, 1, 1))

    def forward(self, x):
        return self.global_avg_pool(self.batch_norm(self.conv_transpose(x) * self.scale_factor))


@dataclass
class Problem:
    batch: int
    in_channels: int
    out_channels: int
    size: tuple
    kernel: tuple
    scale: float = 2.0
    conv_kwargs: dict = field(default_factory=dict)
    bn_kwargs: dict = field(default_factory=dict)
    eps: float = 1e-5
    momentum: float = 0.1

    def ids(self):
        return (f"B{self.batch}-Ci{self.in_channels}-Co{self.out_channels}-"
                f"{'x'.join(map(str, self.size))}-k{'x'.join(map(str, self.kernel))}-s{self.scale}"
                + "".join(f"-{k}{v}" for k, v in {**self.conv_kwargs, **self.bn_kwargs}.items())
                + ("" if self.momentum == 0.1 else f"-momentum{self.momentum}"))

    def triple(self, name, default):
        value = self.conv_kwargs.get(name, default)
        return tuple(value) if isinstance(value, (tuple, list)) else (value,) * 3

    def out_size(self):
        stride, padding = self.triple("stride", 1), self.triple("padding", 0)
        output_padding, dilation = self.triple("output_padding", 0), self.triple("dilation", 1)
        return tuple((n - 1) * s - 2 * p + d * (k - 1) + op + 1 for n, k, s, p, op, d in zip(
            self.size, self.kernel, stride, padding, output_padding, dilation))

    def values_per_channel(self):
        return self.batch * math.prod(self.out_size())


def problem_params(problems, slow_above=1e9):
    """pytest.param of each problem, marked slow where its convolution has more multiply-adds
    than `slow_above` (the float64 reference takes seconds on the CPU there)."""
    def work(p):
        groups = p.conv_kwargs.get("groups", 1)
        return (p.batch * p.in_channels * p.out_channels // groups * math.prod(p.kernel)
                * math.prod(p.size))
    return [pytest.param(p, id=p.ids(), marks=[pytest.mark.slow] if work(p) > slow_above else [])
            for p in problems]


def has_padding(problem: Problem) -> bool:
    return any(p != 0 for p in problem.triple("padding", 0))


def algo_covers(problem: Problem, algo: str, device="cpu", dtype=torch.float32) -> bool:
    """Whether a forced `algo` computes `problem` (each algorithm's file tests the refusals)."""
    if algo in ("correlation", "cross_spectrum"):
        return not has_padding(problem)
    if algo == "border":
        return has_padding(problem)
    if algo == "fft":
        return (torch.device(device).type == "cuda" and dtype != torch.float64
                and not has_padding(problem))
    return True


def skip_unless_algo_covers(problem: Problem, algo: str, device="cpu", dtype=torch.float32):
    if not algo_covers(problem, algo, device, dtype):
        pytest.skip(f"algo='{algo}' does not cover this problem, device or dtype")


def relerr(out, ref):
    """||out - ref|| / ||ref|| (0 where both are zero, inf where only ref is)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    error, norm = (out - ref).norm().item(), ref.norm().item()
    return error / norm if norm > 0 else (0.0 if error == 0 else float("inf"))


def randomize(ref, beta="zero"):
    """Non-trivial BN parameters and running stats: gamma +-[0.5, 1.5], beta 0 (see the module
    docstring) or N(0, 1) with beta="random", running stats N(0, 1) and [0.5, 2]."""
    bn = ref.batch_norm
    with torch.no_grad():
        if bn.affine:
            sign = torch.where(torch.rand(bn.num_features) < 0.5, -1.0, 1.0)
            bn.weight.uniform_(0.5, 1.5).mul_(sign.to(bn.weight.dtype))
            if beta == "random":
                bn.bias.normal_()
            else:
                bn.bias.zero_()
        if bn.track_running_stats:
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    return ref


def make_models(p: Problem, dtype=torch.float32, device="cpu", algo="auto", beta="zero"):
    """(float64 CPU reference, fused module with the same parameters on device/dtype)."""
    ref = Reference(p.in_channels, p.out_channels, p.kernel, p.scale, p.eps, p.momentum,
                    p.conv_kwargs, p.bn_kwargs)
    randomize(ref, beta)
    ref = ref.double()
    fused = fused_ops.ConvTransposeBNPool3d(
        p.in_channels, p.out_channels, p.kernel, p.scale, p.eps, p.momentum, algo=algo,
        **p.conv_kwargs, **p.bn_kwargs)
    fused.load_state_dict(ref.state_dict())
    return ref, fused.to(device=device, dtype=dtype)


def make_dtype_models(p: Problem, conv_dtype, bn_dtype, device="cpu", algo="auto", beta="zero"):
    """(float64 CPU reference holding exactly the fused module's rounded values, fused module
    with its convolution in conv_dtype and its batch norm in bn_dtype on device)."""
    ref, fused = make_models(p, torch.float64, device, algo=algo, beta=beta)
    fused.conv_transpose.to(conv_dtype)
    fused.batch_norm.to(bn_dtype)
    ref.load_state_dict(fused.state_dict())  # the rounded values, back in float64
    return ref, fused


def make_input(p: Problem, dtype=torch.float32, device="cpu", offset=0.0):
    """Normal values (plus `offset`) rounded to `dtype` from float64."""
    x = torch.randn(p.batch, p.in_channels, *p.size, dtype=torch.float64) + offset
    return x.to(dtype=dtype, device=device)


def random_problems(count, seed, **fixed):
    """Random small problems with odd sizes and non-cubic kernels."""
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        kernel = tuple(rng.choice([1, 2, 3, 4, 5]) for _ in range(3))
        size = tuple(rng.randint(1, 9) for _ in range(3))
        problems.append(Problem(
            batch=rng.randint(1, 5), in_channels=rng.randint(1, 7),
            out_channels=rng.randint(1, 20), size=size, kernel=kernel,
            scale=rng.choice([2.0, -1.5, 0.37, 3.0]), **fixed))
    return problems


# Every configuration family once, for the checks every algorithm runs.
SPECIAL = [
    Problem(2, 8, 16, (4, 6, 5), (3, 3, 3)),
    Problem(3, 4, 37, (3, 4, 5), (2, 3, 4)),  # channels not a multiple of the direct kernel's tile
    Problem(3, 4, 5, (3, 4, 5), (1, 1, 1)),  # kernel 1
    Problem(1, 3, 4, (2, 3, 4), (2, 2, 2)),  # batch 1: the statistics are the check
    Problem(2, 3, 4, (5, 2, 3), (3, 1, 2), scale=-0.75),  # negative scale
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=2)),
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(padding=1)),
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=2, output_padding=1)),
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(dilation=(2, 1, 3))),
    Problem(2, 6, 9, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(groups=3)),
    Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), conv_kwargs=dict(
        stride=(1, 2, 3), padding=(1, 0, 2), output_padding=(0, 1, 2), dilation=(2, 1, 1),
        groups=2)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(bias=False)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), bn_kwargs=dict(affine=False)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), eps=1e-3, momentum=0.5),
]
# Training needs more than one value per channel.
TRAIN_PROBLEMS = SPECIAL + [p for p in random_problems(10, seed=2)
                            if p.values_per_channel() > 1]


# Padding-0 problems (the FFT, correlation and cross-spectrum paths' families). On the FFT path,
# problems of at most 8 samples go to the small-problem kernel where its re-reads of the taps
# stay small, the others to the 16-sample kernel with the weight's spectrum; the comments
# on tiles and passes are about the latter.
FFT_PROBLEMS = [
    Problem(2, 8, 16, (4, 6, 5), (3, 3, 3)),
    Problem(3, 4, 37, (3, 4, 5), (2, 3, 4)),  # channels not a multiple of the 32-channel tile
    Problem(1, 3, 4, (2, 3, 4), (2, 2, 2)),  # batch 1
    Problem(3, 4, 5, (3, 4, 5), (1, 1, 1)),  # kernel 1: the spectrum of a single tap
    Problem(19, 11, 70, (5, 7, 6), (3, 2, 4), scale=-0.75),  # > 16 samples: two passes over b
    Problem(2, 5, 9, (30, 3, 4), (3, 2, 2)),  # Ld = 32: 256 threads of the small kernel
    Problem(9, 5, 9, (30, 3, 4), (3, 2, 2)),  # Ld = 32 > 24 depth lanes: two passes over fd
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(dilation=(2, 1, 3))),
    Problem(2, 6, 9, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(groups=3)),
    Problem(2, 12, 66, (3, 4, 6), (2, 2, 3), conv_kwargs=dict(groups=2, bias=False)),
    # > 8 samples: groups and dilation in the 16-sample kernel
    Problem(10, 12, 66, (3, 4, 6), (2, 2, 3), conv_kwargs=dict(groups=2, dilation=(2, 1, 2))),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), bn_kwargs=dict(affine=False)),
    Problem(4, 64, 128, (6, 10, 12), (5, 5, 5)),  # the seed problem's channels
    # x_spectrum_dft.cu's tiles: 256 rows of x per block with 8 and 10 W bins (4 and 5 bins per
    # thread), depth grids of 20 and 40 (radix 4: 5 rows in one pass, 10 in two passes of 8).
    Problem(2, 8, 4, (20, 32, 26), (1, 3, 3)),
    Problem(2, 8, 4, (38, 32, 32), (3, 5, 5)),
    # one depth position and frequency (border's plane problems): plane_dft writes the spectrum
    # itself (no depth_dft), 20 channels in blocks of 8 (the last of 4), groups.
    Problem(3, 20, 12, (1, 9, 12), (1, 3, 3)),
    Problem(2, 12, 6, (1, 32, 26), (1, 2, 3), conv_kwargs=dict(groups=2)),
] + [p for p in random_problems(8, seed=5) if p.batch > 1 or p.size != (1, 1, 1)]

# Strides and output padding: the polyphase split (docs/math.md §3.3.1).
STRIDED_FFT_PROBLEMS = [
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=2)),
    Problem(3, 5, 7, (4, 3, 5), (3, 2, 4), conv_kwargs=dict(stride=(2, 1, 3))),
    Problem(2, 4, 6, (3, 4, 5), (3, 2, 3), conv_kwargs=dict(stride=2, dilation=3)),
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(stride=(3, 2, 2), dilation=(2, 4, 1))),
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=2, output_padding=1)),
    # stride 1 with output padding: one phase, the padded positions outside the grid
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(dilation=2, output_padding=1)),
    # output_padding 2 >= stride 2 (< dilation 3): real outputs beyond every phase's grid
    Problem(2, 3, 5, (3, 4, 5), (1, 2, 2), conv_kwargs=dict(stride=2, dilation=3,
                                                             output_padding=(2, 1, 0))),
    Problem(2, 6, 9, (3, 4, 5), (3, 3, 2), conv_kwargs=dict(stride=2, groups=3)),
    Problem(2, 12, 66, (3, 4, 6), (2, 3, 2),
            conv_kwargs=dict(stride=(1, 2, 2), groups=2, bias=False)),
    Problem(3, 4, 5, (3, 4, 5), (1, 1, 1), conv_kwargs=dict(stride=2)),  # k < s: 7 phases empty
    Problem(2, 4, 6, (3, 4, 5), (1, 2, 3), conv_kwargs=dict(stride=3, output_padding=2)),
    Problem(2, 4, 6, (3, 4, 5), (4, 4, 2), conv_kwargs=dict(stride=2)),  # k divisible by s
    Problem(19, 11, 70, (5, 7, 6), (3, 2, 4), scale=-0.75,
            conv_kwargs=dict(stride=2, dilation=(1, 2, 1))),  # two passes over b
    Problem(2, 5, 9, (30, 3, 4), (3, 2, 2), conv_kwargs=dict(stride=(2, 1, 1))),  # Ld = 31
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(stride=2),
            bn_kwargs=dict(affine=False)),
    Problem(4, 64, 128, (6, 10, 12), (5, 5, 5), conv_kwargs=dict(stride=2)),
] + [p for p in random_problems(6, seed=7, conv_kwargs=dict(stride=(2, 3, 1),
                                                             output_padding=(1, 0, 0)))]

# The correlation and cross-spectrum paths: the padding-0 families above and a few where the
# correlation's lags are few (kernel = stride), and the cross-spectrum kernels' tiles.
CORRELATION_PROBLEMS = FFT_PROBLEMS + STRIDED_FFT_PROBLEMS + [
    Problem(3, 5, 7, (4, 5, 3), (2, 2, 2), conv_kwargs=dict(stride=2)),  # one lag
    Problem(2, 6, 8, (3, 4, 5), (4, 2, 3), conv_kwargs=dict(stride=(2, 2, 3), groups=2)),
    Problem(1, 3, 4, (1, 1, 1), (3, 3, 3), conv_kwargs=dict(stride=2)),  # one input position
    # cross_spectrum's S stage: 40 channels (two 32-wide tiles, the second partial) and 10 W
    # lags from 0 on (two launches of 5); several chunks of depth frequencies; 72 channels
    # (float32: three tiles, float64: five; off-diagonal pairs beyond the first row).
    Problem(2, 40, 24, (3, 4, 5), (2, 2, 10)),
    Problem(2, 72, 6, (3, 4, 5), (3, 3, 3)),
    Problem(1, 64, 8, (40, 20, 20), (3, 3, 3)),
    # its staging: 19 samples (a second chunk of 3) and 33 channels (a second 32-wide tile of
    # one); groups of 20 channels and 10 samples, with strides.
    Problem(19, 33, 5, (3, 4, 5), (3, 2, 3), scale=-1.5),
    Problem(10, 40, 6, (4, 3, 5), (2, 3, 3), conv_kwargs=dict(stride=(1, 2, 1), groups=2)),
    # and its unrolled steps (whole chunks of 16 samples, whole tiles): 32 samples in two
    # chunks and 32 channels, 7 W lags (launches of 5 and 2); 16 samples and 16 channels
    # (float32's 16-wide tile).
    Problem(32, 32, 5, (3, 4, 5), (3, 2, 7)),
    Problem(16, 16, 4, (3, 4, 5), (2, 2, 2), scale=0.5),
    # the lag stage: 13 D lags and 11 H lags (two launches of up to 9 each).
    Problem(2, 5, 6, (3, 4, 5), (7, 6, 2)),
    # x's spectrum: odd D and H on even grids (radix 2 with a missing last odd input), rows of
    # x not whole 16-byte pieces (W = 6), and blocks of 8 channels whose second group has one.
    Problem(20, 9, 6, (7, 7, 6), (2, 2, 3)),
] + random_problems(6, seed=11, conv_kwargs=dict(stride=(1, 2, 2), dilation=(2, 1, 1)))

# --- float64 reference statistics ------------------------------------------------------------

def op_conv_options(conv_kwargs):
    """A Problem's conv_kwargs as ct_bn_pool's keywords (3-lists, groups)."""
    def triple(v):
        return list(v) if isinstance(v, (tuple, list)) else [v] * 3
    return {k: v if k == "groups" else triple(v) for k, v in conv_kwargs.items() if k != "bias"}


def reference_conv(x, weight, options):
    """The convolution output without bias, in float64 on the CPU. `options`: ct_bn_pool's
    conv keywords."""
    options = {k: v for k, v in options.items() if k != "algo"}
    return F.conv_transpose3d(x.detach().double().cpu(), weight.detach().double().cpu(),
                              **options)


def reference_stats(y):
    """(count, mean [C], biased variance [C], sample means [B, C]) of y in float64."""
    var, mean = torch.var_mean(y, dim=(0, 2, 3, 4), correction=0)
    return y.numel() // y.shape[1], mean, var, y.mean((2, 3, 4))


def moment_ratio(y):
    """min over channels of E[y^2] / Var(y): how much a naive E[y^2] - E[y]^2 would cancel."""
    var = y.var(dim=(0, 2, 3, 4), correction=0)
    return ((y * y).mean((0, 2, 3, 4)) / var).min().item()


def assert_stats_match(x, weight, options, algo, tol):
    """ct_bn_pool_stats(x, weight) with `algo` against float64: the count exactly, each
    channel's variance within `tol` of itself, its mean and the sample means within `tol` of
    its standard deviation. Returns the float64 convolution output."""
    options = {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}
    sample_sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(x, weight, algo=algo, **options)
    y = reference_conv(x, weight, options)
    count, mean, var, sample_means = reference_stats(y)
    stats, sample_sums = stats.cpu(), sample_sums.cpu()
    assert stats.dtype == sample_sums.dtype == torch.float64
    assert torch.equal(stats[0], torch.full_like(mean, count)), (stats[0], count)
    std = var.sqrt()
    var_err = ((stats[2] / stats[0] - var).abs() / var).max().item()
    assert var_err <= tol, f"variance off by {var_err:.2e} (tolerance {tol:.0e}, algo {algo})"
    mean_err = ((stats[1] - mean).abs() / std).max().item()
    assert mean_err <= tol, f"mean off by {mean_err:.2e} of the spread (algo {algo})"
    positions = count // y.shape[0]
    sums_err = ((sample_sums / positions - sample_means).abs() / std).max().item()
    assert sums_err <= tol, f"sample sums off by {sums_err:.2e} of the spread (algo {algo})"
    return y


def border_amplification(x, weight, options):
    """How much algo='border' amplifies its terms' rounding (docs/math.md §3.6): per channel,
    the full padding-0 grid's within-sample energy over the crop's centred energy (the
    output's), the largest over the channels, in float64. Without an offset of x it is about
    1 / (the share of the grid the crop keeps); a common offset of x grows it with the square
    of the offset over x's spread, since the planes the padding cuts hold partial sums."""
    options = dict(options)
    padding = options.pop("padding", [0, 0, 0])
    output_padding = options.pop("output_padding", [0, 0, 0])
    full = reference_conv(x, weight, dict(
        options, output_padding=[max(op - p, 0) for op, p in zip(output_padding, padding)]))
    crop = reference_conv(x, weight, dict(options, padding=padding, output_padding=output_padding))
    within = (full - full.mean((2, 3, 4), keepdim=True)).square().sum((0, 2, 3, 4))
    centred = (crop - crop.mean((0, 2, 3, 4), keepdim=True)).square().sum((0, 2, 3, 4))
    return (within / centred).max().item()


def default_stats_tol(algo, x, weight, options):
    """STATS_TOL of x's dtype, and for algo='border' its bound (docs/math.md §3.6): twice the
    unit roundoff of its computing dtype times border_amplification."""
    tol = STATS_TOL[x.dtype]
    if algo == "border":
        unit = UNIT[torch.float64 if x.dtype == torch.float64 else torch.float32]
        tol += 2 * unit * border_amplification(x, weight, options)
    return tol


def module_conv_options(fused):
    """The fused module's conv options as ct_bn_pool_stats takes them (3-lists, groups)."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in conv_transpose_options(fused.conv_transpose).items()}


def assert_train_steps_match(ref, fused, next_input, tolerance, steps=3, stats_tol=None):
    """`steps` training calls of `fused` on next_input()'s tensors against its float64
    reference `ref` (on the CPU): each output within relative error `tolerance` (one
    sample: exactly beta, and nothing else to compare), each step's batch statistics
    (ct_bn_pool_stats with the module's algo) within `stats_tol` (default_stats_tol by
    default), then the running statistics within `tolerance` and the batch count."""
    ref.train()
    fused.train()
    bn = fused.batch_norm
    for _ in range(steps):
        x = next_input()
        with torch.no_grad():
            out = fused(x)
            expected = ref(x.double().cpu())
        assert out.shape == expected.shape and out.dtype == x.dtype and out.device == x.device
        if x.shape[0] == 1:
            # One sample: its mean is the batch mean, so the output is beta whatever the
            # statistics are. They are checked below.
            beta = torch.zeros(bn.num_features) if bn.bias is None else bn.bias.detach().cpu()
            assert torch.allclose(out.double().cpu().flatten(1), beta.double().expand(1, -1),
                                  rtol=0, atol=tolerance), out
        else:
            assert relerr(out, expected) <= tolerance
        weight, options = fused.conv_transpose.weight.detach(), module_conv_options(fused)
        assert_stats_match(x, weight, options, fused.algo, default_stats_tol(
            fused.algo, x, weight, options) if stats_tol is None else stats_tol)
    rbn = ref.batch_norm
    if rbn.track_running_stats:
        for name in ("running_mean", "running_var"):
            assert relerr(getattr(bn, name), getattr(rbn, name)) <= tolerance, name
        assert int(bn.num_batches_tracked) == int(rbn.num_batches_tracked)


def check_training(problem, dtype, device, algo, steps=3, offset=0.0, tolerance=None,
                   stats_tol=None):
    """`problem` in training with `algo` against float64 over `steps` steps (see
    assert_train_steps_match; tolerances TOL and STATS_TOL of dtype by default)."""
    skip_unless_algo_covers(problem, algo, device, dtype)
    ref, fused = make_models(problem, dtype, device, algo=algo)
    assert_train_steps_match(ref, fused, lambda: make_input(problem, dtype, device, offset),
                             TOL[dtype] if tolerance is None else tolerance, steps, stats_tol)


def assert_gradients_match(got: dict, want: dict, tolerance: float):
    """Each gradient in `got` within `tolerance` relative error of the one in `want`.

    A gradient that is zero in exact arithmetic (the conv bias's in training mode: the batch
    mean removes the bias) is rounding noise in the reference, so one that is tiny next to
    the largest gradient is compared in absolute terms, against that largest gradient.
    """
    largest = max(g.detach().double().cpu().norm().item() for g in want.values())
    for name, value in want.items():
        assert got[name] is not None, name
        if value.detach().double().cpu().norm().item() <= tolerance * largest:
            assert got[name].detach().double().cpu().norm().item() <= tolerance * largest, name
        else:
            assert relerr(got[name], value) <= tolerance, name


def twin_modules(p: Problem, dtype, device, training):
    """Two fused modules with the same parameters and buffers, both in mode `training`."""
    _, a = make_models(p, dtype, device)
    _, b = make_models(p, dtype, device)
    b.load_state_dict(a.state_dict())
    return a.train(training), b.train(training)


# --- CUDA helpers ----------------------------------------------------------------------------

def cuda_train_step_kernels(problem: Problem, algo: str, dtype=torch.float32):
    """One training step of `problem` in `dtype` on CUDA with `algo`, checked against float64
    (output, statistics and running statistics); the names of the kernels it ran."""
    return cuda_train_step(problem, *make_models(problem, dtype, "cuda", algo=algo))


def cuda_train_step(problem: Problem, ref, fused, x=None):
    """cuda_train_step_kernels's step with the given models (ref: fused's float64 reference)
    and input (default: make_input's)."""
    from torch.profiler import ProfilerActivity, profile
    dtype = fused.conv_transpose.weight.dtype
    if x is None:
        x = make_input(problem, dtype, "cuda")
    ref.train()
    fused.train()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    with torch.no_grad():
        expected = ref(x.double().cpu())
    if x.shape[0] == 1:  # the output is beta (0): the statistics are the check
        assert out.abs().max().item() <= TOL[dtype]
    else:
        assert relerr(out, expected) <= TOL[dtype]
    weight, options = fused.conv_transpose.weight.detach(), module_conv_options(fused)
    assert_stats_match(x, weight, options, fused.algo, default_stats_tol(fused.algo, x, weight,
                                                                         options))
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= TOL[dtype]
    return [e.name for e in prof.events()]


def assert_no_host_sync(fused, x):
    """A second call of fused(x) (the first makes cuFFT plans, cuBLAS handles, allocations)
    never waits for the GPU: torch.cuda's sync debug mode raises if it does."""
    with torch.no_grad():
        fused(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fused(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(autouse=True)
def _seed(request):
    """Each test draws the same values on every run (a failure reproduces), other tests
    other values."""
    torch.manual_seed(sum(map(ord, request.node.nodeid)) * 7919 % (2 ** 31))


# One small problem per ConvTranspose3d / BatchNorm3d option, and one with all of them: the
# families the compile, export, CUDA graph and opcheck suites run.
_FAMILY_BASE = dict(batch=2, in_channels=4, out_channels=6, size=(3, 4, 5), kernel=(2, 3, 2))
FAMILIES = {
    "plain": Problem(**_FAMILY_BASE),
    "stride": Problem(**_FAMILY_BASE, conv_kwargs=dict(stride=(2, 1, 3))),
    "padding": Problem(**_FAMILY_BASE, conv_kwargs=dict(padding=(1, 0, 1))),
    "output_padding": Problem(**_FAMILY_BASE, conv_kwargs=dict(stride=2, output_padding=(1, 0, 1))),
    "dilation": Problem(**_FAMILY_BASE, conv_kwargs=dict(dilation=(2, 1, 3))),
    "groups": Problem(**_FAMILY_BASE, conv_kwargs=dict(groups=2)),
    "no_bias": Problem(**_FAMILY_BASE, conv_kwargs=dict(bias=False)),
    "no_affine": Problem(**_FAMILY_BASE, bn_kwargs=dict(affine=False)),
    "untracked": Problem(**_FAMILY_BASE, bn_kwargs=dict(track_running_stats=False)),
    "momentum_none": Problem(**_FAMILY_BASE, momentum=None),
    "momentum_0": Problem(**_FAMILY_BASE, momentum=0.0),
    "everything": Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), scale=-0.75, eps=1e-3, momentum=0.3,
                          conv_kwargs=dict(stride=(1, 2, 3), padding=(1, 0, 2),
                                           output_padding=(0, 1, 2), dilation=(2, 1, 1),
                                           groups=2, bias=False),
                          bn_kwargs=dict(affine=False)),
}


def assert_refused_unchanged(problem, device, algo, match):
    """A forced `algo` where it does not apply: a ValueError matching `match` from the module,
    and nothing changed (running statistics, batch count)."""
    _, fused = make_models(problem, torch.float32, device, algo=algo)
    before = fused.batch_norm.running_var.clone()
    with pytest.raises(ValueError, match=match):
        fused(make_input(problem, torch.float32, device))
    assert torch.equal(fused.batch_norm.running_var, before)
    assert int(fused.batch_norm.num_batches_tracked) == 0


def run_backward(module, x, grad_out):
    """(module(x), {"x": its gradient, parameter name: its gradient}) for grad_out."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad_out)
    # A compiled module's names start with _orig_mod.
    return out.detach(), {"x": x.grad, **{name.removeprefix("_orig_mod."): p.grad
                                          for name, p in module.named_parameters()}}
