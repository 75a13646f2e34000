"""Gradient accumulation's window: K calls per optimizer update, and what each call stages.

The first call of a window zeroes the gradients, the last all-reduces, clips and updates; the
calls between only add to the gradients. Each micro-batch's loss is weighted so that the update
sees every sample of the window with the same weight, 1 / the window's samples (per-sample
losses), which with full micro-batches is the plain loop's ``(loss / K).backward()``:

    call i's loss weight      w_i = n_i / (K * B)        (n_i its valid samples, B the batch)
    the update's correction   c   = K * B / sum(n_i)     (1 when every micro-batch is full)

The weight is known when the call is made; the correction only at the window's last call, so
the update multiplies the accumulated gradients by it (inside the fused update's gradient
factor: no extra pass). A scalar loss (Step cannot know what it averages over) is weighted
1/K, as the plain loop does.

A caller may end a window early (``step(batch, update=True)``: the epoch's last micro-batches,
fewer than K) and give a call's loss weight itself (``loss_weight=``: a loop that scales its
loss, as transformers.Trainer does by the window's label count); the correction is then 1.
"""

from __future__ import annotations

import math


class Window:
    """Where the next call falls in its window of `k` calls."""

    def __init__(self, k: int):
        self.k = k
        self.micro = 0       # the next call's place in the window
        self.samples = 0     # valid samples of the window's calls so far
        self.stepped = False  # whether the last call completed a window (updated)
        self.ends = False    # the current call ends its window early (update=True)
        self.weight: float | None = None  # the current call's loss weight, given by the caller

    def set_call(self, update: bool | None, loss_weight: float | None) -> None:
        """What the caller says of the current call (Step.__call__'s keywords), checked."""
        if update is False and self.micro == self.k - 1:
            raise ValueError(
                f"update=False on the call that completes a window of accumulate={self.k} "
                "calls; a window holds at most `accumulate` micro-batches (build the Step with "
                "a larger accumulate, or pass update=None)")
        if loss_weight is not None:
            if not isinstance(loss_weight, (int, float)) or isinstance(loss_weight, bool):
                raise TypeError(f"loss_weight must be a float or None; got "
                                f"{type(loss_weight).__name__}")
            loss_weight = float(loss_weight)
            if not math.isfinite(loss_weight):
                raise ValueError(f"loss_weight must be a finite number; got {loss_weight!r} "
                                 "(nothing was run for this call)")
            if self.k == 1 and loss_weight != 1.0:
                raise ValueError(
                    f"loss_weight={loss_weight!r} needs accumulate > 1 (the weight is staged "
                    "with the accumulation scales); scale the loss in loss_fn instead")
        self.ends = update is True
        self.weight = loss_weight

    def kind(self, micro: int | None = None) -> tuple[bool, bool]:
        """(zero, update) of the next call (or of the call at place `micro`)."""
        if micro is None:
            return self.micro == 0, self.micro == self.k - 1 or self.ends
        return micro == 0, micro == self.k - 1

    def scales(self, samples: int, batch_size: int, per_sample: bool | None) -> tuple[float, float]:
        """The next call's loss weight and gradient correction (see the module's note)."""
        if self.weight is not None:
            return self.weight, 1.0
        if per_sample is False:
            return 1.0 / self.k, 1.0
        last = self.micro == self.k - 1 or self.ends
        scale = self.k * batch_size
        return samples / scale, (scale / (self.samples + samples) if last else 1.0)

    def advance(self, samples: int) -> bool:
        """The next call completed with `samples` valid samples; True when it updated."""
        self.micro += 1
        if self.micro < self.k and not self.ends:
            self.samples += samples
            self.stepped = False
            return False
        self.micro = 0
        self.samples = 0
        self.stepped = True
        return True
