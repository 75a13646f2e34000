"""Where a step's GPU time goes: one kernel alone, several at once, or none.

    python bench/bench_profile.py --model branchy --batch 32 --modes step step-auto
    python bench/bench_profile.py --model resnet18 --modes graph-fused step-auto --top 20

One process, one GPU. Each mode of the benchmark (``python -m nimble_train.bench``: the same
model, seed and batches) is built, warmed up and profiled over --steps steps with
torch.profiler's CUDA activity. A sweep over the kernels' intervals then says, per step:

- the span and the busy, idle and summed kernel time, and how many kernels ran at once on
  average while the GPU was busy;
- which kernels ran **alone** and for how long: the serial part of the step, which no further
  stream can overlap (a stem, the layers between a network's stages, a concatenation, the
  update), or a stream waiting on another;
- between which kernels the GPU was **idle**: a host that fell behind (the gap before a
  step's first kernel), or the latency of a dependency inside the graph;
- with --totals, every kernel's time summed by name, alone or not (how many ran per step):
  where two modes' kernels differ, whatever runs beside them.

Kernels run a little slower under the profiler, and the gaps between steps grow with its
per-launch cost: compare modes within one run, not with the timed benchmark.
"""

from __future__ import annotations

import argparse
import sys

import torch

from nimble_train.bench.modes import MODES, warmed
from nimble_train.bench.timing import profile_overlap
from nimble_train.bench.workloads import add_workload_arguments, cuda_workload_from


def short(name: str, width: int = 90) -> str:
    """A kernel's name without its return type, anonymous namespaces and arguments, cut to
    `width` characters."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(name):  # the argument list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0 and i > 0 and name[i - 1] != " ":
            name = name[:i]
            break
    return name if len(name) <= width else name[:width - 3] + "..."


def report(label: str, o, steps: int, top: int, totals: bool = False) -> str:
    """The sweep of `steps` steps as text, per step; with `totals`, the kernels' summed times
    by name too."""
    per = 1.0 / steps
    alone = sum(o.alone.values())
    lines = [f"== {label}: per step (us) span {o.span * per:.1f}, busy {o.busy * per:.1f}, "
             f"idle {o.idle * per:.1f}, kernels {o.kernel_sum * per:.1f}, one kernel alone "
             f"{alone * per:.1f} ({alone / o.span:.0%} of the span), "
             f"{o.concurrency:.2f} at once while busy",
             f"   alone, us per step (top {top}):"]
    by_name: dict[str, float] = {}
    for name, t in o.alone.items():
        name = short(name)
        by_name[name] = by_name.get(name, 0.0) + t
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"   {t * per:8.1f}  {name}")
    lines.append(f"   idle, us per step, after -> before (top {top}):")
    gaps: dict[tuple[str, str], float] = {}
    for (a, b), t in o.gaps.items():
        key = (short(a, 50), short(b, 50))
        gaps[key] = gaps.get(key, 0.0) + t
    for (a, b), t in sorted(gaps.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"   {t * per:8.1f}  {a} -> {b}")
    if totals:
        lines.append(f"   kernel time by name, us per step (count per step), top {top}:")
        by_total: dict[str, list[float]] = {}
        for name, t in o.total.items():
            entry = by_total.setdefault(short(name), [0.0, 0.0])
            entry[0] += t
            entry[1] += o.count[name]
        for name, (t, n) in sorted(by_total.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"   {t * per:8.1f}  ({n * per:g})  {name}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_arguments(parser, model="branchy")
    parser.add_argument("--modes", nargs="+", default=["step", "step-auto"],
                        choices=sorted(MODES))
    parser.add_argument("--steps", type=int, default=20, help="profiled steps per mode")
    parser.add_argument("--top", type=int, default=12, help="kernels and gaps listed")
    parser.add_argument("--totals", action="store_true",
                        help="list every kernel's summed time by name too")
    args = parser.parse_args(argv)
    w = cuda_workload_from(args, "bench_profile")
    if w is None:
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {w.description}, "
          f"batch {w.batch}; {args.steps} profiled steps per mode")
    for key in args.modes:
        with warmed(MODES[key], w) as step:
            print(report(MODES[key].label, profile_overlap(step, w.batches, args.steps),
                         args.steps, args.top, args.totals), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
