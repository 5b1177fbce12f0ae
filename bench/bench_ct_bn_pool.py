#!/usr/bin/env python
"""Benchmark of fused_ops.ct_bn_pool against PyTorch eager and torch.compile.

    python bench/bench_ct_bn_pool.py [--device cuda|cpu] [--sweep seed|real] [--problems seed,b4,...]
        [--modes eval,train] [--passes forward,step] [--dtypes float32,bfloat16] [--reps N]
        [--no-compile] [--algos auto,fft,direct,sliced_conv]
        [--memory-format contiguous|channels_last_3d] [--out bench/results]

For every problem, dtype, mode and pass (forward: one call under torch.no_grad(); step: a
training step, forward with gradients then backward) it times the unfused PyTorch module
(eager and torch.compile) and the fused module, per call and as an eager loop, checks both
against a float64 run of the same module, and writes one JSON row per (problem, dtype, mode,
pass, algo) to <out>/<gpu>-<date>[-real][-step].json. Problems: bench/problems.py. See
bench/README.md.
"""
import argparse
import copy
import datetime
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional

import torch
from torch import nn

import fused_ops
import fused_ops.testing
from clocks import (MIN_INPUTS, SLEEP_US, SLOW_CALL_MS, SLOW_CALL_REPS, WARMUP_CALLS, Clock,
                    CpuClock, CudaClock, InputRing, Timing, as_memory_format, l2_bytes, loop_calls)
from problems import ALL_PROBLEMS, REAL_CUDA, SEED_CUDA, SWEEPS, Problem, default_problems

SCALE = 2.0
MODES = ("eval", "train")
PASS_NAMES = ("forward", "step")
# The gradients a step computes, in the order step_grads returns them.
GRAD_NAMES = ("x", "conv_weight", "conv_bias", "bn_weight", "bn_bias")
ALGOS = ("auto", "fft", "direct", "sliced_conv", "correlation", "cross_spectrum", "border")
MEMORY_FORMATS = ("contiguous", "channels_last_3d")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROFILE_CALLS = 20
COPY_BYTES = 2**30
COPY_REPS = 20

# name -> (B, Ci, Co, D, H, W, k) and name -> conv options, as scripts/profile_seed.py reads them.
CUDA_PROBLEMS = {name: problem.dims for name, problem in {**SEED_CUDA, **REAL_CUDA}.items()}


def conv_options(name):
    """The stride, padding and output_padding of a bench problem."""
    return ALL_PROBLEMS[name].conv_options()


class Reference(nn.Module):
    """The unfused pattern that fused_ops.ConvTransposeBNPool3d replaces."""

    def __init__(self, in_channels, out_channels, kernel_size, scale_factor, eps=1e-5, momentum=0.1,
                 stride=1, padding=0, output_padding=0):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(in_channels, out_channels, kernel_size, stride, padding,
                                                 output_padding)
        self.scale_factor = scale_factor
        self.batch_norm = nn.BatchNorm3d(out_channels, eps=eps, momentum=momentum)
        self.global_avg_pool = nn.AdaptiveAvgPool3d((1, 1, 1))

    def forward(self, x):
        return self.global_avg_pool(self.batch_norm(self.conv_transpose(x) * self.scale_factor))


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(errors: List[str], what: str, fn: Callable):
    """fn(), or None with the failure appended to errors: one failed measurement (OOM,
    compile error, unsupported algo) must not end the sweep."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        errors.append(f"{what}: {type(exc).__name__}: {message}")
    free_memory()  # outside the except block, so the traceback no longer pins tensors
    return None


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def one_call(module: nn.Module, x: torch.Tensor, dtype=None):
    """Output and running_var after one call of a copy of module, so every compared
    implementation starts from the same running statistics and module is left untouched."""
    module = copy.deepcopy(module)
    if dtype is not None:
        module, x = module.to(dtype), x.to(dtype)
    return module(x), module.batch_norm.running_var.clone()


def step_grads(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, dtype=None) -> dict:
    """The gradients (GRAD_NAMES) of one training step of a copy of module on x, with
    grad as out's gradient; module is left untouched."""
    module = copy.deepcopy(module)
    if dtype is not None:
        module, x, grad = module.to(dtype), x.to(dtype), grad.to(dtype)
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    module(x).backward(grad)
    conv, bn = module.conv_transpose, module.batch_norm
    return dict(zip(GRAD_NAMES, (x.grad, conv.weight.grad, conv.bias.grad, bn.weight.grad,
                                 bn.bias.grad)))


