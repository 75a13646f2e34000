"""How the benchmark measures a training step: CUDA-event medians, time to the first fast
step, the fraction of a step during which the GPU is busy, and where one kernel runs alone or
none runs (the last two from a profile)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

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


def captured(step, batches: Sequence, what: str,
             settings: Iterable[tuple[object, str, Any]] = ()):
    """`step`, an nt.Step, called through its warm-up, its capture and two replays with each
    module switch of `settings` ((module, name, value)) set, and set back after: the graph
    keeps what it was captured under. Raises, naming `what`, when the step did not capture."""
    settings = list(settings)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in settings]
    for owner, name, value in settings:
        setattr(owner, name, value)
    try:
        for i in range(step.stats()["warmup_left"] + 2):
            step(batches[i % len(batches)])
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    if not step.stats()["captured"]:
        raise RuntimeError(f"{what}: the step was not captured: {step.stats()['capture_error']}")
    return step


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


def alternating_ms(ways: dict[str, tuple[StepFn, Sequence]], *, rounds: int, steps: int,
                   warm: int = 10) -> dict[str, float]:
    """Each way's median ms per step over `rounds` rounds that alternate between the ways
    ({way: (step, batches)}; each a CUDA-event mean over `steps` steps after `warm` untimed
    ones): what drifts over the run (clocks, temperature) drifts for every way alike."""
    samples: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(rounds):
        for way, (step, batches) in ways.items():
            samples[way].append(ms_per_step(step, batches, steps=steps, repeats=1, warm=warm))
    return {way: statistics.median(values) for way, values in samples.items()}


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


def gpu_intervals(step: StepFn, batches: Sequence,
                  steps: int = 20) -> list[tuple[float, float, str]]:
    """(start, end, name) of the GPU activity (kernels, copies, fills) of `steps` steps, from a
    CUDA profile; in microseconds."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def gpu_activity(step: StepFn, batches: Sequence, steps: int = 20) -> tuple[float, float]:
    """(busy fraction, GPU milliseconds per step) over `steps` steps, from a CUDA profile.

    The busy fraction is the part of the GPU time the steps span in which a kernel or copy runs
    (on any stream): what launch overhead and serialisation leave unused. The GPU milliseconds
    are that busy time per step: what the step would take if the host never made the GPU wait,
    the bound a host-bound mode approaches on a faster CPU. Kernels run a little slower under
    the profiler, so this errs high."""
    busy, span = busy_time([(s, e) for s, e, _ in gpu_intervals(step, batches, steps)])
    if span <= 0:
        return float("nan"), float("nan")
    return busy / span, busy / steps / 1e3  # profiler times are in microseconds


def gpu_busy_fraction(step: StepFn, batches: Sequence, steps: int = 20) -> float:
    """The busy fraction of :func:`gpu_activity`."""
    return gpu_activity(step, batches, steps)[0]


@dataclass
class Overlap:
    """How kernels shared the GPU over a profiled stretch (times in the events' unit)."""

    span: float                           # first start to last end
    busy: float                           # something runs
    idle: float                           # nothing runs
    kernel_sum: float                     # the kernels' own durations, added up
    concurrency: float                    # kernels running at once, on average while busy
    alone: dict[str, float] = field(default_factory=dict)  # by name: runs with nothing else
    total: dict[str, float] = field(default_factory=dict)  # by name: its kernels' durations
    count: dict[str, int] = field(default_factory=dict)    # by name: how many ran
    # Idle time by (the kernel that ended last, the kernel that started next).
    gaps: dict[tuple[str, str], float] = field(default_factory=dict)


def overlap(events: Sequence[tuple[float, float, str]]) -> Overlap:
    """Sweeps (start, end, name) intervals: where one kernel runs alone (what no further stream
    overlaps: the critical path's serial part), where none runs, and between which kernels the
    GPU idles. Intervals that touch do not overlap; empty ones are left out."""
    ev = [(s, e, n) for s, e, n in events if e > s]
    if not ev:
        return Overlap(0.0, 0.0, 0.0, 0.0, float("nan"))
    # At one instant ends come before starts, so back-to-back kernels never count as two.
    points = sorted([(e, 0, k) for k, (_, e, _) in enumerate(ev)]
                    + [(s, 1, k) for k, (s, _, _) in enumerate(ev)])
    alone: dict[str, float] = {}
    gaps: dict[tuple[str, str], float] = {}
    active: set[int] = set()
    busy = idle = weighted = 0.0
    last_t, last_ended = points[0][0], None
    for t, starts, k in points:
        d = t - last_t
        if d > 0:
            if active:
                busy += d
                weighted += d * len(active)
                if len(active) == 1:
                    name = ev[next(iter(active))][2]
                    alone[name] = alone.get(name, 0.0) + d
            else:  # the point that ends an idle stretch is a start
                key = (ev[last_ended][2], ev[k][2])
                gaps[key] = gaps.get(key, 0.0) + d
                idle += d
        if starts:
            active.add(k)
        else:
            active.discard(k)
            last_ended = k
        last_t = t
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for s, e, n in ev:
        total[n] = total.get(n, 0.0) + (e - s)
        count[n] = count.get(n, 0) + 1
    span = max(e for _, e, _ in ev) - min(s for s, _, _ in ev)
    return Overlap(span=span, busy=busy, idle=idle, kernel_sum=sum(total.values()),
                   concurrency=weighted / busy if busy > 0 else float("nan"),
                   alone=alone, gaps=gaps, total=total, count=count)


def profile_overlap(step: StepFn, batches: Sequence, steps: int = 20) -> Overlap:
    """:func:`overlap` of :func:`gpu_intervals`: microseconds, for all the steps together."""
    return overlap(gpu_intervals(step, batches, steps))
