"""FusedOptimizer: a torch optimizer's update as one fused, capturable pass over flat buffers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .._extension import _C
from .lamb import LAMB

_LAYOUT = _C.optim_layout()
_HYPER = _LAYOUT["hyper"]
_CONTROL = _LAYOUT["control"]
_COUNTER = _LAYOUT["counter"]
_STAGED = _LAYOUT["staged_columns"]
_SLOT_HEADER = _LAYOUT["slot_header"]
_SEQ_MODULUS = _LAYOUT["seq_modulus"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STATE_KEYS = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "lamb": ("exp_avg", "exp_avg_sq"),
}


def _algorithm(optimizer) -> str | None:
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return "sgd"
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    if kind is LAMB:
        return "lamb"
    return None


def _dense(p: torch.Tensor) -> bool:
    """Non-overlapping and dense: the strides are a permutation of a contiguous layout's."""
    expected = 1
    for size, stride in sorted(zip(p.shape, p.stride()), key=lambda x: x[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _trainable(group, exclude: frozenset = frozenset()) -> list[torch.Tensor]:
    return [p for p in group["params"] if p.requires_grad and id(p) not in exclude]


@dataclass
class _Bucket:
    """The flat buffers of one dtype: params, grads and state, segments 16-byte aligned."""

    dtype: torch.dtype
    params: list = field(default_factory=list)       # the parameters, in flat order
    param_index: list = field(default_factory=list)  # index of each into the optimizer's params
    groups: list = field(default_factory=list)       # group of each parameter
    offsets: list = field(default_factory=lambda: [0])  # [num_tensors + 1], elements
    param: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    state: dict = field(default_factory=dict)        # state key -> flat buffer
    grad_views: list = field(default_factory=list)
    chunks: torch.Tensor | None = None
    first_chunk: torch.Tensor | None = None
    chunk_norms: torch.Tensor | None = None          # LAMB scratch
    trust: torch.Tensor | None = None                # LAMB scratch
    partials: torch.Tensor | None = None             # this bucket's rows of the stats partials

    def segment(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's view of `flat`, laid out as the parameter is: a channels_last weight keeps
        its strides, so convolutions see the memory format (and cuDNN the algorithms) they had
        before. Parameter, gradient and state share the layout, so the update stays
        elementwise over the segment."""
        p = self.params[i]
        seg = flat[self.offsets[i]: self.offsets[i] + p.numel()]
        if p.is_contiguous() or not _dense(p):
            return seg.view(p.shape)
        return seg.as_strided(p.shape, p.stride())


@dataclass
class _Piece:
    """A sharded optimizer's slice [start, stop) of one dtype's flat buffers: this rank updates
    it, with state buffers of its own (the rest of the state lives on the other ranks)."""

    bucket: _Bucket
    start: int
    stop: int
    gathered_from: tuple[int, int]  # the range whose all-gather brings the other ranks' parts
    state: dict = field(default_factory=dict)  # state key -> buffer of stop - start elements
    chunks: torch.Tensor | None = None
    partials: torch.Tensor | None = None

    @property
    def param(self) -> torch.Tensor:
        return self.bucket.param[self.start: self.stop]

    @property
    def grad(self) -> torch.Tensor:
        return self.bucket.grad[self.start: self.stop]


class FusedOptimizer:
    """Runs ``optimizer``'s update (``torch.optim.SGD``, ``Adam``, ``AdamW`` or
    ``nimble_train.optim.LAMB``) as fused kernels over flat buffers, capturable in a CUDA graph.

    Parameters, gradients and state of one dtype are moved into flat buffers; ``p.data``,
    ``p.grad`` and the optimizer's own ``state[p]`` tensors become views into them, so the model,
    ``optimizer.state_dict()`` and ``load_state_dict()`` (followed automatically by
    :meth:`refresh_state`) keep working in PyTorch's format. Parameters that do not require grad
    are left alone. Every parameter always has a gradient (zeros when unused), as with
    ``zero_grad(set_to_none=False)``.

    A step, eager::

        fused.zero_grad(); loss.backward(); fused.step()     # stages host values itself

    In a CUDA graph (capture once, replay many times)::

        with torch.cuda.graph(g):
            fused.zero_grad(); ...backward...; fused.step()
        for ...:
            scheduler.step()
            fused.stage_host_values()   # outside the graph, exactly once before each replay
            g.replay()

    Hyper-parameters are read from ``optimizer.param_groups`` by :meth:`stage_host_values`, so
    schedulers (and any edit of lr, betas, eps, weight_decay, momentum, dampening, nesterov,
    maximize) take effect without recapture. Changing ``amsgrad``, a momentum between zero and
    non-zero, or the set of parameters needs a new FusedOptimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, ring_slots: int = 16,
                 chunk_elems: int = _LAYOUT["default_chunk_elems"],
                 exclude: frozenset[int] = frozenset(), shard_world: int = 1):
        reason = self.why_unsupported(optimizer)
        if reason is not None:
            raise ValueError(f"FusedOptimizer cannot fuse this optimizer: {reason}. Use the "
                             "optimizer as it is (eager), or check why_unsupported() first.")
        if ring_slots < 2:
            raise ValueError(f"FusedOptimizer: ring_slots must be >= 2; got {ring_slots}")
        self.optimizer = optimizer
        self._algorithm = _algorithm(optimizer)
        groups = optimizer.param_groups
        self._amsgrad = self._algorithm == "adam" and bool(groups[0]["amsgrad"])
        self._momentum_on = [self._algorithm == "sgd" and group["momentum"] != 0
                             for group in groups]
        self._group_sizes = [len(group["params"]) for group in groups]
        self._shard_world = shard_world
        self._chunk_elems = chunk_elems
        self._pieces: list[_Piece] | None = None  # this rank's shards (see shard())
        self._state_released = False  # sharded: optimizer.state holds no state tensors
        self._consolidated = False    # sharded: whole-state copies until the next step
        self.reduce_partials: Callable[[torch.Tensor], None] | None = None
        # Parameters in `exclude` (by id) are left out, as torch.optim skips parameters that
        # never get a gradient: no update, no state (a captured step knows them from warm-up).
        params = [(g, p) for g, group in enumerate(groups) for p in _trainable(group, exclude)]
        self.device = params[0][1].device
        self._is_cuda = self.device.type == "cuda"
        self._build_buckets(params, chunk_elems)
        self._build_tables(len(groups), len(params), ring_slots)
        self._ring_slots = ring_slots
        self._events = [None] * ring_slots
        self._next_seq = 0       # sequence number of the next staged step
        self._pending = None     # seq staged but not yet consumed by an eager step
        self._unrecorded = None  # slot whose consuming step is enqueued but has no event yet
        self._captured = False
        self.refresh_state()
        optimizer.register_load_state_dict_post_hook(lambda _opt: self._on_load())
        optimizer.register_state_dict_pre_hook(lambda _opt: self._check_state_is_whole())

    # ------------------------------------------------------------------ support

    @staticmethod
    def why_unsupported(optimizer) -> str | None:
        """Why ``optimizer`` cannot be fused, or None when it can."""
        algorithm = _algorithm(optimizer)
        if algorithm is None:
            return (f"{type(optimizer).__module__}.{type(optimizer).__qualname__} is not "
                    "torch.optim.SGD, Adam, AdamW or nimble_train.optim.LAMB")
        params = [p for group in optimizer.param_groups for p in _trainable(group)]
        if not params:
            return "it has no parameters that require grad"
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            return f"its parameters are on several devices ({', '.join(devices)})"
        device = params[0].device
        if device.type not in ("cpu", "cuda"):
            return f"its parameters are on {device}; fused updates run on CPU or CUDA"
        if device.type == "cuda" and not _C.has_cuda():
            return "its parameters are on CUDA, but nimble_train was built without CUDA"
        for i, p in enumerate(params):
            if p.dtype not in _DTYPES:
                return (f"parameter {i} is {p.dtype}; fused updates take float32, float16 or "
                        "bfloat16 parameters")
            if p.is_sparse or (p.grad is not None and p.grad.is_sparse):
                return f"parameter {i} has a sparse gradient"
        for g, group in enumerate(optimizer.param_groups):
            if group.get("differentiable", False):
                return f"param_groups[{g}] has differentiable=True"
        if algorithm == "adam":
            amsgrad = {bool(group["amsgrad"]) for group in optimizer.param_groups}
            if len(amsgrad) > 1:
                return "amsgrad differs between parameter groups"
        return None

    # ------------------------------------------------------------------ building

    def _build_buckets(self, params, chunk_elems: int) -> None:
        by_dtype: dict[torch.dtype, _Bucket] = {}
        for index, (g, p) in enumerate(params):
            bucket = by_dtype.setdefault(p.dtype, _Bucket(p.dtype))
            bucket.params.append(p)
            bucket.param_index.append(index)
            bucket.groups.append(g)
            # Each segment starts on a 256-byte boundary: 16-byte loads everywhere, and cuDNN
            # sees a weight as aligned as the caching allocator's blocks (its algorithm cache
            # is keyed by pointer alignment; a less aligned weight misses it, and a miss inside
            # a graph capture cannot be benchmarked).
            # Sharded (shard_world > 1): every segment also splits into shard_world parts of
            # whole 16-byte vectors, so any run of whole segments does.
            align = math.lcm(256 // p.element_size(), self._shard_world * (16 // p.element_size()))
            bucket.offsets.append(bucket.offsets[-1] + -(-p.numel() // align) * align)
        self._buckets = list(by_dtype.values())
        keys = list(_STATE_KEYS[self._algorithm])
        if self._amsgrad:
            keys.append("max_exp_avg_sq")
        if self._algorithm == "sgd" and not any(self._momentum_on):
            keys = []
        self._state_keys = keys
        rows = 0
        for bucket in self._buckets:
            total = bucket.offsets[-1]
            # Zeros in the padding stay zeros: a zero parameter with a zero gradient and zero
            # state has a zero update in every algorithm, so the padding never changes norms.
            def flat():
                return torch.zeros(total, dtype=bucket.dtype, device=self.device)
            bucket.param, bucket.grad = flat(), flat()
            bucket.state = {key: flat() for key in keys}
            for i, p in enumerate(bucket.params):
                view = bucket.segment(bucket.param, i)
                view.copy_(p.detach())
                p.data = view
                grad = bucket.segment(bucket.grad, i)
                if p.grad is not None:
                    grad.copy_(p.grad)
                p.grad = grad
                bucket.grad_views.append(grad)
            offsets = torch.tensor(bucket.offsets, dtype=torch.int64)
            groups = torch.tensor(bucket.groups, dtype=torch.int64)
            chunks, first_chunk = _C.optim_build_chunk_table(offsets, groups, chunk_elems)
            bucket.chunks = chunks.to(self.device)
            bucket.first_chunk = first_chunk.to(self.device)
            if self._algorithm == "lamb":
                bucket.chunk_norms = torch.zeros(chunks.shape[0], 2, device=self.device)
                bucket.trust = torch.zeros(len(bucket.params), device=self.device)
            rows += _C.optim_grad_stats_rows(total)
        self._partials = torch.zeros(rows, 2, device=self.device)
        start = 0
        for bucket in self._buckets:
            n = _C.optim_grad_stats_rows(bucket.offsets[-1])
            bucket.partials = self._partials[start: start + n]
            start += n

    def _build_tables(self, num_groups: int, num_params: int, ring_slots: int) -> None:
        dev = self.device
        slot = _SLOT_HEADER + num_groups * _STAGED
        ring_host = torch.zeros(ring_slots, slot, pin_memory=self._is_cuda)
        param_group = torch.empty(num_params, dtype=torch.int64)
        for bucket in self._buckets:
            for index, g in zip(bucket.param_index, bucket.groups):
                param_group[index] = g
        self._tables = _C.OptimStepTables(
            ring_host=ring_host,
            ring=torch.zeros(ring_slots, slot, device=dev) if self._is_cuda else ring_host,
            hyper=torch.zeros(num_groups, _LAYOUT["hyper_columns"], device=dev),
            param_steps=torch.zeros(num_params, device=dev),
            param_group=param_group.to(dev),
            control=torch.zeros(_LAYOUT["control_size"], device=dev),
            counter=torch.zeros(_LAYOUT["counter_size"], dtype=torch.int64, device=dev))
        self._control = self._tables.control

    # ------------------------------------------------------------------ state

    def refresh_state(self) -> None:
        """Copies ``optimizer.state`` into the flat buffers and points it back at them.

        Runs at construction and after ``optimizer.load_state_dict`` (through a hook); call it
        after replacing state tensors by hand. Host-side work: call it outside a captured graph.
        """
        if self._pieces is not None:
            if self._state_released:
                return  # the shards hold the state; optimizer.state keeps the step counts
            # Whole buffers for the copy, then only this rank's slices are kept.
            for bucket in self._buckets:
                bucket.state = {key: torch.zeros_like(bucket.param) for key in self._state_keys}
        num_groups = len(self.optimizer.param_groups)
        group_steps: list[set] = [set() for _ in range(num_groups)]
        steps = self._tables.param_steps
        has_step = self._algorithm in ("adam", "lamb")
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                g = bucket.groups[i]
                state = self.optimizer.state[p]
                if self._algorithm == "sgd":
                    if not self._momentum_on[g]:
                        if not state:  # torch keeps no state for SGD without momentum
                            del self.optimizer.state[p]
                        continue
                    group_steps[g].add(1.0 if state.get("momentum_buffer") is not None else 0.0)
                for key, flat in bucket.state.items():
                    view = bucket.segment(flat, i)
                    old = state.get(key)
                    if old is None:
                        view.zero_()
                    elif old.data_ptr() != view.data_ptr():
                        view.copy_(old)
                    state[key] = view
                if has_step:
                    old = state.get("step")
                    group_steps[g].add(float(old) if old is not None else 0.0)
                    state["step"] = steps[bucket.param_index[i]]
        values = []
        for g, seen in enumerate(group_steps):
            if len(seen) > 1:
                raise ValueError(
                    f"FusedOptimizer: the parameters of param_groups[{g}] have different step "
                    f"counts ({sorted(seen)}) in the loaded state; the fused update keeps one step "
                    "count per group. Put parameters with different histories in different groups.")
            values.append(seen.pop() if seen else 0.0)
        hyper = self._tables.hyper
        hyper[:, _HYPER["step"]].copy_(torch.tensor(values, dtype=torch.float32))
        steps.copy_(torch.tensor(values, dtype=torch.float32)[self._tables.param_group.cpu()])
        if self._pieces is not None:
            for piece in self._pieces:
                for key, flat in piece.bucket.state.items():
                    piece.state[key].copy_(flat[piece.start: piece.stop])
            self._release_whole_state()

    def _on_load(self) -> None:
        self._state_released = False  # load_state_dict put whole state tensors back
        self.refresh_state()

    # ------------------------------------------------------------------ sharding (ZeRO-1)

    def shard(self, pieces: list[tuple[torch.dtype, int, int, int, int]]) -> None:
        """Keeps only these slices of the state: this rank's shards in a data-parallel job
        whose ranks each update one part of every all-reduce bucket (ZeRO stage 1).

        pieces: (dtype, start, stop, range_start, range_count) in the same order on every rank;
        [start, stop) is this rank's part of the flat buffers of `dtype`, and the all-gather of
        flat[range_start: range_start + range_count] brings the other ranks' parts. The state
        of the slices moves into buffers of their own and optimizer.state keeps only the step
        counts (see consolidate()). step() then updates the slices alone; the caller reduces
        the gradients into them before and all-gathers the parameters after, and sets
        `reduce_partials` (an in-place sum over the ranks) when step() computes gradient norms.
        Built with shard_world=N, every run of whole segments splits into N such slices.
        """
        if self._algorithm == "lamb":
            raise ValueError("FusedOptimizer.shard: LAMB's trust ratio needs each whole "
                             "parameter's norms, which a shard does not hold; shard SGD, Adam or "
                             "AdamW, or keep LAMB's state whole")
        if self._pieces is not None:
            raise RuntimeError("FusedOptimizer.shard: the state is sharded already")
        by_dtype = {b.dtype: b for b in self._buckets}
        shards = []
        for dtype, start, stop, range_start, range_count in pieces:
            bucket = by_dtype[dtype]
            vec = 16 // bucket.param.element_size()
            if not 0 <= start <= stop <= bucket.offsets[-1] or start % vec or stop % vec:
                raise ValueError(f"FusedOptimizer.shard: slice [{start}, {stop}) of the "
                                 f"{bucket.offsets[-1]} {dtype} elements is out of range or "
                                 "not cut at 16-byte vectors")
            offs = bucket.offsets
            members = [i for i in range(len(bucket.params))
                       if offs[i] < stop and offs[i + 1] > start]
            local = [max(offs[i], start) - start for i in members] + [stop - start]
            chunks, _ = _C.optim_build_chunk_table(
                torch.tensor(local, dtype=torch.int64),
                torch.tensor([bucket.groups[i] for i in members], dtype=torch.int64),
                self._chunk_elems)
            piece = _Piece(bucket, start, stop, (range_start, range_count),
                           chunks=chunks.to(self.device))
            piece.state = {key: flat[start:stop].clone() for key, flat in bucket.state.items()}
            shards.append(piece)
        rows = [_C.optim_grad_stats_rows(p.stop - p.start) for p in shards]
        self._partials = torch.zeros(sum(rows), 2, device=self.device)
        first = 0
        for piece, n in zip(shards, rows):
            piece.partials = self._partials[first: first + n]
            first += n
        self._pieces = shards
        self._release_whole_state()

    def consolidate(self, gather: Callable[[torch.Tensor, int, int], None]) -> None:
        """Sharded: puts the whole state back into ``optimizer.state`` (in torch's format, so
        ``optimizer.state_dict()`` works) until the next step. Every rank calls it:
        ``gather(flat, start, count)`` all-gathers flat[start: start + count] in place across the
        ranks. The tensors are copies: to change the state, use ``load_state_dict``."""
        if self._pieces is None:
            return
        for bucket in self._buckets:
            bucket.state = {key: torch.zeros_like(bucket.param) for key in self._state_keys}
        for piece in self._pieces:
            for key, buf in piece.state.items():
                piece.bucket.state[key][piece.start: piece.stop].copy_(buf)
                gather(piece.bucket.state[key], *piece.gathered_from)
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                if self._algorithm == "sgd" and not self._momentum_on[bucket.groups[i]]:
                    continue
                state = self.optimizer.state[p]
                for key, flat in bucket.state.items():
                    state[key] = bucket.segment(flat, i)
        self._state_released = False
        self._consolidated = True

    def _release_whole_state(self) -> None:
        """Sharded: drops the whole-state buffers and their views in optimizer.state."""
        for bucket in self._buckets:
            bucket.state = {}
            for p in bucket.params:
                state = self.optimizer.state.get(p)
                for key in self._state_keys:
                    if state:
                        state.pop(key, None)
        self._state_released = True
        self._consolidated = False

    def _check_state_is_whole(self) -> None:
        if self._pieces is not None and self._state_released:
            raise RuntimeError(
                "the optimizer's state is sharded across the ranks (nt.Step(..., "
                "shard_optimizer=True)): this rank holds 1/N of it, so optimizer.state_dict() "
                "would lose the rest. Call step.consolidate_optimizer_state() on every rank "
                "first; until the next step, optimizer.state_dict() then returns the whole state.")

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state this process holds (sharded: its slices, plus whole-state
        copies while consolidated)."""
        tensors = [t for b in self._buckets for t in b.state.values()]
        tensors += [t for piece in self._pieces or [] for t in piece.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ host staging

    def _staged_row(self, group) -> list[float]:
        row = [0.0] * _STAGED
        row[_HYPER["lr"]] = float(group["lr"])
        row[_HYPER["weight_decay"]] = float(group["weight_decay"])
        if self._algorithm == "sgd":
            row[_HYPER["momentum"]] = float(group["momentum"])
            row[_HYPER["dampening"]] = float(group["dampening"])
            row[_HYPER["nesterov"]] = float(bool(group["nesterov"]))
        else:
            beta1, beta2 = group["betas"]
            row[_HYPER["beta1"]] = float(beta1)
            row[_HYPER["beta2"]] = float(beta2)
            row[_HYPER["eps"]] = float(group["eps"])
        if self._algorithm in ("sgd", "adam"):
            row[_HYPER["maximize"]] = float(bool(group.get("maximize", False)))
        if self._algorithm == "adam":
            row[_HYPER["decoupled_weight_decay"]] = float(
                bool(group.get("decoupled_weight_decay", False)))
        if self._algorithm == "lamb":
            row[_HYPER["bias_correction"]] = float(bool(group["bias_correction"]))
            row[_HYPER["always_adapt"]] = float(bool(group["always_adapt"]))
        return row

    def _check_structure(self) -> None:
        groups = self.optimizer.param_groups
        sizes = [len(group["params"]) for group in groups]
        if sizes != self._group_sizes:
            raise ValueError(
                f"FusedOptimizer: the parameter groups changed (sizes {self._group_sizes} -> "
                f"{sizes}); the flat buffers hold the old parameters. Build a new FusedOptimizer.")
        for g, group in enumerate(groups):
            if self._algorithm == "adam" and bool(group["amsgrad"]) != self._amsgrad:
                raise ValueError(
                    f"FusedOptimizer: param_groups[{g}]['amsgrad'] changed to {group['amsgrad']}; "
                    "it decides which state buffers exist. Build a new FusedOptimizer.")
            if self._algorithm == "sgd" and (group["momentum"] != 0) != self._momentum_on[g]:
                raise ValueError(
                    f"FusedOptimizer: param_groups[{g}]['momentum'] changed between zero and "
                    f"non-zero (now {group['momentum']}); that creates or drops momentum buffers. "
                    "Build a new FusedOptimizer.")

    def stage_host_values(self) -> None:
        """Reads ``optimizer.param_groups`` and stages the values for the next step.

        CPU only, outside any captured graph, exactly once before each graph replay (an eager
        :meth:`step` stages by itself when nothing is staged). The values go into a ring of
        pinned host slots; the step copies the whole ring to the device and its first kernel
        picks its own slot, by a step counter kept on the device.

        Why a ring and events: a captured copy reads a fixed host address when it *executes*,
        which may be several steps after the host staged it, since the host runs ahead. One
        buffer would hand queued replays the values of a later step. With a ring, step n reads
        slot n % ring_slots, and before overwriting a slot the host waits for an event recorded
        after the step that last read it; so the host blocks only when it is ring_slots steps
        ahead of the GPU (backpressure, not a per-step sync). Staging without a replay, or a
        replay without staging, desynchronises the counters; the device sees the stale slot's
        sequence number and counts it (see :meth:`staging_errors`).
        """
        if self._consolidated:
            self._release_whole_state()  # a replay moves the shards on: copies would go stale
        if self._is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "FusedOptimizer.stage_host_values() runs on the host before each replay; call it "
                "outside the captured graph (only step() and zero_grad() go inside).")
        self._check_structure()
        if self._captured or self._pending is None:
            # The previously staged step is enqueued by now (a step() or a graph replay): the
            # event recorded here completes once it has read the ring.
            if self._is_cuda and self._unrecorded is not None:
                event = self._events[self._unrecorded] or torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self._events[self._unrecorded] = event
            seq = self._next_seq
            self._next_seq += 1
        else:
            seq = self._pending  # staged twice before one eager step: rewrite the same slot
        slot = seq % self._ring_slots
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # returns at once unless the GPU is ring_slots steps behind
        values = [float(seq % _SEQ_MODULUS), 0.0, 0.0, 0.0]
        for group in self.optimizer.param_groups:
            values += self._staged_row(group)
        self._tables.ring_host[slot].copy_(torch.tensor(values, dtype=torch.float32))
        self._pending = seq
        self._unrecorded = slot

    def staging_errors(self) -> int:
        """Steps that ran with a stale staging slot (a replay without stage_host_values()).
        Synchronises with the device; for tests and debugging."""
        return int(self._tables.counter[_COUNTER["staging_errors"]])

    # ------------------------------------------------------------------ device work

    def zero_grad(self, set_to_none: bool = False) -> None:
        """One memset per flat gradient buffer (capturable). ``set_to_none`` is refused: the
        gradients are views into the flat buffers and must stay there."""
        if set_to_none:
            raise ValueError("FusedOptimizer.zero_grad: gradients live in flat buffers and cannot "
                             "be set to None; call zero_grad() (zeroing in place).")
        for bucket in self._buckets:
            bucket.grad.zero_()
            for p, view in zip(bucket.params, bucket.grad_views):
                if p.grad is not view:
                    p.grad = view

    def _reattach(self) -> None:
        """Puts back parameters and gradients that user code moved out of the flat buffers
        (``optimizer.zero_grad()`` sets grads to None, ``load_state_dict(assign=True)`` swaps
        tensors): the values are copied in, the views restored. A None gradient becomes zero."""
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                view = bucket.grad_views[i]
                if p.grad is not view:
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad)
                    p.grad = view
                if p.data_ptr() != bucket.param.data_ptr() + bucket.offsets[i] * p.element_size():
                    data = bucket.segment(bucket.param, i)
                    data.copy_(p.detach())
                    p.data = data

    def step(self, *, inv_scale: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None,
             max_grad_norm: float | None = None) -> torch.Tensor | None:
        """The update: device work only, capturable.

        inv_scale: float32 [1] on the device, 1 / loss scale; gradients are multiplied by it.
        found_inf: float32 [1] on the device, written 1.0 when a non-finite gradient was seen.
        With either, a non-finite gradient skips the update and the step count (no host sync).
        max_grad_norm: clip the global norm of the (unscaled) gradients to it, as
        ``torch.nn.utils.clip_grad_norm_``; fixed at capture.
        Returns the global gradient norm as a 0-dim device tensor (valid until the next step)
        when it was computed (any of the three given), else None.
        """
        for name, t in (("inv_scale", inv_scale), ("found_inf", found_inf)):
            if t is not None and (t.numel() != 1 or t.dtype != torch.float32
                                  or t.device != self.device):
                raise ValueError(f"FusedOptimizer.step: {name} must be a one-element float32 "
                                 f"tensor on {self.device}; got {t.numel()} elements of {t.dtype} "
                                 f"on {t.device}")
        if max_grad_norm is not None and not (0 < max_grad_norm < math.inf):
            raise ValueError(f"FusedOptimizer.step: max_grad_norm must be a positive finite "
                             f"float or None; got {max_grad_norm}")
        if self._consolidated:
            self._release_whole_state()  # the step moves the shards on: copies would go stale
        capturing = self._is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            self._captured = True
            if self._pending is not None:  # capture runs nothing: the staged slot stays unused
                self._next_seq, self._pending, self._unrecorded = self._pending, None, None
        else:
            self._reattach()
            if self._pending is None:
                self.stage_host_values()
        stats = inv_scale is not None or found_inf is not None or max_grad_norm is not None
        targets = self._buckets if self._pieces is None else self._pieces
        if stats:
            for t in targets:
                _C.optim_grad_stats_(t.grad, inv_scale, t.partials)
            if self._pieces is not None:
                if self.reduce_partials is None:
                    raise RuntimeError(
                        "FusedOptimizer.step: the state is sharded and this step needs the "
                        "global gradient norm or overflow flag; set reduce_partials (an "
                        "in-place sum over the ranks) after shard()")
                self.reduce_partials(self._partials)  # norms and overflow over every shard
        _C.optim_prepare_step_(self._tables, self._partials if stats else None, inv_scale,
                               found_inf, float(max_grad_norm or 0.0),
                               inv_scale is not None or found_inf is not None)
        hyper, control = self._tables.hyper, self._control
        for bucket in targets:  # a _Bucket, or a _Piece of one when sharded
            s = bucket.state
            if self._algorithm == "sgd":
                _C.optim_sgd_update_(bucket.param, bucket.grad, s.get("momentum_buffer"),
                                     bucket.chunks, hyper, control)
            elif self._algorithm == "adam":
                _C.optim_adam_update_(bucket.param, bucket.grad, s["exp_avg"], s["exp_avg_sq"],
                                      s.get("max_exp_avg_sq"), bucket.chunks, hyper, control)
            else:
                _C.optim_lamb_update_(bucket.param, bucket.grad, s["exp_avg"], s["exp_avg_sq"],
                                      bucket.chunks, bucket.first_chunk, hyper, control,
                                      bucket.chunk_norms, bucket.trust)
        if not capturing:
            self._pending = None
        # LR schedulers check that optimizer.step() ran before them; this step stands for it.
        self.optimizer._opt_called = True
        return self._control[_CONTROL["grad_norm"]] if stats else None

    # ------------------------------------------------------------------ introspection

    @property
    def flat_params(self) -> dict[torch.dtype, torch.Tensor]:
        """The flat parameter buffer of each dtype."""
        return {b.dtype: b.param for b in self._buckets}

    @property
    def flat_grads(self) -> dict[torch.dtype, torch.Tensor]:
        """The flat gradient buffer of each dtype (all-reduce buckets are slices of these)."""
        return {b.dtype: b.grad for b in self._buckets}

    def segments(self, dtype: torch.dtype) -> list[tuple[torch.Tensor, int, int]]:
        """(parameter, offset, numel) of each parameter in the flat buffers of ``dtype``."""
        bucket = next(b for b in self._buckets if b.dtype == dtype)
        return [(p, bucket.offsets[i], p.numel()) for i, p in enumerate(bucket.params)]
