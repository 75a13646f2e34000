"""ResNet-18/CIFAR training step, side by side in one process on one GPU.

A thin wrapper, kept so that its command line goes on working: the benchmark itself (timing
helpers, modes, table, JSON and chart) lives in the package, ``python -m nimble_train.bench``.
This runs its ResNet-18 comparison of eager, the hand-written whole-step graph,
torch.compile reduce-overhead and nt.Step on one stream.

    python bench/bench_step.py [--batch 32 128] [--no-compile] [--json out.json] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from nimble_train.bench import main as bench_main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", nargs="+", default=["32", "128"])
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--out", default="bench-out",
                        help="folder for resnet18.json and resnet18.png (default bench-out)")
    args = parser.parse_args(argv)
    modes = ["eager", "graph"] + ([] if args.no_compile else ["compile-ro"]) + ["step"]
    status = bench_main(["--model", "resnet18", "--batch", *args.batch, "--modes", *modes,
                         "--out", args.out])
    if status == 0 and args.json:
        shutil.copyfile(os.path.join(args.out, "resnet18.json"), args.json)
    return status


if __name__ == "__main__":
    sys.exit(main())
