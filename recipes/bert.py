"""BERT on synthetic tokens, one GPU (or the CPU): masked-LM pretraining steps (default), or
sequence-classification fine-tuning on variable-length batches (--task finetune).

    python recipes/bert.py --steps 300                         # BERT-base, nt.Step, bf16
    python recipes/bert.py --size tiny --mode eager --steps 50
    python recipes/bert.py --size tiny --device cpu --steps 3 --batch 4 --seq 32
    python recipes/bert.py --task finetune --steps 300         # lengths 8..512, 4 buckets
    python recipes/bert.py --task finetune --size tiny --device cpu --steps 6 --batch 4

Hugging Face's BERT models, built from a BertConfig (nothing is downloaded), compute their own
loss from `labels`, so nt.Step runs them with loss_fn=None on dict batches. bf16 autocast on the
GPU, AdamW (or nimble_train's LAMB, --optimizer lamb) with no decay on biases and LayerNorm,
linear warm-up then linear decay. Dropout is on (--dropout, BERT's 0.1); a checkpoint carries
the random-number states it draws from, so a resumed run continues exactly. The evaluation
runs through nt.Step's evaluator (captured beside the training graphs, in their pool) or, in
the plain loop's modes, eagerly; its counts stay on the device until one read at the end
(--eval-samples 0 skips it).

pretrain: BertForMaskedLM on static shapes: each sequence of --seq tokens repeats a random motif
of Zipf-distributed tokens, 15% of the positions are masked (80% [MASK], 10% random, 10% kept),
so the loss has something to learn. The accuracy is masked-token accuracy on held-out
sequences.

finetune: BertForSequenceClassification (pad id 0, 4 classes, from random weights) on sequences
of varied length, log-normal around --median-len (64) clipped to [8, --max-len] (512): most
under 128, a tail to 512, as in real fine-tuning sets. A sequence is [CLS], content tokens,
[SEP]; the content is Zipf-distributed with keyword tokens of its class scattered in (one
position in 16 on average, at least one), so the label is learnable from the tokens. Each batch
is padded to its longest sequence (attention_mask 0 on the padding), as Hugging Face's
DataCollatorWithPadding does, and nt.Step pads it on to the smallest of --buckets that fits:
one captured graph per bucket, all in one pool, exact since the padding is masked. The
accuracy is classification accuracy on held-out sequences of the same distribution, batched
the same way. Throughput counts samples and real tokens (padding excluded).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _train  # noqa: E402  (the recipes' shared loop, beside this file)

import nimble_train as nt  # noqa: E402
from nimble_train.bench import workloads  # noqa: E402
from nimble_train.bench.workloads import CLS_ID, FIRST_CONTENT_ID, PAD_ID, SEP_ID  # noqa: E402

RECIPE = "bert"
TASKS = ("pretrain", "finetune")
DEFAULT_LR = {"base": 1e-4, "tiny": 1e-3}
# Options older checkpoints do not record: they were all written by pretraining with BERT's
# dropout.
CONFIG_DEFAULTS = {"task": "pretrain", "dropout": 0.1}

# Fine-tuning data.
NUM_LABELS = 4
KEYWORDS = 8            # token ids per class that mark it; the vocabulary's last ones
KEYWORD_RATE = 1 / 16   # chance of a content position holding a keyword of the class
MIN_LEN = 8             # [CLS] + at least 6 content tokens + [SEP]
LENGTH_SIGMA = 0.7      # of log(length): with median 64, p90 = 64 e^(1.28 * 0.7) = 157
DEFAULT_MAX_LEN = 512   # BERT's position table
DEFAULT_MEDIAN_LEN = 64
DEFAULT_BUCKETS = (64, 128, 256, 512)


def has_lamb() -> bool:
    return hasattr(getattr(nt, "optim", None), "LAMB")


# ---------------------------------------------------------------------- options


def _lengths(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive lengths such as "
                                         f"64,128,256,512; got {text!r}")
    return tuple(sorted(set(sizes)))


def parse_args(argv=None):
    p = _train.base_parser(__doc__, batch=32, epochs=1, lr_warmup=0.1,
                           amp_help="autocast: bf16 (default on GPU), none (default on CPU) "
                                    "or fp16")
    p.add_argument("--task", choices=TASKS, default="pretrain",
                   help="pretrain: masked-LM steps on static shapes (default); finetune: "
                        "sequence classification on variable-length batches")
    p.add_argument("--size", choices=workloads.BERT_SIZES, default="base",
                   help="base (110 M parameters, default) or tiny (tests)")
    p.add_argument("--seq", type=int, default=None,
                   help="pretrain: sequence length (default 128)")
    p.add_argument("--max-len", type=int, default=None,
                   help=f"finetune: the longest sequence (default {DEFAULT_MAX_LEN})")
    p.add_argument("--median-len", type=int, default=None,
                   help=f"finetune: the median sequence length (default {DEFAULT_MEDIAN_LEN}, "
                        "at most --max-len)")
    p.add_argument("--buckets", type=_lengths, default=None,
                   help="finetune: the lengths nt.Step pads each batch up to (default "
                        "64,128,256,512, capped at --max-len); --mode eager and compile run "
                        "each batch at its own length")
    p.add_argument("--samples", type=int, default=32768,
                   help="synthetic training sequences; an epoch is one pass (default 32768)")
    p.add_argument("--eval-samples", type=int, default=512,
                   help="held-out sequences for the accuracy (default 512; 0 skips the "
                        "evaluation)")
    p.add_argument("--optimizer", choices=("adamw", "lamb"), default="adamw",
                   help="adamw (default) or lamb (nimble_train.optim.LAMB, where present)")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="dropout of hidden states and attention (default 0.1, BERT's)")
    args = p.parse_args(argv)
    _train.check_args(p, args)
    if args.samples < args.batch:
        p.error(f"--samples ({args.samples}) must be at least --batch ({args.batch})")
    if args.optimizer == "lamb" and not has_lamb():
        p.error("--optimizer lamb needs nimble_train.optim.LAMB, which this build lacks; "
                "use --optimizer adamw")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout must be in [0, 1); got {args.dropout}")
    if args.task == "pretrain":
        _check_pretrain(p, args)
    else:
        _check_finetune(p, args)
    return args


def _check_pretrain(p: argparse.ArgumentParser, args) -> None:
    given = [flag for flag, value in (("--max-len", args.max_len),
                                      ("--median-len", args.median_len),
                                      ("--buckets", args.buckets)) if value is not None]
    if given:
        p.error(f"{', '.join(given)}: for --task finetune (pretraining has sequences of --seq "
                "tokens)")
    args.seq = 128 if args.seq is None else args.seq
    if args.seq < 3 or args.seq > 512:
        p.error(f"--seq must be in [3, 512] (BERT's position table); got {args.seq}")


def _check_finetune(p: argparse.ArgumentParser, args) -> None:
    if args.seq is not None:
        p.error("--seq is for --task pretrain; fine-tuning sequences vary in length: give "
                "--max-len (and --median-len)")
    args.max_len = DEFAULT_MAX_LEN if args.max_len is None else args.max_len
    if not MIN_LEN <= args.max_len <= 512:
        p.error(f"--max-len must be in [{MIN_LEN}, 512] (BERT's position table); got "
                f"{args.max_len}")
    if args.median_len is None:
        args.median_len = min(DEFAULT_MEDIAN_LEN, args.max_len)
    if not MIN_LEN <= args.median_len <= args.max_len:
        p.error(f"--median-len must be in [{MIN_LEN}, --max-len {args.max_len}]; got "
                f"{args.median_len}")
    if args.buckets is None:
        args.buckets = tuple(sorted({min(size, args.max_len) for size in DEFAULT_BUCKETS}))
    if args.buckets[-1] < args.max_len:
        p.error(f"--buckets {','.join(map(str, args.buckets))}: the largest is shorter than "
                f"--max-len {args.max_len}, so the longest batches would not fit; add "
                f"{args.max_len}")


# ---------------------------------------------------------------------- tasks


@dataclass
class Task:
    """What pretraining and fine-tuning each supply to the shared loop."""

    model: torch.nn.Module
    steps_per_epoch: int
    epoch_batches: Callable[[int], Iterable[dict]]
    epoch_tokens: Callable[[int], list[int]] | None  # variable lengths: real tokens per step
    counts: Callable[[torch.nn.Module, dict], dict]  # the evaluation step, fn(model, batch)
    eval_batches: Callable[[], Iterable[dict]] | None  # None: no evaluation
    accuracy: Callable[[dict], float]                 # from the summed counts
    config: dict                                      # what a resumed run must match
    buckets: nt.Buckets | None
    described: list[str]                              # lines printed before training
    extra: str                                        # fields of the summary


def pretraining(args, device: torch.device, job: _train.Job) -> Task:
    model = workloads.bert_model(args.size, device, hidden_dropout_prob=args.dropout,
                                 attention_probs_dropout_prob=args.dropout)
    vocab = model.config.vocab_size
    train = workloads.synthetic_mlm(args.samples, args.seq, vocab, device=device, seed=args.seed)
    held_out = (workloads.synthetic_mlm(args.eval_samples, args.seq, vocab, device=device,
                                        seed=args.seed + 10_000) if args.eval_samples else None)
    # Under torchrun every rank takes its own share of each epoch's shuffled samples.
    steps_per_epoch = args.samples // (args.batch * job.world_size)

    def epoch_batches(epoch: int):
        g = torch.Generator(device=device).manual_seed(args.seed * 1000 + epoch)
        order = torch.randperm(args.samples, device=device, generator=g)
        mine = order[job.rank::job.world_size]  # the same order on every rank, disjoint shares
        shuffled = {k: v[mine] for k, v in train.items()}
        return workloads.slice_batches(shuffled, args.batch)

    def eval_batches():
        n = held_out["input_ids"].shape[0]
        return ({k: v[start:start + args.batch] for k, v in held_out.items()}
                for start in range(0, n, args.batch))

    return Task(
        model=model, steps_per_epoch=steps_per_epoch, epoch_batches=epoch_batches,
        epoch_tokens=None, counts=masked_lm_counts,
        eval_batches=eval_batches if held_out is not None else None,
        accuracy=lambda counts: counts.get("correct", 0) / max(counts.get("masked", 0), 1),
        config={"size": args.size, "seq": args.seq}, buckets=None,
        described=[f"SYNTHETIC masked-LM data: {args.samples} sequences of {args.seq} tokens "
                   "(repeated Zipf motifs, 15% masked)"],
        extra=f"task=pretrain seq={args.seq} data=synthetic")


def finetuning(args, device: torch.device, job: _train.Job) -> Task:
    model = classifier_model(args.size, device, args.dropout)
    vocab = model.config.vocab_size
    train = synthetic_classification(args.samples, args.max_len, args.median_len, vocab,
                                     device=device, seed=args.seed)
    held_out = (synthetic_classification(args.eval_samples, args.max_len, args.median_len,
                                         vocab, device=device, seed=args.seed + 10_000)
                if args.eval_samples else None)
    span = args.batch * job.world_size  # a global batch: every rank's share of one step
    steps_per_epoch = args.samples // span

    def epoch_batches(epoch: int):
        return train.take(epoch_order(args.samples, args.seed, epoch)).batches(args.batch, job)

    def epoch_tokens(epoch: int) -> list[int]:
        return step_tokens(train.lengths[epoch_order(args.samples, args.seed, epoch)], span)

    buckets = nt.Buckets(sizes=args.buckets, dim=1) if args.mode == "step" else None
    n = held_out.lengths.numel() if held_out is not None else 0
    return Task(
        model=model, steps_per_epoch=steps_per_epoch, epoch_batches=epoch_batches,
        epoch_tokens=epoch_tokens, counts=classification_counts,
        eval_batches=((lambda: held_out.batches(args.batch, drop_last=False))
                      if held_out is not None else None),
        accuracy=lambda counts: counts.get("correct", 0) / max(n, 1),
        config={"size": args.size, "max_len": args.max_len, "median_len": args.median_len,
                "samples": args.samples},
        buckets=buckets,
        described=describe_lengths(train, args, span, buckets),
        extra=f"task=finetune max_len={args.max_len} data=synthetic")


# ---------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    job = _train.join_job(RECIPE, args)
    if job is None:
        return 2
    _train.check_save_path(args, job)
    try:
        workloads.require_transformers()
    except ImportError as exc:
        print(f"{RECIPE}: {exc}", file=sys.stderr)
        return 2
    if args.resume:
        check_resumed_task(args)
    device = _train.pick_device(args.device)
    amp = _train.amp_of(args, device, default_on_cuda="bf16")
    torch.manual_seed(args.seed)

    task = (pretraining if args.task == "pretrain" else finetuning)(args, device, job)
    model = task.model
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.size]
    optimizer = workloads.bert_optimizer(model, lr, kind=args.optimizer)
    planned = _train.planned_steps(args, task.steps_per_epoch, RECIPE)
    scheduler = _train.make_scheduler(optimizer, args, planned, decay="linear")
    config = {"task": args.task, **task.config, "batch": args.batch,
              "optimizer": args.optimizer, "dropout": args.dropout,
              "steps_per_epoch": task.steps_per_epoch, "planned_steps": planned}

    for line in task.described:
        print(line)
    print(_train.describe_run(device, args, amp))
    params = sum(p.numel() for p in model.parameters())
    kind = "" if args.task == "pretrain" else f" sequence classifier ({NUM_LABELS} classes)"
    print(f"BERT-{args.size}{kind}: {params / 1e6:.1f} M parameters, batch {args.batch}, "
          f"{task.steps_per_epoch} steps per epoch, {type(optimizer).__name__} peak lr "
          f"{lr:.3g}, {planned} planned steps" +
          (f", nt.Step buckets {','.join(map(str, task.buckets.sizes))}" if task.buckets
           else ""))
    try:
        train_step = _train.make_train_step(
            args.mode, model, optimizer, None, device=device, amp=amp, streams=args.streams,
            warmup=args.warmup, grad_clip=args.grad_clip, capture=not args.no_capture,
            compile_model=args.compile, buckets=task.buckets,
            shard_optimizer=args.shard_optimizer)
    except NotImplementedError as exc:
        print(f"--mode {args.mode} --amp {args.amp}: {exc}", file=sys.stderr)
        return 2
    start_step = _train.resume(args, recipe=RECIPE, model=model, optimizer=optimizer,
                               scheduler=scheduler, train_step=train_step, config=config,
                               device=device, steps_per_epoch=task.steps_per_epoch, job=job,
                               config_defaults=CONFIG_DEFAULTS)
    evaluator = _train.make_evaluator(train_step, model, task.counts, device=device, amp=amp)

    def evaluate() -> float:
        return task.accuracy(_train.evaluate_counts(evaluator, task.eval_batches()))

    result = _train.fit(args, recipe=RECIPE, model=model, optimizer=optimizer,
                        scheduler=scheduler, train_step=train_step,
                        epoch_batches=task.epoch_batches, steps_per_epoch=task.steps_per_epoch,
                        evaluate=evaluate if task.eval_batches is not None else None,
                        device=device, start_step=start_step, config=config, job=job,
                        epoch_tokens=task.epoch_tokens)
    _train.finish(RECIPE, args, f"bert-{args.size}", result, train_step, job, extra=task.extra)
    return 0


def check_resumed_task(args) -> None:
    """A checkpoint of the other task ends the run with one line, before anything is built."""
    saved = _train.checkpoint_config(args.resume, RECIPE).get("task", CONFIG_DEFAULTS["task"])
    if saved != args.task:
        raise SystemExit(f"--resume {args.resume}: a checkpoint of --task {saved}, not --task "
                         f"{args.task}; pass --task {saved} to continue it")


# ---------------------------------------------------------------------- evaluation steps


def masked_lm_counts(model, batch: dict) -> dict:
    """Pretraining's evaluation step: masked positions whose token the model ranks first, and
    masked positions, as device counts."""
    predicted = model(input_ids=batch["input_ids"]).logits.argmax(-1)
    labels = batch["labels"]
    masked = labels != -100
    return {"correct": ((predicted == labels) & masked).sum(), "masked": masked.sum()}


def classification_counts(model, batch: dict) -> dict:
    """Fine-tuning's evaluation step: sequences whose class the model ranks first, as a device
    count (padding is masked, so a batch padded further gives the same count)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return {"correct": (logits.argmax(-1) == batch["labels"]).sum()}