def grad_relerrs(got: dict, expected: dict, train: bool) -> dict:
    """relerr of each gradient against float64. In training mode the conv bias's exact
    gradient is 0 (the batch mean removes the bias), so a relerr is undefined: its norm
    relative to the largest reference gradient's norm instead."""
    largest = max(g.double().norm().item() for g in expected.values())
    errors = {}
    for name, ref in expected.items():
        if train and name == "conv_bias":
            errors[name] = 0.0 if got[name] is None else got[name].double().norm().item() / largest
        else:
            errors[name] = relerr(got[name], ref)
    return errors


def build_modules(problem: Problem, device):
    """The reference (default init) and the fused module loaded with its state_dict, float32."""
    ci, co, k, options = problem.Ci, problem.Co, problem.k, problem.conv_options()
    ref = Reference(ci, co, k, SCALE, **options).to(device)
    bn = ref.batch_norm
    # Non-trivial BatchNorm state, so eval mode does not just see mean 0 / var 1. The bias
    # stays 0: a constant added exactly to every output would dilute the relative error.
    bn.weight.data.uniform_(0.5, 1.5)
    bn.running_mean.normal_(0.0, 0.1)
    bn.running_var.uniform_(0.5, 1.5)
    fused = fused_ops.ConvTransposeBNPool3d(ci, co, k, SCALE, **options).to(device)
    fused.load_state_dict(ref.state_dict())
    return ref, fused


def set_mode(mode, state, *modules):
    for module in modules:
        module.load_state_dict(state)
        module.train(mode == "train")


def kernel_stats(fused, ring: InputRing) -> dict:
    """Kernels launched per fused call and the spatial-sum kernel's time, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_CALLS):
            fused(ring.next())
        torch.cuda.synchronize()
    device_events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                           key=lambda e: e.time_range.start)
    kernels = [e for e in device_events if not e.name.startswith(("Memset", "Memcpy"))]
    sums = [e.time_range.elapsed_us() for e in kernels if "spatial_sum" in e.name]
    # Should the spatial sum ever take several kernels, a call's time is their total.
    per_call = max(1, len(sums) // PROFILE_CALLS)
    call_us = [sum(sums[i:i + per_call]) for i in range(0, per_call * PROFILE_CALLS, per_call)]
    return {
        "kernels_per_call": len(kernels) / PROFILE_CALLS,
        "memops_per_call": (len(device_events) - len(kernels)) / PROFILE_CALLS,
        "spatial_sum_us": statistics.median(call_us) if sums else None,
    }


def copy_gbps(clock: CudaClock) -> float:
    """Device-to-device copy bandwidth (bytes read + written): the practical ceiling."""
    src = torch.empty(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    # 1 GiB is far larger than L2, so re-reading the same source is not cached.
    ms, _ = clock.timed_calls(dst.copy_, lambda: src, COPY_REPS, SLEEP_US)
    return 2 * COPY_BYTES / (statistics.median(ms) * 1e-3) / 1e9


def bandwidth_stats(fused, ring: InputRing, x_bytes: int, clock: CudaClock) -> dict:
    stats = kernel_stats(fused, ring)
    stats["copy_gbps"] = copy_gbps(clock)
    if stats["spatial_sum_us"]:
        stats["spatial_sum_gbps"] = x_bytes / (stats["spatial_sum_us"] * 1e-6) / 1e9
        stats["spatial_sum_frac_of_copy"] = stats["spatial_sum_gbps"] / stats["copy_gbps"]
    return stats


ROW_KEYS = ("eager_ms", "compile_ms", "fused_ms", "speedup", "eager_loop_us", "fused_loop_us",
            "loop_speedup", "host_us", "relerr_fp64", "eager_relerr_fp64", "abserr_fp64",
            "eager_abserr_fp64", "relerr_running_var",
            "eager_relerr_running_var", "grad_relerr", "eager_grad_relerr", "grad_relerrs",
            "eager_grad_relerrs", "peak_mib", "eager_peak_mib", "reps", "loop_calls",
            "late_calls", "error")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def new_row(name, problem: Problem, mode, pass_name, algo, dtype, meta) -> dict:
    row = {"shape": name, "dims": problem._asdict(), "scale": SCALE, "dtype": dtype_name(dtype),
           "mode": mode, "pass": pass_name, "algo": algo}
    row.update(dict.fromkeys(ROW_KEYS))
    row.update(meta)
    return row


class Setup(NamedTuple):
    """What one (problem, dtype)'s measurements share."""
    ref: nn.Module                 # the Reference, in dtype
    fused: nn.Module               # fused_ops.ConvTransposeBNPool3d with the same state
    compiled: Optional[Callable]   # torch.compile(ref), or None with --no-compile
    state: dict                    # the starting state_dict of both
    ring: InputRing                # the timed inputs
    x_check: torch.Tensor          # the accuracy check's input
    grad: torch.Tensor             # out's gradient in every step (timed and checked)
    dtype: torch.dtype


