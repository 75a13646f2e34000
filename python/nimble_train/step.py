"""nt.Step: a whole training step, captured once as a CUDA graph and replayed.

    step = nt.Step(model, optimizer, loss_fn)
    for batch in loader:
        loss = step(batch)   # one graph launch; a 0-dim device tensor, no host sync

Lifecycle: the first batch fixes the template (shapes, dtypes, devices); the first `warmup`
calls are ordinary eager training steps (on a side stream, with host syncs recorded); the next
call captures the step into a graph-private memory pool and replays it; every later call
copies the batch into the static inputs, stages the learning rates and launches the graph.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch

from . import _capturable
from ._batch import BatchTemplate, StaticBatch
from ._extension import _C
from ._multistream import build_multistream, warn_single_stream
from ._sync import SyncRecorder
from .distributed import DEFAULT_BUCKET_MB, GradientSync, current_world, fingerprint
from .errors import CaptureError, NimbleError, ShapeError, SyncError

_AMP_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
_PARTIAL_BATCH = ("pad", "eager", "error")


class Step:
    """One training iteration of `model` with `optimizer`, captured once and replayed.

    Args:
        model: the module to train (its parameters on one device).
        optimizer: a torch.optim.Optimizer over (some of) the model's parameters. SGD, Adam
            and AdamW are switched to their fused/capturable forms so that learning rates set
            by schedulers reach the graph without recapture.
        loss_fn: ``loss_fn(outputs, target)`` for (inputs, target) batches,
            ``loss_fn(outputs, batch)`` for dict batches; None for dict batches whose model
            returns its own loss. It may return a scalar or one loss per sample; per-sample
            losses let a short last batch be padded and masked inside the graph.
        streams: "auto", or the most CUDA streams to use (1: a single stream).
        warmup: eager iterations before capture (at least 1); they are real training steps.
        amp: None, "bf16" (autocast to bfloat16) or "fp16".
        grad_clip: max global gradient norm, applied on the device; None for no clipping.
        partial_batch: a batch with fewer samples than the first: "pad" (pad and mask, in the
            graph), "eager" (run it eagerly) or "error" (raise ShapeError).
        capture: False runs every step eagerly with the same semantics (debugging, CPU).
        bucket_mb: in a data-parallel job (torch.distributed initialised with several ranks,
            e.g. by ``nt.init_distributed()`` under torchrun), the largest size of the gradient
            buckets that are all-reduced while the backward goes on. The last buckets to fill
            are smaller (1 MiB for the very last, doubling back toward ``bucket_mb``): what is
            all-reduced after the backward ends is not hidden by it.
        shard_optimizer: in a data-parallel job on GPUs, shard the optimizer's state across
            the ranks (ZeRO stage 1): each bucket's gradients are reduce-scattered instead of
            all-reduced, each rank updates its part with the fused kernels and keeps only that
            part's state (1/N of it), and the parameters are all-gathered after the update, all
            inside the graph. Needs a fused optimizer (SGD, Adam, AdamW) and capture.
            ``p.grad`` then holds the averaged gradient only in this rank's parts, and
            ``optimizer.state_dict()`` needs :meth:`consolidate_optimizer_state` on every rank
            first. With one process it changes nothing.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        streams: str | int = "auto",
        warmup: int = 3,
        amp: str | None = None,
        grad_clip: float | None = None,
        partial_batch: str = "pad",
        capture: bool = True,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        shard_optimizer: bool = False,
    ):
        _validate_arguments(model, optimizer, loss_fn, streams, warmup, amp, grad_clip,
                            partial_batch, capture)
        if not (isinstance(bucket_mb, (int, float)) and 0 < bucket_mb < float("inf")):
            raise ValueError(f"bucket_mb must be a positive number of megabytes; got {bucket_mb!r}")
        if not isinstance(shard_optimizer, bool):
            raise ValueError(f"shard_optimizer must be True or False; got {shard_optimizer!r}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.streams = streams
        self.warmup = warmup
        self.amp = amp
        self.grad_clip = grad_clip
        self.partial_batch = partial_batch
        self.capture = capture

        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._device = _single_device(model, self._params)
        self._cuda = self._device.type == "cuda"
        self._will_capture = capture and self._cuda
        if self._will_capture and not _C.has_cuda():
            raise NimbleError(
                f"Step needs nimble_train's CUDA runtime to capture on {self._device}, but this "
                f"build has none ({_C.build_info()['cuda']['reason']}). Rebuild it "
                "(pip install --no-build-isolation -e .) or pass capture=False."
            )
        self._fused = None   # the FusedOptimizer, from the first capture on (see _fuse)
        self._scaler = None  # fp16: DeviceLossScaler with the fused update
        self._grad_scaler = None  # fp16: torch's GradScaler for eager steps
        self._fuse_reason, self._staged_lr = self._choose_update(optimizer, amp)
        self._stream = None  # warm-up and capture run on this side stream

        self._template: BatchTemplate | None = None
        self._static: StaticBatch | None = None
        self._per_sample: bool | None = None  # does loss_fn return one loss per sample?
        self._sync = SyncRecorder() if self._cuda else None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._multistream = None  # the forward on several streams, once planned
        self._single_stream_reason: str | None = None
        self._scalars = None
        self._static_loss: torch.Tensor | None = None
        self._baked: list[dict] | None = None
        self._capture_error: BaseException | None = None
        self._counts = {"steps": 0, "eager_steps": 0, "replays": 0, "captures": 0}
        self._graph_nodes: int | None = None
        self._pool_bytes: int | None = None
        world = current_world()
        self._gradsync = None
        if world:
            if shard_optimizer:
                self._check_shardable()
            self._gradsync = GradientSync(world, self._device, bucket_mb, shard=shard_optimizer)
        self.shard_optimizer = shard_optimizer
        self._closed = False

    # ------------------------------------------------------------------ public API

    def __call__(self, batch: Any) -> torch.Tensor:
        """Runs one training step on `batch`; returns the loss (valid until the next call)."""
        if self._closed:
            raise NimbleError("this Step was closed (Step.close() released its graph and "
                              "communicator); make a new nt.Step to train further")
        if self._template is None:
            template = _checked_first_template(batch, self._device)
            if self._gradsync is not None:
                self._join_ranks(template)
            self._template = template
        leaves, samples = self._template.check(batch)
        short = samples < self._template.batch_size
        if short and self.partial_batch == "error":
            raise ShapeError(
                f"this batch has {samples} samples, fewer than the {self._template.batch_size} "
                'of the first batch, and partial_batch="error"; drop the last batch '
                '(drop_last=True) or use partial_batch="pad" or "eager"'
            )

        in_warmup = self._counts["steps"] < self.warmup
        if self._needs_fusing and self._counts["steps"] == max(self.warmup - 1, 1):
            # The flat buffers give parameters and gradients new addresses and this step
            # warms them up: cuDNN and cuBLAS meet them before capture (their caches are keyed
            # by alignment, and nothing can be autotuned inside a capture). The steps before
            # showed which parameters get gradients. With warmup=1 this is one extra step.
            self._fuse()
            in_warmup = True
        if in_warmup or not self._will_capture or self._capture_error:
            loss = self._eager_or_padded(batch, leaves, samples, short, in_warmup)
        elif short and not self._can_pad():
            loss = self._eager_step(batch, samples)
        else:
            if self._graph is None or self._hyperparameters_changed():  # as-is optimizers
                self._capture_graph(leaves, samples)  # copies the batch in
            else:
                self._static.copy_in(leaves, samples)
            loss = self._launch(samples)
        self._counts["steps"] += 1
        return loss

    def stats(self) -> dict:
        """What the step has done and holds: capture state, streams, graph size, pool, calls."""
        records = self._sync.records if self._sync else []
        return {
            "captured": self._graph is not None,
            "streams": self._multistream.num_streams if self._multistream else 1,
            "syncs": self._multistream.num_syncs if self._multistream else 0,
            "traced_ops": len(self._multistream.graph.nodes) if self._multistream else None,
            "single_stream_reason": self._single_stream_reason,
            "graph_nodes": self._graph_nodes,
            "pool_bytes": self._pool_bytes,
            "warmup_left": max(0, self.warmup - self._counts["steps"])
            + (self.warmup == 1 and self._needs_fusing),
            "host_syncs_in_warmup": [str(r) for r in records],
            "capture_error": None if self._capture_error is None else str(self._capture_error),
            "world_size": self._gradsync.world.size if self._gradsync else 1,
            "buckets": self._gradsync.num_buckets if self._gradsync else 0,
            "optimizer_shards": (self._gradsync.world.size
                                 if self._gradsync and self._gradsync.sharded else 1),
            "optimizer_state_bytes": self._fused.state_bytes if self._fused else None,
            "optimizer": ("fused" if self._fused else
                          "captured as-is" if self._fuse_reason else "eager"),
            **self._counts,
        }

    # ------------------------------------------------------------------ eager paths

    def _eager_or_padded(self, batch, leaves, samples, short, in_warmup) -> torch.Tensor:
        """Steps that are not replays: warm-up, capture=False, CPU, or after a failed capture."""
        if short and not self._will_capture and self._can_pad():
            # The padded, masked computation the graph would run, done eagerly: on CPU and
            # with capture=False a short batch sees the semantics of the captured step.
            return self._padded_eager_step(leaves, samples)
        return self._eager_step(batch, samples, in_warmup)

    def _eager_step(self, batch, samples: int, in_warmup: bool = False) -> torch.Tensor:
        with self._warmup_context(in_warmup):
            self._zero_grad()
            loss = self._loss(batch, samples, None)
            self._backward_and_update(loss)
        self._counts["eager_steps"] += 1
        return loss.detach()

    def _padded_eager_step(self, leaves, samples: int) -> torch.Tensor:
        static = self._static_batch(leaves, samples)
        self._zero_grad()
        valid = torch.tensor(float(samples), device=self._device)
        loss = self._loss(static.batch, self._template.batch_size, valid)
        self._backward_and_update(loss)
        self._counts["eager_steps"] += 1
        return loss.detach()

    def _join_ranks(self, template: BatchTemplate) -> None:
        """Data parallel: checks that every rank runs the same step, then connects them."""
        params = [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in self._params]
        self._gradsync.world.agree("model, optimizer and Step options", {
            "parameters": f"{len(params)} tensors, {sum(p.numel() for p in self._params)} "
                          f"elements, digest {fingerprint(params)}",
            "optimizer": f"{type(self.optimizer).__qualname__} with "
                         f"{len(self.optimizer.param_groups)} param group(s)",
            "batch": [(leaf.path, leaf.shape, str(leaf.dtype)) for leaf in template.leaves],
            "options": {"streams": self.streams, "warmup": self.warmup, "amp": self.amp,
                        "grad_clip": self.grad_clip, "partial_batch": self.partial_batch,
                        "capture": self.capture, "bucket_mb": self._gradsync.bucket_mb,
                        "shard_optimizer": self._gradsync.sharded, "device": self._device.type},
        })
        self._gradsync.connect()

    def consolidate_optimizer_state(self) -> None:
        """With ``shard_optimizer=True``, gathers the whole optimizer state into
        ``optimizer.state`` on every rank, so that ``optimizer.state_dict()`` (a checkpoint)
        holds all of it, until the next step. A collective: call it on every rank, then save
        on one. Does nothing when the state is not sharded."""
        if self._fused is not None and self._gradsync is not None and self._gradsync.sharded:
            self._fused.consolidate(self._gradsync.gather)

    def _check_shardable(self) -> None:
        from .optim import LAMB

        why = None
        if not self._cuda:
            why = f"the model is on {self._device}; the shards are reduced and gathered by NCCL"
        elif not self.capture:
            why = "capture=False: the sharded update is the fused one, which capture sets up"
        elif self._fuse_reason is not None:
            why = f"the optimizer cannot be fused ({self._fuse_reason})"
        elif isinstance(self.optimizer, LAMB):
            why = "LAMB's trust ratio needs each whole parameter's norms, which a shard lacks"
        if why:
            raise ValueError(f"shard_optimizer=True needs CUDA GPUs, capture and a fused SGD, "
                             f"Adam or AdamW; here {why}. Pass shard_optimizer=False.")

    def close(self) -> None:
        """Releases the graph and, in a data-parallel job, the NCCL communicator (every rank
        should call it, or let the Step go, before the process group is destroyed)."""
        if self._graph is not None and self._cuda:
            torch.cuda.synchronize(self._device)
        self._graph = None
        self._static_loss = None
        if self._gradsync is not None:
            self._gradsync.close()
        self._closed = True

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        return self._stream

    @contextlib.contextmanager
    def _warmup_context(self, in_warmup: bool):
        if not (in_warmup and self._cuda):
            yield
            return
        # Warm-up runs on the stream capture will use: lazily made per-stream state (cuBLAS
        # and cuDNN workspaces, optimizer state) then exists before capture, outside its pool.
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side), self._sync:
            yield
        torch.cuda.current_stream(self._device).wait_stream(side)

    # ------------------------------------------------------------------ the step's body

    def _loss(self, batch, batch_size: int, valid: torch.Tensor | None,
              model: Callable | None = None) -> torch.Tensor:
        """Forward and loss. `valid` (a 0-dim float tensor) masks rows at or past it."""
        with self._autocast():
            outputs, losses = self._forward(batch, model or self.model)
        per_sample = self._classify_loss(losses, batch_size)
        if not per_sample:
            return losses
        losses = losses.float()
        if valid is None:
            return losses.mean()
        keep = torch.arange(batch_size, device=losses.device) < valid
        # where, not a product: a padded row's loss may be inf or NaN, and 0 * NaN is NaN.
        return torch.where(keep, losses, 0.0).sum() / valid

    def _forward(self, batch, model: Callable):
        if isinstance(batch, dict):
            outputs = model(**batch)
            if self.loss_fn is not None:
                return outputs, self.loss_fn(outputs, batch)
            return outputs, _own_loss(outputs)
        inputs, target = batch
        outputs = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        return outputs, self.loss_fn(outputs, target)

    def _classify_loss(self, losses, batch_size: int) -> bool:
        if not isinstance(losses, torch.Tensor):
            raise TypeError(f"the loss must be a tensor; got {type(losses).__name__}")
        if losses.dim() == 0:
            kind = False
        elif losses.dim() == 1 and losses.shape[0] == batch_size:
            kind = True
        else:
            raise ValueError(
                "loss_fn must return a scalar or one loss per sample (shape "
                f"[{batch_size}]); got shape {tuple(losses.shape)}. Reduce it yourself, or "
                "return per-sample losses (e.g. reduction='none')."
            )
        if self._per_sample is None:
            self._per_sample = kind
        return kind

    def _zero_grad(self) -> None:
        if self._fused is not None:
            self._fused.zero_grad()  # one memset per flat gradient buffer
        else:
            # After capture, gradients live in the graph's pool: zero them in place, so that
            # p.grad keeps pointing at the tensors the replays write.
            self.optimizer.zero_grad(set_to_none=self._graph is None)

    def _backward_and_update(self, loss: torch.Tensor) -> None:
        sync = self._gradsync
        if self._fused is not None:
            if sync is not None:
                sync.begin()  # buckets are all-reduced as their gradients arrive
            if self._scaler is None:
                loss.backward()
            else:
                self._scaler.scale_loss(loss).backward()
            if sync is not None:
                sync.finish()  # the update waits for every bucket
            if self._scaler is None:
                self._fused.step(max_grad_norm=self.grad_clip)  # clipping fused in
            else:
                # Unscale, clip and the overflow skip inside the update; the scale moves on the
                # device: no host sync anywhere.
                self._scaler.step(self._fused, max_grad_norm=self.grad_clip)
            if sync is not None:
                sync.after_update()  # sharded: every rank gets every updated part
            return
        scaler = self._grad_scaler
        with (sync.noting_arrival_order(self._params) if sync is not None and self._needs_fusing
              else contextlib.nullcontext()):
            (scaler.scale(loss) if scaler else loss).backward()
        if sync is not None:
            sync.all_reduce_grads(self._params)  # (scaled) gradients, before clip and update
        # The update is ours, not the user's code: its syncs (GradScaler's) are not recorded.
        with self._sync.paused() if self._sync else contextlib.nullcontext():
            if self.grad_clip is not None:
                if scaler:
                    scaler.unscale_(self.optimizer)
                # foreach norms, clamped factor as a device tensor: no host sync, capturable.
                torch.nn.utils.clip_grad_norm_(self._params, self.grad_clip, foreach=self._cuda)
            if scaler:
                scaler.step(self.optimizer)
                scaler.update()
            else:
                self.optimizer.step()

    def _choose_update(self, optimizer, amp):
        """How the update runs: returns (why it cannot be fused or None, staged_lr).

        A captured step fuses SGD, Adam, AdamW and LAMB (FusedOptimizer, at the first capture:
        warm-up tells which parameters get gradients); other optimizers are captured as they
        are, with staged_lr saying which param groups read their lr from DeviceScalars.
        """
        from .optim import FusedOptimizer

        if amp == "fp16" and not (self._will_capture and self._cuda):
            self._grad_scaler = torch.amp.GradScaler(self._device.type)
        if not self._will_capture:
            return None, []
        reason = FusedOptimizer.why_unsupported(optimizer)
        if reason is None:
            if amp == "fp16":
                self._grad_scaler = torch.amp.GradScaler("cuda")  # warm-up steps are eager
            return None, [False] * len(optimizer.param_groups)
        if amp == "fp16":
            raise NotImplementedError(
                'amp="fp16" in a captured step needs a fused optimizer for its device-side loss '
                f"scale, and this one cannot be fused: {reason}. Use amp=\"bf16\", SGD, Adam, "
                "AdamW or nimble_train.optim.LAMB, or capture=False.")
        warnings.warn(
            f"nimble_train.Step captures the optimizer's own step(), which is slower than the "
            f"fused update (one kernel per tensor group, hyper-parameters other than lr baked "
            f"into the graph): {reason}.", stacklevel=3)
        return reason, _capturable.make_capturable(optimizer)

    @property
    def _needs_fusing(self) -> bool:
        return self._will_capture and self._fused is None and self._fuse_reason is None

    def _fuse(self) -> None:
        """Moves the update to FusedOptimizer before the first capture.

        Parameters that got no gradient in warm-up are left out, as torch.optim skips them;
        state made by the eager warm-up steps is carried into the flat buffers, and the fp16
        loss scale from torch's GradScaler into the device-side scaler.
        """
        from .optim import DeviceLossScaler, FusedOptimizer

        unused = frozenset(id(p) for p in self._params if p.grad is None)
        shards = self._gradsync.world.size if self._gradsync and self._gradsync.sharded else 1
        self._fused = FusedOptimizer(self.optimizer, exclude=unused, shard_world=shards)
        if self._gradsync is not None:
            self._gradsync.use_buckets(self._fused)
        if self._grad_scaler is not None:
            self._scaler = DeviceLossScaler(self._device)
            self._scaler.load_state_dict(self._grad_scaler.state_dict())
            self._grad_scaler = None

    def _autocast(self):
        dtype = _AMP_DTYPES[self.amp]
        if dtype is None:
            return contextlib.nullcontext()
        # The autocast cache would keep casts made during capture alive across replays.
        return torch.autocast(self._device.type, dtype=dtype, cache_enabled=False)

    def _can_pad(self) -> bool:
        """A short batch can be padded when losses are per sample and no layer sees the batch."""
        return (self.partial_batch == "pad" and self._per_sample is not False
                and not _has_batch_statistics(self.model))

    def _static_batch(self, leaves, samples: int) -> StaticBatch:
        if self._static is None:
            self._static = StaticBatch(self._template, leaves, samples)
        else:
            self._static.copy_in(leaves, samples)
        return self._static

    # ------------------------------------------------------------------ capture and replay

    def _plan_streams(self) -> None:
        """Traces and plans the forward on several streams, once, at the first capture."""
        if self._multistream is not None or self._single_stream_reason is not None:
            return
        self._multistream, self._single_stream_reason = build_multistream(
            self.model, self.streams, self._device)
        if self._multistream is None and self.streams != 1:
            warn_single_stream(self._single_stream_reason)

    def _capture_graph(self, leaves, samples: int) -> None:
        static = self._static_batch(leaves, samples)
        self._plan_streams()
        if self._scalars is None:
            # One slot per staged learning rate, and the number of valid samples last.
            self._scalars = _C.DeviceScalars(sum(self._staged_lr) + 1, self._device)
        self._graph = None
        self._static_loss = None
        saved_grads = [p.grad for p in self._params]
        saved_lrs = [group["lr"] for group in self.optimizer.param_groups]
        values = self._scalars.values
        staged = iter(range(len(values) - 1))
        for group, is_staged in zip(self.optimizer.param_groups, self._staged_lr):
            if is_staged:
                group["lr"] = values[next(staged)]
        graph = _new_graph()
        pool = torch.cuda.graph_pool_handle()  # a fresh private pool for every capture
        try:
            if self._fused is None:
                self.optimizer.zero_grad(set_to_none=True)  # gradients are made in the graph
            # An earlier graph's pool dies with that graph.
            with torch.cuda.graph(graph, pool=pool, stream=self._side_stream(),
                                  capture_error_mode="thread_local"):
                self._scalars.fetch()
                if self._fused is not None:
                    self._fused.zero_grad()  # inside: replays never accumulate gradients
                loss = self._loss(static.batch, self._template.batch_size, values[-1],
                                  self._multistream)
                self._backward_and_update(loss)
                if self._multistream is not None:
                    # Every side stream rejoins the capture stream before capture ends.
                    self._multistream.join()
            if hasattr(graph, "instantiate") and getattr(graph, "_nt_keep_graph", False):
                graph.instantiate()
        except Exception as exc:
            for p, grad in zip(self._params, saved_grads):
                p.grad = grad
            _abandon_capture(pool, self._device)
            failure = self._capture_failure(exc)
            if self._multistream is not None and not isinstance(failure, SyncError):
                # The plan's streams are an optimisation: try once more on one stream.
                self._multistream = None
                self._single_stream_reason = (
                    f"capture on several streams failed ({_root_message(exc)})")
                warn_single_stream(self._single_stream_reason)
                retry = True
            else:
                self._capture_error = exc
                raise failure from exc
        else:
            retry = False
        finally:
            for group, lr in zip(self.optimizer.param_groups, saved_lrs):
                group["lr"] = lr
        if retry:
            return self._capture_graph(leaves, samples)
        self._graph = graph
        self._static_loss = loss.detach()
        if self._fused is None:
            self._baked = _capturable.hyperparameters(self.optimizer, self._staged_lr)
        self._counts["captures"] += 1
        self._warn_if_recapturing_often()
        self._pool_bytes = _pool_bytes(graph, self._device)
        self._graph_nodes = _node_count(graph)

    def _launch(self, samples: int) -> torch.Tensor:
        """Stages this step's scalars and launches the graph: the whole replay path."""
        values = [_capturable.host_lr(group)
                  for group, staged in zip(self.optimizer.param_groups, self._staged_lr)
                  if staged]
        self._scalars.stage(values + [float(samples)])
        if self._fused is not None:
            self._fused.stage_host_values()  # this step's hyper-parameters, for the graph
        try:
            self._graph.replay()
        except BaseException:
            self._scalars.unstage()
            raise
        self._counts["replays"] += 1
        return self._static_loss

    def _warn_if_recapturing_often(self) -> None:
        captures, steps = self._counts["captures"], self._counts["steps"]
        if captures == 4 and steps < 4 * (self.warmup + 20):
            warnings.warn(
                f"Step has captured its graph {captures} times in {steps} steps: optimizer "
                "hyper-parameters other than lr (momentum, betas, weight decay, ...) changed "
                f"between steps, and {type(self.optimizer).__name__} bakes them into the graph. "
                "Keep them fixed (e.g. OneCycleLR(cycle_momentum=False)); each change costs a "
                "capture.", stacklevel=3)

    def _hyperparameters_changed(self) -> bool:
        if self._fused is not None:
            return False  # the fused update reads every hyper-parameter on the device
        now = _capturable.hyperparameters(self.optimizer, self._staged_lr)
        return not _capturable.same_hyperparameters(now, self._baked)

    def _capture_failure(self, exc: BaseException) -> NimbleError:
        cause = _root_message(exc)
        records = self._sync.records if self._sync else []
        sync_like = any(s in cause for s in ("capturing", "StreamCapture", "capture"))
        if records and sync_like:
            found = "\n".join(f"  - {r}" for r in records)
            return SyncError(
                "capturing the step failed because it synchronises with the host; warm-up saw "
                f"these host syncs:\n{found}\nKeep values on the device (no .item(), .cpu(), "
                "printing CUDA tensors or data-dependent shapes such as nonzero / boolean "
                "indexing inside the step), or pass capture=False. The model and optimizer "
                "are as after the last step; later calls run eagerly. Cause: " + cause
            )
        return CaptureError(
            f"capturing the step as a CUDA graph failed: {cause}. The model and optimizer are "
            "as after the last completed step; later calls run eagerly (capture=False does "
            "that from the start)."
        )


