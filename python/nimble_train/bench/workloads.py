"""The recipes' models, optimizers and synthetic data, defined once for recipes and benchmarks.

A workload is what one training step is made of: a model, an optimizer over its parameters, a
loss convention (Step's batch conventions, see DESIGN.md) and batches of a fixed shape. The
recipes in ``recipes/`` train these; ``python -m nimble_train.bench`` times them.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import models

BERT_SIZES = ("base", "tiny")

# Token ids of BERT's uncased vocabulary that the synthetic data uses; content tokens come
# from [FIRST_CONTENT_ID, vocab_size).
PAD_ID, CLS_ID, SEP_ID, MASK_ID = 0, 101, 102, 103
FIRST_CONTENT_ID = 104


# ---------------------------------------------------------------------- CIFAR


def cifar_model(name: str, device: torch.device | str = "cpu", width: float = 1.0):
    """ResNet-18, the branchy network or airbench94's network for 32×32 images, on `device`
    (channels-last on CUDA, where cuDNN's convolutions are fastest in that layout)."""
    if name in ("resnet18", "airbench"):
        if width != 1.0:
            raise ValueError(f"{name} has a fixed width; got width={width}")
        model = models.resnet18_cifar() if name == "resnet18" else models.airbench_cifar()
    elif name == "branchy":
        model = models.branchy_cifar(width=width)
    else:
        raise ValueError(f"model must be one of {CIFAR_MODELS}; got {name!r}")
    model = model.to(device)
    if torch.device(device).type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model


def cifar_optimizer(model: torch.nn.Module, lr: float, *, fused: bool | None = None,
                    momentum: float = 0.9, weight_decay: float = 5e-4) -> torch.optim.SGD:
    """SGD with Nesterov momentum (0.9 unless told) and weight decay, as CIFAR ResNets are
    trained."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=True,
                           weight_decay=weight_decay, fused=fused)


cifar_loss = torch.nn.CrossEntropyLoss(reduction="none")
"""Per-sample losses: Step can then pad a short last batch and average exactly."""


@dataclass(frozen=True)
class CifarTraining:
    """How the recipe and the benchmark train one CIFAR model: SGD with Nesterov momentum and
    weight decay over per-sample cross-entropy losses. The recipe's default batch is `batch`,
    and its peak learning rate scales linearly from `lr` at `batch`."""

    description: str     # the benchmark table's title line
    batch: int
    lr: float
    bench_lr: float      # the benchmark's fixed learning rate (it times steps, nothing more)
    momentum: float = 0.9
    weight_decay: float = 5e-4
    loss_fn: Callable = cifar_loss

    def optimizer(self, model: torch.nn.Module, lr: float, *,
                  fused: bool | None = None) -> torch.optim.SGD:
        return cifar_optimizer(model, lr, fused=fused, momentum=self.momentum,
                               weight_decay=self.weight_decay)


CIFAR_TRAINING: dict[str, CifarTraining] = {
    # lr 0.1 per 128 images, the usual CIFAR ResNet setting.
    "resnet18": CifarTraining("ResNet-18, CIFAR 32×32, SGD momentum",
                              batch=256, lr=0.2, bench_lr=0.05),
    "branchy": CifarTraining("branchy inception-style net, CIFAR 32×32, SGD momentum",
                             batch=256, lr=0.2, bench_lr=0.05),
    # airbench94's batch, momentum and label smoothing. Its learning rate and weight decay are
    # not taken over: airbench sums the losses of a batch (rather than averaging them), trains
    # its BatchNorm shifts at 64x the learning rate and freezes its BatchNorm scales and its
    # whitening conv, so its values (lr 11.5 and wd 0.0153 "per 1024 examples", 1.5 and 1.3e-3
    # for averaged losses) do not carry over to this plain optimizer over every parameter.
    "airbench": CifarTraining(
        "airbench94 net, CIFAR 32×32, SGD Nesterov, label smoothing 0.2",
        batch=1024, lr=0.2, bench_lr=0.2, momentum=0.85,
        loss_fn=torch.nn.CrossEntropyLoss(label_smoothing=0.2, reduction="none")),
}
CIFAR_MODELS = tuple(CIFAR_TRAINING)


def random_cifar_batches(batch: int, count: int, device, seed: int = 0) -> list[tuple]:
    """`count` batches of normalised-looking 32×32 images and labels (for timing only)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(batch, 3, 32, 32, device=device, generator=g)
        if torch.device(device).type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        out.append((x, torch.randint(0, 10, (batch,), device=device, generator=g)))
    return out


# ---------------------------------------------------------------------- BERT


def require_transformers():
    """The `transformers` module, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "the BERT workload builds Hugging Face's BertForMaskedLM, but `transformers` is not "
            "installed: pip install transformers (or pip install 'nimble_train[recipes]')"
        ) from exc
    return transformers


def bert_config(size: str = "base", **overrides):
    """BERT-base (110 M parameters) or a tiny BERT for tests (2 layers of 128, 0.4 M)."""
    transformers = require_transformers()
    if size == "base":
        shape = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                     num_attention_heads=12, intermediate_size=3072)
    elif size == "tiny":
        shape = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=256)
    else:
        raise ValueError(f"BERT size must be one of {BERT_SIZES}; got {size!r}")
    # pad_token_id=None: the synthetic sequences have no padding, and without a pad id
    # transformers never inspects input_ids on the host to warn about a missing mask.
    return transformers.BertConfig(**{"max_position_embeddings": 512, "pad_token_id": None,
                                      **shape, **overrides})


def bert_model(size: str = "base", device: torch.device | str = "cpu", **overrides):
    """A freshly initialised BertForMaskedLM (built from its config; nothing is downloaded)."""
    transformers = require_transformers()
    return transformers.BertForMaskedLM(bert_config(size, **overrides)).to(device)


def bert_optimizer(model: torch.nn.Module, lr: float, *, kind: str = "adamw",
                   fused: bool | None = None, capturable: bool = False,
                   weight_decay: float = 0.01) -> torch.optim.Optimizer:
    """AdamW (or nimble_train's LAMB) with BERT's decay groups: no decay on biases and
    LayerNorm weights, as in the reference BERT pretraining."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or "LayerNorm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-6, fused=fused,
                                 capturable=capturable)
    if kind == "lamb":
        if fused or capturable:
            raise ValueError("nimble_train.optim.LAMB is a plain optimizer whose step reads the "
                             "step count on the host: it has no fused=True of torch's, and a "
                             "hand-written CUDA graph cannot capture it (capturable=True). "
                             "nt.Step runs it as fused kernels; use kind='adamw' here.")
        from ..optim import LAMB
        return LAMB(groups, lr=lr, betas=(0.9, 0.999), eps=1e-6)
    raise ValueError(f'optimizer must be "adamw" or "lamb"; got {kind!r}')


def synthetic_mlm(samples: int, seq: int, vocab_size: int, *, device, seed: int = 0,
                  mask_prob: float = 0.15, period: int = 8) -> dict[str, torch.Tensor]:
    """Masked-LM pretraining data with static shapes: `input_ids` and `labels`, [samples, seq].

    Each sequence is [CLS] + a random motif of `period` tokens repeated + [SEP]; motif tokens
    follow a Zipf law over the content vocabulary. A masked token can thus be learnt first from
    its frequency, then exactly by copying it from `period` positions away: the loss has
    somewhere to go. 15% of the content positions are chosen (BERT's 80% [MASK], 10% random
    token, 10% unchanged); `labels` holds the original token there and -100 elsewhere.
    """
    if seq < 3 or vocab_size <= FIRST_CONTENT_ID:
        raise ValueError(f"need seq >= 3 and vocab_size > {FIRST_CONTENT_ID}; "
                         f"got seq={seq}, vocab_size={vocab_size}")
    g = torch.Generator(device=device).manual_seed(seed)
    content = vocab_size - FIRST_CONTENT_ID
    zipf = 1.0 / (torch.arange(content, device=device, dtype=torch.float32) + 1.0)
    motif = torch.multinomial(zipf, samples * period, replacement=True, generator=g)
    motif = motif.view(samples, period) + FIRST_CONTENT_ID
    ids = motif.repeat(1, math.ceil((seq - 2) / period))[:, : seq - 2]
    ids = torch.cat([torch.full((samples, 1), CLS_ID, device=device), ids,
                     torch.full((samples, 1), SEP_ID, device=device)], dim=1)

    chosen = torch.rand(samples, seq, device=device, generator=g) < mask_prob
    chosen[:, 0] = chosen[:, -1] = False
    labels = torch.where(chosen, ids, -100)
    roll = torch.rand(samples, seq, device=device, generator=g)
    random_ids = torch.randint(FIRST_CONTENT_ID, vocab_size, (samples, seq), device=device,
                               generator=g)
    inputs = torch.where(chosen & (roll < 0.8), MASK_ID, ids)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
    return {"input_ids": inputs, "labels": labels}


def slice_batches(data: dict[str, torch.Tensor], batch: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive full batches (views) of a dict of equally long tensors; the tail is dropped."""
    n = next(iter(data.values())).shape[0] // batch
    return [{k: v[i * batch:(i + 1) * batch] for k, v in data.items()} for i in range(n)]


# ---------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """One training step's ingredients, for the benchmark."""

    name: str          # "resnet18", "branchy", "airbench", "bert"
    description: str   # one line for the table's title
    batch: int
    make_model: Callable[[], torch.nn.Module]
    # (model, fused) -> optimizer; fused=True asks for torch's fused implementation and
    # capturable=True for one that a hand-written CUDA graph may capture.
    make_optimizer: Callable[..., torch.optim.Optimizer]
    loss_fn: Callable | None   # None: the model returns its own loss (dict batches)
    batches: list[Any]
    amp: str | None = None


def why_not_optimizer(name: str, optimizer: str | None) -> str | None:
    """Why workload `name` cannot train with `optimizer` (None: it can)."""
    if optimizer not in (None, "adamw", "lamb"):
        return f'optimizer must be None, "adamw" or "lamb"; got {optimizer!r}'
    if optimizer is not None and name != "bert":
        return (f"optimizer {optimizer!r} chooses BERT's optimizer; {name} trains with its "
                f"recipe's SGD. Leave the optimizer out, or take the bert workload.")
    return None


def make_workload(name: str, batch: int, device, *, seq: int = 128, bert_size: str = "base",
                  count: int = 8, seed: int = 0, amp: str | None = None,
                  optimizer: str | None = None) -> Workload:
    """The workload of the recipe `name` with `count` distinct batches of size `batch`.

    `amp="bf16"`: a CIFAR model's steps run under bfloat16 autocast (its weights and the
    optimizer stay float32; no loss scaling, so every mode runs the same step). BERT always
    runs in bf16. `optimizer`: BERT's, "adamw" (the default) or "lamb" (nimble_train's LAMB,
    which a hand-written graph cannot capture: its plain step reads the step count on the
    host); the CIFAR models train with their recipe's SGD."""
    device = torch.device(device)
    if amp not in (None, "bf16"):
        raise ValueError(f"amp must be None or 'bf16' (float16 would need each mode's loss "
                         f"scaling); got {amp!r}")
    why = why_not_optimizer(name, optimizer)
    if why is not None:
        raise ValueError(why)
    if name in CIFAR_MODELS:
        training = CIFAR_TRAINING[name]
        description = training.description + (f", {amp} autocast" if amp else "")
        return Workload(
            name=name, description=description, batch=batch, amp=amp,
            make_model=lambda: cifar_model(name, device),
            make_optimizer=lambda m, fused=None, capturable=False: training.optimizer(
                m, training.bench_lr, fused=fused),
            loss_fn=training.loss_fn, batches=random_cifar_batches(batch, count, device, seed))
    if name == "bert":
        config = bert_config(bert_size)
        data = synthetic_mlm(batch * count, seq, config.vocab_size, device=device, seed=seed)
        kind = optimizer or "adamw"
        return Workload(
            name=name, description=(f"BERT-{bert_size} masked LM, seq {seq}, bf16, "
                                    f"{'AdamW' if kind == 'adamw' else 'LAMB'}"),
            batch=batch, make_model=lambda: bert_model(bert_size, device),
            make_optimizer=lambda m, fused=None, capturable=False: bert_optimizer(
                m, 1e-4, kind=kind, fused=fused, capturable=capturable),
            loss_fn=None, batches=slice_batches(data, batch), amp="bf16")
    raise ValueError(f"model must be one of {CIFAR_MODELS + ('bert',)}; got {name!r}")


def forward_loss(model: Callable, loss_fn: Callable | None, batch: Any) -> torch.Tensor:
    """Step's batch conventions, eagerly: the mean loss of one batch."""
    if isinstance(batch, dict):
        outputs = model(**batch)
        loss = loss_fn(outputs, batch) if loss_fn is not None else outputs.loss
    else:
        inputs, target = batch
        outputs = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        loss = loss_fn(outputs, target)
    return loss.float().mean() if loss.dim() else loss


__all__ = [
    "BERT_SIZES", "CIFAR_MODELS", "CIFAR_TRAINING", "CifarTraining", "Workload", "bert_config",
    "bert_model", "bert_optimizer", "cifar_loss", "cifar_model", "cifar_optimizer",
    "forward_loss", "make_workload", "random_cifar_batches", "require_transformers",
    "slice_batches", "synthetic_mlm",
]


def add_workload_arguments(parser: argparse.ArgumentParser, *, model: str = "resnet18",
                           several_batches: bool = False) -> None:
    """A benchmark's workload options: --model, --batch (one size, or with `several_batches`
    a list), --seq, --bert-size and --amp; :func:`workload_from` builds what they name."""
    parser.add_argument("--model", choices=CIFAR_MODELS + ("bert",), default=model)
    if several_batches:
        parser.add_argument("--batch", type=int, nargs="+", default=[32],
                            help="batch sizes (default 32)")
    else:
        parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--seq", type=int, default=128, help="BERT sequence length (128)")
    parser.add_argument("--bert-size", choices=BERT_SIZES, default="base")
    parser.add_argument("--amp", choices=("bf16",), default=None,
                        help="CIFAR models: every mode's step under bfloat16 autocast "
                             "(default float32; BERT always runs in bf16)")


def workload_from(args: argparse.Namespace, device, batch: int | None = None) -> Workload:
    """The workload the options of :func:`add_workload_arguments` name (`batch`: one of
    several sizes, else --batch)."""
    return make_workload(args.model, args.batch if batch is None else batch, device,
                         seq=args.seq, bert_size=args.bert_size, amp=args.amp)


def cuda_workload_from(args: argparse.Namespace, script: str) -> Workload | None:
    """:func:`workload_from` on the GPU, cuDNN's autotuning on (as every mode times it); None,
    after saying on stderr that `script` needs a GPU, where there is none."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return None
    torch.backends.cudnn.benchmark = True
    return workload_from(args, "cuda")