# ---------------------------------------------------------------------- fine-tuning data


def classifier_model(size: str, device, dropout: float = 0.1):
    """A freshly initialised BertForSequenceClassification of NUM_LABELS classes whose token id
    0 is padding (built from its config; nothing is downloaded)."""
    transformers = workloads.require_transformers()
    # With a pad id the embedding of id 0 is a zero row that is never trained; every batch
    # carries its attention_mask, so transformers never inspects input_ids for padding.
    config = workloads.bert_config(size, num_labels=NUM_LABELS, pad_token_id=PAD_ID,
                                   hidden_dropout_prob=dropout,
                                   attention_probs_dropout_prob=dropout)
    return transformers.BertForSequenceClassification(config).to(device)


def sequence_lengths(samples: int, median: int, max_len: int, *,
                     generator: torch.Generator) -> torch.Tensor:
    """[samples] int64 on the CPU: log-normal around `median` (sigma LENGTH_SIGMA of the log),
    rounded and clipped to [MIN_LEN, max_len]. With median 64 and max_len 512: p90 157, p99 326,
    one in 670 at 512."""
    z = torch.randn(samples, generator=generator, dtype=torch.float64)
    lengths = (math.log(median) + LENGTH_SIGMA * z).exp().round()
    return lengths.clamp(MIN_LEN, max_len).to(torch.int64)


