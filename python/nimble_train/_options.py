"""Checks of Step's arguments and of the first batch, each error saying what was expected,
what was seen, and the fix."""

from __future__ import annotations

from typing import Any

import torch

from . import _torch_private
from ._batch import BatchTemplate
from ._extension import _C
from ._iteration import AMP_DTYPES
from .errors import NimbleError, ShapeError

PARTIAL_BATCH = ("pad", "eager", "error")


def check_streams(streams) -> None:
    if not (streams == "auto" or (isinstance(streams, int) and not isinstance(streams, bool)
                                  and streams >= 1)):
        raise ValueError(f'streams must be "auto" or an int >= 1; got {streams!r}')


def validate(model, optimizer, loss_fn, streams, warmup, amp, grad_clip, partial_batch, capture,
             bucket_mb, shard_optimizer) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "LBFGS re-evaluates the model through a closure inside step(), which a training "
            "step of one forward and one backward cannot give it; train it with its own loop, "
            "or use SGD, Adam, AdamW or another optimizer whose step() needs no closure")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None; got {type(loss_fn).__name__}")
    check_streams(streams)
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(
            f"warmup must be an int >= 1 (eager steps before capture create optimizer state "
            f"and pick cuDNN algorithms); got {warmup!r}")
    if amp not in AMP_DTYPES:
        raise ValueError(f'amp must be None, "bf16" or "fp16"; got {amp!r}')
    if grad_clip is not None and (isinstance(grad_clip, bool)
                                  or not isinstance(grad_clip, (int, float)) or not grad_clip > 0
                                  or grad_clip == float("inf")):
        raise ValueError(f"grad_clip must be None or a positive number (finite: the max "
                         f"global gradient norm, e.g. 1.0); got {grad_clip!r}")
    if partial_batch not in PARTIAL_BATCH:
        raise ValueError(f'partial_batch must be "pad", "eager" or "error"; got {partial_batch!r}')
    if not isinstance(capture, bool):
        raise TypeError(f"capture must be True or False; got {capture!r}")
    if not (isinstance(bucket_mb, (int, float)) and 0 < bucket_mb < float("inf")):
        raise ValueError(f"bucket_mb must be a positive number of megabytes; got {bucket_mb!r}")
    if not isinstance(shard_optimizer, bool):
        raise ValueError(f"shard_optimizer must be True or False; got {shard_optimizer!r}")


def check_compiled_graphs(model: torch.nn.Module) -> None:
    """Refuses, before anything is changed, a compiled module that replays CUDA graphs of its
    own: its replay cannot be captured in Step's graph (torch raises "Cannot prepare for replay
    during capturing stage"), and Step's one graph already does what they would."""
    for name, module in model.named_modules():
        if _torch_private.replays_cuda_graphs(module):
            what = f"model.{name}" if name else "the model"
            raise ValueError(
                f"nimble_train.Step captures the whole step as one CUDA graph, so a compiled "
                f"model inside it must leave CUDA graphs to Step; {what} was compiled to replay "
                f"CUDA graphs of its own (torch.compile's mode=\"reduce-overhead\" or "
                f"\"max-autotune\", options={{\"triton.cudagraphs\": True}}, or "
                f"backend=\"cudagraphs\"), which cannot run inside a capture. Compile it with "
                f"torch.compile(model) or mode=\"max-autotune-no-cudagraphs\" (Step's graph "
                f"takes the place of reduce-overhead's), or pass capture=False to run every "
                f"step eagerly.")


def check_accumulate(accumulate) -> None:
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(
            f"accumulate must be an int >= 1 (micro-batches per optimizer update, one call "
            f"each; 1 updates on every call); got {accumulate!r}")


def require_cuda_runtime(device: torch.device) -> None:
    if not _C.has_cuda():
        raise NimbleError(
            f"Step needs nimble_train's CUDA runtime to capture on {device}, but this build has "
            f"none ({_C.build_info()['cuda']['reason']}). Rebuild it (pip install "
            "--no-build-isolation -e .) or pass capture=False.")


def single_device(model: torch.nn.Module, params: list[torch.Tensor]) -> torch.device:
    devices = {p.device for p in list(model.parameters()) + params}
    if len(devices) != 1:
        raise ValueError(
            "Step trains a model whose parameters all live on one device; got parameters on "
            f"{sorted(str(d) for d in devices)}. Move the model with model.to(device) before "
            "building the optimizer." if devices else
            "the model and optimizer have no parameters; there is nothing to train")
    return devices.pop()


def first_template(batch: Any, device: torch.device, loss_fn=None) -> BatchTemplate:
    """The template of the first batch, after checking its form and device."""
    if not isinstance(batch, (tuple, list, dict)):
        raise TypeError(
            "a batch must be a tuple/list (inputs, target) or a dict of model inputs; got "
            f"{type(batch).__name__}")
    if not isinstance(batch, dict) and len(batch) != 2:
        raise TypeError(
            f"a tuple/list batch must be (inputs, target); got {len(batch)} items. Wrap "
            "several inputs in a tuple: ((x1, x2), target).")
    if not isinstance(batch, dict) and loss_fn is None:
        raise TypeError(
            "a tuple/list batch (inputs, target) needs a loss_fn, loss_fn(outputs, target), and "
            "this Step has none; pass one to nt.Step, or give dict batches to a model that "
            "returns its own loss (outputs.loss)")
    return check_devices(BatchTemplate(batch), device)


def check_devices(template: BatchTemplate, device: torch.device) -> BatchTemplate:
    """The template, once its tensors are known to be on the model's device."""
    for leaf in template.tensor_leaves:
        if leaf.tensor.device != device:
            raise ShapeError(
                f"{leaf.path} is on {leaf.tensor.device} but the model is on {device}; move "
                f"batches to the model's device (x.to('{device}', non_blocking=True)), or keep "
                "the dataset there")
    return template


def short_batch_error(samples: int, batch_size: int) -> ShapeError:
    return ShapeError(
        f"this batch has {samples} samples, fewer than the {batch_size} of the first batch, and "
        'partial_batch="error"; drop the last batch (drop_last=True) or use partial_batch="pad" '
        'or "eager"')


def check_shardable(device: torch.device, capture: bool, fuse_reason: str | None) -> None:
    why = None
    if device.type != "cuda":
        why = f"the model is on {device}; the shards are reduced and gathered by NCCL"
    elif not capture:
        why = "capture=False: the sharded update is the fused one, which capture sets up"
    elif fuse_reason is not None:
        why = f"the optimizer cannot be fused ({fuse_reason})"
    if why:
        raise ValueError(f"shard_optimizer=True needs CUDA GPUs, capture and a fused SGD, "
                         f"Adam, AdamW or LAMB; here {why}. Pass shard_optimizer=False.")
