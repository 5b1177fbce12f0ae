"""algo='border' (docs/math.md §3.6): the energy of a padded problem as the full grid's minus
that of the planes the padding cuts, by inclusion-exclusion over the dims, each term a
padding-0 problem on x's edge planes. Forced on padded problems of every geometry (padding
in one, two and three dims, strides, dilation, output padding below, at and above the
padding, groups, kernels larger than the input) against PyTorch's modules in float64 over
several steps, its statistics within its bound (the terms' rounding amplified by
border_amplification); the plane regions of one problem shape are one problem, counted;
refused with a clear error, and nothing changed, without padding. With an offset of x:
tests/test_statistics.py."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import (DEVICES, KERNELS, Problem, TOL, assert_no_host_sync, assert_refused_unchanged,
                      assert_stats_match, assert_train_steps_match, default_stats_tol, make_input,
                      make_models, module_conv_options, paths_seen, relerr)

ALGO = "border"
PROBLEMS = [
    Problem(3, 4, 5, (5, 6, 7), (3, 3, 3), conv_kwargs=dict(padding=1)),
    Problem(2, 3, 4, (6, 5, 4), (5, 3, 2), conv_kwargs=dict(padding=(2, 1, 0))),
    Problem(2, 4, 6, (4, 5, 6), (3, 4, 3), conv_kwargs=dict(padding=(0, 0, 2))),
    Problem(2, 4, 6, (4, 5, 3), (3, 3, 3), conv_kwargs=dict(stride=2, padding=1, output_padding=1)),
    Problem(2, 4, 6, (4, 5, 3), (3, 3, 3),
            conv_kwargs=dict(stride=2, padding=(1, 2, 0), output_padding=(1, 1, 1))),
    Problem(2, 4, 6, (4, 5, 3), (3, 2, 3), conv_kwargs=dict(dilation=2, padding=(3, 1, 2))),
    Problem(2, 4, 6, (4, 5, 3), (3, 2, 3), scale=-1.5, conv_kwargs=dict(
        stride=(2, 3, 1), dilation=(1, 2, 2), padding=(2, 3, 1), groups=2)),
    Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), conv_kwargs=dict(
        stride=(1, 2, 3), padding=(1, 0, 2), output_padding=(0, 1, 2), dilation=(2, 1, 1),
        groups=2)),
    # padding larger than the kernel's overhang: the crop cuts into the input's own span
    Problem(2, 3, 5, (3, 4, 3), (4, 4, 4), conv_kwargs=dict(padding=(2, 3, 2))),
    Problem(3, 2, 2, (1, 1, 1), (3, 3, 3), conv_kwargs=dict(padding=1)),
    # D and H alike: their four sides' plane regions one problem, of 4 x 2 channel groups
    Problem(2, 4, 6, (4, 4, 5), (3, 3, 2), conv_kwargs=dict(padding=1, groups=2)),
    # output padding leaves the high sides one plane where the low ones have two: each its own
    Problem(2, 3, 4, (4, 5, 6), (3, 3, 3), conv_kwargs=dict(dilation=2, padding=2, output_padding=1)),
    # the bench's padded problems, smaller: "same" padding of a 5-tap and a 3-tap kernel
    Problem(4, 16, 24, (6, 8, 8), (5, 5, 5), conv_kwargs=dict(padding=2)),
    Problem(5, 32, 32, (5, 6, 7), (3, 3, 3), conv_kwargs=dict(padding=1)),
    # batch 1: the statistics are the check
    Problem(1, 3, 4, (4, 5, 6), (3, 3, 3), conv_kwargs=dict(padding=1)),
    # lines along W longer than the CUDA line kernels stage in shared memory in float64 (6201
    # values a channel, 49.6 KB): ATen's gathers there; float32's 24.8 KB take the kernel
    Problem(2, 2, 3, (3, 3, 6200), (3, 3, 3), conv_kwargs=dict(padding=1)),
]


def crop_fraction(problem):
    """The share of the padding-0 grid's positions that the crop keeps."""
    full = crop = 1
    for n, k, s, p, op, d in zip(problem.size, problem.kernel, problem.triple("stride", 1),
                                 problem.triple("padding", 0), problem.triple("output_padding", 0),
                                 problem.triple("dilation", 1)):
        grid = (n - 1) * s + d * (k - 1) + 1 + max(op - p, 0)
        full *= grid
        crop *= grid - p - max(p - op, 0)
    return crop / full


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_matches_reference_over_steps(problem, device, dtype):
    """x offset by 0.75 of its spread, so that the sample means are far from 0 and the
    centring is tested. The statistics within STATS_TOL plus the terms' rounding amplified by
    border_amplification (conftest.default_stats_tol, docs/math.md §3.6); the output within TOL
    where the crop keeps a quarter of the grid (float64 covers the geometry of the others)."""
    if dtype == torch.float32 and crop_fraction(problem) < 0.25:
        pytest.skip("the crop keeps under a quarter of the grid: float64 only")
    ref, fused = make_models(problem, dtype, device, algo=ALGO)
    assert_train_steps_match(ref, fused, lambda: make_input(problem, dtype, device, offset=0.75),
                             TOL[dtype])


