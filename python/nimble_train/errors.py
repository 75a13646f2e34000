"""The errors nimble_train raises; each message says what was expected, what was seen, and the fix."""


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
