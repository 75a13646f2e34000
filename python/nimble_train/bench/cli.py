"""A recipe's training step in several modes, side by side in one process on one GPU.

    python -m nimble_train.bench --model resnet18 --batch 32 --out bench-out
    python -m nimble_train.bench --model bert --batch 32 --seq 128 --modes eager compile-ro step

Every mode builds the same model from the same seed and runs the same batches. Reported per
mode: ms per step (median of --repeats runs of --steps steps, CUDA events, after 20 untimed
steps), samples/s, speed-up over eager and over torch.compile reduce-overhead, time to the
first fast step (from building the model; compilation and capture included), the GPU-busy
fraction (union of kernel time over elapsed GPU time, from a profile) and the GPU time per
step (that union per step: what a host-bound mode would take on a host that never kept the GPU
waiting), with the speed-up over the reduce-overhead rows' GPU time. A mode that fails says
why in its row; the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import shlex
import sys
from typing import Sequence

import torch

from .. import _torch_private
from .modes import MODES, Mode
from .report import add_ratios, format_table, write_all
from .timing import gpu_activity, ms_per_step, time_to_first_fast_step
from .workloads import Workload, add_workload_arguments, make_workload


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _note(step) -> str:
    stats = getattr(step, "stats", None)
    if not callable(stats):
        return ""
    s = stats()
    if not s.get("captured"):
        reason = s.get("capture_error") or "not captured"
        return f"eager: {reason}"[:120]
    split, sides = s.get("weight_grad_layers"), s.get("weight_grad_streams")
    backward = f", {split} weight grads on {sides} side stream(s)" if split else ""
    return f"{s.get('streams')} stream(s){backward}, {s.get('graph_nodes') or '?'} graph nodes"


def run_mode(w: Workload, mode: Mode, *, steps: int, repeats: int, profile: bool) -> dict:
    """Times one mode on one workload; never raises for a failing mode (the row says why)."""
    row = {"model": w.name, "batch": w.batch, "mode": mode.key, "label": mode.label,
           "ms_per_step": None, "samples_per_s": None, "first_step_s": None,
           "gpu_busy": None, "gpu_ms": None, "note": "", "error": None}
    step = None
    try:
        first_s, step = time_to_first_fast_step(lambda: mode.build(w), w.batches,
                                                mode.first_fast_call)
        ms = ms_per_step(step, w.batches, steps=steps, repeats=repeats)
        row.update(first_step_s=first_s, ms_per_step=ms, samples_per_s=w.batch / ms * 1e3,
                   note=_note(step))
        if profile:
            try:
                row["gpu_busy"], row["gpu_ms"] = gpu_activity(step, w.batches)
            except Exception as exc:  # the timing stands without the profile
                row["note"] = (row["note"] + f"; no profile: {_one_line(exc)}").lstrip("; ")
    except Exception as exc:
        row["error"] = _one_line(exc)
    finally:
        del step
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def run(model: str, batches: Sequence[int], modes: Sequence[str], *, seq: int = 128,
        bert_size: str = "base", steps: int = 50, repeats: int = 5,
        profile: bool = True, amp: str | None = None, log=print) -> tuple[list[dict], dict]:
    """Rows for every (batch, mode), and the metadata that goes with them."""
    rows, description = [], model
    for batch in batches:
        w = make_workload(model, batch, "cuda", seq=seq, bert_size=bert_size, amp=amp)
        description = w.description
        for key in modes:
            row = run_mode(w, MODES[key], steps=steps, repeats=repeats, profile=profile)
            log(f"  batch {batch:>4}  {row['label']:<32} " + (
                f"failed: {row['error']}" if row["error"] else f"{row['ms_per_step']:.3f} ms"))
            rows.append(row)
        del w
    add_ratios(rows)
    from .. import __version__
    meta = {"model": model, "description": description, "batches": list(batches),
            "modes": list(modes), "steps": steps, "repeats": repeats,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nimble_train": __version__,
            "command": " ".join(shlex.quote(a) for a in sys.argv),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    if model == "bert":
        meta.update(seq=seq, bert_size=bert_size)
    elif amp is not None:
        meta.update(amp=amp)
    return rows, meta


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m nimble_train.bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="modes: " + ", ".join(f"{k} ({m.label})" for k, m in MODES.items()))
    add_workload_arguments(parser, several_batches=True)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        metavar="MODE", help="modes to run (default: all): " + " ".join(MODES))
    parser.add_argument("--steps", type=int, default=50, help="timed steps per repeat (50)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; the median is kept")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the profiler run that measures the GPU-busy fraction")
    parser.add_argument("--compile-cache", action="store_true",
                        help="let torch.compile reuse its on-disk caches (default: compile "
                             "cold, so time to first step is what a first run costs)")
    parser.add_argument("--out", default="bench-out",
                        help="folder for <model>.json and <model>.png (default bench-out)")
    args = parser.parse_args(argv)
    if any(b < 1 for b in args.batch) or args.steps < 1 or args.repeats < 1:
        parser.error("--batch, --steps and --repeats must be >= 1")
    if "eager" not in args.modes:
        print("note: without the eager mode the 'vs eager' column stays empty")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("nimble_train.bench times training steps on a CUDA GPU; torch.cuda.is_available() "
              "is False here", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    if not args.compile_cache and any("compile" in m for m in args.modes):
        _torch_private.disable_compile_caches()
    print(f"benchmarking {args.model} on {torch.cuda.get_device_name()}: "
          f"{', '.join(args.modes)}")
    try:
        rows, meta = run(args.model, args.batch, args.modes, seq=args.seq,
                         bert_size=args.bert_size, steps=args.steps, repeats=args.repeats,
                         profile=not args.no_profile, amp=args.amp)
    except ImportError as exc:  # the workload's own dependency (transformers for BERT)
        print(f"nimble_train.bench: {exc}", file=sys.stderr)
        return 2
    print()
    print(format_table(rows, meta))
    stem = args.model if args.model != "bert" else f"bert-{args.bert_size}-seq{args.seq}"
    if args.amp and args.model != "bert":
        stem += f"-{args.amp}"
    for path in write_all(args.out, stem, rows, meta):
        print(f"wrote {path}")
    return 0
