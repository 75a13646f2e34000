"""Data parallelism: one process per GPU, gradients averaged by NCCL inside the captured step.

``torchrun --nproc_per_node=N train.py`` starts the processes; :func:`init_distributed` (or the
user's own ``torch.distributed.init_process_group``) joins them, and every ``nt.Step`` made
afterwards trains data-parallel: each rank runs the step on its own batch, the gradients are
averaged across ranks, and every rank applies the same update to its own replica.

How gradients travel (MLPerf's recipe, inside one CUDA graph per rank):

- our own NCCL communicator (``_C.NcclCommunicator``), its unique id passed from rank 0 through
  the torch.distributed store: the process group itself runs no collective of ours;
- the fused optimizer's flat gradient buffer is cut into buckets (``bucket_mb``, 25 MB by
  default) of whole parameters, launched in the order their gradients became ready in
  warm-up; when a bucket's last gradient has been accumulated, an event is recorded on the
  stream that produced it, the communication stream waits on it and all-reduces the bucket in
  place (``ncclAvg``) while the backward goes on; the update waits for every bucket;
- before the fused optimizer exists (the first warm-up steps), and for optimizers that are
  captured as they are, the gradients of each dtype are concatenated, all-reduced once, and
  copied back.

Ranks check at their first step that they agree (parameters, optimizer, batch shapes, Step
options) and, when the buckets are made, on the buckets: a disagreement raises
``DistributedError`` on every rank, naming the first difference, instead of hanging in a
collective that never matches. Joining the communicator and the first all-reduce wait at most
``timeout_s``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ._extension import _C
from .errors import DistributedError

DEFAULT_BUCKET_MB = 25.0
DEFAULT_TIMEOUT_S = 300.0
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_step_numbers = itertools.count()  # Steps are made in the same order on every rank


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, device: str | None = None
                     ) -> DistInfo:
    """Joins the job torchrun started: sets this process's GPU to ``LOCAL_RANK`` and initialises
    torch.distributed (gloo for CPU tensors, NCCL for CUDA ones) from torchrun's environment.
    ``device="cpu"`` (or no CUDA) makes a CPU job over gloo alone.

    Safe to call when torch.distributed is already initialised (returns where this process
    sits). Multi-node jobs work the same way: torchrun's rendezvous sets the environment.
    """
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f'init_distributed: device must be None, "cuda" or "cpu"; got {device!r}')
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if not dist.is_initialized() and missing:
        raise DistributedError(
            f"init_distributed needs torchrun's environment, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set. Start the script with "
            "`torchrun --nproc_per_node=N script.py` (add --nnodes/--rdzv-endpoint for several "
            "machines), or call torch.distributed.init_process_group yourself.")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device != "cpu" and torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise DistributedError('init_distributed(device="cuda"), but torch.cuda.is_available() '
                               "is False here")
    if cuda:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise DistributedError(
                f"LOCAL_RANK is {local_rank} but this machine has {count} CUDA GPU(s); start at "
                f"most {count} processes per node (torchrun --nproc_per_node={count}).")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if cuda else None)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def current_world(timeout_s: float = DEFAULT_TIMEOUT_S) -> World | None:
    """The initialised torch.distributed world when it has several ranks, else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return World(dist.get_rank(), dist.get_world_size(),
                 dist.distributed_c10d._get_default_store(), timeout_s)


