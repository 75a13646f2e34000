"""The batch counters of captured steps: each batch norm's own add against one multi-tensor
add for every layer at the end of the step (nimble_train/_batch_norm.py).

    python bench/bench_batch_norm.py                  # branchy, GoogLeNet, ResNet-18 at batch 32
    python bench/bench_batch_norm.py --workloads resnet18:128 --rounds 7

One process, one GPU. Each network is built four times from the same seed (bench_streams.py's
networks and batches): nt.Step on one stream and with streams="auto", each captured with the
counters advanced per layer (``_batch_norm.DEFER_COUNTERS = False``) and together. Timing
alternates between the four in rounds (a CUDA-event mean over --steps steps after 10 untimed
ones); the table gives each one's median over --rounds rounds and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from nimble_train import _batch_norm
from nimble_train.bench.timing import ms_per_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streams import build  # noqa: E402  (the same networks, batches and capture)

WAYS = (("1 stream, per layer", 1, False), ("1 stream, together", 1, True),
        ("auto, per layer", "auto", False), ("auto, together", "auto", True))


def build_with(name: str, batch: int, streams, defer: bool, device: torch.device):
    saved = _batch_norm.DEFER_COUNTERS
    _batch_norm.DEFER_COUNTERS = defer  # read when the step is captured
    try:
        return build(name, batch, streams, device)
    finally:
        _batch_norm.DEFER_COUNTERS = saved


def measure(name: str, batch: int, args, device: torch.device) -> dict:
    built = {way: build_with(name, batch, streams, defer, device)
             for way, streams, defer in WAYS}
    samples = {way: [] for way, _, _ in WAYS}
    for _ in range(args.rounds):
        for way, _, _ in WAYS:
            samples[way].append(ms_per_step(*built[way], steps=args.steps, repeats=1, warm=10))
    row = {"workload": f"{name} b{batch}", **{way: statistics.median(samples[way])
                                              for way, _, _ in WAYS},
           "counters": built["auto, together"][0].stats()["batch_norm_counters"]}
    for step, _ in built.values():
        step.close()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+",
                        default=["branchy:32", "googlenet:32", "resnet18:32"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_batch_norm needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    rows = []
    for spec in args.workloads:
        name, _, batch = spec.partition(":")
        rows.append(measure(name, int(batch or 32), args, device))
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per step, "
          f"median of {args.rounds} alternating rounds of {args.steps} steps")
    print("| network | counters | " + " | ".join(way for way, _, _ in WAYS)
          + " | 1 stream: gain | auto: gain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        one, one_t, auto, auto_t = (r[way] for way, _, _ in WAYS)
        print(f"| {r['workload']} | {r['counters']} | {one:.3f} | {one_t:.3f} | {auto:.3f} "
              f"| {auto_t:.3f} | {one / one_t:.3f}x | {auto / auto_t:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
