"""Data-parallel training step on several GPUs: DDP eager, DDP captured by hand, nt.Step.

One invocation prints one table. The script launches itself: run without torchrun, it times
nt.Step on one GPU (the baseline for the scaling efficiency), then starts one worker per GPU
through torch.distributed.run and reads what rank 0 reports.

    python bench/bench_dist.py --gpus 2 [--model resnet18|bert] [--batch 32] [--steps 50]
                               [--repeats 5] [--bucket-mb 25 ...] [--shard-optimizer] [--sync-bn]
                               [--grad-clip MAX] [--optimizer adamw|lamb] [--json out.json]

Each worker runs the same modes one after the other, each with a fresh model and optimizer
from the same seed and its own synthetic data (seed + rank), --batch samples per GPU:
ddp-eager (DistributedDataParallel, eager loop), ddp-graph (PyTorch's recipe for capturing
a whole DDP step as one CUDA graph), step-serial (nt.Step(overlap_update=False): the update
after the backward, as one pass) and step (nt.Step, which all-reduces gradients inside its own
graph and updates each bucket right after its all-reduce, while the backward goes on). A row's
time is the slowest rank's median of --repeats runs of --steps steps. With --shard-optimizer
two last rows time nt.Step(shard_optimizer=True) (ZeRO-1: reduce-scatter, each rank's update
of its part, all-gather, in the graph; each GPU keeps 1/N of the optimizer state), with the
update and all-gather after the backward and per bucket. With --sync-bn every mode on N GPUs
converts the model's BatchNorm layers to SyncBatchNorm (statistics over all GPUs' samples: one
all-gather in the forward and one all-reduce in the backward per layer); the one-GPU
baseline keeps BatchNorm. With --grad-clip every mode clips the global gradient norm
(clip_grad_norm_ with foreach, captured in ddp-graph; nt.Step(grad_clip=MAX), whose update then
needs every gradient: its "step" rows take each bucket's share of the norm right after the
bucket's collective and update after the backward). With --optimizer lamb (BERT) every mode
trains with nimble_train's LAMB, which only nt.Step runs fused: torch has no fused LAMB for
the DDP rows (eager, its plain step would read the step count on the host for every tensor;
captured, it cannot be), so the table has nt.Step's rows alone.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

import nimble_train as nt
from nimble_train.bench.cli import _note, _one_line
from nimble_train.bench.modes import _autocast, _eager_loop, _fresh, anchor_capture, graph_step
from nimble_train.bench.report import _fmt, _number, read_json, title, write_json
from nimble_train.bench.timing import ms_per_step
from nimble_train.bench.workloads import (Workload, forward_loss, make_workload,
                                          why_not_optimizer)

LABELS = {"ddp-eager": "DDP eager", "ddp-graph": "DDP whole-step graph", "step": "nt.Step",
          "step-serial": "nt.Step, update after bw", "step-shard": "nt.Step, sharded opt.",
          "step-shard-serial": "nt.Step, sharded, after bw"}
SEED = 0
TORCHRUN_TIMEOUT_S = 500
DDP_WARMUP = 11  # DDP needs this many eager iterations before capture (torch's docs)


# ---------------------------------------------------------------------- modes (workers)


def _clipped(model, optimizer, grad_clip: float | None):
    """optimizer.step, after clip_grad_norm_ (foreach: no host sync, capturable) when asked."""
    if grad_clip is None:
        return optimizer.step

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True)
        optimizer.step()
    return update


def ddp_eager(w: Workload, local_rank: int, grad_clip: float | None = None):
    model, optimizer = _fresh(w)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[local_rank], gradient_as_bucket_view=True)
    return _eager_loop(w, ddp, model, optimizer, update=_clipped(model, optimizer, grad_clip))


def ddp_graph(w: Workload, local_rank: int, grad_clip: float | None = None):
    """Torch's "whole-network capture" with DDP: DDP built and warmed up on a side stream,
    then forward, backward (with its all-reduce) and the capturable optimizer in one graph,
    SDPA given dense attention masks as in Step's capture (modes.anchor_capture)."""
    model, optimizer = _fresh(w, capturable=True)
    update = _clipped(model, optimizer, grad_clip)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank], gradient_as_bucket_view=True)
        for i in range(DDP_WARMUP):
            # Zeroing in place keeps every .grad a view of DDP's buckets, at fixed addresses.
            optimizer.zero_grad(set_to_none=False)
            with _autocast(w.amp):
                loss = forward_loss(ddp, w.loss_fn, w.batches[i % len(w.batches)])
            loss.backward()
            update()
    torch.cuda.current_stream().wait_stream(side)

    static = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                             w.batches[0])
    graph = torch.cuda.CUDAGraph()
    with anchor_capture(graph):
        # Backward accumulates into the bucket views, so every replay must zero them first.
        optimizer.zero_grad(set_to_none=False)
        with _autocast(w.amp, cache=False):
            static_loss = forward_loss(ddp, w.loss_fn, static)
        static_loss.backward()
        update()
    return graph_step(graph, static, static_loss, ddp, optimizer)


