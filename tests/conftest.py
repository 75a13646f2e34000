"""Skips GPU and multi-GPU tests, with the reason, on machines that cannot run them."""

import contextlib
import os
import sys

import pytest
import torch

# Shared helpers (tests/step_reference.py) import as top-level modules in every test folder.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    # NT_TEST_MARGINS=path (scripts/gpu-test sets it): how close each test's comparisons
    # came to their tolerances, written to path (tests/margins.py).
    path = os.environ.get("NT_TEST_MARGINS")
    if path:
        import margins
        margins.register(config, path)


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


@contextlib.contextmanager
def ieee_float32(matmul: bool):
    """float32 convolutions (and, with `matmul`, matrix products) in full precision, no TF32;
    the previous settings back after the block. Through torch's fp32_precision settings where
    it has them: once any library has used those, reading the legacy allow_tf32 flags raises
    ("you have used mix of the legacy and new APIs")."""
    conv = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    if conv is None:  # an older torch: the legacy flags only
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        if matmul:
            torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        return
    saved = torch.backends.cuda.matmul.fp32_precision, conv
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    if matmul:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


@pytest.fixture(autouse=True)
def cudnn_autotuner_restored():
    """cuDNN's autotuner as it was before each test. The recipes and the benchmark, run in
    process by their tests, turn it on for the process as programs do; a later test's eager
    references would then run algorithms picked per run and differ by more than rounding (the
    multi-stream tests' 5%-lr check failed after the recipe tests so)."""
    saved = torch.backends.cudnn.benchmark
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved


@pytest.fixture
def no_tf32():
    """float32 matmuls and convolutions in full precision for the test (comparisons with an
    eager reference at float32 tolerances); the previous settings back after it."""
    with ieee_float32(matmul=True):
        yield


@pytest.fixture
def exact_convolutions():
    """fp32 convolutions in full precision, by fixed algorithms: eager PyTorch and the code
    torch.compile makes then differ by rounding alone (TF32 or other algorithms would differ
    by 1e-3)."""
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        with ieee_float32(matmul=False):
            yield
    finally:
        torch.backends.cudnn.benchmark = saved


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's deterministic algorithms for the test: its default backward algorithms sum with
    atomics, in another order on every run, and deterministic ones make two runs of the same
    graph comparable bit for bit."""
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = before
