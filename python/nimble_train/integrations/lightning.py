"""A Lightning strategy whose training steps are nt.Step calls: an unchanged LightningModule
(automatic optimization) trains through one Step call per training batch.

Before::

    trainer = lightning.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed",
                                accumulate_grad_batches=2, gradient_clip_val=1.0)

After::

    from nimble_train.integrations.lightning import NimbleStrategy
    trainer = lightning.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed",
                                accumulate_grad_batches=2, gradient_clip_val=1.0,
                                strategy=NimbleStrategy(warmup=3))   # optional: Step options

Why a Strategy. Lightning's automatic-optimization loop runs each batch as a closure: the
closure calls ``strategy.training_step`` (the module's ``training_step``), then the optimizer's
``zero_grad`` hook at a window's first batch, then ``strategy.backward``; on a batch that ends
a window the loop runs the closure from inside ``strategy.optimizer_step`` (through the
module's ``optimizer_step`` hook and LightningOptimizer). Those three methods are the whole
per-batch training computation, so a Strategy that overrides them can put forward, loss,
backward, clipping and the update into one Step call where ``training_step`` ran, and leave
everything else to Lightning: data, progress and ``global_step``, LR schedulers, callbacks,
loggers, checkpoints, validation scheduling. A Callback cannot replace the step (it only
observes it); a precision plugin sees only the closure, and only on batches that step; a
wrapper around the module would change the user's code. The Strategy derives from
SingleDeviceStrategy: the Step trains on one device.

How Lightning maps onto the Step:

- ``training_step(batch, batch_idx)`` is the Step's loss: the Step trains a module whose
  forward calls it (the batch reaches the Step as ``{"batch": batch}``). A replay runs no
  Python: the module must compute the same thing each call (``batch_idx``, ``global_step`` or
  other Python values it reads are those of the call that was captured);
- ``accumulate_grad_batches=K`` -> ``accumulate=K``; a batch Lightning steps on before the
  window is full (the epoch's last) is ``step(batch, update=True)``. Lightning divides the loss
  by K, the Step weights a scalar loss 1/K: the same;
- ``gradient_clip_val`` (algorithm "norm") -> ``grad_clip``, on the optimizer's parameters as
  Lightning clips them;
- ``precision="bf16-mixed"`` -> ``amp="bf16"``; ``"16-mixed"`` -> ``amp="fp16"`` when its
  GradScaler has torch's default settings (the Step's loss scale starts and moves as it does);
  ``"32-true"`` -> no autocast;
- streams (``NimbleStrategy(streams=...)``, "auto" by default): ``training_step`` is not
  traced (its ``self.log`` calls would run on proxies); the LightningModule's own forward,
  which ``training_step`` calls as ``self(x)``, is: the Step plans it on streams and, while it
  captures, runs the plan in its place. A ``training_step`` that calls its layers directly
  runs them as they are (``stats()["single_stream_reason"]`` says so). The backward's weight
  gradients run on a side stream either way;
- LR schedulers from ``configure_optimizers`` are stepped by Lightning as before; the Step
  reads each param group's lr at every call (no recapture);
- ``self.log(...)`` (and ``log_dict``) inside ``training_step``: while the step body runs
  (eagerly or being captured) each call is recorded with a copy of its tensor instead of being
  logged; a captured copy lives in the graph's pool, and every replay of that graph rewrites it.
  After each Step call the strategy logs the records of the body that produced the call's loss
  (the graph it replayed, or the eager body that just ran) through the real ``self.log``, which
  copies the value: logging, the progress bar and epoch means see every batch's value. A Python
  number logged inside ``training_step`` stays the captured one in replays (a warning says so);
- validation: ``validation_step`` runs through ``step.evaluator``: captured into the Step's pool
  once the Step replays (a graph per batch shape), eager before that and for a short last batch.
  Its ``self.log`` calls are recorded the same way and returned by the evaluator as device
  tensors, then logged through the real ``self.log`` after each call. ``trainer.validate()``
  outside ``fit`` and ``test_step``/``predict_step`` run as Lightning runs them;
- the optimizer's ``zero_grad`` hook still runs at each window's first batch (after that batch's
  Step call); the Step's next call puts back the gradients it set to None (the Step zeroes
  them itself at the start of every window).

Refused with an error naming the Lightning argument (each cannot be mapped onto one Step call):
manual optimization, several optimizers (or none), ``gradient_clip_algorithm="value"``,
precisions other than 32-true, bf16-mixed and 16-mixed with a default scaler, several devices
or nodes, a module that overrides ``backward``, ``optimizer_zero_grad``,
``configure_gradient_clipping``, ``on_before_backward``, ``on_after_backward`` or
``on_before_optimizer_step`` (or a callback that implements one of the last three: they would
run inside the captured step), an ``optimizer_step`` override that does not run the closure
through ``optimizer.step(closure=...)``, and a run that changes the optimizer,
``accumulate_grad_batches`` or ``gradient_clip_val`` after the Step was built. Refused when
they happen: a ``training_step`` that returns None (a skipped batch) and ``self.log`` of a
torchmetrics Metric inside a step (its update is Python).

Differences that remain: ``on_before_zero_grad`` runs after the window's first Step call, not
before it; with "16-mixed" the loss scale is the Step's, on the device: the precision plugin's
GradScaler stays unused, so a checkpoint holds its initial state and a resumed run starts the
Step's scale afresh.

Step options: ``NimbleStrategy(warmup=3, capture=True, partial_batch="pad", buckets=None,
ema=None)``; ``strategy.nimble_step`` is the nt.Step while training (``stats()``,
``ema_weights()``), ``strategy.stats()`` its stats, also after ``fit`` has closed it. The
forward runs on one stream: the stream planner traces the forward with torch.fx, and a traced
``training_step`` would drop its ``self.log`` calls.
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as error:  # pragma: no cover - only without the extra
    raise ImportError(
        "nimble_train.integrations.lightning needs Lightning 2.x (the `lightning` package); "
        "install it with pip install 'nimble_train[lightning]'") from error

from .. import _options
from .._buckets import Buckets
from ..errors import NimbleError
from ..step import Step

# Module hooks whose work the Step does itself, inside the graph: an override would not run.
_MODULE_HOOKS = ("backward", "optimizer_zero_grad", "configure_gradient_clipping",
                 "on_before_backward", "on_after_backward", "on_before_optimizer_step")
# Callback hooks that would have to run between the backward and the update.
_CALLBACK_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")
# torch.amp.GradScaler's defaults, which the Step's fp16 loss scale starts from.
_DEFAULT_SCALER = {"scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
                   "growth_interval": 2000}


@dataclass
class _Logged:
    """One ``self.log`` call made while a step body ran: a copy of the tensor (or the number),
    and the call's other arguments, to be given to the real ``self.log`` after the call."""

    name: str
    value: Any
    args: tuple
    kwargs: dict


