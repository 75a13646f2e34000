"""Layers whose forward a capture replaces for the length of a block (our kernels, PyTorch's
native batch norms), put back whatever happens."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from torch import nn


@contextlib.contextmanager
def replaced_forwards(layers: list[nn.Module],
                      make_forward: Callable[[nn.Module], Callable]) -> Iterator[int]:
    """Within the block each of `layers` runs make_forward(layer) (an instance attribute that
    shadows the class's forward); yields how many layers that is. Restored on exit."""
    for m in layers:
        m.forward = make_forward(m)
    try:
        yield len(layers)
    finally:
        for m in layers:
            del m.forward