def setup_problem(name, problem: Problem, modules, dtype, args) -> Setup:
    """modules (float32) cast to dtype as module.to(dtype) does (batch norm included), and
    inputs in dtype."""
    ref, fused = (copy.deepcopy(module).to(dtype) for module in modules)
    shape = problem.x_shape
    min_ring_bytes = 3 * l2_bytes() if args.device == "cuda" else 0
    compile_it = not args.no_compile and (not args.compile_problems
                                          or name in args.compile_problems.split(","))
    ring = InputRing(shape, args.device, min_ring_bytes, args.memory_format, dtype)
    x_check = torch.randn(math.prod(shape), device=args.device, dtype=dtype)
    # In dtype, as x_check: the float64 run sees the same values, so errors measure the step.
    grad = torch.randn(problem.B, problem.Co, 1, 1, 1, device=args.device, dtype=dtype)
    return Setup(ref, fused, torch.compile(ref, dynamic=False) if compile_it else None,
                 copy.deepcopy(ref.state_dict()), ring,
                 as_memory_format(x_check, shape, args.memory_format), grad, dtype)


class ForwardPass:
    """One call of the module under torch.no_grad(): output and running statistics."""
    name = "forward"
    grad_mode = torch.no_grad

    def __init__(self, setup: Setup):
        self.setup = setup

    def calls(self, fn: Callable, module: nn.Module):
        """(timed call, its input supplier, an eager loop's call) for fn, which runs module."""
        return fn, self.setup.ring.next, fn

    def check(self, module: nn.Module, dtype=None):
        return one_call(module, self.setup.x_check, dtype)

    @staticmethod
    def set_accuracy(row, prefix, got, expected):
        """relerr of one call's output (and running_var in train mode) against float64."""
        if got is not None and expected is not None:
            # Training at batch 1 pools each channel's normalized output to its BatchNorm bias,
            # 0 here: no relative error exists, the absolute one is recorded instead.
            if expected[0].count_nonzero() == 0:
                row[prefix + "abserr_fp64"] = got[0].double().abs().max().item()
                row[prefix + "relerr_fp64"] = None
            else:
                row[prefix + "relerr_fp64"] = relerr(got[0], expected[0])
            train = row["mode"] == "train"
            row[prefix + "relerr_running_var"] = relerr(got[1], expected[1]) if train else None


