"""The batch norms of a captured step: PyTorch's own kernels where the planned forward shares
the GPU between streams, and one kernel for all their batch counters.

On CUDA, ``F.batch_norm`` calls cuDNN when it is enabled. For channels-last activations cuDNN
runs semi-persistent kernels (``batchnorm_fwtr_nhwc_semiPersist`` and its backward), whose
grids fill every SM of the GPU: whatever another stream has queued (a parallel branch, a
weight gradient on a side stream) waits until they end. PyTorch's native kernels take the
GPU block by block and share it. On one stream cuDNN's are the faster, so a step uses them
there and the native ones only where its forward is planned. Where only the backward is (a
forward torch.fx cannot trace), cuDNN's too: the weight gradients beside the backward have
the slack to wait out each of its kernels (bench/bench_streams.py's "backward only" row; the
README's "Streams" has the figures).

Measured on an H100 (torch 2.11.0+cu130, ms per step, alternating rounds in one process; one
stream with cuDNN's, then streams="auto" with cuDNN's and with the native kernels): the
branchy net b32 5.007 / 3.810 / 3.461, torchvision's GoogLeNet (64 px) b32 3.431 / 2.041 /
1.839, ResNet-18/CIFAR b32 2.263 / 2.099 / 2.015; on one stream the native kernels took 5.155,
3.550 and 2.320.

The autograd node of each batch norm records which kernels its forward ran, so its backward
runs the matching ones. Both compute the batch statistics in float32; they differ only in the
order of their sums.

A training batch norm also adds one to its ``num_batches_tracked`` counter each call: a kernel
of one element, launched between the layer's others, on the critical path of a step that is a
chain of small kernels. In every capture torch's ``_BatchNorm.forward`` (BatchNorm1d/2d/3d)
runs with the counter out of its reach, which is all that call changes when a momentum is set
(the counter feeds the running averages only when it is None), and the captured step adds
each layer's calls to its counter in one multi-tensor kernel when the step's work is done:
the same counts at the end of every step; nothing in between may read them. Layers with
momentum=None, SyncBatchNorm and subclasses with a forward of their own count as they do. On an
H100 (bench/bench_batch_norm.py, b32, streams="auto", ms per step, per layer → together): the
branchy net 3.049 → 3.005, GoogLeNet (64 px) 1.769 → 1.737, ResNet-18/CIFAR 2.010 → 1.981.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _torch_private
from ._forwards import replaced_forwards

# Every capture advances the batch counters in one kernel at its end (see above); False: each
# layer's own add, as eager (bench/bench_batch_norm.py times one against the other).
DEFER_COUNTERS = True


# The CapturedBatchNorms whose block is running, if any (fused operators ask it how to count).
_ACTIVE: CapturedBatchNorms | None = None


def active() -> CapturedBatchNorms | None:
    return _ACTIVE


def candidates(model: nn.Module) -> list[nn.Module]:
    """The batch-norm layers of `model` whose forward this module may wrap: not compiled
    (inductor has its own kernels, and a changed forward would recompile), no forward of
    the user's own."""
    if _torch_private.has_compiled_modules(model):
        return []
    batch_norm, _ = _torch_private.batch_statistics_layers()
    return [m for m in model.modules()
            if isinstance(m, batch_norm) and "forward" not in vars(m)]


def defers_counter(module: nn.Module) -> bool:
    """Whether a call of `module` now may leave its batch counter to the end of the step:
    torch's own forward (which skips the counter when it is None) in training, with running
    statistics, a counter and a momentum."""
    batch_norm, _ = _torch_private.batch_statistics_layers()
    return (type(module).forward is batch_norm.forward and module.training
            and module.track_running_stats and module.momentum is not None
            and isinstance(module._buffers.get("num_batches_tracked"), torch.Tensor))


class CapturedBatchNorms:
    """Within the block, the batch norms of `model` (candidates; None: none) run PyTorch's
    native kernels when `native`, and leave their batch counters (defers_counter) to one
    multi-tensor add issued when the block ends without an error. The layers are restored on
    exit, whatever happens; an error leaves the counters untouched. While the block runs,
    active() returns it: a batch norm fused with its ReLU (_batch_norm_act), which does not
    call the layer's forward, runs fused only in a native block and counts its call with
    count_call. After the block, `native_layers`, `fused_layers` and `counters` say how many
    layers ran natively, how many calls ran fused and how many counters the add advanced."""

    def __init__(self, model: nn.Module | None, native: bool, defer: bool | None = None):
        self._layers = candidates(model) if model is not None else []
        self._native = native
        self._defer = DEFER_COUNTERS if defer is None else defer
        self._calls: dict[int, list] = {}  # id(counter) -> [counter, calls]
        self._replaced = None
        self.native_layers = len(self._layers) if native else 0
        self.counters = 0
        self.fused_layers = 0
        self._outer: CapturedBatchNorms | None = None

    @property
    def native(self) -> bool:
        return self._native

    def __enter__(self) -> CapturedBatchNorms:
        global _ACTIVE
        self._replaced = replaced_forwards(self._layers, self._forward)
        self._replaced.__enter__()
        self._outer, _ACTIVE = _ACTIVE, self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _ACTIVE
        _ACTIVE = self._outer
        self._replaced.__exit__(exc_type, exc, tb)
        if exc_type is None and self._calls:
            counters, calls = zip(*self._calls.values())
            torch._foreach_add_(list(counters), list(calls))
            self.counters = len(counters)
        self._calls = {}
        return False

    def count_call(self, module: nn.Module) -> None:
        """A call of `module` that did not run its forward (fused with its ReLU) counts as
        the forward would have counted it: deferred to the end of the block, or now."""
        self.fused_layers += 1
        counter = self._deferred_counter(module)
        if counter is not None:
            self._calls.setdefault(id(counter), [counter, 0])[1] += 1
        elif module.training and module.track_running_stats:
            if module.num_batches_tracked is not None:
                module.num_batches_tracked.add_(1)

    def _deferred_counter(self, module: nn.Module) -> torch.Tensor | None:
        """`module`'s batch counter when this call leaves it to the end of the block."""
        if self._defer and defers_counter(module):
            return module._buffers["num_batches_tracked"]
        return None

    def _forward(self, module: nn.Module):
        forward = type(module).forward
        native = self._native

        def run(*args, **kwargs):
            counter = self._deferred_counter(module)
            # Only this switch: cudnn.flags() would also reset benchmark, deterministic, TF32.
            enabled = torch.backends.cudnn.enabled
            if native:
                torch.backends.cudnn.enabled = False
            if counter is not None:
                module._buffers["num_batches_tracked"] = None
            try:
                out = forward(module, *args, **kwargs)
            finally:
                if native:
                    torch.backends.cudnn.enabled = enabled
                if counter is not None:
                    module._buffers["num_batches_tracked"] = counter
            if counter is not None:
                self._calls.setdefault(id(counter), [counter, 0])[1] += 1
            return out
        return run
