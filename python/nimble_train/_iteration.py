"""The body of one training iteration: forward, loss, backward, all-reduce, update.

The same code runs eagerly (warm-up, capture=False, CPU, eager fallbacks) and inside a capture;
what differs is only where the valid-sample count comes from (a padded batch masks its padding
rows out of the loss with it) and which update runs (see _update.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import torch

from . import _torch_private
from ._weight_grads import steps_backward
from .errors import NimbleError

AMP_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}

# Captured steps hand the gradients autograd makes to it and copy them into the flat buffers
# once (Iteration.hands_over). False: each is added into its zeroed view as it comes, as
# before; bench/bench_grad_handover.py times one against the other.
HAND_OVER_GRADIENTS = True


class Call(NamedTuple):
    """What one call of a Step does within its accumulation window.

    zero: the window's first call zeroes the gradients; update: its last call updates.
    weight: the loss is multiplied by it before the backward (None: 1); correction: the
    accumulated gradients are multiplied by it before clipping and the update (None: 1).
    Each is a Python float (eager steps without a graph) or a device tensor the step's staging
    ring fills (float32 [] for the weight, [1] for the correction).
    """

    zero: bool = True
    update: bool = True
    weight: Any = None
    correction: Any = None


FULL_STEP = Call()


def autocast_name(device: str, on: bool, dtype: torch.dtype | None) -> str:
    """The autocast a call is made under, for messages: `torch.autocast(...)` or none."""
    return f"under torch.autocast({device!r}, dtype={dtype})" if on else "without autocast"


class LateGradient(NimbleError):
    """A backward gave a gradient to a parameter the fused update had left out."""


class Iteration:
    """Forward, loss, backward and update of `model` with `update` (an _update.Update)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, amp: str | None,
                 grad_clip: float | None, params: list[torch.Tensor], device: torch.device,
                 update, gradsync, sync_recorder, ema=None, accumulate: int = 1,
                 products=None):
        self.model, self.loss_fn, self.amp, self.grad_clip = model, loss_fn, amp, grad_clip
        self.params, self.device, self.update = params, device, update
        self.gradsync, self.sync, self.ema = gradsync, sync_recorder, ema
        self.accumulate = accumulate
        # A compiled model's weight products (_inductor_grads.WeightProducts), or None
        self.products = products
        self.per_sample: bool | None = None  # does loss_fn return one loss per sample?
        # The dtype of the loss a step returns: float32 for per-sample losses (their mean),
        # else the scalar's own, as the last step saw it (a graph's loss buffer takes it).
        self.loss_dtype = torch.float32
        self.grad_norm: torch.Tensor | None = None  # the last clipping's norm (before it)
        self._got_grad = [False] * len(params)  # which parameters a backward reached
        # A step to be captured: the first parameter an eager backward gave a sparse gradient
        # (nn.Embedding(sparse=True)), which neither the flat buffers nor a graph can hold.
        self.sparse_grad: int | None = None
        # The gradient tensors a window's calls accumulate into (accumulate > 1, not fused:
        # the fused update keeps them as views of its flat buffers).
        self.window_grads: list[torch.Tensor | None] | None = None
        # Trained parameters the fused update left out (no gradient in warm-up), by position;
        # a backward that gives one a gradient raises LateGradient (check_left_out).
        self.left_out: list[int] = []
        self.name_of: Callable[[int], str] = str  # a parameter's name for an error (Step's)

    # ------------------------------------------------------------------ forward and loss

    def loss(self, batch: Any, batch_size: int, valid: torch.Tensor | None,
             model: Callable | None = None) -> torch.Tensor:
        """Forward and loss. `valid` (a 0-dim float tensor) masks rows at or past it."""
        with self._autocast():
            losses = self._forward(batch, model or self.model)
        if not self._classify(losses, batch_size):
            self.loss_dtype = losses.dtype
            return losses
        losses = losses.float()
        if valid is None:
            return losses.mean()
        keep = torch.arange(batch_size, device=losses.device) < valid
        # where, not a product: a padded row's loss may be inf or NaN, and 0 * NaN is NaN.
        return torch.where(keep, losses, 0.0).sum() / valid

    def sample_losses(self, batch: Any) -> torch.Tensor:
        """The per-sample losses of `batch` (the padding check's forward)."""
        with self._autocast():
            return self._forward(batch, self.model)

    def _autocast(self):
        dtype = AMP_DTYPES[self.amp]
        if dtype is None:
            return contextlib.nullcontext()
        # The autocast cache would keep casts made during capture alive across replays.
        return torch.autocast(self.device.type, dtype=dtype, cache_enabled=False)

    def _forward(self, batch: Any, model: Callable) -> torch.Tensor:
        args, kwargs = model_arguments(batch)
        outputs = model(*args, **kwargs)
        if isinstance(batch, dict):
            if self.loss_fn is not None:
                return self.loss_fn(outputs, batch)
            return own_loss(outputs)
        _, target = batch
        return self.loss_fn(outputs, target)

    def _classify(self, losses: Any, batch_size: int) -> bool:
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
                "return per-sample losses (e.g. reduction='none').")
        if self.per_sample is None:
            self.per_sample = kind
        return kind

    def can_pad(self, partial_batch: str) -> bool:
        """A short batch can be padded when losses are per sample and no layer sees the batch."""
        return (partial_batch == "pad" and self.per_sample is not False
                and not has_batch_statistics(self.model))

    # ------------------------------------------------------------------ backward and update

    def step(self, batch: Any, batch_size: int, valid: torch.Tensor | None, captured: bool,
             call: Call = None) -> torch.Tensor:
        """One whole call, eagerly (`captured`: gradients live in a captured graph's pool,
        which eager steps must zero in place); returns the detached loss."""
        call = call or FULL_STEP
        self.keep_accumulated_grads()
        if call.zero:
            self.zero_grad(captured)
        sync = self.gradsync
        # Before the buckets are planned: the order gradients arrive in, and which parameters
        # the backward reads after their gradient (sync.observing).
        with (sync.observing(self.params) if sync is not None and self.update.needs_fusing
              else contextlib.nullcontext()) as count_uses:
            loss = self.loss(batch, batch_size, valid)
            if count_uses is not None:
                count_uses(loss)
            self.backward_and_update(loss, call)
        return loss.detach()

    def zero_grad(self, captured: bool) -> None:
        if self.update.fused is not None:
            self.update.fused.zero_grad()  # one memset per flat gradient buffer
        else:
            # After capture, gradients live in the graph's pool: zero them in place, so that
            # p.grad keeps pointing at the tensors the replays write. With accumulation the
            # graphs of one window accumulate into the same tensors: always in place.
            in_place = captured or (self.accumulate > 1 and self.update.will_capture)
            self.update.optimizer.zero_grad(set_to_none=not in_place)

    def got_gradients(self) -> list[bool]:
        """Per parameter: whether a backward so far gave it a gradient (user code may have
        set the gradients to None since: Trainer loops zero them after every update)."""
        return [got or p.grad is not None for got, p in zip(self._got_grad, self.params)]

    def _note_gradients(self) -> None:
        if not all(self._got_grad):
            self._got_grad = self.got_gradients()

    def keep_accumulated_grads(self) -> None:
        """Before an eager call or a capture: gradients user code set to None between calls
        (``zero_grad()`` after an update, as Trainer and Lightning loops do) are put back where
        the calls accumulate them, values kept: a call inside a window adds to what the
        window's graphs or eager calls accumulated, and a window's first call zeroes the
        tensors its graphs read."""
        if self.update.fused is not None:
            self.update.fused.attach_grads()
        elif self.window_grads is not None:
            for p, grad in zip(self.params, self.window_grads):
                if p.grad is None and grad is not None:
                    p.grad = grad

    def backward_and_update(self, loss: torch.Tensor, call: Call = None) -> None:
        """Backward of `loss` (weighted by call.weight), then, when call.update, the gradient
        all-reduce, clipping, the optimizer's update and the EMA."""
        call = call or FULL_STEP
        if call.weight is not None:
            loss = loss.float() * call.weight
        fused, sync = self.update.fused, self.gradsync
        if fused is not None:
            self._fused_backward_and_update(loss, call)
            return
        scaler = self.update.grad_scaler
        with steps_backward():
            (scaler.scale(loss) if scaler else loss).backward()
        self._note_gradients()
        if self.sparse_grad is None and self.update.will_capture:
            self.sparse_grad = next((i for i, p in enumerate(self.params) if p.grad is not None
                                     and p.grad.layout != torch.strided), None)
        if self.accumulate > 1:
            self.window_grads = [p.grad for p in self.params]
        if not call.update:
            return
        optimizer = self.update.optimizer
        # The all-reduce and the update are ours, not the user's code: their syncs (the check
        # of which parameters got gradients, GradScaler's) are not recorded.
        with self.sync.paused() if self.sync else contextlib.nullcontext():
            if sync is not None:
                sync.all_reduce_grads(self.params)  # (scaled) gradients, before clip and update
            correction = call.correction
            if correction is not None and not (isinstance(correction, float)
                                               and correction == 1.0):
                if isinstance(correction, torch.Tensor):
                    correction = correction.reshape(())  # a device scalar
                grads = [p.grad for p in self.params if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, correction)
            if self.grad_clip is not None:
                if scaler:
                    scaler.unscale_(optimizer)
                # foreach norms, clamped factor as a device tensor: no host sync, capturable.
                self.grad_norm = torch.nn.utils.clip_grad_norm_(
                    self.params, self.grad_clip, foreach=self.device.type == "cuda")
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        if self.ema is not None:
            self.ema.update()

    def _fused_backward_and_update(self, loss: torch.Tensor, call: Call) -> None:
        fused, scaler, sync = self.update.fused, self.update.scaler, self.gradsync
        correction = call.correction  # a device tensor: the staging ring's (fused => a graph)
        assert correction is None or isinstance(correction, torch.Tensor), correction
        # A captured step updates each bucket right after its collective (or, when clipping or
        # the fp16 loss scale needs every gradient first, takes its share of the gradient
        # statistics there); an eager step updates after its backward, so that one that
        # raises part-way leaves the parameters as they were.
        in_buckets = (call.update and sync is not None and sync.update_in_buckets
                      and torch.cuda.is_current_stream_capturing())
        step_args = {}
        if in_buckets:
            step_args = {"grad_scale": correction, "max_grad_norm": self.grad_clip}
            if scaler is not None:
                step_args.update(inv_scale=scaler.inv_scale(), found_inf=scaler.found_inf)
        if sync is not None and call.update:
            # buckets are all-reduced as their gradients arrive (and, in_buckets, updated)
            sync.begin(fused if in_buckets else None, **step_args)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        handed = (hand_grads_to_autograd(self.params, zero_kept=capturing)
                  if self.hands_over(call) else None)
        products = self.products
        if handed is None or products is None:
            around = contextlib.nullcontext()
        else:
            around = (products.writing if capturing else products.learning)(handed, self.params)
        try:
            with around, steps_backward():
                (loss if scaler is None else scaler.scale_loss(loss)).backward()
            take_back_grads(handed, zero_unreached=capturing)
            self.check_left_out()
        except BaseException:
            take_back_grads(handed, copy=False)  # the views back; the capture is abandoned
            if sync is not None:
                sync.cancel()
            raise
        if not call.update:
            return  # a micro-batch: its gradients accumulate, nothing else happens
        norm = None
        if sync is not None:
            norm = sync.finish()  # waits for every bucket (in_buckets: the update is done)
        if not in_buckets:
            self._fused_update(correction)
        else:
            if scaler is not None:
                scaler.update()
            if self.grad_clip is not None:
                self.grad_norm = norm
        if self.ema is not None:
            self.ema.update()

    def check_left_out(self) -> None:
        """After a fused step's backward: a parameter the update left out that got a gradient
        would silently never train. Its gradient is dropped and LateGradient raised, before
        the update."""
        late = [i for i in self.left_out if self.params[i].grad is not None]
        if not late:
            return
        for i in late:
            self.params[i].grad = None
        names = ", ".join(self.name_of(i) for i in late[:3])
        more = f" and {len(late) - 3} more" if len(late) > 3 else ""
        raise LateGradient(
            f"nimble_train.Step: {names}{more} got a gradient, and none in the warm-up steps "
            "before the update was fused (the first max(warmup - 1, 1) calls), so the fused "
            "update and the graphs were planned without it, as torch.optim's step() skips a "
            "parameter without a gradient: it would never train. Give every trained parameter "
            "a gradient in those calls (with shape buckets, a forward of another length may use "
            "layers a shorter one does not: put a batch of the longest length first), freeze "
            "the ones that should not train "
            "(requires_grad_(False)) before building the Step, or train with "
            "nt.Step(..., capture=False), whose steps call optimizer.step(). Nothing was "
            "applied for this call: the parameters, buffers and optimizer are as after the "
            "last completed call.")

    def hands_over(self, call: Call) -> bool:
        """Whether `call`'s backward hands the gradients to autograd: captured calls whose
        gradients were just zeroed, and, to learn a compiled model's weight products
        (_inductor_grads), its eager ones. Autograd then keeps the gradient it computed as it
        is, rather than adding it into the zeroed flat buffer, and :func:`take_back_grads`
        copies them all in with one multi-tensor copy after the backward. That takes a kernel
        per parameter off the backward's critical path (each a launch of its own in the graph:
        a ResNet-18's 40 batch-norm parameters, every parameter of a model under
        torch.compile). The values are the same: 0 + g is g. A captured call then zeroes only
        the views autograd will add into (:func:`hand_grads_to_autograd`), not the buffers.

        Not for data parallel steps (the buckets hear of gradients through the accumulation).
        """
        if not (HAND_OVER_GRADIENTS and call.zero and self.gradsync is None
                and self.device.type == "cuda"):
            return False
        return torch.cuda.is_current_stream_capturing() or (
            self.products is not None and self.products.off is None)

    def _fused_update(self, correction: torch.Tensor | None) -> None:
        """The fused update after the backward, as one pass."""
        fused, scaler, sync = self.update.fused, self.update.scaler, self.gradsync
        if scaler is None:  # clipping fused in
            norm = fused.step(max_grad_norm=self.grad_clip, grad_scale=correction)
        else:
            # Unscale, clip and the overflow skip inside the update; the scale moves on the
            # device: no host sync anywhere.
            norm = scaler.step(fused, max_grad_norm=self.grad_clip, grad_scale=correction)
        if self.grad_clip is not None:
            self.grad_norm = norm
        if sync is not None:
            sync.after_update()  # sharded: every rank gets every updated part