class StepPass(ForwardPass):
    """One training step: the forward with gradients for x and the parameters, then
    out.backward(grad). The parameters' grads are set to None before each step, as by
    optimizer.zero_grad(), so each step allocates them rather than accumulating."""
    name = "step"
    grad_mode = torch.enable_grad

    def calls(self, fn: Callable, module: nn.Module):
        grad, ring = self.setup.grad, self.setup.ring

        def step(x):
            # A fresh leaf per step: x's gradient is computed, as for a layer inside a
            # network, and freed with the leaf rather than kept on the rotated input.
            fn(x.detach().requires_grad_()).backward(grad)

        def next_input():  # called outside the timed region
            module.zero_grad(set_to_none=True)
            return ring.next()

        def loop_step(x):  # a loop's inputs are taken up front: each step zeroes for itself
            module.zero_grad(set_to_none=True)
            step(x)
        return step, next_input, loop_step

    def check(self, module: nn.Module, dtype=None):
        return step_grads(module, self.setup.x_check, self.setup.grad, dtype)

    @staticmethod
    def set_accuracy(row, prefix, got, expected):
        """Each gradient's error (grad_relerrs) and the largest, the train-mode conv bias's
        (exactly 0) left out of the largest."""
        if got is not None and expected is not None:
            train = row["mode"] == "train"
            errors = grad_relerrs(got, expected, train)
            row[prefix + "grad_relerrs"] = errors
            row[prefix + "grad_relerr"] = max(error for name, error in errors.items()
                                              if not (train and name == "conv_bias"))


PASSES = {"forward": ForwardPass, "step": StepPass}


def ms_of(timing: Optional[Timing]):
    return None if timing is None else timing.ms


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def time_loop(errors, what, clock: Clock, fn, next_input, timing: Optional[Timing]):
    """(wall µs per call of an eager loop, calls per loop), or Nones if timing failed."""
    if timing is None:
        return None, None
    calls = loop_calls(timing)
    return attempt(errors, what, lambda: clock.loop_us(fn, next_input, calls)), calls


class Baseline(NamedTuple):
    """The unfused module's measurements, shared by the rows of one (problem, dtype, mode)."""
    expected: object            # the pass's float64 check (ForwardPass.check, StepPass.check)
    out: object                 # the same, in the module's dtype
    eager: Optional[Timing]
    loop_us: Optional[float]
    loop_calls: Optional[int]
    peak_mib: Optional[float]
    compiled: Optional[Timing]


def measure_baseline(errors, setup: Setup, pass_: ForwardPass, args, clock: Clock) -> Baseline:
    ref = setup.ref
    expected = attempt(errors, "float64 reference", lambda: pass_.check(ref, torch.float64))
    out = attempt(errors, "eager accuracy", lambda: pass_.check(ref))
    call, next_input, loop_call = pass_.calls(ref, ref)
    eager = attempt(errors, "eager", lambda: clock.measure(call, next_input, args.reps))
    loop_us, calls = time_loop(errors, "eager loop", clock, loop_call, next_input, eager)
    peak = attempt(errors, "eager peak", lambda: clock.peak_mib(call, next_input()))
    comp = None
    if setup.compiled is not None:
        call, next_input, _ = pass_.calls(setup.compiled, ref)  # compiled shares ref's parameters
        comp = attempt(errors, "compile", lambda: clock.measure(call, next_input, args.reps))
    return Baseline(expected, out, eager, loop_us, calls, peak, comp)


