"""Variable-length BERT fine-tuning: nt.Step with shape buckets against eager and torch.compile.

    python bench/bench_buckets.py                          # BERT-base, batch 8, 8 rows
    python bench/bench_buckets.py --rows eager compile-ro step-buckets --steps 100
    python bench/bench_buckets.py --cpu-check              # tiny BERT on the CPU, code paths only

One process, one GPU. Hugging Face's BertForSequenceClassification (built from its config,
nothing downloaded; pad id 0, two labels), bf16 autocast, AdamW at lr 2e-5 with no decay on
biases and LayerNorm weights, dropout on. The data are synthetic sequence-classification
batches: lengths log-normal (median 64 tokens, sigma 0.7, clipped to [16, --max-len]: most
under 128, a tail to 512), [CLS] first and [SEP] last, random content tokens except the first,
one of 16 cue tokens whose parity is the label (a lookup, so the loss has somewhere to go).
Every row trains a fresh model from the same seed on the same batches in the same order; only
the padding differs, and attention_mask 0 on padding makes it exact. The rows:

- eager: per-batch dynamic padding (to the batch's longest sequence, as DataCollatorWithPadding
  does); zero_grad(set_to_none=True), torch's fused AdamW (its fastest eager update). Hugging
  Face's mask code asks the host whether the batch has padding at every eager forward.
- eager-512: every batch padded to --max-len: one shape, every padded token computed.
- compile: torch.compile(model) default mode on the dynamic batches, dynamic shapes left to torch
  (the first length compiles static, the second recompiles with the length symbolic); eager
  fused AdamW. The note counts the graphs dynamo compiled.
- compile-ro: torch.compile(model, mode="reduce-overhead") on the dynamic batches, each step
  marked with cudagraph_mark_step_begin(). Cudagraph trees record a graph per distinct length
  (the note's shapes): the user's default, paid each time the data bring a new length.
- compile-ro-64: the same with every length rounded up to a multiple of 64
  (DataCollatorWithPadding(pad_to_multiple_of=64)): at most 8 shapes, so recording stops early;
  dynamic shapes left to torch, so a length first seen late costs a recording, not a compile.
- step-512: nt.Step(model, optimizer, streams=1, amp="bf16") on batches padded to --max-len
  (a Step's template is fixed by its first batch).
- step-buckets: the same Step with buckets=nt.Buckets(sizes=(64, 128, 256, 512), dim=1), fed the
  dynamically padded batches; Step pads each to its smallest fitting bucket (input ids and
  attention mask with 0; the labels, one per sequence, have no length to pad).
- step-buckets-compile: that Step over torch.compile(model, dynamic=True). Step calls the module
  with four shapes only and replays the kernels in its graphs, so guards and launches are paid at
  capture only; one compile with the length symbolic serves every bucket, so a bucket's first
  (captured) call finds its kernels compiled. dynamic=False would compile each bucket (four
  compiles of forward and backward, one possibly inside a capture) for kernels that differ only
  in the fused element-wise and LayerNorm ones: the matmuls (cuBLAS) and attention (SDPA) are
  the same kernels either way.

The compiled rows compile with the dense attention masks Step gives a compiled model's SDPA
(nimble_train/_inductor_masks.py), so that every row runs the same attention kernels.

Method: an epoch of --repeats x --steps batches, run twice. The first epoch is cold: it pays
every first time (compilation, recompilation, a recording per new shape, cuBLAS and cuDNN
meeting a shape, Step's warm-up and captures); its wall-clock seconds are the "epoch 1" column.
The second epoch is the steady state a long run reaches, timed in --repeats windows of --steps
consecutive steps (the epoch's slices, in order): CUDA events bracket each window (one sync at
its end); the table keeps the median. Every row thus meets every shape before it is timed, so
no row is charged for a first time in its timed windows. tokens/s counts real tokens only,
never padding.
x best: throughput over the best row that is not nt.Step. Peak: max_memory_allocated of the
row, the batches on the device left out; pool: step.stats()["pool_bytes"]. gap: the distance of
the row's parameters from eager's after the first epoch, over the distance eager moved them
(|theta - theta_eager| / |theta_eager - theta_0|). Dropout draws differ between rows (eager at
another shape, inductor and graphs each draw their own masks), so the gap is not 0: eager-512 is
eager itself with other draws, and its gap is the floor the others should be near. Also printed:
the length quantiles, each padding's waste, and for step-buckets the wall-clock seconds from
nt.Step(...) until each bucket the batches reach had a replayed step (a sync after every call,
on a Step of its own, apart from the timed windows).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

import nimble_train as nt
from nimble_train.bench.modes import dense_masks_while_compiling
from nimble_train.bench.report import _fmt, write_json
from nimble_train.bench.workloads import (CLS_ID, FIRST_CONTENT_ID, PAD_ID, SEP_ID, bert_config,
                                          bert_optimizer, require_transformers)

LR = 2e-5
BUCKETS = (64, 128, 256, 512)
CUES = 16  # the first content token is one of these many; its parity is the label


# ---------------------------------------------------------------------- data


@dataclass
class Data:
    """Samples padded to max_len on the host; batches are cut from them per padding scheme."""

    ids: torch.Tensor      # [samples, max_len] int64, PAD_ID after each sequence
    mask: torch.Tensor     # [samples, max_len] int64, 1 on real tokens
    labels: torch.Tensor   # [samples] int64
    lengths: torch.Tensor  # [samples] real tokens per sample
    batch: int

    @property
    def longest(self) -> list[int]:
        return self.lengths.view(-1, self.batch).max(dim=1).values.tolist()

    def tokens(self, i: int) -> int:
        """Real tokens of batch i."""
        return int(self.lengths[i * self.batch:(i + 1) * self.batch].sum())

    def batches(self, pad: Callable[[int], int], device) -> list[dict]:
        """Every batch padded to pad(its longest sequence), on `device`."""
        out = []
        for i, longest in enumerate(self.longest):
            rows, width = slice(i * self.batch, (i + 1) * self.batch), pad(longest)
            out.append({"input_ids": self.ids[rows, :width].contiguous().to(device),
                        "attention_mask": self.mask[rows, :width].contiguous().to(device),
                        "labels": self.labels[rows].to(device)})
        return out


def make_data(batches: int, batch: int, max_len: int, vocab_size: int, seed: int = 0) -> Data:
    g = torch.Generator().manual_seed(seed)
    samples = batches * batch
    # log-normal, median 64, sigma 0.7: p90 = 64 e^(1.28 * 0.7) = 157, p99 = 326, and 0.15% of
    # the samples would pass 512 (clipped there)
    lengths = torch.exp(math.log(64) + 0.7 * torch.randn(samples, generator=g))
    lengths = lengths.round().clamp(16, max_len).long()
    ids = torch.randint(FIRST_CONTENT_ID + CUES, vocab_size, (samples, max_len), generator=g)
    cue = torch.randint(0, CUES, (samples,), generator=g)
    ids[:, 0], ids[:, 1] = CLS_ID, FIRST_CONTENT_ID + cue
    positions = torch.arange(max_len)
    ids[positions >= lengths[:, None]] = PAD_ID
    ids[torch.arange(samples), lengths - 1] = SEP_ID
    mask = (positions < lengths[:, None]).long()
    return Data(ids, mask, cue % 2, lengths, batch)


def bucket_sizes(max_len: int) -> tuple[int, ...]:
    return tuple(s for s in BUCKETS if s < max_len) + (max_len,)


def paddings(max_len: int) -> dict[str, Callable[[int], int]]:
    """Padded length of a batch from its longest sequence, per padding scheme."""
    sizes = bucket_sizes(max_len)
    return {"dynamic": lambda n: n,
            "multiple of 64": lambda n: min(-(-n // 64) * 64, max_len),
            "buckets": lambda n: next(s for s in sizes if s >= n),
            "max-len": lambda n: max_len}


def describe_data(data: Data, used: int, max_len: int) -> dict:
    """Length quantiles and each padding's waste over the batches the rows use."""
    lengths = data.lengths[:used * data.batch].float()
    q = torch.quantile(lengths, torch.tensor([0.5, 0.9, 0.99])).tolist()
    real = lengths.sum().item()
    longest = data.longest[:used]
    waste = {name: 1 - real / (data.batch * sum(pad(n) for n in longest))
             for name, pad in paddings(max_len).items()}
    fits = paddings(max_len)["buckets"]
    per_bucket = {size: sum(fits(n) == size for n in longest) for size in bucket_sizes(max_len)}
    print(f"lengths: mean {lengths.mean():.0f}, median {q[0]:.0f}, p90 {q[1]:.0f}, "
          f"p99 {q[2]:.0f}, max {lengths.max():.0f}; padding waste: "
          + ", ".join(f"{name} {w:.0%}" for name, w in waste.items())
          + f"; {len(set(longest))} distinct batch lengths; batches per bucket {per_bucket}")
    return {"mean": lengths.mean().item(), "median": q[0], "p90": q[1], "p99": q[2],
            "max": lengths.max().item(), "waste": waste, "batches_per_bucket": per_bucket}


