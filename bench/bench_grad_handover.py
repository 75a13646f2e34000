"""The gradient hand-over: captured steps that copy autograd's gradients into the flat buffers
once, against steps that add each into its zeroed view, side by side.

    python bench/bench_grad_handover.py  # ResNet-18 (1 stream, auto, over torch.compile), branchy
    python bench/bench_grad_handover.py --workloads bert:32:step-compile --rounds 5

One process, one GPU. Each workload ``model:batch:mode`` (mode: ``step`` for one stream,
``step-auto``, ``step-compile`` for nt.Step over torch.compile(model); batch 32 and step-auto
unless given) is built twice from the
same seed, once with ``nimble_train._iteration.HAND_OVER_GRADIENTS`` off and once on, each
captured under its setting; then, for CIFAR networks and BERT, the hand-written whole-step graph
with torch's fused optimizer (the benchmark's ``graph-fused`` anchor), built after the steps.
Timing alternates between them in rounds (a CUDA-event mean over --steps steps after 10
untimed ones each); the table gives each one's median over --rounds rounds.
"""

from __future__ import annotations

import argparse
import sys

import torch

import nimble_train as nt
from nimble_train import _iteration
from nimble_train.bench.modes import MODES
from nimble_train.bench.timing import alternating_ms, captured
from nimble_train.bench.workloads import make_workload

STEP_MODES = {"step": 1, "step-auto": "auto", "step-compile": "auto"}
DEFAULT = ["resnet18:32:step", "resnet18:32:step-auto", "resnet18:32:step-compile",
           "branchy:32:step-auto"]


def build_step(w, mode: str, hand_over: bool):
    """A captured nt.Step of workload `w`, the hand-over on or off while it captures."""
    torch.manual_seed(0)
    model = w.make_model()
    optimizer = w.make_optimizer(model)
    if mode == "step-compile":
        model = torch.compile(model)  # no dynamo reset: the other variant's graph stays valid
    step = nt.Step(model, optimizer, w.loss_fn, streams=STEP_MODES[mode], amp=w.amp)
    return captured(step, w.batches, mode, [(_iteration, "HAND_OVER_GRADIENTS", hand_over)])


def measure(spec: str, args) -> dict:
    parts = spec.split(":")
    name, batch, mode = parts[0], (parts[1:2] or ["32"])[0], (parts[2:3] or ["step-auto"])[0]
    if mode not in STEP_MODES:
        raise SystemExit(f"bench_grad_handover: mode must be one of {list(STEP_MODES)}; "
                         f"got {mode!r} in {spec!r}")
    w = make_workload(name, int(batch), "cuda")
    built = {"adds": build_step(w, mode, False), "hand-over": build_step(w, mode, True)}
    built["graph-fused"] = MODES["graph-fused"].build(w)  # after the steps' captures
    row = {"workload": f"{name} b{batch} {mode}",
           **alternating_ms({way: (step, w.batches) for way, step in built.items()},
                            rounds=args.rounds, steps=args.steps)}
    for way in ("adds", "hand-over"):
        built[way].close()
    del built
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=DEFAULT, metavar="MODEL:BATCH:MODE")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_grad_handover needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    rows = []
    for spec in args.workloads:
        rows.append(measure(spec, args))
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per step, "
          f"median of {args.rounds} alternating rounds of {args.steps} steps")
    print("| workload | adds | hand-over | adds ÷ hand-over | hand-written graph (fused) "
          "| graph ÷ hand-over |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['adds']:.3f} | {r['hand-over']:.3f} "
              f"| **{r['adds'] / r['hand-over']:.3f}x** | {r['graph-fused']:.3f} "
              f"| {r['graph-fused'] / r['hand-over']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
