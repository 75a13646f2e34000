"""GLUE-style fine-tuning through transformers.Trainer against nimble_train's drop-in Trainer.

    python bench/bench_trainer.py                 # BERT-base, batch 16, bf16, on a CUDA GPU
    python bench/bench_trainer.py --cpu-check     # tiny BERT on the CPU: the code paths only

One process, one GPU. BertForSequenceClassification built from its config (nothing
downloaded), two labels. The data: synthetic sentences of GLUE-like lengths (log-normal,
median 40 tokens, sigma 0.6, clipped to [8, 128]), [CLS] first and [SEP] last, a cue token whose
parity is the label; DataCollatorWithPadding pads each batch to its longest (dynamic padding),
with a BertTokenizer over a generated 30522-word vocabulary (pad id 0, max length 128).

Both rows use the same TrainingArguments, what a user fine-tuning on an H100 would pick:
bf16=True, per_device_train_batch_size=16, learning_rate 2e-5 with a linear schedule and 6%
warm-up (warmup_steps), Trainer's defaults otherwise (its fused AdamW, max_grad_norm=1.0,
logging every 50 steps, no checkpoints during the run). Each row trains a fresh model from the
same seed on the same data in the same order:

- trainer: transformers.Trainer.
- one-stream: nimble_train.integrations.transformers.Trainer with nimble=dict(streams=1): the
  whole step one graph on one stream (its shape buckets, 32/64/128, come from the collator's
  tokenizer).
- drop-in: nimble_train.integrations.transformers.Trainer, nothing else changed: the Step's
  streams="auto", the linear layers' weight gradients on a side stream.

Method: --steps optimizer steps; a callback synchronizes the GPU at the end of step --skip and
at the last, and the steady state is the samples (and real tokens, never padding) between the
two over the seconds between (tokens/s: samples/s times the data's mean real length, padding
never counted). "first fast step" is the wall-clock time from the start of
train() to the end of the first step that ran as a graph replay (for Trainer: its first step),
synchronized there once. x trainer: samples/s over the trainer row's.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROWS = ("trainer", "one-stream", "drop-in")


def vocabulary(path: Path, size: int) -> Path:
    specials = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]",
                                                                   "[MASK]"]
    words = specials + [f"w{i}" for i in range(size - len(specials))]
    path.write_text("\n".join(words) + "\n")
    return path


def sentences(n: int, vocab: int, max_len: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(min(max(round(rng.lognormvariate(math.log(40), 0.6)), 8), max_len))
        cue = rng.randrange(16)
        ids = [101, 1000 + cue] + [rng.randrange(1016, vocab) for _ in range(length - 3)] + [102]
        out.append({"input_ids": ids, "attention_mask": [1] * length,
                    "token_type_ids": [0] * length, "labels": cue % 2})
    return out


class Timer:
    """A TrainerCallback (built lazily: transformers is imported in main) that synchronizes at
    the end of step `skip`, at the last step, and at the first replayed step."""

    def __init__(self, skip: int):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                torch.cuda.synchronize()
                timer.begin = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                step = getattr(timer.trainer, "nimble_step", None)
                if timer.first_fast is None and (
                        step is None or step.stats()["phase"] == "replay"):
                    torch.cuda.synchronize()
                    timer.first_fast = (time.perf_counter() - timer.begin, state.global_step)
                if state.global_step == skip or state.global_step == state.max_steps:
                    torch.cuda.synchronize()
                    timer.marks.append(time.perf_counter())

        self.callback = Callback()
        self.begin = 0.0
        self.first_fast = None
        self.marks: list[float] = []
        self.trainer = None


def run_row(key: str, args, data: list[dict], tokenizer, out_dir: Path) -> dict:
    import transformers
    from transformers import (BertConfig, BertForSequenceClassification,
                              DataCollatorWithPadding, TrainingArguments)

    from nimble_train.integrations.transformers import Trainer as DropIn

    torch.manual_seed(0)
    if args.size == "base":
        config = BertConfig(num_labels=2)
    else:
        config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=128, num_labels=2)
    model = BertForSequenceClassification(config).to(args.device)
    cuda = args.device == "cuda"
    training = TrainingArguments(
        output_dir=str(out_dir / key), per_device_train_batch_size=args.batch,
        learning_rate=2e-5, lr_scheduler_type="linear", warmup_steps=round(0.06 * args.steps),
        max_steps=args.steps, bf16=cuda, logging_steps=50, save_strategy="no", report_to=[],
        seed=0, disable_tqdm=True, use_cpu=not cuda)
    timer = Timer(args.skip) if cuda else None
    common = dict(model=model, args=training, train_dataset=data,
                  data_collator=DataCollatorWithPadding(tokenizer),
                  callbacks=[timer.callback] if timer else None)
    if key == "trainer":
        trainer = transformers.Trainer(**common)
    else:
        trainer = DropIn(**common, nimble={"streams": 1} if key == "one-stream" else None)
    if timer:
        timer.trainer = trainer
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    result = {"key": key, "wall_s": wall}
    if timer and len(timer.marks) == 2:
        seconds = timer.marks[1] - timer.marks[0]
        samples = (args.steps - args.skip) * args.batch
        mean_length = sum(len(d["input_ids"]) for d in data) / len(data)
        result.update(samples_s=samples / seconds, tokens_s=samples * mean_length / seconds,
                      ms=1e3 * seconds / (args.steps - args.skip),
                      first_fast_s=timer.first_fast[0], first_fast_step=timer.first_fast[1])
    step = getattr(trainer, "nimble_step", None)
    if step is not None:
        stats = step.stats()
        result["note"] = (f"{stats['replays']} replays, {stats['eager_steps']} eager steps, "
                          f"buckets {sorted(stats['shape_buckets'] or [])}, "
                          f"{stats['weight_grad_layers']} weight gradients on a side stream")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result["last_loss"] = losses[-1] if losses else None
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per row")
    parser.add_argument("--skip", type=int, default=100, help="steps before the timed span")
    parser.add_argument("--size", default="base", choices=("base", "tiny"))
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--cpu-check", action="store_true",
                        help="tiny BERT, a few steps on the CPU: the code paths, no timing")
    args = parser.parse_args(argv)
    if args.cpu_check:
        args.size, args.steps, args.skip, args.batch, args.device = "tiny", 6, 2, 4, "cpu"
    elif not torch.cuda.is_available():
        print("bench_trainer.py times training on a CUDA GPU; torch.cuda.is_available() is "
              "False here (use --cpu-check to run the code paths on the CPU)")
        return 1
    else:
        args.device = "cuda"
    from transformers import BertTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vocab = 30522
        tokenizer = BertTokenizer(str(vocabulary(tmp / "vocab.txt", vocab)),
                                  model_max_length=args.max_len)
        data = sentences(max(args.steps * args.batch, 64), vocab, args.max_len)
        lengths = torch.tensor([len(d["input_ids"]) for d in data], dtype=torch.float)
        where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
        print(f"{where}, torch {torch.__version__}; lengths mean {lengths.mean():.0f}, "
              f"median {lengths.median():.0f}, max {lengths.max():.0f}")
        results = [run_row(key, args, data, tokenizer, tmp) for key in args.rows]
    if args.device != "cuda":
        for r in results:
            print(f"{r['key']}: ran {args.steps} steps, last loss {r['last_loss']}; "
                  f"{r.get('note', '')}")
        return 0
    base = next((r for r in results if r["key"] == "trainer" and "samples_s" in r), None)
    print(f"\nBERT-{args.size} sequence classification, batch {args.batch}, bf16, dynamic "
          f"padding; steps {args.skip + 1}..{args.steps} timed")
    head = (f"{'row':<10}  {'ms/step':>8}  {'samples/s':>9}  {'tokens/s':>9}  {'x trainer':>9}  "
            f"{'first fast step':>17}  note")
    print(head + "\n" + "-" * len(head))
    for r in results:
        ratio = r["samples_s"] / base["samples_s"] if base else float("nan")
        first = f"{r['first_fast_s']:.1f} s (step {r['first_fast_step']})"
        print(f"{r['key']:<10}  {r['ms']:8.2f}  {r['samples_s']:9.0f}  {r['tokens_s']:9.0f}  "
              f"{ratio:9.2f}  {first:>17}  {r.get('note', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
