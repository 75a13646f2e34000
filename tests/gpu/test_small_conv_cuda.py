"""The stem's kernels (src/ops/small_conv.h, nimble_train/_small_conv.py): against a float64
reference, and in captured steps against the eager loop and torch's convolution."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nimble_train as nt
from nimble_train import _capture, _small_conv
from nimble_train.models.airbench import airbench_cifar
from step_reference import assert_same_training, eager_loop, training_gap

pytestmark = [pytest.mark.cuda]

# (N, C, H, W, out channels, kernel, stride, padding, dilation, bias)
CASES = [
    (8, 3, 32, 32, 64, 3, 1, 1, 1, False),    # a CIFAR ResNet's stem
    (16, 3, 32, 32, 24, 2, 1, 0, 1, True),    # airbench's whitening
    (4, 3, 64, 64, 64, 3, 2, 1, 1, False),    # strided
    (2, 2, 16, 16, 256, 4, 1, 2, 1, True),    # the most columns (32) and output channels
    (3, 2, 15, 13, 8, (3, 2), (2, 1), (1, 2), (2, 1), True),
    (2, 4, 9, 9, 5, (1, 2), 1, 0, 1, True),
]


def reference(x, conv, grad_y):
    """Output and weight (and bias) gradients in float64 on the CPU."""
    c64 = copy.deepcopy(conv).double().cpu()
    y = c64(x.double().cpu())
    y.backward(grad_y.double().cpu())
    return y, c64.weight.grad, (c64.bias.grad if c64.bias is not None else None)


@pytest.mark.parametrize("input_layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("case", CASES)
def test_the_kernels_compute_the_convolution_in_float32(case, input_layout, no_tf32):
    n, c, h, w, out, kernel, stride, padding, dilation, bias = case
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=g).cuda()
    if input_layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    conv = nn.Conv2d(c, out, kernel, stride, padding, dilation, bias=bias).cuda()
    conv = conv.to(memory_format=torch.channels_last)
    assert _small_conv.takes(x, conv.weight)
    y = _small_conv.apply(x, conv)
    grad_y = torch.randn(y.shape, generator=g).cuda()
    y.backward(grad_y)
    y_ref, gw_ref, gb_ref = reference(x, conv, grad_y)
    # Channels-last output and weight gradient, as cuDNN gives for a channels-last weight.
    assert y.is_contiguous(memory_format=torch.channels_last) and y.shape == y_ref.shape
    assert conv.weight.grad.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.double().cpu(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv.weight.grad.double().cpu(), gw_ref, rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(conv.bias.grad.double().cpu(), gb_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_the_kernels_run_in_its_dtype_and_the_gradient_in_float32(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 32, 32, generator=g).cuda()
    conv = nn.Conv2d(3, 32, 3, padding=1).cuda().to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=dtype):
        y = _small_conv.apply(x, conv)
        y_torch = conv(x)
    assert y.dtype == y_torch.dtype == dtype
    grad_y = torch.randn(y.shape, generator=g).cuda()
    y.float().backward(grad_y)  # the cast's backward rounds grad_y to `dtype`
    assert conv.weight.grad.dtype == conv.bias.grad.dtype == torch.float32
    # The reference takes the operands as the kernels see them: the input, the weight, the bias
    # and the output's gradient rounded to `dtype`, then everything in float64. The kernels sum
    # in float32 and round only the output to `dtype`: the output within one unit in its last
    # place, the gradients (never rounded to `dtype`) within float32's summation error. Against
    # the unrounded operands' float64 results the gradients would differ by the operands'
    # rounding instead, which says nothing of where the kernels round.
    rounded = copy.deepcopy(conv)
    with torch.no_grad():
        rounded.weight.copy_(conv.weight.to(dtype))
        rounded.bias.copy_(conv.bias.to(dtype))
    y_ref, gw_ref, gb_ref = reference(x.to(dtype), rounded, grad_y.to(dtype))
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(y.double().cpu(), y_ref, rtol=ulp, atol=1e-4)
    scale = gw_ref.abs().max().item()
    torch.testing.assert_close(conv.weight.grad.double().cpu() / scale, gw_ref / scale,
                               rtol=1e-5, atol=1e-5)
    scale = gb_ref.abs().max().item()
    torch.testing.assert_close(conv.bias.grad.double().cpu() / scale, gb_ref / scale,
                               rtol=1e-5, atol=1e-5)
    # Rounded to `dtype` once more, as torch's own kernels would leave them, the gradients
    # would miss: the test tells a float32 sum from a `dtype` one.
    assert not torch.allclose(conv.weight.grad.to(dtype).double().cpu(), gw_ref, rtol=1e-5,
                              atol=1e-5 * gw_ref.abs().max().item())


def test_inputs_it_does_not_take_go_to_torch():
    conv = nn.Conv2d(3, 8, 3, padding=1).cuda()
    x = torch.randn(2, 3, 8, 8, device="cuda")
    assert not _small_conv.takes(x, conv.weight)  # NCHW weight and input: torch gives NCHW
    conv = conv.to(memory_format=torch.channels_last)
    assert _small_conv.takes(x, conv.weight)
    assert not _small_conv.takes(x.requires_grad_(True), conv.weight)  # it needs a gradient
    assert not _small_conv.takes(x.detach().half(), conv.weight)  # mixed dtypes: torch's error
    assert not _small_conv.takes(x.detach().cpu(), conv.weight)


class Stem(nn.Module):
    """A CIFAR stem (3 input channels), then a chain with a batch norm, on two branches."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.a = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.b = nn.Conv2d(16, 16, 1, bias=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        return self.head(torch.cat([self.a(x), self.b(x)], 1).mean((2, 3)))