@dataclass
class _Body:
    """What one run of ``training_step`` produced besides its loss."""

    logs: list[_Logged]
    extra: dict = field(default_factory=dict)  # the output dict's other entries
    captured: bool = False  # ran inside a capture: its tensors are rewritten by each replay


class _TrainingStepModule(torch.nn.Module):
    """What the Step trains: ``forward(batch)`` is the LightningModule's ``training_step``,
    whose ``self.log`` calls are recorded (see the module's docstring). torch.fx is not to run
    ``training_step`` on proxies (its ``self.log`` calls would log them): the Step traces the
    LightningModule's own forward, which ``training_step`` calls as ``self(x)``, plans it on
    streams and runs the plan there (with the weight gradients of the backward on a side
    stream)."""

    nimble_untraced = "a LightningModule's training_step is not traced by torch.fx"
    nimble_traced_submodule = "module"

    def __init__(self, module: pl.LightningModule):
        super().__init__()
        self.module = module
        # training_step's arguments after the batch (batch_idx): the captured ones are what the
        # replays run (the module's docstring); private, so that the Step's watch of the
        # numbers a forward reads does not refuse the next call's batch_idx
        self._step_args: tuple = ()
        self._step_kwargs: dict = {}
        # The bodies that ran, by the address of the loss they returned: an eager step's body
        # just ran, a replay's ran in its capture (Step._loss_made).
        self.bodies: dict[int, _Body] = {}

    def forward(self, batch: Any) -> torch.Tensor:
        logs: list[_Logged] = []
        with _recording_logs(self.module, logs, "training_step"):
            output = self.module.training_step(batch, *self._step_args, **self._step_kwargs)
        loss, extra = _split_output(output)
        capturing = loss.is_cuda and torch.cuda.is_current_stream_capturing()
        self.bodies[loss.data_ptr()] = _Body(logs, extra, captured=capturing)
        return loss

    def body_of(self, made: int) -> _Body:
        """The records of the body whose loss was at address `made`; eager bodies' records are
        dropped."""
        body = self.bodies.get(made)
        if body is None:
            raise NimbleError(
                "NimbleStrategy: the Step returned a loss that no run of training_step made, so "
                "its self.log values cannot be found; this is a bug in nimble_train")
        self.bodies = {ptr: b for ptr, b in self.bodies.items() if b.captured}
        return body

    def evaluate(self, model: torch.nn.Module, batch: dict, meta: list) -> dict:
        """The evaluator's fn: ``validation_step`` with its self.log calls recorded; returns
        their tensors (and validation_step's own tensors) as a dict the evaluator can capture,
        and leaves in `meta` how to log them."""
        logs: list[_Logged] = []
        with _recording_logs(self.module, logs, "validation_step"):
            output = self.module.validation_step(batch["batch"], *self._step_args,
                                                 **self._step_kwargs)
        out = {}
        for i, logged in enumerate(logs):
            if isinstance(logged.value, torch.Tensor):
                out[f"log/{i}"] = logged.value
        out.update(_eval_output(output))
        meta[:] = logs
        return out


