"""Per-kernel GPU times of the fused op on a bench problem (torch.profiler), for tuning.

    python scripts/profile_seed.py [eval|train|step] [contiguous|channels_last_3d] [algo] [host|wall|ranges]
        [--problem NAME] [--no-overlap] [--backward ROUTE]

step: a training step (the forward with gradients for x and the parameters, then the backward
of a fixed output gradient) instead of a forward under no_grad; --backward forces its route
(fused_ops.testing.route(backward=ROUTE)). The kernel table also gives the share of the calls'
span in which the GPU ran a kernel: the rest is the GPU waiting for the host.

NAME is one of bench/bench_ct_bn_pool.py's CUDA problems (default: seed). --no-overlap runs
under fused_ops.testing.route(overlap="off") (csrc/common/cuda/pdl.cuh): the kernels that are
otherwise launched to overlap the one before run one after another, so that each kernel's time
excludes its wait for the previous one (with the overlap, the table's times include it, and
their sum exceeds the call).

With `host`, the table is the host side instead: ATen ops by self CPU time, how many
each call issues, and the wall time of issuing one call (no synchronization), with the GPU
busy and with it idle. With
`ranges`, the GPU time of the kernels under each of the op's own profiler ranges (those
csrc/border/border.cpp names: the full grid, the plane problems, the lines and corners). With
`wall`, only the wall time per call of 50 calls issued back to back (what an eager loop
of this op sees: the larger of its host and GPU time), no profiler.
"""
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fused_ops
import fused_ops.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_ct_bn_pool import CUDA_PROBLEMS, conv_options  # noqa: E402

argv = sys.argv[:]
overlap = "auto"
if "--no-overlap" in argv:
    argv.remove("--no-overlap")
    overlap = "off"
backward = "auto"
if "--backward" in argv:
    at = argv.index("--backward")
    backward = argv[at + 1]
    del argv[at:at + 2]
problem = "seed"
if "--problem" in argv:
    at = argv.index("--problem")
    problem = argv[at + 1]
    del argv[at:at + 2]
sys.argv = argv
batch, c_in, c_out, *size, kernel = CUDA_PROBLEMS[problem]
mode = sys.argv[1] if len(sys.argv) > 1 else "eval"
layout = sys.argv[2] if len(sys.argv) > 2 else "contiguous"
memory_format = {"contiguous": torch.contiguous_format,
                 "channels_last_3d": torch.channels_last_3d}[layout]
algo = sys.argv[3] if len(sys.argv) > 3 else "auto"
host = len(sys.argv) > 4 and sys.argv[4] == "host"
wall = len(sys.argv) > 4 and sys.argv[4] == "wall"
ranges = len(sys.argv) > 4 and sys.argv[4] == "ranges"
module = fused_ops.ConvTransposeBNPool3d(c_in, c_out, kernel, 2.0, **conv_options(problem),
                                         algo=algo).cuda().train(mode != "eval")
xs = [torch.randn(batch, c_in, *size, device="cuda").contiguous(memory_format=memory_format)
      for _ in range(6)]
calls = 30 if mode == "eval" else 10
grad_out = torch.randn(batch, c_out, 1, 1, 1, device="cuda")


def step(x):
    module.zero_grad(set_to_none=True)
    module(x.detach().requires_grad_()).backward(grad_out)


m = step if mode == "step" else module
grad_mode = torch.enable_grad() if mode == "step" else torch.no_grad()
with grad_mode, fused_ops.testing.route(overlap=overlap, backward=backward):
    for x in xs:
        m(x)
    torch.cuda.synchronize()
    if wall:
        walls = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(50):
                m(xs[i % len(xs)])
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / 50 * 1e3)
        walls.sort()
        print(f"wall: {problem} {mode} {algo}: {walls[2]:.3f} ms per call, 50 calls back to back (median of 5)")
        sys.exit(0)
    if host:
        # Issue time with the GPU kept busy (issuing never waits on it) and with it idle (after
        # a synchronize): the two can disagree (docs/performance.md, host time).
        for busy in (True, False):
            issue_us = []
            for i in range(calls):
                if busy:
                    torch.cuda._sleep(int(2e7))
                t0 = time.perf_counter()
                m(xs[i % len(xs)])
                issue_us.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
            issue_us.sort()
            state = "busy" if busy else "idle"
            print(f"host: issuing one call takes {issue_us[len(issue_us) // 2]:.0f} us with the GPU {state}"
                  f" (median of {calls})")
    activities = [ProfilerActivity.CPU] if host else [ProfilerActivity.CUDA]
    if ranges:
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for i in range(calls):
            m(xs[i % len(xs)])
        torch.cuda.synchronize()
events = prof.key_averages()
if host:
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / calls
    print(f"host: {ops:.0f} aten ops per call (nested ones included)")
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:40]
    print(f"{'us/call':>8} {'n/call':>6}  op (self CPU time)")
    for e in rows:
        print(f"{e.self_cpu_time_total / calls:8.1f} {e.count / calls:6.1f}  {e.key[:100]}")
elif ranges:  # the op's border ranges (csrc's RECORD_FUNCTION): the kernels launched under each
    def kernels_under(e):
        for k in e.kernels:
            yield k
        for c in e.cpu_children:
            yield from kernels_under(c)

    per_range = {}
    for e in prof.events():
        if e.name.startswith("fused_ops::border"):
            table = per_range.setdefault(e.name, {})
            for k in kernels_under(e):
                n, t = table.get(k.name, (0, 0.0))
                table[k.name] = (n + 1, t + k.duration)
    for name, table in per_range.items():
        total = sum(t for _, t in table.values()) / calls
        print(f"{name}: GPU time {total:.1f} us per call, {sum(n for n, _ in table.values()) / calls:.0f} kernels")
        for kname, (n, t) in sorted(table.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"  {t / calls:8.1f} {n / calls:6.1f}  {kname[:100]}")
else:  # one line per kernel: its GPU time per call, launches per call, name
    kernels = [e for e in events if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels) / calls
    print(f"GPU time {total:.1f} us per call, {sum(e.count for e in kernels) / calls:.0f} kernels per call")
    ranges_us = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, reach = 0.0, ranges_us[0][0]
    for start, end in ranges_us:  # the union of the kernels' intervals
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = reach - ranges_us[0][0]
    print(f"GPU busy {busy / span:.0%} of the calls' span ({span / calls:.1f} us per call)")
    print(f"{'us/call':>8} {'n/call':>6}  kernel")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:40]:
        print(f"{e.self_device_time_total / calls:8.1f} {e.count / calls:6.1f}  {e.key[:110]}")
