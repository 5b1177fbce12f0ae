"""The FFT/Parseval training path (docs/math.md §3.3): forced on the problems it covers,
refused with a clear error on the ones it does not, and what "auto" picks."""
import pytest
import torch

from conftest import Problem, make_input, make_models, random_problems, relerr

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FFT_PROBLEMS = [
    Problem(2, 8, 16, (4, 6, 5), (3, 3, 3)),
    Problem(3, 4, 37, (3, 4, 5), (2, 3, 4)),  # channels not a multiple of the 32-channel tile
    Problem(1, 3, 4, (2, 3, 4), (2, 2, 2)),  # batch 1
    Problem(3, 4, 5, (3, 4, 5), (1, 1, 1)),  # kernel 1: the spectrum of a single tap
    Problem(19, 11, 70, (5, 7, 6), (3, 2, 4), scale=-0.75),  # > 16 samples: two passes over b
    Problem(2, 5, 9, (30, 3, 4), (3, 2, 2)),  # Ld = 32 > 24 depth lanes: two passes over fd
    Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(dilation=(2, 1, 3))),
    Problem(2, 6, 9, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(groups=3)),
    Problem(2, 12, 66, (3, 4, 6), (2, 2, 3), conv_kwargs=dict(groups=2, bias=False)),
    Problem(2, 4, 6, (3, 4, 5), (2, 2, 2), bn_kwargs=dict(affine=False)),
    Problem(4, 64, 128, (6, 10, 12), (5, 5, 5)),  # the seed problem's channels
] + [p for p in random_problems(8, seed=5) if p.batch > 1 or p.size != (1, 1, 1)]


@cuda
@pytest.mark.parametrize("problem", FFT_PROBLEMS, ids=Problem.ids)
def test_fft_matches_reference_over_steps(problem):
    ref, fused = make_models(problem, torch.float32, "cuda", algo="fft")
    ref.train()
    fused.train()
    for _ in range(3):
        x = make_input(problem, torch.float32, "cuda")
        with torch.no_grad():
            out = fused(x)
            expected = ref(x.double().cpu())
        assert relerr(out, expected) <= 1e-6
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= 1e-6


@cuda
def test_fft_survives_a_large_offset():
    """The DC bin is left out, not subtracted: a big common offset must not cancel."""
    p = Problem(4, 6, 10, (5, 6, 7), (3, 3, 3))
    ref, fused = make_models(p, torch.float32, "cuda", algo="fft")
    x = make_input(p, torch.float32, "cuda") + 50.0
    with torch.no_grad():
        assert relerr(fused(x), ref(x.double().cpu())) <= 1e-5


@cuda
@pytest.mark.parametrize("conv_kwargs", [dict(stride=2), dict(padding=1),
                                         dict(dilation=2, output_padding=1)], ids=str)
def test_fft_refuses_what_it_does_not_compute(conv_kwargs):
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=conv_kwargs)
    _, fused = make_models(p, torch.float32, "cuda", algo="fft")
    before = fused.batch_norm.running_var.clone()
    with pytest.raises(ValueError,
                       match="algo='fft' needs float32, float16 or bfloat16 and stride 1"):
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
