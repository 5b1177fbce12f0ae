"""The fused op against the unfused PyTorch modules, run in float64."""
import math

import pytest
import torch

from conftest import (DEVICES, Problem, make_input, make_models, random_problems, relerr,
                      skip_unless_algo_covers)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-6}
DTYPES = [torch.float64, torch.float32]

SPECIAL = [
    Problem(2, 8, 16, (4, 6, 5), (3, 3, 3)),
    Problem(3, 4, 37, (3, 4, 5), (2, 3, 4)),  # channels not a multiple of the direct kernel's tile
    Problem(3, 4, 5, (3, 4, 5), (1, 1, 1)),  # kernel 1
    Problem(1, 3, 4, (2, 3, 4), (2, 2, 2)),  # batch 1
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
EVAL_PROBLEMS = SPECIAL + random_problems(10, seed=1)
# Training needs more than one value per channel.
TRAIN_PROBLEMS = SPECIAL + [
    p for p in random_problems(10, seed=2)
    if p.batch * math.prod(s + k - 1 for s, k in zip(p.size, p.kernel)) > 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", EVAL_PROBLEMS, ids=Problem.ids)
def test_eval_matches_reference(problem, dtype, device):
    ref, fused = make_models(problem, dtype, device)
    ref.eval()
    fused.eval()
    x = make_input(problem, dtype, device)
    with torch.no_grad():
        out = fused(x)
        expected = ref(x.double().cpu())
    assert out.shape == expected.shape and out.dtype == dtype and out.device == x.device
    assert relerr(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["auto", "direct", "sliced_conv", "correlation", "cross_spectrum",
                                  "border"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", TRAIN_PROBLEMS, ids=Problem.ids)
def test_train_matches_reference_over_steps(problem, dtype, algo, device):
    skip_unless_algo_covers(problem, algo)
    ref, fused = make_models(problem, dtype, device, algo=algo)
    ref.train()
    fused.train()
    tol = TOLERANCE[dtype]
    for _ in range(3):
        x = make_input(problem, dtype, device)
        with torch.no_grad():
            out = fused(x)
            expected = ref(x.double().cpu())
        assert out.shape == expected.shape and out.dtype == dtype
        assert relerr(out, expected) <= tol
    fbn, rbn = fused.batch_norm, ref.batch_norm
    if rbn.track_running_stats:
        assert relerr(fbn.running_mean, rbn.running_mean) <= tol
        assert relerr(fbn.running_var, rbn.running_var) <= tol
        assert int(fbn.num_batches_tracked) == int(rbn.num_batches_tracked) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_momentum_none_is_cumulative_average(device):
    p = Problem(3, 4, 6, (3, 4, 5), (2, 3, 2), momentum=None)
    ref, fused = make_models(p, torch.float64, device)
    for mode in ["train", "train", "eval", "train"]:
        ref.train(mode == "train")
        fused.train(mode == "train")
        x = make_input(p, torch.float64, device)
        with torch.no_grad():
            assert relerr(fused(x), ref(x.cpu())) <= 1e-10
    assert relerr(fused.batch_norm.running_mean, ref.batch_norm.running_mean) <= 1e-10
    assert relerr(fused.batch_norm.running_var, ref.batch_norm.running_var) <= 1e-10
    assert int(fused.batch_norm.num_batches_tracked) == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False])
def test_untracked_running_stats_use_batch_stats(training, device):
    p = Problem(3, 4, 6, (3, 4, 5), (2, 3, 2), bn_kwargs=dict(track_running_stats=False))
    ref, fused = make_models(p, torch.float64, device)
    ref.train(training)
    fused.train(training)
    x = make_input(p, torch.float64, device)
    with torch.no_grad():
        assert relerr(fused(x), ref(x.cpu())) <= 1e-10
    assert fused.batch_norm.running_mean is None


@pytest.mark.parametrize("device", DEVICES)
def test_large_channel_mean_is_not_cancelled(device):
    """Inputs with a large common offset: the variance must not cancel."""
    p = Problem(4, 5, 6, (4, 5, 6), (3, 3, 3))
    ref, fused = make_models(p, torch.float32, device)
    x = make_input(p, torch.float32, device) + 50.0
    with torch.no_grad():
        assert relerr(fused(x), ref(x.double().cpu())) <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("problem, staged", [
    # the bench's `odd` problem with a stride along W (at stride 1 ct_stats_stride1.cu takes
    # it): x and the tile's weights copied to shared memory first (float64: past the
    # default 48 KiB limit)
    (Problem(3, 5, 7, (9, 11, 13), (2, 3, 4), conv_kwargs=dict(stride=(1, 1, 2))), True),
    # 256 KiB of x per sample
    (Problem(2, 16, 20, (16, 16, 16), (3, 3, 3), conv_kwargs=dict(dilation=(1, 2, 1))), False),
    # 27 input channels over 16 sets of threads (1 or 2 each), and in float32 the 9 (kd, kh)
    # pairs over 2 (on an H200's 132 SMs), two tiles of output channels
    # (the second partial), rows of an odd length (the last pair of positions half outside)
    (Problem(3, 27, 20, (5, 6, 7), (3, 3, 3), conv_kwargs=dict(dilation=(1, 2, 1))), True),
], ids=["shared", "global", "input-split"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_direct_kernel_stages_what_fits(problem, staged, dtype):
    """csrc/cuda/ct_stats.cu (a stride or dilation above 1) reads x from shared memory where a
    sample's x and a tile's weights fit there, from global memory elsewhere, and splits a
    group's input channels over sets of threads; each against float64."""
    ref, fused = make_models(problem, dtype, "cuda", algo="direct")
    ref.train()
    fused.train()
    x = make_input(problem, dtype, "cuda")
    with torch.no_grad(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    kernel = "energy_direct_kernel<%s, %s>" % ("float" if dtype == torch.float32 else "double",
                                                str(staged).lower())
    assert any(kernel in e.name for e in prof.events())
    with torch.no_grad():
        assert relerr(out, ref(x.double().cpu())) <= TOLERANCE[dtype]
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= TOLERANCE[dtype]


STRIDE1_KERNEL = "energy_direct_stride1_kernel"
MMA_KERNEL = "direct_stats_mma_kernel"
STRIDE1_PROBLEMS = [
    # t8pad1's shape, smaller: one channel chunk; 3 units of work, so tiles of one output row
    # (the tensor cores' kernel: 6 tiles of one 7-row plane); x offset from zero, where sample
    # sums from y would show any loss
    (Problem(3, 12, 16, (6, 7, 8), (3, 3, 3), conv_kwargs=dict(padding=1)), STRIDE1_KERNEL, 3.0),
    # 40 input channels of 125 taps: the staged chunks are several (at most 96 KiB each; the
    # tensor cores' kernel: one group of 8 channels per stage, in float64 past its 100 KiB, so
    # one block per SM); 20 output channels: a second, partial tile; padding above the kernel's
    # reach along D (the output smaller than x) and none along W
    (Problem(2, 40, 20, (9, 9, 11), (5, 5, 5), conv_kwargs=dict(padding=(5, 2, 0))), STRIDE1_KERNEL, 0.0),
    # groups, an odd output width (the last thread's second position outside), a tile of
    # rows that does not divide the output's height
    (Problem(3, 6, 9, (4, 13, 7), (2, 3, 2), conv_kwargs=dict(groups=3, padding=(0, 1, 1))), STRIDE1_KERNEL, 0.0),
    # rows too long for a block's threads (600 float64 positions): ct_stats.cu's kernel (the
    # tensor cores' kernel: tiles of part of a row)
    (Problem(2, 2, 3, (1, 2, 598), (1, 2, 3)), "energy_direct_kernel", 0.0),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("problem, simt_kernel, offset", STRIDE1_PROBLEMS,
                         ids=["one-chunk", "chunks", "groups", "long-rows"])
@pytest.mark.parametrize("route", ["mma", "simt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stride1_direct_kernel(problem, simt_kernel, offset, route, dtype, monkeypatch):
    """At stride and dilation 1 FUSED_OPS_DIRECT picks the kernel that `auto` picks by padding:
    `mma` csrc/cuda/ct_stats_mma.cu (float64 tensor cores, sm_90: every product and sum in
    float64, the sample sums from y), `simt` csrc/cuda/ct_stats_stride1.cu (each tile's box of x
    staged with its halo); each against float64: output and running statistics over three
    steps."""
    if route == "mma" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("float64 tensor cores of sm_90")
    monkeypatch.setenv("FUSED_OPS_DIRECT", route)
    kernel = MMA_KERNEL if route == "mma" else simt_kernel
    if kernel == "energy_direct_kernel" and dtype == torch.float32:
        problem = Problem(2, 2, 3, (1, 2, 1100), (1, 2, 3))  # 1102 float32 positions
    ref, fused = make_models(problem, dtype, "cuda", algo="direct")
    ref.train()
    fused.train()
    for step in range(3):
        x = make_input(problem, dtype, "cuda") + offset
        with torch.no_grad(), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = fused(x)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
        assert any(kernel in n for n in names)
        assert (kernel == STRIDE1_KERNEL) == any(STRIDE1_KERNEL in n for n in names)
        with torch.no_grad():
            assert relerr(out, ref(x.double().cpu())) <= TOLERANCE[dtype]
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= TOLERANCE[dtype]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("problem, layout, kernel", [
    (Problem(2, 5, 6, (4, 6, 7), (3, 2, 3), conv_kwargs=dict(padding=(1, 1, 2))),
     torch.contiguous_format, True),
    # read in place through its strides
    (Problem(2, 5, 6, (4, 6, 7), (3, 2, 3), conv_kwargs=dict(stride=2, padding=(1, 0, 2), output_padding=1)),
     torch.channels_last_3d, True),
    # one plane of x (120 x 120 positions) past the kernel's 48 KiB: box_sums.cpp's einsums
    (Problem(1, 2, 3, (2, 120, 120), (1, 3, 3), conv_kwargs=dict(padding=(0, 1, 1))), torch.contiguous_format,
     False),
], ids=["contiguous", "channels-last-strided", "large-plane"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_box_sums_kernel(problem, layout, kernel, dtype):
    """csrc/cuda/box_sums.cu's sums of x over the taps' boxes (docs/math.md §2.2), which an
    eval call with padding turns into its whole output, against float64 (float16 and
    bfloat16 x: tests/test_dtypes.py's padded problem)."""
    ref, fused = make_models(problem, dtype, "cuda")
    ref.eval()
    fused.eval()
    x = make_input(problem, dtype, "cuda").contiguous(memory_format=layout)
    with torch.no_grad(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    assert any("box_sums_kernel" in e.name for e in prof.events()) == kernel
    with torch.no_grad():
        assert relerr(out, ref(x.double().cpu())) <= TOLERANCE[dtype]
