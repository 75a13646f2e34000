"""The extension imports beside the installed torch and reports what it compiled in."""

import shutil

import torch

import nimble_train as nt
from nimble_train import _C

FEATURES = ("cuda", "nccl")


def test_built_against_the_running_torch():
    assert nt.build_info()["torch_version"] == torch.__version__


def test_every_feature_says_version_or_reason():
    info = nt.build_info()
    for name in FEATURES:
        feature = info[name]
        assert set(feature) == {"available", "version", "reason"}, name
        if feature["available"]:
            assert feature["version"] and feature["reason"] is None, (name, feature)
        else:
            assert feature["version"] is None and len(feature["reason"]) > 10, (name, feature)
    assert nt.has_cuda() == info["cuda"]["available"]
    assert nt.has_nccl() == info["nccl"]["available"]


def test_cuda_compiled_in_when_torch_and_nvcc_allow_it():
    # A CUDA build of torch plus nvcc on PATH is the configuration CI builds in: the CUDA
    # sources must then really have been compiled, for sm_90 and its PTX.
    info = nt.build_info()
    if torch.version.cuda and shutil.which("nvcc"):
        assert info["cuda"]["available"], info["cuda"]["reason"]
        assert "90" in info["cuda_archs"]
    if not torch.version.cuda:
        assert not info["cuda"]["available"]
        assert "CPU-only build" in info["cuda"]["reason"]


def test_runtime_libraries_match_what_was_built_against():
    info = nt.build_info()
    loaded = _C.runtime_versions()
    if info["nccl"]["available"]:
        # _C must use the NCCL that torch loaded, and have been compiled against its header.
        assert loaded["nccl"] == ".".join(map(str, torch.cuda.nccl.version()))
        assert loaded["nccl"] == info["nccl"]["version"]
    if info["cuda"]["available"]:
        major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
        assert loaded["cuda_runtime"] // 1000 == major, (loaded, torch.version.cuda)


def test_describe_build_names_every_feature():
    text = nt.describe_build()
    for name in FEATURES:
        assert name in text


def test_errors_share_a_base_class():
    for error in (nt.SyncError, nt.ShapeError, nt.CaptureError):
        assert issubclass(error, nt.NimbleError)