class World:
    """The ranks of a job as one Step sees them: its rank, their number, and the store through
    which they exchange what they must agree on (keys are private to the Step)."""

    def __init__(self, rank: int, size: int, store, timeout_s: float = DEFAULT_TIMEOUT_S,
                 prefix: str | None = None):
        self.rank, self.size, self.store, self.timeout_s = rank, size, store, timeout_s
        self.prefix = prefix or f"nimble_train/step{next(_step_numbers)}"

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # the store raises its own timeout / connection errors
            raise DistributedError(
                f"rank {self.rank} of {self.size}: waited {self.timeout_s:.0f} s for every rank "
                f"to reach {what}, and some did not ({exc}). A rank crashed, stopped early, or "
                "makes fewer nt.Step objects than the others.") from exc

    def agree(self, what: str, facts: dict[str, Any]) -> None:
        """Every rank publishes `facts`; each compares all ranks against rank 0 and raises
        DistributedError naming the first difference (the same message on every rank)."""
        base = f"{self.prefix}/{what.replace(' ', '_')}"
        self.store.set(f"{base}/{self.rank}", json.dumps(facts, sort_keys=True, default=str))
        keys = [f"{base}/{r}" for r in range(self.size)]
        self._wait(keys, f"the check of the {what}")
        seen = [json.loads(self.store.get(key)) for key in keys]
        for rank, other in enumerate(seen[1:], start=1):
            for field in sorted(set(seen[0]) | set(other)):
                if seen[0].get(field) != other.get(field):
                    raise DistributedError(
                        f"the ranks disagree on the {what}: {field} is {other.get(field)!r} on "
                        f"rank {rank} and {seen[0].get(field)!r} on rank 0. Every rank must build "
                        "the same model and optimizer, pass the same Step options and feed "
                        "batches of the same shape (raised on every rank).")

    def share(self, what: str, value: bytes | None) -> bytes:
        """Rank 0's `value`, on every rank."""
        key = f"{self.prefix}/{what}"
        if self.rank == 0:
            self.store.set(key, value)
        self._wait([key], what)
        return self.store.get(key)


