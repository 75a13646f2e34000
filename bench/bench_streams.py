"""Several streams against one: nt.Step(streams="auto") over nt.Step(streams=1), per network.

    python bench/bench_streams.py               # branchy, GoogLeNet, ResNet-18 at batch 32
    python bench/bench_streams.py --workloads googlenet:64 bert:32 --rounds 5

One process, one GPU. Each network is built twice from the same seed (same weights, same
batches) and run as nt.Step on one stream and with streams="auto" (the forward planned on
several streams, the backward's weight gradients on side streams); both are captured before
any timing. Timing alternates between the two in rounds (each a CUDA-event mean over --steps
consecutive steps after 10 untimed ones), so drift of the GPU's clocks hits both alike, and the
table gives each one's median over --rounds rounds and the ratio of the medians.

Networks (SGD with Nesterov momentum and weight decay, channels-last, cudnn.benchmark on):
``branchy`` (the inception-style CIFAR net of nimble_train.models, 32 px), ``googlenet``
(torchvision's GoogLeNet without auxiliary heads or dropout, 64 px), ``resnet18`` (the CIFAR
ResNet-18, 32 px); ``bert`` (BERT-base masked LM, seq 128, bf16, AdamW) where transformers is
installed. ``name:batch`` sets the batch (32 by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import nimble_train as nt
from nimble_train.bench.timing import ms_per_step
from nimble_train.bench.workloads import cifar_optimizer, make_workload

WAYS = (("1 stream", 1), ("auto", "auto"))


def googlenet(batch: int, device: torch.device):
    import torchvision  # only this network needs it

    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True,
                                         num_classes=10, dropout=0.0)
    model = model.to(device).to(memory_format=torch.channels_last)
    g = torch.Generator(device=device).manual_seed(0)
    batches = [(torch.randn(batch, 3, 64, 64, device=device, generator=g)
                .contiguous(memory_format=torch.channels_last),
                torch.randint(0, 10, (batch,), device=device, generator=g)) for _ in range(8)]
    loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    return model, cifar_optimizer(model, 0.01), loss_fn, batches, None


def build(name: str, batch: int, streams, device: torch.device):
    """A captured nt.Step for the network, and its batches."""
    torch.manual_seed(0)
    if name == "googlenet":
        model, optimizer, loss_fn, batches, amp = googlenet(batch, device)
    else:
        w = make_workload(name, batch, device)
        model = w.make_model()
        optimizer, loss_fn, batches, amp = w.make_optimizer(model), w.loss_fn, w.batches, w.amp
    step = nt.Step(model, optimizer, loss_fn, streams=streams, amp=amp)
    for i in range(step.stats()["warmup_left"] + 2):
        step(batches[i % len(batches)])
    if not step.stats()["captured"]:
        raise RuntimeError(f"{name}: the step was not captured: {step.stats()['capture_error']}")
    return step, batches


def measure(name: str, batch: int, args, device: torch.device) -> dict:
    built = {way: build(name, batch, streams, device) for way, streams in WAYS}
    samples = {way: [] for way, _ in WAYS}
    for _ in range(args.rounds):
        for way, _ in WAYS:
            samples[way].append(ms_per_step(*built[way], steps=args.steps, repeats=1,
                                             warm=10))
    stats = built["auto"][0].stats()
    row = {"workload": f"{name} b{batch}", **{way: statistics.median(samples[way])
                                              for way, _ in WAYS},
           "streams": stats["streams"], "syncs": stats["syncs"],
           "split": stats["weight_grad_layers"], "side": stats["weight_grad_streams"]}
    for step, _ in built.values():
        step.close()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+",
                        default=["branchy:32", "googlenet:32", "resnet18:32"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_streams needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    rows = []
    for spec in args.workloads:
        name, _, batch = spec.partition(":")
        rows.append(measure(name, int(batch or 32), args, device))
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per step, "
          f"median of {args.rounds} alternating rounds of {args.steps} steps")
    print("| network | 1 stream | auto | auto ÷ 1 stream | forward streams | syncs "
          "| split layers | weight-gradient streams |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['1 stream']:.3f} | {r['auto']:.3f} "
              f"| **{r['1 stream'] / r['auto']:.2f}x** | {r['streams']} | {r['syncs']} "
              f"| {r['split']} | {r['side']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