def fused_row(row: dict, base: Baseline, errors, setup: Setup, pass_: ForwardPass, args,
              clock: Clock) -> dict:
    """Fills row (a new_row) with the fused module's measurements at row's algo."""
    fused, algo = setup.fused, row["algo"]
    fused.load_state_dict(setup.state)
    fused.algo = algo
    got = attempt(errors, f"fused accuracy ({algo})", lambda: pass_.check(fused))
    call, next_input, loop_call = pass_.calls(fused, fused)
    timing = attempt(errors, f"fused ({algo})", lambda: clock.measure(call, next_input, args.reps))
    loop_us, calls = time_loop(errors, f"fused loop ({algo})", clock, loop_call, next_input, timing)
    eager = base.eager
    row.update(eager_ms=ms_of(eager), compile_ms=ms_of(base.compiled), fused_ms=ms_of(timing),
               speedup=ratio(ms_of(eager), ms_of(timing)), eager_loop_us=base.loop_us,
               fused_loop_us=loop_us, loop_speedup=ratio(base.loop_us, loop_us),
               host_us=timing and timing.host_us, eager_peak_mib=base.peak_mib,
               reps={"eager": eager and eager.reps, "compile": base.compiled and base.compiled.reps,
                     "fused": timing and timing.reps},
               loop_calls={"eager": base.loop_calls, "fused": calls},
               late_calls={"eager": eager and eager.late, "compile": base.compiled and base.compiled.late,
                           "fused": timing and timing.late})
    row["peak_mib"] = attempt(errors, f"fused peak ({algo})",
                              lambda: clock.peak_mib(call, next_input()))
    pass_.set_accuracy(row, "", got, base.expected)
    pass_.set_accuracy(row, "eager_", base.out, base.expected)
    return row


def bench_pass(name, problem, mode, pass_: ForwardPass, args, clock, meta) -> List[dict]:
    """The rows of one (problem, dtype, mode, pass): eager and compile once, the fused
    module per algo."""
    errors, setup = [], pass_.setup
    set_mode(mode, setup.state, setup.ref, setup.fused)
    # Eval mode needs no convolution and ignores algo, so only train varies it.
    algos = args.algos if mode == "train" else ["auto"]
    with pass_.grad_mode():
        base = measure_baseline(errors, setup, pass_, args, clock)
        rows = [pass_row(name, problem, mode, algo, pass_, base, errors, args, clock, meta)
                for algo in algos]
    for module in (setup.ref, setup.fused):  # the last step's grads, no longer needed
        module.zero_grad(set_to_none=True)
    return rows


def pass_row(name, problem, mode, algo, pass_: ForwardPass, base, errors, args, clock,
             meta) -> dict:
    """The row of one algo: the fused module's measurements, with base's and the bandwidth."""
    setup, row_errors = pass_.setup, list(errors)
    row = fused_row(new_row(name, problem, mode, pass_.name, algo, setup.dtype, meta), base,
                    row_errors, setup, pass_, args, clock)
    if (args.device == "cuda" and name == "seed" and mode == "eval" and pass_.name == "forward"
            and setup.dtype == torch.float32):
        x_bytes = setup.x_check.numel() * setup.x_check.element_size()
        stats = attempt(row_errors, "bandwidth",
                        lambda: bandwidth_stats(setup.fused, setup.ring, x_bytes, clock))
        row.update(stats or {})
    row["error"] = "; ".join(row_errors) or None
    return row


def failed_rows(name, problem, dtype, args, meta, error) -> List[dict]:
    rows = [new_row(name, problem, mode, pass_name, "auto", dtype, meta)
            for mode in args.modes for pass_name in args.passes]
    for row in rows:
        row["error"] = error
    return rows


