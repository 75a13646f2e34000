"""torchrun starts one process per GPU; each loads nimble_train and talks NCCL to the others.

The job must exit by itself, promptly, on every rank.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.multi_gpu]

WORKER = os.path.join(os.path.dirname(__file__), "launch_worker.py")


def test_torchrun_job_runs_and_exits():
    nproc = min(torch.cuda.device_count(), 4)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", WORKER],
        capture_output=True, text=True, timeout=180,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(nproc):
        assert f"rank {rank}/{nproc} ok" in result.stdout, result.stdout + result.stderr
    assert elapsed < 120, f"the job took {elapsed:.0f} s to run and exit"