def nt_step(w: Workload, local_rank: int | None = None, bucket_mb: float = 25.0,
            grad_clip: float | None = None, shard: bool = False,
            overlap_update: bool = True) -> nt.Step:
    # Step finds an initialised process group by itself: the same call on one GPU and on N
    # (local_rank is unused; it keeps the modes' signatures alike).
    model, optimizer = _fresh(w)
    return nt.Step(model, optimizer, w.loss_fn, amp=w.amp, bucket_mb=bucket_mb,
                   grad_clip=grad_clip, shard_optimizer=shard, overlap_update=overlap_update)


def nt_step_serial(w: Workload, local_rank: int | None = None, bucket_mb: float = 25.0,
                   grad_clip: float | None = None):
    """nt.Step with the update after the backward, as one pass (the lever's other side)."""
    return nt_step(w, local_rank, bucket_mb, grad_clip, overlap_update=False)


def nt_step_sharded(w: Workload, local_rank: int | None = None, bucket_mb: float = 25.0,
                    grad_clip: float | None = None):
    return nt_step(w, local_rank, bucket_mb, grad_clip, shard=True)


def nt_step_sharded_serial(w: Workload, local_rank: int | None = None,
                           bucket_mb: float = 25.0, grad_clip: float | None = None):
    return nt_step(w, local_rank, bucket_mb, grad_clip, shard=True, overlap_update=False)


MODES = {"ddp-eager": ddp_eager, "ddp-graph": ddp_graph, "step": nt_step,
         "step-serial": nt_step_serial, "step-shard": nt_step_sharded,
         "step-shard-serial": nt_step_sharded_serial}