# ---------------------------------------------------------------------- rows


def compiled(model, mode: str | None = None):
    """torch.compile(model, mode=mode), compiling with the dense attention masks Step's compiled
    models get (bench.modes.dense_masks_while_compiling) at every call: a length first seen
    late recompiles then."""
    return dense_masks_while_compiling(torch.compile(model, mode=mode), calls=None)


def eager_loop(model, forward, optimizer, mark_step: bool = False):
    device = next(model.parameters()).device.type

    def step(batch):
        if mark_step:  # the previous step's graph outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(**batch).loss
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def nt_step(model, optimizer, max_len: int, buckets: bool):
    options = {}
    if buckets:  # pad_values: the unnamed leaves get 0, the pad id and the masked position
        options["buckets"] = nt.Buckets(sizes=bucket_sizes(max_len), dim=1,
                                        pad_values={"input_ids": PAD_ID, "attention_mask": 0})
    return nt.Step(model, optimizer, None, streams=1, amp="bf16", **options)


@dataclass(frozen=True)
class Row:
    key: str
    label: str        # "{max_len}" is filled in
    padding: str      # a key of paddings()
    wrap: Callable    # (model, optimizer, max_len) -> the step function
    compiled: bool = False

    @property
    def nimble(self) -> bool:
        return self.key.startswith("step")


