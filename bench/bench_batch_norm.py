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

import sys
from pathlib import Path

import torch

from nimble_train import _batch_norm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streams import (alternate, build, measure_workloads,  # noqa: E402
                           print_switch_table)

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
    counters = built["auto, together"][0].stats()["batch_norm_counters"]
    return {"workload": f"{name} b{batch}", **alternate(built, args), "counters": counters}


def main(argv=None) -> int:
    rows = measure_workloads(argv, __doc__.split("\n")[0], "bench_batch_norm", measure,
                             rounds=5)
    if rows is None:
        return 2
    print_switch_table(rows, WAYS, "counters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
