"""The benchmark's results as a table, a JSON file and a bar chart.

A row is a dict: model, batch, mode (key), label, ms_per_step, samples_per_s, first_step_s,
gpu_busy, gpu_ms (GPU time per step, from a profile), note, error (None, or why the mode
failed: its other figures are then None), and the ratios vs_eager, vs_reduce_overhead (the best
reduce-overhead row), vs_graph (the best hand-written graph row) and vs_reduce_overhead_gpu
that add_ratios fills in (reference time / this time: above 1 is faster).

vs_reduce_overhead_gpu is over the smallest GPU time of the reduce-overhead rows. Those rows are
host-bound at small batches: their ms per step are set by how fast the CPU runs cudagraph
trees' and autograd's Python, and differ between machines with the same GPU. Their GPU time is
what they would take on a host fast enough never to keep the GPU waiting, so this ratio is the
one a faster machine cannot lower.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

# Each ratio column's reference: the fastest of these modes in the same batch.
REFERENCE_MODES = {"vs_eager": ("eager",), "vs_reduce_overhead": ("compile-ro", "compile-ro-opt"),
                   "vs_graph": ("graph", "graph-fused", "graph-fused-kernels")}
# Ratios over the references' GPU time per step rather than their wall time.
GPU_REFERENCE_MODES = {"vs_reduce_overhead_gpu": ("compile-ro", "compile-ro-opt")}


def add_ratios(rows: list[dict]) -> list[dict]:
    """Speed-up of each row over the eager row, the best reduce-overhead row and the best
    hand-written graph row of the same batch, and over the smallest GPU time per step of the
    reduce-overhead rows."""
    columns = [(c, refs, "ms_per_step") for c, refs in REFERENCE_MODES.items()]
    columns += [(c, refs, "gpu_ms") for c, refs in GPU_REFERENCE_MODES.items()]
    for row in rows:
        for column, references, key in columns:
            times = [r[key] for r in rows if r["batch"] == row["batch"]
                     and r["mode"] in references and _number(r.get(key))]
            ok = times and _number(row.get("ms_per_step"))
            row[column] = min(times) / row["ms_per_step"] if ok else None
    return rows


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _fmt(x: Any, spec: str, suffix: str = "") -> str:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "-"
    return format(x, spec) + suffix


def title(meta: dict) -> str:
    return (f"{meta.get('description', meta.get('model', '?'))} — {meta.get('gpu', '?')}, "
            f"torch {meta.get('torch', '?')}")


def format_table(rows: Sequence[dict], meta: dict) -> str:
    """The rows as a fixed-width text table under a title line and a line on the method."""
    label_width = max([len(r["label"]) for r in rows] + [4])
    head = (f"{'batch':>5}  {'mode':<{label_width}}  {'ms/step':>8}  {'samples/s':>10}  "
            f"{'vs eager':>8}  {'vs r-o':>7}  {'vs graph':>8}  {'first step':>10}  "
            f"{'GPU busy':>8}  {'GPU ms':>7}  {'vs r-o GPU':>10}  note")
    lines = [title(meta),
             f"median of {meta.get('repeats', '?')} x {meta.get('steps', '?')} steps, CUDA "
             "events; first step: from building the model to the end of the first fast step; "
             "GPU ms: busy GPU time per step (a profile); vs r-o GPU: over the reduce-overhead "
             "rows' GPU ms, the time they approach on a host that never keeps the GPU waiting",
             head, "-" * len(head)]
    for r in rows:
        start = f"{r['batch']:>5}  {r['label']:<{label_width}}  "
        if r.get("error"):
            lines.append(start + "failed: " + r["error"])
            continue
        lines.append(
            start + f"{_fmt(r.get('ms_per_step'), '.3f'):>8}  "
            f"{_fmt(r.get('samples_per_s'), ',.0f'):>10}  "
            f"{_fmt(r.get('vs_eager'), '.2f', 'x'):>8}  "
            f"{_fmt(r.get('vs_reduce_overhead'), '.2f', 'x'):>7}  "
            f"{_fmt(r.get('vs_graph'), '.2f', 'x'):>8}  "
            f"{_fmt(r.get('first_step_s'), '.1f', ' s'):>10}  "
            f"{_fmt(r.get('gpu_busy'), '.0%'):>8}  {_fmt(r.get('gpu_ms'), '.3f'):>7}  "
            f"{_fmt(r.get('vs_reduce_overhead_gpu'), '.2f', 'x'):>10}  "
            f"{r.get('note') or ''}".rstrip())
    return "\n".join(lines)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no NaN
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_json(path: str, rows: Sequence[dict], meta: dict) -> str:
    with open(path, "w") as f:
        json.dump(_json_safe({"meta": meta, "rows": list(rows)}), f, indent=1)
        f.write("\n")
    return path


def read_json(path: str) -> tuple[list[dict], dict]:
    with open(path) as f:
        data = json.load(f)
    return data["rows"], data["meta"]


_COLOURS = {"eager": "#9e9e9e", "eager-fused": "#757575", "compile": "#90caf9",
            "compile-ro": "#1e88e5", "compile-ro-opt": "#0d47a1", "graph": "#ffb74d",
            "graph-fused": "#f57c00", "graph-fused-kernels": "#e65100", "step": "#43a047",
            "step-auto": "#1b5e20", "step-compile": "#2e7d32"}


def plot(path: str, rows: Sequence[dict], meta: dict) -> str | None:
    """A bar chart of time per step (with the speed-up over eager written on each bar) and of
    the GPU-busy fraction, one row of panels per batch size. Returns the path, or None (after
    saying why) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no chart was drawn (the table and JSON are "
              "written): pip install matplotlib")
        return None

    batches = sorted({r["batch"] for r in rows})
    height = sum(0.9 + 0.42 * sum(r["batch"] == b for r in rows) for b in batches) + 0.8
    fig, axes = plt.subplots(len(batches), 2, figsize=(12, height), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for (ax_ms, ax_busy), batch in zip(axes, batches):
        mine = [r for r in rows if r["batch"] == batch][::-1]  # first mode on top
        labels = [r["label"] for r in mine]
        ms = [r["ms_per_step"] if _number(r.get("ms_per_step")) else 0.0 for r in mine]
        colours = [_COLOURS.get(r["mode"], "#8e24aa") for r in mine]
        ax_ms.barh(labels, ms, color=colours)
        longest = max(ms + [1e-9])
        for i, r in enumerate(mine):
            if r.get("error"):
                text = "failed: " + r["error"][:70]
                ax_ms.text(longest * 0.01, i, text, va="center", color="#c62828", fontsize=8)
                continue
            speedup = _fmt(r.get("vs_eager"), ".2f", "× eager")
            ax_ms.text(ms[i] + longest * 0.01, i, f"{ms[i]:.2f} ms   {speedup}", va="center",
                       fontsize=9)
        ax_ms.set_xlim(0, longest * 1.35)
        ax_ms.set_xlabel("ms per training step (lower is better)")
        ax_ms.set_title(f"batch {batch}", loc="left", fontsize=10)
        busy = [r["gpu_busy"] * 100 if _number(r.get("gpu_busy")) else 0.0 for r in mine]
        ax_busy.barh(labels, busy, color=colours)
        for i, r in enumerate(mine):
            if not r.get("error") and not _number(r.get("gpu_busy")):
                ax_busy.text(2, i, "not measured", va="center", color="#616161", fontsize=8)
        ax_busy.set_xlim(0, 100)
        ax_busy.set_yticks([])
        ax_busy.set_xlabel("GPU busy, % of the step")
    fig.suptitle(title(meta), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_all(out_dir: str, stem: str, rows: Sequence[dict], meta: dict) -> list[str]:
    """Writes <stem>.json and <stem>.png under out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written = [write_json(os.path.join(out_dir, stem + ".json"), rows, meta)]
    png = plot(os.path.join(out_dir, stem + ".png"), rows, meta)
    if png:
        written.append(png)
    return written