def fingerprint(items: Sequence) -> str:
    """A short digest of a list (parameter shapes, bucket bounds) for cross-rank checks."""
    return hashlib.sha1(json.dumps(list(items), default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------- bucket planning

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


def plan_buckets(offsets: Sequence[int], ready_rank: Sequence[int], element_size: int,
                 bucket_bytes: int, dtype: torch.dtype = torch.float32,
                 last_bucket_bytes: int = LAST_BUCKET_BYTES) -> list[Bucket]:
    """Cuts one flat buffer (segment i is [offsets[i], offsets[i+1])) into buckets of whole
    segments, in the order their gradients become ready: segment i's gradient is the
    ready_rank[i]-th to arrive. Returned sorted by when their last gradient arrives.

    Buckets are slices of the flat buffer, so they follow its order. They are cut from the end
    whose gradients arrive last (the first layers, which the backward reaches last): the last
    bucket's all-reduce has no backward left to hide behind, so it holds at most
    `last_bucket_bytes`, and each bucket before it at most twice the one after, up to
    `bucket_bytes`. A segment larger than its bucket's limit is a bucket alone.
    """
    count = len(offsets) - 1
    if count != len(ready_rank):
        raise ValueError(f"plan_buckets: {count} segments but {len(ready_rank)} ready ranks")
    if bucket_bytes <= 0 or last_bucket_bytes <= 0:
        raise ValueError(f"plan_buckets: bucket_bytes and last_bucket_bytes must be positive; "
                         f"got {bucket_bytes} and {last_bucket_bytes}")
    if count == 0:
        return []
    half = count // 2
    late_first = sum(ready_rank[half:]) < sum(ready_rank[:half]) if half else False
    order = range(count) if late_first else range(count - 1, -1, -1)
    buckets: list[Bucket] = []
    members: list[int] = []
    size = 0
    limit = min(bucket_bytes, last_bucket_bytes)
    for i in order:
        seg = (offsets[i + 1] - offsets[i]) * element_size
        if members and size + seg > limit:
            buckets.append(_bucket(members, offsets, ready_rank, dtype))
            members, size = [], 0
            limit = min(2 * limit, bucket_bytes)
        members.append(i)
        size += seg
    buckets.append(_bucket(members, offsets, ready_rank, dtype))
    return sorted(buckets, key=lambda b: (b.ready_at, b.start))


def _bucket(members, offsets, ready_rank, dtype) -> Bucket:
    members = sorted(members)
    return Bucket(dtype, offsets[members[0]], offsets[members[-1] + 1], members,
                  max(ready_rank[i] for i in members))


# ---------------------------------------------------------------------- runtime


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

    # ---------------------------------------------------------------- set-up

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
    def noting_arrival_order(self, params: Sequence[torch.Tensor]):
        """Around the first backward: notes the order in which gradients arrive (the buckets
        are planned from it); later, does nothing."""
        if self._order is not None:
            yield
            return
        order: dict[int, int] = {}

        def hook(p):
            order.setdefault(id(p), len(order))
        handles = [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self._order = order

    def use_buckets(self, fused) -> None:
        """Plans buckets over the fused optimizer's flat gradient buffers and hooks them; when
        sharded, gives each rank its part of every bucket to update (fused.shard)."""
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
        self.world.agree("gradient buckets", {
            "buckets": fingerprint([(str(b.dtype), b.start, b.stop) for b in self._buckets])})
        for index, bucket in enumerate(self._buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = index
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_ready))
        if self.sharded:
            self._flat_params = dict(fused.flat_params)
            fused.shard(self.pieces())
            fused.reduce_partials = self._sum_

    def pieces(self) -> list[tuple[torch.dtype, int, int, int, int]]:
        """This rank's part of every bucket, in the buckets' order: (dtype, start, stop,
        bucket start, bucket size). Bucket r-th parts go to rank r, as NCCL's reduce-scatter
        and all-gather cut them."""
        n, r = self.world.size, self.world.rank
        out = []
        for b in self._buckets:
            size = b.stop - b.start
            if size % n:
                raise DistributedError(
                    f"a gradient bucket of {size} elements does not split into {n} equal "
                    "parts; the fused optimizer must be built with shard_world equal to the "
                    "number of ranks")
            part = size // n
            out.append((b.dtype, b.start + r * part, b.start + (r + 1) * part, b.start, size))
        return out

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    # ---------------------------------------------------------------- per step

    def begin(self) -> None:
        """Before a backward that uses the buckets."""
        self._remaining = [len(b.params) for b in self._buckets]
        self._launched = 0
        self._active = True

    def _on_ready(self, p: torch.Tensor) -> None:
        if not self._active:
            return
        index = self._bucket_of[id(p)]
        self._remaining[index] -= 1
        if self._remaining[index] == 0:
            # Buckets go out in one fixed order on every rank (NCCL matches collectives by
            # order): a bucket that fills early waits for those planned before it.
            while (self._launched < len(self._buckets)
                   and self._remaining[self._launched] <= 0):
                self._launch(self._buckets[self._launched])
                self._launched += 1

    def _launch(self, bucket: Bucket) -> None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # where the gradient was made
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            if self.sharded:  # this rank's part gets the average; the optimizer updates it
                self.comm.reduce_scatter_(self._flat[bucket.dtype], bucket.start,
                                          bucket.stop - bucket.start, "avg")
            else:
                self.comm.all_reduce_(self._flat[bucket.dtype], bucket.start,
                                      bucket.stop - bucket.start, "avg")

    def finish(self) -> None:
        """After the backward: launches what is left (parameters without a gradient this step)
        and makes the current stream wait for every bucket."""
        for bucket in self._buckets[self._launched:]:
            self._launch(bucket)
        self._launched = len(self._buckets)
        self._active = False
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._check_first()

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
        """Averages the gradients of `params` (one concatenation per dtype); capturable."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            grads = by_dtype[dtype]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.comm is not None:
                self.comm.all_reduce_(flat, 0, flat.numel(), "avg")
            else:
                dist.all_reduce(flat)
                flat.div_(self.world.size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
        self._check_first()

    def _check_first(self) -> None:
        # Once, in an eager step: the host waits (bounded) for the first all-reduce, so a rank
        # that never joins ends the job with a message instead of a hang.
        if self._checked_first or self.comm is None:
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
