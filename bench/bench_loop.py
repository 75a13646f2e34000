"""Gradient accumulation and an EMA of the weights: nt.Step against eager and torch.compile.

    python bench/bench_loop.py                                   # ResNet-18 b32 x4, BERT-base b8 x4
    python bench/bench_loop.py --workloads resnet18 --accumulate 2 --updates 20

One process, one GPU, every way of running the same optimizer updates side by side, each
update being --accumulate micro-batches (one call each):

- eager: the plain accumulation loop, ``zero_grad(set_to_none=True)`` once per window,
  ``(loss / K).backward()`` per micro-batch, ``optimizer.step()`` with torch's fused optimizer
  (its fastest eager update);
- reduce-overhead: ``torch.compile(model, mode="reduce-overhead")`` (forward and backward in
  cudagraph trees) with the same eager accumulation and fused optimizer. The gradients are
  kept allocated and zeroed in place, and ``torch.compiler.cudagraph_mark_step_begin()`` marks
  each micro-batch: without both, AccumulateGrad takes a graph's output buffer as ``p.grad``
  and the next replay overwrites it (wrong gradients, or an error). It compiles with the dense
  attention masks Step's compiled models get (``bench.modes.dense_masks_while_compiling``);
- nt.Step: ``nt.Step(model, optimizer, loss_fn, accumulate=K, streams=1)``; the same with
  ``ema=0.999`` (the EMA's cost is the difference); and over ``torch.compile(model)`` (default
  mode: inductor's kernels, captured with the rest of the step in Step's graphs).

Columns: ms per optimizer update (CUDA events around --updates consecutive updates, median
of --repeats runs; cudnn.benchmark on),
samples (or tokens) per second, the speed-up over reduce-overhead, the peak memory of the
mode, and the relative distance of its parameters from eager's after the same three warm
windows (a check that each anchor computes the same training). Last, the EMA update measured
alone against its bytes (read weights and average, write average) over the GPU's measured
device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys

import torch

import nimble_train as nt
from nimble_train.bench.modes import dense_masks_while_compiling
from nimble_train.bench.timing import time_ms
from nimble_train.bench.workloads import forward_loss, make_workload

WORKLOADS = {"resnet18": 32, "bert": 8}


def _autocast(amp):
    if amp is None:
        return torch.autocast("cuda", enabled=False)
    return torch.autocast("cuda", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[amp])


def _fresh(w, **optimizer_options):
    torch.manual_seed(0)
    model = w.make_model()
    return model, w.make_optimizer(model, **optimizer_options)


def eager(w, k):
    model, optimizer = _fresh(w, fused=True)

    def update(window):
        optimizer.zero_grad(set_to_none=True)
        for batch in window:
            with _autocast(w.amp):
                loss = forward_loss(model, w.loss_fn, batch)
            (loss / k).backward()
        optimizer.step()
    return model, update


def reduce_overhead(w, k):
    torch._dynamo.reset()
    model, optimizer = _fresh(w, fused=True)
    forward = dense_masks_while_compiling(torch.compile(model, mode="reduce-overhead"))
    for p in model.parameters():  # gradients live outside the graphs' pool, summed in place
        p.grad = torch.zeros_like(p)

    def update(window):
        optimizer.zero_grad(set_to_none=False)
        for batch in window:
            torch.compiler.cudagraph_mark_step_begin()
            with _autocast(w.amp):
                loss = forward_loss(forward, w.loss_fn, batch)
            (loss / k).backward()
        optimizer.step()
    return model, update


def nt_step(ema=None, compiled=False):
    def build(w, k):
        if compiled:
            torch._dynamo.reset()
        model, optimizer = _fresh(w)
        forward = torch.compile(model) if compiled else model
        step = nt.Step(forward, optimizer, w.loss_fn, accumulate=k, streams=1, amp=w.amp,
                       ema=ema)

        def update(window):
            for batch in window:
                step(batch)
        update.step = step
        return model, update
    return build


MODES = {
    "eager": ("eager accumulation, fused optimizer", eager),
    "compile-ro": ("torch.compile reduce-overhead + eager accumulation", reduce_overhead),
    "step": ("nt.Step(accumulate=K), 1 stream", nt_step()),
    "step-ema": ("nt.Step(accumulate=K, ema=0.999)", nt_step(0.999)),
    "step-compile": ("nt.Step(torch.compile(model), accumulate=K)", nt_step(compiled=True)),
}


def windows(batches, k, count, start=0):
    return [[batches[(start + i * k + j) % len(batches)] for j in range(k)]
            for i in range(count)]


def ms_per_update(update, batches, k, updates, repeats):
    times = []
    for r in range(repeats):
        run = windows(batches, k, updates, start=r)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for window in run:
            update(window)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / updates)
    return statistics.median(times)


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def run_workload(name, args):
    w = make_workload(name, WORKLOADS[name] if args.batch is None else args.batch, "cuda",
                      seq=args.seq, count=8)
    k = args.accumulate
    per_sample = w.batch * (args.seq if name == "bert" else 1)
    unit = "tokens/s" if name == "bert" else "samples/s"
    rows, reference = [], None
    for key in args.modes:
        label, build = MODES[key]
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model, update = build(w, k)
        for window in windows(w.batches, k, 3):  # warm-up, capture, compilation
            update(window)
        torch.cuda.synchronize()
        params = flat_params(model)
        if reference is None:
            reference = params
            gap = 0.0
        else:
            gap = ((params - reference).norm() / reference.norm()).item()
        del params
        ms = ms_per_update(update, w.batches, k, args.updates, args.repeats)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30
        rows.append((key, label, ms, k * per_sample / ms * 1e3, peak, gap))
        ema_step = getattr(update, "step", None)
        if key == "step-ema" and ema_step is not None:
            rows.append(("ema-alone", *ema_alone(ema_step)))
        del model, update
    return w, k, unit, rows


def ema_alone(step):
    """The EMA update alone (one lerp_ per flat buffer), against its bytes over the copy
    bandwidth measured on a buffer of the same size."""
    ema = step._ema
    flats = [param for param, _ in ema._flat]
    nbytes = sum(f.numel() * f.element_size() for f in flats)
    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)

    copy_ms = time_ms(lambda: dst.copy_(src), repeats=5, iters=20)
    bandwidth = 2 * nbytes / copy_ms  # bytes per ms, read + write
    ema_ms = time_ms(ema.update, repeats=5, iters=20)
    bound_ms = 3 * nbytes / bandwidth  # read weights and average, write average
    return (f"EMA alone: {nbytes / 2**20:.0f} MiB of weights; bound 3x bytes / copy "
            f"bandwidth {bandwidth / 1e6:.0f} GB/s = {bound_ms:.3f} ms", ema_ms, bound_ms)


def report(w, k, unit, rows):
    print(f"\n{w.description}: micro-batch {w.batch} x accumulate {k}"
          f"{' (bf16)' if w.amp else ''}")
    ro = next((r[2] for r in rows if r[0] == "compile-ro"), None)
    plain = next((r[2] for r in rows if r[0] == "step"), None)
    print(f"| {'mode':<52} | {'ms/update':>9} | {unit:>10} | {'÷ r-o':>6} | {'peak GiB':>8} |"
          f" {'gap vs eager':>12} |")
    print("|" + "-" * 54 + "|" + "-" * 11 + "|" + "-" * 12 + "|" + "-" * 8 + "|" + "-" * 10 +
          "|" + "-" * 14 + "|")
    for row in rows:
        if row[0] == "ema-alone":
            _, text, ema_ms, bound_ms = row
            print(f"{text}; measured {ema_ms:.3f} ms = {ema_ms / bound_ms:.2f}x the bound")
            continue
        key, label, ms, rate, peak, gap = row
        speedup = f"{ro / ms:.2f}" if ro else "-"
        print(f"| {label:<52} | {ms:9.2f} | {rate:10.0f} | {speedup:>6} | {peak:8.2f} |"
              f" {gap:12.1e} |")
        if key == "step-ema" and plain:
            print(f"EMA cost per update in the step: {ms - plain:.3f} ms")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--batch", type=int, help="micro-batch (default 32 ResNet, 8 BERT)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_loop.py times CUDA graphs and needs a GPU", file=sys.stderr)
        return 2
    if args.modes[0] != "eager":
        args.modes = ["eager"] + [m for m in args.modes if m != "eager"]  # the reference
    torch.backends.cudnn.benchmark = True  # as every CIFAR recipe and benchmark here runs
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.workloads:
        report(*run_workload(name, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
