"""On a GPU machine the whole runtime must be compiled in and load beside torch's libraries."""

import pytest
import torch

import nimble_train as nt
from nimble_train import _C

pytestmark = pytest.mark.cuda


def test_cuda_and_nccl_are_compiled_in():
    info = nt.build_info()
    assert info["cuda"]["available"], info["cuda"]["reason"]
    assert info["nccl"]["available"], info["nccl"]["reason"]


def test_kernels_were_built_for_this_gpu():
    # sm_90 machine code runs on compute capability 9.x; PTX covers anything newer.
    major, minor = torch.cuda.get_device_capability()
    archs = nt.build_info()["cuda_archs"]
    assert "90" in archs
    assert major >= 9, f"tests/gpu expects a Hopper GPU or newer; got sm_{major}{minor}"


def test_loaded_nccl_is_torchs():
    assert _C.runtime_versions()["nccl"] == ".".join(map(str, torch.cuda.nccl.version()))