def bench_dtype(name, problem, modules, dtype, args, clock, meta) -> List[dict]:
    # A fresh Dynamo cache per problem and dtype: no recompile limit reached over the sweep,
    # and no automatic dynamic shapes (each gets a static-shape graph, as in real use).
    torch._dynamo.reset()
    errors = []
    setup = attempt(errors, "setup", lambda: setup_problem(name, problem, modules, dtype, args))
    if setup is None:
        return failed_rows(name, problem, dtype, args, meta, errors[0])
    rows = []
    for mode in args.modes:
        for pass_name in args.passes:
            started = time.perf_counter()
            pass_rows = bench_pass(name, problem, mode, PASSES[pass_name](setup), args, clock, meta)
            rows += pass_rows
            print(f"[{name} {mode} {pass_name} {dtype_name(dtype)}] "
                  + ", ".join(progress(r) for r in pass_rows)
                  + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
    del setup
    free_memory()
    return rows


def bench_problem(name, problem: Problem, args, clock, meta) -> List[dict]:
    errors = []
    # Built once in float32, so that every dtype starts from the same weights.
    modules = attempt(errors, "setup", lambda: build_modules(problem, args.device))
    rows = []
    for dtype in args.dtypes:
        if modules is None:
            rows += failed_rows(name, problem, dtype, args, meta, errors[0])
        else:
            rows += bench_dtype(name, problem, modules, dtype, args, clock, meta)
    return rows


def fmt(value, spec) -> str:
    return "-" if value is None else format(value, spec)


def progress(row) -> str:
    error = (f"relerr {fmt(row['relerr_fp64'], '.1e')}" if row["pass"] == "forward"
             else f"grad relerr {fmt(row['grad_relerr'], '.1e')}")
    text = (f"{row['algo']}: eager {fmt(row['eager_ms'], '.3f')} ms, compile {fmt(row['compile_ms'], '.3f')} ms,"
            f" fused {fmt(row['fused_ms'], '.3f')} ms, loop {fmt(row['eager_loop_us'], '.1f')}"
            f" / {fmt(row['fused_loop_us'], '.1f')} us, {error}")
    return text + (f" [errors: {row['error']}]" if row["error"] else "")


TABLE = (("shape", 9, "s"), ("mode", 5, "s"), ("pass", 7, "s"), ("dtype", 8, "s"), ("algo", 11, "s"),
         ("eager_ms", 9, ".3f"), ("compile_ms", 10, ".3f"), ("fused_ms", 9, ".3f"),
         ("speedup", 8, ".1f"), ("eager_loop_us", 13, ".1f"), ("fused_loop_us", 13, ".1f"),
         ("loop_speedup", 12, ".1f"), ("relerr_fp64", 11, ".1e"), ("grad_relerr", 11, ".1e"),
         ("peak_mib", 9, ".1f"))


def print_table(rows):
    # The shape column as wide as the longest name (the real sweep's are long).
    widths = [max([width] + [len(row[key]) for row in rows]) if spec == "s" else width
              for key, width, spec in TABLE]

    def line(cells):  # text columns left-aligned, numbers right-aligned
        return " ".join(f"{cell:{'<' if spec == 's' else '>'}{width}}"
                        for cell, width, (_, _, spec) in zip(cells, widths, TABLE))
    print(line([key for key, _, _ in TABLE]))
    for row in rows:
        print(line([fmt(row[key], spec) for key, _, spec in TABLE]))


def parse_list(text: str, allowed, what: str) -> List[str]:
    items = [item for item in text.split(",") if item]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise SystemExit(f"unknown {what} {unknown or text!r}; choose from {', '.join(allowed)}")
    return items


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sweep", choices=tuple(SWEEPS), default="seed",
                        help="default problem list: seed (one axis varied at a time) or real"
                             " (decoder layers); bench/problems.py")
    parser.add_argument("--problems", help="comma-separated names (default: the sweep's for the device)")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--passes", default="forward",
                        help="comma-separated: forward (a call under no_grad) and/or step (forward"
                             " with gradients, then backward)")
    parser.add_argument("--dtypes", default="float32",
                        help="comma-separated dtypes of x and both modules (float32, bfloat16, float16)")
    parser.add_argument("--reps", type=int, help="timed calls per measurement (default 50 on CUDA, 10 on CPU)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--compile-problems",
                        help="comma-separated problems that time torch.compile (default: all)")
    parser.add_argument("--algos", default="auto", help="train-mode algos of the fused op")
    parser.add_argument("--backward", default="auto",
                        choices=("auto", *fused_ops._backward_routes.ROUTES),
                        help="training backward's route for the fused op (fused_ops.testing.route)")
    parser.add_argument("--memory-format", choices=MEMORY_FORMATS, default="contiguous",
                        help="layout of every input x, for all three implementations")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    names = (parse_list(args.problems, ALL_PROBLEMS, "problem") if args.problems
             else list(default_problems(args.sweep, args.device)))
    args.problems = {name: ALL_PROBLEMS[name] for name in names}
    args.modes = parse_list(args.modes, MODES, "mode")
    args.passes = parse_list(args.passes, PASS_NAMES, "pass")
    args.dtypes = [DTYPES[name] for name in parse_list(args.dtypes, DTYPES, "dtype")]
    args.algos = parse_list(args.algos, ALGOS, "algo")
    if args.reps is None:
        args.reps = 50 if args.device == "cuda" else 10
    return args


