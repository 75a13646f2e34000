"""A network's stem, a convolution of few input channels, on our kernels against torch's cuDNN
convolution (nimble_train/_small_conv.py, src/ops/small_conv.h): per layer, then in whole steps.

    python bench/bench_small_conv.py     # the layers, then ResNet-18, branchy and airbench
    python bench/bench_small_conv.py --workloads resnet18:32 --rounds 7

One process, one GPU. Per layer: the forward and the weight gradient of each stem below, with a
channels-last weight and an NCHW or a channels-last input, captured in a CUDA graph and timed
per replay (median of five rounds of 200 replays), cuDNN's convolution against ours. Whole
steps: each network (bench_streams.py's networks and batches) is built four times from the
same seed, as nt.Step on one stream and with streams="auto", each captured with
``_capture.SMALL_CONV_KERNELS = "torch"`` and ``"ours"``; timing alternates between the four in
rounds (a CUDA-event mean over --steps steps after 10 untimed ones) and the table gives each
one's median over --rounds rounds and the ratios of the medians.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from nimble_train import _small_conv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streams import (alternate, build, measure_workloads,  # noqa: E402
                           print_switch_table)

# (label, batch, in channels, out channels, kernel, stride, padding, bias, image size)
LAYERS = (("ResNet-18/CIFAR stem b32", 32, 3, 64, 3, 1, 1, False, 32),
          ("airbench whitening b1024", 1024, 3, 24, 2, 1, 0, True, 32),
          ("MobileNet-style stem b32 (224 px)", 32, 3, 32, 3, 2, 1, False, 224))

WAYS = (("1 stream, cuDNN", 1, "torch"), ("1 stream, ours", 1, "ours"),
        ("auto, cuDNN", "auto", "torch"), ("auto, ours", "auto", "ours"))


def replay_us(fn, rounds: int, replays: int = 200) -> float:
    """Median over `rounds` of the mean time of one replay of `fn` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(samples)


def layer_row(spec, channels_last_input: bool, rounds: int) -> dict:
    label, batch, cin, cout, kernel, stride, padding, bias, size = spec
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, cin, size, size, device="cuda", generator=g)
    if channels_last_input:
        x = x.contiguous(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(cin, cout, kernel, stride, padding, bias=bias).cuda()
    conv = conv.to(memory_format=torch.channels_last)
    params = [p for p in conv.parameters()]
    grad_y = torch.randn_like(conv(x))

    def cudnn():
        torch.autograd.grad(conv(x), params, grad_y)

    def ours():
        torch.autograd.grad(_small_conv.apply(x, conv), params, grad_y)

    return {"layer": label, "input": "channels-last" if channels_last_input else "NCHW",
            "cudnn": replay_us(cudnn, rounds), "ours": replay_us(ours, rounds)}


def build_with(name: str, batch: int, streams, small: str, device: torch.device):
    return build(name, batch, streams, device, {"SMALL_CONV_KERNELS": small})


def measure(name: str, batch: int, args, device: torch.device) -> dict:
    built = {way: build_with(name, batch, streams, small, device)
             for way, streams, small in WAYS}
    layers = built["auto, ours"][0].stats()["small_conv_layers"]
    return {"workload": f"{name} b{batch}", **alternate(built, args), "layers": layers}


def main(argv=None) -> int:
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True
        print("| layer (forward + weight gradient) | input | cuDNN us | ours us | gain |")
        print("|---|---|---|---|---|")
        for spec in LAYERS:
            for channels_last_input in (False, True):
                r = layer_row(spec, channels_last_input, rounds=5)
                print(f"| {r['layer']} | {r['input']} | {r['cudnn']:.1f} | {r['ours']:.1f} "
                      f"| {r['cudnn'] / r['ours']:.2f}x |", flush=True)
        print()
    rows = measure_workloads(argv, __doc__.split("\n")[0], "bench_small_conv", measure,
                             rounds=5, workloads=["resnet18:32", "branchy:32", "airbench:1024"])
    if rows is None:
        return 2
    print_switch_table(rows, WAYS, "layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
