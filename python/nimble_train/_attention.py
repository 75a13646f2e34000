"""Attention masks that scaled_dot_product_attention's fused kernels accept, while Step captures.

A model that cannot tell without a host sync whether its attention mask may be dropped keeps
it while a CUDA graph is captured: Hugging Face's masking code treats a capture as tracing and
materialises even a mask of all ones, as a broadcast view whose last dimension has a stride of
0. The fused kernels of scaled_dot_product_attention (flash, memory-efficient, cuDNN) need a
mask whose last dimension is contiguous; given another, SDPA runs its math path, which keeps
every attention probability and dropout mask for the backward. BERT-base at batch 32 then
captures with 1 GiB more memory and runs 1.36x slower than with the memory-efficient kernel.

While Step captures, :class:`DenseAttentionMasks` gives SDPA a contiguous copy of such a mask:
the same values (a few hundred kilobytes for BERT-base), so the fused kernel SDPA would have
chosen for a dense mask runs.

A compiled model gets the same copy in the graph inductor compiles (_inductor_masks.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA = F.scaled_dot_product_attention
_MASK = 3  # attn_mask's position in scaled_dot_product_attention(query, key, value, attn_mask)


def dense_mask(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """scaled_dot_product_attention's arguments, its mask contiguous in the last dimension when
    it was not (the fused kernels' requirement); otherwise unchanged."""
    if "attn_mask" in kwargs:
        mask = kwargs["attn_mask"]
        if _needs_copy(mask):
            kwargs = {**kwargs, "attn_mask": mask.contiguous()}
    elif len(args) > _MASK and _needs_copy(args[_MASK]):
        args = (*args[:_MASK], args[_MASK].contiguous(), *args[_MASK + 1:])
    return args, kwargs


def _needs_copy(mask) -> bool:
    return (isinstance(mask, torch.Tensor) and mask.dim() > 0 and mask.size(-1) > 1
            and mask.stride(-1) != 1)


class DenseAttentionMasks(TorchFunctionMode):
    """Inside this mode, scaled_dot_product_attention gets masks contiguous in their last
    dimension (see the module's docstring); every other call passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            args, kwargs = dense_mask(args, kwargs)
        return func(*args, **kwargs)
