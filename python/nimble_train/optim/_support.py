"""Which optimizers the fused update runs, and why one cannot be fused."""

from __future__ import annotations

import torch

from .._extension import _C
from .lamb import LAMB

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def algorithm(optimizer) -> str | None:
    """The fused update that runs `optimizer`: "sgd", "adam" (Adam, AdamW) or "lamb"."""
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return "sgd"
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    if kind is LAMB:
        return "lamb"
    return None


def trainable(group, exclude: frozenset = frozenset()) -> list[torch.Tensor]:
    return [p for p in group["params"] if p.requires_grad and id(p) not in exclude]


def why_unsupported(optimizer) -> str | None:
    """Why ``optimizer`` cannot be fused, or None when it can."""
    kind = algorithm(optimizer)
    if kind is None:
        return (f"{type(optimizer).__module__}.{type(optimizer).__qualname__} is not "
                "torch.optim.SGD, Adam, AdamW or nimble_train.optim.LAMB")
    params = [p for group in optimizer.param_groups for p in trainable(group)]
    if not params:
        return "it has no parameters that require grad"
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        return f"its parameters are on several devices ({', '.join(devices)})"
    device = params[0].device
    if device.type not in ("cpu", "cuda"):
        return f"its parameters are on {device}; fused updates run on CPU or CUDA"
    if device.type == "cuda" and not _C.has_cuda():
        return "its parameters are on CUDA, but nimble_train was built without CUDA"
    for i, p in enumerate(params):
        if p.dtype not in _DTYPES:
            return (f"parameter {i} is {p.dtype}; fused updates take float32, float16 or "
                    "bfloat16 parameters")
        if p.is_sparse or (p.grad is not None and p.grad.is_sparse):
            return f"parameter {i} has a sparse gradient"
    for g, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            return f"param_groups[{g}] has differentiable=True"
    if kind == "adam":
        amsgrad = {bool(group["amsgrad"]) for group in optimizer.param_groups}
        if len(amsgrad) > 1:
            return "amsgrad differs between parameter groups"
    return None
