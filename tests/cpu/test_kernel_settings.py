"""torch's settings that choose a captured step's kernels (src/capture/kernel_settings.h): each
change is seen and named as a program sets it; a setting put back reads as before."""

import functools

import pytest
import torch

from nimble_train._extension import _C


@pytest.fixture
def settings_restored():
    backends = torch.backends
    saved = (torch.get_float32_matmul_precision(), backends.cudnn.allow_tf32,
             backends.cudnn.enabled, backends.cudnn.deterministic,
             torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype(),
             backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
             backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
             backends.cuda.flash_sdp_enabled(), backends.cuda.mem_efficient_sdp_enabled(),
             backends.cuda.math_sdp_enabled(), backends.cuda.cudnn_sdp_enabled())
    backends.cuda.matmul.fp32_precision = "none"  # as torch starts: the generic value, IEEE
    backends.cudnn.conv.fp32_precision = backends.cudnn.rnn.fp32_precision = "tf32"
    yield
    backends.cuda.matmul.fp32_precision = "none"
    backends.cudnn.conv.fp32_precision = backends.cudnn.rnn.fp32_precision = "tf32"
    torch.set_float32_matmul_precision(saved[0])
    backends.cudnn.allow_tf32, backends.cudnn.enabled, backends.cudnn.deterministic = saved[1:4]
    torch.use_deterministic_algorithms(saved[4])
    torch.set_default_dtype(saved[5])
    backends.cuda.matmul.allow_fp16_reduced_precision_reduction = saved[6]
    backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved[7]
    backends.cuda.enable_flash_sdp(saved[8])
    backends.cuda.enable_mem_efficient_sdp(saved[9])
    backends.cuda.enable_math_sdp(saved[10])
    backends.cuda.enable_cudnn_sdp(saved[11])


def test_float32_precision_is_read_as_torch_resolves_it_through_either_api(settings_restored):
    """The legacy setters and the per-operator API write the same values; 'highest' after
    torch's unset start reads the same (IEEE both); a precision set through both APIs, which
    torch's legacy getters refuse to read, is read."""
    backends = torch.backends
    start = _C.kernel_settings()
    assert _C.kernel_setting_changes(start, start) == []

    def changes():
        return _C.kernel_setting_changes(start, _C.kernel_settings())

    torch.set_float32_matmul_precision("high")
    assert changes() == ["torch.backends.cuda.matmul.fp32_precision (or "
                         "torch.set_float32_matmul_precision(), "
                         "torch.backends.cuda.matmul.allow_tf32) is 'tf32', was 'ieee'"]
    torch.set_float32_matmul_precision("medium")  # TF32 too, for CUDA's products
    assert len(changes()) == 1
    torch.set_float32_matmul_precision("highest")
    assert changes() == []
    backends.cuda.matmul.allow_tf32 = True
    assert len(changes()) == 1 and "is 'tf32', was 'ieee'" in changes()[0]
    backends.cuda.matmul.allow_tf32 = False
    assert changes() == []
    backends.cudnn.allow_tf32 = False
    assert changes() == [
        "torch.backends.cudnn.conv.fp32_precision (or torch.backends.cudnn.allow_tf32) is "
        "'ieee', was 'tf32'",
        "torch.backends.cudnn.rnn.fp32_precision (or torch.backends.cudnn.allow_tf32) is "
        "'ieee', was 'tf32'"]
    backends.cudnn.allow_tf32 = True
    assert changes() == []
    backends.cudnn.conv.fp32_precision = "ieee"  # the per-operator API: convolutions only
    assert len(changes()) == 1 and "cudnn.conv" in changes()[0]
    backends.cudnn.conv.fp32_precision = "tf32"
    backends.cuda.matmul.fp32_precision = "tf32"  # after the legacy setters above: mixed
    with pytest.raises(RuntimeError):
        torch.get_float32_matmul_precision()
    assert len(changes()) == 1 and "is 'tf32', was 'ieee'" in changes()[0]
    backends.cuda.matmul.fp32_precision = "ieee"
    assert changes() == []


@pytest.mark.parametrize("change, undo, name, values", [
    (lambda: setattr(torch.backends.cudnn, "enabled", False),
     lambda: setattr(torch.backends.cudnn, "enabled", True),
     "torch.backends.cudnn.enabled", "False, was True"),
    (lambda: setattr(torch.backends.cudnn, "deterministic", True),
     lambda: setattr(torch.backends.cudnn, "deterministic", False),
     "torch.backends.cudnn.deterministic", "True, was False"),
    (lambda: torch.use_deterministic_algorithms(True),
     lambda: torch.use_deterministic_algorithms(False),
     "torch.use_deterministic_algorithms()", "True, was False"),
    (lambda: torch.set_default_dtype(torch.float64),
     lambda: torch.set_default_dtype(torch.float32),
     "torch.set_default_dtype()", "torch.float64, was torch.float32"),
    (lambda: setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False),
     lambda: setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", True),
     "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
     "(False, True), was (True, True)"),
    (lambda: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction",
                     (False, False)),
     lambda: setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", True),
     "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
     "(False, False), was (True, True)"),
    *[(functools.partial(getattr(torch.backends.cuda, f"enable_{b}_sdp"), False),
       functools.partial(getattr(torch.backends.cuda, f"enable_{b}_sdp"), True),
       f"torch.backends.cuda.enable_{b}_sdp()", "False, was True")
      for b in ("flash", "mem_efficient", "math", "cudnn")],
], ids=["cudnn", "cudnn-deterministic", "deterministic", "default-dtype", "fp16-reduction",
        "bf16-reduction", "flash", "mem-efficient", "math", "cudnn-attention"])
def test_each_setting_is_seen_and_named_alone(settings_restored, change, undo, name, values):
    start = _C.kernel_settings()
    change()
    assert _C.kernel_setting_changes(start, _C.kernel_settings()) == [f"{name} is {values}"]
    undo()
    assert _C.kernel_settings() == start
