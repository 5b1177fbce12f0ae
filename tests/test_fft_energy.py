"""The FFT/Parseval training path (docs/math.md §3.3): forced on the problems it covers,
refused with a clear error on the ones it does not, and what "auto" picks; and the
polyphase algebra for strides and output padding (§3.3.1), checked on the CPU too."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import (Problem, assert_no_host_sync, assert_train_steps_match, cuda_train_step_kernels, make_input,
                      make_models, random_problems, relerr)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Problems of at most 8 samples go to the small-problem kernel of csrc/cuda/spectral_energy.cu
# where its re-reads of the taps stay small (csrc/cuda/fft_energy.cpp), the others to the
# 16-sample kernel with the weight's spectrum; the comments on tiles and passes are about
# the latter.
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
    # thread, csrc/cuda/x_spectrum_dft.cu: w_bin_tile), depth grids of 20 and 40 (radix 4: 5 rows
    # in one pass, 10 in two passes of 8).
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


@cuda
@pytest.mark.parametrize("problem", FFT_PROBLEMS + STRIDED_FFT_PROBLEMS, ids=Problem.ids)
def test_fft_matches_reference_over_steps(problem):
    ref, fused = make_models(problem, torch.float32, "cuda", algo="fft")
    assert_train_steps_match(ref, fused, lambda: make_input(problem, torch.float32, "cuda"), 1e-6)


def spectral_kernels(problem):
    """The spectral-energy kernels one checked fft training step of `problem` ran."""
    names = cuda_train_step_kernels(problem, "fft")
    return {kernel for kernel in ("small_spectral_energy_kernel", "weight_spectrum_kernel")
            if any(kernel in name for name in names)}


# The small-problem kernel over the shapes it is for: 3 and 8 samples, input channels odd and
# multiples of its slices, kernels 3 and 5, 1 and 2 groups. 64 channels in and out with kernel
# 5 would re-read 172 MB of taps, past fft_energy.cpp's bound: 16 out there.
SMALL_KERNEL_PROBLEMS = [
    Problem(batch, ci, 32 if ci < 64 else (64 if k == 3 else 16), (8, 8, 8), (k, k, k),
            conv_kwargs=dict(groups=groups))
    for batch, ci, k, groups in itertools.product((3, 8), (5, 32, 64), (3, 5), (1, 2))
    if ci % groups == 0
]


@cuda
@pytest.mark.parametrize("problem", SMALL_KERNEL_PROBLEMS, ids=Problem.ids)
def test_fft_small_kernel_builds_its_own_weight_spectrum(problem):
    assert spectral_kernels(problem) == {"small_spectral_energy_kernel"}


@cuda
@pytest.mark.parametrize("problem", [
    Problem(9, 32, 32, (8, 8, 8), (3, 3, 3)),     # 9 samples: more than the small kernel's tile
    Problem(4, 64, 128, (6, 10, 12), (5, 5, 5)),  # 516 MB of taps re-read: the weight's spectrum
], ids=Problem.ids)
def test_fft_large_problems_keep_the_weight_spectrum(problem):
    assert spectral_kernels(problem) == {"weight_spectrum_kernel"}


@cuda
@pytest.mark.parametrize("conv_kwargs", [dict(), dict(stride=2), dict(stride=2, kernel_size=2),
                                         dict(stride=(2, 1, 3), output_padding=(1, 0, 2))],
                         ids=str)
def test_fft_survives_a_large_offset(conv_kwargs):
    """The DC bin is left out, not subtracted: a big common offset must not cancel. With a
    stride the phases' zero grid positions and their sums' terms (§3.3.1) must not either."""
    conv_kwargs = dict(conv_kwargs)
    kernel = conv_kwargs.pop("kernel_size", 3)
    p = Problem(4, 6, 10, (5, 6, 7), (kernel,) * 3, conv_kwargs=conv_kwargs)
    ref, fused = make_models(p, torch.float32, "cuda", algo="fft")
    x = make_input(p, torch.float32, "cuda") + 50.0
    with torch.no_grad():
        assert relerr(fused(x), ref(x.double().cpu())) <= 1e-5


@cuda
def test_fft_has_no_host_sync_with_a_stride():
    p = Problem(3, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=(2, 1, 3)))
    _, fused = make_models(p, torch.float32, "cuda", algo="fft")
    assert_no_host_sync(fused, make_input(p, torch.float32, "cuda"))


@cuda
@pytest.mark.parametrize("conv_kwargs", [dict(padding=1), dict(stride=2, padding=(0, 1, 0)),
                                         dict(dilation=2, output_padding=1, padding=1)], ids=str)
def test_fft_refuses_what_it_does_not_compute(conv_kwargs):
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=conv_kwargs)
    _, fused = make_models(p, torch.float32, "cuda", algo="fft")
    before = fused.batch_norm.running_var.clone()
    with pytest.raises(ValueError,
                       match="algo='fft' needs float32, float16 or bfloat16 and padding 0"):
        fused(make_input(p, torch.float32, "cuda"))
    assert torch.equal(fused.batch_norm.running_var, before)
    assert int(fused.batch_norm.num_batches_tracked) == 0


@cuda
def test_fft_refuses_float64():
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3))
    _, fused = make_models(p, torch.float64, "cuda", algo="fft")
    with pytest.raises(ValueError, match="needs float32"):
        fused(make_input(p, torch.float64, "cuda"))


def test_fft_is_cuda_only():
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3))
    _, fused = make_models(p, torch.float32, "cpu", algo="fft")
    with pytest.raises(ValueError, match="CUDA tensors only"):
        fused(make_input(p, torch.float32, "cpu"))


# The polyphase algebra of §3.3.1 in float64 with torch.fft, on the CPU: what the CUDA path
# computes (phases' energies without their DC bins, plus the double-precision terms of the
# phases' sums), written independently of it.

def tap_phases(k, s, d):
    """Per tap t of one dim: its phase (d t) mod s and sub-kernel position (d t) div s."""
    return [(d * t % s, d * t // s) for t in range(k)], d * (k - 1) // s + 1


def polyphase_energy(x, w, stride, dilation, output_padding, groups, phase_sums=True):
    """[Co]: sum over b of the within-sample centred energy of conv_transpose3d(x, w)."""
    batch, ci, *n = x.shape
    cog, k = w.shape[1], w.shape[2:]
    dims = [tap_phases(k[i], stride[i], dilation[i]) for i in range(3)]
    grid = [n[i] + dims[i][1] - 1 for i in range(3)]
    real = math.prod((n[i] - 1) * stride[i] + dilation[i] * (k[i] - 1) + output_padding[i] + 1
                     for i in range(3))
    cig = ci // groups
    x_spec = torch.fft.fftn(x, s=grid, dim=(2, 3, 4)).reshape(batch, groups, cig, -1)
    x_sums = x.sum((2, 3, 4)).reshape(batch, groups, cig)
    energy = torch.zeros(groups, cog, dtype=x.dtype)
    squares, total = torch.zeros_like(energy), torch.zeros(batch, groups, cog, dtype=x.dtype)
    for phase in itertools.product(*(range(s) for s in stride)):
        sub = torch.zeros(ci, cog, *(d[1] for d in dims), dtype=x.dtype)
        for taps in itertools.product(*(range(kk) for kk in k)):
            (rd, md), (rh, mh), (rw, mw) = (dims[i][0][taps[i]] for i in range(3))
            if (rd, rh, rw) == phase:
                sub[:, :, md, mh, mw] = w[:, :, taps[0], taps[1], taps[2]]
        w_spec = torch.fft.fftn(sub, s=grid, dim=(2, 3, 4)).reshape(groups, cig, cog, -1)
        power = torch.einsum("bgif,giof->bgof", x_spec, w_spec).abs().square()
        energy += power[..., 1:].sum((0, 3)) / math.prod(grid)  # the DC bin left out
        sums = torch.einsum("bgi,gio->bgo", x_sums, sub.sum((2, 3, 4)).reshape(groups, cig, cog))
        if phase_sums:
            squares += sums.square().sum(0) / math.prod(grid)
        total += sums
    return (energy + squares - total.square().sum(0) / real).reshape(-1)


def conv_energy(x, w, stride, dilation, output_padding, groups):
    y = F.conv_transpose3d(x, w, stride=stride, output_padding=output_padding, groups=groups,
                           dilation=dilation)
    return (y - y.mean((2, 3, 4), keepdim=True)).square().sum((0, 2, 3, 4))


POLYPHASE_CASES = [  # (kernel, stride, dilation, output_padding, groups)
    ((3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0), 1),
    ((3, 2, 4), (2, 1, 3), (1, 1, 1), (0, 0, 0), 1),
    ((3, 2, 3), (2, 2, 2), (3, 3, 3), (0, 0, 0), 1),
    ((3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), 1),
    ((2, 3, 2), (1, 1, 1), (2, 2, 2), (1, 1, 1), 1),  # stride 1, output padding
    ((1, 2, 2), (2, 2, 2), (3, 3, 3), (2, 1, 0), 1),  # output padding past every grid
    ((3, 3, 2), (2, 2, 2), (1, 1, 1), (0, 0, 0), 3),
    ((1, 1, 1), (2, 2, 2), (1, 1, 1), (0, 0, 0), 1),  # k < s: empty phases
    ((1, 2, 3), (3, 3, 3), (1, 1, 1), (2, 2, 2), 1),
    ((4, 4, 2), (2, 2, 2), (1, 1, 1), (0, 0, 0), 1),  # k divisible by s
    ((2, 3, 2), (3, 2, 2), (2, 4, 1), (1, 0, 0), 2),
]


@pytest.mark.parametrize("case", POLYPHASE_CASES, ids=str)
def test_polyphase_parseval_algebra(case):
    kernel, stride, dilation, output_padding, groups = case
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 6, 3, 4, 5, generator=gen, dtype=torch.float64) + 2.0
    w = torch.randn(6, 2, *kernel, generator=gen, dtype=torch.float64)
    args = (x, w, stride, dilation, output_padding, groups)
    want = conv_energy(*args)
    assert relerr(polyphase_energy(*args), want) <= 1e-12
    # The phases' sums are needed: without their terms the answer is wrong.
    assert relerr(polyphase_energy(*args, phase_sums=False), want) >= 1e-3
