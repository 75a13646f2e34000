"""Flat buffers: a fused optimizer's parameters, gradients and state of one dtype, contiguous.

Each parameter is a segment of its dtype's flat buffers; ``p.data`` and ``p.grad`` become views
into them, so the update is one vectorised pass over memory, all-reduce buckets are slices of
the gradient buffer and zeroing gradients is one memset. Building the buffers and the layout
arithmetic are C++ (src/optim/fused_step.h, flat_layout.h), shared with the LibTorch Step;
this module keeps the Python view of them and the shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._extension import _C

STATE_KEYS = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "lamb": ("exp_avg", "exp_avg_sq"),
}


def segment_like(seg: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A 1-d segment of a flat buffer viewed as `p` is laid out (channels_last kept)."""
    if p.is_contiguous() or not _dense(p):
        return seg.view(p.shape)
    return seg.as_strided(p.shape, p.stride())


def _dense(p: torch.Tensor) -> bool:
    """Non-overlapping and dense: the strides are a permutation of a contiguous layout's."""
    expected = 1
    for size, stride in sorted(zip(p.shape, p.stride()), key=lambda x: x[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@dataclass
class FlatBuffers:
    """The flat buffers of one dtype: params, grads and state, segments 256-byte aligned.

    `core` is the C++ object (src/optim/fused_step.h) that built them; the fields are its
    tensors, with the state by torch's names."""

    core: object                                      # _C.FlatTensors
    dtype: torch.dtype
    params: list = field(default_factory=list)       # the parameters, in flat order
    param_index: list = field(default_factory=list)  # index of each into the optimizer's params
    groups: list = field(default_factory=list)       # param group of each parameter
    offsets: list = field(default_factory=list)      # [num_tensors + 1], elements
    param: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    state: dict = field(default_factory=dict)        # state key -> flat buffer
    grad_views: list = field(default_factory=list)
    chunks: torch.Tensor | None = None
    first_chunk: torch.Tensor | None = None
    chunk_norms: torch.Tensor | None = None          # LAMB scratch
    trust: torch.Tensor | None = None                # LAMB scratch

    def segment(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's view of `flat`, laid out as the parameter is: a channels_last weight keeps
        its strides, so convolutions see the memory format (and cuDNN the algorithms) they had
        before. Parameter, gradient and state share the layout, so the update stays
        elementwise over the segment."""
        p = self.params[i]
        return segment_like(flat[self.offsets[i]: self.offsets[i] + p.numel()], p)


@dataclass
class Piece:
    """A sharded optimizer's slice [start, stop) of one dtype's flat buffers: this rank updates
    it, with state buffers of its own (the rest of the state lives on the other ranks)."""

    flat: FlatBuffers
    start: int
    stop: int
    gathered_from: tuple[int, int]  # the range whose all-gather brings the other ranks' parts
    state: dict = field(default_factory=dict)  # state key -> buffer of stop - start elements
    chunks: torch.Tensor | None = None
    first_chunk: torch.Tensor | None = None
    members: list = field(default_factory=list)  # the flat's segments the slice touches

    @property
    def param(self) -> torch.Tensor:
        return self.flat.param[self.start: self.stop]

    @property
    def grad(self) -> torch.Tensor:
        return self.flat.grad[self.start: self.stop]


def build_flat_buffers(params: list[tuple[int, torch.Tensor]], state_keys: list[str], *,
                       device: torch.device, shard_world: int, chunk_elems: int,
                       lamb: bool) -> list[FlatBuffers]:
    """Moves `params` ((group, parameter) pairs, in the optimizer's order) into flat buffers
    per dtype: p.data and p.grad become views (values copied; a None gradient becomes zeros).
    The work is C++'s (the LibTorch Step builds its buffers the same way)."""
    flats = []
    for core in _C.optim_build_flat_buffers(params, len(state_keys), device, shard_world,
                                            chunk_elems, lamb):
        flats.append(FlatBuffers(
            core, core.param.dtype, list(core.params), list(core.param_index),
            list(core.groups), list(core.offsets), core.param, core.grad,
            dict(zip(state_keys, core.state)), list(core.grad_views), core.chunks,
            core.first_chunk, core.chunk_norms, core.trust))
    for _, p in params:
        setattr(p, IN_FLAT_BUFFERS, True)  # for own_storage(), should it be left out later
    return flats


# Marks a parameter that has been in flat buffers: its data, gradient and state are (or were)
# views of them.
IN_FLAT_BUFFERS = "_nimble_train_flat"


def own_storage(params: list[torch.Tensor], state) -> None:
    """Parameters left out of new flat buffers (frozen since, or without a gradient) that were
    in earlier ones (an earlier fused optimizer's: a Step built anew for a new set of trainable
    parameters replaces its buffers) get copies of their data, gradient and state, so that the
    earlier buffers are freed with the last views the new set leaves them."""
    def owned(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            return t.clone()  # a dense view: clone keeps its strides (channels-last)
        return t
    with torch.no_grad():
        for p in params:
            if not getattr(p, IN_FLAT_BUFFERS, False):
                continue
            data = p.data
            copy = owned(data)
            if copy is not data:
                p.data = copy
            if p.grad is not None:
                p.grad = owned(p.grad)
            kept = state.get(p, {})
            for key, value in kept.items():
                if isinstance(value, torch.Tensor):
                    kept[key] = owned(value)
            delattr(p, IN_FLAT_BUFFERS)


def chunk_table(offsets: list[int], groups: list[int], chunk_elems: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk table of segments at `offsets` (of param groups `groups`), on `device`."""
    chunks, first = _C.optim_build_chunk_table(torch.tensor(offsets, dtype=torch.int64),
                                               torch.tensor(groups, dtype=torch.int64),
                                               chunk_elems)
    return chunks.to(device), first.to(device)


def update_targets(targets: list, state_keys: list[str], device: torch.device,
                   lamb: bool = False, sharded: bool = False) -> tuple[torch.Tensor, list]:
    """The C++ update targets (_C.UpdateTarget) of FlatBuffers or Pieces, and one float32
    [rows, 2] buffer for the gradient statistics of them all: (partials, targets).

    `lamb`: each Piece gets its own scratch for LAMB's norms. `sharded` (the Pieces of a sharded
    LAMB, which hold parts of tensors): also, shared by them all, one row per tensor of every
    flat buffer, where the ranks' parts of a tensor's norms are added before its trust ratio,
    and each Piece's view of the rows of its bucket's tensors (src/optim/fused_step.h)."""
    first_row: dict[int, int] = {}  # sharded LAMB: id of a flat buffer -> its first tensor's row
    rows = 0
    if lamb and sharded:
        for t in targets:
            if isinstance(t, Piece) and id(t.flat) not in first_row:
                first_row[id(t.flat)] = rows
                rows += len(t.flat.params)
    global_sums = torch.zeros(rows, 2, dtype=torch.float32, device=device) if rows else None
    made = []
    for t in targets:
        if isinstance(t, FlatBuffers):
            made.append(_C.optim_target_of(t.core))
            continue
        extra = {}
        if lamb:
            k = len(t.members)
            extra = dict(first_chunk=t.first_chunk,
                         chunk_norms=torch.zeros(t.chunks.shape[0], 2, dtype=torch.float32,
                                                 device=device),
                         trust=torch.zeros(k, dtype=torch.float32, device=device))
        if global_sums is not None:
            first = first_row[id(t.flat)]
            range_start, range_count = t.gathered_from
            bucket, _ = _C.slice_segments(t.flat.offsets, range_start, range_start + range_count,
                                          t.flat.param.element_size())
            extra.update(
                tensor_rows=torch.tensor([first + i for i in t.members], dtype=torch.int64,
                                         device=device),
                tensor_sums=torch.zeros(k, 2, dtype=torch.float32, device=device),
                global_sums=global_sums,
                range_sums=global_sums[first + bucket[0]: first + bucket[-1] + 1])
        made.append(_C.UpdateTarget(param=t.param, grad=t.grad,
                                    state=[t.state[key] for key in state_keys],
                                    chunks=t.chunks, **extra))
    return _C.optim_assign_partials(made, device)


def cut_pieces(flats: list[FlatBuffers], slices, chunk_elems: int,
               device: torch.device, copy_state: bool = True) -> list[Piece]:
    """This rank's Pieces: slices (dtype, start, stop, range_start, range_count) of the flat
    buffers, each with a copy of its part of the state (`copy_state`; else views of the flat
    state buffers) and a chunk table of its own."""
    by_dtype = {f.dtype: f for f in flats}
    pieces = []
    for dtype, start, stop, range_start, range_count in slices:
        flat = by_dtype[dtype]
        members, local = _C.slice_segments(flat.offsets, start, stop,
                                           flat.param.element_size())
        chunks, first = chunk_table(list(local), [flat.groups[i] for i in members],
                                    chunk_elems, device)
        piece = Piece(flat, start, stop, (range_start, range_count), chunks=chunks,
                      first_chunk=first, members=list(members))
        piece.state = {key: buf[start:stop].clone() if copy_state else buf[start:stop]
                       for key, buf in flat.state.items()}
        pieces.append(piece)
    return pieces
