"""Flat buffers: a fused optimizer's parameters, gradients and state of one dtype, contiguous.

Each parameter is a segment of its dtype's flat buffers; ``p.data`` and ``p.grad`` become views
into them, so the update is one vectorised pass over memory, all-reduce buckets are slices of
the gradient buffer and zeroing gradients is one memset. The layout arithmetic (segment
offsets, slices of shards) is C++ (src/optim/flat_layout.h); this module holds the tensors.
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


def _dense(p: torch.Tensor) -> bool:
    """Non-overlapping and dense: the strides are a permutation of a contiguous layout's."""
    expected = 1
    for size, stride in sorted(zip(p.shape, p.stride()), key=lambda x: x[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def segment_like(seg: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A 1-d segment of a flat buffer viewed as `p` is laid out (channels_last kept)."""
    if p.is_contiguous() or not _dense(p):
        return seg.view(p.shape)
    return seg.as_strided(p.shape, p.stride())


@dataclass
class FlatBuffers:
    """The flat buffers of one dtype: params, grads and state, segments 256-byte aligned."""

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
    partials: torch.Tensor | None = None             # this buffer's rows of the stats partials

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
    partials: torch.Tensor | None = None

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
    per dtype: p.data and p.grad become views (values copied; a None gradient becomes zeros)."""
    by_dtype: dict[torch.dtype, FlatBuffers] = {}
    for index, (g, p) in enumerate(params):
        flat = by_dtype.setdefault(p.dtype, FlatBuffers(p.dtype))
        flat.params.append(p)
        flat.param_index.append(index)
        flat.groups.append(g)
    for flat in by_dtype.values():
        element_size = flat.params[0].element_size()
        flat.offsets = list(_C.flat_segment_offsets([p.numel() for p in flat.params],
                                                    element_size, shard_world))
        total = flat.offsets[-1]
        # Zeros in the padding stay zeros: a zero parameter with a zero gradient and zero state
        # has a zero update in every algorithm, so the padding never changes norms.
        flat.param = torch.zeros(total, dtype=flat.dtype, device=device)
        flat.grad = torch.zeros_like(flat.param)
        flat.state = {key: torch.zeros_like(flat.param) for key in state_keys}
        for i, p in enumerate(flat.params):
            view = flat.segment(flat.param, i)
            view.copy_(p.detach())
            p.data = view
            grad = flat.segment(flat.grad, i)
            if p.grad is not None:
                grad.copy_(p.grad)
            p.grad = grad
            flat.grad_views.append(grad)
        flat.chunks, flat.first_chunk = chunk_table(flat.offsets, flat.groups, chunk_elems, device)
        if lamb:
            flat.chunk_norms = torch.zeros(flat.chunks.shape[0], 2, device=device)
            flat.trust = torch.zeros(len(flat.params), device=device)
    return list(by_dtype.values())


def chunk_table(offsets: list[int], groups: list[int], chunk_elems: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk table of segments at `offsets` (of param groups `groups`), on `device`."""
    chunks, first = _C.optim_build_chunk_table(torch.tensor(offsets, dtype=torch.int64),
                                               torch.tensor(groups, dtype=torch.int64),
                                               chunk_elems)
    return chunks.to(device), first.to(device)


def assign_partials(targets: list, device: torch.device) -> torch.Tensor:
    """One float32 [rows, 2] buffer for the grad-stats partials of every target (FlatBuffers or
    Piece); each target gets its rows as `.partials`. Returns the whole buffer."""
    rows = [_C.optim_grad_stats_rows(t.grad.numel()) for t in targets]
    partials = torch.zeros(sum(rows), 2, device=device)
    first = 0
    for t, n in zip(targets, rows):
        t.partials = partials[first: first + n]
        first += n
    return partials


def cut_pieces(flats: list[FlatBuffers], slices, chunk_elems: int,
               device: torch.device) -> list[Piece]:
    """This rank's Pieces: slices (dtype, start, stop, range_start, range_count) of the flat
    buffers, each with a copy of its part of the state and a chunk table of its own."""
    by_dtype = {f.dtype: f for f in flats}
    pieces = []
    for dtype, start, stop, range_start, range_count in slices:
        flat = by_dtype[dtype]
        members, local = _C.slice_segments(flat.offsets, start, stop,
                                           flat.param.element_size())
        chunks, _ = chunk_table(list(local), [flat.groups[i] for i in members], chunk_elems,
                                device)
        piece = Piece(flat, start, stop, (range_start, range_count), chunks=chunks)
        piece.state = {key: buf[start:stop].clone() for key, buf in flat.state.items()}
        pieces.append(piece)
    return pieces


def run_updates(algorithm: str, targets: list, tables) -> None:
    """Launches the fused update over each target (FlatBuffers, or a sharded Piece of them),
    after prepare_step has filled the tables."""
    hyper, control = tables.hyper, tables.control
    for t in targets:
        s = t.state
        if algorithm == "sgd":
            _C.optim_sgd_update_(t.param, t.grad, s.get("momentum_buffer"), t.chunks, hyper,
                                 control)
        elif algorithm == "adam":
            _C.optim_adam_update_(t.param, t.grad, s["exp_avg"], s["exp_avg_sq"],
                                  s.get("max_exp_avg_sq"), t.chunks, hyper, control)
        else:
            _C.optim_lamb_update_(t.param, t.grad, s["exp_avg"], s["exp_avg_sq"], t.chunks,
                                  t.first_chunk, hyper, control, t.chunk_norms, t.trust)
