"""Batch norms fused with the activation after them in planned steps, against the batch norm,
the addition and the activation as the model calls them (nimble_train/_batch_norm_act.py).

    python bench/bench_batch_norm_act.py     # branchy, GoogLeNet, ResNet-18 b32, airbench b1024
    python bench/bench_batch_norm_act.py --workloads resnet18:128 --rounds 7

One process, one GPU. Each network is built six times from the same seed (bench_streams.py's
networks and batches): nt.Step with streams=1 (cuDNN's batch norms, nothing fused: the fusion
rewrites the planned forward), and with streams="auto" (for a chain such as airbench's, the
backward's plan and a forward on one stream), captured with ``_capture.FUSE_BATCH_NORM_ACT``
off, on with torch's backward (``_batch_norm_act.OUR_BACKWARD = False``), on with torch's
statistics kernel (``_batch_norm_act.OUR_STATS = False``), on with our backward reading the
ReLU's mask from the output (``_batch_norm_act.MASK_BITS = False``) and on with ours for all.
Timing alternates between the six in rounds (a CUDA-event mean over --steps steps after 10
untimed ones); the table gives each one's median over --rounds rounds and the ratios of the
medians.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nimble_train import _batch_norm_act

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streams import alternate, build, measure_workloads  # noqa: E402

# (name, streams, fused, our backward, our statistics, the ReLU's mask as bits)
WAYS = (("1 stream", 1, False, True, True, True),
        ("auto, separate", "auto", False, True, True, True),
        ("auto, fused, torch's backward", "auto", True, False, True, True),
        ("auto, fused, torch's statistics", "auto", True, True, False, True),
        ("auto, fused, mask from the output", "auto", True, True, True, False),
        ("auto, fused", "auto", True, True, True, True))
SWITCHES = ("OUR_BACKWARD", "OUR_STATS", "MASK_BITS")


def build_with(name: str, batch: int, streams, fuse: bool, switches: tuple, device):
    saved = [getattr(_batch_norm_act, key) for key in SWITCHES]
    for key, value in zip(SWITCHES, switches):  # read when the step is captured
        setattr(_batch_norm_act, key, value)
    try:
        return build(name, batch, streams, device, {"FUSE_BATCH_NORM_ACT": fuse})
    finally:
        for key, value in zip(SWITCHES, saved):
            setattr(_batch_norm_act, key, value)


def measure(name: str, batch: int, args, device) -> dict:
    built = {way: build_with(name, batch, streams, fuse, switches, device)
             for way, streams, fuse, *switches in WAYS}
    fused = built["auto, fused"][0].stats()["fused_batch_norm_layers"]
    return {"workload": f"{name} b{batch}", **alternate(built, args), "fused": fused}


def main(argv=None) -> int:
    rows = measure_workloads(argv, __doc__.split("\n")[0], "bench_batch_norm_act", measure,
                             rounds=5, workloads=["branchy:32", "googlenet:32", "resnet18:32",
                                                  "airbench:1024"])
    if rows is None:
        return 2
    print("| network | fused | " + " | ".join(way for way, *_ in WAYS)
          + " | fused: gain | our backward: gain | our statistics: gain | mask bits: gain"
          " | auto ÷ 1 stream: separate | fused |")
    print("|---" * 14 + "|")
    for r in rows:
        one, separate, torch_backward, torch_stats, from_output, fused = (
            r[way] for way, *_ in WAYS)
        print(f"| {r['workload']} | {r['fused']} | {one:.3f} | {separate:.3f} "
              f"| {torch_backward:.3f} | {torch_stats:.3f} | {from_output:.3f} | {fused:.3f} "
              f"| {separate / fused:.3f}x | {torch_backward / fused:.3f}x "
              f"| {torch_stats / fused:.3f}x | {from_output / fused:.3f}x "
              f"| {one / separate:.3f}x | **{one / fused:.3f}x** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
