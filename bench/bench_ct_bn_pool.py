#!/usr/bin/env python
"""Benchmark of fused_ops.ct_bn_pool against PyTorch eager and torch.compile.

    python bench/bench_ct_bn_pool.py [--device cuda|cpu] [--problems seed,b4,...]
        [--modes eval,train] [--reps N] [--no-compile] [--algos auto,fft,direct,sliced_conv]
        [--memory-format contiguous|channels_last_3d] [--out bench/results]

For every problem and mode it times the unfused PyTorch module (eager and torch.compile)
and the fused module, checks both against a float64 run of the same module, and writes
one JSON row per (problem, mode, algo) to <out>/<gpu>-<date>.json. See bench/README.md.
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

SCALE = 2.0

# name -> (B, Ci, Co, D, H, W, k); the seed problem first, then one axis varied at a time.
CUDA_PROBLEMS = {
    "seed": (16, 64, 128, 16, 32, 32, 5),
    "b4": (4, 64, 128, 16, 32, 32, 5),
    "b64": (64, 64, 128, 16, 32, 32, 5),
    "c16": (16, 16, 32, 16, 32, 32, 5),
    "c128": (16, 128, 256, 16, 32, 32, 5),
    "s8": (16, 64, 128, 8, 16, 16, 5),
    "s32": (8, 64, 128, 32, 32, 32, 5),
    "k3": (16, 64, 128, 16, 32, 32, 3),
    "odd": (3, 5, 7, 9, 11, 13, (2, 3, 4)),
    "t8": (8, 16, 16, 8, 8, 8, 3),    # small problems between odd and s8, where launch
    "t8c32": (8, 32, 32, 8, 8, 8, 3),  # latency rather than work decides
    "t8c64": (8, 64, 64, 8, 8, 8, 3),  # and two more between t8c32 and s8, where the direct
    "t8k5": (8, 32, 32, 8, 8, 8, 5),   # kernel and the FFT path cross (the CUDA auto rule)
    "st2": (8, 32, 64, 16, 16, 16, 4),
    "up2": (8, 64, 32, 16, 16, 16, 2),  # a decoder's upsampling: kernel = stride
    "pad2": (16, 64, 128, 16, 32, 32, 5),  # the seed problem with padding 2 (same-size output)
    "t8pad1": (8, 32, 32, 8, 8, 8, 3),     # t8c32 with padding 1
}
# ConvTranspose3d stride of the problems that have one (else 1): the phases of the FFT and
# correlation paths (docs/math.md §3.3.1, §3.4).
STRIDES = {"st2": 2, "up2": 2, "cpu_st2": 2, "cpu_up2": 2}
# ConvTranspose3d padding of the problems that have one (else 0): configurations the FFT,
# correlation and cross-spectrum paths do not cover (`auto`: direct or sliced_conv).
PADDINGS = {"pad2": 2, "t8pad1": 1}


def conv_options(name):
    """The stride and padding of a bench problem."""
    return dict(stride=STRIDES.get(name, 1), padding=PADDINGS.get(name, 0))
CPU_PROBLEMS = {
    "cpu_small": (4, 16, 32, 8, 16, 16, 3),
    "cpu_mid": (8, 32, 64, 8, 16, 16, 5),
    "cpu_st2": (4, 16, 32, 8, 8, 8, 4),
    "cpu_up2": (4, 32, 16, 8, 8, 8, 2),
}
DIM_NAMES = ("B", "Ci", "Co", "D", "H", "W", "k")
MODES = ("eval", "train")
ALGOS = ("auto", "fft", "direct", "sliced_conv", "correlation", "cross_spectrum", "border")
MEMORY_FORMATS = ("contiguous", "channels_last_3d")

WARMUP_CALLS = 5
SLEEP_US = 100.0         # GPU busy-wait enqueued before each timed CUDA call (see CudaClock)
SLOW_CALL_MS = 20.0      # a call slower than this after warm-up ...
SLOW_CALL_REPS = 5       # ... is timed only this many times, to bound the sweep's duration
MIN_INPUTS = 6
L2_FALLBACK_BYTES = 60 * 2**20
INPUT_ALIGN = 128        # elements (512 B): each rotated input starts aligned like a fresh allocation
PROFILE_CALLS = 20
COPY_BYTES = 2**30
COPY_REPS = 20


class Reference(nn.Module):
    """The unfused pattern that fused_ops.ConvTransposeBNPool3d replaces."""

    def __init__(self, in_channels, out_channels, kernel_size, scale_factor, eps=1e-5, momentum=0.1,
                 stride=1, padding=0):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(in_channels, out_channels, kernel_size, stride, padding)
        self.scale_factor = scale_factor
        self.batch_norm = nn.BatchNorm3d(out_channels, eps=eps, momentum=momentum)
        self.global_avg_pool = nn.AdaptiveAvgPool3d((1, 1, 1))

    def forward(self, x):
        return self.global_avg_pool(self.batch_norm(self.conv_transpose(x) * self.scale_factor))


class Timing(NamedTuple):
    ms: float                  # median device time of one call (CPU: wall time)
    host_us: Optional[float]   # median wall time of issuing one call, without sync (CUDA only)
    reps: int
    late: Optional[int] = None  # timed calls whose issue outlasted the GPU sleep (CUDA only)


class InputRing:
    """Distinct inputs used round-robin, so a timed call never reads an x that is cache-resident.

    The inputs are views into one buffer (cheap even when thousands are needed for a
    small x), each starting INPUT_ALIGN-aligned like a fresh allocation, so the fused
    kernels and Inductor see the alignment they would in real use.
    """

    def __init__(self, shape, device, min_total_bytes, memory_format="contiguous"):
        numel = math.prod(shape)
        slot = -(-numel // INPUT_ALIGN) * INPUT_ALIGN
        count = max(MIN_INPUTS, math.ceil(min_total_bytes / (numel * 4)))
        buffer = torch.randn(count * slot, device=device)
        self.inputs = [as_memory_format(buffer[i * slot:i * slot + numel], shape, memory_format)
                       for i in range(count)]
        self.index = 0

    def next(self) -> torch.Tensor:
        x = self.inputs[self.index]
        self.index = (self.index + 1) % len(self.inputs)
        return x


def as_memory_format(flat, shape, memory_format):
    """flat viewed as [B, C, D, H, W] in memory_format (channels_last_3d: [B, D, H, W, C] in memory)."""
    if memory_format == "contiguous":
        return flat.view(shape)
    batch, channels, *size = shape
    return flat.view(batch, *size, channels).permute(0, 4, 1, 2, 3)


class Clock:
    """Times one callable: a first call (compilation, lazy init), warm-up, then median of reps."""

    def measure(self, fn: Callable, next_input: Callable, reps: int) -> Timing:
        fn(next_input())
        self.sync()
        warm_ms, warm_host_us = self.timed_calls(fn, next_input, WARMUP_CALLS, SLEEP_US)
        if warm_ms[-1] > SLOW_CALL_MS:
            reps = min(reps, SLOW_CALL_REPS)
        if warm_host_us is None:
            ms, _ = self.timed_calls(fn, next_input, reps, SLEEP_US)
            return Timing(statistics.median(ms), None, reps)
        # The sleep must outlast issuing the call, or launch gaps would be timed: twice the
        # slowest warm-up issue (1.5x the median let a sweep's later eval rows, issued in
        # 150-160 us, be timed with launch gaps: k3 read 80 us against 27 us).
        sleep_us = max(SLEEP_US, 2 * max(warm_host_us))
        ms, host_us = self.timed_calls(fn, next_input, reps, sleep_us)
        late = sum(us > sleep_us for us in host_us)
        return Timing(statistics.median(ms), statistics.median(host_us), reps, late)

    def sync(self):
        pass

    def timed_calls(self, fn, next_input, count, sleep_us):
        """Returns per-call times in ms and per-call issue times in µs (None if not separate)."""
        raise NotImplementedError

    def peak_mib(self, fn, x) -> Optional[float]:
        return None


class CpuClock(Clock):
    def timed_calls(self, fn, next_input, count, sleep_us):
        times = []
        for _ in range(count):
            x = next_input()
            start = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - start) * 1e3)
        return times, None


class CudaClock(Clock):
    """CUDA events around each call, each call preceded by a GPU busy-wait.

    torch.cuda._sleep keeps the GPU busy while the host enqueues the start event, the
    call's kernels and the end event; when the sleep ends they run back to back, so the
    events measure GPU time without host launch overhead (which is reported apart as
    host_us). The sleep lasts SLEEP_US, or twice the slowest warm-up call's issue if longer
    (Clock.measure).
    Each call starts on an idle GPU: queued behind earlier calls, a call whose GPU time
    exceeds its issue time filled the launch queue and its host_us measured the wait
    (fft on c128 read 11.5 ms, its GPU time 10.5 ms).
    """

    def __init__(self):
        self.cycles_per_us = self._calibrate()

    @staticmethod
    def _calibrate() -> float:
        cycles = 1_000_000
        torch.cuda._sleep(cycles)  # first use loads the kernel
        samples = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        return cycles / statistics.median(samples)

    def sync(self):
        torch.cuda.synchronize()

    def timed_calls(self, fn, next_input, count, sleep_us):
        sleep_cycles = int(sleep_us * self.cycles_per_us)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(count)]
        host_us = []
        for start, end in events:
            x = next_input()
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            start.record()
            issued = time.perf_counter()
            fn(x)
            host_us.append((time.perf_counter() - issued) * 1e6)
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events], host_us

    def peak_mib(self, fn, x) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20


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


def build_modules(dims, device, stride=1, padding=0):
    """The reference (default init) and the fused module loaded with its state_dict."""
    _, ci, co, _, _, _, k = dims
    ref = Reference(ci, co, k, SCALE, stride=stride, padding=padding).to(device)
    bn = ref.batch_norm
    # Non-trivial BatchNorm state, so eval mode does not just see mean 0 / var 1. The bias
    # stays 0: a constant added exactly to every output would dilute the relative error.
    bn.weight.data.uniform_(0.5, 1.5)
    bn.running_mean.normal_(0.0, 0.1)
    bn.running_var.uniform_(0.5, 1.5)
    fused = fused_ops.ConvTransposeBNPool3d(ci, co, k, SCALE, stride=stride, padding=padding).to(device)
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


def bandwidth_stats(fused, ring: InputRing, x_numel: int, clock: CudaClock) -> dict:
    stats = kernel_stats(fused, ring)
    stats["copy_gbps"] = copy_gbps(clock)
    if stats["spatial_sum_us"]:
        stats["spatial_sum_gbps"] = x_numel * 4 / (stats["spatial_sum_us"] * 1e-6) / 1e9
        stats["spatial_sum_frac_of_copy"] = stats["spatial_sum_gbps"] / stats["copy_gbps"]
    return stats


ROW_KEYS = ("eager_ms", "compile_ms", "fused_ms", "speedup", "host_us", "relerr_fp64",
            "eager_relerr_fp64", "relerr_running_var", "eager_relerr_running_var", "peak_mib",
            "eager_peak_mib", "reps", "late_calls", "error")


def new_row(name, dims, mode, algo, meta) -> dict:
    row = {"shape": name, "dims": dict(zip(DIM_NAMES, dims), **conv_options(name)),
           "scale": SCALE, "dtype": "float32",
           "mode": mode, "algo": algo}
    row.update(dict.fromkeys(ROW_KEYS))
    row.update(meta)
    return row


class Setup(NamedTuple):
    """What one problem's measurements share."""
    ref: nn.Module                 # the Reference, float32
    fused: nn.Module               # fused_ops.ConvTransposeBNPool3d with the same state
    compiled: Optional[Callable]   # torch.compile(ref), or None with --no-compile
    state: dict                    # the starting state_dict of both
    ring: InputRing                # the timed inputs
    x_check: torch.Tensor          # the accuracy check's input