class NimbleStrategy(SingleDeviceStrategy):
    """Trains a LightningModule with one nt.Step call per training batch (see the module's
    docstring for what maps to what and what is refused).

    Args:
        streams: "auto" (the default), a limit, or 1: beyond 1, the LightningModule's
            forward (what ``training_step`` calls as ``self(x)``) is traced and planned on
            several streams where it has branches, and the backward's weight gradients of
            convolutions and linear layers run on a side stream, off its critical path (a
            compiled module's convolutions' on two). 1: the whole step on one stream.
        warmup: eager training steps before the Step captures (at least 1).
        capture: False runs every step eagerly with the Step's semantics (debugging).
        partial_batch: "pad", "eager" or "error" for a batch shorter than the first (a scalar
            loss from training_step is never padded: such a batch runs eagerly).
        buckets: None, or nt.Buckets(...): variable-length batches padded to a few lengths,
            each with its graph.
        ema: None, or a decay in (0, 1): an EMA of the weights kept in the graph
            (``strategy.nimble_step.ema_weights()``).

    The other Step options follow from the Trainer: ``accumulate`` from
    ``accumulate_grad_batches``, ``grad_clip`` from ``gradient_clip_val``, ``amp`` from
    ``precision``; the device from ``accelerator`` and ``devices`` (one device).
    """

    def __init__(self, *, streams: str | int = "auto", warmup: int = 3, capture: bool = True,
                 partial_batch: str = "pad", buckets: Buckets | None = None,
                 ema: float | None = None, checkpoint_io=None):
        _options.check_streams(streams)
        super().__init__(checkpoint_io=checkpoint_io)
        self.step_options = {"streams": streams, "warmup": warmup, "capture": capture,
                             "partial_batch": partial_batch, "buckets": buckets, "ema": ema}
        self._parallel_devices: list[torch.device] | None = None
        self._num_nodes = 1
        self.nimble_step: Step | None = None
        self._module: _TrainingStepModule | None = None
        self._evaluators: dict[int, tuple] = {}  # dataloader index -> (evaluator, log meta)
        self._stepping = False       # inside optimizer_step: this batch ends a window
        self._calls = 0              # Step calls made by training_step
        self._micro = 0              # the next call's place in its window
        self._clip: float | None = None
        self._stats: dict | None = None
        self._warned_numbers: set[str] = set()

    # ------------------------------------------------------------------ devices

    # Lightning's accelerator connector gives a strategy that has these attributes the devices
    # and nodes the Trainer was asked for (a plain SingleDeviceStrategy silently uses one).
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices is not None and len(devices) != 1:
            raise ValueError(
                f"NimbleStrategy trains on one device; Trainer(devices=...) asked for "
                f"{len(devices)} ({', '.join(str(d) for d in devices)}). Pass devices=1 (or "
                "devices=[i] for GPU i); for several GPUs launch one process per GPU with "
                "torchrun and train with nt.Step directly")
        self._parallel_devices = devices
        if devices:
            self._root_device = devices[0]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, nodes: int) -> None:
        if nodes != 1:
            raise ValueError(f"NimbleStrategy trains on one device; Trainer(num_nodes={nodes}) "
                             "asks for several machines. Pass num_nodes=1")
        self._num_nodes = nodes

    # ------------------------------------------------------------------ set-up

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if not module.automatic_optimization:
            raise NimbleError(
                f"NimbleStrategy needs automatic optimization; {type(module).__name__} sets "
                "self.automatic_optimization = False (manual optimization: training_step calls "
                "the optimizers itself, which one captured Step call cannot replay). Remove "
                "that line and let training_step return the loss, or train with another strategy")
        try:
            super().setup_optimizers(trainer)
        except RuntimeError as error:
            if "multiple optimizers" not in str(error):
                raise
            raise NimbleError(_several_optimizers(module, "several optimizers")) from error
        optimizers = self.optimizers
        if len(optimizers) != 1:
            raise NimbleError(_several_optimizers(module, f"{len(optimizers)} optimizers"))
        # configure_optimizers returning None gives a stand-in over a tensor of its own.
        own, params = {id(p) for p in module.parameters()}, _params(optimizers[0])
        if not params or not all(id(p) in own for p in params):
            raise NimbleError(_several_optimizers(
                module, "no optimizer, or one over tensors that are not its parameters"))

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        _refuse_hooks(module, trainer)
        self._clip = _grad_clip(trainer)
        self._close_step()
        self._module = _TrainingStepModule(module)
        self.nimble_step = Step(self._module, self.optimizers[0], None,
                         amp=_amp(self.precision_plugin, trainer),
                         grad_clip=self._clip,
                         accumulate=_accumulate(trainer.accumulate_grad_batches),
                         **self.step_options)
        self._stats = None
        self._evaluators = {}
        self._micro = 0

    # ------------------------------------------------------------------ training

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        step, trainer = self.nimble_step, self.lightning_module.trainer
        self._check_unchanged(trainer)
        if not self._stepping and self._micro == step.accumulate - 1:
            raise NimbleError(
                "NimbleStrategy: training_step ran outside optimizer.step() on a batch that "
                f"completes a window of accumulate_grad_batches={step.accumulate}; the Step "
                "updates inside training_step, so an override of LightningModule.optimizer_step "
                "must run the closure through optimizer.step(closure=optimizer_closure)")
        batch, args, kwargs = _split_batch(args, kwargs)
        self._module._step_args, self._module._step_kwargs = args, kwargs
        loss = step({"batch": batch}, update=self._stepping)
        self._calls += 1
        self._micro = 0 if self._stepping else self._micro + 1
        body = self._module.body_of(step._loss_made(loss))
        self._log(body.logs, "training_step")
        if not body.extra:
            return loss
        return {"loss": loss, **{k: v.clone() if isinstance(v, torch.Tensor) else v
                                 for k, v in body.extra.items()}}

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """The Step ran the backward (and, on a window's last batch, the update). Lightning
        calls this after the optimizer's zero_grad hook, which at a window's first batch sets
        that batch's gradients to None: the Step's next call puts them back."""
        return closure_loss.detach()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None,
                       **kwargs: Any) -> Any:
        """A batch that ends a window: its training_step (inside `closure`) is the Step call
        that updates; the optimizer itself is not stepped."""
        if kwargs:
            raise NimbleError(
                f"NimbleStrategy: optimizer.step() was given {sorted(kwargs)}; the Step's update "
                "takes no arguments. Call optimizer.step(closure=optimizer_closure) in "
                "LightningModule.optimizer_step")
        calls = self._calls
        self._stepping = True
        try:
            result = closure()
        finally:
            self._stepping = False
        if self._calls == calls:
            raise NimbleError(
                "NimbleStrategy: optimizer_step ran without running training_step; the Step "
                "updates inside training_step, so an override of LightningModule.optimizer_step "
                "must call optimizer.step(closure=optimizer_closure) (or be removed)")
        return result

    def _check_unchanged(self, trainer: pl.Trainer) -> None:
        step = self.nimble_step
        if self.optimizers[0] is not step.optimizer or len(self.optimizers) != 1:
            raise NimbleError(
                "NimbleStrategy: the Trainer's optimizers changed during fit (now "
                f"{[type(o).__name__ for o in self.optimizers]}, the Step was built for one "
                f"{type(step.optimizer).__name__}); the Step captures one optimizer's update. Keep "
                "the optimizer configure_optimizers returned; change its param_groups' values "
                "(lr, weight decay) instead")
        if trainer.accumulate_grad_batches != step.accumulate:
            raise NimbleError(
                f"NimbleStrategy: accumulate_grad_batches changed during fit (now "
                f"{trainer.accumulate_grad_batches}, the Step was built with "
                f"{step.accumulate}), e.g. by GradientAccumulationScheduler or "
                "StochasticWeightAveraging; keep Trainer(accumulate_grad_batches=...) fixed")
        if _grad_clip(trainer) != self._clip:
            raise NimbleError(
                f"NimbleStrategy: gradient_clip_val changed during fit (now "
                f"{trainer.gradient_clip_val!r}, the Step clips at {self._clip!r}); keep "
                "Trainer(gradient_clip_val=...) fixed")

    # ------------------------------------------------------------------ validation

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.nimble_step is None:  # trainer.validate() outside fit
            return super().validation_step(*args, **kwargs)
        batch, args, kwargs = _split_batch(args, kwargs)
        loader = kwargs.get("dataloader_idx", args[1] if len(args) > 1 else 0)
        if loader not in self._evaluators:
            meta: list[_Logged] = []
            module = self._module
            evaluator = self.nimble_step.evaluator(
                lambda model, b: module.evaluate(model, b, meta))
            self._evaluators[loader] = (evaluator, meta)
        evaluator, meta = self._evaluators[loader]
        self._module._step_args, self._module._step_kwargs = args, kwargs
        out = evaluator({"batch": batch})
        logs = [_Logged(m.name, out[f"log/{i}"] if isinstance(m.value, torch.Tensor)
                        else m.value, m.args, m.kwargs) for i, m in enumerate(meta)]
        self._log(logs, "validation_step")
        return _eval_result(out)

    # ------------------------------------------------------------------ logging

    def _log(self, logs: list[_Logged], where: str) -> None:
        module = self.lightning_module
        for logged in logs:
            if (not isinstance(logged.value, torch.Tensor)
                    and self.nimble_step.stats()["captured"]):
                self._warn_number(logged.name, where)
            module.log(logged.name, logged.value, *logged.args, **logged.kwargs)

    def _warn_number(self, name: str, where: str) -> None:
        if name in self._warned_numbers:
            return
        self._warned_numbers.add(name)
        warnings.warn(
            f"self.log({name!r}, <a Python number>) in {where}: a captured step runs no Python, "
            "so every replay logs the number seen when it was captured. Log a tensor computed "
            "on the device, or log the value from a hook outside the step (on_train_batch_end)",
            stacklevel=2)

    # ------------------------------------------------------------------ the rest

    def stats(self) -> dict | None:
        """The Step's stats (nt.Step.stats()); after fit, those it had when it was closed."""
        return self.nimble_step.stats() if self.nimble_step is not None else self._stats

    def teardown(self) -> None:
        self._close_step()
        super().teardown()

    def _close_step(self) -> None:
        if self.nimble_step is not None:
            self._stats = self.nimble_step.stats()
            self.nimble_step.close()
        self.nimble_step = None
        self._evaluators = {}
        if self._module is not None:
            self._module.bodies = {}  # their tensors hold memory of the released pool


