"""Peak memory of a training step: nt.Step against eager and torch.compile, one process each.

    python bench/bench_memory.py                     # ResNet-18 b32, branchy b32, airbench b1024
    python bench/bench_memory.py --workloads bert --batch 32

Every row runs in a process of its own, so that nothing a previous row left (a compiled
model's caches, a freed pool's cyclic garbage) counts in the next; the rows' processes run side
by side on the one GPU (--jobs), which changes no process's own peak. cudnn.benchmark is off
in every row, so that autotuning's workspaces do not count.

- eager: four warm steps (``zero_grad(set_to_none=True)``, forward and loss, backward, the
  workload's optimizer), then the peak of allocated memory over one more step;
- compiled: the same loop over ``torch.compile(model)``, compiled with the dense attention
  masks Step's compiled models get (``bench.modes.dense_masks_while_compiling``);
- step-1 / step-auto: ``nt.Step(model, ...)`` with streams=1 / "auto", the peak over its
  warm-up, capture and replays (eight calls), and the graphs' private pool (its segments'
  bytes);
- step-compile-1 / step-compile-auto: the same over ``torch.compile(model)``.

Columns: the peak in MiB, the peak over eager's and over the compiled loop's, the pool in MiB,
the weight gradients on side streams (stats()["weight_grad_layers"]).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys

MODES = ("eager", "compiled", "step-1", "step-auto", "step-compile-1", "step-compile-auto")
WORKLOADS = {"resnet18": 32, "branchy": 32, "airbench": 1024, "bert": 32}
MiB = 2 ** 20


def measure(name: str, batch: int, mode: str) -> dict:
    """One row, in this process."""
    import torch

    import nimble_train as nt
    from nimble_train.bench.modes import dense_masks_while_compiling
    from nimble_train.bench.workloads import forward_loss, make_workload

    torch.backends.cudnn.benchmark = False
    workload = make_workload(name, batch, "cuda")
    torch.manual_seed(0)
    model = workload.make_model()
    optimizer = workload.make_optimizer(model)
    batches = workload.batches
    row = {"workload": f"{name} b{batch}", "mode": mode}
    if mode in ("eager", "compiled"):
        forward = (dense_masks_while_compiling(torch.compile(model)) if mode == "compiled"
                   else model)

        def step(batch):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=workload.amp == "bf16"):
                loss = forward_loss(forward, workload.loss_fn, batch)
            loss.backward()
            optimizer.step()

        for i in range(4):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(batches[0])
        torch.cuda.synchronize()
    else:
        compiled = mode.startswith("step-compile")
        streams = 1 if mode.endswith("-1") else "auto"
        torch.cuda.reset_peak_memory_stats()
        step = nt.Step(torch.compile(model) if compiled else model, optimizer,
                       workload.loss_fn, streams=streams, amp=workload.amp)
        for i in range(8):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
        stats = step.stats()
        row.update(pool=stats["pool_bytes"], weight_grads=stats["weight_grad_layers"],
                   phase=stats["phase"])
    row["peak"] = torch.cuda.max_memory_allocated()
    return row


def _in_a_process(name: str, batch: int, mode: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--row", name, str(batch), mode],
                            capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        tail = "\n".join((result.stderr or result.stdout).splitlines()[-5:])
        return {"workload": f"{name} b{batch}", "mode": mode, "error": tail}
    return json.loads(lines[-1])


def _table(rows: list[dict]) -> None:
    print(f"   {'workload':<14} {'mode':<18} {'peak MiB':>9} {'÷ eager':>8} {'÷ compiled':>10} "
          f"{'pool MiB':>9} {'side wgrads':>11}")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        anchor = {r["mode"]: r.get("peak") for r in mine}
        for r in mine:
            if "error" in r:
                print(f"   {workload:<14} {r['mode']:<18} failed: {r['error'].splitlines()[-1]}")
                continue
            ratios = [f"{r['peak'] / anchor[a]:.2f}x" if anchor.get(a) else "-"
                      for a in ("eager", "compiled")]
            pool = f"{r['pool'] / MiB:.0f}" if r.get("pool") else "-"
            print(f"   {workload:<14} {r['mode']:<18} {r['peak'] / MiB:9.0f} {ratios[0]:>8} "
                  f"{ratios[1]:>10} {pool:>9} {r.get('weight_grads', '-'):>11}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["resnet18", "branchy", "airbench"],
                        choices=WORKLOADS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--batch", type=int, help="default: 32, airbench 1024")
    parser.add_argument("--jobs", type=int, default=6, help="processes side by side")
    parser.add_argument("--row", nargs=3, metavar=("WORKLOAD", "BATCH", "MODE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        name, batch, mode = args.row
        print(json.dumps(measure(name, int(batch), mode)), flush=True)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("bench_memory measures CUDA memory: it needs a CUDA GPU", file=sys.stderr)
        return 2
    jobs = [(name, args.batch or WORKLOADS[name], mode)
            for name in args.workloads for mode in args.modes]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda job: _in_a_process(*job), jobs))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn.benchmark off")
    _table(rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
