"""Skips GPU and multi-GPU tests, with the reason, on machines that cannot run them."""

import os
import sys

import pytest
import torch

# Shared helpers (tests/step_reference.py) import as top-level modules in every test folder.
sys.path.insert(0, os.path.dirname(__file__))


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    gpus = _gpu_count()
    no_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU; torch.cuda.is_available() is False here "
        "(run scripts/gpu-test on a GPU machine)"
    )
    few_gpus = pytest.mark.skip(
        reason=f"needs 2 or more CUDA GPUs; this machine has {gpus} "
        "(run scripts/gpu-test on a multi-GPU machine)"
    )
    for item in items:
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(few_gpus)
        elif "cuda" in item.keywords and gpus < 1:
            item.add_marker(no_gpu)


@pytest.fixture
def no_tf32():
    """float32 matmuls and convolutions in full precision for the test (comparisons with an
    eager reference at float32 tolerances); the previous settings back after it."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's deterministic algorithms for the test: its default backward algorithms sum with
    atomics, in another order on every run, and deterministic ones make two runs of the same
    graph comparable bit for bit."""
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = before
