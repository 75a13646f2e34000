"""Our max-pooling kernels in place of torch's, in a captured step (src/ops/max_pool.h).

torch's CUDA max-pooling of a channels-last tensor saves each window's choice as an int64 index
and runs at a fraction of the GPU's bandwidth: on the branchy network (b32, H100) its ten
max-pools took 0.68 of the 4.94 ms of kernels a step runs on one stream, and the two between
the stages, which nothing can run beside, 0.24 ms of what is left of a step on several streams.
Ours save a one-byte code per output and read 16-byte packs of channels; their outputs and
gradients are torch's bit for bit (same comparisons, same tie-breaking, same order of sums).

While a step is captured, each ``nn.MaxPool2d`` of the model (dilation 1, no indices returned,
no forward of the user's own) runs them on inputs they take (CUDA, float32/16 or bfloat16,
channels-last and not also contiguous); anything else goes to torch as before. The backward
cannot itself be differentiated (torch's can): a capture whose loss differentiates through a
max-pool's gradient fails with autograd's error, naming this function.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import _torch_private
from ._extension import _C
from ._forwards import replaced_forwards

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_WINDOW = 255  # positions a one-byte code names (src/ops/max_pool.h)


def _pair(value) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)] * 2


def _stride(stride, kernel: list[int]) -> list[int]:
    """torch's default: a stride of None (or an empty one) is the kernel's."""
    return kernel if stride is None or (isinstance(stride, (tuple, list)) and not stride) \
        else _pair(stride)


class _MaxPool2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel, stride, padding, ceil_mode):
        y, argmax = _C.max_pool2d_forward(x, kernel, stride, padding, ceil_mode)
        ctx.save_for_backward(argmax)
        ctx.pool = (list(x.shape), kernel, stride, padding, ceil_mode)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        (argmax,) = ctx.saved_tensors
        size, kernel, stride, padding, ceil_mode = ctx.pool
        grad_x = _C.max_pool2d_backward(grad_y, argmax, size, kernel, stride, padding,
                                        ceil_mode)
        return grad_x, None, None, None, None


def max_pool2d(x: torch.Tensor, kernel, stride=None, padding=0,
               ceil_mode: bool = False) -> torch.Tensor:
    """F.max_pool2d with dilation 1 on our kernels (x: channels-last, CUDA or CPU; the CPU runs
    the reference the kernels are tested against)."""
    kernel = _pair(kernel)
    return _MaxPool2d.apply(x, kernel, _stride(stride, kernel), _pair(padding), bool(ceil_mode))


def takes(x) -> bool:
    """Whether our kernels take this input: a 4-D CUDA tensor of float32/16 or bfloat16 that is
    channels-last and not also contiguous (where torch would give a contiguous output)."""
    return (isinstance(x, torch.Tensor) and x.is_cuda and x.dim() == 4 and x.dtype in _DTYPES
            and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())


def candidates(model: nn.Module) -> list[nn.MaxPool2d]:
    """The max-pools of `model` whose forward this module may wrap: dilation 1, no indices
    returned, windows of at most 255 positions, no forward of the user's own; none in a
    compiled model (inductor generates its own)."""
    if _torch_private.has_compiled_modules(model):
        return []
    found = []
    for m in model.modules():
        if (not isinstance(m, nn.MaxPool2d) or "forward" in vars(m)
                or type(m).forward is not nn.MaxPool2d.forward):
            continue
        kernel = _pair(m.kernel_size)
        if (_pair(m.dilation) == [1, 1] and not m.return_indices
                and kernel[0] * kernel[1] <= _MAX_WINDOW):
            found.append(m)
    return found


def _forward(module: nn.MaxPool2d):
    forward = type(module).forward
    kernel = _pair(module.kernel_size)
    stride = _stride(module.stride, kernel)
    padding = _pair(module.padding)
    ceil_mode = bool(module.ceil_mode)

    def run(x):
        if not takes(x):
            return forward(module, x)
        return _MaxPool2d.apply(x, kernel, stride, padding, ceil_mode)
    return run


def our_max_pool(model: nn.Module) -> contextlib.AbstractContextManager[int]:
    """Within the block, `model`'s max-pools (candidates) run our kernels on the inputs they
    take; yields how many layers that is. The layers are restored on exit, whatever happens."""
    return replaced_forwards(candidates(model), _forward)
