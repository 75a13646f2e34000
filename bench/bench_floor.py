"""How far each mode's step is from the GPU's floor for its kernels.

    python bench/bench_floor.py --model resnet18 --batch 32
    python bench/bench_floor.py --model bert --batch 32 --modes compile-ro step-compile

One process, one GPU. Each mode of the benchmark (``python -m nimble_train.bench``: the same
model, seed and batches) is built, warmed up, timed (CUDA events) and profiled; modes are
built and freed one at a time. Per step, in milliseconds:

- **ms**: timed; **busy**: the profiled time in which anything runs on the GPU (what the step
  would take if the host never made the GPU wait); **kernels**: the profiled activities' own
  times added up, as they ran (beside each other, on several streams);
- for nt.Step's modes, the floor of its graph (nimble_train/bench/floor.py), each node timed
  as it runs alone in a serial replay of the same graph: **sum** (the floor on one stream),
  **serial** (the serial replay timed: the sum and the latency between dependent nodes),
  **path** (the critical path: the floor on several streams, were nothing slowed by what
  runs beside it) with its part in convolutions and matrix products, and **path + gaps**
  (with the serial replay's latency per node between each of its nodes). For the other
  modes (one stream each) the kernels' sum is their floor.

Per Step mode, its critical path's longest kernels, and the kernels whose time as run (beside
the others) most exceeds their time alone: where contention keeps a step above its critical
path. Last, for each anchor a ratio over it would need (--targets), the step time that ratio means
beside Step's floors: a target below a Step mode's critical path (with its gaps) is out of
reach of any schedule of that mode's kernels.
"""

from __future__ import annotations

import argparse
import sys

import torch

from nimble_train.bench.floor import step_floor, stretch
from nimble_train.bench.modes import MODES, warmed
from nimble_train.bench.timing import ms_per_step, profile_overlap
from nimble_train.bench.workloads import add_workload_arguments, cuda_workload_from

ANCHORS = ("compile-ro", "compile-ro-opt", "graph", "graph-fused", "graph-fused-kernels")


def measure(key: str, w, args) -> dict:
    with warmed(MODES[key], w) as step:
        row = {"mode": key, "label": MODES[key].label,
               "ms": ms_per_step(step, w.batches, steps=args.steps, repeats=args.repeats)}
        o = profile_overlap(step, w.batches, args.profiled)  # microseconds, all steps
        row.update(busy=o.busy / args.profiled / 1e3, kernels=o.kernel_sum / args.profiled / 1e3)
        if key.startswith("step"):
            f = step_floor(step, w.batches, steps=args.profiled, timed_steps=args.steps)
            row.update(sum=f.kernel_sum, path=f.critical_path, products=f.path_products,
                       gaps=f.path_with_gaps, serial=f.serial_ms, nodes=f.nodes,
                       work=f.work_nodes, path_nodes=f.path_nodes,
                       top=sorted(f.by_name.items(), key=lambda kv: -kv[1]),
                       stretch=stretch(f.totals, {name: t / args.profiled / 1e3
                                                  for name, t in o.total.items()}))
    return row


def report(rows: list[dict], targets: list[float], top: int) -> str:
    """The table of the measured rows, each Step mode's longest kernels on its critical path and
    the kernels that ran slowest beside the others, and the step time each target ratio over
    each anchor asks."""
    lines = ["", "| mode | ms | busy | kernels | sum alone | serial | critical path (products) "
             "| path + gaps | ms ÷ path + gaps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "path" in r:
            lines.append(f"| {r['label']} | {r['ms']:.3f} | {r['busy']:.3f} | {r['kernels']:.3f} "
                         f"| {r['sum']:.3f} | {r['serial']:.3f} | {r['path']:.3f} "
                         f"({r['products']:.3f}) | {r['gaps']:.3f} | {r['ms'] / r['gaps']:.2f} |")
        else:
            lines.append(f"| {r['label']} | {r['ms']:.3f} | {r['busy']:.3f} | {r['kernels']:.3f} "
                         f"| {r['kernels']:.3f} | - | - | - | - |")
    for r in rows:
        if "path" in r:
            lines.append(f"\n{r['label']}: {r['nodes']} nodes, {r['work']} that work, "
                         f"{r['path_nodes']} on the critical path; its longest kernels there "
                         f"(ms):")
            for name, t in r["top"][:top]:
                lines.append(f"   {t:.3f}  {name.removeprefix('void ')[:80]}")
            if r.get("stretch"):
                lines.append(f"  the kernels that ran slowest beside the others (ms alone -> as "
                             f"run):")
                for name, alone, run in r["stretch"][:top]:
                    lines.append(f"   {alone:.3f} -> {run:.3f}  {name.removeprefix('void ')[:80]}")
    anchors = [r for r in rows if r["mode"] in ANCHORS]
    steps = [r for r in rows if "path" in r]
    if anchors and steps:
        lines.append("\nStep time a target ratio over an anchor's busy time asks, beside Step's "
                     "floors (sum alone / critical path + gaps):")
        lines.append("   " + ", ".join(f"{r['mode']} {r['sum']:.3f} / {r['gaps']:.3f}"
                                       for r in steps))
        for a in anchors:
            asks = ", ".join(f"{t:g}x: {a['busy'] / t:.3f}" for t in targets)
            lines.append(f"   over {a['mode']} (busy {a['busy']:.3f}): {asks}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_arguments(parser, model="resnet18")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES),
                        default=["compile-ro", "compile-ro-opt", "graph-fused-kernels", "step",
                                 "step-auto", "step-compile"])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profiled", type=int, default=10, help="profiled steps")
    parser.add_argument("--targets", type=float, nargs="*", default=[1.15, 1.25, 1.3],
                        help="ratios over the anchors' busy time to set beside the floors")
    parser.add_argument("--top", type=int, default=6,
                        help="kernels listed per Step mode's critical path")
    args = parser.parse_args(argv)
    w = cuda_workload_from(args, "bench_floor")
    if w is None:
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {w.description}, "
          f"batch {w.batch}; ms per step")
    rows = []
    for key in args.modes:
        rows.append(measure(key, w, args))
        r = rows[-1]
        print(f"  {key}: {r['ms']:.3f} ms, busy {r['busy']:.3f}", flush=True)

    print(report(rows, args.targets, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