def _release_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def measure(key: str, w: Workload, info, args, bucket_mb: float | None = None
            ) -> tuple[dict, object, float]:
    """One mode on every rank: its row (slowest rank's time, or the errors), the step
    function (or None) and the wall-clock time at which this rank finished its timed steps."""
    step, error, ms = None, None, 0.0
    try:
        options = {"grad_clip": args.grad_clip}
        if bucket_mb is not None:
            options["bucket_mb"] = bucket_mb
        step = MODES[key](w, info.local_rank, **options)
        ms = ms_per_step(step, w.batches, steps=args.steps, repeats=args.repeats)
    except Exception as exc:  # the row says why; the other modes still run
        error = _one_line(exc)
    finished = time.time()
    # Every rank must learn whether any rank failed, so that all skip or join the reduction.
    errors = [None] * info.world_size
    dist.all_gather_object(errors, error)
    label = LABELS[key] + (f", {bucket_mb:g} MB buckets" if bucket_mb is not None else "")
    row = {"mode": key, "label": label, "gpus": info.world_size, "batch": w.batch,
           "ms_per_step": None, "samples_per_s": None, "note": "", "error": None}
    failed: dict[str, list[int]] = {}  # error -> the ranks that raised it
    for r, e in enumerate(errors):
        if e:
            failed.setdefault(e, []).append(r)
    if failed:
        row["error"] = "; ".join(
            e if len(ranks) == info.world_size else f"rank {','.join(map(str, ranks))}: {e}"
            for e, ranks in failed.items())[:300]
    else:
        slowest = torch.tensor([ms], device=info.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        row["ms_per_step"] = slowest.item()
        row["samples_per_s"] = info.world_size * w.batch / row["ms_per_step"] * 1e3
    dist.barrier()
    return row, step, finished


def worker(args) -> int:
    info = nt.init_distributed()
    torch.backends.cudnn.benchmark = True
    w = make_workload(args.model, args.batch, info.device, seed=SEED + info.rank,
                      optimizer=args.optimizer)
    if args.sync_bn:
        make_model = w.make_model
        w.make_model = lambda: torch.nn.SyncBatchNorm.convert_sync_batchnorm(make_model())
    rows, step, last_step_wall = [], None, None
    # "step" last, so that its communicator is the last one to close; one row per bucket size.
    ddp = [("ddp-eager", None), ("ddp-graph", None)] if args.optimizer != "lamb" else []
    runs = ddp + [("step-serial", args.bucket_mb[0])] + [("step", mb) for mb in args.bucket_mb]
    if args.shard_optimizer:
        runs += [("step-shard-serial", args.bucket_mb[0]), ("step-shard", args.bucket_mb[0])]
    for i, (key, mb) in enumerate(runs):
        row, step, last_step_wall = measure(key, w, info, args, mb)
        if key.startswith("step") and step is not None and info.rank == 0:
            stats = step.stats()
            state_mb = (stats.get("optimizer_state_bytes") or 0) / 2**20
            extra = [f"world {stats['world_size']}" if "world_size" in stats else "",
                     f"{stats['buckets']} buckets" if "buckets" in stats else "",
                     f"optimizer state {state_mb:.1f} MB/GPU" if state_mb else ""]
            row["note"] = ", ".join(x for x in [_note(step), *extra] if x)
            row.update({k: stats[k] for k in ("world_size", "buckets") if k in stats})
        if info.rank == 0:
            print(f"  {row['label']:<24} " + (f"failed: {row['error']}" if row["error"]
                                              else f"{row['ms_per_step']:.3f} ms"), flush=True)
        rows.append(row)
        if i + 1 < len(runs):
            if callable(getattr(step, "close", None)):
                step.close()
            del step
            _release_memory()
    if info.rank == 0:
        meta = {"model": args.model, "description": w.description, "batch": args.batch,
                "world_size": info.world_size, "steps": args.steps, "repeats": args.repeats,
                "gpu": torch.cuda.get_device_name(info.device), "torch": torch.__version__,
                "cuda": torch.version.cuda, "nimble_train": nt.__version__,
                "sync_bn": args.sync_bn, "grad_clip": args.grad_clip,
                "optimizer": args.optimizer,
                "last_step_wall": last_step_wall}
        write_json(args.worker_out, rows, meta)
    if step is not None and callable(getattr(step, "close", None)):
        step.close()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------- launcher


def single_gpu_baseline(args) -> dict:
    """nt.Step on one GPU with the per-GPU batch, no process group: the scaling reference."""
    w = make_workload(args.model, args.batch, "cuda", seed=SEED, optimizer=args.optimizer)
    row = {"mode": "step", "label": LABELS["step"], "gpus": 1, "batch": args.batch,
           "ms_per_step": None, "samples_per_s": None, "note": "baseline", "error": None}
    step = None
    try:
        step = nt_step(w, grad_clip=args.grad_clip)
        row["ms_per_step"] = ms_per_step(step, w.batches, steps=args.steps,
                                         repeats=args.repeats)
        row["samples_per_s"] = args.batch / row["ms_per_step"] * 1e3
        state = step.stats().get("optimizer_state_bytes")
        if state:
            row["note"] += f", optimizer state {state / 2**20:.1f} MB/GPU"
    except Exception as exc:
        row["error"] = _one_line(exc)
    if step is not None and callable(getattr(step, "close", None)):
        step.close()
    # Rank 0 shares this GPU: give back everything but the CUDA context before it starts.
    del step, w
    _release_memory()
    return row


def run_torchrun(args, out_path: str) -> tuple[int, str, float]:
    """Starts the workers; returns their exit status, stderr's tail and when they exited."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.gpus}", os.path.abspath(__file__),
               "--gpus", str(args.gpus), "--model", args.model, "--batch", str(args.batch),
               "--steps", str(args.steps), "--repeats", str(args.repeats),
               "--bucket-mb", *map(str, args.bucket_mb), "--worker-out", out_path]
    if args.sync_bn:
        command.append("--sync-bn")
    if args.shard_optimizer:
        command.append("--shard-optimizer")
    if args.grad_clip is not None:
        command += ["--grad-clip", str(args.grad_clip)]
    if args.optimizer is not None:
        command += ["--optimizer", args.optimizer]
    # stderr goes to a file rather than a pipe: workers that outlive torchrun would hold a
    # pipe open and block the read.
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stderr=err, text=True)
        try:
            proc.wait(timeout=TORCHRUN_TIMEOUT_S)
            stopped = ""
        except subprocess.TimeoutExpired:
            # On SIGTERM torchrun stops its workers (each runs in a session of its own).
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            stopped = f"\n(torchrun stopped after {TORCHRUN_TIMEOUT_S} s)"
        exited = time.time()
        err.seek(0)
        tail = "\n".join(err.read().splitlines()[-40:]) + stopped
    return proc.returncode, tail, exited


def add_ratios(rows: list[dict], baseline: dict) -> None:
    """Speed-ups over the N-GPU DDP rows, and Step's efficiency relative to one GPU."""
    timed = {r["mode"]: r["ms_per_step"] for r in rows
             if r is not baseline and _number(r.get("ms_per_step"))}
    for row in rows:
        if row is baseline or not _number(row.get("ms_per_step")):
            continue
        for column, ref in (("vs_ddp_eager", "ddp-eager"), ("vs_ddp_graph", "ddp-graph")):
            row[column] = timed[ref] / row["ms_per_step"] if ref in timed else None
        if row["mode"].startswith("step") and _number(baseline.get("ms_per_step")):
            row["scaling"] = baseline["ms_per_step"] / row["ms_per_step"]


def format_table(rows: list[dict], meta: dict) -> str:
    head = (f"{'mode':<24}  {'GPUs':>4}  {'batch/GPU':>9}  {'ms/step':>8}  {'samples/s':>10}  "
            f"{'scaling':>7}  {'vs DDP eager':>12}  {'vs DDP graph':>12}  note")
    sync_bn = ", SyncBatchNorm on N GPUs" if meta.get("sync_bn") else ""
    clip = f", gradients clipped to norm {meta['grad_clip']:g}" if meta.get("grad_clip") else ""
    lamb = (", LAMB (no DDP rows: torch has no fused LAMB)"
            if meta.get("optimizer") == "lamb" else "")
    lines = [f"{title(meta)}, {meta['model']}, batch {meta['batch']} per GPU{sync_bn}{clip}{lamb}",
             f"median of {meta['repeats']} x {meta['steps']} steps, CUDA events, slowest rank; "
             "samples/s over all GPUs; scaling: per-GPU throughput vs nt.Step on one GPU",
             head, "-" * len(head)]
    for r in rows:
        start = f"{r['label']:<24}  {r['gpus']:>4}  {r['batch']:>9}  "
        if r.get("error"):
            lines.append(start + "failed: " + r["error"])
            continue
        lines.append((start + f"{_fmt(r.get('ms_per_step'), '.3f'):>8}  "
                      f"{_fmt(r.get('samples_per_s'), ',.0f'):>10}  "
                      f"{_fmt(r.get('scaling'), '.0%'):>7}  "
                      f"{_fmt(r.get('vs_ddp_eager'), '.2f', 'x'):>12}  "
                      f"{_fmt(r.get('vs_ddp_graph'), '.2f', 'x'):>12}  "
                      f"{r.get('note') or ''}").rstrip())
    return "\n".join(lines)


def launcher(args) -> int:
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"bench_dist.py needs {args.gpus} CUDA GPU(s); this machine has {have}",
              file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    print(f"{args.model}, batch {args.batch} per GPU: nt.Step on 1 GPU", flush=True)
    try:
        baseline = single_gpu_baseline(args)
    except ImportError as exc:  # the workload's own dependency (transformers for BERT)
        print(f"bench_dist.py: {exc}", file=sys.stderr)
        return 2
    print(f"  {'nt.Step, 1 GPU':<24} " + (f"failed: {baseline['error']}" if baseline["error"]
                                         else f"{baseline['ms_per_step']:.3f} ms"))
    print(f"then {args.gpus} GPUs under torch.distributed.run", flush=True)

    fd, out_path = tempfile.mkstemp(prefix="bench_dist-", suffix=".json")
    os.close(fd)
    try:
        status, stderr_tail, exited = run_torchrun(args, out_path)
        try:
            rows, meta = read_json(out_path)
        except (OSError, ValueError, KeyError):
            rows, meta = None, None
    finally:
        os.remove(out_path)
    if status != 0 or rows is None:
        print(f"torchrun exited with status {status}; its stderr ends with:\n{stderr_tail}",
              file=sys.stderr)
        if rows is None:
            return 1

    rows = [baseline] + rows
    add_ratios(rows, baseline)
    meta["exit_after_last_step_s"] = exited - meta["last_step_wall"]
    print()
    print(format_table(rows, meta))
    print(f"job exited {meta['exit_after_last_step_s']:.1f} s after its last step")
    if args.json:
        print(f"wrote {write_json(args.json, rows, meta)}")
    return 0 if status == 0 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="GPUs, one worker each (2)")
    parser.add_argument("--model", choices=("resnet18", "bert"), default="resnet18",
                        help="resnet18 (CIFAR, SGD) or bert (BERT-base, bf16, AdamW)")
    parser.add_argument("--batch", type=int, default=32, help="samples per GPU (32)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per repeat (50)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; the median is kept")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0],
                        help="nt.Step's gradient bucket size(s) in MB; one row each (25)")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="also time nt.Step(shard_optimizer=True): ZeRO-1 inside the graph")
    parser.add_argument("--sync-bn", action="store_true",
                        help="on N GPUs, convert BatchNorm to SyncBatchNorm (every mode)")
    parser.add_argument("--grad-clip", type=float, metavar="MAX",
                        help="every mode clips the global gradient norm to MAX")
    parser.add_argument("--optimizer", choices=("adamw", "lamb"), default=None,
                        help="BERT's optimizer: adamw (default) or lamb (nt.Step rows only)")
    parser.add_argument("--json", help="also write the rows and metadata to this file")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set by the launcher
    args = parser.parse_args(argv)
    if min(args.gpus, args.batch, args.steps, args.repeats) < 1:
        parser.error("--gpus, --batch, --steps and --repeats must be >= 1")
    if args.grad_clip is not None and not 0 < args.grad_clip < float("inf"):
        parser.error(f"--grad-clip must be a positive finite number; got {args.grad_clip}")
    why = why_not_optimizer(args.model, args.optimizer)
    if why is not None:  # before any GPU or torchrun
        parser.error(why)
    if "RANK" not in os.environ:
        return launcher(args)
    if not args.worker_out:
        parser.error("under torchrun, run by the launcher: python bench/bench_dist.py --gpus N")
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
