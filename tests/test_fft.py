"""algo='fft' (docs/math.md §3.3, CUDA only): Parseval on the spectra of x and the weight,
in float32, the DC bin left out, strides by the polyphase split (§3.3.1). Forced on the
problems it covers against PyTorch's modules in float64 (output, statistics and running
statistics over three steps); which of its kernels runs; refused with a clear error, and
nothing changed, where it does not apply."""
import itertools

import pytest
import torch

from conftest import (FFT_PROBLEMS, KERNELS, STRIDED_FFT_PROBLEMS, TOL, Problem,
                      assert_no_host_sync, assert_train_steps_match, cuda_train_step_kernels,
                      make_input, make_models)

@pytest.mark.cuda
@pytest.mark.parametrize("problem", FFT_PROBLEMS + STRIDED_FFT_PROBLEMS, ids=Problem.ids)
def test_matches_reference_over_steps(problem):
    ref, fused = make_models(problem, torch.float32, "cuda", algo="fft")
    assert_train_steps_match(ref, fused, lambda: make_input(problem, torch.float32, "cuda"),
                             TOL[torch.float32])


def spectral_kernels(problem):
    """The spectral-energy kernels one checked fft training step of `problem` ran."""
    names = cuda_train_step_kernels(problem, "fft")
    return {kernel for kernel in (KERNELS["small_spectral_energy"], KERNELS["weight_spectrum"])
            if any(kernel in name for name in names)}


# The small-problem kernel over the shapes it is for: 3 and 8 samples, input channels odd and
# multiples of its slices, kernels 3 and 5, 1 and 2 groups. 64 channels in and out with kernel
# 5 would re-read 172 MB of taps, past the path's bound: 16 out there.
SMALL_KERNEL_PROBLEMS = [
    Problem(batch, ci, 32 if ci < 64 else (64 if k == 3 else 16), (8, 8, 8), (k, k, k),
            conv_kwargs=dict(groups=groups))
    for batch, ci, k, groups in itertools.product((3, 8), (5, 32, 64), (3, 5), (1, 2))
    if ci % groups == 0
]


@pytest.mark.cuda
@pytest.mark.parametrize("problem", SMALL_KERNEL_PROBLEMS, ids=Problem.ids)
def test_small_kernel_builds_its_own_weight_spectrum(problem):
    assert spectral_kernels(problem) == {KERNELS["small_spectral_energy"]}


@pytest.mark.cuda
@pytest.mark.parametrize("problem", [
    Problem(9, 32, 32, (8, 8, 8), (3, 3, 3)),     # 9 samples: more than the small kernel's tile
    Problem(4, 64, 128, (6, 10, 12), (5, 5, 5)),  # 516 MB of taps re-read: the weight's spectrum
], ids=Problem.ids)
def test_large_problems_keep_the_weight_spectrum(problem):
    assert spectral_kernels(problem) == {KERNELS["weight_spectrum"]}


@pytest.mark.cuda
def test_no_host_sync_with_a_stride():
    p = Problem(3, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=(2, 1, 3)))
    _, fused = make_models(p, torch.float32, "cuda", algo="fft")
    assert_no_host_sync(fused, make_input(p, torch.float32, "cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("conv_kwargs", [dict(padding=1), dict(stride=2, padding=(0, 1, 0)),
                                         dict(dilation=2, output_padding=1, padding=1)], ids=str)
def test_refuses_padding(conv_kwargs):
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=conv_kwargs)
    _, fused = make_models(p, torch.float32, "cuda", algo="fft")
    before = fused.batch_norm.running_var.clone()
    with pytest.raises(ValueError,
                       match="algo='fft' needs float32, float16 or bfloat16 and padding 0"):
        fused(make_input(p, torch.float32, "cuda"))
    assert torch.equal(fused.batch_norm.running_var, before)
    assert int(fused.batch_norm.num_batches_tracked) == 0


@pytest.mark.cuda
def test_refuses_float64():
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3))
    _, fused = make_models(p, torch.float64, "cuda", algo="fft")
    with pytest.raises(ValueError, match="needs float32"):
        fused(make_input(p, torch.float64, "cuda"))


def test_is_cuda_only():
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3))
    _, fused = make_models(p, torch.float32, "cpu", algo="fft")
    before = fused.batch_norm.running_var.clone()
    with pytest.raises(ValueError, match="CUDA tensors only"):
        fused(make_input(p, torch.float32, "cpu"))
    assert torch.equal(fused.batch_norm.running_var, before)


