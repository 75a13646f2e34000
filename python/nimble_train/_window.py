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
"""

from __future__ import annotations


class Window:
    """Where the next call falls in its window of `k` calls."""

    def __init__(self, k: int):
        self.k = k
        self.micro = 0       # the next call's place in the window
        self.samples = 0     # valid samples of the window's calls so far
        self.stepped = False  # whether the last call completed a window (updated)

    def kind(self, micro: int | None = None) -> tuple[bool, bool]:
        """(zero, update) of the next call (or of the call at place `micro`)."""
        micro = self.micro if micro is None else micro
        return micro == 0, micro == self.k - 1

    def scales(self, samples: int, batch_size: int, per_sample: bool | None) -> tuple[float, float]:
        """The next call's loss weight and gradient correction (see the module's note)."""
        if per_sample is False:
            return 1.0 / self.k, 1.0
        last = self.micro == self.k - 1
        scale = self.k * batch_size
        return samples / scale, (scale / (self.samples + samples) if last else 1.0)

    def advance(self, samples: int) -> bool:
        """The next call completed with `samples` valid samples; True when it updated."""
        self.micro += 1
        if self.micro < self.k:
            self.samples += samples
            self.stepped = False
            return False
        self.micro = 0
        self.samples = 0
        self.stepped = True
        return True
