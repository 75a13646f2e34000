"""The recipes as importable modules (recipes/ is not a package), and the transformers check."""

import os
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "recipes")))

import bert  # noqa: E402
import cifar10  # noqa: E402

try:
    import transformers  # noqa: F401  (only whether it imports)
    HAVE_TRANSFORMERS = True
except ImportError:
    HAVE_TRANSFORMERS = False
needs_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason="transformers is not installed here (pip install transformers)")

__all__ = ["HAVE_TRANSFORMERS", "bert", "cifar10", "needs_transformers"]
