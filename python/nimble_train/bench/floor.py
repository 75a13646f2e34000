"""A captured step's floor: the sum of its nodes' times on one stream, its critical path on
several, each node timed as it runs alone.

A graph's replay is as fast as its kernels allow when its span reaches one of two bounds: the
sum of its nodes' times, if they run one after another, or the longest chain of dependent nodes
(the critical path), if every other node runs beside that chain without slowing it. Both need
each node's time without contention, which a profile of the graph as captured does not give
(a kernel beside another runs slower, and nothing says which interval is which node). So the
step's graph is replayed serially (src/capture/graph_structure.h: a clone with an edge from
each node to the next in one topological order), profiled, and the profile's activities of
each step, in order, are the graph's work nodes in that order; the graph's own structure then
gives the critical path.

Kernels run a little slower under the profiler; the floors err high by the same amount as the
profiled busy time they are compared with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .timing import gpu_intervals, ms_per_step

WORK_KINDS = ("kernel", "memcpy", "memset")  # the nodes that do work and show in a profile

# Kernel names of the convolutions and matrix products (cuDNN, cuBLAS, CUTLASS), lower case;
# everything else is "other" (pointwise, reductions, normalisations, the update).
PRODUCT_MARKS = ("gemm", "conv", "cudnn::cnn", "cutlass", "xmma", "nvjet", "dgrad", "wgrad",
                 "implicit", "winograd", "sm80_", "sm90_", "cublas")


def is_product(name: str) -> bool:
    """Whether a kernel's name is a convolution's or a matrix product's (by its library's
    naming; a heuristic for reports)."""
    lowered = name.lower()
    return any(mark in lowered for mark in PRODUCT_MARKS)


def critical_path(dependencies: Sequence[Sequence[int]],
                  durations: Sequence[float]) -> tuple[float, list[int]]:
    """(length, nodes) of the longest chain of dependent nodes, a node's length its duration.
    `dependencies[i]`: the nodes node i waits for, each below i (a topological order)."""
    if len(dependencies) != len(durations):
        raise ValueError(f"critical_path: {len(dependencies)} nodes but {len(durations)} "
                         f"durations")
    finish = [0.0] * len(durations)
    through = [-1] * len(durations)  # the dependency the longest chain to i comes through
    for i, deps in enumerate(dependencies):
        start = 0.0
        for d in deps:
            if not 0 <= d < i:
                raise ValueError(f"critical_path: node {i} depends on node {d}; dependencies "
                                 f"must come first (a topological order)")
            if finish[d] > start:
                start, through[i] = finish[d], d
        finish[i] = start + durations[i]
    if not finish:
        return 0.0, []
    end = max(range(len(finish)), key=finish.__getitem__)
    chain = []
    while end >= 0:
        chain.append(end)
        end = through[end]
    return max(finish), chain[::-1]


def graph_activities(events: Sequence[tuple[float, float, str]], steps: int,
                     work_nodes: int) -> list[list[tuple[float, float, str]]]:
    """Each step's activities of a serially replayed graph, out of a profile of `steps` calls:
    per call the same number of activities (the batch's copies into the static inputs first,
    then the graph's `work_nodes`, one after another). Raises ValueError when the profile does
    not split so (the mapping to nodes would be wrong)."""
    ordered = sorted(events, key=lambda e: e[0])
    if steps <= 0 or len(ordered) % steps:
        raise ValueError(f"graph_activities: {len(ordered)} GPU activities do not split into "
                         f"{steps} calls of one graph")
    per_call = len(ordered) // steps
    copies = per_call - work_nodes
    if copies < 0:
        raise ValueError(f"graph_activities: {per_call} GPU activities per call, fewer than the "
                         f"graph's {work_nodes} work nodes (a node the profile does not show?)")
    calls = [ordered[k * per_call + copies:(k + 1) * per_call] for k in range(steps)]
    names = [n for _, _, n in calls[0]]
    for k, call in enumerate(calls[1:], 1):
        if [n for _, _, n in call] != names:
            raise ValueError(f"graph_activities: call {k} ran other kernels than call 0 (in a "
                             f"serial replay every call runs the same nodes in the same order)")
    return calls


def own_times(call: Sequence[tuple[float, float, str]]) -> list[float]:
    """Each activity's time of a serial replay's call, from its start or its predecessor's end,
    whichever is later: a kernel launched early by a programmatic dependency (cuBLAS's, on
    Hopper) waits inside its interval for the one before it, and that wait is the other's."""
    times, previous_end = [], float("-inf")
    for start, end, _ in call:
        times.append(max(end - max(start, previous_end), 0.0))
        previous_end = max(previous_end, end)
    return times


@dataclass
class Floor:
    """A captured step's floor (milliseconds per step)."""

    nodes: int                  # the graph's nodes
    work_nodes: int             # of those, kernels, copies and fills
    kernel_sum: float           # the work nodes' times, each alone, summed: the one-stream floor
    critical_path: float        # the longest dependent chain of those times: the floor on several
    serial_ms: float            # the serial replay, timed (the sum and the gaps between nodes)
    path_products: float        # of the critical path, convolutions and matrix products
    path_nodes: int             # nodes on the critical path
    by_name: dict[str, float] = field(default_factory=dict)  # critical path's time by kernel
    totals: dict[str, float] = field(default_factory=dict)   # every node's time by kernel

    @property
    def gap(self) -> float:
        """The serial replay's time between one node and the next, on average: the latency of
        a dependency inside a graph (and the batch's copies, spread over the nodes)."""
        return max(self.serial_ms - self.kernel_sum, 0.0) / max(self.work_nodes, 1)

    @property
    def path_with_gaps(self) -> float:
        """The critical path with that latency between each of its nodes and the next: the
        floor on several streams of a graph whose dependencies cost what they cost."""
        return self.critical_path + self.path_nodes * self.gap


def stretch(alone: dict[str, float], as_run: dict[str, float]) -> list[tuple[str, float, float]]:
    """(name, time alone, time as run) per kernel name, the most stretched first (by what
    running beside others added to its time): where a multi-stream step loses the floor that
    its critical path promises. `alone`: :attr:`Floor.totals`; `as_run`: the same step's
    profile as captured, by name, in the same unit per step. A name in one only counts 0 in the
    other (a profile that ran other kernels shows so)."""
    names = set(alone) | set(as_run)
    rows = [(n, alone.get(n, 0.0), as_run.get(n, 0.0)) for n in names]
    return sorted(rows, key=lambda r: (r[1] - r[2], r[0]))


def step_floor(step, batches: Sequence, *, steps: int = 10, timed_steps: int = 30) -> Floor:
    """The floor of nt.Step `step`'s graph (the one its last call launched), measured by calls
    over `batches`: they train, as any call does, with the graph replayed serially. The step
    replays as captured again afterwards."""
    graph, entry = step._graph.graph, step._last_entry
    if entry < 0:
        raise ValueError("step_floor: the step's last call ran eagerly; call it until it "
                         "replays a captured graph (stats()['captured'])")
    kinds, dependencies = graph.structure(entry)
    work = [i for i, kind in enumerate(kinds) if kind in WORK_KINDS]
    graph.replay_serially(entry, True)
    try:
        for i in range(3):
            step(batches[i % len(batches)])
        serial_ms = ms_per_step(step, batches, steps=timed_steps, repeats=1, warm=3)
        calls = graph_activities(gpu_intervals(step, batches, steps), steps, len(work))
    finally:
        graph.replay_serially(entry, False)
    durations = [0.0] * len(kinds)
    names = [""] * len(kinds)
    alone = [own_times(call) for call in calls]
    for position, node in enumerate(work):
        times = sorted(call[position] for call in alone)
        durations[node] = times[len(times) // 2] / 1e3  # median, microseconds -> ms
        names[node] = calls[0][position][2]
    length, chain = critical_path(dependencies, durations)
    by_name: dict[str, float] = {}
    for node in chain:
        if durations[node] > 0:
            by_name[names[node]] = by_name.get(names[node], 0.0) + durations[node]
    totals: dict[str, float] = {}
    for node in work:
        totals[names[node]] = totals.get(names[node], 0.0) + durations[node]
    return Floor(nodes=len(kinds), work_nodes=len(work), kernel_sum=sum(durations),
                 critical_path=length, serial_ms=serial_ms,
                 path_products=sum(durations[n] for n in chain if is_product(names[n])),
                 path_nodes=sum(1 for n in chain if durations[n] > 0), by_name=by_name,
                 totals=totals)
