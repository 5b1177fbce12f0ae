"""How bench_ct_bn_pool.py times a call: per-call device time (CUDA events after a GPU
busy-wait; CPU: wall time), the wall time per call of an eager loop, and the rotated inputs.
See bench/README.md, "What is measured, and how"."""
import math
import statistics
import time
from typing import Callable, List, NamedTuple, Optional

import torch

WARMUP_CALLS = 5
SLEEP_US = 100.0         # GPU busy-wait enqueued before each timed CUDA call (see CudaClock)
SLOW_CALL_MS = 20.0      # a call slower than this after warm-up ...
SLOW_CALL_REPS = 5       # ... is timed only this many times, to bound the sweep's duration
MIN_INPUTS = 6
L2_FALLBACK_BYTES = 60 * 2**20
INPUT_ALIGN = 128        # elements: each rotated input starts aligned like a fresh allocation
LOOP_REPEATS = 3         # eager loops timed; their median is reported
LOOP_MAX_S = 0.1         # a loop of slow calls is shortened to about this long (>= 1 call)


class Timing(NamedTuple):
    ms: float                  # median device time of one call (CPU: wall time)
    host_us: Optional[float]   # median wall time of issuing one call, without sync (CUDA only)
    reps: int
    late: Optional[int] = None  # timed calls whose issue outlasted the GPU sleep (CUDA only)


def l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK_BYTES


class InputRing:
    """Distinct inputs used round-robin, so a timed call never reads an x that is cache-resident.

    The inputs are views into one buffer (cheap even when thousands are needed for a
    small x), each starting INPUT_ALIGN-aligned like a fresh allocation, so the fused
    kernels and Inductor see the alignment they would in real use.
    """

    def __init__(self, shape, device, min_total_bytes, memory_format="contiguous",
                 dtype=torch.float32):
        numel = math.prod(shape)
        slot = -(-numel // INPUT_ALIGN) * INPUT_ALIGN
        item_bytes = torch.empty((), dtype=dtype).element_size()
        count = max(MIN_INPUTS, math.ceil(min_total_bytes / (numel * item_bytes)))
        buffer = torch.randn(count * slot, device=device, dtype=dtype)
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
        # slowest warm-up issue (1.5x the median still let launch gaps into later eval rows).
        sleep_us = max(SLEEP_US, 2 * max(warm_host_us))
        ms, host_us = self.timed_calls(fn, next_input, reps, sleep_us)
        late = sum(us > sleep_us for us in host_us)
        return Timing(statistics.median(ms), statistics.median(host_us), reps, late)

    def loop_us(self, fn: Callable, next_input: Callable, calls: int) -> float:
        """Wall time per call of `calls` calls issued back to back, as an eager loop issues
        them (no sync or sleep between them; the larger of host and device time decides),
        from an idle device to the last call's end: median of LOOP_REPEATS loops, in µs."""
        per_call = []
        for _ in range(LOOP_REPEATS):
            inputs = [next_input() for _ in range(calls)]
            self.sync()
            start = time.perf_counter()
            for x in inputs:
                fn(x)
            self.sync()
            per_call.append((time.perf_counter() - start) / calls * 1e6)
        return statistics.median(per_call)

    def sync(self):
        pass

    def timed_calls(self, fn, next_input, count, sleep_us):
        """Returns per-call times in ms and per-call issue times in µs (None if not separate)."""
        raise NotImplementedError

    def peak_mib(self, fn, x) -> Optional[float]:
        return None


def loop_calls(timing: Timing) -> int:
    """Calls per eager loop: as many as the timed calls, fewer where that would take long."""
    return max(1, min(timing.reps, math.ceil(LOOP_MAX_S * 1e3 / max(timing.ms, 1e-6))))


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
    exceeds its issue time would fill the launch queue and its host_us would measure the wait.
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
        host_us: List[float] = []
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