def describe(name, problem: Problem) -> str:
    """The name, dims and the conv options that differ from ConvTranspose3d's defaults."""
    options = "".join(f" {key} {value}" for key, value in problem.conv_options().items()
                      if value != Problem._field_defaults[key])
    return f"{name} {problem.dims}{options}"


def print_header(args, clock, meta):
    print(f"fused_ops.ct_bn_pool benchmark on {meta['gpu']}, torch {meta['torch']}, {meta['date']}")
    print(f"{args.sweep} sweep; problems (B, Ci, Co, D, H, W, k), scale {SCALE},"
          f" {', '.join(map(dtype_name, args.dtypes))}, x {args.memory_format}: "
          + "; ".join(describe(name, problem) for name, problem in args.problems.items()))
    if args.device == "cuda":
        print(f"timing: CUDA events around each call; before each call torch.cuda._sleep of "
              f">= {SLEEP_US:.0f} us ({clock.cycles_per_us:.0f} cycles/us) hides host launch overhead;"
              f" inputs rotated over >= {MIN_INPUTS} tensors totalling >= 3 x L2 ({l2_bytes() / 2**20:.0f} MiB);"
              f" median of {args.reps} calls ({SLOW_CALL_REPS} for calls > {SLOW_CALL_MS:.0f} ms)"
              f" after {WARMUP_CALLS} warm-up calls")
    else:
        print(f"timing: wall clock around each call, inputs rotated over {MIN_INPUTS} tensors,"
              f" median of {args.reps} calls after {WARMUP_CALLS} warm-up calls")
    print("loop: wall time per call of calls issued back to back, then one synchronize;"
          " median of 3 loops")
    print("forward: calls under torch.no_grad(); step: x.requires_grad_(), forward, out.backward(grad)"
          " with a fixed grad, grads set to None before each step (outside the timing);"
          " PyTorch's default settings (TF32 flags untouched)", flush=True)


def result_path(args, meta) -> Path:
    sweep = "" if args.sweep == "seed" else "-" + args.sweep
    layout = "" if args.memory_format == "contiguous" else "-" + args.memory_format
    step = "-step" if "step" in args.passes else ""
    backward = "" if args.backward == "auto" else "-" + args.backward
    return args.out / f"{meta['gpu']}-{meta['date']}{sweep}{layout}{step}{backward}.json"


def main():
    args = parse_args()
    torch.manual_seed(0)
    if args.device == "cuda":
        gpu = torch.cuda.get_device_name(0).lower().replace(" ", "-")
        clock = CudaClock()
    else:
        gpu, clock = "cpu", CpuClock()
    meta = {"gpu": gpu, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "sweep": args.sweep, "memory_format": args.memory_format, "backward": args.backward,
            "command": " ".join(["python"] + sys.argv)}
    print_header(args, clock, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    path = result_path(args, meta)
    rows = []
    # No autograd graph outside the step pass (which enables grad for itself): forward rows
    # build none for the reference either.
    with torch.no_grad(), fused_ops.testing.route(backward=args.backward):
        for name, problem in args.problems.items():
            rows += bench_problem(name, problem, args, clock, meta)
            path.write_text(json.dumps(rows, indent=1) + "\n")  # after each problem: a crash keeps the rest
    print()
    print_table(rows)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
