"""The optimizer's state in torch's format (``optimizer.state[p]``) over the flat buffers.

``optimizer.state[p][key]`` tensors are views into the flat state buffers, and each ``step``
count a view into the per-parameter step table the update kernels advance: the model, the
optimizer, ``state_dict()`` and ``load_state_dict()`` keep working in PyTorch's format.

Sharded (ZeRO-1), a rank keeps only its slices (Pieces) of the state: ``optimizer.state`` then
holds the step counts alone, until ``consolidate`` gathers whole copies back for a checkpoint.
"""

from __future__ import annotations

from typing import Callable

import torch

from ._flat import FlatBuffers, Piece
from ._hyper import HYPER


class FlatState:
    """Keeps ``optimizer.state`` and the flat buffers (or this rank's shards of them) in step."""

    def __init__(self, optimizer: torch.optim.Optimizer, flats: list[FlatBuffers],
                 algorithm: str, state_keys: list[str], momentum_on: list[bool], tables):
        self.optimizer, self.flats, self.algorithm = optimizer, flats, algorithm
        self.keys, self.momentum_on, self.tables = state_keys, momentum_on, tables
        self.pieces: list[Piece] | None = None
        self.released = False      # sharded: optimizer.state holds no state tensors
        self.consolidated = False  # sharded: whole-state copies until the next step

    def _keeps_state(self, group: int) -> bool:
        return not (self.algorithm == "sgd" and not self.momentum_on[group])

    def refresh(self) -> None:
        """Copies ``optimizer.state`` into the flat buffers and points it back at them."""
        if self.pieces is not None:
            if self.released:
                return  # the shards hold the state; optimizer.state keeps the step counts
            for flat in self.flats:  # whole buffers for the copy; then only the slices stay
                flat.state = {key: torch.zeros_like(flat.param) for key in self.keys}
        group_steps: list[set] = [set() for _ in self.optimizer.param_groups]
        steps = self.tables.param_steps
        has_step = self.algorithm in ("adam", "lamb")
        for flat in self.flats:
            for i, p in enumerate(flat.params):
                g = flat.groups[i]
                state = self.optimizer.state[p]
                if not self._keeps_state(g):
                    if not state:  # torch keeps no state for SGD without momentum
                        del self.optimizer.state[p]
                    continue
                if self.algorithm == "sgd":
                    group_steps[g].add(1.0 if state.get("momentum_buffer") is not None else 0.0)
                for key, buffer in flat.state.items():
                    view = flat.segment(buffer, i)
                    old = state.get(key)
                    if old is None:
                        view.zero_()
                    elif old.data_ptr() != view.data_ptr():
                        view.copy_(old)
                    state[key] = view
                if has_step:
                    old = state.get("step")
                    group_steps[g].add(float(old) if old is not None else 0.0)
                    state["step"] = steps[flat.param_index[i]]
        self._load_steps(group_steps)
        if self.pieces is not None:
            for piece in self.pieces:
                for key, buffer in piece.flat.state.items():
                    piece.state[key].copy_(buffer[piece.start: piece.stop])
            self.release_whole()

    def _load_steps(self, group_steps: list[set]) -> None:
        values = []
        for g, seen in enumerate(group_steps):
            if len(seen) > 1:
                raise ValueError(
                    f"FusedOptimizer: the parameters of param_groups[{g}] have different step "
                    f"counts ({sorted(seen)}) in the loaded state; the fused update keeps one step "
                    "count per group. Put parameters with different histories in different groups.")
            values.append(seen.pop() if seen else 0.0)
        self.tables.hyper[:, HYPER["step"]].copy_(torch.tensor(values, dtype=torch.float32))
        self.tables.param_steps.copy_(
            torch.tensor(values, dtype=torch.float32)[self.tables.param_group.cpu()])

    def shard(self, pieces: list[Piece]) -> None:
        """Keeps only `pieces` (this rank's slices, state copied in) of the state."""
        self.pieces = pieces
        self.release_whole()

    def consolidate(self, gather: Callable[[torch.Tensor, int, int], None]) -> None:
        """Sharded: whole copies of the state back into ``optimizer.state`` until the next
        step; every rank calls it (``gather`` all-gathers a range of a flat buffer)."""
        if self.pieces is None:
            return
        for flat in self.flats:
            flat.state = {key: torch.zeros_like(flat.param) for key in self.keys}
        for piece in self.pieces:
            for key, buffer in piece.state.items():
                piece.flat.state[key][piece.start: piece.stop].copy_(buffer)
                gather(piece.flat.state[key], *piece.gathered_from)
        for flat in self.flats:
            for i, p in enumerate(flat.params):
                if not self._keeps_state(flat.groups[i]):
                    continue
                state = self.optimizer.state[p]
                for key, buffer in flat.state.items():
                    state[key] = flat.segment(buffer, i)
        self.released = False
        self.consolidated = True

    def release_whole(self) -> None:
        """Sharded: drops the whole-state buffers and their views in optimizer.state."""
        for flat in self.flats:
            flat.state = {}
            for p in flat.params:
                state = self.optimizer.state.get(p)
                for key in self.keys:
                    if state:
                        state.pop(key, None)
        self.released = True
        self.consolidated = False

    def before_update(self) -> None:
        """A step moves the shards on: whole-state copies would go stale."""
        if self.consolidated:
            self.release_whole()

    def check_whole(self) -> None:
        """Raises when optimizer.state_dict() would lose the other ranks' shards."""
        if self.pieces is not None and self.released:
            raise RuntimeError(
                "the optimizer's state is sharded across the ranks (nt.Step(..., "
                "shard_optimizer=True)): this rank holds 1/N of it, so optimizer.state_dict() "
                "would lose the rest. Call step.consolidate_optimizer_state() on every rank "
                "first; until the next step, optimizer.state_dict() then returns the whole state.")

    def on_load(self) -> None:
        self.released = False  # load_state_dict put whole state tensors back
        self.refresh()

    @property
    def bytes(self) -> int:
        """Bytes of state this process holds (sharded: its slices, plus whole copies while
        consolidated)."""
        tensors = [t for f in self.flats for t in f.state.values()]
        tensors += [t for piece in self.pieces or [] for t in piece.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
