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

This module: joining the job (init_distributed) and the ranks' agreement (World). The gradient
buckets and their all-reduce are in _gradsync.py.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import _torch_private
from .errors import DistributedError, one_line

DEFAULT_BUCKET_MB = 25.0
DEFAULT_TIMEOUT_S = 300.0
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_step_numbers = itertools.count()  # Steps are made in the same order on every rank
FAILURE_KEY = "nimble_train/failure"  # the first rank whose step failed says why


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
        _torch_private.import_before_process_group()  # so that destroy_process_group ends it
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if cuda else None)
    global _job_timeout_s
    _job_timeout_s = float(timeout_s)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


_job_timeout_s = DEFAULT_TIMEOUT_S  # every wait across ranks: init_distributed(timeout_s=...)


def current_world(timeout_s: float | None = None) -> World | None:
    """The initialised torch.distributed world when it has several ranks, else None. Its
    waits end after `timeout_s`, by default init_distributed's."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return World(dist.get_rank(), dist.get_world_size(), _torch_private.default_store(),
                 _job_timeout_s if timeout_s is None else timeout_s)


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
                f"to reach {what}, and some did not ({exc}).{self.peer_failure()} A rank "
                "crashed, stopped early, or makes fewer nt.Step objects than the others "
                "(the wait is init_distributed's timeout_s).") from exc

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

    def collective(self, what: str, run: Callable[[], Any]) -> Any:
        """Runs a torch.distributed collective; its failure (a peer that crashed, or none that
        came within the process group's timeout) becomes a DistributedError naming this rank,
        the phase and, when a peer said so, the rank that failed first."""
        try:
            return run()
        except (RuntimeError, ValueError) as exc:  # gloo and NCCL raise these
            cause = one_line(exc) or type(exc).__name__
            raise DistributedError(
                f"rank {self.rank} of {self.size}: {what} failed ({cause}).{self.peer_failure()} "
                "Every rank must keep stepping together; the job cannot go on.") from exc

    def tell_peers(self, error: BaseException) -> None:
        """Publishes why this rank's step failed, for the peers' errors (best effort: the store
        may be gone with the process that served it)."""
        try:
            self.store.set(FAILURE_KEY, f"rank {self.rank}: {type(error).__name__}: "
                                        f"{one_line(error)}")
        except Exception:
            pass

    def peer_failure(self) -> str:
        try:
            if self.store.check([FAILURE_KEY]):
                return f" First failure: {self.store.get(FAILURE_KEY).decode()}."
        except Exception:
            pass
        return ""

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
