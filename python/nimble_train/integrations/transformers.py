"""A drop-in ``transformers.Trainer`` whose optimizer steps are nt.Step launches.

Before::

    from transformers import Trainer
    trainer = Trainer(model=model, args=args, train_dataset=..., data_collator=collator)

After::

    from nimble_train.integrations.transformers import Trainer
    trainer = Trainer(model=model, args=args, train_dataset=..., data_collator=collator,
                      nimble=dict(warmup=3))   # optional: nt.Step options

How Trainer's loop maps onto the Step. Trainer drives everything it drives today (data,
callbacks, the LR scheduler, logging, evaluation scheduling, checkpoints); this class overrides
the per-micro-batch ``training_step`` and what Trainer does around an optimizer step:

- every micro-batch is one Step call (one graph launch once captured); the window's last call
  also clips, updates and, fused in the graph, applies the optimizer; Trainer's own
  ``optimizer.step()`` and clipping then find the work done (the accelerator is told the
  gradients are not to be synchronized, so its optimizer wrapper steps nothing);
- ``gradient_accumulation_steps`` -> ``accumulate``: Trainer's windows, including the short one
  an epoch ends with (``update=True``), and its loss scaling: ``loss / window`` or, when the
  model takes ``num_items_in_batch`` (Trainer then does not divide), weight 1 with the count a
  batch leaf the graph reads (``loss_weight``, staged each call: no recapture);
- ``max_grad_norm`` -> ``grad_clip`` (the logged ``grad_norm`` is the Step's, read on the
  device; with ``max_grad_norm=0`` no norm is computed and none is logged);
- ``bf16`` -> the model's forward under autocast as Trainer's accelerator patches it (the Step
  adds none); ``fp16`` -> ``amp="fp16"`` (the loss scale on the device; an overflow skips the
  update in the graph, but the scheduler still steps: Trainer would have to read the device);
- dynamic padding (``DataCollatorWithPadding`` and friends) -> shape buckets: doubling lengths
  from 32 up to the collator's ``max_length`` or the tokenizer's ``model_max_length`` (capped
  by the model's ``max_position_embeddings``), padded with the tokenizer's pad id, labels with
  -100; ``nimble=dict(buckets=nt.Buckets(...))`` chooses them, ``buckets=None`` turns them off;
- evaluation and prediction run through ``step.evaluator`` once the Step has captured;
- logging: the losses stay on the device until a logging step, as Trainer keeps them; the
  NaN/inf filter (``logging_nan_inf_filter``) is applied on the device instead of a host check
  per micro-batch;
- checkpoints: the model's weights are saved as copies (the Step keeps parameters as views of
  flat buffers, which safetensors would take for shared tensors), the optimizer's state
  through ``optimizer.state_dict()``; resuming loads into the same tensors;
- ``torchrun``: the Step all-reduces the gradients itself (buckets overlapping the backward),
  on the unwrapped model; Trainer's DDP wrapper is bypassed.

- streams: the Step's default, "auto". Trainer's ``compute_loss`` is not traced (nor could
  torch.fx trace most Hugging Face models), so the forward runs on one stream and the
  backward's linear layers compute their weight gradients on a side stream, off its critical
  path (BERT-base fine-tuning b16: 1.20x ``nimble=dict(streams=1)``, bench/bench_trainer.py);
- ``torch_compile`` -> the Step over ``torch.compile(model)`` with the arguments' backend and
  mode (its warm-up compiles, its capture records inductor's kernels); modes whose code replays
  CUDA graphs of its own (``reduce-overhead``, ``max-autotune``) are refused: the Step's graph
  takes their place.

What does not map is refused with the argument's name (DeepSpeed, FSDP, ``torch_compile_mode``
with CUDA graphs, several GPUs in one process, ``use_cpu`` with ``fp16``...). Equal to Trainer,
up to float reassociation, without dropout; with dropout the masks are drawn on the
bucket-padded shapes, so runs agree in distribution, not bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

try:
    import transformers
except ImportError as error:  # pragma: no cover - only without the extra
    raise ImportError(
        "nimble_train.integrations.transformers needs Hugging Face transformers (and "
        "accelerate); install them with pip install 'nimble_train[transformers]'") from error

from ..errors import NimbleError
from ..step import Step
from .._buckets import Buckets

NUM_ITEMS = "num_items_in_batch"  # the batch leaf that carries Trainer's window token count

# Step options the ``nimble=`` dict may set; the others follow from TrainingArguments.
STEP_OPTIONS = {"streams", "warmup", "capture", "bucket_mb", "shard_optimizer", "buckets",
                "ema", "init_sync", "partial_batch"}
FROM_ARGS = {"accumulate": "gradient_accumulation_steps", "grad_clip": "max_grad_norm",
             "amp": "bf16/fp16"}


class _LossModule(torch.nn.Module):
    """What the Step trains: ``forward(**batch)`` is Trainer's ``compute_loss`` on the model,
    with the window's token count taken back out of the batch. torch.fx cannot trace Trainer's
    ``compute_loss`` (nor most Hugging Face models): the Step plans the backward only (the
    linear layers' weight gradients on a side stream)."""

    nimble_untraced = "Trainer's compute_loss is not traced by torch.fx"

    def __init__(self, trainer: "Trainer", model: torch.nn.Module):
        super().__init__()
        self.model = model
        object.__setattr__(self, "_trainer", trainer)  # not a submodule

    def forward(self, **batch):
        count = batch.pop(NUM_ITEMS, None)
        trainer = self._trainer
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(self.model, batch, num_items_in_batch=count)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` with each optimizer step one nt.Step launch (see the module's
    docstring). Same arguments, plus ``nimble``: a dict of nt.Step options (streams, warmup,
    capture, buckets, bucket_mb, shard_optimizer, ema, init_sync, partial_batch)."""

    def __init__(self, *args, nimble: dict | None = None, **kwargs):
        options = dict(nimble or {})
        for key in options:
            if key in FROM_ARGS:
                raise ValueError(
                    f"nimble={{'{key}': ...}}: the Step's {key} follows TrainingArguments' "
                    f"{FROM_ARGS[key]}; set it there")
            if key not in STEP_OPTIONS:
                raise ValueError(f"nimble={{'{key}': ...}} is not an nt.Step option this Trainer "
                                 f"passes on; expected some of {sorted(STEP_OPTIONS)}")
        self.nimble_options = options
        self.nimble_step: Step | None = None
        self._nt_evaluator = None
        self._nt_nan_filter = False  # Trainer's NaN/inf loss filter, applied on the device
        super().__init__(*args, **kwargs)
        _refuse_what_does_not_map(self)

    # ------------------------------------------------------------------ training

    def train(self, *args, **kwargs):
        # The NaN/inf filter runs on the device (training_step); Trainer's own would read
        # every micro-batch's loss on the host.
        self._nt_nan_filter = self.args.logging_nan_inf_filter
        self.args.logging_nan_inf_filter = False
        try:
            return super().train(*args, **kwargs)
        finally:
            self.args.logging_nan_inf_filter = self._nt_nan_filter

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One micro-batch: one Step call; the window's last also clips and updates."""
        step = self._step_for_training()
        if not self.model.training:
            self.model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        if isinstance(inputs, Mapping):  # a collator's BatchEncoding
            inputs = dict(inputs)
        else:
            raise TypeError(f"nimble_train's Trainer trains on dict batches (a data collator's "
                            f"output); got {type(inputs).__name__}")
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # newer transformers only
        if scaled is None:
            scaled = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                      or self.compute_loss_func is not None)
        if num_items_in_batch is not None and self.model_accepts_loss_kwargs:
            inputs = {**inputs, NUM_ITEMS: _as_device_tensor(num_items_in_batch, self.args)}
        window = self.current_gradient_accumulation_steps
        last = self.accelerator.sync_gradients  # Trainer marks the window's last micro-batch
        weight = 1.0 if scaled else 1.0 / window
        loss = step(inputs, update=True if last else None,
                    loss_weight=weight if step.accumulate > 1 else None)
        if last:
            # The update ran in the graph: Trainer's optimizer.step() and zero_grad() through
            # the accelerator's wrapper must not run it again.
            self.accelerator.gradient_state._set_sync_gradients(False)
        if weight != 1.0:
            loss = loss * weight  # what Trainer's training_step returns (and logs)
        if self._nt_nan_filter:
            # Trainer's filter: a non-finite loss counts as the mean of those logged so far.
            since = 1 + self.state.global_step - self._globalstep_last_logged
            loss = torch.where(torch.isfinite(loss), loss, self._tr_loss / since)
        return loss

    def _clip_grad_norm(self, model):
        return self.nimble_step.grad_norm  # the Step clipped; this is the norm before it

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm  # with max_grad_norm=0, none is computed (see the module docstring)

    def _step_for_training(self) -> Step:
        optimizer = _unwrapped_optimizer(self.optimizer)
        step = self.nimble_step
        if step is not None and step.optimizer is optimizer:
            return step
        if step is not None:
            step.close()
        args = self.args
        options = dict(self.nimble_options)
        if "buckets" not in options:
            options["buckets"] = default_buckets(self.data_collator, self.model)
        amp = "fp16" if args.fp16 else None  # bf16: the accelerator's autocast in forward
        grad_clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        self.nimble_step = Step(_LossModule(self, self._compiled_model()), optimizer, None,
                                accumulate=args.gradient_accumulation_steps, amp=amp,
                                grad_clip=grad_clip, **options)
        self._nt_evaluator = None
        return self.nimble_step

    def _compiled_model(self) -> torch.nn.Module:
        """The model the Step trains: with ``torch_compile``, torch.compile(model) with the
        arguments' backend and mode (the Step's warm-up compiles it), else the model. The
        accelerator compiles its own wrapper, which the Step leaves unused; Trainer saves and
        inspects the model itself."""
        if not self.args.torch_compile:
            return self.model
        return torch.compile(self.model, backend=self.args.torch_compile_backend,
                             mode=self.args.torch_compile_mode)

    # ------------------------------------------------------------------ evaluation

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Trainer's prediction step through the Step's evaluator (captured once the Step
        replays); before any training, Trainer's own."""
        step = self.nimble_step
        has_labels = (isinstance(inputs, Mapping) and bool(self.label_names)
                      and all(inputs.get(k) is not None for k in self.label_names))
        if step is None or not has_labels:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = dict(self._prepare_inputs(inputs))
        if ignore_keys is None:
            ignore_keys = getattr(getattr(self.model, "config", None),
                                  "keys_to_ignore_at_inference", ["past_key_values"])
        if self._nt_evaluator is None:
            self._nt_evaluator = step.evaluator(_evaluation_outputs(self))
        outputs = self._nt_evaluator(inputs)
        loss = outputs.pop("loss").mean()
        if prediction_loss_only:
            return loss, None, None
        length = _length(inputs)
        logits = tuple(_narrow(v, length) for k, v in outputs.items() if k not in ignore_keys)
        if len(logits) == 1:
            logits = logits[0]
        labels = tuple(inputs.get(name) for name in self.label_names)
        if len(labels) == 1:
            labels = labels[0]
        return loss, logits, labels

    # ------------------------------------------------------------------ checkpoints

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and self.nimble_step is not None:
            state_dict = _copied_state_dict(self.model)
        super()._save(output_dir, state_dict=state_dict)


def _evaluation_outputs(trainer: Trainer):
    """fn(model, batch) for the evaluator: Trainer's compute_loss with its outputs, as a dict
    of tensors (the loss under "loss")."""
    def fn(module: _LossModule, batch: dict) -> dict:
        with trainer.compute_loss_context_manager():
            loss, outputs = trainer.compute_loss(module.model, dict(batch), return_outputs=True)
        if isinstance(outputs, dict):
            out = {k: v for k, v in outputs.items() if k != "loss" and torch.is_tensor(v)}
        else:
            out = {f"output_{i}": v for i, v in enumerate(outputs[1:]) if torch.is_tensor(v)}
        return {"loss": loss.detach().reshape(-1), **out}
    return fn


def default_buckets(collator: Any, model: torch.nn.Module) -> Buckets | None:
    """Shape buckets for a collator that pads each batch to its longest sequence: doubling
    lengths from 32 up to the longest the collator or tokenizer allows. None for collators
    that do not pad dynamically (fixed-length batches need no buckets)."""
    tokenizer = getattr(collator, "tokenizer", None)
    if tokenizer is None or getattr(collator, "padding", True) in ("max_length", False):
        return None
    longest = getattr(collator, "max_length", None) or getattr(tokenizer, "model_max_length", None)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if longest is None or longest > 100_000:  # tokenizers without a limit say 1e30
        longest = positions
    if longest is None:
        return None
    if positions is not None:
        longest = min(longest, positions)
    multiple = getattr(collator, "pad_to_multiple_of", None) or 1
    sizes, size = [], 32
    while size < longest:
        sizes.append(math.ceil(size / multiple) * multiple)
        size *= 2
    sizes.append(longest)
    pad = {"input_ids": tokenizer.pad_token_id or 0, "labels": -100,
           "token_type_ids": getattr(tokenizer, "pad_token_type_id", 0) or 0}
    return Buckets(sizes=tuple(sorted(set(sizes))), dim=1, pad_values=pad)


# torch.compile modes whose code replays CUDA graphs of its own
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _refuse_what_does_not_map(trainer: Trainer) -> None:
    args = trainer.args

    def refuse(argument: str, seen: Any, fix: str) -> None:
        raise NimbleError(f"nimble_train's Trainer cannot map TrainingArguments.{argument}="
                          f"{seen!r} onto nt.Step; {fix}")

    if trainer.is_deepspeed_enabled:
        refuse("deepspeed", args.deepspeed, "train with plain data parallel (torchrun), where "
               "the Step all-reduces and can shard the optimizer (nimble=dict("
               "shard_optimizer=True)), or use transformers.Trainer")
    if trainer.is_fsdp_enabled or args.fsdp:
        refuse("fsdp", args.fsdp, "use plain data parallel (torchrun) with nimble=dict("
               "shard_optimizer=True), or transformers.Trainer")
    own_graphs = ("the Step captures the whole step as one CUDA graph, which takes the place "
                  "of the compiled code's own graphs (they cannot be captured inside it); leave "
                  "torch_compile_mode unset, or use \"max-autotune-no-cudagraphs\", with the "
                  "inductor backend")
    if args.torch_compile and args.torch_compile_backend == "cudagraphs":
        refuse("torch_compile_backend", args.torch_compile_backend, own_graphs)
    if args.torch_compile and args.torch_compile_mode in _CUDA_GRAPH_MODES:
        refuse("torch_compile_mode", args.torch_compile_mode, own_graphs)
    if args.n_gpu > 1:
        refuse("n_gpu", args.n_gpu, "launch one process per GPU with torchrun (or set "
               "CUDA_VISIBLE_DEVICES to one GPU); one process driving several GPUs "
               "(torch.nn.DataParallel) is not supported")
    if getattr(args, "optim", None) in ("lomo", "adalomo"):
        refuse("optim", args.optim, "LOMO fuses the update into the backward; choose an "
               "optimizer with a step(), e.g. adamw_torch")


def _unwrapped_optimizer(optimizer):
    inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _as_device_tensor(count, args) -> torch.Tensor:
    if torch.is_tensor(count):
        return count.to(args.device, non_blocking=True).reshape(())
    return torch.tensor(count, device=args.device)


def _length(inputs: dict) -> int | None:
    for key in ("input_ids", "attention_mask", "inputs_embeds"):
        value = inputs.get(key)
        if torch.is_tensor(value) and value.dim() >= 2:
            return value.shape[1]
    return None


def _narrow(value: torch.Tensor, length: int | None) -> torch.Tensor:
    """An evaluator output computed on the bucket-padded batch, cut back to the batch's own
    sequence length (positions past it are padding)."""
    if length is not None and value.dim() >= 2 and value.shape[1] > length:
        return value.narrow(1, 0, length)
    return value


def _copied_state_dict(model: torch.nn.Module) -> dict:
    """The model's state_dict as independent copies, tied weights kept tied (one copy each)."""
    copies: dict = {}
    out = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key not in copies:
            copies[key] = tensor.detach().clone()
        out[name] = copies[key]
    return out
