"""Shared test helpers: the unfused reference pattern and problem generators."""
import copy
import random
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import fused_ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


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
                + "".join(f"-{k}{v}" for k, v in {**self.conv_kwargs, **self.bn_kwargs}.items()))


def has_padding(problem: Problem) -> bool:
    padding = problem.conv_kwargs.get("padding", 0)
    return any(p != 0 for p in (padding if isinstance(padding, tuple) else (padding,)))


def skip_unless_algo_covers(problem: Problem, algo: str):
    """algo='correlation' and 'cross_spectrum' compute padding 0 only
    (tests/test_correlation_paths.py checks the refusal), 'border' padding > 0 only
    (tests/test_border_energy.py); the other algorithms every problem these tests use
    ('fft': see tests/test_tooling_families.py)."""
    if algo in ("correlation", "cross_spectrum") and has_padding(problem):
        pytest.skip(f"algo='{algo}' covers padding 0 only")
    if algo == "border" and not has_padding(problem):
        pytest.skip("algo='border' covers padding > 0 only")


def relerr(out, ref):
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - ref).norm() / ref.norm()).item()


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


def randomize(ref):
    """Non-trivial BN parameters and running stats (fresh random, never zeros)."""
    bn = ref.batch_norm
    with torch.no_grad():
        if bn.affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
        if bn.track_running_stats:
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    return ref


def make_models(p: Problem, dtype=torch.float32, device="cpu", algo="auto"):
    """(float64 CPU reference, fused module with the same parameters on device/dtype)."""
    ref = Reference(p.in_channels, p.out_channels, p.kernel, p.scale, p.eps, p.momentum,
                    p.conv_kwargs, p.bn_kwargs)
    randomize(ref)
    ref = ref.double()
    fused = fused_ops.ConvTransposeBNPool3d(
        p.in_channels, p.out_channels, p.kernel, p.scale, p.eps, p.momentum, algo=algo,
        **p.conv_kwargs, **p.bn_kwargs)
    fused.load_state_dict(ref.state_dict())
    return ref, fused.to(device=device, dtype=dtype)


def make_input(p: Problem, dtype=torch.float32, device="cpu"):
    return torch.randn(p.batch, p.in_channels, *p.size, dtype=dtype, device=device)


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


# The checked CUDA training step's tolerance against float64, per dtype.
STEP_TOL = {torch.float32: 1e-6, torch.float64: 1e-10}


def assert_train_steps_match(ref, fused, next_input, tolerance, steps=3):
    """`steps` training calls of `fused` on next_input()'s tensors against its float64
    reference `ref` (on the CPU): each output, then the running statistics, within relative
    error `tolerance`."""
    ref.train()
    fused.train()
    for _ in range(steps):
        x = next_input()
        with torch.no_grad():
            out = fused(x)
            expected = ref(x.double().cpu())
        assert relerr(out, expected) <= tolerance
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= tolerance, name


def cuda_train_step_kernels(problem: Problem, algo: str, dtype=torch.float32):
    """One training step of `problem` in `dtype` on CUDA with `algo`, checked against float64
    (output and running statistics); the names of the kernels it ran."""
    return cuda_train_step(problem, *make_models(problem, dtype, "cuda", algo=algo), dtype)


def cuda_train_step(problem: Problem, ref, fused, dtype):
    """cuda_train_step_kernels's step with the given models (ref: its float64 reference)."""
    ref.train()
    fused.train()
    x = make_input(problem, dtype, "cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    with torch.no_grad():
        assert relerr(out, ref(x.double().cpu())) <= STEP_TOL[dtype]
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(fused.batch_norm, name), getattr(ref.batch_norm, name)) <= STEP_TOL[dtype]
    return [e.name for e in prof.events()]


def clone_state(module):
    return copy.deepcopy(module.state_dict())


def twin_modules(p: Problem, dtype, device, training):
    """Two fused modules with the same parameters and buffers, both in mode `training`."""
    _, a = make_models(p, dtype, device)
    _, b = make_models(p, dtype, device)
    b.load_state_dict(a.state_dict())
    return a.train(training), b.train(training)


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
