"""Padding that proves itself: before the first padded step, a check that the model treats its
samples independently, so that padding a short batch cannot change the real samples' losses.

A padded step computes the loss of the real rows of a batch filled up with padding rows. That
equals the eager step on the real rows only when no layer mixes samples: BatchNorm is known to
(and is refused up front), but so do in-batch-negative losses, layers that centre over the
batch, attention across the batch. Rather than list them, the step measures once: the short
batch is padded twice, with different contents (copies of the first real sample; copies of the
last, floating-point values scaled and shifted), and both go through the model's forward and
the loss with the same random numbers (dropout draws the same masks) and autograd off. When the
real rows' per-sample losses differ, the model mixes samples and short batches run eagerly.
Buffers the forward may update (running statistics of custom layers) and the random number
generators are restored afterwards: the check leaves no trace in the training.

What holds with dropout: a padded step draws masks for the padded shape, so the real rows get
masks of the same distribution, independent of the padding's contents, but not the numbers an
eager step on the unpadded batch would draw.

Shape buckets pad along the sequence (nt.Buckets): exact only where the model and the loss
ignore the padded positions (labels -100, attention mask 0). The first padded batch is checked
once (bucket_padding_check): its per-sample losses with the padding and without it, in eval mode
(dropout off) and autograd off, buffers and random number generators restored after. A training
step's BatchNorm (and InstanceNorm) layers stay in training mode for it: their batch statistics,
over the padded positions where they normalise along the padded dimension, are what a padded
step trains with.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from . import _torch_private
from .errors import ShapeError, one_line


def mixing_reason(forward_losses: Callable[[Any], torch.Tensor], model: torch.nn.Module,
                  template, tensors: list[torch.Tensor], samples: int) -> str | None:
    """Why padding this model's short batches is unsafe (its real rows' losses depend on the
    padding's contents), or None. `forward_losses(batch)` gives the per-sample losses."""
    size = template.batch_size
    leaves = template.tensor_leaves
    first = _padded(leaves, tensors, samples, size, lambda real: real[:1], vary=False)
    other = _padded(leaves, tensors, samples, size, lambda real: real[samples - 1: samples],
                    vary=True)
    device = next((t.device for t in tensors if t.device.type == "cuda"), None)
    buffers = [b.detach().clone() for b in model.buffers()]
    losses = []
    try:
        for padded in (first, other):
            with torch.random.fork_rng(devices=[device] if device is not None else []), \
                    torch.no_grad():
                losses.append(forward_losses(template.unflatten(padded))[:samples].float())
    finally:
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
    a, b = losses
    if torch.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True):
        return None
    gap = (a - b).abs().nan_to_num(0.0).max().item()
    return (f"the model mixes samples: the real rows' losses moved by up to {gap:.3g} when the "
            "padding rows' contents changed (an in-batch loss, a layer over the batch "
            "dimension); short batches run eagerly, exactly")


def _padded(leaves, tensors, samples, size, filler, vary: bool) -> list[torch.Tensor]:
    out = []
    for leaf, t in zip(leaves, tensors):
        if not leaf.batched:
            out.append(t)
            continue
        real = t[:samples]
        pad = filler(real).expand(size - samples, *t.shape[1:])
        if vary and pad.is_floating_point():
            pad = pad * 3.0 + 1.0
        out.append(torch.cat([real, pad.to(t.dtype)]))
    return out


class BucketPadding:
    """The padding check of a Step or an evaluator: run at the first batch its bucket pads, its
    verdict kept. `verdict`: None until then, "exact", "unchecked: why" or "refused: why";
    `settled`: a batch may be padded without the check (exact or unchecked). `who` names the
    caller in the refusal, `why` says what the padding would do and `fix` how to avoid it."""

    def __init__(self, buckets, who: str, why: str, fix: str, what: str = "its losses",
                 training: bool = False):
        self.verdict = None if buckets.exact else "unchecked: nt.Buckets(exact=False)"
        self.settled = not buckets.exact
        self.who, self.why, self.fix, self.what = who, why, fix, what
        self.training = training  # a training step's check: BatchNorm keeps batch statistics

    def check(self, run: Callable[[Any], Any], model: torch.nn.Module, layout,
              tensors: list[torch.Tensor], bucket: int, autocast: bool) -> None:
        """Checks the batch once, if its bucket pads it; raises ShapeError, before anything
        runs, at this batch and every later padded one, where the padding changes `run`'s
        outputs."""
        length, size = tensors[layout.lead].shape[layout.buckets.dim], layout.sizes[bucket]
        if length == size:
            return  # nothing padded
        if self.verdict is None:
            verdict, differs = bucket_padding_check(run, model, layout, tensors, bucket,
                                                    autocast, self.what, self.training)
            self.verdict = verdict if differs is None else (
                f"refused: padding a batch of length {length} to its bucket's {size} changed "
                f"it: {differs}")
            self.settled = differs is None
        if not self.settled:
            raise ShapeError(
                f"{self.who}: {self.verdict[len('refused: '):]}. {self.why} Pad values used: "
                f"{layout.pad_values_said()} (0 where nt.Buckets(pad_values=...) names none). "
                f"{self.fix} Nothing was run for this call.")