# ---------------------------------------------------------------------- helpers


def _validate_arguments(model, optimizer, loss_fn, streams, warmup, amp, grad_clip,
                        partial_batch, capture) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None; got {type(loss_fn).__name__}")
    if not (streams == "auto" or (isinstance(streams, int) and not isinstance(streams, bool)
                                  and streams >= 1)):
        raise ValueError(f'streams must be "auto" or an int >= 1; got {streams!r}')
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(
            f"warmup must be an int >= 1 (eager steps before capture create optimizer state "
            f"and pick cuDNN algorithms); got {warmup!r}")
    if amp not in _AMP_DTYPES:
        raise ValueError(f'amp must be None, "bf16" or "fp16"; got {amp!r}')
    if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
        raise ValueError(f"grad_clip must be None or a positive number; got {grad_clip!r}")
    if partial_batch not in _PARTIAL_BATCH:
        raise ValueError(f'partial_batch must be "pad", "eager" or "error"; got {partial_batch!r}')
    if not isinstance(capture, bool):
        raise TypeError(f"capture must be True or False; got {capture!r}")


def _single_device(model: torch.nn.Module, params: list[torch.Tensor]) -> torch.device:
    devices = {p.device for p in list(model.parameters()) + params}
    if len(devices) != 1:
        raise ValueError(
            "Step trains a model whose parameters all live on one device; got parameters on "
            f"{sorted(str(d) for d in devices)}. Move the model with model.to(device) before "
            "building the optimizer." if devices else
            "the model and optimizer have no parameters; there is nothing to train")
    return devices.pop()