def hooked(p: torch.Tensor) -> bool:
    """Whether a hook watches `p`'s gradient (registered on it, or after its accumulation)."""
    return bool(_torch_private.tensor_hooks(p) or _torch_private.post_accumulate_grad_hooks(p))


def hand_grads_to_autograd(params: list[torch.Tensor], zero_kept: bool = False) -> list:
    """Sets ``.grad = None`` on each of `params` that has a gradient tensor (its view into a
    flat buffer) and no hook watching it (hooks, the weight-gradient side stream's or a
    user's, see or make ``.grad`` as accumulated); returns the (param, view) pairs, for
    :func:`take_back_grads`. `zero_kept`: the gradients not handed over are zeroed, for a
    backward to add into (a captured step zeroes no flat buffer when it hands over)."""
    handed, kept = [], []
    for p in params:
        if p.grad is not None:
            (kept if hooked(p) else handed).append(p)
    if zero_kept and kept:
        torch._foreach_zero_([p.grad for p in kept])
    handed = [(p, p.grad) for p in handed]
    for p, _ in handed:
        p.grad = None
    return handed


class MisdirectedGradient(RuntimeError):
    """A backward left a parameter's gradient in another parameter's flat view."""


def take_back_grads(handed: list | None, copy: bool = True,
                    zero_unreached: bool = False) -> None:
    """The views go back to the parameters :func:`hand_grads_to_autograd` handed over, and
    (`copy`) the gradients autograd left in their place are copied into them, on the current
    stream, with one multi-tensor copy; a gradient made in its view already (a compiled
    model's weight product, _inductor_grads) is left there. A parameter the backward did not
    reach keeps its view as it was, zeroed if `zero_unreached`.

    Raises MisdirectedGradient, the views back and nothing copied, if a gradient lies in a
    flat buffer without being its parameter's view: copying it would race with the copy into
    its own view."""
    if handed is None:
        return
    if copy:
        try:
            check_directed(handed)
        except MisdirectedGradient:
            take_back_grads(handed, copy=False)
            raise
    views, grads, zeros = [], [], []
    for p, view in handed:
        grad, p.grad = p.grad, view
        if not copy or is_view(grad, view):
            continue
        if grad is None:
            if zero_unreached:
                zeros.append(view)
            continue
        views.append(view)
        grads.append(grad)
    if zeros:
        torch._foreach_zero_(zeros)
    if not views:
        return
    if views[0].is_cuda:
        current = torch.cuda.current_stream()
        for grad in grads:
            grad.record_stream(current)  # made on a forward stream: freed after the copy
    torch._foreach_copy_(views, grads)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def is_view(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    """Whether `grad` is `view`'s memory, laid out as `view`."""
    return (grad is not None and grad.data_ptr() == view.data_ptr()
            and same_layout(grad, view))


def check_directed(handed: list) -> None:
    """Raises MisdirectedGradient if a handed parameter's gradient lies in a flat buffer (the
    storage of a handed view) without being its own view."""
    storages = {view.untyped_storage().data_ptr() for _, view in handed}
    for p, view in handed:
        grad = p.grad
        if (grad is not None and not is_view(grad, view)
                and grad.untyped_storage().data_ptr() in storages):
            raise MisdirectedGradient(
                f"the gradient of a parameter of shape {tuple(p.shape)} lies in another "
                "parameter's flat gradient view")


def model_arguments(batch: Any) -> tuple[tuple, dict]:
    """The model's arguments in `batch` (DESIGN.md's batch conventions): a dict's items as
    keywords; of an (inputs, target) pair, the inputs, a tuple of them spread."""
    if isinstance(batch, dict):
        return (), batch
    inputs, _ = batch
    return (inputs if isinstance(inputs, tuple) else (inputs,)), {}


def own_loss(outputs: Any) -> torch.Tensor:
    """The loss a model returned itself: outputs.loss, outputs["loss"] or a 0-dim tensor."""
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


def has_batch_statistics(model: torch.nn.Module) -> bool:
    """Layers whose training-mode output or running statistics depend on the whole batch."""
    batch_norm, norm_base = _torch_private.batch_statistics_layers()
    for m in model.modules():
        if isinstance(m, norm_base) and m.training:
            if isinstance(m, batch_norm) or m.track_running_stats:
                return True
    return False
