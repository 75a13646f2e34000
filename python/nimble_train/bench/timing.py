"""How the benchmark measures a training step: CUDA-event medians, time to the first fast
step, and the fraction of a step during which the GPU is busy (from a profile)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

StepFn = Callable[[Any], Any]


def time_ms(fn, repeats: int, iters: int) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls, CUDA events."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def time_to_first_fast_step(build: Callable[[], StepFn], batches: Sequence,
                            calls: int | Callable[[StepFn], int]) -> tuple[float, StepFn]:
    """Seconds from building a mode (model and optimizer included) to the end of its first
    fast-path step, which is call number `calls` (or `calls(step)`: e.g. the first replay after
    Step's warm-up); returns them and the step function."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    step = build()
    for i in range(calls(step) if callable(calls) else calls):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    return time.perf_counter() - start, step


def ms_per_step(step: StepFn, batches: Sequence, *, steps: int = 50, repeats: int = 5,
                warm: int = 20) -> float:
    """Median over `repeats` of the mean time of `steps` consecutive steps, in milliseconds,
    timed with CUDA events after `warm` untimed steps.

    Events bracket the whole run of steps, so the time includes the host's launch overhead
    whenever the GPU waits for it: exactly the cost the modes differ in.
    """
    for i in range(warm):
        step(batches[i % len(batches)])
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(steps):
            step(batches[i % len(batches)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def busy_time(intervals: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(length of the union of the [start, end) intervals, span from the first start to the
    last end): the time in which the GPU runs something, and the time it was watched."""
    ordered = sorted((s, e) for s, e in intervals if e > s)
    if not ordered:
        return 0.0, 0.0
    busy = 0.0
    cur_start, cur_end = ordered[0]
    span_end = cur_end
    for s, e in ordered[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
        span_end = max(span_end, e)
    busy += cur_end - cur_start
    return busy, span_end - ordered[0][0]


def busy_fraction(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals over the span from the first start to the
    last end: 1.0 when the GPU never idles. NaN when there are no intervals."""
    busy, span = busy_time(intervals)
    return busy / span if span > 0 else float("nan")


def gpu_activity(step: StepFn, batches: Sequence, steps: int = 20) -> tuple[float, float]:
    """(busy fraction, GPU milliseconds per step) over `steps` steps, from a CUDA profile.

    The busy fraction is the part of the GPU time the steps span in which a kernel or copy runs
    (on any stream): what launch overhead and serialisation leave unused. The GPU milliseconds
    are that busy time per step: what the step would take if the host never made the GPU wait,
    the bound a host-bound mode approaches on a faster CPU. Kernels run a little slower under
    the profiler, so this errs high."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
    busy, span = busy_time([(e.time_range.start, e.time_range.end) for e in prof.events()
                            if e.device_type == torch.autograd.DeviceType.CUDA])
    if span <= 0:
        return float("nan"), float("nan")
    return busy / span, busy / steps / 1e3  # profiler times are in microseconds


def gpu_busy_fraction(step: StepFn, batches: Sequence, steps: int = 20) -> float:
    """The busy fraction of :func:`gpu_activity`."""
    return gpu_activity(step, batches, steps)[0]
