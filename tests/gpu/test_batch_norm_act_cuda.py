"""Batch norms fused with their ReLU in planned captures (nimble_train/_batch_norm_act.py,
src/ops/batch_norm_act.h): the kernel against float64, the fused operator's gradients against
autograd's in float64, and captured steps against the eager loop."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nimble_train as nt
from nimble_train import _capture
from nimble_train._batch_norm_act import _BatchNormReLU
from nimble_train._extension import _C
from step_reference import assert_same_training, classification_batches, eager_loop

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_cudnn")]

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def channels_last(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda").to(dtype).contiguous(
        memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels", [64, 6, 200])  # packs of 16 bytes; one element at a time
@pytest.mark.parametrize("residual", [False, True])
def test_the_kernel_is_float64_batch_norm_plus_residual_then_relu(dtype, channels, residual):
    torch.manual_seed(channels)
    x = channels_last(6, channels, 9, 7, dtype=dtype) * 3 + 1
    r = channels_last(6, channels, 9, 7, dtype=dtype) if residual else None
    mean, invstd = torch.batch_norm_stats(x, 1e-5)
    w, b = torch.randn(channels, device="cuda"), torch.randn(channels, device="cuda")
    running = [torch.randn(channels, device="cuda"), torch.rand(channels, device="cuda") + 0.5]
    expected_running = [t.double().clone() for t in running]
    y = _C.batch_norm_relu_forward(x, mean.float(), invstd.float(), w, b, r, *running, 0.1, 1e-5)
    z = F.batch_norm(x.double(), *expected_running, w.double(), b.double(), True, 0.1, 1e-5)
    expected = torch.relu(z + r.double() if residual else z)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    scale = expected.abs().max().item()
    assert (y.double() - expected).abs().max().item() <= TOLERANCE[dtype] * scale
    for got, want in zip(running, expected_running):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_the_kernel_keeps_nan_and_takes_unaligned_tensors():
    x = channels_last(2, 8, 4, 4)
    x[0, 3, 1, 1] = float("nan")
    mean = torch.zeros(8, device="cuda")
    invstd, w, b = (torch.ones(8, device="cuda") for _ in range(3))
    y = _C.batch_norm_relu_forward(x, mean, invstd, w, b, None, None, None, 0.1, 1e-5)
    assert torch.isnan(y[0, 3, 1, 1])  # torch.relu keeps NaN
    assert torch.equal(torch.nan_to_num(y), torch.relu(torch.nan_to_num(x + 1)))
    # a view one element into its storage: not 16-byte aligned
    base = torch.randn(1 + 2 * 8 * 4 * 4, device="cuda")
    xs = base[1:].view(2, 4, 4, 8).permute(0, 3, 1, 2)
    assert xs.is_contiguous(memory_format=torch.channels_last) and xs.data_ptr() % 16
    y = _C.batch_norm_relu_forward(xs, mean, invstd, w, b, None, None, None, 0.1, 1e-5)
    assert torch.equal(y, torch.relu(xs + 1))


@pytest.mark.parametrize("residual", [False, True])
def test_the_fused_operators_gradients_are_autograds_in_float64(residual):
    torch.manual_seed(1)
    x = channels_last(16, 32, 8, 8).requires_grad_()
    r = channels_last(16, 32, 8, 8).requires_grad_() if residual else None
    w = torch.randn(32, device="cuda", requires_grad=True)
    b = torch.randn(32, device="cuda", requires_grad=True)
    rm, rv = torch.zeros(32, device="cuda"), torch.ones(32, device="cuda")
    y = _BatchNormReLU.apply(x, r, w, b, rm, rv, 0.1, 1e-5)
    g = torch.randn_like(y)
    inputs = [x, w, b] + ([r] if residual else [])
    grads = torch.autograd.grad(y, inputs, g)
    doubles = [t.detach().double().requires_grad_() for t in inputs]
    z = F.batch_norm(doubles[0], None, None, doubles[1], doubles[2], True, 0.1, 1e-5)
    expected = torch.relu(z + doubles[3] if residual else z)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(expected, doubles, g.double())):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


class Block(nn.Module):
    """A residual block whose addition writes the batch norm's output in place (torchvision's)
    and whose ReLU is one module called twice."""

    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class Net(nn.Module):
    """Two branches (several streams with "auto"), a residual block, F.relu and a batch norm
    whose output is also read by the head (not fused)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.left = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16),
                                  nn.ReLU(inplace=True))
        self.right = nn.Conv2d(16, 16, 1)
        self.right_bn = nn.BatchNorm2d(16)
        self.block = Block(32)
        self.bare = nn.BatchNorm2d(32)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        x = self.stem(x)
        x = torch.cat([self.left(x), F.relu(self.right_bn(self.right(x)))], 1)
        x = self.block(x)
        y = self.bare(x)
        return self.head(torch.cat([F.relu(y).mean((2, 3)), y.amax((2, 3))], 1))


FUSED = 5  # stem, left, right_bn, block.bn1, block.bn2 (+ x); not `bare`: two readers


def per_sample(logits, target):
    return F.cross_entropy(logits, target, reduction="none")


def make_opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def channels_last_batches(n):
    return [(x.contiguous(memory_format=torch.channels_last), y)
            for x, y in classification_batches(n, 16, device="cuda", image=True)]


@pytest.mark.parametrize("fuse", [True, False])
def test_a_fused_step_trains_as_the_eager_loop(fuse, monkeypatch, no_tf32):
    monkeypatch.setattr(_capture, "FUSE_BATCH_NORM_RELU", fuse)
    torch.manual_seed(0)
    model = Net().cuda().to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    batches = channels_last_batches(4)
    step = nt.Step(model, opt, per_sample, streams="auto", warmup=2)
    for b in batches:
        step(b)
    stats = step.stats()
    assert stats["captured"] and stats["replays"] > 0 and stats["streams"] > 1
    assert stats["fused_batch_norm_layers"] == (FUSED if fuse else 0)
    eager_loop(reference, ref_opt, per_sample, batches)
    # running averages and counters included
    assert_same_training(model, opt, reference, ref_opt, rtol=1e-3, atol=1e-4)
    assert {n: int(b) for n, b in model.named_buffers() if "num_batches" in n} == \
        {n: int(b) for n, b in reference.named_buffers() if "num_batches" in n}


def test_an_nchw_model_runs_unfused_and_trains_as_the_eager_loop(no_tf32):
    torch.manual_seed(0)
    model = Net().cuda()
    reference = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    batches = classification_batches(4, 16, device="cuda", image=True)
    step = nt.Step(model, opt, per_sample, streams="auto", warmup=2)
    for b in batches:
        step(b)
    assert step.stats()["captured"] and step.stats()["fused_batch_norm_layers"] == 0
    eager_loop(reference, ref_opt, per_sample, batches)
    assert_same_training(model, opt, reference, ref_opt, rtol=1e-3, atol=1e-4)