ROWS = {r.key: r for r in [
    Row("eager", "eager, dynamic padding", "dynamic", lambda m, o, n: eager_loop(m, m, o)),
    Row("eager-512", "eager, padded to {max_len}", "max-len",
        lambda m, o, n: eager_loop(m, m, o)),
    Row("compile", "torch.compile, dynamic padding", "dynamic",
        lambda m, o, n: eager_loop(m, compiled(m), o), compiled=True),
    Row("compile-ro", "reduce-overhead, dynamic padding", "dynamic",
        lambda m, o, n: eager_loop(m, compiled(m, "reduce-overhead"), o, True),
        compiled=True),
    Row("compile-ro-64", "reduce-overhead, lengths to x64", "multiple of 64",
        lambda m, o, n: eager_loop(m, compiled(m, "reduce-overhead"), o, True),
        compiled=True),
    Row("step-512", "nt.Step, padded to {max_len}", "max-len",
        lambda m, o, n: nt_step(m, o, n, buckets=False)),
    Row("step-buckets", "nt.Step, buckets", "dynamic",
        lambda m, o, n: nt_step(m, o, n, buckets=True)),
    Row("step-buckets-compile", "nt.Step, buckets, torch.compile", "dynamic",
        lambda m, o, n: nt_step(torch.compile(m, dynamic=True), o, n, buckets=True),
        compiled=True),
]}
CPU_ROWS = ("eager", "eager-512", "step-buckets")


