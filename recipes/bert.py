"""BERT masked-LM pretraining steps on synthetic tokens, one GPU (or the CPU).

    python recipes/bert.py --steps 300                         # BERT-base, nt.Step, bf16
    python recipes/bert.py --size tiny --mode eager --steps 50
    python recipes/bert.py --size tiny --device cpu --steps 3 --batch 4 --seq 32

Hugging Face's BertForMaskedLM, built from a BertConfig (nothing is downloaded), computes its
own loss from `labels` (-100 where a token is not masked), so nt.Step runs it with
loss_fn=None on dict batches. The data is synthetic with static shapes: each sequence repeats a
random motif of Zipf-distributed tokens, 15% of the positions are masked (80% [MASK], 10%
random, 10% kept), so the loss has something to learn. bf16 autocast on the GPU, AdamW (or
nimble_train's LAMB, --optimizer lamb) with no decay on biases and LayerNorm, linear warm-up
then linear decay. The reported accuracy is masked-token accuracy on held-out sequences
(--eval-samples 0 skips it). Dropout is on (BERT's 0.1); a checkpoint carries the
random-number states it draws from, so a resumed run continues exactly.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _train  # noqa: E402  (the recipes' shared loop, beside this file)

import nimble_train as nt  # noqa: E402
from nimble_train.bench import workloads  # noqa: E402

RECIPE = "bert"
DEFAULT_LR = {"base": 1e-4, "tiny": 1e-3}


def has_lamb() -> bool:
    return hasattr(getattr(nt, "optim", None), "LAMB")


def parse_args(argv=None):
    p = _train.base_parser(__doc__, batch=32, epochs=1, lr_warmup=0.1,
                           amp_help="autocast: bf16 (default on GPU), none (default on CPU) "
                                    "or fp16")
    p.add_argument("--size", choices=workloads.BERT_SIZES, default="base",
                   help="base (110 M parameters, default) or tiny (tests)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--samples", type=int, default=32768,
                   help="synthetic training sequences; an epoch is one pass (default 32768)")
    p.add_argument("--eval-samples", type=int, default=512,
                   help="held-out sequences for the masked-token accuracy (default 512; "
                        "0 skips the evaluation)")
    p.add_argument("--optimizer", choices=("adamw", "lamb"), default="adamw",
                   help="adamw (default) or lamb (nimble_train.optim.LAMB, where present)")
    args = p.parse_args(argv)
    _train.check_args(p, args)
    if args.seq < 3 or args.seq > 512:
        p.error(f"--seq must be in [3, 512] (BERT's position table); got {args.seq}")
    if args.samples < args.batch:
        p.error(f"--samples ({args.samples}) must be at least --batch ({args.batch})")
    if args.optimizer == "lamb" and not has_lamb():
        p.error("--optimizer lamb needs nimble_train.optim.LAMB, which this build lacks; "
                "use --optimizer adamw")
    return args


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
    device = _train.pick_device(args.device)
    amp = _train.amp_of(args, device, default_on_cuda="bf16")
    torch.manual_seed(args.seed)

    model = workloads.bert_model(args.size, device)
    vocab = model.config.vocab_size
    train = workloads.synthetic_mlm(args.samples, args.seq, vocab, device=device, seed=args.seed)
    held_out = (workloads.synthetic_mlm(args.eval_samples, args.seq, vocab, device=device,
                                        seed=args.seed + 10_000) if args.eval_samples else None)
    # Under torchrun every rank takes its own share of each epoch's shuffled samples.
    batches_per_epoch = args.samples // (args.batch * job.world_size)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.size]
    optimizer = workloads.bert_optimizer(model, lr, kind=args.optimizer)
    planned = _train.planned_steps(args, batches_per_epoch, RECIPE)
    scheduler = _train.make_scheduler(optimizer, args, planned, decay="linear")
    config = {"size": args.size, "seq": args.seq, "batch": args.batch,
              "optimizer": args.optimizer, "steps_per_epoch": batches_per_epoch,
              "planned_steps": planned}

    print(f"SYNTHETIC masked-LM data: {args.samples} sequences of {args.seq} tokens "
          "(repeated Zipf motifs, 15% masked)")
    print(_train.describe_run(device, args, amp))
    params = sum(p.numel() for p in model.parameters())
    print(f"BERT-{args.size}: {params / 1e6:.1f} M parameters, batch {args.batch}, "
          f"{batches_per_epoch} steps per epoch, {type(optimizer).__name__} peak lr {lr:.3g}, "
          f"{planned} planned steps")
    try:
        train_step = _train.make_train_step(
            args.mode, model, optimizer, None, device=device, amp=amp, streams=args.streams,
            warmup=args.warmup, grad_clip=args.grad_clip, capture=not args.no_capture,
            compile_model=args.compile)
    except NotImplementedError as exc:
        print(f"--mode {args.mode} --amp {args.amp}: {exc}", file=sys.stderr)
        return 2
    start_step = _train.resume(args, recipe=RECIPE, model=model, optimizer=optimizer,
                               scheduler=scheduler, train_step=train_step, config=config,
                               device=device, steps_per_epoch=batches_per_epoch, job=job)

    def epoch_batches(epoch: int):
        g = torch.Generator(device=device).manual_seed(args.seed * 1000 + epoch)
        order = torch.randperm(args.samples, device=device, generator=g)
        mine = order[job.rank::job.world_size]  # the same order on every rank, disjoint shares
        shuffled = {k: v[mine] for k, v in train.items()}
        return workloads.slice_batches(shuffled, args.batch)

    def evaluate() -> float:
        return masked_accuracy(model, held_out, args.batch, device, amp)

    result = _train.fit(args, recipe=RECIPE, model=model, optimizer=optimizer,
                        scheduler=scheduler, train_step=train_step, epoch_batches=epoch_batches,
                        steps_per_epoch=batches_per_epoch,
                        evaluate=evaluate if held_out is not None else None, device=device,
                        start_step=start_step, config=config, job=job)
    _train.finish(RECIPE, args, f"bert-{args.size}", result, train_step, job,
                  extra=f"seq={args.seq} data=synthetic")
    return 0


@torch.no_grad()
def masked_accuracy(model, data: dict, batch: int, device, amp) -> float:
    """Fraction of masked positions whose token the model ranks first; one host sync."""
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    n = data["input_ids"].shape[0]
    with _train.autocast(device, amp):
        for start in range(0, n, batch):
            ids = data["input_ids"][start:start + batch]
            labels = data["labels"][start:start + batch]
            predicted = model(input_ids=ids).logits.argmax(-1)
            masked = labels != -100
            correct += ((predicted == labels) & masked).sum()
            total += masked.sum()
    model.train(was_training)
    return correct.item() / max(total.item(), 1)


if __name__ == "__main__":
    sys.exit(main())
