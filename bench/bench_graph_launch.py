"""What a captured step's launch costs the host, with its memset nodes left in the graph and
rewritten as kernels (src/capture/graph_nodes.h).

    python bench/bench_graph_launch.py          # ResNet-18 b32, the branchy net b32, airbench b1024
    python bench/bench_graph_launch.py --workloads resnet18:128 --rounds 7

One process, one GPU. Each network (the benchmark's workloads: same seed, same batches) is built
six times: the hand-written whole-step graph with torch's fused optimizer (the benchmark's
``graph-fused`` anchor) with its memset nodes left in and rewritten as Step's are
(``graph-fused-kernels``), then nt.Step with streams=1 and with streams="auto", captured with
``_capture.MEMSETS_AS_KERNELS`` off and on. Timing alternates between the six in rounds:
per round a CUDA-event mean over --steps steps after 10 untimed ones, and the host's time per
call over the same steps (from the first call to the last one's return: where it is about the
GPU's time per step, the host waited in the launch). The table gives each one's median over
--rounds rounds.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from nimble_train import _capture
from nimble_train.bench.modes import MODES
from nimble_train.bench.workloads import make_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streams import build, measure_workloads  # noqa: E402

# (name, how it is built: Step's streams or a bench mode, memsets as kernels); built in this
# order, the hand-written graphs first
WAYS = (("graph", "graph-fused", False), ("graph, kernels", "graph-fused-kernels", True),
        ("1 stream", 1, False), ("1 stream, kernels", 1, True),
        ("auto", "auto", False), ("auto, kernels", "auto", True))


def build_way(name: str, batch: int, how, kernels: bool, device):
    if how in MODES:
        w = make_workload(name, batch, device)
        step = MODES[how].build(w)
        for i in range(3):
            step(w.batches[i % len(w.batches)])
        return step, w.batches
    return build(name, batch, how, device, {"MEMSETS_AS_KERNELS": kernels})


def timed(step, batches, steps: int) -> tuple[float, float]:
    """(GPU ms per step, host µs per call) over `steps` steps after 10 untimed ones."""
    for i in range(10):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps, host / steps * 1e6


def measure(name: str, batch: int, args, device) -> dict:
    built = {way: build_way(name, batch, how, kernels, device) for way, how, kernels in WAYS}
    memsets = {key: built[way][0].stats()["memset_nodes_as_kernels"]
               for key, way in (("memsets 1", "1 stream, kernels"),
                                ("memsets auto", "auto, kernels"))}
    ms = {way: [] for way in built}
    host = {way: [] for way in built}
    for _ in range(args.rounds):
        for way, (step, batches) in built.items():
            t, h = timed(step, batches, args.steps)
            ms[way].append(t)
            host[way].append(h)
    for step, _ in built.values():
        close = getattr(step, "close", None)
        if callable(close):
            close()
    torch.cuda.empty_cache()
    row = {"workload": f"{name} b{batch}", **memsets}
    for way in built:
        row[way] = statistics.median(ms[way])
        row[way + " host"] = statistics.median(host[way])
    return row


def main(argv=None) -> int:
    saved = _capture.MEMSETS_AS_KERNELS
    try:
        rows = measure_workloads(argv, __doc__.split("\n")[0], "bench_graph_launch", measure,
                                 rounds=5, workloads=["resnet18:32", "branchy:32",
                                                      "airbench:1024"])
    finally:
        _capture.MEMSETS_AS_KERNELS = saved
    if rows is None:
        return 2
    print("ms per step (host µs per call); memset nodes: those Step's captures rewrote")
    print("| network | memset nodes (1 / auto) | " + " | ".join(w for w, *_ in WAYS)
          + " | graph: gain | 1 stream: gain | auto: gain |")
    print("|---" * 11 + "|")
    for r in rows:
        cells = " | ".join(f"{r[w]:.3f} ({r[w + ' host']:.0f})" for w, *_ in WAYS)
        gains = " | ".join(f"{r[a] / r[b]:.3f}x" for a, b in (
            ("graph", "graph, kernels"), ("1 stream", "1 stream, kernels"),
            ("auto", "auto, kernels")))
        print(f"| {r['workload']} | {r['memsets 1']} / {r['memsets auto']} | {cells} "
              f"| {gains} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