@dataclass
class Sequences:
    """Variable-length sequences to classify: `input_ids` [N, max_len] (PAD_ID after each
    sequence's end) and `labels` [N] on the training device, `lengths` [N] on the host, so
    that every batch's shape is known without reading the device."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor

    def take(self, order: torch.Tensor) -> Sequences:
        """The sequences in `order` (host indices): one gather on the device."""
        rows = order.to(self.input_ids.device)
        return Sequences(self.input_ids[rows], self.labels[rows], self.lengths[order])

    def batches(self, batch: int, job: _train.Job | None = None, *,
                drop_last: bool = True) -> Iterator[dict]:
        """This rank's share of consecutive global batches of world_size x `batch` sequences,
        each padded to the longest sequence of its global batch (so every rank has the same
        length, and the same bucket): `input_ids`, `attention_mask` (1 on the tokens, 0 on the
        padding) [batch, longest] and `labels` [batch]."""
        job = job or _train.Job()
        n, span = self.lengths.numel(), batch * job.world_size
        for start in range(0, n // span * span if drop_last else n, span):
            longest = int(self.lengths[start:start + span].max())
            mine = slice(start + job.rank * batch, min(start + (job.rank + 1) * batch, n))
            ids = self.input_ids[mine, :longest].contiguous()
            yield {"input_ids": ids, "attention_mask": (ids != PAD_ID).long(),
                   "labels": self.labels[mine]}


def synthetic_classification(samples: int, max_len: int, median_len: int, vocab_size: int, *,
                             device, seed: int = 0) -> Sequences:
    """Learnable sequence-classification data of varied lengths (drawn on the CPU, the same on
    any device). A sequence of length L (sequence_lengths) is [CLS], L - 2 content tokens,
    [SEP]; content tokens follow a Zipf law over the content vocabulary less the keywords, and
    each content position holds, with probability KEYWORD_RATE, one of its class's KEYWORDS
    keyword ids (one random position always does). The label is the class: learnable from the
    tokens, by attending to the keywords among the noise."""
    first_keyword = vocab_size - NUM_LABELS * KEYWORDS
    if first_keyword <= FIRST_CONTENT_ID:
        raise ValueError(f"vocab_size must exceed {FIRST_CONTENT_ID + NUM_LABELS * KEYWORDS} "
                         f"(content tokens and keywords); got {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    lengths = sequence_lengths(samples, median_len, max_len, generator=g)
    labels = torch.randint(0, NUM_LABELS, (samples,), generator=g)
    ranks = torch.arange(1, first_keyword - FIRST_CONTENT_ID + 1, dtype=torch.float64)
    cdf = torch.cumsum(1 / ranks, 0)
    uniform = torch.rand(samples, max_len, generator=g, dtype=torch.float64) * cdf[-1]
    ids = torch.searchsorted(cdf, uniform).clamp_(max=ranks.numel() - 1) + FIRST_CONTENT_ID
    keyword_ids = (first_keyword + labels[:, None] * KEYWORDS
                   + torch.randint(0, KEYWORDS, (samples, max_len), generator=g))
    position = torch.arange(max_len)
    end = lengths[:, None] - 1                                   # the [SEP] position
    forced = 1 + (torch.rand(samples, generator=g) * (lengths - 2)).long()  # in [1, L - 2]
    keyword = ((torch.rand(samples, max_len, generator=g) < KEYWORD_RATE)
               | (position == forced[:, None])) & (position >= 1) & (position < end)
    ids = torch.where(keyword, keyword_ids, ids)
    ids[:, 0] = CLS_ID
    ids = torch.where(position == end, SEP_ID, ids)
    ids = torch.where(position > end, PAD_ID, ids)
    return Sequences(ids.to(device), labels.to(device), lengths)


def epoch_order(samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order of the training sequences, on the host (batch lengths come from it),
    fixed by the epoch's number and the same on every rank."""
    return torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


