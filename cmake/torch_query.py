"""Prints what the build needs to know about the installed torch, one `key=value` a line.

Run by CMake with the interpreter it builds for, so the extension is compiled against the
torch that will import it.
"""
import os
import sys

import torch
import torch.utils

site = os.path.dirname(os.path.dirname(torch.__file__))
nvidia = os.path.join(site, "nvidia")
# Wheels of CUDA libraries (nvidia-nccl-cu13, nvidia-cudnn-cu13, nvidia-cublas, ...) unpack to
# site-packages/nvidia/<name>/{include,lib}; they are the copies torch loads at run time.
nvidia_dirs = []
if os.path.isdir(nvidia):
    nvidia_dirs = sorted(
        os.path.join(nvidia, d)
        for d in os.listdir(nvidia)
        if os.path.isdir(os.path.join(nvidia, d, "include"))
        or os.path.isdir(os.path.join(nvidia, d, "lib"))
    )


def loaded_libstdcxx():
    """The C++ runtime this process (Python + torch) has loaded; '' where /proc is missing."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libstdc++.so" in line}
    except OSError:
        return ""
    return sorted(paths)[0] if paths else ""


fields = {
    "prefix": os.path.dirname(os.path.dirname(torch.utils.cmake_prefix_path)),
    "version": torch.__version__,
    "cuda": torch.version.cuda or "",
    "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
    "libstdcxx": loaded_libstdcxx(),
}
for key, value in fields.items():
    sys.stdout.write(f"{key}={value}\n")
for path in nvidia_dirs:
    sys.stdout.write(f"nvidia_dir={path}\n")