def bucket_padding_check(run: Callable[[Any], Any], model: torch.nn.Module, layout,
                         tensors: list[torch.Tensor], bucket: int, autocast: bool,
                         what: str = "its losses",
                         training: bool = False) -> tuple[str, str | None]:
    """Whether padding this batch to its bucket leaves what `run(batch)` gives (the per-sample
    losses, or an evaluator's tensor or dict of tensors) as it is: ("exact", None),
    ("unchecked: why", None) where no comparison can be made, or ("differs", what differs)
    where it moves (`what`: what run gives, for the message). The runs are made in eval mode
    with autograd off; with `training` (a training step's run) BatchNorm layers in training
    mode keep it: their batch statistics are what the padded step trains with."""
    if _torch_private.has_compiled_modules(model):
        return ("unchecked: a compiled model (the check would compile it again for the "
                "unpadded batch's shapes)"), None
    batch_norms = _training_batch_norms(model) if training else []
    if any(isinstance(m, torch.nn.SyncBatchNorm) for m in batch_norms) and \
            torch.distributed.is_available() and torch.distributed.is_initialized():
        return ("unchecked: SyncBatchNorm layers in training gather their batch statistics "
                "over the ranks, which a check on one rank cannot run"), None

    template = layout.template
    padded = layout.padded(tensors, bucket)
    device = next((t.device for t in tensors if t.device.type == "cuda"), None)
    devices = [device] if device is not None else []
    buffers = [b.detach().clone() for b in model.buffers()]
    runs = []
    try:
        with _checking_modes(model, batch_norms), torch.no_grad():
            for batch, other_numbers in ((tensors, False), (tensors, True), (padded, False)):
                with torch.random.fork_rng(devices=devices):
                    if other_numbers:  # what draws random numbers moves with them
                        torch.rand(1)
                        if device is not None:
                            torch.rand(1, device=device)
                    runs.append(_named_tensors(run(template.unflatten(batch))))
    except Exception as error:  # noqa: BLE001 - an eval-mode forward may not fit the loss
        return (f"unchecked: the forward in eval mode raised {type(error).__name__}: "
                f"{one_line(error)}"), None
    finally:
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
    plain, again, with_padding = runs
    if any(not torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(plain.values(),
                                                                          again.values())):
        return "unchecked: the forward or the loss draws random numbers in eval mode", None
    shapes = {k: tuple(v.shape) for k, v in plain.items()}
    padded_shapes = {k: tuple(v.shape) for k, v in with_padding.items()}
    if shapes != padded_shapes:
        return (f"unchecked: the outputs have shapes {_said(shapes)} without the padding and "
                f"{_said(padded_shapes)} with it"), None
    tolerance = 2e-2 if autocast else 1e-3  # relative, and to the output's largest value
    for key, a in plain.items():
        b = with_padding[key]
        scale = a.abs().nan_to_num(0.0, 0.0, 0.0).max().item() if a.numel() else 0.0
        if torch.allclose(a, b, rtol=tolerance, atol=tolerance * scale + 1e-12,
                          equal_nan=True):
            continue
        gap = (a - b).abs().nan_to_num(float("inf"))
        worst = int(gap.flatten().argmax())
        where = ((f"sample {worst}: " if not key else f"at {worst}: ") if a.dim() else "")
        subject = what if not key else f"{what} {key!r}"
        return "differs", (f"{subject} moved by up to {gap.max().item():.3g} ({where}"
                           f"{a.flatten()[worst].item():.6g} without the padding, "
                           f"{b.flatten()[worst].item():.6g} with it)")
    return "exact", None


def _training_batch_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The normalisation layers in training mode (BatchNorm*, InstanceNorm*, SyncBatchNorm): in
    it they normalise with the batch's statistics, in eval mode with running ones if kept."""
    _, norm_base = _torch_private.batch_statistics_layers()
    return [m for m in model.modules() if isinstance(m, norm_base) and m.training]


@contextlib.contextmanager
def _checking_modes(model: torch.nn.Module, batch_norms: list[torch.nn.Module]):
    """The model in eval mode (dropout draws nothing), but `batch_norms` in training mode;
    every module's own mode back after the block."""
    from ._evaluator import evaluating

    with evaluating(model):
        for m in batch_norms:
            m.training = True
        yield


def _named_tensors(out: Any) -> dict[str, torch.Tensor]:
    """A run's tensor, or dict of tensors, as float32 tensors by name ("" for a tensor)."""
    items = out.items() if isinstance(out, dict) else [("", out)]
    return {str(k): v.detach().float() for k, v in items}


def _said(shapes: dict) -> str:
    return ", ".join(f"{k} {v}" if k else str(v) for k, v in shapes.items())