def fresh(config, device, nimble: bool):
    """The model from seed 0, and AdamW: torch's fused one for the eager update, the plain one
    for Step (which moves it to its own fused update over flat buffers)."""
    transformers = require_transformers()
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).to(device).train()
    return model, bert_optimizer(model, LR, fused=None if nimble else True)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (its private counter, read for the note)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def window_ms(step, window: list, device) -> float:
    """Milliseconds per step over `window`: CUDA events around it, one sync at its end (the
    host's launch time counts wherever the GPU waits for it)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for batch in window:
            step(batch)
        return (time.perf_counter() - start) * 1e3 / len(window)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for batch in window:
        step(batch)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / len(window)


def run_row(row: Row, args, config, data: Data, batches: list, refs: dict) -> dict:
    device, t = args.device, args.steps
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if row.compiled:
        torch._dynamo.reset()  # no reuse of an earlier row's compiled code
    graphs = compiled_graphs() if row.compiled else 0
    model, optimizer = fresh(config, device, row.nimble)
    if "init" not in refs:  # every row starts from these parameters (seed 0)
        refs["init"] = flat_params(model)
    sync(device)
    start = time.perf_counter()
    step = row.wrap(model, optimizer, args.max_len)
    for batch in batches:  # the cold epoch
        step(batch)
    sync(device)
    cold_s = time.perf_counter() - start
    params = flat_params(model)
    if row.key == "eager":  # the reference; it runs first
        refs["eager"] = params
    eager = refs.get("eager")
    gap = (((params - eager).norm() / (eager - refs["init"]).norm()).item()
           if eager is not None else None)
    del params, eager
    ms, rates = [], []
    for r in range(args.repeats):
        first = r * t
        ms.append(window_ms(step, batches[first:first + t], device))
        rates.append(sum(data.tokens(i) for i in range(first, first + t)) / (ms[-1] * t) * 1e3)
    lengths = {b["input_ids"].shape[1] for b in batches}
    result = {"key": row.key, "label": row.label.format(max_len=args.max_len),
              "ms": statistics.median(ms), "tokens_per_s": statistics.median(rates),
              "epoch1_s": cold_s,
              "windows_ms": ms, "gap": gap, "shapes": len(lengths),
              "peak_gib": ((torch.cuda.max_memory_allocated() - base) / 2**30
                           if device.type == "cuda" else None)}
    if row.compiled:
        result["graphs_compiled"] = compiled_graphs() - graphs
    if isinstance(step, nt.Step):
        stats = step.stats()
        pool = stats.get("pool_bytes")
        result.update(pool_gib=pool / 2**30 if pool else None,
                      shape_buckets=repr(stats.get("shape_buckets")),
                      captures=stats.get("captures"), replays=stats.get("replays"))
        step.close()
    print(f"{row.key}: epoch 1 {cold_s:.1f} s; {result['ms']:.2f} ms/step (windows "
          + ", ".join(f"{m:.2f}" for m in ms) + f"), gap {_fmt(gap, '.2f')}"
          + "".join(f", {k} {result[k]}" for k in ("graphs_compiled", "captures", "replays",
                                                  "shape_buckets") if k in result))
    del model, optimizer, step
    if row.compiled:
        torch._dynamo.reset()  # frees the cudagraph trees' pool before the next row
    return result


def bucket_first_replays(args, config, batches: list) -> dict:
    """Seconds from nt.Step(...) until each bucket the batches reach has had a replayed step,
    read from the per-bucket counts of step.stats() after every call (and a sync)."""
    device, sizes = args.device, bucket_sizes(args.max_len)
    fits = paddings(args.max_len)["buckets"]
    reached = {fits(b["input_ids"].shape[1]) for b in batches}
    model, optimizer = fresh(config, device, nimble=True)
    sync(device)
    start = time.perf_counter()
    step = nt_step(model, optimizer, args.max_len, buckets=True)
    first = {}  # bucket size -> (call, seconds) of its first replay
    for call, batch in enumerate(batches, 1):
        step(batch)
        sync(device)
        for size, counts in (step.stats().get("shape_buckets") or {}).items():
            if isinstance(counts, dict) and counts.get("replays", 0) > 0 and size not in first:
                first[size] = (call, time.perf_counter() - start)
        if reached <= first.keys():
            break
    step.close()
    del model, optimizer, step
    done = reached <= first.keys()
    seconds = max(sec for _, sec in first.values()) if done else None
    never = sorted(set(sizes) - reached)
    print("step-buckets, first replayed step of each bucket: "
          + (", ".join(f"{size} at call {c} ({sec:.1f} s)"
                       for size, (c, sec) in sorted(first.items())) or "none")
          + (f"; every reached bucket fast after {seconds:.1f} s" if done else
             f"; not every reached bucket replayed within {len(batches)} calls")
          + (f"; never reached: {never}" if never else ""))
    return {"reached": sorted(reached), "seconds": seconds,
            "first_replay": {str(size): v for size, v in first.items()}}


# ---------------------------------------------------------------------- report


def report(results: list[dict], args) -> None:
    best = max((r["tokens_per_s"] for r in results if r.get("ok") and
                not ROWS[r["key"]].nimble), default=None)
    width = max(len(r["label"]) for r in results)
    print(f"\nBERT-{args.size} sequence classification, batch {args.batch}, bf16, AdamW; "
          f"epoch 2: median of {args.repeats} windows of {args.steps} steps")
    head = (f"{'row':<{width}}  {'epoch 1 s':>9}  {'ms/step':>8}  {'real tok/s':>10}  "
            f"{'x best':>6}  {'peak GiB':>8}  {'pool GiB':>8}  {'gap':>5}  note")
    print(head + "\n" + "-" * len(head))
    for r in results:
        if not r.get("ok"):
            print(f"{r['label']:<{width}}  {r['error']}")
            continue
        note = f"{r['shapes']} shape{'s' if r['shapes'] != 1 else ''}"
        if "graphs_compiled" in r:
            note += f", {r['graphs_compiled']} graphs compiled"
        print(f"{r['label']:<{width}}  {r['epoch1_s']:9.1f}  {r['ms']:8.2f}  "
              f"{r['tokens_per_s']:10.0f}  "
              + (f"{r['tokens_per_s'] / best:6.2f}" if best else f"{'-':>6}")
              + "".join(f"  {v:8.2f}" if v is not None else f"  {'-':>8}"
                        for v in (r["peak_gib"], r.get("pool_gib")))
              + f"  {_fmt(r['gap'], '5.2f')}  {note}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows; median kept")
    parser.add_argument("--size", default="base", choices=("base", "tiny"))
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--json", help="also write the rows and metadata to this file")
    parser.add_argument("--cpu-check", action="store_true",
                        help=f"tiny BERT on the CPU, 3 + 3 steps of {', '.join(CPU_ROWS)}")
    args = parser.parse_args(argv)
    if args.cpu_check:
        args.size, args.batch, args.max_len, args.rows = "tiny", 8, 128, list(CPU_ROWS)
        args.steps, args.repeats = 6, 1
        args.device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench_buckets.py times training steps on a CUDA GPU; torch.cuda.is_available() "
              "is False (--cpu-check runs its code paths on the CPU)", file=sys.stderr)
        return 2
    else:
        args.device = torch.device("cuda")
    if min(args.batch, args.steps, args.repeats) < 1:
        parser.error("--batch, --steps and --repeats must be at least 1")
    if not 16 <= args.max_len <= 512:
        parser.error(f"--max-len must be in [16, 512] (BERT's positions); got {args.max_len}")
    where = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU"
    used = args.repeats * args.steps
    print(f"{where}, torch {torch.__version__}, nimble_train {nt.__version__}; "
          f"an epoch of {used} batches of {args.batch}, run twice")
    missing = [] if hasattr(nt, "Buckets") else [k for k in args.rows if "buckets" in k]
    for key in missing:
        print(f"{key}: skipped, this nimble_train has no nt.Buckets")
    args.rows = ["eager"] + [k for k in args.rows if k != "eager" and k not in missing]

    config = bert_config(args.size, num_labels=2)
    config.pad_token_id = PAD_ID  # workloads' config has none: its sequences are never padded
    data = make_data(used, args.batch, args.max_len, config.vocab_size)
    meta = {"device": where, "torch": torch.__version__, "args": {
        k: v for k, v in vars(args).items() if k != "device"},
        "lengths": describe_data(data, used, args.max_len)}

    refs, results, cached = {}, [], {}
    for key in args.rows:
        row = ROWS[key]
        if row.padding not in cached:
            cached[row.padding] = data.batches(paddings(args.max_len)[row.padding], args.device)
        try:
            result = run_row(row, args, config, data, cached[row.padding], refs)
            results.append({"ok": True, **result})
        except Exception as error:  # one row failing must not hide the others
            first_line = (str(error).splitlines() or [""])[0][:200]
            message = f"failed: {type(error).__name__}: {first_line}"
            print(f"{key}: {message}")
            results.append({"ok": False, "key": key, "error": message,
                            "label": row.label.format(max_len=args.max_len)})
        if key == "step-buckets" and results[-1]["ok"]:
            meta["bucket_first_replays"] = bucket_first_replays(args, config,
                                                                cached[row.padding])
    if args.json:
        print(f"wrote {write_json(args.json, results, meta)}")
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
