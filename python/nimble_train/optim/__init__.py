"""Fused, capturable optimizers over flat buffers.

``FusedOptimizer(optimizer)`` runs the update of a ``torch.optim.SGD``, ``Adam``, ``AdamW`` or
``LAMB`` as a few fused kernels over per-dtype flat buffers (C++ reference on CPU), with the
learning rate, step count, loss scale and overflow flag read on the device, so the whole update
can live in a CUDA graph. ``LAMB`` is a plain ``torch.optim.Optimizer`` (the reference
semantics); ``DeviceLossScaler`` is fp16 dynamic loss scaling kept on the device.
"""

from .fused import FusedOptimizer
from .lamb import LAMB
from .loss_scale import DeviceLossScaler

__all__ = ["DeviceLossScaler", "FusedOptimizer", "LAMB"]
