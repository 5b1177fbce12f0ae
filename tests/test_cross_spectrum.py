"""algo='cross_spectrum' (docs/math.md §3.5): the phases' lags from x's per-frequency channel
cross-spectrum, contracted with the weight on a grid of 2k - 1 per dim, on any device and
dtype. Forced on every padding-0 configuration against PyTorch's modules in float64 (output
and statistics over three steps); its geometry tables built once (in a process of its own); refused where padding > 0;
on CUDA, which of its kernels runs (S stage, contraction, tap spectrum, lag stages, x's
spectrum), each against float64."""
import pathlib
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fused_ops
import fused_ops.testing
from conftest import (CORRELATION_PROBLEMS, DEVICES, KERNELS, Problem, TOL, assert_no_host_sync,
                      assert_refused_unchanged, assert_train_steps_match, check_training,
                      cuda_train_step, cuda_train_step_kernels, make_input, make_models,
                      problem_params, relerr)

ALGO = "cross_spectrum"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem", problem_params(CORRELATION_PROBLEMS))
def test_matches_reference_over_steps(problem, device, dtype):
    if problem.values_per_channel() == 1:
        pytest.skip("one value per channel: training is refused (tests/test_errors.py)")
    check_training(problem, dtype, device, ALGO)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv_kwargs", [dict(padding=1), dict(stride=2, padding=(0, 1, 0))],
                         ids=str)
def test_refuses_padding(device, conv_kwargs):
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=conv_kwargs)
    assert_refused_unchanged(p, device, ALGO, f"algo='{ALGO}' needs padding 0")


def build_tables_twice(device):
    """Two calls of the same sizes with other samples, batch and channels: the first builds the
    geometry's tables (aten::polar makes the phases), the second none, both right."""
    first, second = (Problem(batch, ci, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(stride=(1, 2, 1)))
                     for batch, ci in ((2, 5), (3, 7)))
    for p, expect_polar in ((first, True), (second, False)):
        ref, fused = make_models(p, torch.float32, device, algo=ALGO)
        ref.train()
        fused.train()
        x = make_input(p, torch.float32, device)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fused(x)
        assert any(e.name == "aten::polar" for e in prof.events()) == expect_polar
        with torch.no_grad():
            assert relerr(out, ref(x.double().cpu())) <= TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_builds_its_tables_once_per_geometry(device):
    """The lag phases and tap slots depend on the geometry alone (a cache): build_tables_twice,
    in a process of its own: the cache keeps 64 geometries (csrc/common/table_cache.h) and past
    them a call builds its own, so a suite that filled it would see every call build."""
    code = f"import test_cross_spectrum as t; t.build_tables_twice({device!r})"
    subprocess.run([sys.executable, "-c", code], cwd=pathlib.Path(__file__).parent, check=True)


@pytest.mark.cuda
@pytest.mark.parametrize("batch, d_stages, chunks", [(8, 1, 2), (1, 6, 6)], ids=["kept", "per-chunk"])
def test_keeps_the_w_stage_output_where_x_spectrum_is_larger(batch, d_stages, chunks):
    """Over 42 depth frequencies in chunks, the W stage's output (20.6 MB of complex64 here,
    whatever the batch) is kept for one D stage where x's spectrum is at least as large
    (batch 8: 45 MB, 2 chunks), else the D stage runs per chunk (batch 1: 5.7 MB, 6 chunks of
    at most 8 MiB of Q). Both against float64."""
    names = cuda_train_step_kernels(Problem(batch, 64, 8, (40, 20, 20), (3, 3, 3)), ALGO)
    # the D stage is the lag stage that stores float64 sums (the W stage stores x's dtype)
    lag = KERNELS["lag_stage"]
    assert sum(f"{lag}<float2, double2" in n for n in names) == d_stages
    assert sum(f"{lag}<float2, float2" in n for n in names) == chunks


