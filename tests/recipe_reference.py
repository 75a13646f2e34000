"""The recipes as importable modules (recipes/ is not a package), their tiny CPU settings, and
the transformers check."""

import os
import sys

import pytest

RECIPES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "recipes"))
sys.path.insert(0, RECIPES)

import bert  # noqa: E402
import cifar10  # noqa: E402
import torch  # noqa: E402

# Runs of a few seconds on the CPU.
TINY_CIFAR = ["--device", "cpu", "--model", "branchy", "--width", "0.25", "--batch", "8",
              "--synthetic-size", "40", "--eval-samples", "16", "--log-every", "2"]
TINY_BERT = ["--size", "tiny", "--device", "cpu", "--batch", "2", "--seq", "16",
             "--samples", "8", "--eval-samples", "4", "--log-every", "2"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread avoids OpenMP oversubscription on busy CI machines and keeps CPU
    results reproducible. Autouse in the modules that import it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


try:
    import transformers  # noqa: F401  (only whether it imports)
    HAVE_TRANSFORMERS = True
except ImportError:
    HAVE_TRANSFORMERS = False
needs_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason="transformers is not installed here (pip install transformers)")

__all__ = ["HAVE_TRANSFORMERS", "RECIPES", "TINY_BERT", "TINY_CIFAR", "bert", "cifar10",
           "needs_transformers", "one_thread"]