# ---------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _recording_logs(module: pl.LightningModule, into: list[_Logged], where: str):
    """``module.log`` records into `into` for the block (an instance attribute shadows the
    method; ``log_dict`` calls ``self.log`` and is recorded too)."""

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()  # as self.log does; captured: in the graph's pool
        elif not isinstance(value, numbers.Number):
            raise TypeError(
                f"NimbleStrategy: self.log({name!r}, {type(value).__name__}) in {where}: a "
                "captured step can log tensors (and numbers) only, not a torchmetrics Metric or "
                "a dict, whose updates run Python each step. Log the tensor the metric is "
                "computed from (e.g. (preds == y).float().mean()), or update the metric in "
                "on_train_batch_end / on_validation_batch_end")
        into.append(_Logged(name, value, args, kwargs))

    module.__dict__["log"] = record
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _split_batch(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """The batch of a step hook's arguments, and the arguments after it."""
    kwargs = dict(kwargs)
    if args:
        batch, args = args[0], tuple(args[1:])
    elif "batch" in kwargs:
        batch = kwargs.pop("batch")
    else:
        raise TypeError("NimbleStrategy: the step was called without a batch")
    if not isinstance(batch, (tuple, list, dict)):
        raise TypeError(
            f"NimbleStrategy: training_step/validation_step got a batch of type "
            f"{type(batch).__name__}; the Step needs a tuple, list or dict of tensors (as a "
            "DataLoader collates them). A training_step(self, dataloader_iter) cannot be "
            "captured: take (batch, batch_idx)")
    return batch, args, kwargs


def _split_output(output: Any) -> tuple[torch.Tensor, dict]:
    """training_step's loss and its output's other entries."""
    if isinstance(output, torch.Tensor):
        return output, {}
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"], {k: v for k, v in output.items() if k != "loss"}
    if output is None:
        raise TypeError(
            "NimbleStrategy: training_step returned None (Lightning then skips the batch); a "
            "captured step runs the same computation on every batch and cannot skip one. "
            "Return the loss on every batch (multiply it by 0 to ignore a batch)")
    raise TypeError(
        f"NimbleStrategy: training_step must return the loss tensor or a dict with a 'loss' "
        f"tensor; got {type(output).__name__}")


def _eval_output(output: Any) -> dict:
    """validation_step's output as evaluator outputs (tensors only)."""
    if output is None:
        return {}
    if isinstance(output, torch.Tensor):
        return {"out": output}
    if isinstance(output, dict) and all(isinstance(v, torch.Tensor) for v in output.values()):
        return {f"out/{k}": v for k, v in output.items()}
    raise TypeError(
        f"NimbleStrategy: validation_step returned {type(output).__name__}; a captured "
        "validation step returns None, a tensor or a dict of tensors")


def _eval_result(out: dict) -> Any:
    """What validation_step returned, rebuilt from the evaluator's outputs."""
    if "out" in out:
        return out["out"]
    result = {k[len("out/"):]: v for k, v in out.items() if k.startswith("out/")}
    return result or None


def _several_optimizers(module: pl.LightningModule, seen: str) -> str:
    return (f"NimbleStrategy trains one optimizer; {type(module).__name__}.configure_optimizers "
            f"returned {seen}. Return one torch.optim.Optimizer (with its LR scheduler, if any); "
            "one Step call updates it. Several optimizers need manual optimization, which the "
            "Step cannot capture")


def _refuse_hooks(module: pl.LightningModule, trainer: pl.Trainer) -> None:
    for hook in _MODULE_HOOKS:
        if is_overridden(hook, module):
            raise NimbleError(
                f"NimbleStrategy: {type(module).__name__} overrides LightningModule.{hook}; the "
                "Step does backward, zeroing, clipping and the update itself, inside one "
                "captured step where the override cannot run. Remove it (clip with "
                "Trainer(gradient_clip_val=...)), or train with another strategy")
    for callback in trainer.callbacks:
        for hook in _CALLBACK_HOOKS:
            if is_overridden(hook, callback, pl.Callback):
                raise NimbleError(
                    f"NimbleStrategy: the callback {type(callback).__name__} implements {hook}, "
                    "which would run between the backward and the update, inside the captured "
                    "step. Remove the callback from Trainer(callbacks=...), or move its work to "
                    "on_train_batch_end")


def _grad_clip(trainer: pl.Trainer) -> float | None:
    if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        raise NimbleError(
            "NimbleStrategy: Trainer(gradient_clip_algorithm='value') clips each gradient "
            "element; the Step clips the global gradient norm. Use "
            "gradient_clip_algorithm='norm' (the default)")
    value = trainer.gradient_clip_val
    return float(value) if value else None  # None or 0: Lightning does not clip


def _accumulate(k: Any) -> int:
    if not isinstance(k, int) or isinstance(k, bool):
        raise NimbleError(
            f"NimbleStrategy: Trainer(accumulate_grad_batches={k!r}); the Step accumulates a "
            "fixed number of batches, given as an int")
    return k


def _amp(plugin: Precision, trainer: pl.Trainer) -> str | None:
    precision = getattr(plugin, "precision", None)
    if type(plugin) is Precision:
        return None
    if type(plugin) is MixedPrecision and precision == "bf16-mixed":
        return "bf16"
    if type(plugin) is MixedPrecision and precision == "16-mixed":
        scaler = plugin.scaler
        settings = {"scale": scaler.get_scale(), "growth_factor": scaler.get_growth_factor(),
                    "backoff_factor": scaler.get_backoff_factor(),
                    "growth_interval": scaler.get_growth_interval()}
        if scaler.is_enabled() and settings == _DEFAULT_SCALER:
            return "fp16"
        raise NimbleError(
            f"NimbleStrategy: precision='16-mixed' with a GradScaler set to {settings} (enabled: "
            f"{scaler.is_enabled()}); the Step's fp16 loss scale follows torch's defaults "
            f"{_DEFAULT_SCALER}. Pass MixedPrecision without a scaler, or precision='bf16-mixed'")
    raise NimbleError(
        f"NimbleStrategy: Trainer(precision={trainer.precision!r}) uses "
        f"{type(plugin).__name__}, which the Step cannot reproduce; it supports "
        "precision='32-true', 'bf16-mixed' and '16-mixed'. Pass one of those (and no precision "
        "plugin in Trainer(plugins=...))")
