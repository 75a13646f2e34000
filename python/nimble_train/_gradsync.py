"""Gradient averaging across the ranks of a data-parallel job, inside the captured step.

On CUDA the fused optimizer's flat gradient buffer is cut into buckets (src/optim/flat_layout.h
plans them from the order gradients arrived in warm-up); when a bucket's last gradient has been
accumulated, the communication stream waits on that point and all-reduces the bucket in place
through our NCCL communicator, while the backward goes on. Sharded (ZeRO-1), each bucket is
reduce-scattered instead, each rank updates its part, and the parameters are all-gathered.
A captured step updates each bucket (sharded: and all-gathers it) on the communication stream
right after its collective; when the update needs every gradient first (clipping, the fp16
overflow check), each bucket's share of the gradient statistics is taken there instead and the
update follows the backward. Before the fused optimizer exists (the first warm-up steps), and
for optimizers captured as they are, the gradients of each dtype are concatenated, all-reduced
once and copied back; on the CPU through torch.distributed (gloo)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from . import _torch_private
from ._extension import _C
from .distributed import World, fingerprint
from .errors import DistributedError

# The last bucket to fill is all-reduced after the backward has ended, so it is kept small;
# 1 MiB all-reduces in tens of microseconds between GPUs of one host.
LAST_BUCKET_BYTES = 2 ** 20


@dataclass
class Bucket:
    """A contiguous slice [start, stop) of one dtype's flat gradient buffer."""

    dtype: torch.dtype
    start: int
    stop: int
    members: list[int]   # indices of its parameters in the flat buffer's order
    ready_at: int = 0    # position, in the warm-up's gradient order, of its last gradient
    params: list = field(default_factory=list)  # the parameters themselves (GradientSync)


def hyperparameters(group: dict) -> dict:
    """A param group's settings, for the ranks' agreement (tensors as their values)."""
    out = {}
    for key, value in sorted(group.items()):
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        out[key] = repr(value)
    return out


def plan_buckets(offsets: Sequence[int], ready_rank: Sequence[int], element_size: int,
                 bucket_bytes: int, dtype: torch.dtype = torch.float32,
                 last_bucket_bytes: int = LAST_BUCKET_BYTES) -> list[Bucket]:
    """Cuts one flat buffer (segment i is [offsets[i], offsets[i+1])) into buckets of whole
    segments, in the order their gradients become ready (segment i's is the ready_rank[i]-th
    to arrive); sorted by when their last gradient arrives. The last bucket holds at most
    `last_bucket_bytes` (nothing hides its all-reduce), each before it at most twice the one
    after, up to `bucket_bytes` (see src/optim/flat_layout.h)."""
    planned = _C.plan_flat_buckets(list(offsets), list(ready_rank), element_size, bucket_bytes,
                                   last_bucket_bytes)
    return [Bucket(dtype, start, stop, list(members), ready_at)
            for start, stop, members, ready_at in planned]


