"""GPU time of algo='border''s plane problems (docs/math.md §3.6) under each padding-0 path,
for choosing the path a region takes: the plane problems of a bench padded problem (default
pad2; both sides of each dim's cut as two channel groups, the dims alike in one problem), run
through the op as the padding-0 problems they are.

    python scripts/border_regions_check.py [--problem NAME] [--algos fft,cross_spectrum,sliced_conv]
        [--orientations]

--orientations also runs each plane problem with its one-position dim moved to the height and
to the width (the same work, another layout): border_energy.cpp puts it at the depth
(Region::order), which the cross-spectrum path reduces last (docs/math.md §3.5, §3.6); a plane
problem that `auto` sends to the FFT path takes a whole depth first instead.

Timed as the bench times its rows (bench_ct_bn_pool.CudaClock: CUDA events, warm-up, the
host's issue hidden behind a GPU sleep, median of 10 calls), inputs rotated over 4 tensors.
"""
import argparse
import itertools
import os
import sys

import torch

import fused_ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from bench_ct_bn_pool import CUDA_PROBLEMS, CudaClock, conv_options  # noqa: E402


def plane_problems(name):
    """(label, x shape, weight shape, groups) of each plane problem, the layout
    border_energy.cpp gives them where they take the cross-spectrum path (the cut dim first;
    each side of a cut, of each dim of one shape, a channel group)."""
    batch, ci, co, d, h, w, k = CUDA_PROBLEMS[name]
    p, s = conv_options(name)["padding"], conv_options(name)["stride"]
    n = -(-p // s)  # input planes reaching the p cut planes
    ci2, co2 = ci * n, co * p
    sides = {}  # x's sizes -> the dims of that shape
    for label, sizes in (("d", (1, h, w)), ("h", (1, d, w)), ("w", (1, d, h))):
        sides.setdefault(sizes, []).append(label)
    return [("".join(dims), (batch, 2 * len(dims) * ci2) + sizes, (2 * len(dims) * ci2, co2, 1, k, k),
             2 * len(dims)) for sizes, dims in sides.items()]


def orientations(label, x_shape, w_shape, groups):
    """The plane problem as border_energy.cpp lays it out (its one-position dim at the depth),
    then with that dim at the height and at the width: x's and the weight's last three dims
    permuted alike."""
    yield label, x_shape, w_shape, groups
    for name, to in (("1 at height", 1), ("1 at width", 2)):
        order = [0, 1, 2]
        order[0], order[to] = to, 0
        yield (f"{label} ({name})", tuple(x_shape[:2]) + tuple(x_shape[2 + i] for i in order),
               tuple(w_shape[:2]) + tuple(w_shape[2 + i] for i in order), groups)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--problem", default="pad2")
    parser.add_argument("--algos", default="fft,cross_spectrum,sliced_conv")
    parser.add_argument("--orientations", action="store_true")
    args = parser.parse_args()
    clock = CudaClock()
    problems = plane_problems(args.problem)
    if args.orientations:
        problems = [oriented for problem in problems for oriented in orientations(*problem)]
    for label, x_shape, w_shape, groups in problems:
        inputs = [torch.randn(x_shape, device="cuda") for _ in range(4)]
        next_input = itertools.cycle(inputs).__next__
        weight = torch.randn(w_shape, device="cuda")
        row = []
        for algo in args.algos.split(","):
            def call(x):
                return fused_ops.ct_bn_pool(x, weight, None, 2.0, None, None, None, None, True,
                                            0.1, 1e-5, groups=groups, algo=algo)
            with torch.no_grad():
                row.append(f"{algo} {clock.measure(call, next_input, 10).ms:.3f}")
        print(f"{args.problem} planes {label}: x {list(x_shape)}, weight {list(w_shape)}, "
              f"groups {groups}: "
              + ", ".join(row) + " ms")


if __name__ == "__main__":
    main()
