"""ResNet-18/CIFAR training step, side by side in one process on one GPU.

Modes: eager PyTorch; the whole step captured by hand as one CUDA graph (PyTorch's documented
recipe); torch.compile(mode="reduce-overhead") on the model with the eager optimizer; and
nt.Step on one stream. Same model, data and optimizer (SGD, momentum 0.9); median of repeats
timed with CUDA events; time to first step (until the fast path has run once); and the
GPU-busy fraction of a step (kernel time / elapsed GPU time, from a profile).

    python bench/bench_step.py [--batch 32 128] [--no-compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

import nimble_train as nt


def make_data(batch: int, count: int = 8):
    g = torch.Generator(device="cuda").manual_seed(batch)
    return [(torch.randn(batch, 3, 32, 32, device="cuda", generator=g),
             torch.randint(0, 10, (batch,), device="cuda", generator=g)) for _ in range(count)]


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = nt.models.resnet18_cifar().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    return model, opt


def eager_mode(model, opt, data):
    def step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def hand_graph_mode(model, opt, data):
    """PyTorch's whole-network capture recipe, written out by hand."""
    static_x, static_y = (t.clone() for t in data[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for batch in data[:3]:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(batch[0]), batch[1]).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = F.cross_entropy(model(static_x), static_y)
        static_loss.backward()
        opt.step()

    def step(batch):
        static_x.copy_(batch[0])
        static_y.copy_(batch[1])
        graph.replay()
        return static_loss
    return step


def compile_mode(model, opt, data):
    compiled = torch.compile(model, mode="reduce-overhead")

    def step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def step_mode(model, opt, data, streams=1):
    return nt.Step(model, opt, F.cross_entropy, streams=streams)


MODES = {
    "eager": eager_mode,
    "hand-written graph": hand_graph_mode,
    "compile reduce-overhead": compile_mode,
    "nt.Step (1 stream)": step_mode,
}


def time_to_first_fast_step(make_step, data, calls: int):
    """Seconds from building the mode to the end of its first fast-path step."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    model, opt = make_training()
    step = make_step(model, opt, data)
    for i in range(calls):
        step(data[i % len(data)])
    torch.cuda.synchronize()
    return time.perf_counter() - start, step


def ms_per_step(step, data, steps: int = 50, repeats: int = 5) -> float:
    for i in range(20):
        step(data[i % len(data)])
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(steps):
            step(data[i % len(data)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def gpu_busy_fraction(step, data, steps: int = 20) -> float:
    """Union of kernel/copy intervals over the GPU time the steps span, from a profile."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(data[i % len(data)])
        torch.cuda.synchronize()
    intervals = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not intervals:
        return float("nan")
    busy, cur_start, cur_end = 0, *intervals[0]
    for s, e in intervals[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    return busy / (intervals[-1][1] - intervals[0][0])


def run(batch: int, modes: list[str]) -> list[dict]:
    data = make_data(batch)
    first_calls = {"eager": 1, "hand-written graph": 1, "compile reduce-overhead": 3,
                   "nt.Step (1 stream)": 4}
    rows = []
    for name in modes:
        first_s, step = time_to_first_fast_step(MODES[name], data, first_calls[name])
        ms = ms_per_step(step, data)
        busy = gpu_busy_fraction(step, data)
        rows.append({"batch": batch, "mode": name, "ms_per_step": ms, "first_step_s": first_s,
                     "gpu_busy": busy, "samples_per_s": batch / ms * 1e3})
        del step
        torch.cuda.empty_cache()
    eager = next(r["ms_per_step"] for r in rows if r["mode"] == "eager")
    ro = next((r["ms_per_step"] for r in rows if r["mode"] == "compile reduce-overhead"), None)
    for r in rows:
        r["vs_eager"] = eager / r["ms_per_step"]
        r["vs_reduce_overhead"] = ro / r["ms_per_step"] if ro else None
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step needs a CUDA GPU")
    torch.backends.cudnn.benchmark = True
    modes = [m for m in MODES if not (args.no_compile and m.startswith("compile"))]
    rows = [row for batch in args.batch for row in run(batch, modes)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\nResNet-18/CIFAR, SGD momentum, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    print(f"{'batch':>5} {'mode':<26} {'ms/step':>8} {'vs eager':>9} {'vs r-o':>7} "
          f"{'first s':>8} {'GPU busy':>9}")
    for r in rows:
        ro = f"{r['vs_reduce_overhead']:.2f}x" if r["vs_reduce_overhead"] else "-"
        print(f"{r['batch']:>5} {r['mode']:<26} {r['ms_per_step']:>8.3f} {r['vs_eager']:>8.2f}x "
              f"{ro:>7} {r['first_step_s']:>8.2f} {r['gpu_busy']:>9.2f}")


if __name__ == "__main__":
    main()
