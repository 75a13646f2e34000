"""nt.Step data-parallel across the GPUs of one machine, launched with torchrun.

Each case runs step_worker.py on every GPU (at most 4) and checks every rank's last line, and
that the job exits by itself within seconds of its last step.
"""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.multi_gpu]

WORKER = os.path.join(os.path.dirname(__file__), "step_worker.py")


def torchrun(case: str) -> tuple[int, str, list[float], float]:
    nproc = min(torch.cuda.device_count(), 4)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", WORKER, case],
        capture_output=True, text=True, timeout=300)
    exited = time.time()
    output = result.stdout + result.stderr
    lines = {int(m.group(1)): m for m in
             re.finditer(r"^rank (\d+)/\d+ (ok|error: .*) (\d+\.\d+)$", result.stdout, re.M)}
    assert sorted(lines) == list(range(nproc)), output
    ends = [float(lines[r].group(3)) for r in range(nproc)]
    return result.returncode, output, [lines[r].group(2) for r in range(nproc)], exited - max(ends)


def test_ranks_train_as_one_gpu_with_the_whole_batch_and_stay_identical():
    code, output, status, exit_after = torchrun("equivalence")
    assert code == 0 and all(s == "ok" for s in status), output
    assert exit_after < 15, f"the job took {exit_after:.1f} s to exit after its last step"


@pytest.mark.parametrize("case", ["clipped", "unfused"])
def test_clipping_and_unfused_optimizers_see_the_averaged_gradients(case):
    code, output, status, _ = torchrun(case)
    assert code == 0 and all(s == "ok" for s in status), output


def test_a_sharded_optimizer_trains_as_one_gpu_with_1_nth_of_the_state_per_rank():
    code, output, status, _ = torchrun("sharded")
    assert code == 0 and all(s == "ok" for s in status), output


def test_accumulating_ranks_train_as_one_gpu_and_all_reduce_only_when_updating():
    code, output, status, _ = torchrun("accumulating")
    assert code == 0 and all(s == "ok" for s in status), output


def test_sync_batchnorm_in_the_graph_trains_as_one_gpu_with_the_whole_batch():
    code, output, status, exit_after = torchrun("syncbn")
    assert code == 0 and all(s == "ok" for s in status), output
    assert exit_after < 15, f"the job took {exit_after:.1f} s to exit after its last step"


def test_all_reduce_overlaps_the_backward():
    code, output, status, _ = torchrun("overlap")
    assert code == 0 and all(s == "ok" for s in status), output


def test_mismatched_ranks_fail_clearly_and_promptly():
    start = time.time()
    code, output, status, exit_after = torchrun("mismatch")
    for s in status:
        assert "the ranks disagree on the model, optimizer and Step options" in s, output
        assert "parameters is" in s, output
    assert time.time() - start < 120 and exit_after < 15, output