def step_tokens(lengths: torch.Tensor, span: int) -> list[int]:
    """The real tokens of each step's global batch of `span` sequences (the tail dropped)."""
    steps = lengths.numel() // span
    return lengths[:steps * span].view(steps, span).sum(1).tolist()


def describe_lengths(data: Sequences, args, span: int, buckets: nt.Buckets | None) -> list[str]:
    """The length distribution, and what padding costs in the first epoch: the share of real
    tokens in batches padded to their longest sequence and, under nt.Step, padded on to the
    buckets, with the steps each bucket gets."""
    lengths = data.lengths
    q = torch.quantile(lengths.double(), torch.tensor([0.5, 0.9], dtype=torch.float64)).tolist()
    lines = [f"SYNTHETIC classification data: {lengths.numel()} sequences, {NUM_LABELS} classes "
             f"(keywords among Zipf tokens); lengths median {q[0]:.0f}, p90 {q[1]:.0f}, max "
             f"{int(lengths.max())} tokens (log-normal around {args.median_len}, clipped to "
             f"[{MIN_LEN}, {args.max_len}])"]
    shuffled = lengths[epoch_order(args.samples, args.seed, 0)]
    steps = shuffled.numel() // span
    per_step = shuffled[:steps * span].view(steps, span)
    real, longest = per_step.sum().item(), per_step.max(1).values
    text = (f"padding in epoch 1: {real / (span * longest.sum().item()):.0%} of the positions "
            "are real tokens with each batch padded to its longest sequence")
    if buckets is not None:
        sizes = torch.tensor(buckets.sizes)
        padded = sizes[torch.searchsorted(sizes, longest)]
        used = {size: int((padded == size).sum()) for size in buckets.sizes}
        text += (f", {real / (span * padded.sum().item()):.0%} padded on to the buckets (steps "
                 "per bucket: " + ", ".join(f"{s}: {c}" for s, c in used.items()) + ")")
    return lines + [text]


if __name__ == "__main__":
    sys.exit(main())
