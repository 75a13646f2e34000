"""Adversarial training: each step makes its batch's adversarial examples with
``torch.autograd.grad`` of the loss by the images (FGSM's one step, or PGD's k from no
perturbation, each of size alpha within an L-inf ball of eps), then trains on them; the
attack runs inside the model's forward, so nt.Step captures it with the rest of the step.

    python bench/bench_adversarial.py                 # ResNet-18 b32, FGSM and PGD-3
    python bench/bench_adversarial.py --model branchy --attack-steps 1 7

One process, one GPU. Side by side, in alternating rounds (a CUDA-event mean over --steps
steps after 10 untimed ones each; the table gives each one's median over --rounds rounds):
the eager loop (torch's fused SGD), nt.Step on one stream, streams="auto", and
streams="auto" captured with the split layers computing every weight gradient in the
attack's backwards too, where autograd throws them away (what they did before they computed
only the gradients a backward asks for, as torch's own layers do).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import nimble_train as nt
from nimble_train import _torch_private
from nimble_train.bench.timing import alternating_ms, captured
from nimble_train.bench.workloads import CIFAR_MODELS, make_workload

WAYS = ("eager", "step", "step-auto", "step-auto, every weight gradient")


class Adversarial(nn.Module):
    """`net` trained on adversarial examples of its batch: `steps` signed-gradient steps of
    size `alpha` from the images, kept within `eps` of them (steps=1, alpha=eps: FGSM)."""

    def __init__(self, net: nn.Module, loss_fn, steps: int, eps: float = 8 / 255):
        super().__init__()
        self.net, self.loss_fn, self.steps = net, loss_fn, steps
        self.eps, self.alpha = eps, eps if steps <= 1 else 2.5 * eps / steps

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        delta = torch.zeros_like(images)
        for _ in range(self.steps):
            x = (images + delta).requires_grad_()
            g, = torch.autograd.grad(self._loss(x, labels), x)
            delta = (delta + self.alpha * g.sign()).clamp(-self.eps, self.eps)
        return self._loss(images + delta, labels)

    def _loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(self.net(x), labels)  # the mean of a loss per sample
        return loss.mean() if loss.dim() else loss


def _every_weight_gradient(ctx, i: int) -> bool:
    """backward_asks as the split layers had it: whatever needs a gradient gets one."""
    return ctx.needs_input_grad[i]


def build(w, attack_steps: int, way: str):
    """One way's step function for workload `w` (fresh model and optimizer, seed 0)."""
    torch.manual_seed(0)
    model = Adversarial(w.make_model(), w.loss_fn, attack_steps)
    if way == "eager":
        optimizer = w.make_optimizer(model, fused=True)

        def step(batch):
            optimizer.zero_grad(set_to_none=True)
            model(**batch).backward()
            optimizer.step()
        return step
    step = nt.Step(model, w.make_optimizer(model), streams=1 if way == "step" else "auto")
    every = way == "step-auto, every weight gradient"
    return captured(step, w.batches, way, [(_torch_private, "backward_asks",
                                            _every_weight_gradient)] if every else [])


def print_table(rows: list[dict]) -> None:
    print("| workload | attack | " + " | ".join(WAYS) + " | eager ÷ step-auto "
          "| every weight gradient ÷ asked |")
    print("|---|---|" + "---|" * (len(WAYS) + 2))
    for r in rows:
        print(f"| {r['workload']} | {r['attack']} | "
              + " | ".join(f"{r[way]:.3f}" for way in WAYS)
              + f" | **{r['eager'] / r['step-auto']:.2f}x** "
              f"| **{r[WAYS[-1]] / r['step-auto']:.3f}x** |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18", choices=CIFAR_MODELS)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--attack-steps", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_adversarial needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    w = make_workload(args.model, args.batch, "cuda")
    w.batches = [{"images": x, "labels": y} for x, y in w.batches]
    rows = []
    for k in args.attack_steps:
        built = {way: build(w, k, way) for way in WAYS}
        rows.append({"workload": f"{args.model} b{args.batch}",
                     "attack": "FGSM" if k == 1 else f"PGD-{k}",
                     **alternating_ms({way: (fn, w.batches) for way, fn in built.items()},
                                      rounds=args.rounds, steps=args.steps)})
        print(rows[-1], flush=True)
        for fn in built.values():
            if isinstance(fn, nt.Step):
                fn.close()
        del built
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per step, "
          f"median of {args.rounds} alternating rounds of {args.steps} steps")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
