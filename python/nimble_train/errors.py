"""The errors nimble_train raises; each message says what was expected, what was seen, and the
fix."""


class NimbleError(Exception):
    """Base class of nimble_train's own errors."""


class SyncError(NimbleError):
    """A host synchronisation (``.item()``, ``.cpu()``, a data-dependent shape) inside the step."""


class ShapeError(NimbleError):
    """A batch that does not match the captured template and cannot be padded."""


class CaptureError(NimbleError):
    """Capturing the step as a CUDA graph failed; model and optimizer are left as they were."""


class DistributedError(NimbleError):
    """Ranks of a data-parallel job that disagree, or a rank that does not take part."""


def one_line(text: object, limit: int = 400) -> str:
    """A foreign message in one line, for an error or a warning of ours: its first line, and
    where that line ends with a colon the lines after it too (pybind11's "incompatible function
    arguments. The following argument types are supported:" names the types and the arguments
    it was given only below), joined by "; " and cut to `limit` characters."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    out = lines[0]
    if out.endswith(":") and len(lines) > 1:
        out = f"{out} {'; '.join(lines[1:])}"
    return out if len(out) <= limit else out[:limit - 3] + "..."