# The S stage's cases (tests above): tiles past the channels, lag launches of 5 and 2,
# chunks of samples with a partial one, groups, strides; and for the tensor cores' S stage a
# partial chunk of samples with an even group (34 channels: a block whose columns end at
# 34 of its 48).
S_STAGE_PROBLEMS = [p for p in CORRELATION_PROBLEMS if p.in_channels >= 16 or p.batch >= 10] + [
    Problem(19, 34, 5, (3, 4, 5), (3, 2, 3), scale=-1.5),
    # its paired blocks (BlockPlan, tests/index_models/w_stage_plan.py): 48 channels (one pair
    # of row blocks, 0 and 2) and 128 (two pairs, 1 and 3, 5 and 7).
    Problem(3, 48, 5, (3, 4, 5), (2, 3, 3)),
    Problem(2, 128, 4, (3, 3, 4), (2, 2, 3)),
    # and its stores (16 bytes per two entries of a row, the diagonal's i = j + 1 alone): groups
    # of 2 channels (one partial tile; 2 h lags: the 2-lag kernel) and 6, and 10 channels (a
    # pair of row blocks with one idle side).
    Problem(2, 12, 6, (3, 4, 5), (2, 2, 3), conv_kwargs=dict(groups=6)),
    Problem(3, 12, 4, (3, 4, 5), (3, 2, 3), scale=-1.5, conv_kwargs=dict(groups=2)),
    Problem(3, 10, 5, (3, 4, 5), (2, 3, 3))]


@pytest.mark.cuda
@pytest.mark.parametrize("s_stage", ["auto", "simt"])
@pytest.mark.parametrize("problem", S_STAGE_PROBLEMS, ids=Problem.ids)
def test_s_stage_kernels(problem, s_stage):
    """The float64 tensor cores' S stage on sm_90 and later where the groups have an even
    number of channels, else the SIMT kernel; route(s_stage="simt") takes the latter
    everywhere. Both against float64, and the kernel that ran is the one named."""
    with fused_ops.testing.route(s_stage=s_stage):
        names = cuda_train_step_kernels(problem, ALGO)
    group_channels = problem.in_channels // problem.conv_kwargs.get("groups", 1)
    mma = (s_stage == "auto" and torch.cuda.get_device_capability()[0] >= 9
           and group_channels % 2 == 0)
    assert any(KERNELS["s_stage_mma"] in n for n in names) == mma
    assert any(KERNELS["s_stage"] in n for n in names) == (not mma)


# The contraction's cases (R = 2 Cig rows, C columns per group and call): R = C = 128 (the seed
# problem's two row and two column tiles); R = 10 (one partial row tile, one chunk) with C = 37
# (odd: W copied 8 bytes at a time); R = 72 (a second row tile of 8 rows, a chunk past R) with
# C = 200 (a last column tile of 8); groups of 3, with R = 72 and C = 20, and R = 10 and C = 7;
# 48 output channels in calls of 20, 20 and 8 columns (8 MiB of spectra per chunk); two phases
# (C = P n).
CONTRACTION_PROBLEMS = [
    Problem(2, 64, 128, (3, 4, 5), (2, 2, 3)),
    Problem(2, 5, 37, (3, 4, 5), (2, 3, 2)),
    Problem(2, 36, 200, (3, 4, 5), (2, 2, 2)),
    Problem(2, 108, 60, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(groups=3)),
    Problem(2, 15, 21, (3, 4, 5), (2, 3, 2), scale=-1.5, conv_kwargs=dict(groups=3)),
    Problem(2, 64, 48, (2, 3, 3), (5, 5, 5)),
    Problem(2, 4, 12, (3, 4, 5), (3, 5, 3), conv_kwargs=dict(stride=(1, 2, 1), groups=2))]


@pytest.mark.cuda
@pytest.mark.parametrize("contraction", ["auto", "gemm"])
@pytest.mark.parametrize("problem", CONTRACTION_PROBLEMS, ids=Problem.ids)
def test_contraction_kernels(problem, contraction):
    """The fused contraction (float64 tensor cores) on sm_90 and later, else cuBLAS's product
    and the quad-form kernel; route(contraction="gemm") takes the latter everywhere. Both
    against float64, and the kernel that ran is the one named."""
    with fused_ops.testing.route(contraction=contraction):
        names = cuda_train_step_kernels(problem, ALGO)
    fused = contraction == "auto" and torch.cuda.get_device_capability()[0] >= 9
    assert any(KERNELS["quad_form_mma"] in n for n in names) == fused
    assert any(KERNELS["quad_form"] in n for n in names) == (not fused)


