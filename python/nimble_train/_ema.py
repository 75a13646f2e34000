"""An exponential moving average of a model's weights, updated after every optimizer update.

``avg = avg + (1 - decay) * (p - avg)`` (``lerp``, as ``torch.optim.swa_utils``' EMA), for every
trainable parameter the optimizer holds and for every floating-point buffer (BatchNorm's running
statistics are averaged too, as timm's ModelEmaV2 and ``AveragedModel(use_buffers=True)`` do, so
the averaged weights come with statistics that were averaged alongside them); integer buffers
(``num_batches_tracked``) and parameters outside the optimizer are not averaged: the model's
own values stand for them. Once the fused optimizer holds the parameters in flat buffers, the
averages are views into flat buffers of the same layout and the update is one ``lerp_`` per
flat buffer: one pass over memory, captured in the step's graph.
"""

from __future__ import annotations

import contextlib

import torch

from .errors import NimbleError
from .optim._flat import segment_like


class EMA:
    """The moving averages of `params` (trainable, the optimizer's) and `model`'s buffers."""

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor], decay: float):
        self.model, self.decay = model, float(decay)
        seen: set[int] = set()
        self.params = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.buffers = [b for b in unique_tensors(model.buffers()) if b.is_floating_point()]
        with torch.no_grad():
            self.averages = [p.detach().clone() for p in self.params]
            self.buffer_averages = [b.detach().clone() for b in self.buffers]
        # After use_flat: (flat parameter buffer, its flat average) per dtype, and the
        # parameters outside the flat buffers (averaged one by one).
        self._flat: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._loose = list(range(len(self.params)))

    @property
    def nbytes(self) -> int:
        tensors = self.buffer_averages + ([avg for _, avg in self._flat]
                                          + [self.averages[i] for i in self._loose])
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ device work

    def update(self) -> None:
        """One step of the average (device work only: capturable, no host sync)."""
        weight = 1.0 - self.decay
        with torch.no_grad():
            for param, average in self._flat:
                average.lerp_(param, weight)
            if self._loose:
                torch._foreach_lerp_([self.averages[i] for i in self._loose],
                                     [self.params[i].detach() for i in self._loose], weight)
            if self.buffers:
                torch._foreach_lerp_(self.buffer_averages, self.buffers, weight)

    def use_flat(self, fused) -> None:
        """The parameters moved into the fused optimizer's flat buffers: the averages move
        into flat buffers of the same layout (padding stays zero: lerp of zeros is zero)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        flat_params = fused.flat_params
        placed = set()
        with torch.no_grad():
            for dtype, flat in flat_params.items():
                average = torch.zeros_like(flat)
                for p, offset, numel in fused.segments(dtype):
                    i = index.get(id(p))
                    if i is None:
                        continue
                    view = segment_like(average[offset: offset + numel], p)
                    view.copy_(self.averages[i])
                    self.averages[i] = view
                    placed.add(i)
                self._flat.append((flat, average))
        self._loose = [i for i in range(len(self.params)) if i not in placed]

    # ------------------------------------------------------------------ host side

    @contextlib.contextmanager
    def swapped_in(self):
        """The averages in the model's parameters and buffers, the trained values back after."""
        targets = self.params + self.buffers
        averages = self.averages + self.buffer_averages
        with torch.no_grad():
            saved = [t.detach().clone() for t in targets]
            for t, average in zip(targets, averages):
                t.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, value in zip(targets, saved):
                    t.copy_(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with the averages in place of what is averaged (copies)."""
        by_id = self._by_id()
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            average = by_id.get(id(t))
            out[name] = (average if average is not None else t).detach().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores the averages from ``state_dict()``'s format (a checkpoint)."""
        if not isinstance(state, dict):
            raise TypeError(f"load_ema_state_dict expects the dict ema_state_dict() returned; "
                            f"got {type(state).__name__}")
        by_id = self._by_id()
        names = self.model.state_dict(keep_vars=True)
        unexpected = sorted(set(state) - set(names))
        missing = sorted(name for name, t in names.items()
                         if id(t) in by_id and name not in state)
        if unexpected or missing:
            raise NimbleError(
                "load_ema_state_dict: the EMA state does not match this model: "
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}. Load a state saved "
                "by step.ema_state_dict() for the same model.")
        pending = []
        for name, t in names.items():
            average = by_id.get(id(t))
            if average is None:
                continue
            value = state[name]
            if not isinstance(value, torch.Tensor) or value.shape != average.shape:
                raise NimbleError(
                    f"load_ema_state_dict: {name} has shape {tuple(average.shape)} in this "
                    f"model; the state holds {getattr(value, 'shape', type(value).__name__)}. "
                    "Load a state saved by step.ema_state_dict() for the same model.")
            pending.append((average, value))
        with torch.no_grad():  # checked whole first: a bad state changes nothing
            for average, value in pending:
                average.copy_(value)

    def _by_id(self) -> dict[int, torch.Tensor]:
        pairs = zip(self.params + self.buffers, self.averages + self.buffer_averages)
        return {id(t): average for t, average in pairs}


def unique_tensors(tensors) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def check_decay(ema) -> None:
    if ema is None:
        return
    if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0.0 < ema < 1.0:
        raise ValueError(
            f"ema must be None or a decay strictly between 0 and 1 (e.g. 0.999: each update "
            f"moves the average 0.1% of the way to the weights); got {ema!r}")
