"""nt.Step: a whole training step, captured once as a CUDA graph and replayed.

A Step moves through phases, held in one field and changed in one place (``_enter``):

    TEMPLATE --first batch--> WARMUP --warmup steps--> CAPTURE --capture--> REPLAY
        |                                                  |
        +--capture=False, or the CPU--> EAGER <--a failed capture
    any phase --close()--> CLOSED

TEMPLATE: the first batch fixes shapes, dtypes and devices. WARMUP: ordinary eager training
steps on the capture's side stream, host syncs recorded; the update moves to the fused
optimizer before the last one. CAPTURE: the next batch is captured (through the C++ runtime,
_capture.py) and launched. REPLAY: a call is the flatten of the batch, the staged values read
from param_groups, and one C++ call that checks and copies the batch in, stages the values and
launches the graph. EAGER: every call is an eager step with the same semantics. A short batch
that cannot be padded (BatchNorm, a scalar loss) runs eagerly in any phase.

With ``accumulate=K`` the calls of a window of K differ (see _iteration.Call): the first zeroes
the gradients, the last all-reduces, clips and updates; each kind is a graph of its own over
the same static inputs, captured the first time it is needed, all in one pool.

With ``buckets`` (_buckets.py) every bucket has static inputs of its own and a graph per kind
of call; every step, eager ones included, runs on the batch padded to its bucket. When a kind
is first captured it is captured for every bucket at once, largest first: the pool then grows
to the largest bucket's working memory and the others reuse it, and a bucket's first batch is
already a replay. A bucket no eager step has met whose capture fails (cuDNN autotuning a shape
it has not seen, a compiler meeting a new shape) is deferred: its next batch runs eagerly and
the one after captures it.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from typing import Any, Callable

import torch

from . import _options, _torch_private
from ._buckets import BucketLayout, Buckets, check_buckets
from ._capture import CapturedStep
from ._ema import EMA, check_decay, unique_tensors
from ._evaluator import Evaluator
from ._extension import _C
from ._gradsync import GradientSync
from ._iteration import Call, Iteration, LateGradient, autocast_name, model_arguments
from ._model_watch import ModelWatch, refuse_replaced, warn_replays_keep
from ._multistream import traced_submodule
from ._padding import BucketPadding, mixing_reason
from ._sync import SyncRecorder
from ._update import Update
from ._window import Window
from .distributed import DEFAULT_BUCKET_MB, current_world
from .errors import DistributedError, NimbleError
from .optim.fused import in_flat_buffers


class Phase(enum.Enum):
    TEMPLATE = "template"
    WARMUP = "warm-up"
    CAPTURE = "capture"
    REPLAY = "replay"
    EAGER = "eager"
    CLOSED = "closed"


class Step:
    """One training iteration of `model` with `optimizer`, captured once and replayed::

        step = nt.Step(model, optimizer, loss_fn)
        for batch in loader:
            loss = step(batch)   # one graph launch; a 0-dim device tensor, no host sync

    Args:
        model: the module to train (its parameters on one device); compiled or not
            (torch.compile(model), or model.compile() in place), without inductor's CUDA
            graphs (not mode="reduce-overhead"): Step's graph replaces them.
        optimizer: a torch.optim.Optimizer over (some of) the model's parameters. SGD, Adam,
            AdamW and nimble_train.optim.LAMB are fused in the graph (every hyper-parameter
            read on the device); others are captured as they are.
        loss_fn: ``loss_fn(outputs, target)`` for (inputs, target) batches, ``loss_fn(outputs,
            batch)`` for dict batches; None when the model returns its own loss. A scalar, or
            one loss per sample (a short last batch is then padded and masked in the graph).
        streams: "auto", or the most CUDA streams the forward's plan may use (1: a single
            stream for the whole step). Beyond 1, the weight gradients of convolutions and
            linear layers also leave the backward's critical path for a side stream (in a
            compiled model, the convolutions' for two, as inductor compiles its backward in
            the first calls).
        warmup: eager iterations before capture (at least 1); they are real training steps
            (with accumulation and an optimizer captured as it is, at least one window).
        amp: None, "bf16" (autocast to bfloat16) or "fp16" (loss scale kept on the device).
        grad_clip: max global gradient norm, applied on the device; None for no clipping.
        partial_batch: a batch with fewer samples than the first: "pad" (pad and mask, in the
            graph), "eager" (run it eagerly) or "error" (raise ShapeError).
        capture: False runs every step eagerly with the same semantics (debugging, CPU).
        bucket_mb: data parallel (torchrun): the largest gradient bucket all-reduced while the
            backward goes on; the last buckets are smaller (1 MiB for the very last).
        shard_optimizer: data parallel on GPUs: ZeRO stage 1 inside the graph (each rank keeps
            1/N of the optimizer state; see :meth:`consolidate_optimizer_state`). LAMB too: the
            ranks add their parts of each tensor's norms before its trust ratio.
        accumulate: K micro-batches per optimizer update, one call each: calls 1..K-1 run the
            forward and backward into the accumulated gradients, call K also all-reduces,
            clips, updates and (next call) zeroes; :attr:`stepped` says which calls updated.
            Each micro-batch's loss weighs its valid samples over the window's: with full
            micro-batches that is ``loss / K``; with a short (padded or eager) one and
            per-sample losses, the update equals one step on the window's samples together.
            A scalar loss is weighted 1/K, as ``(loss / K).backward()``.
        buckets: None, or nt.Buckets(sizes=(64, 128, 256, 512), dim=1, pad_values={"labels":
            -100}): a batch whose length along `dim` fits a bucket is padded to the smallest
            that fits and runs on that bucket's graph (all in one pool). Exact when the model
            masks padded positions (attention mask 0, labels -100). Longer than the largest
            bucket: ShapeError. :meth:`stats` has each bucket's captures and replays.
        ema: None, or a decay in (0, 1): after each update the graph moves an exponential
            moving average of the weights (and floating-point buffers) towards them; see
            :meth:`ema_weights`, :meth:`ema_state_dict`.
        init_sync: data parallel: at the first step every rank takes rank 0's parameters and
            buffers (as DDP does when it is built); False keeps each rank's own.
        overlap_update: data parallel on GPUs: the captured step updates each gradient bucket
            (sharded: this rank's part, then its all-gather) on the communication stream right
            after its collective, while the backward goes on (LAMB too: each bucket's trust
            ratios from its own tensors' norms; sharded, the ranks add their parts of them
            first, bucket by bucket). With grad_clip or the fp16 loss scale the update needs
            every gradient first: each bucket's share of the gradient norm and overflow check
            is taken there instead, and the update follows the backward. :meth:`stats` says
            which ("update_in_buckets") or why neither. False: after the backward, as one pass.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[..., torch.Tensor] | None = None, *,
                 streams: str | int = "auto", warmup: int = 3, amp: str | None = None,
                 grad_clip: float | None = None, partial_batch: str = "pad",
                 capture: bool = True, bucket_mb: float = DEFAULT_BUCKET_MB,
                 shard_optimizer: bool = False, buckets: Buckets | None = None,
                 accumulate: int = 1, ema: float | None = None, init_sync: bool = True,
                 overlap_update: bool = True):
        _options.validate(model, optimizer, loss_fn, streams, warmup, amp, grad_clip,
                          partial_batch, capture, bucket_mb, shard_optimizer)
        _options.check_accumulate(accumulate)
        check_buckets(buckets)
        check_decay(ema)
        if not isinstance(init_sync, bool):
            raise TypeError(f"init_sync must be True or False; got {init_sync!r}")
        if not isinstance(overlap_update, bool):
            raise TypeError(f"overlap_update must be True or False; got {overlap_update!r}")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.streams, self.warmup, self.amp, self.grad_clip = streams, warmup, amp, grad_clip
        self.partial_batch, self.capture = partial_batch, capture
        self.shard_optimizer, self.accumulate, self.ema = shard_optimizer, accumulate, ema
        self.buckets = buckets
        self.init_sync = init_sync
        self.overlap_update = overlap_update
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._device = _options.single_device(model, self._params)
        self._device_type = self._device.type  # read on the replay path: torch.device.type is slow
        cuda = self._device_type == "cuda"
        self._will_capture = capture and cuda
        # A compiled model's weight gradients: on side streams as inductor compiles its
        # backward (in the first calls).
        self._compiled_split = None
        # and its attention: SDPA given dense masks as inductor compiles it (_inductor_masks.py)
        self._compiled_masks = None
        # and its weight products: in the gradients' dtype, into their flat views when captured
        self._compiled_products = None
        if cuda and _torch_private.has_compiled_modules(model):
            from ._inductor_grads import WeightProducts
            from ._inductor_masks import DenseMaskPass  # loads inductor's modules
            self._compiled_masks = DenseMaskPass()
            self._compiled_products = WeightProducts()
            if streams != 1:
                from ._inductor_wgrad import SplitBackward
                self._compiled_split = SplitBackward()
        if self._will_capture:
            _options.check_compiled_graphs(model)
            _options.require_cuda_runtime(self._device)
        # A model that names a submodule to trace in its place (an integration's loss module):
        # that submodule's arguments at each eager step, until the plan sizes its operators.
        self._inside_example: tuple | None = None
        self._inside_hook = None
        inside = traced_submodule(model)
        if (inside is not None and self._will_capture and streams != 1
                and self._compiled_masks is None):
            def record(module, args, kwargs):  # a function: a copy of the module copies no Step
                self._inside_example = (args, kwargs)
            self._inside_hook = inside.register_forward_pre_hook(record, with_kwargs=True)
        self._update = Update(optimizer, amp, self._will_capture, self._device)
        world = current_world()
        if world and shard_optimizer:
            _options.check_shardable(self._device, capture, self._update.fuse_reason)
        self._gradsync = (GradientSync(world, self._device, bucket_mb, shard=shard_optimizer)
                          if world else None)
        self._sync = SyncRecorder() if cuda else None
        self._ema = EMA(model, self._params, ema) if ema is not None else None
        self._iteration = Iteration(model, loss_fn, amp, grad_clip, self._params, self._device,
                                    self._update, self._gradsync, self._sync, self._ema,
                                    accumulate, self._compiled_products)
        self._window = Window(accumulate)
        self._swapped = False  # the EMA weights are in the model (ema_weights())
        # Which parameters required gradients when the flat buffers and graphs fixed what the
        # step trains (the end of warm-up): a change since is refused (_refuse_trainable_change);
        # and from capture on where the graphs read their data (_settle_model).
        self._watch = None
        self._watched: list[torch.Tensor] = []  # the optimizer's parameters, then other tensors
        self._warned_numbers: set[str] = set()  # numbers a capture's forwards changed
        # The autocast the calls were made under when the graphs were captured (enabled, its
        # dtype; None before a capture): a replay runs the precision it was captured with.
        self._autocast: tuple[bool | None, torch.dtype | None] = (None, None)
        # And torch's settings that chose the graphs' kernels (float32's precision, cuDNN, the
        # attention backends, ...; src/capture/kernel_settings.h): a replay runs those kernels.
        self._kernel_settings: int | None = None
        # Each module's training mode, children, parameters and buffers when the graphs were
        # first captured (ModelWatch.check_modes, _settle_model).
        self._model: ModelWatch | None = None
        # The graph each call launches, by bucket and place in the window (-1: none yet).
        self._launch_entry: list[list[int]] = []
        self._entry_of: dict[tuple[int, tuple[bool, bool]], int] = {}  # (bucket, kind) -> entry
        self._phase = Phase.TEMPLATE
        self._template = None
        self._layout: BucketLayout | None = None
        self._inputs = None    # per bucket _C.StaticInputs when nothing is captured (CPU)
        self._filled: set[int] = set()    # buckets whose padding rows hold data
        self._met: set[int] = set()       # buckets an eager step ran on
        self._deferred: dict[int, str] = {}  # buckets whose capture waits for an eager step
        self._bucket_counts: list[list[int]] = []  # per bucket [replays, eager steps]
        self._evaluators: list[Evaluator] = []
        self._captured_entries: set[int] = set()  # entries captured at least once
        self._captures_before = 0  # captures before the graphs were last all dropped
        self._padded = 0       # padded eager steps so far
        self._padding: str | None = None  # "proven" or "refused: why", once checked
        # With buckets: the first padded batch's losses with and without the padding
        # (_padding.BucketPadding); a replay pads a batch once it settled.
        self._bucket_padding = None if buckets is None else BucketPadding(
            buckets, "nimble_train.Step",
            "The model or the loss does not ignore the padded positions (a BatchNorm along "
            "the padded dimension counts them in its batch statistics), so every padded step "
            "would train otherwise than the loop on the batches as given.",
            "Name values the loss and the attention ignore (labels -100: "
            "nt.Buckets(..., pad_values={'labels': -100}); attention mask 0), mask the padding "
            "in the model, or use buckets=None; nt.Buckets(..., exact=False) trains on the "
            "padded batches as they are.", training=True)
        self._graph: CapturedStep | None = None
        self._stream = torch.cuda.Stream(self._device) if self._will_capture else None
        self._capture_error: str | None = None  # its message: no frames or tensors kept
        self._last_entry = -1  # the graph the last call launched (-1: it ran eagerly)
        self._norms: dict[int, torch.Tensor | None] = {}  # update entry -> its gradient norm
        self._last_norm: torch.Tensor | None = None  # the last update's (grad_norm)
        self._counts = {"steps": 0, "updates": 0, "eager_steps": 0, "replays": 0,
                        "captures": 0}
        fusing = self._update.needs_fusing
        self._fuse_at = max(warmup - 1, 1) if fusing else -1  # which warm-up step fuses
        self._warmup_steps = warmup + (1 if fusing and warmup == 1 else 0)
        if self._will_capture and self._update.fuse_reason is not None:
            # An optimizer captured as it is creates its state in its first step(), which
            # must run eagerly (captured, the state's creation would replay every time):
            # warm-up covers the first window.
            self._warmup_steps = max(self._warmup_steps, accumulate)

    # ------------------------------------------------------------------ calls

    def __call__(self, batch: Any, *, update: bool | None = None,
                 loss_weight: float | None = None) -> torch.Tensor:
        """Runs one training step on `batch`; returns the loss (valid until the next call; its
        evaluators' calls leave it alone).

        With ``accumulate=K``, for loops whose windows vary: ``update=True`` ends the window
        with this call (the epoch's last micro-batches, fewer than K: the update sees them);
        ``loss_weight`` multiplies this micro-batch's loss instead of Step's weighting (a loop
        that normalizes its loss itself, e.g. by the window's token count; give it on every
        call of the window). Both are staged values: no recapture."""
        window = self._window
        window.set_call(update, loss_weight)
        ends_early = window.ends and window.micro != self.accumulate - 1
        if self._phase is Phase.REPLAY and not ends_early:
            try:
                tensors = self._template.tensors(batch)
                full = tensors[self._lead].shape[0] == self._template.batch_size
                bucket = self._bucket_of(tensors)
            except (AttributeError, IndexError, TypeError):
                full = False  # the slow path says what is wrong with the batch
            if full:
                entry = self._launch_entry[bucket][window.micro]
                autocast, dtype = self._autocast
                if (entry >= 0 and not self._swapped and not self._update.changed()
                        and not self._watch.changed() and self._model.first_changed() < 0
                        and torch.is_grad_enabled()
                        and torch.is_autocast_enabled(self._device_type) is autocast
                        and (dtype is None
                             or torch.get_autocast_dtype(self._device_type) is dtype)
                        and _C.kernel_settings() == self._kernel_settings):
                    samples = self._template.batch_size
                    try:
                        self._graph.graph.launch(entry, tensors, self._call_values(samples))
                    except TypeError:
                        self._template.explain_non_tensors(tensors)
                        raise
                    self._last_entry = entry
                    self._counts["replays"] += 1
                    self._bucket_counts[bucket][0] += 1
                    self._advance(samples)
                    return self._graph.outputs[entry]
        return self._call(batch)

    def _loss_made(self, loss: torch.Tensor) -> int:
        """The data address of the loss the step's body returned for `loss`, a call's result:
        an eager call's own, and for a replay the one its graph's capture made (a replay returns
        its graph's loss buffer, outside the pool). Integrations find what that body recorded
        (Lightning's self.log values) by it."""
        made = self._graph.loss_made.get(loss.data_ptr()) if self._graph is not None else None
        return (made if made is not None else loss).data_ptr()

    def _call(self, batch: Any) -> torch.Tensor:
        try:
            if self._compiled_masks is None:
                return self._run(batch)
            # Whatever inductor compiles in the step (the first calls compile the model)
            from ._inductor_wgrad import split_compiled_backward
            split = (split_compiled_backward(self._compiled_split)
                     if self._compiled_split is not None else contextlib.nullcontext())
            # the split first: the weight products it launches are not rewritten after
            with self._compiling(), split, _torch_private.post_grad_pass(self._compiled_products):
                return self._run(batch)
        except BaseException as error:
            if self._gradsync is not None and not isinstance(error, DistributedError):
                self._gradsync.world.tell_peers(error)  # their errors then name this one
            raise

    def _compiling(self):
        """A block in which what inductor compiles (a compiled model's first calls, in the step
        or an evaluator) gives SDPA dense attention masks (_inductor_masks.py)."""
        if self._compiled_masks is None:
            return contextlib.nullcontext()
        from ._inductor_masks import compiled_dense_masks
        return compiled_dense_masks(self._compiled_masks)

    def _run(self, batch: Any) -> torch.Tensor:
        if self._phase is Phase.CLOSED:
            raise NimbleError("this Step was closed (Step.close() released its graph and "
                              "communicator); make a new nt.Step to train further")
        if self._swapped:
            raise NimbleError("a Step cannot train while its EMA weights are in the model; "
                              "call it after the `with step.ema_weights():` block")
        self._check_ambient()
        if self._phase is Phase.TEMPLATE:
            return self._first_call(batch)
        self._update.check_groups()
        self._update.check_step_hooks()
        if self._phase in (Phase.CAPTURE, Phase.REPLAY):
            self._model.check_modes()
        self._settle_model()
        self._update.settle_state()
        captures = self._counts["captures"]
        try:
            return self._run_settled(batch)
        finally:  # what this call's forwards changed themselves is not the user's change
            if self._model is not None:
                changed = self._model.after_forward()
                if changed and self._counts["captures"] > captures:
                    warn_replays_keep(changed, self._warned_numbers, "the step's capture")

    def _autocast_now(self) -> tuple[bool, torch.dtype | None]:
        on = torch.is_autocast_enabled(self._device_type)
        return on, torch.get_autocast_dtype(self._device_type) if on else None

    def _check_ambient(self) -> None:
        """The call is made with autograd on, and, while the step's graphs may run, under the
        autocast and kernel settings they were captured under (once a capture failed, the step
        runs eagerly, as an eager loop would under the settings of the moment). Raised before
        anything runs."""
        if not torch.is_grad_enabled():
            raise NimbleError(
                "nimble_train.Step: called with autograd off (inside torch.no_grad() or "
                "torch.inference_mode()); a training step needs autograd for its backward, and "
                "a captured step would train all the same. Call the step outside that block; "
                "to evaluate without training, use ev = step.evaluator(fn), then ev(batch). "
                "Nothing was run for this call.")
        if self._phase is Phase.EAGER:
            return
        if self._autocast[0] is not None and self._autocast_now() != self._autocast:
            device = self._device_type
            raise NimbleError(
                f"nimble_train.Step: called {autocast_name(device, *self._autocast_now())}, "
                f"where the step's graphs were captured "
                f"{autocast_name(device, *self._autocast)}; a replay runs the precision "
                "it was captured with. Make every call under the same autocast (for mixed "
                "precision, nt.Step(..., amp='bf16') applies autocast inside the step), or "
                "build a new Step: step.close(), then nt.Step(model, optimizer, ...) again. "
                "Nothing was run for this call.")
        self._check_kernel_settings()

    def _check_kernel_settings(self) -> None:
        """Once graphs were captured: torch's settings that chose their kernels are as they were
        then (a training call's, or a captured evaluator's). Raised before anything runs.
        None of them runs once a capture failed (EAGER)."""
        if self._kernel_settings is None or self._phase is Phase.EAGER:
            return
        now = _C.kernel_settings()
        if now == self._kernel_settings:
            return
        changed = _C.kernel_setting_changes(self._kernel_settings, now)
        raise NimbleError(
            "nimble_train.Step: torch's settings changed since the step's graphs were captured: "
            f"{'; '.join(changed)}. A replay runs the kernels its capture chose, where an eager "
            "step would run others: the precision or algorithms asked for would not be met. "
            "Set them back before calling the step, or set them before building the Step, or "
            "build a new Step under the new settings: step.close(), then nt.Step(model, "
            "optimizer, ...) again. Nothing was run for this call.")

    def _run_settled(self, batch: Any) -> torch.Tensor:
        tensors = self._template.tensors(batch)
        bucket = self._layout.bucket(tensors)
        if self._bucket_padding is not None and not self._bucket_padding.settled:
            self._bucket_padding.check(self._iteration.sample_losses, self.model, self._layout,
                                       tensors, bucket, self.amp is not None)
        samples = self._samples(tensors, bucket)
        short = samples < self._template.batch_size
        if short and self.partial_batch == "error":
            raise _options.short_batch_error(samples, self._template.batch_size)
        phase = self._phase
        if phase is Phase.WARMUP:
            if self._counts["steps"] == self._fuse_at:
                self._fuse()
            loss = self._eager_step(batch, tensors, bucket, samples, warmup=True)
            if self._counts["steps"] + 1 >= self._warmup_steps:
                self._fix_trainable()  # an optimizer captured as it is: from here on
                self._fix_model()
                self._enter(Phase.CAPTURE)
        elif phase is Phase.EAGER:
            if short and not self._will_capture and self._pads(tensors, samples):
                loss = self._padded_eager_step(tensors, bucket, samples)
            else:
                loss = self._eager_step(batch, tensors, bucket, samples)
        elif short and not self._pads(tensors, samples):
            loss = self._eager_step(batch, tensors, bucket, samples)
        else:
            kind = self._window.kind()
            if kind[1] and self._update.changed():
                self._drop_update_graphs()  # they baked the old hyper-parameters
            entry = self._entry(bucket, kind)
            if not self._graph.graph.captured(entry):
                self._capture_buckets(kind, bucket, tensors, samples)
            if self._graph.graph.captured(entry):
                if short and bucket not in self._filled:
                    self._copy_in(bucket, tensors, samples)  # its padding rows get data
                self._graph.graph.launch(entry, tensors, self._call_values(samples))
                self._last_entry = entry
                self._counts["replays"] += 1
                self._bucket_counts[bucket][0] += 1
                loss = self._graph.outputs[entry]
            else:  # a deferred bucket meets its shapes eagerly first
                loss = self._eager_step(batch, tensors, bucket, samples)
        self._advance(samples)
        return loss

    def _pads(self, tensors: list, samples: int) -> bool:
        """Whether this short batch is padded: the loss is per sample, no layer keeps batch
        statistics, and (checked once, _padding.py) the model does not mix samples."""
        if not self._iteration.can_pad(self.partial_batch):
            return False
        if self._padding is None:
            reason = mixing_reason(self._iteration.sample_losses, self.model, self._template,
                                   tensors, samples)
            self._padding = "proven" if reason is None else f"refused: {reason}"
        return self._padding == "proven"

    def _first_call(self, batch: Any) -> torch.Tensor:
        """TEMPLATE: the first batch fixes the template, but only once its step completed: a
        first call that fails (a batch of the wrong dtype) leaves the Step as it was built."""
        self._start(batch)
        try:
            return self._run(batch)
        except BaseException:
            if self._phase is not Phase.CLOSED and self._counts["steps"] == 0:
                if self._graph is not None:
                    self._graph.release()
                self._template = self._graph = self._inputs = self._layout = None
                self._filled, self._met = set(), set()
                self._enter(Phase.TEMPLATE)
            raise

    # ------------------------------------------------------------------ accumulation

    def _call_values(self, samples: int) -> list[float]:
        """The values a call stages after its sample count: with accumulation the loss weight
        and the gradient correction, then the update's."""
        if self.accumulate == 1:
            return self._update.host_values()
        return [*self._scales(samples), *self._update.host_values()]

    def _scales(self, samples: int) -> tuple[float, float]:
        return self._window.scales(samples, self._template.batch_size,
                                   self._iteration.per_sample)

    def _advance(self, samples: int) -> None:
        """A call completed: the window moves on."""
        self._counts["steps"] += 1
        if self._window.advance(samples):
            self._counts["updates"] += 1
            self._last_norm = (self._norms.get(self._last_entry) if self._last_entry >= 0
                               else self._iteration.grad_norm)

    def _eager_call(self, samples: int) -> Call:
        """The Call of an eager step: the scales as floats, or, when the step has a staging
        ring (CUDA), as the device values it staged."""
        zero, update = self._window.kind()
        if self.accumulate == 1:
            return Call(zero, update)
        if self._graph is not None:
            weight, correction = self._graph.scales
            return Call(zero, update, weight, correction)
        return Call(zero, update, *self._scales(samples))

    def _entry(self, bucket: int, kind: tuple[bool, bool]) -> int:
        """The entry of a bucket's graph of one kind: the bucket's first kind takes the entry
        of its static inputs, the others share them."""
        entry = self._entry_of.get((bucket, kind))
        if entry is None:
            first = not any(b == bucket for b, _ in self._entry_of)
            entry = self._graph.bases[bucket] if first else self._graph.new_entry(bucket)
            self._entry_of[(bucket, kind)] = entry
        return entry

    def _refresh_launch_entries(self) -> None:
        graph = self._graph.graph
        for bucket, entries in enumerate(self._launch_entry):
            for micro in range(self.accumulate):
                entry = self._entry_of.get((bucket, self._window.kind(micro)), -1)
                entries[micro] = entry if entry >= 0 and graph.captured(entry) else -1

    def _drop_update_graphs(self) -> None:
        for (_, kind), entry in self._entry_of.items():
            if kind[1] and self._graph.graph.captured(entry):
                self._graph.graph.drop(entry)
                self._graph.outputs.pop(entry, None)
        self._refresh_launch_entries()

    # ------------------------------------------------------------------ buckets

    def _bucket_of(self, tensors: list) -> int:
        """The replay path's bucket lookup: IndexError for a batch the slow path must explain."""
        layout = self._layout
        if layout.buckets is None:
            return 0
        length = tensors[layout.lead].shape[layout.buckets.dim]
        bucket = layout.by_length[length]
        if not self._bucket_padding.settled and length != layout.sizes[bucket]:
            raise IndexError("the slow path checks the padding first")
        return bucket

    def _copy_in(self, bucket: int, tensors: list, samples: int) -> None:
        """Copies a checked batch into its bucket's static inputs (padded along the bucket's
        dimension); the first short batch a bucket sees fills its padding rows too."""
        fill = samples < self._template.batch_size and bucket not in self._filled
        if fill or samples == self._template.batch_size:
            self._filled.add(bucket)
        if self._graph is not None:
            self._graph.graph.copy_in(self._graph.bases[bucket], tensors, samples,
                                      fill_padding=fill)
        else:
            self._inputs[bucket].copy_in(tensors, samples, fill_padding=fill)

    def _static_batch(self, tensors: list, bucket: int, samples: int) -> Any:
        """An eager step's batch with buckets: the batch padded to its bucket, in the bucket's
        static inputs, its first `samples` rows (what the bucket's graph computes on)."""
        self._copy_in(bucket, tensors, samples)
        buffers = (self._graph.graph.inputs(self._graph.bases[bucket]) if self._graph is not None
                   else self._inputs[bucket].buffers)
        return self._template.unflatten_rows(buffers, samples)

    def _enter(self, phase: Phase) -> None:
        """The one place the phase changes."""
        self._phase = phase

    def _start(self, batch: Any) -> None:
        """TEMPLATE: the first batch fixes the template; ranks agree; buffers are made."""
        template = _options.first_template(batch, self._device, self.loss_fn)
        sync = self._gradsync
        if sync is not None and not sync.joined:
            options = {key: getattr(self, key) for key in (
                "streams", "warmup", "amp", "grad_clip", "partial_batch", "capture",
                "accumulate", "ema", "init_sync", "overlap_update")}
            options["buckets"] = repr(self.buckets)
            sync.join(self._params, self.optimizer, template, options,
                      vary_dim=self.buckets.dim if self.buckets is not None else None)
            if self.init_sync:  # every replica starts from rank 0's weights, as with DDP
                sync.broadcast_from_rank0(unique_tensors(list(self.model.parameters())
                                                         + list(self.model.buffers())))
        layout = BucketLayout(template, self.buckets)
        self._template, self._layout = template, layout
        self._lead = next(i for i, leaf in enumerate(template.tensor_leaves) if leaf.batched)
        buckets = range(len(layout.sizes))
        self._launch_entry = [[-1] * self.accumulate for _ in buckets]
        self._bucket_counts = [[0, 0] for _ in buckets]
        self._entry_of, self._deferred = {}, {}
        if self._will_capture:
            extra = 2 if self.accumulate > 1 else 0
            self._graph = CapturedStep(self._device, extra, self._update.num_values(), layout)
            self._enter(Phase.WARMUP)
        else:
            self._inputs = [_C.StaticInputs(layout.specs(b)) for b in buckets]
            self._enter(Phase.EAGER)

    def _samples(self, tensors: list, bucket: int) -> int:
        """The batch's sample count, checked against its bucket's inputs (ShapeError)."""
        try:
            if self._graph is not None:
                return self._graph.graph.check(self._graph.bases[bucket], tensors)
            return self._inputs[bucket].check(tensors)
        except TypeError:
            self._template.explain_non_tensors(tensors)
            raise

    # ------------------------------------------------------------------ eager steps

    def _eager_step(self, batch: Any, tensors: list, bucket: int, samples: int,
                    warmup: bool = False) -> torch.Tensor:
        # A compiled model compiles for the batch it is given, and a capture cannot compile:
        # given the user's (a slice x[i:i + b], a view), dynamo may guard on the view's base,
        # which the static inputs the capture reads lack. It meets those inputs from the start.
        if self.buckets is not None or (self._graph is not None
                                        and self._compiled_masks is not None):
            batch = self._static_batch(tensors, bucket, samples)
        with (self._sync.recording_on(self._stream) if warmup and self._stream is not None
              else contextlib.nullcontext()):
            if self._graph is not None and (self._update.fused is not None
                                            or self.accumulate > 1):
                # The fused update and accumulation's scales read the staged values.
                self._graph.graph.stage_eager(samples, self._call_values(samples))
            captured = self._graph is not None and self._graph.captured
            with self._buffers_kept_if_late():
                loss = self._iteration.step(batch, samples, None, captured,
                                            self._eager_call(samples))
        self._last_entry = -1
        self._counts["eager_steps"] += 1
        self._bucket_counts[bucket][1] += 1
        self._met.add(bucket)
        return loss

    def _padded_eager_step(self, tensors: list, bucket: int, samples: int) -> torch.Tensor:
        """The padded, masked computation the graph would run, done eagerly: on the CPU and
        with capture=False a short batch sees the semantics of the captured step."""
        self._copy_in(bucket, tensors, samples)  # the first fills the padding rows
        self._padded += 1
        static = self._template.unflatten(self._inputs[bucket].buffers)
        valid = torch.tensor(float(samples), device=self._device)
        with self._buffers_kept_if_late():
            loss = self._iteration.step(static, self._template.batch_size, valid,
                                        captured=False, call=self._eager_call(samples))
        self._last_entry = -1
        self._counts["eager_steps"] += 1
        self._bucket_counts[bucket][1] += 1
        return loss

    @contextlib.contextmanager
    def _buffers_kept_if_late(self):
        """Around an eager step whose fused update left parameters out: if one gets a gradient
        (LateGradient, raised before the update), the buffers its forward moved (a batch
        norm's statistics) are put back."""
        if not self._iteration.left_out:
            yield
            return
        buffers = [b for b in self.model.buffers() if b is not None]
        if isinstance(self.loss_fn, torch.nn.Module):
            buffers += [b for b in self.loss_fn.buffers() if b is not None]
        with torch.no_grad():
            kept = [b.clone() for b in buffers]
        try:
            yield
        except LateGradient:
            with torch.no_grad():
                for b, value in zip(buffers, kept):
                    b.copy_(value)
            raise

    def _fuse(self) -> None:
        """The update moves to the fused optimizer before the last warm-up step: the flat
        buffers give parameters and gradients new addresses, and that step lets cuDNN and
        cuBLAS meet them before capture (their caches are keyed by alignment, and nothing can
        be autotuned inside a capture)."""
        self._refuse_sparse_gradients()
        self._update.check_step_hooks(fusing=True)
        sync = self._gradsync
        shards = sync.world.size if sync is not None and sync.sharded else 1
        # Data parallel: the ranks' flat buffers must hold the same parameters.
        used = self._iteration.got_gradients()
        # A window's accumulated gradients move into the flat buffers with the parameters.
        self._iteration.keep_accumulated_grads()
        if sync is not None:
            used = sync.used_anywhere(used)
        self._fix_trainable()
        self._update.fuse(self._params, self._graph.update_values, shards, used)
        self._iteration.left_out = [i for i, (p, u) in enumerate(zip(self._params, used))
                                    if p.requires_grad and not u]
        self._iteration.name_of = self._param_name
        if sync is not None:
            sync.use_buckets(self._update.fused,
                             update_in_buckets=self._why_not_in_buckets() is None)
        if self._ema is not None:
            self._ema.use_flat(self._update.fused)

    def _refuse_sparse_gradients(self) -> None:
        """Before the update is fused or the step captured, nothing run yet for this call."""
        i = self._iteration.sparse_grad
        if i is None:
            return
        raise NimbleError(
            f"nimble_train.Step: {self._param_name(i)} gets a sparse gradient "
            f"({self._params[i].grad.layout}: an nn.Embedding or nn.EmbeddingBag built with "
            "sparse=True), and a captured step keeps every gradient dense: in the fused "
            "update's flat buffers, and in a graph, whose tensors cannot change size with the "
            "batch's indices. Build the layer with sparse=False (its dense gradient is made in "
            "the graph), or train with nt.Step(..., capture=False). Nothing was run for this "
            "call; the warm-up steps before it trained as eager steps do.")

    def _fix_trainable(self) -> None:
        """From here on the flat buffers and the graphs hold which parameters train."""
        if self._watch is None:
            self._watched = list(self._params)  # what the graphs read besides: at capture
            self._watch = _C.ParamWatch(self._watched, len(self._params))

    def _read_besides(self) -> list[torch.Tensor]:
        """The tensors the graphs read besides the optimizer's parameters: the model's frozen
        parameters and its buffers, the loss module's parameters (a perceptual loss's frozen
        network) and buffers (a class weight), those of the modules a loss function reads from
        its scope (a GAN's discriminator) and of those the model's modules hold unregistered (a
        teacher in a list: ModelWatch.read_modules), and the tensors the model's and the loss
        module's modules hold in plain attributes (a temperature)."""
        held = [*self.model.parameters(), *self.model.buffers()]
        if isinstance(self.loss_fn, torch.nn.Module):
            held += [*self.loss_fn.parameters(), *self.loss_fn.buffers()]
        for _, module in self._model.read_modules():  # a GAN's critic, a hidden teacher
            held += [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        held += [t for _, t in self._model.tensor_attributes()]
        known = {id(p) for p in self._params}
        return [t for t in unique_tensors(held) if id(t) not in known]

    def _param_name(self, i: int) -> str:
        """The name of the i-th tensor the graphs read: the optimizer's parameters (from the
        first call on), then, once the trainable set is fixed, the model's others."""
        t = self._params[i] if i < len(self._params) else self._watched[i]
        params = list(self.model.named_parameters())
        if isinstance(self.loss_fn, torch.nn.Module):
            params += self.loss_fn.named_parameters(prefix="loss_fn")
        names = {id(q): name for name, q in params}
        if id(t) in names:
            return names[id(t)]
        buffers = list(self.model.named_buffers())
        if isinstance(self.loss_fn, torch.nn.Module):
            buffers += self.loss_fn.named_buffers(prefix="loss_fn")
        names = {id(b): name for name, b in buffers}
        if id(t) in names:
            return f"the buffer {names[id(t)]}"
        attributes = self._model.tensor_attributes() if self._model is not None else []
        names = {id(a): name for name, a in attributes}
        if id(t) in names:
            return f"the tensor attribute {names[id(t)]}"
        # a module the graphs run besides (a loss function's critic, a hidden teacher): as
        # named from who reads it
        for prefix, module in self._model.read_modules() if self._model is not None else ():
            names = {id(q): f"{prefix}.{name}"
                     for name, q in module.named_parameters(recurse=False)}
            names.update((id(b), f"the buffer {prefix}.{name}")
                         for name, b in module.named_buffers(recurse=False))
            if id(t) in names:
                return names[id(t)]
        return f"optimizer parameter {i} (shape {tuple(t.shape)})"

    def _fix_model(self) -> None:
        """The graphs about to be captured run every module in its training mode of now, and
        read each parameter's data, each buffer and tensor attribute and each module where
        they are now."""
        self._model = ModelWatch(self.model, self.loss_fn)
        others = self._read_besides()  # a buffer assigned anew since warm-up: where it is now
        self._watched = [*self._params, *others]
        self._watch.fix_storage(others)

    def _settle_model(self, *, training: bool = True) -> None:
        """Before anything runs (a training call, or an evaluator's with training=False): a
        parameter frozen or unfrozen since warm-up is refused, and so is a module or a
        parameter object replaced since capture; a parameter or buffer whose data was replaced
        (``p.data = t``) goes back where the graphs read it, its new values copied there, and
        so does a replaced buffer or tensor attribute, or the call is refused when they cannot
        (ModelWatch)."""
        watch, model = self._watch, self._model
        if watch is None or not (watch.changed() or (model is not None
                                                     and model.objects_changed())):
            return
        if training and watch.first_flag_changed() >= 0:
            self._refuse_trainable_change()
        if model is None:
            return  # before capture: nothing is fixed but the flags
        model.refuse_replaced_objects()
        moved = watch.moved()
        trained = len(self._params)
        # Read where another step's update moved them (see _read_anew); the rest goes back.
        taken = [i for i in moved if i >= trained and in_flat_buffers(self._watched[i])]
        for i in moved:
            why = watch.why_not_restorable(i) if i not in taken else ""
            if why:
                j = watch.shares_memory_with(i)
                if j >= 0:
                    why = (f"its data now shares memory with {self._param_name(j)}'s, a tie the "
                           "graphs (captured with them apart) cannot keep")
                refuse_replaced(f"the data of {self._param_name(i)}", why)
        tensors = model.replaced_tensors()
        if taken:
            self._read_anew(taken)
        watch.restore()
        model.put_back(tensors)

    def _read_anew(self, others: list[int]) -> None:
        """Parameters the graphs read and this step does not train, which another step's
        fused update moved into its flat buffers since they were captured (a GAN's two steps,
        each reading the other's network, the one that fused last having moved them): the
        graphs are captured again, as they are next called, reading them there. Put back where
        these graphs read them, as a replaced parameter's data is, they would move at every
        call of either step, and both would copy them and leave their fast paths."""
        self._watch.adopt(others)
        if self._graph is not None:
            self._graph.drop_all()
            self._refresh_launch_entries()
            # captured again for this, not for changed hyper-parameters (_capture's warning)
            self._captured_entries.clear()
            self._captures_before = self._counts["captures"]

    def _refuse_trainable_change(self) -> None:
        """A parameter frozen or unfrozen (requires_grad_) since warm-up: the flat buffers and
        the graphs would go on updating it, or never update it. Raised before anything runs."""
        watch = self._watch
        i = watch.first_flag_changed()
        was = watch.was_trainable(i)
        changed = sum(q.requires_grad != watch.was_trainable(k)
                      for k, q in enumerate(self._params))
        effect = ("the captured step would go on updating it" if was else
                  "the captured step would never compute its gradient or update it")
        raise NimbleError(
            f"nimble_train.Step: {self._param_name(i)}.requires_grad changed from {was} to "
            f"{not was} after warm-up fixed which parameters the step trains ({changed} "
            f"parameter(s) changed); {effect}. Freeze or unfreeze parameters before the Step's "
            "first call, or build a new Step for the new set: step.close(), then "
            "nt.Step(model, optimizer, ...) again (the optimizer's state carries over). Nothing "
            "was run for this call.")

    def _why_not_in_buckets(self) -> str | None:
        """Why a captured data-parallel step does not update each bucket right after its
        collective (None: it does)."""
        if self._gradsync is None:
            return "not data parallel"
        if not self.overlap_update:
            return "overlap_update=False"
        if self._update.fused is None:
            return "the optimizer is not fused"
        return None

    def _weight_grad_layers(self) -> int:
        split, graph = self._compiled_split, self._graph
        if split is not None:
            return graph.compiled_launches if graph is not None else 0
        return graph.weight_grads.layers if graph and graph.weight_grads else 0

    def _compiled_side_streams(self, launches: int) -> int:
        if launches == 0:
            return 0
        from ._inductor_wgrad import SIDE_STREAMS
        return min(SIDE_STREAMS, launches)

    def _weight_grads_off(self) -> str | None:
        split, graph = self._compiled_split, self._graph
        if graph is None:
            return None
        if split is not None and not split.on_one_stream:
            return None if split.launched else ("no weight gradient of the compiled backward "
                                                "can leave its critical path")
        return graph.weight_grads_off

    def _why_update_waits(self) -> str | None:
        """Why a step's update needs every gradient first (None: it does not)."""
        if self.grad_clip is not None:
            return "grad_clip needs the global gradient norm"
        if self.amp == "fp16":
            return "the fp16 loss scale needs every gradient's overflow check"
        return None

    # ------------------------------------------------------------------ capture

    def _capture_buckets(self, kind: tuple[bool, bool], bucket: int, tensors: list,
                         samples: int) -> None:
        """CAPTURE of the graphs of one kind of call (or a recapture of an optimizer captured
        as it is), for every bucket not captured yet, largest first (see the module's
        docstring), the current batch's `bucket` among them. On success the phase is REPLAY.
        A failure raises, with nothing changed, and the phase becomes EAGER; except for a
        bucket no eager step has met, which is deferred."""
        self._refuse_sparse_gradients()
        graph = self._graph
        self._copy_in(bucket, tensors, samples)
        graph.plan_streams(self.model, self.streams, self._device,
                           gradients=self._gradsync,
                           example=model_arguments(graph.batches[bucket]),
                           compiled_split=self._compiled_split,
                           compiled_products=self._compiled_products,
                           inside_example=self._inside_example)
        self._stop_recording_inside()
        sizes = self._layout.sizes
        order = sorted(range(len(sizes)), key=lambda b: -(sizes[b] or 0))
        for b in order:
            entry = self._entry(b, kind)
            if graph.graph.captured(entry) or (b in self._deferred
                                               and (b != bucket or b not in self._met)):
                continue  # a deferred bucket is captured once met, as the current bucket
            try:
                self._capture(entry, b, kind)
            except NimbleError as failure:
                if b not in self._met and self.buckets is not None:
                    self._deferred[b] = str(failure).splitlines()[0]
                    continue
                self._capture_error = str(failure)
                for entries in self._launch_entry:
                    entries[:] = [-1] * self.accumulate
                self._enter(Phase.EAGER)
                raise
            self._deferred.pop(b, None)
        self._refresh_launch_entries()
        self._enter(Phase.REPLAY)

    def _stop_recording_inside(self) -> None:
        if self._inside_hook is not None:
            self._inside_hook.remove()
            self._inside_hook = None
        self._inside_example = None

    def _capture(self, entry: int, bucket: int, kind: tuple[bool, bool]) -> None:
        """Captures one graph; on failure raises SyncError or CaptureError with the gradients
        as they were (a capture runs nothing: the model and optimizer are unchanged)."""
        graph = self._graph
        self._iteration.keep_accumulated_grads()  # every graph of a window: one set
        saved_grads = [p.grad for p in self._params]
        saved_window = self._iteration.window_grads
        host = self._update.host_state if kind[1] else None
        if host is not None:  # an optimizer captured as it is: what its step() does on the host
            host.take(self._param_name)
        # The norm clip_grad_norm_ makes in an update graph (an optimizer run as it is) goes
        # into a buffer outside the pool, as the loss does (CapturedStep.norm_buffer); its dtype
        # is clip_grad_norm_'s, the gradients' promoted.
        graph.loss_dtype = self._iteration.loss_dtype  # the loss buffer's
        norm_out = None
        if kind[1] and self.grad_clip is not None and self._update.fused is None:
            dtype = functools.reduce(torch.promote_types, (p.dtype for p in self._params))
            norm_out = graph.norm_buffer(entry, dtype)
        try:
            with self._update.lr_on_device(graph.update_values):
                graph.capture(entry,
                              lambda forward: self._capture_body(bucket, kind, forward, norm_out),
                              self._stream, self._sync.records, undo=self._undo_forwards)
        except NimbleError:
            self._undo_forwards()
            for p, grad in zip(self._params, saved_grads):
                p.grad = grad
            self._iteration.window_grads = saved_window  # not the abandoned graph's tensors
            raise
        finally:
            if host is not None:
                host.release()
        if kind[1]:
            self._update.bake()
            self._norms[entry] = self._iteration.grad_norm
        self._counts["captures"] += 1
        self._model.captured = True  # its numbers are the graphs' from here on
        self._autocast = self._autocast_now()  # and the autocast they run (_check_ambient)
        self._kernel_settings = _C.kernel_settings()  # and the settings of its kernels
        self._captured_entries.add(entry)
        recaptures = (self._counts["captures"] - self._captures_before
                      - len(self._captured_entries))
        self._update.warn_if_recapturing_often(recaptures, self._counts["steps"], self.warmup)

    def _undo_forwards(self) -> None:
        """After a failed capture (given up, or tried again on one stream): what its forwards
        assigned or changed is back as after the last completed call, and so is the data they
        gave (no values: a capture runs nothing)."""
        self._model.undo_capture()
        self._watch.undo_moves()
        host = self._update.host_state
        if host is not None:  # and what the optimizer's step() did on the host
            host.restore()

    def _capture_body(self, bucket: int, kind: tuple[bool, bool], forward,
                      norm_out: torch.Tensor | None = None) -> torch.Tensor:
        # A graph user code still holds (a loss kept without .detach()) keeps each parameter's
        # gradient accumulation on the stream its step ran on, outside this capture.
        _C.bind_grad_accumulators([p for p in self.model.parameters() if p.requires_grad])
        zero, update = kind
        call = Call(zero, update, *self._graph.scales)
        if zero and self._update.fused is not None:
            # inside: replays never accumulate gradients (handed over to autograd, they are
            # made afresh and copied in, and the views zeroed that autograd adds into)
            if not self._iteration.hands_over(call):
                self._update.fused.zero_grad()
        elif zero:
            # backward makes them in the graph; the graphs of a window share them
            self.optimizer.zero_grad(set_to_none=self.accumulate == 1)
        loss = self._iteration.loss(self._graph.batches[bucket], self._template.batch_size,
                                    self._graph.valid, forward)
        self._iteration.backward_and_update(loss, call)
        if norm_out is not None and self._update.fused is None:
            self._iteration.grad_norm = CapturedStep.write_out(self._iteration.grad_norm,
                                                               norm_out)
        host = self._update.host_state
        if update and host is not None and host.taken:
            host.check_and_keep()  # state it assigned anew read by the next replay; or refused
        self._model.keep_assigned_tensors()  # a forward's `self.avg = ...`: read by the next
        self._keep_moved_data()  # and its `self.avg.data = ...`
        return loss

    def _keep_moved_data(self) -> None:
        """Inside a capture, after the step's forwards: a buffer, tensor attribute or frozen
        parameter they gave new data (``self.avg.data = 0.9 * self.avg + ...``) has its new
        values copied where the graphs read it, in the graph, and views that storage again, so
        that every replay leaves them where the next one reads them, as eager steps leave them
        in the module. New data of another shape, dtype or device, and a trained parameter's
        (the graphs update it where they read it: the new data would never train), fail the
        capture, which puts the data back (_capture)."""
        watch = self._watch
        moved = watch.moved()
        for i in moved:
            why = ("the graphs read and update each trained parameter in the storage they "
                   "were captured with, so new data would never train" if i < len(self._params)
                   else watch.why_not_restorable(i))
            if why:
                raise NimbleError(
                    f"nimble_train.Step: the forward gave {self._param_name(i)} new data "
                    f"(.data = t) in the step's capture, and {why}. Change its values in place "
                    "(with torch.no_grad(): t.copy_(...)), or keep its shape, dtype and device.")
        if moved:
            watch.restore()

    # ------------------------------------------------------------------ the rest of the API

    def stats(self) -> dict:
        """What the step has done and holds: phase, capture, streams, graph size, pool, calls."""
        graph, sync, fused = self._graph, self._gradsync, self._update.fused
        ms = graph.multistream if graph else None
        captured = graph is not None and graph.captured
        split_layers = self._weight_grad_layers()
        return {
            "phase": self._phase.value,
            "captured": captured,
            "streams": ms.plan.num_streams if ms else 1,
            "syncs": ms.plan.num_syncs if ms else 0,
            "traced_ops": len(ms.graph.nodes) if ms else None,
            "small_ops_kept": ms.plan.kept if ms else 0,  # planned on their producer's stream
            "single_stream_reason": graph.single_stream_reason if graph else None,
            # layers whose weight gradients the last capture ran on a side stream (a compiled
            # model: its weight gradients the last capture launched on side streams)
            "weight_grad_layers": split_layers,
            # their side streams: one per forward stream that launched them (a compiled
            # model's: those its launches took in turn)
            "weight_grad_streams": graph.weight_grads.streams if graph and graph.weight_grads
            else self._compiled_side_streams(split_layers),
            "weight_grads_off": self._weight_grads_off(),
            # each forked before its layer's data gradient (a chain), or after it (None: not
            # split here)
            "weight_grads_first": graph.weight_grads.first if graph and graph.weight_grads
            else None,
            # batch norms the last planned capture ran with PyTorch's kernels, not cuDNN's
            "native_batch_norm_layers": graph.native_bn_layers if captured else 0,
            # batch norms the last planned capture ran fused with the ReLU after them
            "fused_batch_norm_layers": graph.fused_bn_layers if captured else 0,
            # batch counters the last training capture advanced in one kernel at its end
            "batch_norm_counters": graph.bn_counters if captured else 0,
            # attention calls of a compiled model given dense masks as Step's calls compiled it
            "dense_attention_masks": (self._compiled_masks.masks
                                      if self._compiled_masks is not None else 0),
            # a compiled model's weight products the last capture wrote into their parameters'
            # flat gradient views (_inductor_grads.py)
            "weight_products_in_place": (self._compiled_products.written
                                         if self._compiled_products is not None else 0),
            # max-pools the last capture ran on nimble_train's kernels (_max_pool.py)
            "max_pool_layers": graph.max_pool_layers if captured else 0,
            # stems (convolutions of few input channels) the last capture ran on
            # nimble_train's kernels (_small_conv.py)
            "small_conv_layers": graph.small_conv_layers if captured else 0,
            # graph_nodes, graphs, pool_bytes, and the memset nodes the captures made kernels
            **(graph.stats() if captured else {"graph_nodes": None, "graphs": 0,
                                                  "memset_nodes_as_kernels": 0,
                                                  "pool_bytes": None}),
            "warmup_left": max(0, self._warmup_steps - self._counts["steps"]),
            "host_syncs_in_warmup": [str(r) for r in self._sync.records] if self._sync else [],
            "capture_error": self._capture_error,
            "padding": self._padding,
            "bucket_padding": self._bucket_padding and self._bucket_padding.verdict,
            "shape_buckets": self._bucket_stats(),
            "evaluators": [e.stats() for e in self._evaluators],
            "world_size": sync.world.size if sync else 1,
            "buckets": sync.num_buckets if sync else 0,
            # data parallel: whether each bucket is updated right after its collective, or why not
            "update_in_buckets": self._in_buckets_stats(),
            "optimizer_shards": sync.world.size if sync and sync.sharded else 1,
            "optimizer_state_bytes": fused.state_bytes if fused else None,
            "optimizer": self._update.kind,
            "accumulate": self.accumulate,
            "micro_batch": self._window.micro,  # the next call's place in its window
            "ema": self.ema,
            "ema_bytes": self._ema.nbytes if self._ema else None,
            **self._counts,
        }

    def _in_buckets_stats(self) -> str | None:
        sync = self._gradsync
        if sync is None or self._update.fused is None:
            return None
        why = self._why_not_in_buckets()
        if why is not None:
            return f"no: {why}"
        waits = self._why_update_waits()
        if waits is not None:
            return (f"statistics only: {waits}; each bucket's share of it is taken right after "
                    "its collective, and the update follows the backward")
        late = sync.num_buckets - sync.early_buckets
        return ("yes" if late == 0 else
                f"yes, but {late} bucket(s) after the backward: it reads their parameters after "
                "their gradients")

    def _bucket_stats(self) -> dict | None:
        """Per bucket length: whether its graphs are captured, its replays and eager steps,
        and why its capture waits, if it does. None without buckets."""
        if self.buckets is None:
            return None
        sizes = self.buckets.sizes
        graph = self._graph
        out = {}
        for b, size in enumerate(sizes):
            replays, eager = self._bucket_counts[b] if self._bucket_counts else (0, 0)
            entries = [e for (bucket, _), e in self._entry_of.items() if bucket == b]
            out[size] = {
                "captured": graph is not None and any(graph.graph.captured(e) for e in entries),
                "replays": replays, "eager_steps": eager,
                "deferred": self._deferred.get(b)}
        return out

    @property
    def stepped(self) -> bool:
        """Whether the last call applied an optimizer update (every call with accumulate=1;
        every K-th with accumulate=K): step an LR scheduler when it is True."""
        return self._window.stepped

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """With ``grad_clip``: the global gradient norm before clipping (unscaled, as
        ``clip_grad_norm_`` returns it) of the last update, a 0-dim device tensor rewritten by
        the next update (read it when :attr:`stepped`); None without grad_clip or before an
        update."""
        return self._last_norm if self.grad_clip is not None else None

    # ------------------------------------------------------------------ EMA

    @contextlib.contextmanager
    def ema_weights(self):
        """The EMA weights (and averaged buffers) in the model for the block, the trained ones
        back after it: evaluate or save the averaged model. The step refuses to train inside."""
        ema = self._require_ema("ema_weights")
        if self._swapped:
            raise NimbleError("ema_weights() is already active; the blocks do not nest")
        self._swapped = True
        try:
            with ema.swapped_in():
                yield self.model
        finally:
            self._swapped = False

    def ema_state_dict(self) -> dict:
        """The model's state_dict with the EMA weights in place of the trained ones (copies):
        ``torch.save`` it, or load it into a copy of the model for evaluation or export."""
        return self._require_ema("ema_state_dict").state_dict()

    def load_ema_state_dict(self, state: dict) -> None:
        """Restores the EMA from ``ema_state_dict()`` (resuming a run)."""
        self._require_ema("load_ema_state_dict").load_state_dict(state)

    def evaluator(self, fn: Callable[[torch.nn.Module, Any], Any]) -> Evaluator:
        """An evaluation step: ``ev = step.evaluator(fn)``, then ``out = ev(batch)`` runs
        ``fn(model, batch)`` (a tensor or a dict of tensors, e.g. the number of correct
        predictions and the summed loss) with the model in eval mode, autograd off and the
        Step's autocast; the model's modes are restored after each call. Once the Step replays,
        it is captured into the Step's pool (a graph per bucket) and replayed; the outputs are
        new device tensors (sum them on the device: no host sync per batch). The weights are
        the training ones, by address (no copies): inside :meth:`ema_weights`, the EMA's.
        A short batch, calls before capture and the CPU run eagerly, with the same semantics."""
        self._require_open("evaluator")
        evaluator = Evaluator(self, fn)
        self._evaluators.append(evaluator)
        return evaluator

    def _require_open(self, what: str) -> None:
        if self._phase is Phase.CLOSED:
            raise NimbleError(f"Step.{what}: this Step was closed (Step.close() released its "
                              "graphs); make a new nt.Step")

    def _replaying_graph(self) -> CapturedStep | None:
        """The step graph while the Step replays (its parameters keep their addresses)."""
        return self._graph if self._phase is Phase.REPLAY else None

    def _require_ema(self, what: str) -> EMA:
        if self._ema is None:
            raise NimbleError(f"Step.{what}: this Step keeps no EMA; build it with "
                              "nt.Step(..., ema=0.999)")
        return self._ema

    def consolidate_optimizer_state(self) -> None:
        """With ``shard_optimizer=True``, gathers the whole optimizer state into
        ``optimizer.state`` on every rank, so that ``optimizer.state_dict()`` (a checkpoint)
        holds all of it, until the next step. A collective: call it on every rank, then save
        on one. Does nothing when the state is not sharded."""
        fused, sync = self._update.fused, self._gradsync
        if fused is not None and sync is not None and sync.sharded:
            fused.consolidate(sync.gather)

    def close(self) -> None:
        """Releases the graphs, their pool, the hooks Step put on the optimizer and, in a
        data-parallel job, the NCCL communicator; every rank should call it before the process
        group is destroyed. The optimizer stays usable, eagerly: a sharded state is gathered
        back whole first (a collective). Calling it again does nothing."""
        if self._phase is Phase.CLOSED:
            return
        try:
            if self._graph is not None:
                self._graph.release()
            if self._gradsync is not None and self._gradsync.comm is not None:
                self.consolidate_optimizer_state()
        finally:
            self._stop_recording_inside()
            self._update.close()
            if self._gradsync is not None:
                self._gradsync.close()
            # The watch's aliases and the buffers kept the graphs' storage alive.
            self._watch, self._watched, self._model = None, [], None
            self._enter(Phase.CLOSED)
