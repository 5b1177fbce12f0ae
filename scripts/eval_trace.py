"""Where the eval call's time goes on the seed problem: the kernels' start and end times
within a call (torch.profiler), and the call's event time as the host's head start
grows, eagerly and as a CUDA graph replay. For tuning; bench/ is what reports speed.

    python scripts/eval_trace.py
"""
import statistics

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import fused_ops

CALLS = 30


def sleep_cycles(us):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(100_000)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    return int(us * 1_000_000 / (start.elapsed_time(end) * 1e3))


def event_ms(fn, inputs, cycles, queued=False):
    """Median event time of a call, the first half of the calls left out as warm-up; the
    host waits for each call, or (queued) enqueues them all first, as bench/'s loop does."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(CALLS * 2)]
    for i, (start, end) in enumerate(events):
        torch.cuda._sleep(cycles)
        start.record()
        fn(inputs[i % len(inputs)])
        end.record()
        if not queued:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events[CALLS:])


def trace(fn, inputs, cycles):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            torch.cuda._sleep(cycles)
            fn(inputs[i % len(inputs)])
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                      and "sleep" not in e.name), key=lambda e: e.time_range.start)
    names = []
    for e in kernels:
        if e.name not in names:
            names.append(e.name)
    per_call = len(kernels) // CALLS
    rows = {n: [] for n in names}
    for c in range(CALLS):
        call = kernels[c * per_call:(c + 1) * per_call]
        t0 = call[0].time_range.start
        for e in call:
            rows[e.name].append((e.time_range.start - t0, e.time_range.end - t0))
    print(f"  {per_call} kernels a call; us from the first kernel's start, "
          f"median over {CALLS} calls")
    for n, r in rows.items():
        print(f"  {n[:90]:90s} start {statistics.median(s for s, _ in r):7.2f}  "
              f"end {statistics.median(e for _, e in r):7.2f}")


def main():
    m = fused_ops.ConvTransposeBNPool3d(64, 128, 5, 2.0).cuda().eval()
    xs = [torch.randn(16, 64, 16, 32, 32, device="cuda") for _ in range(6)]
    with torch.no_grad():
        for x in xs:
            m(x)
        torch.cuda.synchronize()
        print("eager module call")
        trace(m, xs, sleep_cycles(200))
        for us in (100, 300, 1000):
            print(f"  events, {us} us head start: {event_ms(m, xs, sleep_cycles(us)) * 1e3:.2f} us")
        print(f"  events, all calls queued (bench/'s loop), 140 us head start: "
              f"{event_ms(m, xs, sleep_cycles(140), queued=True) * 1e3:.2f} us")
        # After a second of convolution at full power, as bench/ times the op after eager.
        conv = torch.nn.Conv3d(64, 128, 5, padding=2).cuda()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            conv(xs[0])
        end.record()
        torch.cuda.synchronize()
        print(f"  ({start.elapsed_time(end):.0f} ms of conv3d) then queued: "
              f"{event_ms(m, xs, sleep_cycles(140), queued=True) * 1e3:.2f} us, synced: "
              f"{event_ms(m, xs, sleep_cycles(140)) * 1e3:.2f} us")
        static = xs[0].clone()
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            m(static)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            m(static)
        print(f"graph replay, one input: events, 100 us head start: "
              f"{event_ms(lambda _: graph.replay(), xs, sleep_cycles(100)) * 1e3:.2f} us")


if __name__ == "__main__":
    main()
