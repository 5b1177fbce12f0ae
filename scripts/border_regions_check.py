"""GPU time of algo='border''s plane problems (docs/math.md §3.6) under each padding-0 path,
for choosing the path a region takes: the three dims' plane problems of a bench padded problem
(default pad2), run through the op as the padding-0 problems they are.

    python scripts/border_regions_check.py [--problem NAME] [--algos fft,cross_spectrum,sliced_conv]

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
    """(label, x shape, weight shape) of the low side's plane problem of each cut dim, the
    layout border_energy.cpp gives them (a cut depth swapped with the height)."""
    batch, ci, co, d, h, w, k = CUDA_PROBLEMS[name]
    p, s = conv_options(name)["padding"], conv_options(name)["stride"]
    n = -(-p // s)  # input planes reaching the p cut planes
    ci2, co2 = ci * n, co * p
    return [("d", (batch, ci2, h, 1, w), (ci2, co2, k, 1, k)),
            ("h", (batch, ci2, d, 1, w), (ci2, co2, k, 1, k)),
            ("w", (batch, ci2, d, h, 1), (ci2, co2, k, k, 1))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--problem", default="pad2")
    parser.add_argument("--algos", default="fft,cross_spectrum,sliced_conv")
    args = parser.parse_args()
    clock = CudaClock()
    for label, x_shape, w_shape in plane_problems(args.problem):
        inputs = [torch.randn(x_shape, device="cuda") for _ in range(4)]
        next_input = itertools.cycle(inputs).__next__
        weight = torch.randn(w_shape, device="cuda")
        row = []
        for algo in args.algos.split(","):
            def call(x):
                return fused_ops.ct_bn_pool(x, weight, None, 2.0, None, None, None, None, True,
                                            0.1, 1e-5, algo=algo)
            with torch.no_grad():
                row.append(f"{algo} {clock.measure(call, next_input, 10).ms:.3f}")
        print(f"{args.problem} plane {label}: x {list(x_shape)}, weight {list(w_shape)}: "
              + ", ".join(row) + " ms")


if __name__ == "__main__":
    main()
