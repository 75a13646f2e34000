"""PyTorch's own batch-norm kernels, not cuDNN's, in a step planned on several streams.

On CUDA, ``F.batch_norm`` calls cuDNN when it is enabled. For channels-last activations cuDNN
runs semi-persistent kernels (``batchnorm_fwtr_nhwc_semiPersist`` and its backward), whose
grids fill every SM of the GPU: whatever another stream has queued (a parallel branch, a
weight gradient on a side stream) waits until they end. PyTorch's native kernels take the
GPU block by block and share it. On one stream cuDNN's are the faster, so a step uses them
there and the native ones only where its plan runs kernels side by side.

Measured on an H100 (torch 2.11.0+cu130, ms per step, alternating rounds in one process; one
stream with cuDNN's, then streams="auto" with cuDNN's and with the native kernels): the
branchy net b32 5.007 / 3.810 / 3.461, torchvision's GoogLeNet (64 px) b32 3.431 / 2.041 /
1.839, ResNet-18/CIFAR b32 2.263 / 2.099 / 2.015; on one stream the native kernels took 5.155,
3.550 and 2.320.

The autograd node of each batch norm records which kernels its forward ran, so its backward
runs the matching ones. Both compute the batch statistics in float32; they differ only in the
order of their sums.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import _torch_private
from ._forwards import replaced_forwards


def native_candidates(model: nn.Module) -> list[nn.Module]:
    """The batch-norm layers of `model` whose forward this module may wrap: not compiled
    (inductor has its own kernels, and a changed forward would recompile), no forward of
    the user's own."""
    if _torch_private.has_compiled_modules(model):
        return []
    batch_norm, _ = _torch_private.batch_statistics_layers()
    return [m for m in model.modules()
            if isinstance(m, batch_norm) and "forward" not in vars(m)]


def _native_forward(module: nn.Module):
    forward = type(module).forward

    def run(*args, **kwargs):
        # Only this switch: cudnn.flags() would also reset benchmark, deterministic and TF32.
        enabled = torch.backends.cudnn.enabled
        torch.backends.cudnn.enabled = False
        try:
            return forward(module, *args, **kwargs)
        finally:
            torch.backends.cudnn.enabled = enabled
    return run


def native_batch_norm(model: nn.Module) -> contextlib.AbstractContextManager[int]:
    """Within the block, `model`'s batch-norm layers (native_candidates) run PyTorch's native
    kernels; yields how many layers that is. The layers are restored on exit, whatever
    happens."""
    return replaced_forwards(native_candidates(model), _native_forward)