@pytest.mark.cuda
@pytest.mark.parametrize("problem, kernel", [
    (Problem(3, 6, 5, (3, 4, 5), (2, 3, 4)), True),
    (Problem(2, 4, 12, (3, 4, 5), (3, 5, 3), conv_kwargs=dict(stride=(1, 2, 1), groups=2)), True),
    (Problem(3, 6, 10, (4, 4, 3), (2, 3, 8)), True),   # k'w = 8: the kernel's largest
    (Problem(2, 5, 6, (3, 4, 5), (2, 2, 10)), False),  # k'w = 10: ATen's GEMMs
    (Problem(2, 3, 4, (2, 8, 8), (1, 7, 7)), False),   # k'h k'w = 49: past its shared memory
], ids=["k2x3x4", "groups-strided", "kw8", "kw10", "k7x7"])
def test_tap_spectrum_kernel(problem, kernel):
    """The tap-spectrum kernel takes the sub-kernels' spectra where k'w <= 8 and a block's
    planes fit 48 KiB of shared memory (k'h k'w < 48), else ATen's GEMMs one dim at a time.
    Both against float64: the kernel forms half the depth bins and mirrors the rest, so k'd of
    1 to 3 and groups are among the cases (the reference tests above run it on every shape
    they cover with k'w <= 8)."""
    names = cuda_train_step_kernels(problem, ALGO)
    assert any(KERNELS["tap_spectrum"] in n for n in names) == kernel


TAP_SOURCES = ["StackTaps", "WeightTaps<float>", "WeightTaps<double>"]


def tap_spectrum_sources(names):
    """Where the tap-spectrum launches among the kernels named read the taps (their Taps type)."""
    return {source for n in names if KERNELS["tap_spectrum"] + "<" in n
            for source in TAP_SOURCES if source in n}


@pytest.mark.cuda
@pytest.mark.parametrize("problem, dtype, source", [
    (Problem(3, 6, 5, (3, 4, 5), (2, 3, 4)), torch.float32, "WeightTaps<float>"),
    (Problem(3, 6, 5, (3, 4, 5), (2, 3, 4)), torch.float64, "WeightTaps<double>"),
    # 144 columns: tiles of 32, the last of 16, across the weight's rows of 12
    (Problem(2, 12, 36, (3, 4, 5), (3, 5, 3), conv_kwargs=dict(groups=3)), torch.float32, "WeightTaps<float>"),
    # 48 output channels in chunks of 20, 20 and 8 (8 MiB of spectra per chunk)
    (Problem(2, 64, 48, (2, 3, 3), (5, 5, 5)), torch.float32, "WeightTaps<float>"),
    # dilation and output padding: one phase, not the full convolution
    (Problem(2, 4, 6, (3, 4, 5), (2, 3, 3), conv_kwargs=dict(dilation=2, output_padding=(1, 0, 1))),
     torch.float32, "WeightTaps<float>"),
    # phases: the float64 stack's gather
    (Problem(2, 4, 12, (3, 4, 5), (3, 5, 3), conv_kwargs=dict(stride=(1, 2, 1), groups=2)), torch.float32,
     "StackTaps"),
    # 200 k'd x 8 k'w float64 taps: 0.4 MB of shared memory per block of 32 columns, past any GPU's
    (Problem(2, 2, 3, (1, 1, 2), (200, 1, 8)), torch.float64, "StackTaps"),
    # 27 taps (odd) of 64 output channels: each tile of 32 columns one run of the weight,
    # staged by the whole block; 40 in float64: a second tile of 8, one run too
    (Problem(2, 3, 64, (3, 4, 5), (3, 3, 3)), torch.float32, "WeightTaps<float>"),
    (Problem(2, 1, 40, (3, 4, 5), (3, 3, 3)), torch.float64, "WeightTaps<double>"),
    # k'h = 10: pairs of h bins and plane rows past the block's 8 warps (warps 0 and 1 take two)
    (Problem(2, 3, 4, (3, 12, 4), (2, 10, 2)), torch.float32, "WeightTaps<float>"),
], ids=["seed-like", "float64", "groups", "chunks", "dilated", "phases", "staging-too-large", "one-run",
        "one-run-partial", "pairs-past-warps"])
def test_tap_spectrum_reads_the_weight(problem, dtype, source):
    """With one phase the tap-spectrum kernel reads the taps from the weight itself in its
    dtype (WeightTaps: each warp's columns staged in shared memory), also per chunk of output
    channels; with phases, or where the staging does not fit a block's shared memory, from the
    float64 stack (StackTaps). Both against float64."""
    assert tap_spectrum_sources(cuda_train_step_kernels(problem, ALGO, dtype)) == {source}


