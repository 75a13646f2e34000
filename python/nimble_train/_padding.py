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
"""

from __future__ import annotations

from typing import Any, Callable

import torch


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
