"""A LibTorch program finds the installed runtime library with find_package(nimble_train),
builds against its headers and runs (tests/cpp/package_consumer)."""

import os
import shutil
import subprocess

import pytest

import nimble_train as nt
from package_build import build_against_package

CONSUMER = os.path.join(os.path.dirname(__file__), "..", "cpp", "package_consumer")


def test_the_package_says_where_it_is():
    config = os.path.join(nt.cmake_prefix_path, "nimble_train", "nimble_trainConfig.cmake")
    assert os.path.isfile(config), config


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake on PATH")
def test_a_libtorch_program_builds_and_runs_against_the_package(tmp_path):
    build = build_against_package(CONSUMER, tmp_path / "build")
    ran = subprocess.run([str(build / "consumer")], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.count("ok ") == 5 and "FAILED" not in ran.stdout, ran.stdout
    assert f"nimble_train {nt.__version__}" in ran.stdout
