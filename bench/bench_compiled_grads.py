"""A compiled model's weight products (nimble_train/_inductor_grads.py): rounded to half
precision, cast and copied into the flat gradient buffers after the backward, as inductor's
graph had them; in float32 and copied; in float32 and written into the flat buffers.

    python bench/bench_compiled_grads.py                      # BERT-base b32 bf16, ResNet-18 b32
    python bench/bench_compiled_grads.py --workloads bert:32 --rounds 5

One process, one GPU. Each workload ``model:batch`` builds nt.Step over torch.compile(model)
once per way, from one seed, each captured under its setting of
``nimble_train._inductor_grads.FLOAT32_PRODUCTS`` and ``INTO_FLAT``. Timing alternates between
them in rounds (a CUDA-event mean over --steps steps after 10 untimed ones each); the table gives
each one's median, and its GPU time per step: the busy time of a CUDA profile (profiled steps
run a little slower). Against the anchors, run the benchmark itself (``python -m
nimble_train.bench --model bert --modes compile-ro compile-ro-opt step-compile``), which builds
and frees one mode at a time.
"""

from __future__ import annotations

import argparse
import sys

import torch

import nimble_train as nt
from nimble_train import _inductor_grads
from nimble_train.bench.timing import alternating_ms, gpu_activity
from nimble_train.bench.workloads import make_workload

WAYS = {  # (FLOAT32_PRODUCTS, INTO_FLAT)
    "rounded, copied": (False, False),
    "float32, copied": (True, False),
    "float32, in place": (True, True),
}


def build_step(w, float32: bool, into_flat: bool):
    """A captured nt.Step over torch.compile of workload `w`'s model, under the settings."""
    torch.manual_seed(0)
    model = w.make_model()
    optimizer = w.make_optimizer(model)
    saved = _inductor_grads.FLOAT32_PRODUCTS, _inductor_grads.INTO_FLAT
    _inductor_grads.FLOAT32_PRODUCTS, _inductor_grads.INTO_FLAT = float32, into_flat
    try:
        # no dynamo reset between the ways: each capture replays without dynamo
        step = nt.Step(torch.compile(model), optimizer, w.loss_fn, amp=w.amp)
        for i in range(step.stats()["warmup_left"] + 2):
            step(w.batches[i % len(w.batches)])
    finally:
        _inductor_grads.FLOAT32_PRODUCTS, _inductor_grads.INTO_FLAT = saved
    stats = step.stats()
    if not stats["captured"]:
        raise RuntimeError(f"the step was not captured: {stats['capture_error']}")
    return step


def measure(spec: str, args) -> list[dict]:
    name, _, batch = spec.partition(":")
    w = make_workload(name, int(batch or 32), "cuda")
    built = {way: build_step(w, *flags) for way, flags in WAYS.items()}
    medians = alternating_ms({way: (step, w.batches) for way, step in built.items()},
                             rounds=args.rounds, steps=args.steps)
    rows = []
    for way, step in built.items():
        rows.append({"workload": f"{name} b{batch or 32}", "way": way,
                     "ms": medians[way],
                     "gpu_ms": gpu_activity(step, w.batches, steps=20)[1],
                     "in_place": step.stats()["weight_products_in_place"]})
        step.close()
    del built
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["bert:32", "resnet18:32"],
                        metavar="MODEL:BATCH")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_compiled_grads needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    rows = []
    for spec in args.workloads:
        rows += measure(spec, args)
        for row in rows[-len(WAYS):]:
            print(row, flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per step, median "
          f"of {args.rounds} alternating rounds of {args.steps} steps; GPU ms from a profile")
    print("| workload | nt.Step over torch.compile, products | ms | GPU ms | written in place "
          "| first way's ms ÷ ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        first = next(a for a in rows if a["workload"] == r["workload"])
        print(f"| {r['workload']} | {r['way']} | {r['ms']:.3f} | {r['gpu_ms']:.3f} "
              f"| {r['in_place']} | {first['ms'] / r['ms']:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