def _checked_first_template(batch: Any, device: torch.device) -> BatchTemplate:
    if not isinstance(batch, (tuple, list, dict)):
        raise TypeError(
            "a batch must be a tuple/list (inputs, target) or a dict of model inputs; got "
            f"{type(batch).__name__}")
    if not isinstance(batch, dict) and len(batch) != 2:
        raise TypeError(
            f"a tuple/list batch must be (inputs, target); got {len(batch)} items. Wrap "
            "several inputs in a tuple: ((x1, x2), target).")
    template = BatchTemplate(batch)
    for leaf in template.tensor_leaves:
        if leaf.device != device:
            raise ShapeError(
                f"{leaf.path} is on {leaf.device} but the model is on {device}; move batches "
                f"to the model's device (x.to('{device}', non_blocking=True)), or keep the "
                "dataset there")
    return template


def _own_loss(outputs) -> torch.Tensor:
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if loss is None and isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        loss = outputs
    if loss is None:
        raise TypeError(
            "with no loss_fn, the model must return its own loss (outputs.loss, "
            f"outputs['loss'] or a 0-dim tensor); got {type(outputs).__name__}. Pass labels "
            "in the batch so the model computes it, or give Step a loss_fn.")
    return loss


def _has_batch_statistics(model: torch.nn.Module) -> bool:
    """Layers whose training-mode output or running statistics depend on the whole batch."""
    from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

    for m in model.modules():
        if isinstance(m, _NormBase) and m.training:
            if isinstance(m, _BatchNorm) or m.track_running_stats:
                return True
    return False


