"""Per-kernel GPU times of the fused op on the seed problem (torch.profiler), for tuning.

    python scripts/profile_seed.py [eval|train] [contiguous|channels_last_3d] [algo] [host|wall]

With `host`, the table is the host side instead: ATen ops by self CPU time, how many
each call issues, and the wall time of issuing one call (no synchronization). With
`wall`, only the wall time per call of 50 calls issued back to back (what an eager loop
of this op sees: the larger of its host and GPU time), no profiler.
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fused_ops

mode = sys.argv[1] if len(sys.argv) > 1 else "eval"
layout = sys.argv[2] if len(sys.argv) > 2 else "contiguous"
memory_format = {"contiguous": torch.contiguous_format,
                 "channels_last_3d": torch.channels_last_3d}[layout]
algo = sys.argv[3] if len(sys.argv) > 3 else "auto"
host = len(sys.argv) > 4 and sys.argv[4] == "host"
wall = len(sys.argv) > 4 and sys.argv[4] == "wall"
m = fused_ops.ConvTransposeBNPool3d(64, 128, 5, 2.0, algo=algo).cuda().train(mode == "train")
xs = [torch.randn(16, 64, 16, 32, 32, device="cuda").contiguous(memory_format=memory_format)
      for _ in range(6)]
calls = 30 if mode == "eval" else 10
with torch.no_grad():
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
        print(f"wall: {mode} {algo}: {walls[2]:.3f} ms per call, 50 calls back to back (median of 5)")
        sys.exit(0)
    if host:
        issue_us = []
        for i in range(calls):
            torch.cuda._sleep(int(2e7))  # the GPU stays busy: issuing never waits on it
            t0 = time.perf_counter()
            m(xs[i % len(xs)])
            issue_us.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        issue_us.sort()
        print(f"host: issuing one call takes {issue_us[len(issue_us) // 2]:.0f} us (median of {calls})")
    activities = [ProfilerActivity.CPU] if host else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for i in range(calls):
            m(xs[i % len(xs)])
        torch.cuda.synchronize()
events = prof.key_averages()
if host:
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / calls
    print(f"host: {ops:.0f} aten ops per call (nested ones included)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=50))
else:
    print(events.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=130))
