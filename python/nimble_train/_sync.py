"""Finds host synchronisations in eager warm-up steps, naming the expression and the user's line.

Nothing here changes what torch.compile sees: no torch-function or dispatch mode is pushed
(dynamo guards on the mode stack, so code compiled in a warm-up step under a mode would be
compiled again, inside the capture, and fail there).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import types
import warnings
from dataclasses import dataclass

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)
_SYNC_MESSAGE = "synchronizing CUDA operation"


@dataclass(frozen=True)
class SyncRecord:
    op: str  # the expression that synchronised, e.g. "x.abs().max().item()"
    filename: str
    lineno: int
    line: str  # the source line

    def __str__(self) -> str:
        return f"{self.op} at {self.filename}:{self.lineno}: {self.line}"


def _user_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The innermost frame, from `frame` outwards, outside torch, nimble_train and the standard
    library (the outermost frame when all are inside)."""
    last = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_TORCH_DIR, _PACKAGE_DIR, _STDLIB_DIR)) and "<frozen" not in path:
            return frame
        last, frame = frame, frame.f_back
    return last


def warn_at_user(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn attributed to the user's line (_user_frame: their step(batch), Step(...) or
    evaluate(batch)), however deep in nimble_train the warning is raised."""
    frame, level = sys._getframe(1), 2
    target = _user_frame(frame)
    while frame is not None and frame is not target:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def expression(frame: types.FrameType) -> str:
    """The source of the expression `frame` is running, e.g. "x.abs().max().item()" in
    "scale = x.abs().max().item()", from the columns of its current instruction; "an
    operation" when they are unknown or span several lines."""
    try:
        line, end_line, start, end = list(frame.f_code.co_positions())[frame.f_lasti // 2]
    except (AttributeError, IndexError):
        return "an operation"
    if None in (line, end_line, start, end) or line != end_line:
        return "an operation"
    text = linecache.getline(frame.f_code.co_filename, line)
    span = text.encode("utf-8")[start:end].decode("utf-8", "replace").strip()  # byte columns
    return span or "an operation"


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
        torch.cuda.set_sync_debug_mode("warn")
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._warnings.__exit__(*exc)

    @contextlib.contextmanager
    def recording_on(self, stream: torch.cuda.Stream):
        """Warm-up: runs the block on `stream` (the capture's side stream: lazily made
        per-stream state, cuBLAS and cuDNN workspaces, then exists before capture, outside its
        pool), ordered after the current stream's work and before its later work, with host
        syncs recorded."""
        current = torch.cuda.current_stream(stream.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream), self:
            yield
        current.wait_stream(stream)

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
        frame = _user_frame(sys._getframe(1))
        if frame is None:
            return
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        text = linecache.getline(filename, lineno).strip()
        record = SyncRecord(expression(frame), filename, lineno, text)
        if record not in self.records:
            self.records.append(record)