def _abandon_capture(pool, device: torch.device) -> None:
    """Undoes what a failed capture left behind, so eager training can go on.

    A capture that fails inside cudaStreamEndCapture (a host sync invalidated it) stops
    torch's capture_end before its bookkeeping: the caching allocator still routes this
    thread's allocations to the graph's pool (destroying any MemPool later aborts the process
    on an internal assert), the pool is never released, and the default CUDA generator still
    believes it is being captured (every later dropout fails with "Offset increment outside
    graph capture"). End the allocation to the pool and release it, then run a trivial
    capture, whose prologue and epilogue reset the generator.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:
        pass  # capture_end got that far, and the graph releases its pool itself
    else:
        torch._C._cuda_releasePool(index, pool)
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.empty(1, device=device).zero_()
    except Exception as exc:  # the original failure is what the user needs to see
        warnings.warn(f"could not reset the CUDA generator after a failed capture: {exc}")


def _new_graph() -> torch.cuda.CUDAGraph:
    """A graph that keeps its cudaGraph_t, so its nodes can be counted, where torch allows."""
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        graph._nt_keep_graph = True
    except TypeError:
        graph = torch.cuda.CUDAGraph()
    return graph


def _pool_bytes(graph, device: torch.device) -> int | None:
    """Bytes of the segments of the graph's private memory pool."""
    pool = tuple(graph.pool())
    index = device.index if device.index is not None else torch.cuda.current_device()
    segments = [seg for seg in torch.cuda.memory_snapshot()
                if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) == pool]
    return sum(seg["total_size"] for seg in segments) if segments else None


def _node_count(graph) -> int | None:
    if not getattr(graph, "_nt_keep_graph", False):
        return None
    try:
        return _C.graph_node_count(int(graph.raw_cuda_graph()))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _root_message(exc: BaseException) -> str:
    """The first error of a chain: capture_end's own failure often hides the real cause."""
    seen = exc
    while seen.__context__ is not None and seen.__context__ is not seen:
        seen = seen.__context__
    text = f"{type(seen).__name__}: {seen}".strip()
    return text.splitlines()[0] if text else type(seen).__name__
