"""Configures and builds a CMake project against the installed nimble_train package, as a
LibTorch program would (find_package(nimble_train) through nimble_train.cmake_prefix_path)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import nimble_train as nt


def build_against_package(source: str, build: pathlib.Path) -> pathlib.Path:
    """Configures `source` into `build` (Release, Ninja when present) and builds it; asserts
    both steps succeed with their output as the message. Returns `build`."""
    configure = subprocess.run(
        ["cmake", "-S", source, "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
         f"-DCMAKE_PREFIX_PATH={nt.cmake_prefix_path}"]
        + (["-G", "Ninja"] if shutil.which("ninja") else []),
        capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return build
