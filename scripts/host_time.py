#!/usr/bin/env python
"""Host time per call of the op and the module (issue: host cost), by the CPU profiler.

    python scripts/host_time.py [--device cuda|cpu] [--calls N]

For each case: the median wall time of issuing one call (perf_counter around the call, the
GPU kept busy so that no call waits for it), the time per call of back-to-back loops (the
fastest of 5; on CUDA one synchronization per loop, so this is the eager loop's pace), the
ATen ops each call dispatches and the host time of the op's dispatch under torch.profiler
(CPU activity). Cases: a tiny problem (host time alone), the seed problem and padded/strided
training problems; the raw op, and the module under no_grad and with gradients;
--reduce-overhead adds the module under torch.compile(mode="reduce-overhead") (CUDA graph
trees, under no_grad; compiling takes tens of seconds per problem and mode).
"""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fused_ops

# name -> (B, Ci, Co, size, k, conv options)
PROBLEMS = {
    "tiny": (1, 2, 2, 2, 2, {}),
    "seed": (16, 64, 128, (16, 32, 32), 5, {}),
    "t8pad1": (8, 32, 32, 8, 3, {"padding": 1}),
    "up2": (8, 64, 32, 16, 2, {"stride": 2}),
    "k4s2p1": (8, 64, 32, 16, 4, {"stride": 2, "padding": 1}),
}


def make(name, device):
    batch, ci, co, size, k, options = PROBLEMS[name]
    size = size if isinstance(size, tuple) else (size,) * 3
    module = fused_ops.ConvTransposeBNPool3d(ci, co, k, 2.0, **options).to(device)
    return module, torch.randn(batch, ci, *size, device=device)


def raw_call(module):
    c, bn = module.conv_transpose, module.batch_norm
    op = torch.ops.fused_ops.ct_bn_pool.default
    rest = (bn.weight, bn.bias, bn.running_mean, bn.running_var, module.training, 0.1, bn.eps)
    options = dict(stride=c.stride, padding=c.padding, output_padding=c.output_padding,
                   dilation=c.dilation, groups=c.groups)
    return lambda x: op(x, c.weight, c.bias, 2.0, *rest, **options)


def issue_us(fn, x, calls, device):
    """Median wall time of issuing one call; each call issued behind a GPU sleep long enough
    that the host never waits for the device."""
    times = []
    for _ in range(calls):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)  # ~10 ms: longer than any issue measured here
        start = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - start) * 1e6)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def loop_us(fn, x, calls, device):
    """Time per call of `calls` back-to-back calls, the fastest of 5 loops."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def profiled(fn, x, calls, device):
    """(ATen ops per call, host µs per call of the op's dispatch) from torch.profiler."""
    activities = [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn(x)
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    op = [e for e in events if e.key.startswith("fused_ops::ct_bn_pool")]
    op_us = max((e.cpu_time_total for e in op), default=0.0) / calls
    return aten / calls, op_us


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--reduce-overhead", action="store_true",
                        help="also time the module compiled with mode='reduce-overhead' (CUDA)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # host time, not the CPU kernels' parallelism
    print(f"host time per call, torch {torch.__version__}, {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    print(f"{'problem':8} {'mode':5} {'form':16} {'issue us':>9} {'loop us':>9} {'aten ops':>9}"
          f" {'op us':>8}")
    for name in args.problems.split(","):
        module, x = make(name, args.device)
        for mode in ("eval", "train"):
            module.train(mode == "train")
            state = {k: v.clone() for k, v in module.state_dict().items()}
            forms = [("raw op, no_grad", raw_call(module), False),
                     ("module, no_grad", module, False), ("module, grad", module, True)]
            if args.reduce_overhead and args.device == "cuda":
                torch._dynamo.reset()
                forms.append(("reduce-overhead", torch.compile(module, mode="reduce-overhead"),
                              False))
            for form, fn, grad in forms:
                with torch.set_grad_enabled(grad):
                    for _ in range(3):  # plans, tables, lazy initialization; graph recording
                        fn(x)
                    calls = args.calls if name == "tiny" else max(20, args.calls // 10)
                    us = issue_us(fn, x, calls, args.device)
                    loop = loop_us(fn, x, calls, args.device)
                    ops, op_us = profiled(fn, x, 20, args.device)
                print(f"{name:8} {mode:5} {form:16} {us:9.1f} {loop:9.1f} {ops:9.1f} {op_us:8.1f}",
                      flush=True)
            module.load_state_dict(state)


if __name__ == "__main__":
    main()
