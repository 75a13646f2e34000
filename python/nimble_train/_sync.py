"""Finds host synchronisations in eager warm-up steps, naming the op and the user's line."""

from __future__ import annotations

import contextlib
import linecache
import os
import traceback
import warnings
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)
_SYNC_MESSAGE = "synchronizing CUDA operation"


@dataclass(frozen=True)
class SyncRecord:
    op: str  # the torch function that synchronised, e.g. "Tensor.item"
    filename: str
    lineno: int
    line: str  # the source line

    def __str__(self) -> str:
        return f"{self.op} at {self.filename}:{self.lineno}: {self.line}"


def _user_frame(stack: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame outside torch, nimble_train and the standard library."""
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if not path.startswith((_TORCH_DIR, _PACKAGE_DIR, _STDLIB_DIR)) and "<frozen" not in path:
            return frame
    return stack[-1] if stack else None


class _CurrentOp(TorchFunctionMode):
    """Remembers the outermost torch function being run, to name the op that synchronised."""

    def __init__(self):
        super().__init__()
        self.op = "an operation"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.op = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        return func(*args, **(kwargs or {}))


class SyncRecorder:
    """Context manager: while active, each host sync on CUDA is recorded (and not printed).

    Uses the CUDA sync debug mode in "warn" mode, so nothing fails here: whether a sync
    matters is decided by capture (some libraries sync in eager code only).
    """

    def __init__(self):
        self.records: list[SyncRecord] = []
        self._active = False

    def __enter__(self) -> SyncRecorder:
        self._previous_mode = torch.cuda.get_sync_debug_mode()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{_SYNC_MESSAGE}.*")
        warnings.filterwarnings("ignore", message=".*debug mode is a prototype feature.*")
        self._show = warnings.showwarning
        warnings.showwarning = self._on_warning
        self._op = _CurrentOp()
        self._op.__enter__()
        torch.cuda.set_sync_debug_mode("warn")
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._op.__exit__(*exc)
        self._warnings.__exit__(*exc)

    @contextlib.contextmanager
    def paused(self):
        """Within it, syncs are neither flagged nor recorded (nimble_train's own code)."""
        if not self._active:
            yield
            return
        torch.cuda.set_sync_debug_mode(self._previous_mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("warn")

    def _on_warning(self, message, category, filename, lineno, file=None, line=None):
        if _SYNC_MESSAGE not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        frame = _user_frame(traceback.extract_stack()[:-1])
        if frame is None:
            return
        text = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        record = SyncRecord(self._op.op, frame.filename, frame.lineno, text)
        if record not in self.records:
            self.records.append(record)
