"""nimble_train's max-pooling kernels against torch's: per layer, and in whole steps.

    python bench/bench_max_pool.py                       # branchy and GoogLeNet at batch 32
    python bench/bench_max_pool.py --workloads branchy:128 --rounds 5

One process, one GPU. First each max-pool shape of the networks, forward and backward of a
channels-last float32 input, captured ten times over in a CUDA graph and replayed (microseconds
per forward + backward; ours against torch's). Then each network is built from the same seed
as nt.Step on one stream and with streams="auto", each with our kernels and with torch's
(``nimble_train._capture.MAX_POOL_KERNELS``), all captured before any timing; timing alternates
between them in rounds (a CUDA-event mean over --steps steps after 10 untimed ones) and the
table gives medians over --rounds rounds. Networks as in bench/bench_streams.py.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

from bench_streams import build, googlenet
from nimble_train import _max_pool
from nimble_train.bench.timing import alternating_ms
from nimble_train.bench.workloads import make_workload

WAYS = (("1 stream, torch's", 1, "torch"), ("1 stream, ours", 1, "ours"),
        ("auto, torch's", "auto", "torch"), ("auto, ours", "auto", "ours"))


def pool_shapes(name: str, batch: int, device: torch.device) -> list[tuple]:
    """(input shape, kernel, stride, padding, ceil_mode) of each distinct max-pool call."""
    torch.manual_seed(0)
    if name == "googlenet":
        model, _, _, batches, _ = googlenet(batch, device)
    else:
        w = make_workload(name, batch, device)
        model, batches = w.make_model(), w.batches
    seen = []

    def record(module, args, _):
        key = (tuple(args[0].shape), module.kernel_size, module.stride, module.padding,
               module.ceil_mode)
        if key not in seen:
            seen.append(key)
    hooks = [m.register_forward_hook(record) for m in model.modules()
             if isinstance(m, nn.MaxPool2d)]
    with torch.no_grad():
        model(batches[0][0])
    for h in hooks:
        h.remove()
    return seen


def layer_us(shape, kernel, stride, padding, ceil_mode, ours: bool, device) -> float:
    x = torch.randn(shape, device=device).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    pool = (lambda t: _max_pool.max_pool2d(t, kernel, stride, padding, ceil_mode)) if ours \
        else (lambda t: F.max_pool2d(t, kernel, stride, padding, ceil_mode=ceil_mode))
    g = torch.randn_like(pool(x).detach())

    def once():
        (grad,) = torch.autograd.grad(pool(x), x, g)
        return grad
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        once()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            once()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 200 * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["branchy:32", "googlenet:32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_max_pool needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    print("| layer (input, kernel, stride, padding, ceil) | torch's us | ours us | ratio |")
    print("|---|---|---|---|")
    totals = {}
    for spec in args.workloads:
        name, _, batch = spec.partition(":")
        batch = int(batch or 32)
        for shape, kernel, stride, padding, ceil_mode in pool_shapes(name, batch, device):
            theirs = layer_us(shape, kernel, stride, padding, ceil_mode, False, device)
            ours = layer_us(shape, kernel, stride, padding, ceil_mode, True, device)
            print(f"| {name} {list(shape)} k{kernel} s{stride} p{padding}"
                  f"{' ceil' if ceil_mode else ''} | {theirs:.1f} | {ours:.1f} | "
                  f"{theirs / ours:.2f}x |", flush=True)
        rows = {}
        for way, streams, kernels in WAYS:
            rows[way] = build(name, batch, streams, device, {"MAX_POOL_KERNELS": kernels})
        totals[f"{name} b{batch}"] = (alternating_ms(rows, rounds=args.rounds, steps=args.steps),
                                      rows["auto, ours"][0].stats()["max_pool_layers"])
        for step, _ in rows.values():
            step.close()
        torch.cuda.empty_cache()
    print(f"\nms per step, median of {args.rounds} alternating rounds of {args.steps} steps")
    print("| network | max-pools | " + " | ".join(w for w, _, _ in WAYS)
          + " | 1 stream: ours ÷ torch's | auto: ours ÷ torch's | auto ÷ 1 stream, ours |")
    print("|---" * (len(WAYS) + 5) + "|")
    for net, (ms, layers) in totals.items():
        print(f"| {net} | {layers} | " + " | ".join(f"{ms[w]:.3f}" for w, _, _ in WAYS)
              + f" | {ms[WAYS[0][0]] / ms[WAYS[1][0]]:.3f}x"
              f" | {ms[WAYS[2][0]] / ms[WAYS[3][0]]:.3f}x"
              f" | {ms[WAYS[1][0]] / ms[WAYS[3][0]]:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
