"""Several streams against one: nt.Step(streams="auto") over nt.Step(streams=1), per network,
and what the backward's plan alone gives.

    python bench/bench_streams.py               # branchy, GoogLeNet, ResNet-18 at batch 32
    python bench/bench_streams.py --workloads googlenet:64 encoder:32 bert:32 --rounds 5

One process, one GPU. Each network is built six times from the same seed (same weights, same
batches) and run as nt.Step on one stream, with streams="auto" but the forward's plan switched
off (``nimble_train._capture.PLAN_FORWARD``: the backward's weight gradients on side streams
alone, what a model torch.fx cannot trace gets), with streams="auto" but cuDNN's batch-norm
kernels (``BATCH_NORM_KERNELS = "cudnn"``: see nimble_train/_batch_norm.py), with
streams="auto" but every weight gradient forked after its data gradient
(``nimble_train._weight_grads.WEIGHT_GRADS_FIRST = False``; "auto" forks a chain's beside it:
see weight_grads_first there), with streams="auto" but the fused batch norms' kernels launched
one after the other (``nimble_train._batch_norm_act.EARLY_LAUNCHES = False``: no programmatic
dependent launch) and with streams="auto"; all are captured before any timing. Timing
alternates between them in rounds (each a CUDA-event mean over --steps consecutive steps after
10 untimed ones), so drift of the GPU's clocks hits all alike, and the table gives each one's
median over --rounds rounds and the ratios of the medians.

Networks (SGD with Nesterov momentum and weight decay, channels-last, cudnn.benchmark on):
``branchy`` (the inception-style CIFAR net of nimble_train.models, 32 px), ``googlenet``
(torchvision's GoogLeNet without auxiliary heads or dropout, 64 px), ``resnet18`` (the CIFAR
ResNet-18, 32 px); ``encoder`` (BERT-base's encoder and vocabulary head written with plain
torch modules, which torch.fx traces: separate query, key and value projections, SDPA,
post-LayerNorm, GELU; seq 128, bf16, AdamW, a token-level cross-entropy); ``bert`` (Hugging
Face's BERT-base masked LM, seq 128, bf16, AdamW) where transformers is installed.
``name:batch`` sets the batch (32 by default).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import nimble_train as nt
from nimble_train import _batch_norm_act, _capture, _weight_grads
from nimble_train.bench.timing import alternating_ms, captured
from nimble_train.bench.workloads import cifar_optimizer, make_workload

# (name, streams, switches of nimble_train._capture, _weight_grads or _batch_norm_act while it
# captures)
WAYS = (("1 stream", 1, {}), ("backward only", "auto", {"PLAN_FORWARD": False}),
        ("auto, cuDNN batch norm", "auto", {"BATCH_NORM_KERNELS": "cudnn"}),
        ("auto, weight gradients after data's", "auto", {"WEIGHT_GRADS_FIRST": False}),
        ("auto, no early launches", "auto", {"EARLY_LAUNCHES": False}),
        ("auto", "auto", {}))


def _switched(key: str):
    """The module whose switch `key` is."""
    return next(m for m in (_capture, _weight_grads, _batch_norm_act) if hasattr(m, key))


class EncoderLayer(nn.Module):
    """A BERT encoder layer (post-LayerNorm) of plain modules."""

    def __init__(self, dim: int = 768, heads: int = 12, hidden: int = 3072):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def _heads(self, x):
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x):
        attended = F.scaled_dot_product_attention(
            self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x)))
        x = self.norm1(x + self.out(attended.transpose(1, 2).flatten(-2)))
        return self.norm2(x + self.down(F.gelu(self.up(x))))


class Encoder(nn.Module):
    """BERT-base's shape: token and position embeddings, 12 layers, a vocabulary head."""

    def __init__(self, vocab: int = 30522, dim: int = 768, layers: int = 12, seq: int = 128):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.zeros(seq, dim))
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.Sequential(*[EncoderLayer(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.layers(self.norm(self.tokens(ids) + self.positions)))


def token_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def encoder(batch: int, device: torch.device, seq: int = 128, vocab: int = 30522):
    model = Encoder(vocab=vocab, seq=seq).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    batches = [(torch.randint(0, vocab, (batch, seq), device=device, generator=g),
                torch.randint(0, vocab, (batch, seq), device=device, generator=g))
               for _ in range(4)]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), token_loss, batches, "bf16"


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


def build(name: str, batch: int, streams, device: torch.device, switches: dict | None = None):
    """A captured nt.Step for the network, and its batches."""
    torch.manual_seed(0)
    if name == "googlenet":
        model, optimizer, loss_fn, batches, amp = googlenet(batch, device)
    elif name == "encoder":
        model, optimizer, loss_fn, batches, amp = encoder(batch, device)
    else:
        w = make_workload(name, batch, device)
        model = w.make_model()
        optimizer, loss_fn, batches, amp = w.make_optimizer(model), w.loss_fn, w.batches, w.amp
    step = nt.Step(model, optimizer, loss_fn, streams=streams, amp=amp)
    settings = [(_switched(key), key, value) for key, value in (switches or {}).items()]
    return captured(step, batches, name, settings), batches


def alternate(built: dict, args) -> dict[str, float]:
    """Each way's median ms per step over args.rounds rounds that alternate between the ways
    (each a CUDA-event mean over args.steps steps after 10 untimed ones); the steps are closed
    after."""
    medians = alternating_ms(built, rounds=args.rounds, steps=args.steps)
    for step, _ in built.values():
        step.close()
    torch.cuda.empty_cache()
    return medians


def measure(name: str, batch: int, args, device: torch.device) -> dict:
    built = {way: build(name, batch, streams, device, switches)
             for way, streams, switches in WAYS}
    stats = built["auto"][0].stats()
    return {"workload": f"{name} b{batch}", **alternate(built, args),
            "streams": stats["streams"], "syncs": stats["syncs"],
            "split": stats["weight_grad_layers"], "side": stats["weight_grad_streams"],
            "native": stats["native_batch_norm_layers"],
            "first": "beside" if stats["weight_grads_first"] else "after"}


def measure_workloads(argv, description: str, script: str, measure, rounds: int,
                      workloads: list[str] | None = None) -> list[dict] | None:
    """Parses --workloads (name:batch; by default `workloads`, else the branchy net, GoogLeNet
    and ResNet-18 at batch 32), --steps and --rounds, and returns measure(name, batch, args,
    device) for each workload, printing each row and then the table's title; None without a
    GPU (after saying so)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workloads", nargs="+",
                        default=workloads or ["branchy:32", "googlenet:32", "resnet18:32"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return None
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda")
    rows = []
    for spec in args.workloads:
        name, _, batch = spec.partition(":")
        rows.append(measure(name, int(batch or 32), args, device))
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per step, "
          f"median of {args.rounds} alternating rounds of {args.steps} steps")
    return rows


def print_switch_table(rows: list[dict], ways, count: str) -> None:
    """The table of a switch timed on 1 and "auto" streams: `ways` are (name, streams, value)
    for 1 stream off, 1 stream on, auto off, auto on; `count` names the rows' count column
    (the layers the switch touched)."""
    print(f"| network | {count} | " + " | ".join(way for way, _, _ in ways)
          + " | 1 stream: gain | auto: gain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        one, one_on, auto, auto_on = (r[way] for way, _, _ in ways)
        print(f"| {r['workload']} | {r[count]} | {one:.3f} | {one_on:.3f} | {auto:.3f} "
              f"| {auto_on:.3f} | {one / one_on:.3f}x | {auto / auto_on:.3f}x |")


def main(argv=None) -> int:
    rows = measure_workloads(argv, __doc__.split("\n")[0], "bench_streams", measure, rounds=7)
    if rows is None:
        return 2
    print("| network | 1 stream | backward only | auto, cuDNN batch norm "
          "| auto, weight gradients after data's | auto, no early launches | auto "
          "| auto ÷ 1 stream | backward only ÷ 1 stream | auto ÷ backward only "
          "| auto ÷ cuDNN batch norm | auto ÷ weight gradients after | auto ÷ no early launches "
          "| auto's weight gradients | forward streams | syncs | split layers "
          "| weight-gradient streams | native batch norms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        one, back, cudnn, after, late, auto = (r[way] for way, _, _ in WAYS)
        print(f"| {r['workload']} | {one:.3f} | {back:.3f} | {cudnn:.3f} | {after:.3f} "
              f"| {late:.3f} | {auto:.3f} | **{one / auto:.2f}x** | {one / back:.2f}x "
              f"| {back / auto:.3f}x | {cudnn / auto:.3f}x | {after / auto:.3f}x "
              f"| {late / auto:.3f}x | {r['first']} "
              f"| {r['streams']} | {r['syncs']} | {r['split']} | {r['side']} "
              f"| {r['native']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