@pytest.mark.parametrize("problem, plane_problems, value_gemms", [
    # each dim's two sides one problem; the lines of each pair of cut dims one GEMM, the corners one
    (Problem(2, 3, 4, (4, 5, 6), (3, 3, 3), conv_kwargs=dict(padding=1)), 3, 4),
    # D and H alike (the cut dim first): their four sides one problem, and the lines along H and
    # along D (cut in the other two dims) one GEMM
    (Problem(2, 3, 4, (5, 5, 6), (3, 3, 3), conv_kwargs=dict(padding=1)), 2, 3),
    # H and W alike, likewise
    (Problem(2, 3, 4, (4, 5, 5), (3, 3, 3), conv_kwargs=dict(padding=1)), 2, 3),
    # unequal sides (output padding): every side its own problem
    (Problem(2, 3, 4, (4, 5, 6), (3, 3, 3), conv_kwargs=dict(dilation=2, padding=2, output_padding=1)), 6, 13),
], ids=["sides", "dims-alike", "dims-alike-hw", "unequal-sides"])
def test_plane_regions_share_problems_on_cpu(problem, plane_problems, value_gemms):
    """Padding in all three dims: the full grid's problem and one per group of plane regions of
    one problem shape (docs/math.md §3.6). The CPU's auto takes ATen's convolution for each of
    these padding-0 problems (sliced_conv, one slice here), so each runs aten::_convolution
    once, its cut dim at the depth; the lines and corners are one GEMM (aten::baddbmm) per
    group of one problem shape and sign. The call's output against float64."""
    ref, fused = make_models(problem, torch.float32, "cpu", algo=ALGO)
    x = make_input(problem, torch.float32, "cpu")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = fused.train()(x)
    inputs = [e.input_shapes[0] for e in prof.events() if e.name == "aten::_convolution"]
    assert len(inputs) == 1 + plane_problems, inputs
    assert all(shape[2] == 1 for shape in inputs[1:]), inputs
    assert sum(e.name == "aten::baddbmm" for e in prof.events()) == value_gemms
    with torch.no_grad():
        assert relerr(out, ref.train()(x.double())) <= TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_refuses_padding_0(device):
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=2, output_padding=1))
    assert_refused_unchanged(p, device, ALGO,
                             r"algo='border' needs padding > 0 in some dim; got padding \[0, 0, 0\]")


@pytest.mark.cuda
def test_no_host_sync_on_cuda():
    p = Problem(3, 8, 12, (5, 6, 7), (3, 3, 3), conv_kwargs=dict(padding=1))
    _, fused = make_models(p, torch.float32, "cuda", algo=ALGO)
    assert_no_host_sync(fused.train(), make_input(p, torch.float32, "cuda"))


