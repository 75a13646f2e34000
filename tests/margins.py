"""How close each test's comparisons came to failing: a pytest plugin for GPU runs.

A tolerance that a test passes by a hair on one machine fails on another (other cuDNN or
inductor kernels, another rounding of a bf16 product). With NT_TEST_MARGINS=path set (as
scripts/gpu-test sets it), every torch.testing.assert_close that passes in the pytest process
is measured: its closeness, the largest |actual - expected| / (atol + rtol * |expected|) over
the finite elements (1.0: at the tolerance). Per test the closest comparison is kept; the
session writes them all to `path` as JSON and lists those at REPORT_ABOVE or more last.
Comparisons with no tolerance (rtol = atol = 0: bit for bit) have no margin and are left out,
as are the workers that tests/dist starts (other processes); a test that probes tolerances on
purpose calls the comparison unmeasured (unmeasured()).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence

import pytest
import torch

REPORT_ABOVE = 0.3  # within about 3x of the tolerance

# torch.testing.assert_close's defaults (its documentation's table): (rtol, atol) per dtype;
# a pair of dtypes takes the looser of the two.
_DEFAULTS = {
    torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7),
    torch.complex32: (1e-3, 1e-5), torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def default_tolerances(*dtypes: torch.dtype) -> tuple[float, float]:
    """assert_close's (rtol, atol) when neither is given; (0, 0) for integers and bool."""
    pairs = [_DEFAULTS.get(d, (0.0, 0.0)) for d in dtypes]
    return max(r for r, _ in pairs), max(a for _, a in pairs)


def closeness(actual, expected, rtol: float | None = None,
              atol: float | None = None) -> float | None:
    """max |actual - expected| / (atol + rtol * |expected|) over the finite elements of every
    pair of tensors (or floats) in `actual` and `expected` (matching sequences and mappings,
    as assert_close takes them); None where nothing has a tolerance to measure against."""
    if isinstance(actual, Mapping) and isinstance(expected, Mapping):
        return _worst(closeness(actual[k], expected[k], rtol, atol)
                      for k in expected if k in actual)
    if (isinstance(actual, Sequence) and isinstance(expected, Sequence)
            and not isinstance(actual, str)):
        return _worst(closeness(a, e, rtol, atol) for a, e in zip(actual, expected))
    if isinstance(actual, float) and isinstance(expected, (float, int)):  # compared in float64
        actual = torch.tensor(actual, dtype=torch.float64)
        expected = torch.tensor(float(expected), dtype=torch.float64)
    if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
        return None
    if (actual.shape != expected.shape or actual.is_complex() or expected.is_complex()
            or any(t.layout != torch.strided or t.is_meta for t in (actual, expected))):
        return None  # only dense values are measured: the report never fails a test
    if rtol is None or atol is None:
        rtol, atol = default_tolerances(actual.dtype, expected.dtype)
    a = actual.detach().to(expected.device, torch.float64)
    e = expected.detach().to(torch.float64)
    finite = torch.isfinite(a) & torch.isfinite(e)
    allowed = atol + rtol * e.abs()
    measured = finite & (allowed > 0)  # where allowed is 0, a pass means equal: no margin
    if not bool(measured.any()):
        return None
    return float(((a - e).abs()[measured] / allowed[measured]).max())


def _worst(values) -> float | None:
    found = [v for v in values if v is not None]
    return max(found) if found else None


class MarginRecorder:
    """The plugin: wraps torch.testing.assert_close while the session runs."""

    def __init__(self, path: str):
        self.path = path
        self.closest: dict[str, dict] = {}  # test id -> its closest comparison
        self._test: str | None = None
        self._original = None

    def pytest_configure(self, config) -> None:
        original = self._original = torch.testing.assert_close

        @functools.wraps(original)  # __wrapped__: the comparison unmeasured
        def measured(actual, expected, *args, rtol=None, atol=None, **kwargs):
            original(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)  # raises first
            if self._test is not None:
                self._note(closeness(actual, expected, rtol, atol), rtol, atol)
        measured.nt_margins = True
        torch.testing.assert_close = measured

    def pytest_unconfigure(self, config) -> None:
        if self._original is not None:
            torch.testing.assert_close = self._original
            self._original = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        self._test = item.nodeid
        try:
            yield
        finally:
            self._test = None

    def _note(self, ratio: float | None, rtol, atol) -> None:
        if ratio is None or not math.isfinite(ratio):
            return
        kept = self.closest.get(self._test)
        if kept is not None and kept["closeness"] >= ratio:
            return
        self.closest[self._test] = {"closeness": ratio, "where": _caller(),
                                    "rtol": rtol, "atol": atol}

    def pytest_sessionfinish(self, session) -> None:
        with open(self.path, "w") as f:
            json.dump(self.closest, f, indent=1, sort_keys=True)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        near = sorted(((v["closeness"], test, v) for test, v in self.closest.items()
                       if v["closeness"] >= REPORT_ABOVE), key=lambda x: -x[0])
        terminalreporter.section("comparisons near their tolerance")
        terminalreporter.write_line(
            f"{len(near)} of {len(self.closest)} tests came within {1 / REPORT_ABOVE:.0f}x of a "
            f"tolerance (closeness >= {REPORT_ABOVE}; 1.0 fails); all in {self.path}")
        for ratio, test, v in near:
            terminalreporter.write_line(f"  {ratio:6.3f}  {v['where']}  rtol={v['rtol']} "
                                        f"atol={v['atol']}  {test}")


def _caller() -> str:
    """file:line that called assert_close (relative to tests/ where it is in it)."""
    here = os.path.abspath(__file__)
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) == here:
        frame = frame.f_back
    if frame is None:
        return "?"
    name = os.path.abspath(frame.f_code.co_filename)
    tests = os.path.dirname(here)
    shown = (os.path.relpath(name, tests) if name.startswith(tests + os.sep)
             else os.path.basename(name))
    return f"{shown}:{frame.f_lineno}"


def unmeasured():
    """torch.testing.assert_close without the recorder (itself where none is installed)."""
    f = torch.testing.assert_close
    while getattr(f, "nt_margins", False):
        f = f.__wrapped__
    return f


def register(config, path: str) -> MarginRecorder:
    """Registers the recorder for this session (its pytest_configure runs at once)."""
    recorder = MarginRecorder(path)
    config.pluginmanager.register(recorder, "nt_margins")
    return recorder
