"""Training a CIFAR network with Lightning against NimbleStrategy.

    python bench/bench_lightning.py                      # ResNet-18 b32, on a CUDA GPU
    python bench/bench_lightning.py --model branchy      # the inception-style network
    python bench/bench_lightning.py --cpu-check          # a few steps on the CPU: code paths only

One process, one GPU. A LightningModule over the recipes' network (channels-last), SGD with
Nesterov momentum as the recipes train it, per-batch mean cross-entropy, ``self.log`` of the
loss every step (Lightning's ``log_every_n_steps=50`` writes it); batches of synthetic images
already on the GPU (a DataLoader over them, batch_size=None), so the rows time the step.
Each row trains a fresh model from the same seed on the same batches:

- lightning: ``lightning.Trainer(precision="32-true")``, Lightning's default strategy.
- lightning-compile: the same over ``torch.compile(module)``, as Lightning's docs show.
- nimble-1: ``strategy=NimbleStrategy(streams=1)``: the whole step one graph on one stream.
- nimble: ``strategy=NimbleStrategy()``: streams="auto": the module's forward (which
  training_step calls as ``self(x)``) traced and planned, the backward's weight gradients on
  a side stream.
- nimble-compile: NimbleStrategy() over ``torch.compile(module)``.

Method: --steps training steps; a callback synchronizes the GPU at the end of step --skip and
at the last, and the steady state is the milliseconds per step between the two. x lightning:
the lightning row's time over the row's.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

ROWS = ("lightning", "lightning-compile", "nimble-1", "nimble", "nimble-compile")


def run_row(key: str, args, batches: list) -> dict:
    import lightning
    from lightning.pytorch.callbacks import Callback

    from nimble_train.bench.workloads import CIFAR_TRAINING, cifar_model
    from nimble_train.integrations.lightning import NimbleStrategy

    training = CIFAR_TRAINING[args.model]
    torch.manual_seed(0)
    network = cifar_model(args.model, args.device)

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = training.loss_fn(self(x), y).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return training.optimizer(self, training.bench_lr)

    marks: list[float] = []

    class Timer(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step in (args.skip, args.steps) and args.device == "cuda":
                torch.cuda.synchronize()
                marks.append(time.perf_counter())

    module = Module()
    if key.endswith("compile"):
        module = torch.compile(module)
    strategy = {"nimble-1": NimbleStrategy(streams=1), "nimble": NimbleStrategy(),
                "nimble-compile": NimbleStrategy()}.get(key, "auto")
    trainer = lightning.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=1, strategy=strategy,
        precision="32-true", max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[Timer()])
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    start = time.perf_counter()
    trainer.fit(module, loader)
    result = {"key": key, "wall_s": time.perf_counter() - start,
              "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}
    if len(marks) == 2:
        result["ms"] = 1e3 * (marks[1] - marks[0]) / (args.steps - args.skip)
    if isinstance(strategy, NimbleStrategy):
        stats = strategy.stats()
        result["note"] = (f"{stats['replays']} replays, weight gradients of "
                          f"{stats['weight_grad_layers']} layers on side streams")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--model", default="resnet18", choices=("resnet18", "branchy"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=600, help="training steps per row")
    parser.add_argument("--skip", type=int, default=200, help="steps before the timed span")
    parser.add_argument("--cpu-check", action="store_true",
                        help="a few steps on the CPU: the code paths, no timing")
    args = parser.parse_args(argv)
    if args.cpu_check:
        args.steps, args.skip, args.batch, args.device = 6, 2, 4, "cpu"
        args.rows = [r for r in args.rows if not r.endswith("compile")]
    elif not torch.cuda.is_available():
        print("bench_lightning.py times training on a CUDA GPU; torch.cuda.is_available() is "
              "False here (use --cpu-check to run the code paths on the CPU)")
        return 1
    else:
        args.device = "cuda"
    from nimble_train.bench.workloads import random_cifar_batches

    # Distinct batches for a whole run: the DataLoader hands them out in order.
    batches = random_cifar_batches(args.batch, args.steps, args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}")
    results = [run_row(key, args, batches) for key in args.rows]
    if args.device != "cuda":
        for r in results:
            print(f"{r['key']}: ran {args.steps} steps, last loss {r['loss']:.4f}; "
                  f"{r.get('note', '')}")
        return 0
    base = next((r for r in results if r["key"] == "lightning" and "ms" in r), None)
    print(f"\n{args.model} b{args.batch}, float32, steps {args.skip + 1}..{args.steps} timed")
    head = f"{'row':<17}  {'ms/step':>8}  {'x lightning':>11}  {'last loss':>9}  note"
    print(head + "\n" + "-" * len(head))
    for r in results:
        ratio = base["ms"] / r["ms"] if base and "ms" in r else float("nan")
        print(f"{r['key']:<17}  {r.get('ms', float('nan')):8.3f}  {ratio:11.2f}  "
              f"{r['loss']:9.4f}  {r.get('note', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
