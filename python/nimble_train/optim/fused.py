"""FusedOptimizer: a torch optimizer's update as one fused, capturable pass over flat buffers."""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

from .. import _torch_private
from .._extension import _C
from ._flat import build_flat_buffers, cut_pieces, own_storage, update_targets
from ._hyper import LAYOUT, STAGED, Structure, any_on_device, device_values, make_tables
from ._state import FlatState
from ._support import algorithm, trainable, why_unsupported


# Every FusedOptimizer alive, for in_flat_buffers.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def in_flat_buffers(t: torch.Tensor) -> bool:
    """Whether t's data lies in a FusedOptimizer's flat parameter buffers: that optimizer's
    update moved it there and writes it there (a captured step that reads a parameter another
    step trains, as a GAN's generator step reads the discriminator, tells by it)."""
    where = t.untyped_storage().data_ptr()
    return any(flat.untyped_storage().data_ptr() == where
               for fused in list(_LIVE) for flat in fused.flat_params.values())


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

    Hyper-parameters are read from ``optimizer.param_groups`` at each staging and reach the
    device through a staging ring (src/capture/slot_ring.h) whose fetch is the step's first
    kernel, so schedulers (and any edit of lr, betas, eps, weight_decay, momentum, dampening,
    nesterov, maximize) take effect without recapture. One held as a one-element tensor on the
    device (``lr=torch.tensor(1e-3, device="cuda")``) is not read on the host, which would
    wait for the device at every step: the step copies it over its staged value on the device
    (:meth:`device_values`), so a schedule fills it in place (``fill_``, as torch's schedulers
    do), and a graph reads the tensor it was captured with (another one in its place needs a
    new capture). Changing ``amsgrad``, a momentum between zero and non-zero, or the set of
    parameters needs a new FusedOptimizer.

    ``staged``: inside nt.Step, the step's one staging ring stages these values with the rest
    of the launch's (:meth:`host_values` gives them) and fetches them at the top of the graph;
    ``staged`` is then the float32 device tensor [num_staged_values(optimizer)] it fetches them
    into, and this object neither stages nor fetches.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, ring_slots: int = 16,
                 chunk_elems: int = LAYOUT["default_chunk_elems"],
                 exclude: frozenset[int] = frozenset(), shard_world: int = 1,
                 staged: torch.Tensor | None = None):
        reason = self.why_unsupported(optimizer)
        if reason is not None:
            raise ValueError(f"FusedOptimizer cannot fuse this optimizer: {reason}. Use the "
                             "optimizer as it is (eager), or check why_unsupported() first.")
        if ring_slots < 2:
            raise ValueError(f"FusedOptimizer: ring_slots must be >= 2; got {ring_slots}")
        self.optimizer = optimizer
        self._algorithm = algorithm(optimizer)
        self._structure = Structure(optimizer, self._algorithm)
        self._chunk_elems = chunk_elems
        self.reduce_partials: Callable[[torch.Tensor], None] | None = None
        # Parameters in `exclude` (by id) are left out, as torch.optim skips parameters that
        # never get a gradient: no update, no state (a captured step knows them from warm-up).
        groups = optimizer.param_groups
        params = [(g, p) for g, group in enumerate(groups) for p in trainable(group, exclude)]
        self.device = params[0][1].device
        keys = self._structure.state_keys()
        self._keys = keys
        self._flats = build_flat_buffers(params, keys, device=self.device,
                                         shard_world=shard_world, chunk_elems=chunk_elems,
                                         lamb=self._algorithm == "lamb")
        self._cores = [flat.core for flat in self._flats]
        taken = {id(p) for _, p in params}
        own_storage([p for group in groups for p in group["params"] if id(p) not in taken],
                    optimizer.state)
        self._partials, self._targets = update_targets(self._flats, keys, self.device)
        self._parts: list | None = None  # split(): the update's parts, as UpdateTargets
        self._part_partials: torch.Tensor | None = None  # their gradient statistics
        self._waiting = None  # a step in parts that needs statistics: step()'s arguments
        self._factor: torch.Tensor | None = None  # and its gradient factor
        self._ring = None if staged is not None else _C.StagingRing(
            self.num_staged_values(optimizer), self.device, ring_slots)
        self._captured = False
        self._staged = staged if staged is not None else self._ring.current
        self._tables = make_tables(self._staged, self._flats, len(groups), len(params),
                                   self.device)
        self._state = FlatState(optimizer, self._flats, self._algorithm, keys,
                                self._structure.momentum_on, self._tables)
        self._state.refresh()
        self._hooks = [
            optimizer.register_load_state_dict_post_hook(lambda _opt: self._state.on_load()),
            optimizer.register_state_dict_pre_hook(lambda _opt: self._state.check_whole()),
        ]
        _LIVE.add(self)

    @staticmethod
    def num_staged_values(optimizer: torch.optim.Optimizer) -> int:
        """Values staged per step for `optimizer`: one row of staged columns per param group."""
        return len(optimizer.param_groups) * STAGED

    @staticmethod
    def why_unsupported(optimizer) -> str | None:
        """Why ``optimizer`` cannot be fused, or None when it can."""
        return why_unsupported(optimizer)

    # ------------------------------------------------------------------ state

    def refresh_state(self) -> None:
        """Copies ``optimizer.state`` into the flat buffers and points it back at them.

        Runs at construction and after ``optimizer.load_state_dict`` (through a hook); call it
        after replacing state tensors by hand. Host-side work: call it outside a captured graph.
        """
        self._state.refresh()

    def shard(self, slices: list[tuple[torch.dtype, int, int, int, int]]) -> None:
        """Keeps only these slices of the state: this rank's shards in a data-parallel job
        whose ranks each update one part of every all-reduce bucket (ZeRO stage 1).

        slices: (dtype, start, stop, range_start, range_count) in the same order on every rank;
        [start, stop) is this rank's part of the flat buffers of `dtype`, and the all-gather of
        flat[range_start: range_start + range_count] brings the other ranks' parts. The state
        of the slices moves into buffers of their own and optimizer.state keeps only the step
        counts (see consolidate()). step() then updates the slices alone; the caller reduces
        the gradients into them before and all-gathers the parameters after, and sets
        `reduce_partials` (an in-place sum over the ranks) when step() computes gradient norms,
        and for LAMB always: each rank takes its part of every tensor's two norms, and the sum
        over the ranks gives the whole tensor's trust ratio.
        Built with shard_world=N, every run of whole segments splits into N such slices.
        """
        if self._state.pieces is not None:
            raise RuntimeError("FusedOptimizer.shard: the state is sharded already")
        pieces = cut_pieces(self._flats, slices, self._chunk_elems, self.device)
        self._partials, self._targets = update_targets(pieces, self._keys, self.device,
                                                       lamb=self._algorithm == "lamb",
                                                       sharded=True)
        self._state.shard(pieces)

    def split(self, slices: list[tuple[torch.dtype, int, int]]) -> None:
        """Cuts the update into parts, one per slice (dtype, start, stop) of whole segments of
        the flat buffers, for a step in parts (:meth:`begin_update`); the state stays where it
        is. A sharded optimizer is in parts already: one per slice given to :meth:`shard`."""
        if self.sharded:
            raise RuntimeError("FusedOptimizer.split: a sharded optimizer is in parts already "
                               "(its shards)")
        bounds = {f.dtype: set(f.offsets) for f in self._flats}
        for dtype, start, stop in slices:
            if dtype not in bounds or start not in bounds[dtype] or stop not in bounds[dtype]:
                raise ValueError(
                    f"FusedOptimizer.split: each slice must be a run of whole parameters of the "
                    f"flat buffers (start and stop among segments(dtype)'s offsets, or the "
                    f"buffer's end); got ({dtype}, {start}, {stop})")
        pieces = cut_pieces(self._flats, [(d, start, stop, start, stop - start)
                                          for d, start, stop in slices],
                            self._chunk_elems, self.device, copy_state=False)
        self._part_partials, self._parts = update_targets(pieces, self._keys, self.device,
                                                         lamb=self._algorithm == "lamb")

    @property
    def num_parts(self) -> int:
        """How many parts a step in parts updates (0: not split)."""
        if self.sharded:
            return len(self._targets)
        return len(self._parts) if self._parts is not None else 0

    def consolidate(self, gather: Callable[[torch.Tensor, int, int], None]) -> None:
        """Sharded: puts the whole state back into ``optimizer.state`` (in torch's format, so
        ``optimizer.state_dict()`` works) until the next step. Every rank calls it:
        ``gather(flat, start, count)`` all-gathers flat[start: start + count] in place across the
        ranks. The tensors are copies: to change the state, use ``load_state_dict``."""
        self._state.consolidate(gather)

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state this process holds (sharded: its slices, plus whole-state
        copies while consolidated)."""
        return self._state.bytes

    @property
    def sharded(self) -> bool:
        return self._state.pieces is not None

    def close(self) -> None:
        """Removes the hooks this object put on the optimizer. The optimizer stays usable:
        parameters, gradients and state remain views into the flat buffers, which live on
        with them."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------------ host staging

    def host_values(self) -> list[float]:
        """This step's staged values (every group's row), read from ``param_groups`` now."""
        return self._structure.values(self.optimizer)

    def stage_host_values(self) -> None:
        """Reads ``optimizer.param_groups`` and stages the values for the next step.

        Outside any captured graph, exactly once before each graph replay (an eager
        :meth:`step` stages by itself when nothing is staged; staging twice before one eager
        step keeps the latest values). A replay without staging reads a slot staged for
        another step: the device counts it (:meth:`staging_errors`) and the next staging raises.
        """
        if self._ring is None:
            raise RuntimeError("FusedOptimizer.stage_host_values: this optimizer's values are "
                               "staged by the step that owns it (nt.Step), with the rest of each "
                               "launch's values")
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "FusedOptimizer.stage_host_values() runs on the host before each replay; call it "
                "outside the captured graph (only step() and zero_grad() go inside).")
        self._state.before_update()  # a replay moves the shards on: copies would go stale
        values = self.host_values()
        if self._captured:
            self._ring.launched(self._ring.pending)  # each staging since was for one replay
            self._ring.stage(values)
        elif self._ring.pending:
            self._ring.restage(values)
        else:
            self._ring.stage(values)

    def device_values(self) -> list[tuple[int, torch.Tensor]]:
        """(index in the staged values, tensor) per hyper-parameter a param group holds as a
        tensor on the device (a CUDA tensor lr a scheduler fills): each step copies it over its
        staged value on the device, where the host stages 0 (reading it would wait for the
        device). A captured step copies from the tensor it was captured with: another one put
        in the group needs the step captured again (nt.Step sees to it)."""
        return device_values(self._algorithm, self.optimizer.param_groups)

    def any_on_device(self) -> bool:
        """Whether any hyper-parameter is held as a tensor on the device (device_values)."""
        return any_on_device(self._algorithm, self.optimizer.param_groups)

    def staging_errors(self) -> int:
        """Launches that read a staging slot not staged for them (a replay without
        stage_host_values()). Read from host memory the device publishes to: no sync."""
        return self._ring.stale if self._ring is not None else 0

    # ------------------------------------------------------------------ device work

    def zero_grad(self, set_to_none: bool = False) -> None:
        """One memset per flat gradient buffer (capturable). ``set_to_none`` is refused: the
        gradients are views into the flat buffers and must stay there."""
        if set_to_none:
            raise ValueError("FusedOptimizer.zero_grad: gradients live in flat buffers and cannot "
                             "be set to None; call zero_grad() (zeroing in place).")
        _C.optim_zero_grads(self._cores)

    def attach_grads(self) -> None:
        """Gradients user code set to None go back to their views, keeping the values the
        views hold (an accumulation window's graphs wrote them)."""
        _C.optim_attach_grads(self._cores)

    def _reattach(self) -> None:
        """Puts back parameters and gradients that user code moved out of the flat buffers
        (``optimizer.zero_grad()`` sets grads to None, ``load_state_dict(assign=True)`` swaps
        tensors): the values are copied in, the views restored. A None gradient becomes zero."""
        _C.optim_reattach(self._cores)

    def _fetch(self, capturing: bool) -> None:
        """Standalone: the staged values reach the device (eagerly: now; captured: at every
        replay, as the graph's first kernel of the update)."""
        if self._ring is None:
            return  # the owner fetched this launch's values at the top of its graph
        if capturing:
            if self._ring.pending and not self._captured:
                self._ring.unstage()  # a capture runs nothing: that slot would be misread
            self._captured = True
            self._ring.fetch()
            return
        if not self._ring.pending:
            self._ring.stage(self.host_values())
        self._ring.fetch()
        self._ring.launched()

    def step(self, *, inv_scale: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None,
             max_grad_norm: float | None = None,
             grad_scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """The update: device work only, capturable.

        inv_scale: float32 [1] on the device, 1 / loss scale; gradients are multiplied by it.
        found_inf: float32 [1] on the device, written 1.0 when a non-finite gradient was seen.
        With either, a non-finite gradient skips the update and the step count (no host sync).
        max_grad_norm: clip the global norm of the (unscaled) gradients to it, as
        ``torch.nn.utils.clip_grad_norm_``; fixed at capture.
        grad_scale: float32 [1] on the device; gradients are multiplied by it too (before the
        norm), without the overflow skip (gradient accumulation's normalisation).
        Returns the global gradient norm as a 0-dim device tensor (valid until the next step)
        when it was computed (any of the three given), else None.
        """
        self._check_step("step", inv_scale, found_inf, max_grad_norm, grad_scale)
        self._before_update()
        # Sharded LAMB sums its norms over the ranks after the step counts have moved on (its
        # ratios need the step's bias corrections) and before it writes anything else: if that
        # sum raises, an eager step puts the counts back, and the state is as it was.
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        tables = self._tables
        counts = ([(t, t.clone()) for t in (tables.hyper, tables.param_steps)]
                  if self._algorithm == "lamb" and self.sharded and not capturing else [])
        try:
            # The step itself is C++ (src/optim/fused_step.h), shared with the LibTorch Step.
            norm = _C.optim_fused_step(self._algorithm, self._targets, tables,
                                       self._partials, inv_scale, found_inf, grad_scale,
                                       float(max_grad_norm or 0.0), self._partial_sum())
        except BaseException:
            for table, kept in counts:  # the groups' step counts (hyper) and the parameters'
                table.copy_(kept)
            raise
        # LR schedulers check that optimizer.step() ran before them; this step stands for it.
        _torch_private.mark_optimizer_stepped(self.optimizer)
        return norm

    def _check_step(self, where: str, inv_scale, found_inf, max_grad_norm, grad_scale) -> bool:
        """Checks a step's arguments (see step()); whether the step needs the gradient
        statistics (the global norm or overflow flag)."""
        for name, t in (("inv_scale", inv_scale), ("found_inf", found_inf),
                        ("grad_scale", grad_scale)):
            if t is not None and (t.numel() != 1 or t.dtype != torch.float32
                                  or t.device != self.device):
                raise ValueError(f"FusedOptimizer.{where}: {name} must be a one-element float32 "
                                 f"tensor on {self.device}; got {t.numel()} elements of {t.dtype} "
                                 f"on {t.device}")
        if max_grad_norm is not None and not (0 < max_grad_norm < math.inf):
            raise ValueError(f"FusedOptimizer.{where}: max_grad_norm must be a positive finite "
                             f"float or None; got {max_grad_norm}")
        stats = inv_scale is not None or found_inf is not None or max_grad_norm is not None
        if stats and self.sharded and self.reduce_partials is None:
            raise RuntimeError(
                f"FusedOptimizer.{where}: the state is sharded and this step needs the global "
                "gradient norm or overflow flag; set reduce_partials (an in-place sum over the "
                "ranks) after shard()")
        if self._algorithm == "lamb" and self.sharded and self.reduce_partials is None:
            raise RuntimeError(
                f"FusedOptimizer.{where}: the state is sharded and LAMB's trust ratios need "
                "every rank's part of each tensor's norms; set reduce_partials (an in-place sum "
                "over the ranks) after shard()")
        return stats

    def _partial_sum(self) -> Callable[[torch.Tensor], None] | None:
        """What sums the gradient statistics over the ranks: sharded, reduce_partials."""
        return self.reduce_partials if self.sharded else None

    def _before_update(self) -> None:
        """What every step does before its device work: shard copies dropped, user-moved
        views put back (eagerly), this step's staged values fetched (standalone)."""
        self._state.before_update()
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        on_device = self.device_values()
        for index, value in on_device:
            if value.numel() != 1 or value.device != self.device:
                raise ValueError(
                    f"FusedOptimizer: param group {index // STAGED} holds a hyper-parameter as "
                    f"a tensor of {value.numel()} elements on {value.device}; a hyper-parameter "
                    f"held as a tensor must be one value on the CPU or on {self.device}, the "
                    "parameters' device. Nothing was updated.")
        if not capturing:
            self._reattach()
        self._fetch(capturing)
        for index, value in on_device:  # over the host's 0, in order after the fetch
            self._staged[index:index + 1].copy_(value.reshape(1))

    def begin_update(self, *, grad_scale: torch.Tensor | None = None,
                     inv_scale: torch.Tensor | None = None,
                     found_inf: torch.Tensor | None = None,
                     max_grad_norm: float | None = None) -> None:
        """A step in parts, for updates that overlap the backward: this first, then
        :meth:`update_part` once for each part (after its gradients are final, on any stream
        ordered after this call's), then :meth:`end_update`. Together they do what
        ``step(...)`` with the same arguments does.

        Without anything global (only ``grad_scale``) this call prepares the step (the step
        count, the hyper-parameters) and each update_part updates its part. With unscaling,
        clipping or the overflow skip (``inv_scale``, ``found_inf``, ``max_grad_norm``), no part
        can be updated before every gradient exists: each update_part then takes only its
        part's share of the gradient statistics, and end_update sums them (over the ranks too,
        sharded), prepares and updates every part (:attr:`update_waits_for_all_parts`).
        """
        if self.num_parts == 0:
            raise RuntimeError("FusedOptimizer.begin_update: split() the update (or shard() the "
                               "state) first")
        stats = self._check_step("begin_update", inv_scale, found_inf, max_grad_norm,
                                 grad_scale)
        self._before_update()
        if not stats:
            self._waiting = None
            _C.optim_prepare_update(self._tables, grad_scale)
            return
        self._waiting = (inv_scale, found_inf, grad_scale, float(max_grad_norm or 0.0))
        # computed once, before every part's statistics; the end's prepare computes it again
        self._factor = _C.optim_gradient_factor(*self._waiting, self.device)

    @property
    def update_waits_for_all_parts(self) -> bool:
        """In a step in parts that needs the gradient statistics: update_part takes a part's
        share of them, and end_update updates every part."""
        return self._waiting is not None

    def update_part(self, index: int) -> None:
        """Updates part `index` (of :meth:`split`, or shard `index`) on the current stream; or,
        when the update waits for all parts, takes its share of the gradient statistics."""
        parts = self._targets if self.sharded else self._parts
        if self._waiting is not None:
            _C.optim_grad_stats_parts([parts[index]], self._factor)
        else:
            _C.optim_update(self._algorithm, [parts[index]], self._tables, self._partial_sum())

    def end_update(self) -> torch.Tensor | None:
        """After every part's update_part: the step stands for ``optimizer.step()``. When the
        update waits for all parts, it runs now, on the current stream (which must be ordered
        after every update_part): returns the global gradient norm, as step()."""
        norm = None
        if self._waiting is not None:
            waiting, self._waiting, self._factor = self._waiting, None, None
            partials = self._partials if self.sharded else self._part_partials
            norm = _C.optim_fused_step(self._algorithm, self._targets, self._tables, partials,
                                       *waiting, self._partial_sum(), stats_done=True)
        _torch_private.mark_optimizer_stepped(self.optimizer)
        return norm

    def abandon_update(self) -> None:
        """A step in parts that will not end (its backward raised): forgets its arguments."""
        self._waiting, self._factor = None, None

    # ------------------------------------------------------------------ introspection

    @property
    def flat_params(self) -> dict[torch.dtype, torch.Tensor]:
        """The flat parameter buffer of each dtype."""
        return {f.dtype: f.param for f in self._flats}

    @property
    def flat_grads(self) -> dict[torch.dtype, torch.Tensor]:
        """The flat gradient buffer of each dtype (all-reduce buckets are slices of these)."""
        return {f.dtype: f.grad for f in self._flats}

    def segments(self, dtype: torch.dtype) -> list[tuple[torch.Tensor, int, int]]:
        """(parameter, offset, numel) of each parameter in the flat buffers of ``dtype``."""
        flat = next(f for f in self._flats if f.dtype == dtype)
        return [(p, flat.offsets[i], p.numel()) for i, p in enumerate(flat.params)]