def per_sample(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


@pytest.mark.parametrize("streams", [1, "auto"])
@pytest.mark.parametrize("input_layout", ["nchw", "channels_last"])
def test_a_step_runs_the_stem_on_our_kernels_and_trains_as_the_eager_loop(streams, input_layout,
                                                                        no_tf32):
    torch.manual_seed(0)
    model = Stem().cuda().to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 3, 16, 16, generator=g).cuda(),
                torch.randint(0, 5, (8,), generator=g).cuda()) for _ in range(6)]
    if input_layout == "channels_last":
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    make_opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,  # noqa: E731
                                         weight_decay=1e-4)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    o_ours, o_theirs = make_opt(ours.parameters()), make_opt(theirs.parameters())
    step = nt.Step(ours, o_ours, per_sample, streams=streams, warmup=2)
    losses = torch.stack([step(b).clone() for b in batches])
    eager = torch.stack(eager_loop(theirs, o_theirs, per_sample, batches))
    stats = step.stats()
    assert stats["captured"] and stats["replays"] == 4 and stats["small_conv_layers"] == 1
    if streams == "auto":  # the stem's weight gradient goes to the side stream with the rest
        assert stats["weight_grad_layers"] == 4, stats  # the stem, a, b and the head
    assert "forward" not in vars(ours.stem)  # restored after the capture
    torch.testing.assert_close(losses, eager, rtol=1e-4, atol=1e-5)
    assert_same_training(ours, o_ours, theirs, o_theirs, rtol=1e-4, atol=1e-5)


def test_switched_off_the_step_runs_torch_s_convolution(no_tf32):
    torch.manual_seed(0)
    model = Stem().cuda().to(memory_format=torch.channels_last)
    batches = [(torch.randn(8, 3, 16, 16, device="cuda"),
                torch.randint(0, 5, (8,), device="cuda")) for _ in range(4)]
    saved = _capture.SMALL_CONV_KERNELS
    _capture.SMALL_CONV_KERNELS = "torch"
    try:
        step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.05), per_sample,
                       warmup=2)
        for b in batches:
            step(b)
    finally:
        _capture.SMALL_CONV_KERNELS = saved
    stats = step.stats()
    assert stats["captured"] and stats["small_conv_layers"] == 0


def airbench_run(batches, small: str, lr_scale: float = 1.0, step: bool = True):
    torch.manual_seed(0)
    model = airbench_cifar().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scale, momentum=0.9, nesterov=True)
    if not step:
        eager_loop(model, opt, per_sample, batches, amp=torch.bfloat16)
        return model, opt, None
    saved = _capture.SMALL_CONV_KERNELS, _capture.FUSE_BATCH_NORM_ACT
    # the stem alone: the batch norms and GELUs as the eager loop runs them
    _capture.SMALL_CONV_KERNELS, _capture.FUSE_BATCH_NORM_ACT = small, False
    try:
        s = nt.Step(model, opt, per_sample, streams="auto", amp="bf16", warmup=2)
        for b in batches:
            s(b)
    finally:
        _capture.SMALL_CONV_KERNELS, _capture.FUSE_BATCH_NORM_ACT = saved
    return model, opt, s.stats()


def test_airbench_under_bf16_trains_as_close_to_the_eager_loop_as_with_cudnn(no_tf32):
    """The whitening convolution (a bias, 2x2) on our kernels under autocast, on several
    streams: as far from the eager loop as the step with cuDNN's convolution is (bf16
    rounding), where a 50% error in the learning rate lands outside."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(32, 3, 32, 32, generator=g).cuda()
                .contiguous(memory_format=torch.channels_last),
                torch.randint(0, 10, (32,), generator=g).cuda()) for _ in range(6)]
    eager, eager_opt, _ = airbench_run(batches, "torch", step=False)
    ours, ours_opt, ours_stats = airbench_run(batches, "ours")
    cudnn, cudnn_opt, cudnn_stats = airbench_run(batches, "torch")
    assert ours_stats["small_conv_layers"] == 1 and cudnn_stats["small_conv_layers"] == 0
    assert ours_stats["captured"] and ours_stats["weight_grad_layers"] > 0
    floor = training_gap(cudnn, cudnn_opt, eager, eager_opt)
    gap = training_gap(ours, ours_opt, eager, eager_opt)
    assert gap <= 3 * floor + 1e-6, f"gap to eager {gap:.3g}, with cuDNN's {floor:.3g}"
    off, off_opt, _ = airbench_run(batches, "torch", lr_scale=1.5, step=False)
    assert training_gap(off, off_opt, eager, eager_opt) > 3 * floor + 1e-6