def setup_problem(name, dims, args) -> Setup:
    batch, ci, _, d, h, w, _ = dims
    shape = (batch, ci, d, h, w)
    ref, fused = build_modules(dims, args.device, **conv_options(name))
    l2_bytes = 0
    if args.device == "cuda":
        l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK_BYTES
    compile_it = not args.no_compile and (not args.compile_problems
                                          or name in args.compile_problems.split(","))
    return Setup(ref, fused, torch.compile(ref, dynamic=False) if compile_it else None,
                 copy.deepcopy(ref.state_dict()),
                 InputRing(shape, args.device, 3 * l2_bytes, args.memory_format),
                 as_memory_format(torch.randn(math.prod(shape), device=args.device), shape,
                                  args.memory_format))


def set_accuracy(row, prefix, got, expected, train):
    """relerr of one call's output (and running_var in train mode) against float64."""
    if got is not None and expected is not None:
        row[prefix + "relerr_fp64"] = relerr(got[0], expected[0])
        row[prefix + "relerr_running_var"] = relerr(got[1], expected[1]) if train else None


def ms_of(timing: Optional[Timing]):
    return None if timing is None else timing.ms


def bench_mode(name, dims, mode, args, clock, meta, setup: Setup) -> List[dict]:
    """The rows of one (problem, mode): eager and compile once, the fused module per algo."""
    errors = []
    ref, fused, compiled, ring = setup.ref, setup.fused, setup.compiled, setup.ring
    set_mode(mode, setup.state, ref, fused)
    train = mode == "train"
    expected = attempt(errors, "float64 reference", lambda: one_call(ref, setup.x_check, torch.float64))
    eager_out = attempt(errors, "eager accuracy", lambda: one_call(ref, setup.x_check))
    eager = attempt(errors, "eager", lambda: clock.measure(ref, ring.next, args.reps))
    eager_peak = attempt(errors, "eager peak", lambda: clock.peak_mib(ref, ring.next()))
    comp = None
    if compiled is not None:
        comp = attempt(errors, "compile", lambda: clock.measure(compiled, ring.next, args.reps))

    rows = []
    # Eval mode needs no convolution and ignores algo, so only train varies it.
    for algo in args.algos if train else ["auto"]:
        row_errors = list(errors)
        fused.load_state_dict(setup.state)
        fused.algo = algo
        got = attempt(row_errors, f"fused accuracy ({algo})", lambda: one_call(fused, setup.x_check))
        timing = attempt(row_errors, f"fused ({algo})", lambda: clock.measure(fused, ring.next, args.reps))
        row = new_row(name, dims, mode, algo, meta)
        row.update(eager_ms=ms_of(eager), compile_ms=ms_of(comp), fused_ms=ms_of(timing),
                   host_us=timing and timing.host_us, eager_peak_mib=eager_peak,
                   reps={"eager": eager and eager.reps, "compile": comp and comp.reps,
                         "fused": timing and timing.reps},
                   late_calls={"eager": eager and eager.late, "compile": comp and comp.late,
                               "fused": timing and timing.late})
        row["peak_mib"] = attempt(row_errors, f"fused peak ({algo})", lambda: clock.peak_mib(fused, ring.next()))
        if eager and timing:
            row["speedup"] = eager.ms / timing.ms
        set_accuracy(row, "", got, expected, train)
        set_accuracy(row, "eager_", eager_out, expected, train)
        if args.device == "cuda" and name == "seed" and mode == "eval":
            stats = attempt(row_errors, "bandwidth",
                            lambda: bandwidth_stats(fused, ring, setup.x_check.numel(), clock))
            row.update(stats or {})
        row["error"] = "; ".join(row_errors) or None
        rows.append(row)
    return rows


