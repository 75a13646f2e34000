"""nimble_train: a whole PyTorch training step captured once as a CUDA graph and replayed.

The C++/CUDA runtime is a shared library (libnimble_train) bound by the extension
``nimble_train._C``; this package is its Python face. ``build_info()`` says what the installed
build compiled in; ``cmake_prefix_path`` is where a LibTorch program finds the library with
``find_package(nimble_train)``.
"""

import torch  # noqa: F401  (loads libtorch and the CUDA libraries that _C links against)

from ._extension import _C, build_info, cmake_prefix_path, describe_build, has_cuda, has_nccl
from ._buckets import Buckets
from .distributed import DistInfo, init_distributed
from .errors import CaptureError, DistributedError, NimbleError, ShapeError, SyncError
from . import optim
from . import models
from .step import Step

__version__ = build_info()["version"]

__all__ = [
    "Buckets",
    "CaptureError",
    "DistInfo",
    "DistributedError",
    "NimbleError",
    "ShapeError",
    "Step",
    "SyncError",
    "build_info",
    "cmake_prefix_path",
    "describe_build",
    "has_cuda",
    "has_nccl",
    "init_distributed",
]
