"""A network's stem, a convolution of few input channels, on kernels of our own in a captured
step (src/ops/small_conv.h).

A stem reads the images: three input channels. cuDNN has no tensor-core kernel for so few
channels in float32: for channels-last tensors it transposes the input and the output around an
NCHW kernel in the forward and runs a weight-gradient kernel of a few thread blocks in the
backward. On an H100, for the CIFAR ResNet-18's 3×3 stem at batch 32, that is about 23 µs of
forward and a 33 µs weight gradient that runs alone at the end of every step, on any number of
streams, while the update waits for it; airbench's 2×2 whitening convolution at batch 1024
takes about 400 µs a step. Ours stage the weight and a tile of windows in shared memory and
write the output channels-last in one kernel, and sum the weight's and bias's gradients per
thread block, then over the blocks in a fixed order (deterministic).

While a step is captured, each ``nn.Conv2d`` of at most MAX_CHANNELS input channels,
MAX_COLUMNS input channels × kernel positions and MAX_OUT_CHANNELS output channels (groups 1,
zero padding, no forward of the user's own) runs them on the inputs they take: CUDA, floating
point, needing no gradient (the input's gradient is not computed: a stem's input is the
batch), and where torch would give a channels-last output (the input or the weight is
channels-last). Anything else goes to torch as before. The results are the convolution's up
to the order of the float32 sums; under autocast the operands are cast as torch casts them,
and the weight's gradient comes out in the parameter's dtype from its float32 sum. With the
backward's weight gradients on side streams (streams="auto"), the stem's goes there too.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from . import _torch_private
from ._extension import _C
from ._forwards import replaced_forwards
from ._max_pool import _pair
from ._weight_grads import _accumulate, _amp_cast, _conv_padding, splits

# The layers a capture gives the kernels: a stem's input channels (an image's 1 to 4), and what
# the kernels take (src/ops/small_conv.h): input channels × kernel positions, output channels.
MAX_CHANNELS = 4
MAX_COLUMNS = 32
MAX_OUT_CHANNELS = 256
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


class _SmallConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, module, side):
        x_, w_, b_ = _amp_cast(x, weight, bias)
        y = _C.small_conv2d_forward(x_, w_, b_, stride, padding, dilation)
        ctx.save_for_backward(x_, weight)
        ctx.conv = (stride, padding, dilation)
        ctx.module, ctx.side = module, side
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.conv
        with_bias = ctx.needs_input_grad[2]

        def weight_grads():
            g = grad_y if grad_y.dtype == x.dtype else grad_y.to(x.dtype)
            return _C.small_conv2d_weight_grad(g, x, weight, stride, padding, dilation,
                                               with_bias)

        if ctx.side is None or not splits():
            gw, gb = weight_grads()
            return None, gw, gb, None, None, None, None, None
        module, side = ctx.module, ctx.side

        def launch():  # on the weight-gradient side stream (_weight_grads.SideStream)
            gw, gb = weight_grads()
            _accumulate(module.weight, gw)
            if gb is not None:
                _accumulate(module.bias, gb)
            side.accumulated(module.weight, module.bias)

        side.launch(launch, (grad_y, x), key=module)
        return None, None, None, None, None, None, None, None


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride=1,
           padding=0, dilation=1) -> torch.Tensor:
    """F.conv2d (groups 1, integer zero padding) on our kernels (on the CPU, their reference):
    the output channels-last, the weight's and bias's gradients; x must need no gradient."""
    if x.requires_grad:
        raise ValueError("the stem's kernels compute no input gradient, and this input "
                         "requires one; call F.conv2d for it")
    return _SmallConv.apply(x, weight, bias, _pair(stride), _pair(padding), _pair(dilation),
                            None, None)


def apply(x, module: nn.Conv2d, side=None) -> torch.Tensor:
    """`module`'s convolution of `x` on our kernels (x taken: see takes); with `side` (a
    _weight_grads.SideStream), its weight gradients are accumulated there."""
    return _SmallConv.apply(x, module.weight, module.bias, _pair(module.stride),
                            _conv_padding(module), _pair(module.dilation), module, side)


def takes(x, weight: torch.Tensor) -> bool:
    """Whether this input runs on our kernels: a 4-D CUDA floating-point tensor that needs no
    gradient, of the weight's dtype (or under autocast), and an output torch would make
    channels-last (the input or the weight is)."""
    return (isinstance(x, torch.Tensor) and x.is_cuda and x.dim() == 4 and x.dtype in _DTYPES
            and not x.requires_grad and weight.dtype in _DTYPES
            and (x.dtype == weight.dtype or torch.is_autocast_enabled("cuda"))
            and (_channels_last(x) or _channels_last(weight)))


def is_candidate(m: nn.Module) -> bool:
    """A stem our kernels take: an nn.Conv2d of at most MAX_CHANNELS input channels, MAX_COLUMNS
    input channels × kernel positions and MAX_OUT_CHANNELS output channels, groups 1, integer
    zero padding."""
    return (type(m) is nn.Conv2d and m.groups == 1 and m.in_channels <= MAX_CHANNELS
            and m.in_channels * m.kernel_size[0] * m.kernel_size[1] <= MAX_COLUMNS
            and m.out_channels <= MAX_OUT_CHANNELS and _conv_padding(m) is not None)


def candidates(model: nn.Module) -> list[nn.Conv2d]:
    """The convolutions of `model` this module may run: is_candidate, no forward of the user's
    own; none in a compiled model (inductor calls the convolutions itself)."""
    if _torch_private.has_compiled_modules(model):
        return []
    return [m for m in model.modules() if is_candidate(m) and "forward" not in vars(m)]


@contextlib.contextmanager
def small_convs(model: nn.Module) -> Iterator[int]:
    """Within the block the candidates of `model` that no other part of the capture has given a
    forward when the block begins (the weight-gradient split runs its own through apply())
    run our kernels on the inputs they take; yields how many layers that is. Restored on exit."""
    with replaced_forwards(candidates(model), _forward) as layers:
        yield layers


def _forward(m: nn.Conv2d):
    forward = type(m).forward

    def run(x):
        if not takes(x, m.weight):
            return forward(m, x)
        return apply(x, m)
    return run