def bench_problem(name, dims, args, clock, meta) -> List[dict]:
    # A fresh Dynamo cache per problem: no recompile limit reached over the sweep, and no
    # automatic dynamic shapes (each problem gets a static-shape graph, as in real use).
    torch._dynamo.reset()
    errors = []
    setup = attempt(errors, "setup", lambda: setup_problem(name, dims, args))
    if setup is None:
        rows = [new_row(name, dims, mode, "auto", meta) for mode in args.modes]
        for row in rows:
            row["error"] = errors[0]
        return rows
    rows = []
    for mode in args.modes:
        started = time.perf_counter()
        mode_rows = bench_mode(name, dims, mode, args, clock, meta, setup)
        rows += mode_rows
        print(f"[{name} {mode}] " + ", ".join(progress(r) for r in mode_rows)
              + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
    del setup
    free_memory()
    return rows


def fmt(value, spec) -> str:
    return "-" if value is None else format(value, spec)


def progress(row) -> str:
    text = (f"{row['algo']}: eager {fmt(row['eager_ms'], '.3f')} ms, compile {fmt(row['compile_ms'], '.3f')} ms,"
            f" fused {fmt(row['fused_ms'], '.3f')} ms, relerr {fmt(row['relerr_fp64'], '.1e')}")
    return text + (f" [errors: {row['error']}]" if row["error"] else "")


TABLE = (("shape", 9, "s"), ("mode", 5, "s"), ("algo", 11, "s"), ("eager_ms", 9, ".3f"),
         ("compile_ms", 10, ".3f"), ("fused_ms", 9, ".3f"), ("speedup", 8, ".1f"),
         ("relerr_fp64", 11, ".1e"), ("peak_mib", 9, ".1f"))


def print_table(rows):
    def line(cells):  # text columns left-aligned, numbers right-aligned
        return " ".join(f"{cell:{'<' if spec == 's' else '>'}{width}}"
                        for cell, (_, width, spec) in zip(cells, TABLE))
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
    parser.add_argument("--problems", help="comma-separated names (default: all for the device)")
    parser.add_argument("--modes", default="eval,train")
    parser.add_argument("--reps", type=int, help="timed calls per measurement (default 50 on CUDA, 10 on CPU)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--compile-problems",
                        help="comma-separated problems that time torch.compile (default: all)")
    parser.add_argument("--algos", default="auto", help="train-mode algos of the fused op")
    parser.add_argument("--memory-format", choices=MEMORY_FORMATS, default="contiguous",
                        help="layout of every input x, for all three implementations")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    known = {**CUDA_PROBLEMS, **CPU_PROBLEMS}
    default = CUDA_PROBLEMS if args.device == "cuda" else CPU_PROBLEMS
    names = parse_list(args.problems, known, "problem") if args.problems else list(default)
    args.problems = {name: known[name] for name in names}
    args.modes = parse_list(args.modes, MODES, "mode")
    args.algos = parse_list(args.algos, ALGOS, "algo")
    if args.reps is None:
        args.reps = 50 if args.device == "cuda" else 10
    return args


def print_header(args, clock, meta):
    print(f"fused_ops.ct_bn_pool benchmark on {meta['gpu']}, torch {meta['torch']}, {meta['date']}")
    print(f"problems (B, Ci, Co, D, H, W, k), scale {SCALE}, float32, x {args.memory_format}:"
          f" {args.problems}")
    if args.device == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK_BYTES
        print(f"timing: CUDA events around each call; before each call torch.cuda._sleep of "
              f">= {SLEEP_US:.0f} us ({clock.cycles_per_us:.0f} cycles/us) hides host launch overhead;"
              f" inputs rotated over >= {MIN_INPUTS} tensors totalling >= 3 x L2 ({l2 / 2**20:.0f} MiB);"
              f" median of {args.reps} calls ({SLOW_CALL_REPS} for calls > {SLOW_CALL_MS:.0f} ms)"
              f" after {WARMUP_CALLS} warm-up calls")
    else:
        print(f"timing: wall clock around each call, inputs rotated over {MIN_INPUTS} tensors,"
              f" median of {args.reps} calls after {WARMUP_CALLS} warm-up calls")
    print("all calls under torch.no_grad(); PyTorch's default settings (TF32 flags untouched)", flush=True)


def main():
    args = parse_args()
    torch.manual_seed(0)
    if args.device == "cuda":
        gpu = torch.cuda.get_device_name(0).lower().replace(" ", "-")
        clock = CudaClock()
    else:
        gpu, clock = "cpu", CpuClock()
    meta = {"gpu": gpu, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "memory_format": args.memory_format, "command": " ".join(["python"] + sys.argv)}
    print_header(args, clock, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.memory_format == "contiguous" else "-" + args.memory_format
    path = args.out / f"{gpu}-{meta['date']}{suffix}.json"
    rows = []
    with torch.no_grad():  # forward-only benchmark: no autograd graph for the reference either
        for name, dims in args.problems.items():
            rows += bench_problem(name, dims, args, clock, meta)
            path.write_text(json.dumps(rows, indent=1) + "\n")  # after each problem: a crash keeps the rest
    print()
    print_table(rows)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