@pytest.mark.cuda
def test_tap_spectrum_reads_a_strided_weight():
    """A weight whose channels are strided in memory (Ci and Co swapped) reaches the path
    contiguous (the op's copy in the energy's dtype), so it is read in place too."""
    problem = Problem(3, 6, 5, (3, 4, 5), (2, 3, 4))
    ref, fused = make_models(problem, torch.float32, "cuda", algo=ALGO)
    weight = fused.conv_transpose.weight
    with torch.no_grad():
        fused.conv_transpose.weight = torch.nn.Parameter(weight.transpose(0, 1).contiguous().transpose(0, 1))
    assert not fused.conv_transpose.weight.is_contiguous()
    names = cuda_train_step(problem, ref, fused)
    assert tap_spectrum_sources(names) == {"WeightTaps<float>"}


@pytest.mark.cuda
def test_no_host_sync_on_cuda():
    """Every table (phases, lags, sub-kernels) is built on the device: nothing waits."""
    p = Problem(3, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=(2, 1, 3)))
    _, fused = make_models(p, torch.float32, "cuda", algo=ALGO)
    assert_no_host_sync(fused, make_input(p, torch.float32, "cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("algo", ["cross_spectrum", "fft", "correlation"])
@pytest.mark.parametrize("problem, from_spectrum", [
    (Problem(2, 16, 4, (17, 128, 128), (1, 2, 2), scale=-1.5), True),  # 35.7 MB of x
    (Problem(2, 16, 4, (17, 128, 128), (2, 2, 2), conv_kwargs=dict(stride=2, groups=2)), True),
    (Problem(3, 10, 6, (5, 9, 12), (3, 2, 3)), False),  # 130 KB
    (Problem(3, 10, 6, (1, 9, 12), (1, 2, 3)), True),  # one depth position: no sum over D to add
], ids=lambda v: Problem.ids(v) if isinstance(v, Problem) else str(v))
def test_training_takes_large_x_sums_from_the_spectrum_pass(problem, from_spectrum, algo):
    """From 32 MiB of x the spectral paths take x's sums (the means, docs/math.md §2) from
    their pass over x for its spectrum (the planes' sums, added over D by the D DFT's launch),
    not from a pass of their own (the spatial-sum kernel); below it, and on the correlation
    path, which forms no spectrum, that pass stays; with one depth position at any size.
    Checked against float64: output, statistics and running statistics."""
    names = cuda_train_step_kernels(problem, algo)
    spectral = algo != "correlation"
    assert any(KERNELS["spatial_sum"] in name for name in names) == (not (spectral and from_spectrum))


@pytest.mark.cuda
@pytest.mark.parametrize("algo, dtype", [("cross_spectrum", torch.float32), ("cross_spectrum", torch.float64),
                                         ("fft", torch.float32)], ids=str)
def test_one_depth_position_skips_the_depth_stages(algo, dtype):
    """With one depth position and frequency (border's plane problems, docs/math.md §3.6): the
    plane DFT writes x's spectrum itself (no depth DFT), and on the cross-spectrum path the W
    stage's coefficients carry the D stage's 1 / |L|, so that one lag stage writes Z^ in
    float64. Checked against float64: output, statistics and running statistics."""
    names = cuda_train_step_kernels(Problem(3, 20, 12, (1, 9, 12), (1, 3, 3)), algo, dtype)
    assert any(KERNELS["plane_dft"] in n for n in names)
    assert not any(KERNELS["depth_dft"] in n for n in names)
    if algo == "cross_spectrum":
        complex_t = "float2" if dtype == torch.float32 else "double2"
        lag = KERNELS["lag_stage"]
        assert sum(lag in n for n in names) == 1
        assert sum(f"{lag}<{complex_t}, double2" in n for n in names) == 1


@pytest.mark.cuda
def test_one_depth_position_in_slices_of_a_channels_last_x():
    """x of another layout is copied a slice of the batch at a time (48 MiB of spectrum: 23 of
    these samples); with one depth position the plane DFT writes each slice's samples, and
    their sums, at their own place in the spectrum: 30 samples, slices of 23 and 7. Against
    float64: output, statistics and running statistics."""
    p = Problem(30, 8, 4, (1, 256, 256), (1, 3, 3), scale=-1.5)
    ref, fused = make_models(p, torch.float32, "cuda", algo=ALGO)
    x = make_input(p, torch.float32, "cuda").to(memory_format=torch.channels_last_3d)
    assert_train_steps_match(ref, fused, lambda: x, TOL[torch.float32], steps=1)
