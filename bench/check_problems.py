#!/usr/bin/env python
"""Dry check of the bench's problem lists, on the meta device (no GPU, no compute).

    python bench/check_problems.py

For every problem: nn.ConvTranspose3d with its options computes an output shape, the fused
module accepts the options in both modes (its fake kernel runs the op's checks), names are
unique across the lists, and a real-layer problem's name says its dims and its family's
geometry holds (2x upsampling, or the same size for k3s1p1). Prints each problem's output
size and convolution work, to see a list's range at a glance. Exits 1 on any failure.
"""
import math
import re
import sys

import torch
from torch import nn

import fused_ops
from problems import (FAMILIES, REAL_CPU, REAL_CUDA, SEED_CPU, SEED_CUDA, SWEEPS, Problem,
                      layer)

NAME = re.compile(r"(?P<family>[a-z0-9]+)-c(?P<ci>\d+)-s(?P<size>\d+)-b(?P<batch>\d+)")
MAX_BATCH = 32


def triple(value):
    return (value,) * 3 if isinstance(value, int) else tuple(value)


def conv_output_shape(problem: Problem) -> tuple:
    conv = nn.ConvTranspose3d(problem.Ci, problem.Co, problem.k, device="meta",
                              **problem.conv_options())
    return tuple(conv(torch.empty(problem.x_shape, device="meta")).shape)


def fused_accepts(problem: Problem):
    """Raises as the op would on the problem's options (the fake kernel's checks)."""
    fused = fused_ops.ConvTransposeBNPool3d(problem.Ci, problem.Co, problem.k, 2.0, device="meta",
                                            **problem.conv_options())
    x = torch.empty(problem.x_shape, device="meta")
    for training in (False, True):
        out = fused.train(training)(x)
        assert tuple(out.shape) == (problem.B, problem.Co, 1, 1, 1), out.shape


def check_real_name(name: str, problem: Problem, out_shape: tuple):
    """The name is the problem `layer` builds from it, and the family's geometry holds."""
    match = NAME.fullmatch(name)
    assert match, f"{name}: not family-cCI-sSIZE-bBATCH"
    fields = match.groupdict()
    family = fields["family"]
    assert family in FAMILIES, f"{name}: unknown family {family}"
    expected = layer(family, int(fields["ci"]), int(fields["size"]), int(fields["batch"]))
    assert expected == (name, problem), f"{name}: dims {problem} differ from the name's {expected[1]}"
    assert 1 <= problem.B <= MAX_BATCH, f"{name}: batch {problem.B} outside 1..{MAX_BATCH}"
    grow = FAMILIES[family].stride
    want = tuple(grow * s for s in (problem.D, problem.H, problem.W))
    assert out_shape[2:] == want, f"{name}: output size {out_shape[2:]}, expected {want}"


def work_line(name: str, problem: Problem, out_shape: tuple) -> str:
    """Output size and the transposed convolution's multiply-adds (each input value meets
    Co * taps weights), the two things that set an eager call's time."""
    out_mib = math.prod(out_shape) * 4 / 2**20
    taps = math.prod(triple(problem.k))
    gflop = 2 * math.prod(problem.x_shape) * problem.Co * taps / 1e9
    options = problem.conv_options()
    return (f"  {name:22} {str(problem.dims):38} s{options['stride']} p{options['padding']}"
            f" op{options['output_padding']}  out {str(out_shape):26} {out_mib:8.1f} MiB"
            f" {gflop:8.2f} GFLOP")


def check_list(title: str, problems: dict, real: bool) -> list:
    print(f"{title} ({len(problems)} problems)")
    failures = []
    for name, problem in problems.items():
        try:
            out_shape = conv_output_shape(problem)
            fused_accepts(problem)
            if real:
                check_real_name(name, problem, out_shape)
            print(work_line(name, problem, out_shape))
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"  {name}: FAILED: {exc}")
    return failures


def main():
    lists = [("seed, CUDA", SEED_CUDA, False), ("seed, CPU", SEED_CPU, False),
             ("real, CUDA", REAL_CUDA, True), ("real, CPU", REAL_CPU, True)]
    failures = []
    for title, problems, real in lists:
        failures += check_list(title, problems, real)
    names = [name for _, problems, _ in lists for name in problems]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        failures.append(f"names in more than one list: {duplicates}")
    assert all(SWEEPS[sweep][device] for sweep in SWEEPS for device in ("cuda", "cpu"))
    print("\n".join(["", *failures]) if failures else "\nall problems valid")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
