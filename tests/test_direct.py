"""algo='direct' (docs/math.md §3.1): the convolution output formed in registers (CUDA) or
loops (CPU) and never stored. Forced on every configuration family against PyTorch's modules
in float64, output and statistics over three steps; on CUDA, which kernel runs where (the
staged and unstaged kernel at a stride or dilation, the stride-1 kernels of each route)."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fused_ops
import fused_ops.testing
from conftest import (DEVICES, KERNELS, STATS_TOL, TOL, TRAIN_PROBLEMS, Problem,
                      assert_stats_match, check_training, make_input, make_models,
                      module_conv_options, relerr)

DTYPES = [torch.float64, torch.float32]
PROBLEMS = TRAIN_PROBLEMS + [
    # rows too long for one block's threads on CUDA, several tiles of output channels
    Problem(2, 2, 3, (1, 2, 598), (1, 2, 3)),
    Problem(2, 5, 70, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(padding=(0, 1, 1))),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_matches_reference_over_steps(problem, dtype, device):
    check_training(problem, dtype, device, "direct")


def profiled_step(fused, x):
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events()]


def assert_step_matches(ref, fused, x, out, dtype):
    with torch.no_grad():
        assert relerr(out, ref(x.double().cpu())) <= TOL[dtype]
    assert_stats_match(x, fused.conv_transpose.weight.detach(), module_conv_options(fused),
                       "direct", STATS_TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("problem, staged", [
    # the bench's `odd` problem with a stride along W (at stride 1 the stride-1 kernels take
    # it): x and the tile's weights copied to shared memory first (float64: past the default
    # 48 KiB limit)
    (Problem(3, 5, 7, (9, 11, 13), (2, 3, 4), conv_kwargs=dict(stride=(1, 1, 2))), True),
    # 256 KiB of x per sample
    (Problem(2, 16, 20, (16, 16, 16), (3, 3, 3), conv_kwargs=dict(dilation=(1, 2, 1))), False),
    # 27 input channels over 16 sets of threads (1 or 2 each), and in float32 the 9 (kd, kh)
    # pairs over 2 (on an H200's 132 SMs), two tiles of output channels (the second partial),
    # rows of an odd length (the last pair of positions half outside)
    (Problem(3, 27, 20, (5, 6, 7), (3, 3, 3), conv_kwargs=dict(dilation=(1, 2, 1))), True),
], ids=["shared", "global", "input-split"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_stages_what_fits(problem, staged, dtype):
    """The kernel for a stride or dilation above 1 reads x from shared memory where a sample's
    x and a tile's weights fit there, from global memory elsewhere, and splits a group's input
    channels over sets of threads; each against float64."""
    ref, fused = make_models(problem, dtype, "cuda", algo="direct")
    ref.train()
    fused.train()
    x = make_input(problem, dtype, "cuda")
    out, names = profiled_step(fused, x)
    kernel = "%s<%s, %s>" % (KERNELS["direct"], "float" if dtype == torch.float32 else "double",
                             str(staged).lower())
    assert any(kernel in n for n in names)
    assert_step_matches(ref, fused, x, out, dtype)
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= TOL[dtype]


STRIDE1_PROBLEMS = [
    # t8pad1's shape, smaller: one channel chunk; 3 units of work, so tiles of one output row
    # (the tensor cores' kernel: 6 tiles of one 7-row plane); x offset from zero, where sample
    # sums from y would show any loss
    (Problem(3, 12, 16, (6, 7, 8), (3, 3, 3), conv_kwargs=dict(padding=1)),
     KERNELS["direct_stride1"], 3.0),
    # 40 input channels of 125 taps: the staged chunks are several (at most 96 KiB each; the
    # tensor cores' kernel: one group of 8 channels per stage, in float64 past its 100 KiB, so
    # one block per SM); 20 output channels: a second, partial tile; padding above the kernel's
    # reach along D (the output smaller than x) and none along W
    (Problem(2, 40, 20, (9, 9, 11), (5, 5, 5), conv_kwargs=dict(padding=(5, 2, 0))),
     KERNELS["direct_stride1"], 0.0),
    # groups, an odd output width (the last thread's second position outside), a tile of
    # rows that does not divide the output's height
    (Problem(3, 6, 9, (4, 13, 7), (2, 3, 2), conv_kwargs=dict(groups=3, padding=(0, 1, 1))),
     KERNELS["direct_stride1"], 0.0),
    # rows too long for a block's threads (600 float64 positions): the general kernel (the
    # tensor cores' kernel: tiles of part of a row)
    (Problem(2, 2, 3, (1, 2, 598), (1, 2, 3)), KERNELS["direct"], 0.0),
]


@pytest.mark.cuda
@pytest.mark.parametrize("problem, simt_kernel, offset", STRIDE1_PROBLEMS,
                         ids=["one-chunk", "chunks", "groups", "long-rows"])
@pytest.mark.parametrize("route", ["mma", "simt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stride1_kernels(problem, simt_kernel, offset, route, dtype):
    """At stride and dilation 1 the route picks the kernel that `auto` picks by padding: `mma`
    the float64 tensor cores' kernel (sm_90: every product and sum in float64, the sample sums
    from y), `simt` the stride-1 kernel (each tile's box of x staged with its halo); each
    against float64: output, statistics and running statistics over three steps."""
    if route == "mma" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("float64 tensor cores of sm_90")
    kernel = KERNELS["direct_mma"] if route == "mma" else simt_kernel
    if kernel == KERNELS["direct"] and dtype == torch.float32:
        problem = Problem(2, 2, 3, (1, 2, 1100), (1, 2, 3))  # 1102 float32 positions
    ref, fused = make_models(problem, dtype, "cuda", algo="direct")
    ref.train()
    fused.train()
    stride1 = KERNELS["direct_stride1"]
    with fused_ops.testing.route(direct=route):
        for _ in range(3):
            x = make_input(problem, dtype, "cuda", offset)
            out, names = profiled_step(fused, x)
            assert any(kernel in n for n in names)
            assert (kernel == stride1) == any(stride1 in n for n in names)
            assert_step_matches(ref, fused, x, out, dtype)
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= TOL[dtype]