class GradientSync:
    """Averages gradients across the ranks of `world`, on CUDA through our NCCL communicator
    (inside a captured step too), on CPU through torch.distributed (gloo)."""

    def __init__(self, world: World, device: torch.device, bucket_mb: float,
                 shard: bool = False):
        self.world, self.device, self.bucket_mb = world, device, bucket_mb
        self.sharded = shard  # ZeRO-1: reduce-scatter into optimizer shards, all-gather after
        self.comm = None
        self._stream = None          # the communication stream (CUDA)
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[int, int] = {}  # id(param) -> index into _buckets
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self._flat_params: dict[torch.dtype, torch.Tensor] = {}
        self._remaining: list[int] = []
        self._launched = 0
        self._hooks = []
        self._active = False
        self._checked_first = False
        self._order: dict[int, int] | None = None  # id(param) -> place in the arrival order
        self._late: set[int] = set()  # id(param) of those the backward reads after their grad
        self._single_use: set[int] = set()  # id(param) of those one autograd node alone uses
        self._made_on: list[dict] = []  # per bucket: the streams its gradients were made on
        # id(param) of those a side stream reports (ready()) while its layers are split:
        # autograd's accumulation hook still fires for them, with no gradient, and is ignored
        self._side_reported: set[int] = set()
        self._early: list[bool] = []  # per bucket: may be updated as soon as it is reduced
        self._fused = None            # the fused optimizer, while a step updates in buckets
        self.update_in_buckets = False  # captured steps update each bucket after its collective
        self.joined = False

    # ---------------------------------------------------------------- set-up

    def join(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, template,
             options: dict, vary_dim: int | None = None) -> None:
        """At the first step: checks that every rank runs the same step (parameters,
        optimizer, the batch template's tensor leaves, Step options), then connects them.
        With shape buckets (`vary_dim`) the first batches' lengths may differ."""
        shapes = [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in params]
        batch = [(leaf.path, _shape_text(leaf.tensor, vary_dim), str(leaf.tensor.dtype))
                 for leaf in template.tensor_leaves]
        self.world.agree("model, optimizer and Step options", {
            "parameters": f"{len(shapes)} tensors, {sum(p.numel() for p in params)} elements, "
                          f"digest {fingerprint(shapes)}",
            "optimizer": f"{type(optimizer).__qualname__} with "
                         f"{len(optimizer.param_groups)} param group(s)",
            **{f"param_groups[{g}]": hyperparameters(group)
               for g, group in enumerate(optimizer.param_groups)},
            "batch": batch,
            "options": {**options, "bucket_mb": self.bucket_mb, "shard_optimizer": self.sharded,
                        "device": self.device.type},
        })
        self.connect()
        self.joined = True

    def broadcast_from_rank0(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every rank starts from rank 0's values of `tensors` (the model's parameters and
        buffers, as DDP does when it is built): one broadcast per dtype and device."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((str(t.dtype), str(t.device)), []).append(t)
        with torch.no_grad():
            for key in sorted(groups):  # the same order on every rank
                group = groups[key]
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                self.world.collective("the broadcast of rank 0's parameters and buffers",
                                      lambda flat=flat: dist.broadcast(flat, src=0))
                offset = 0
                for t in group:
                    t.detach().copy_(flat[offset: offset + t.numel()].view_as(t))
                    offset += t.numel()

    def used_anywhere(self, used: Sequence[bool]) -> list[bool]:
        """Whether each parameter got a gradient (`used`: on this rank) on some rank (eager:
        synchronises)."""
        device = self.device if self.comm is not None else torch.device("cpu")
        counts = torch.tensor([float(u) for u in used], device=device)
        self._sum_eager(counts, "the check of which parameters got gradients")
        return [c > 0 for c in counts.tolist()]

    def _sum_eager(self, t: torch.Tensor, what: str) -> None:
        if self.comm is not None:
            self.comm.all_reduce_(t, 0, t.numel(), "sum")
        else:
            self.world.collective(what, lambda: dist.all_reduce(t))

    def connect(self) -> None:
        """Makes the NCCL communicator (CUDA): rank 0's unique id through the store."""
        if self.device.type != "cuda" or self.comm is not None:
            return
        if not _C.has_nccl():
            raise DistributedError(
                "data-parallel training on CUDA needs nimble_train's NCCL layer, and this build "
                f"has none ({_C.build_info()['nccl']['reason']}).")
        unique_id = self.world.share("nccl_unique_id",
                                     _C.nccl_unique_id() if self.world.rank == 0 else None)
        self.comm = _C.NcclCommunicator(unique_id, self.world.rank, self.world.size,
                                        self.device, self.world.timeout_s)
        self._stream = torch.cuda.Stream(self.device)

    @contextlib.contextmanager
    def observing(self, params: Sequence[torch.Tensor]):
        """Around the first forward and backward: notes the order in which gradients arrive
        (the buckets are planned from it) and which parameters the backward still reads after
        their gradient was accumulated (a tensor saved for the backward that shares a
        parameter's storage, unpacked after that parameter's gradient arrived: a `p.detach()`
        in a product, say). Those parameters' buckets are not updated before the backward
        ends. Yields a function to call with the loss before the backward: it counts the
        autograd nodes that use each parameter (see splittable). Later, does nothing and
        yields None."""
        if self._order is not None:
            yield None
            return
        order: dict[int, int] = {}
        late: set[int] = set()
        uses: dict[int, int] = {}
        owners: dict[int, list[int]] = {}  # storage address -> ids of its parameters
        for p in params:
            if p.requires_grad:
                owners.setdefault(_storage_address(p), []).append(id(p))

        def arrived(p):
            order.setdefault(id(p), len(order))

        def pack(t):
            return t, owners.get(_storage_address(t), ())

        def unpack(packed):
            t, ids = packed
            late.update(i for i in ids if i in order)
            return t
        handles = [p.register_post_accumulate_grad_hook(arrived) for p in params
                   if p.requires_grad]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield lambda loss: uses.update(_autograd_uses(loss))
        finally:
            for handle in handles:
                handle.remove()
        self._order, self._late = order, late
        self._single_use = {i for i, n in uses.items() if n == 1}

    def use_buckets(self, fused, update_in_buckets: bool = False) -> None:
        """Plans buckets over the fused optimizer's flat gradient buffers and hooks them; when
        sharded, gives each rank its part of every bucket to update (fused.shard).
        `update_in_buckets`: the update goes in parts, one per bucket (fused.split), for
        captured steps that update each bucket right after its collective (begin(fused))."""
        bucket_bytes = max(1, int(self.bucket_mb * 2 ** 20))
        self._order = self._order or {}
        unseen = len(self._order)
        self._buckets = []
        for dtype, flat in fused.flat_grads.items():
            segments = fused.segments(dtype)
            offsets = [offset for _, offset, _ in segments] + [flat.numel()]
            ready = []
            for p, _, _ in segments:
                if id(p) not in self._order:  # no gradient seen: ready last
                    self._order[id(p)] = unseen
                    unseen += 1
                ready.append(self._order[id(p)])
            self._flat[dtype] = flat
            planned = plan_buckets(offsets, ready, flat.element_size(), bucket_bytes, dtype)
            for bucket in planned:
                bucket.params = [segments[i][0] for i in bucket.members]
            self._buckets += planned
        self._buckets.sort(key=lambda b: b.ready_at)
        self._early = [not any(id(p) in self._late for p in b.params) for b in self._buckets]
        self.world.agree("gradient buckets", {
            "buckets": fingerprint([(str(b.dtype), b.start, b.stop) for b in self._buckets]),
            "updated as soon as reduced": fingerprint(self._early)})
        for index, bucket in enumerate(self._buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = index
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_ready))
        if self.sharded:
            self._flat_params = dict(fused.flat_params)
            fused.shard(self.pieces())
            fused.reduce_partials = self._sum_
        elif update_in_buckets:
            fused.split([(b.dtype, b.start, b.stop) for b in self._buckets])
        self.update_in_buckets = update_in_buckets

    def pieces(self) -> list[tuple[torch.dtype, int, int, int, int]]:
        """This rank's part of every bucket, in the buckets' order: (dtype, start, stop,
        bucket start, bucket size). Bucket r-th parts go to rank r, as NCCL's reduce-scatter
        and all-gather cut them."""
        n, r = self.world.size, self.world.rank
        out = []
        for b in self._buckets:
            try:
                cut = _C.shard_slice(b.start, b.stop, n, r)
            except ValueError as exc:
                raise DistributedError(
                    f"{exc}; the fused optimizer must be built with shard_world equal to the "
                    "number of ranks") from exc
            out.append((b.dtype, *cut))
        return out

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def splittable(self, p: torch.Tensor) -> bool:
        """Whether a side stream may compute `p`'s gradient and report it (ready()) in place of
        autograd's accumulation hook: the only hooks on `p` are the buckets' and, in the first
        step, a single autograd node used it (its layer, called once); otherwise a gradient
        from elsewhere could arrive after the side stream's report."""
        if not self._bucket_of:  # no buckets: the gradients are averaged after the backward
            return not _torch_private.post_accumulate_grad_hooks(p)
        hooks = _torch_private.post_accumulate_grad_hooks(p)
        return (id(p) in self._single_use and id(p) in self._bucket_of
                and all(fn == self._on_ready for fn in hooks.values()))

    def ready(self, p: torch.Tensor) -> None:
        """`p`'s gradient is complete on the current stream (a side stream's report)."""
        self._count(p)

    def reported_by_side(self, params: Sequence[torch.Tensor]) -> None:
        """From now on these parameters' gradients are reported by ready() alone (empty: by
        autograd's accumulation hooks again)."""
        self._side_reported = {id(p) for p in params}

    @property
    def early_buckets(self) -> int:
        """Buckets a step that overlaps its update updates as soon as they are reduced."""
        return sum(self._early)

    # ---------------------------------------------------------------- per step

    def begin(self, update=None, **step_args) -> None:
        """Before a backward that uses the buckets. `update`: the fused optimizer (split or
        sharded, see use_buckets) when this step updates each bucket on the communication
        stream right after its collective (and, sharded, all-gathers it there); its step
        starts now (begin_update, with `step_args`) and ends in finish(). When the step needs
        the gradient statistics (unscaling, clipping, the overflow skip), each bucket's share of
        them is taken there instead, and the update follows the backward."""
        self._remaining = [len(b.params) for b in self._buckets]
        self._made_on = [{} for _ in self._buckets]
        self._launched = 0
        self._active = True
        self._fused = update
        if update is not None:
            update.begin_update(**step_args)
            if self._stream is not None:  # every part's update comes after the prepare
                self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def cancel(self) -> None:
        """A backward begun with begin() raised: its hooks go quiet until the next begin()."""
        self._active = False
        if self._fused is not None:
            self._fused.abandon_update()
        self._fused = None

    def _on_ready(self, p: torch.Tensor) -> None:
        if id(p) not in self._side_reported:
            self._count(p)

    def _count(self, p: torch.Tensor) -> None:
        if not self._active:
            return
        index = self._bucket_of[id(p)]
        if self._stream is not None:
            stream = torch.cuda.current_stream(self.device)
            self._made_on[index][stream.cuda_stream] = stream
        self._remaining[index] -= 1
        if self._remaining[index] == 0:
            # Buckets go out in one fixed order on every rank (NCCL matches collectives by
            # order): a bucket that fills early waits for those planned before it.
            while (self._launched < len(self._buckets)
                   and self._remaining[self._launched] <= 0):
                self._launch(self._launched)
                self._launched += 1

    def _launch(self, index: int) -> None:
        bucket = self._buckets[index]
        on_comm = contextlib.nullcontext()  # the CPU runs each collective at once
        if self._stream is not None:
            # after the work on the streams that made its gradients (autograd's, the weight
            # gradients' side stream) and on the current one
            current = torch.cuda.current_stream(self.device)
            for stream in {**self._made_on[index], current.cuda_stream: current}.values():
                self._stream.wait_stream(stream)
            on_comm = torch.cuda.stream(self._stream)
        with on_comm:
            if self.sharded:  # this rank's part gets the average; the optimizer updates it
                self.comm.reduce_scatter_(self._flat[bucket.dtype], bucket.start,
                                          bucket.stop - bucket.start, "avg")
            else:
                self.comm.all_reduce_(self._flat[bucket.dtype], bucket.start,
                                      bucket.stop - bucket.start, "avg")
            if self._fused is not None and (self._early[index]
                                            or self._fused.update_waits_for_all_parts):
                self._update(index)  # statistics read only the gradients: never late

    def _update(self, index: int) -> None:
        """Bucket `index`'s update (sharded: this rank's part, then the all-gather of the
        bucket's parameters), or its share of the gradient statistics, on the current stream."""
        self._fused.update_part(index)
        if self.sharded and not self._fused.update_waits_for_all_parts:
            bucket = self._buckets[index]
            self.comm.all_gather_(self._flat_params[bucket.dtype], bucket.start,
                                  bucket.stop - bucket.start)

    def finish(self) -> torch.Tensor | None:
        """After the backward: launches what is left (parameters without a gradient this step)
        and makes the current stream wait for every bucket. A step that updates in buckets
        then updates those the backward read late, and its update is done; or, when it took
        only the statistics in buckets, updates every part now (sharded: then all-gathers).
        Returns the step's global gradient norm when it computed one (see begin)."""
        for index in range(self._launched, len(self._buckets)):
            self._launch(index)
        self._launched = len(self._buckets)
        self._active = False
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        norm = None
        if self._fused is not None:
            waits = self._fused.update_waits_for_all_parts
            for index, early in enumerate(self._early):
                if not early and not waits:
                    self._update(index)
            norm = self._fused.end_update()
            self._fused = None
            if waits:
                self.after_update()
        self._check_first()
        return norm

    def after_update(self) -> None:
        """Sharded: after the update of this rank's parts, every rank gets every part of the
        parameters (an all-gather per bucket, in place, on the current stream)."""
        if not self.sharded:
            return
        for bucket in self._buckets:
            self.comm.all_gather_(self._flat_params[bucket.dtype], bucket.start,
                                  bucket.stop - bucket.start)

    def gather(self, flat: torch.Tensor, start: int, count: int) -> None:
        """All-gathers flat[start: start + count], cut in equal parts, in place (a collective:
        every rank calls it, in the same order); for consolidating sharded state."""
        self.comm.all_gather_(flat, start, count)

    def _sum_(self, t: torch.Tensor) -> None:
        self.comm.all_reduce_(t, 0, t.numel(), "sum")

    def all_reduce_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Averages the gradients of every trainable parameter of `params` (one concatenation
        per dtype), the same fixed set on every rank: a parameter without a gradient here
        contributes zeros, and gets the average when another rank gave it one (as DDP with
        find_unused_parameters). Eagerly, a parameter no rank gave a gradient keeps None, so
        that the optimizer skips it as one process would; captured, every one gets the average.
        """
        trainable = [p for p in params if p.requires_grad]
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        used = ([True] * len(trainable) if capturing
                else self.used_anywhere([p.grad is not None for p in trainable]))
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p, anywhere in zip(trainable, used):
            if anywhere:
                by_dtype.setdefault(p.dtype, []).append(p)
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            group = by_dtype[dtype]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in group])
            if self.comm is not None:
                self.comm.all_reduce_(flat, 0, flat.numel(), "avg")
            else:
                self.world.collective("the gradient all-reduce", lambda flat=flat:
                                      dist.all_reduce(flat))
                flat.div_(self.world.size)
            offset = 0
            for p in group:
                average = flat[offset: offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = average.clone()
                else:
                    p.grad.copy_(average)
                offset += p.numel()
        self._check_first()

    def _check_first(self) -> None:
        # Once, in an eager step: the host waits (bounded) for the first all-reduce, so a rank
        # that never joins ends the job with a message instead of a hang.
        if self._checked_first or self.comm is None or self.device.type != "cuda":
            return
        if torch.cuda.is_current_stream_capturing():
            return
        self.comm.wait(self.world.timeout_s, "the first gradient all-reduce")
        self._checked_first = True

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.comm is not None:
            if self._stream is not None:
                self._stream.synchronize()
            self.comm = None  # the communicator finalizes and is destroyed with its last reference


def _autograd_uses(loss: torch.Tensor) -> dict[int, int]:
    """id(leaf) -> how many autograd nodes of `loss`'s graph use it (edges into its
    accumulation node)."""
    uses: dict[int, int] = {}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            leaf = getattr(child, "variable", None)
            if leaf is not None:
                uses[id(leaf)] = uses.get(id(leaf), 0) + 1
            stack.append(child)
    return uses


def _storage_address(t) -> int | None:
    """The address of a tensor's storage (None for tensors without one: sparse, subclasses)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def _shape_text(t: torch.Tensor, vary_dim: int | None) -> tuple:
    """A leaf's shape as ranks compare it: a bucketed length is any ("L")."""
    if vary_dim is None or t.dim() <= vary_dim:
        return tuple(t.shape)
    return tuple("L" if d == vary_dim else n for d, n in enumerate(t.shape))
