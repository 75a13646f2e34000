"""The C++ quick start (examples/cpp) builds against the installed package with
find_package(nimble_train) and trains: on the CPU everywhere, and captured on a GPU where
there is one."""

import math
import os
import re
import shutil
import subprocess

import pytest

from package_build import build_against_package

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "cpp")
LOSS_LINE = re.compile(r"^step (\d+) lr \S+ loss (\S+)$", re.MULTILINE)
SAMPLES_LINE = re.compile(r"^samples/s (\S+) over steps", re.MULTILINE)
EVAL_LINE = re.compile(r"^eval: accuracy (\S+) over (\d+) held-out samples \(evaluator: "
                       r"replays (\d+), eager (\d+)\)$", re.MULTILINE)


def evaluation(stdout: str) -> tuple[float, int, int, int]:
    """The evaluation's line: accuracy, samples, evaluator replays and eager calls."""
    found = EVAL_LINE.search(stdout)
    assert found, stdout
    accuracy, samples, replays, eager = found.groups()
    return float(accuracy), int(samples), int(replays), int(eager)


@pytest.fixture(scope="module")
def train_cnn(tmp_path_factory):
    """The example's executable, configured and built as its CMakeLists.txt says."""
    if shutil.which("cmake") is None:
        pytest.skip("needs cmake on PATH to build examples/cpp")
    build = build_against_package(EXAMPLE, tmp_path_factory.mktemp("example") / "build")
    return str(build / "train_cnn")


def run(train_cnn, *args):
    return subprocess.run([train_cnn, *args], capture_output=True, text=True, timeout=300)


def losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in LOSS_LINE.findall(stdout)}


def test_the_example_trains_on_the_cpu(train_cnn):
    ran = run(train_cnn, "--device", "cpu", "--steps", "8", "--batch", "8")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    printed = losses(ran.stdout)
    assert 8 in printed, ran.stdout  # the last step's loss is always printed
    assert all(math.isfinite(loss) for loss in printed.values()), ran.stdout
    samples = SAMPLES_LINE.search(ran.stdout)
    assert samples and float(samples.group(1)) > 0, ran.stdout
    assert re.search(r"^stats: phase \S+, calls 8,", ran.stdout, re.MULTILINE), ran.stdout
    accuracy, samples, replays, eager = evaluation(ran.stdout)
    assert 0 <= accuracy <= 1 and samples == 4 * 8, ran.stdout
    assert (replays, eager) == (0, 4), ran.stdout  # the CPU evaluates eagerly


def test_the_example_accumulates_gradients_on_the_cpu(train_cnn):
    ran = run(train_cnn, "--device", "cpu", "--steps", "9", "--batch", "8", "--accumulate", "3")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert all(math.isfinite(loss) for loss in losses(ran.stdout).values()), ran.stdout
    assert re.search(r"^stats: phase \S+, calls 9, .*updates 3,", ran.stdout, re.MULTILINE), \
        ran.stdout


def test_the_example_refuses_a_bad_argument(train_cnn):
    ran = run(train_cnn, "--steps", "0")
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert "--steps needs a positive integer; got '0'" in ran.stderr


@pytest.mark.cuda
def test_the_example_captures_on_a_gpu(train_cnn):
    ran = run(train_cnn, "--device", "cuda", "--steps", "30")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    printed = losses(ran.stdout)
    assert 30 in printed and all(math.isfinite(v) for v in printed.values()), ran.stdout
    stats = re.search(r"^stats: phase (\S+), .*captures (\d+),", ran.stdout, re.MULTILINE)
    assert stats and stats.groups() == ("replay", "1"), ran.stdout
    accuracy, samples, replays, eager = evaluation(ran.stdout)
    # the evaluator: one eager batch, then captured into the step's pool and replayed
    assert 0 <= accuracy <= 1 and (replays, eager) == (3, 1), ran.stdout


@pytest.mark.cuda
def test_the_example_accumulates_in_graphs_on_a_gpu(train_cnn):
    """--accumulate 2: the window's first and last calls are two graphs; 30 calls, 15 updates."""
    ran = run(train_cnn, "--device", "cuda", "--steps", "30", "--accumulate", "2")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    printed = losses(ran.stdout)
    assert 30 in printed and all(math.isfinite(v) for v in printed.values()), ran.stdout
    stats = re.search(r"^stats: phase (\S+), .*captures (\d+), updates (\d+),", ran.stdout,
                      re.MULTILINE)
    assert stats and stats.groups() == ("replay", "2", "15"), ran.stdout