@pytest.mark.cuda
@pytest.mark.slow
def test_auto_on_cuda_takes_border_on_large_padded_problems():
    """CUDA auto with padding: the border's terms where the convolution has at least 1e11
    multiply-adds and the crop keeps half of the grid, else cuDNN over slices or the direct
    kernel (tests/test_dispatch.py). The float64 reference of a problem this size would take
    minutes on the CPU: the statistics against float64 on the GPU (F.conv_transpose3d in
    float64 there), the output against sliced_conv (strict float32), whose own accuracy the
    small problems test."""
    p = Problem(16, 64, 64, (16, 32, 32), (5, 5, 5), conv_kwargs=dict(padding=2))  # 1.3e11
    _, fused = make_models(p, torch.float32, "cuda")
    _, sliced = make_models(p, torch.float32, "cuda", algo="sliced_conv")
    sliced.load_state_dict(fused.state_dict())
    x = make_input(p, torch.float32, "cuda", offset=0.5)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fused.train()(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert not any(name == "aten::_convolution" for name in names)
    # the terms' paths at padding 0: Parseval or the cross-spectrum
    assert paths_seen(names) & {"fft", "cross_spectrum"}
    with torch.no_grad():
        assert relerr(out, sliced.train()(x)) <= 2e-6
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(sliced.batch_norm, name)) <= 2e-6
    sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(x, fused.conv_transpose.weight.detach(),
                                                       padding=[2, 2, 2])
    y = torch.nn.functional.conv_transpose3d(x.double(), fused.conv_transpose.weight.double(),
                                             padding=2)
    var = y.var(dim=(0, 2, 3, 4), correction=0)
    del y
    assert ((stats[2] / stats[0] - var).abs() / var).max().item() <= 1e-6


@pytest.mark.cuda
def test_plane_problems_take_the_cross_spectrum_on_cuda():
    """Padding in D alone: the full grid and one plane problem (both sides of D's cut, the cut
    dim at the depth). That problem's 1.7e8 multiply-adds are past the direct kernel's share, so
    CUDA auto takes the cross-spectrum for it (a depth of one position), whose W stage writes
    Z^ itself (one lag stage storing float64 sums), beside the full grid's W and D stages if it
    takes that path too. Against float64: output, statistics and running statistics."""
    p = Problem(8, 32, 64, (4, 32, 32), (3, 3, 3), conv_kwargs=dict(padding=(1, 0, 0)))
    ref, fused = make_models(p, torch.float32, "cuda", algo=ALGO)
    ref.train()
    fused.train()
    x = make_input(p, torch.float32, "cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    lag = KERNELS["lag_stage"]
    w_stages = sum(f"{lag}<float2, float2" in n for n in names)
    assert sum(f"{lag}<float2, double2" in n for n in names) == w_stages + 1
    with torch.no_grad():
        assert relerr(out, ref(x.double().cpu())) <= TOL[torch.float32]
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= TOL[torch.float32]
    weight, options = fused.conv_transpose.weight.detach(), module_conv_options(fused)
    assert_stats_match(x, weight, options, ALGO, default_stats_tol(ALGO, x, weight, options))


@pytest.mark.cuda
def test_auto_on_cuda_leaves_border_where_its_weights_are_large():
    """A 7-tap kernel with padding 3 on 256 channels: 3.7e11 multiply-adds, the crop keeps 0.52
    of the grid, but a line's weight would hold 256 * 256 * 81 * 7 float64 values (297 MB):
    auto takes cuDNN over slices."""
    p = Problem(1, 256, 256, (16, 32, 32), (7, 7, 7), conv_kwargs=dict(padding=3))
    _, fused = make_models(p, torch.float32, "cuda")
    x = make_input(p, torch.float32, "cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fused.train()(x)
        torch.cuda.synchronize()
    assert any(e.name == "aten::_convolution" for e in prof.events())
