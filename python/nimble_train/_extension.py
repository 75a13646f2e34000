"""Loads the extension nimble_train._C and checks it matches the torch it runs beside."""

import os

import torch

_REBUILD = "Rebuild it against the installed torch: pip install --no-build-isolation -e ."

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        f"nimble_train's extension nimble_train._C could not be loaded: {exc}. {_REBUILD}"
    ) from exc

_built_against = _C.build_info()["torch_version"]
if _built_against != torch.__version__:
    # torch's C++ ABI changes between releases: a mismatch fails later, in obscure ways.
    raise ImportError(
        f"nimble_train._C was built against torch {_built_against}, but torch "
        f"{torch.__version__} is installed. {_REBUILD}"
    )


# The runtime library's CMake package, installed beside _C (for CMAKE_PREFIX_PATH).
cmake_prefix_path = os.path.join(os.path.dirname(os.path.abspath(_C.__file__)), "share", "cmake")


def build_info() -> dict:
    """What this build compiled in (see ``nimble_train._C.build_info``)."""
    return _C.build_info()


def has_cuda() -> bool:
    """True when the CUDA kernels and the capture runtime were compiled in."""
    return _C.has_cuda()


def has_nccl() -> bool:
    """True when the NCCL communication layer was compiled in."""
    return _C.has_nccl()


def describe_build() -> str:
    """One line per feature: what is compiled in, at which version, or why it is left out."""
    info = build_info()
    lines = [f"nimble_train {info['version']} (built against torch {info['torch_version']})"]
    for name in ("cuda", "nccl"):
        feature = info[name]
        if feature["available"]:
            extra = f", archs {info['cuda_archs']}" if name == "cuda" else ""
            lines.append(f"  {name:9s} {feature['version']}{extra}")
        else:
            lines.append(f"  {name:9s} left out: {feature['reason']}")
    return "\n".join(lines)
