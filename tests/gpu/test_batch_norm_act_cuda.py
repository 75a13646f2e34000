"""Batch norms fused with their ReLU in planned captures (nimble_train/_batch_norm_act.py,
src/ops/batch_norm_act.h): the kernel against float64, the fused operator's gradients against
autograd's in float64, and captured steps against the eager loop."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nimble_train as nt
from nimble_train import _batch_norm_act, _capture
from nimble_train._batch_norm_act import _BatchNormAct
from nimble_train._extension import _C
from nimble_train.models.airbench import airbench_cifar
from step_reference import (assert_same_training, batch_norm_act_grads, batch_norm_stats_float64,
                            classification_batches, eager_loop, relu_mask_words, training_gap)

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_cudnn")]

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def channels_last(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda").to(dtype).contiguous(
        memory_format=torch.channels_last)


# (activation, residual): a residual goes with the ReLU only
ACTS = [("relu", False), ("relu", True), ("gelu", False)]


def activate(z, act):
    return F.gelu(z) if act == "gelu" else torch.relu(z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels", [64, 6, 200])  # packs of 16 bytes; one element at a time
@pytest.mark.parametrize("act, residual", ACTS)
def test_the_kernel_is_float64_batch_norm_plus_residual_then_activation(dtype, channels, act,
                                                                       residual):
    torch.manual_seed(channels)
    x = channels_last(6, channels, 9, 7, dtype=dtype) * 3 + 1
    r = channels_last(6, channels, 9, 7, dtype=dtype) if residual else None
    mean, invstd = torch.batch_norm_stats(x, 1e-5)
    w, b = torch.randn(channels, device="cuda"), torch.randn(channels, device="cuda")
    running = [torch.randn(channels, device="cuda"), torch.rand(channels, device="cuda") + 0.5]
    expected_running = [t.double().clone() for t in running]
    gelu = act == "gelu"
    y, mask = _C.batch_norm_relu_forward(x, mean.float(), invstd.float(), w, b, r, *running,
                                         0.1, 1e-5, gelu, not gelu)
    if not gelu:  # 6 and 200 channels: a last word partly used
        assert torch.equal(mask.cpu().long() & 0xFFFFFFFF, relu_mask_words(y))
    z = F.batch_norm(x.double(), *expected_running, w.double(), b.double(), True, 0.1, 1e-5)
    expected = activate(z + r.double() if residual else z, act)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    scale = expected.abs().max().item()
    assert (y.double() - expected).abs().max().item() <= TOLERANCE[dtype] * scale
    for got, want in zip(running, expected_running):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 64, 9, 7), (6, 6, 9, 7), (64, 256, 16, 16)])
@pytest.mark.parametrize("act, residual", ACTS)
def test_the_backward_kernels_are_autograds_in_float64_and_deterministic(dtype, shape, act,
                                                                         residual):
    gelu = act == "gelu"
    torch.manual_seed(shape[1])
    x = channels_last(*shape, dtype=dtype) * 2 + 0.5
    r = channels_last(*shape, dtype=dtype) if residual else None
    w, b = torch.randn(shape[1], device="cuda"), torch.randn(shape[1], device="cuda")
    mean, invstd = torch.batch_norm_stats(x, 1e-5)
    y, mask = _C.batch_norm_relu_forward(x, mean, invstd, w, b, r, None, None, 0.1, 1e-5, gelu,
                                         not gelu)
    gy = channels_last(*shape, dtype=dtype)
    got = _C.batch_norm_relu_backward(gy, y, x, mean, invstd, w, b, True, residual, gelu)
    again = _C.batch_norm_relu_backward(gy, y, x, mean, invstd, w, b, True, residual, gelu)
    for a, b_ in zip(got, again):
        assert (a is None and b_ is None) or torch.equal(a, b_)  # the same sums, same order
    if not gelu:  # the ReLU's mask from the forward's bits: the same values, bit for bit
        from_mask = _C.batch_norm_relu_backward(gy, None, x, mean, invstd, w, b, True, residual,
                                                gelu, mask)
        for a, b_ in zip(got, from_mask):
            assert (a is None and b_ is None) or torch.equal(a, b_)
    expected = batch_norm_act_grads(x, w, b, r, gy, y, gelu)
    grad_x, grad_r, grad_w, grad_b = got
    for name, a, e in zip(("x", "weight", "bias", "residual"),
                          [grad_x, grad_w, grad_b] + ([grad_r] if residual else []), expected):
        scale = e.abs().max().item()
        assert (a.double() - e).abs().max().item() <= 10 * TOLERANCE[dtype] * scale, name
    assert grad_x.dtype == dtype and grad_x.is_contiguous(memory_format=torch.channels_last)
    assert grad_r is None if not residual else grad_r.dtype == dtype


def bn_chain(x, gy, w, b, r, gelu, early):
    """Statistics, forward and backward of the fused batch norm (the ReLU with a residual, or
    the GELU)."""
    mean, invstd = _C.batch_norm_stats(x, 1e-5, early)
    y, mask = _C.batch_norm_relu_forward(x, mean, invstd, w, b, None if gelu else r, None, None,
                                         0.1, 1e-5, gelu, not gelu, early)
    grads = _C.batch_norm_relu_backward(gy, y if gelu else None, x, mean, invstd, w, b, True,
                                        not gelu, gelu, None if gelu else mask, early)
    return [mean, invstd, y] + [t for t in grads if t is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 64, 32, 32), (32, 512, 4, 4), (6, 33, 9, 7)])
@pytest.mark.parametrize("gelu", [False, True])
def test_kernels_launched_early_wait_for_what_they_read_in_a_graph(dtype, shape, gelu):
    """Each kernel of the chains starts early (programmatic dependent launch), the first after a
    cuBLAS product that makes its input and may itself let it start early: replayed in a CUDA
    graph on new inputs, the values are those of the kernels launched one after the other on
    the graph's own x and output gradient, bit for bit."""
    n, c, h, wd = shape
    rows, k = n * h * wd, 96

    def made(a, m, g, m2):  # channels-last [N, C, H, W] views of [rows, C] products
        return [(p @ q).view(n, h, wd, c).permute(0, 3, 1, 2) for p, q in ((a, m), (g, m2))]

    torch.manual_seed(c)
    static = [torch.randn(*size, device="cuda", dtype=dtype)
              for size in ((rows, k), (k, c), (rows, k), (k, c))]
    w, b = torch.randn(c, device="cuda"), torch.randn(c, device="cuda")
    r = channels_last(*shape, dtype=dtype)
    bn_chain(*made(*static), w, b, r, gelu, True)  # first calls outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x, gy = made(*static)
        out = bn_chain(x, gy, w, b, r, gelu, True)
    for i in range(4):
        for t in static:
            t.copy_(torch.randn_like(t))
        graph.replay()
        expected = bn_chain(x, gy, w, b, r, gelu, False)
        for got, want in zip(out, expected, strict=True):
            assert torch.equal(got, want), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 6, 9, 7), (6, 33, 9, 7), (8, 640, 12, 12),
                                   (128, 64, 32, 32), (32, 512, 4, 4)])
def test_the_statistics_are_float64s_and_deterministic(dtype, shape):
    """Shapes: one element at a time (6 and 33 channels), several blocks across the channels
    (640), 256 blocks down the rows (131072 rows), ResNet-18's last batch norm. The mean sits
    far from zero, where plain sums of x and x * x would cancel."""
    torch.manual_seed(shape[1])
    x = channels_last(*shape, dtype=dtype) * 0.5 + 20
    mean, invstd = _C.batch_norm_stats(x, 1e-5)
    again = _C.batch_norm_stats(x, 1e-5)
    assert torch.equal(mean, again[0]) and torch.equal(invstd, again[1])
    want_mean, want_invstd = batch_norm_stats_float64(x)
    torch.testing.assert_close(mean.double(), want_mean, rtol=2e-6, atol=0)
    torch.testing.assert_close(invstd.double(), want_invstd, rtol=2e-4, atol=0)
    torch_mean, torch_invstd = torch.batch_norm_stats(x, 1e-5)  # about as accurate as torch's
    assert ((invstd.double() - want_invstd).abs().max()
            <= 2 * (torch_invstd.double() - want_invstd).abs().max() + 1e-6 * want_invstd.max())


def test_the_statistics_take_unaligned_tensors():
    torch.manual_seed(3)
    base = torch.randn(1 + 4 * 8 * 5 * 5, device="cuda")
    x = base[1:].view(4, 5, 5, 8).permute(0, 3, 1, 2)
    assert x.is_contiguous(memory_format=torch.channels_last) and x.data_ptr() % 16
    mean, invstd = _C.batch_norm_stats(x, 1e-3)
    want_mean, want_invstd = batch_norm_stats_float64(x, 1e-3)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(invstd.double(), want_invstd, rtol=1e-5, atol=0)


def test_the_backward_takes_unaligned_tensors_and_any_gradient_layout():
    torch.manual_seed(5)
    base = torch.randn(3, 1 + 2 * 8 * 4 * 4, device="cuda")
    x, y_in, gy = (row[1:].view(2, 4, 4, 8).permute(0, 3, 1, 2) for row in base)
    assert x.data_ptr() % 16
    mean, invstd = torch.batch_norm_stats(x, 1e-5)
    w, b = torch.randn(8, device="cuda"), torch.randn(8, device="cuda")
    y, mask = _C.batch_norm_relu_forward(x, mean, invstd, w, b, None, None, None, 0.1, 1e-5,
                                         False, True)
    assert torch.equal(mask.cpu().long() & 0xFFFFFFFF, relu_mask_words(y))
    y_odd = torch.empty_like(base[0]).copy_(base[0])[1:].view(2, 4, 4, 8).permute(0, 3, 1, 2)
    y_odd.copy_(y)
    aligned = _C.batch_norm_relu_backward(gy.contiguous(memory_format=torch.channels_last),
                                          y, x.clone(memory_format=torch.channels_last), mean,
                                          invstd, w, b, True, True)
    unaligned = _C.batch_norm_relu_backward(gy.contiguous(), y_odd, x, mean, invstd, w, b, True,
                                            True)
    from_mask = _C.batch_norm_relu_backward(gy.contiguous(), None, x, mean, invstd, w, b, True,
                                            True, False, mask)
    for a, b_, c in zip(aligned, unaligned, from_mask):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-6)
        assert torch.equal(b_, c)


def test_the_kernel_keeps_nan_and_takes_unaligned_tensors():
    x = channels_last(2, 8, 4, 4)
    x[0, 3, 1, 1] = float("nan")
    mean = torch.zeros(8, device="cuda")
    invstd, w, b = (torch.ones(8, device="cuda") for _ in range(3))
    y, mask = _C.batch_norm_relu_forward(x, mean, invstd, w, b, None, None, None, 0.1, 1e-5,
                                         False, True)
    assert torch.isnan(y[0, 3, 1, 1])  # torch.relu keeps NaN
    assert torch.equal(torch.nan_to_num(y), torch.relu(torch.nan_to_num(x + 1)))
    words = mask.cpu().long() & 0xFFFFFFFF
    assert torch.equal(words, relu_mask_words(y))
    at = (1 * 4 + 1) * 8 + 3  # channels-last index of [0, 3, 1, 1]: threshold_backward passes
    assert (words[at // 32] >> (at % 32)) & 1 == 1
    # a view one element into its storage: not 16-byte aligned
    base = torch.randn(1 + 2 * 8 * 4 * 4, device="cuda")
    xs = base[1:].view(2, 4, 4, 8).permute(0, 3, 1, 2)
    assert xs.is_contiguous(memory_format=torch.channels_last) and xs.data_ptr() % 16
    y, mask = _C.batch_norm_relu_forward(xs, mean, invstd, w, b, None, None, None, 0.1, 1e-5,
                                         False, True)
    assert torch.equal(y, torch.relu(xs + 1))
    assert torch.equal(mask.cpu().long() & 0xFFFFFFFF, relu_mask_words(y))


def test_the_mask_of_a_forward_that_strides_over_its_rows():
    """More packs than the forward's most blocks take at once (65536 x 256 threads): each
    thread strides on, and each warp's words are written on every lap; one element at a time
    (one channel), the last word partly used."""
    torch.manual_seed(4)
    x = channels_last(1025, 1, 127, 129)
    assert x.numel() > 65536 * 256 and x.numel() % 32
    mean, invstd = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    w, b = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    y, mask = _C.batch_norm_relu_forward(x, mean, invstd, w, b, None, None, None, 0.1, 1e-5,
                                         False, True)
    assert torch.equal(y, torch.relu(x))
    assert torch.equal(mask.cpu().long() & 0xFFFFFFFF, relu_mask_words(y))


@pytest.mark.parametrize("our_stats", [True, False])
@pytest.mark.parametrize("ours, bits", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("act, residual", ACTS)
def test_the_fused_operators_gradients_are_autograds_in_float64(act, residual, ours, bits,
                                                                 our_stats, monkeypatch):
    monkeypatch.setattr(_batch_norm_act, "OUR_BACKWARD", ours)
    monkeypatch.setattr(_batch_norm_act, "MASK_BITS", bits)
    monkeypatch.setattr(_batch_norm_act, "OUR_STATS", our_stats)
    torch.manual_seed(1)
    x = channels_last(16, 32, 8, 8).requires_grad_()
    r = channels_last(16, 32, 8, 8).requires_grad_() if residual else None
    w = torch.randn(32, device="cuda", requires_grad=True)
    b = torch.randn(32, device="cuda", requires_grad=True)
    rm, rv = torch.zeros(32, device="cuda"), torch.ones(32, device="cuda")
    y = _BatchNormAct.apply(x, r, w, b, rm, rv, 0.1, 1e-5, act == "gelu")
    g = torch.randn_like(y)
    inputs = [x, w, b] + ([r] if residual else [])
    grads = torch.autograd.grad(y, inputs, g)
    doubles = [t.detach().double().requires_grad_() for t in inputs]
    z = F.batch_norm(doubles[0], None, None, doubles[1], doubles[2], True, 0.1, 1e-5)
    expected = activate(z + doubles[3] if residual else z, act)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(expected, doubles, g.double())):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    var, mean = torch.var_mean(doubles[0].detach(), (0, 2, 3))  # unbiased, as the running var
    torch.testing.assert_close(rm.double(), 0.1 * mean, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rv.double(), 0.9 + 0.1 * var, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_the_fused_operator_is_torchs_batch_norm_and_relu(dtype):
    """Half-precision activations, float32 parameters (a batch norm under autocast): the
    output as torch's native kernels give it, to the storage dtype's rounding, the running
    averages as theirs, and the gradients float64's of the same inputs through the mask of the
    output as stored (a value rounding to the other side of zero flips it)."""
    torch.manual_seed(2)
    x = channels_last(16, 32, 8, 8, dtype=dtype).requires_grad_()
    r = channels_last(16, 32, 8, 8, dtype=dtype).requires_grad_()
    w = torch.randn(32, device="cuda", requires_grad=True)
    b = torch.randn(32, device="cuda", requires_grad=True)
    running = [torch.zeros(32, device="cuda"), torch.ones(32, device="cuda")]
    y = _BatchNormAct.apply(x, r, w, b, *running, 0.1, 1e-5, False)
    assert y.dtype == dtype
    g = channels_last(16, 32, 8, 8, dtype=dtype)
    grads = torch.autograd.grad(y, [x, r, w, b], g)
    expected_running = [torch.zeros(32, device="cuda"), torch.ones(32, device="cuda")]
    with torch.backends.cudnn.flags(enabled=False):  # torch's native kernels, as in the step
        z = F.batch_norm(x.detach(), *expected_running, w.detach(), b.detach(), True, 0.1, 1e-5)
        expected = torch.relu(z + r.detach())
    tol = TOLERANCE[dtype] * 4
    torch.testing.assert_close(y.float(), expected.float(), rtol=tol, atol=tol)
    for got, want in zip(running, expected_running):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    gx, gw, gb, gr = batch_norm_act_grads(x, w, b, r, g, y)
    for got, want in zip(grads, (gx, gr, gw, gb)):
        assert (got.double() - want).abs().max() <= 10 * TOLERANCE[dtype] * want.abs().max()


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
    monkeypatch.setattr(_capture, "FUSE_BATCH_NORM_ACT", fuse)
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


def test_a_step_trains_bit_for_bit_alike_with_its_kernels_launched_early_or_not(monkeypatch,
                                                                                no_tf32):
    trained = []
    for early in (True, False):
        monkeypatch.setattr(_batch_norm_act, "EARLY_LAUNCHES", early)
        torch.manual_seed(0)
        model = Net().cuda().to(memory_format=torch.channels_last)
        opt = make_opt(model.parameters())
        step = nt.Step(model, opt, per_sample, streams="auto", warmup=2)
        for b in channels_last_batches(5):
            step(b)
        assert step.stats()["captured"] and step.stats()["fused_batch_norm_layers"] == FUSED
        trained.append((model, opt))
    (a, opt_a), (b, opt_b) = trained
    assert_same_training(a, opt_a, b, opt_b, rtol=0, atol=0)


def test_layers_with_hooks_run_unfused_and_their_hooks_run_in_the_capture(no_tf32):
    torch.manual_seed(0)
    model = Net().cuda().to(memory_format=torch.channels_last)
    seen = []
    for layer in (model.stem[1], model.left[2]):  # a batch norm, a ReLU module
        layer.register_forward_hook(lambda m, args, out: seen.append(
            (type(m).__name__, torch.cuda.is_current_stream_capturing())))
    step = nt.Step(model, make_opt(model.parameters()), per_sample, streams="auto", warmup=1)
    for b in channels_last_batches(3):
        step(b)
    stats = step.stats()
    assert stats["captured"] and stats["fused_batch_norm_layers"] == FUSED - 2
    assert ("BatchNorm2d", True) in seen and ("ReLU", True) in seen


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


def bf16_run(batches, fuse: bool, step: bool = True, lr_scale: float = 1.0):
    torch.manual_seed(0)
    model = Net().cuda().to(memory_format=torch.channels_last)
    opt = make_opt(model.parameters())
    for group in opt.param_groups:
        group["lr"] *= lr_scale
    if not step:
        eager_loop(model, opt, per_sample, batches, amp=torch.bfloat16)
        return model, opt, None
    saved = _capture.FUSE_BATCH_NORM_ACT
    _capture.FUSE_BATCH_NORM_ACT = fuse
    try:
        s = nt.Step(model, opt, per_sample, streams="auto", amp="bf16", warmup=2)
        for b in batches:
            s(b)
    finally:
        _capture.FUSE_BATCH_NORM_ACT = saved
    return model, opt, s.stats()


def test_under_bf16_a_fused_step_trains_as_close_to_the_eager_loop_as_unfused(no_tf32):
    batches = channels_last_batches(6)
    eager, eager_opt, _ = bf16_run(batches, False, step=False)
    fused, fused_opt, fused_stats = bf16_run(batches, True)
    plain, plain_opt, plain_stats = bf16_run(batches, False)
    assert fused_stats["captured"] and fused_stats["fused_batch_norm_layers"] == FUSED
    assert plain_stats["fused_batch_norm_layers"] == 0
    floor = training_gap(plain, plain_opt, eager, eager_opt)
    gap = training_gap(fused, fused_opt, eager, eager_opt)
    assert gap <= 3 * floor + 1e-6, f"gap to eager {gap:.3g}, unfused {floor:.3g}"
    off, off_opt, _ = bf16_run(batches, False, step=False, lr_scale=1.5)
    assert training_gap(off, off_opt, eager, eager_opt) > 3 * floor + 1e-6


def test_a_chain_runs_its_traced_forward_fused_on_one_stream(no_tf32):
    """airbench's network: a chain (one stream) whose batch norms feed GELUs; its traced
    forward runs fused, and trains as the eager loop."""
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(16, 3, 32, 32, generator=g).cuda()
                .contiguous(memory_format=torch.channels_last),
                torch.randint(0, 10, (16,), generator=g).cuda()) for _ in range(4)]
    torch.manual_seed(0)
    model = airbench_cifar().cuda().to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    step = nt.Step(model, opt, per_sample, streams="auto", warmup=2)
    for b in batches:
        step(b)
    stats = step.stats()
    assert stats["captured"] and stats["streams"] == 1
    assert stats["fused_batch_norm_layers"] == 6
    eager_loop(reference, ref_opt, per_sample, batches)
    assert_same_training(model, opt, reference, ref_opt, rtol=1e-3, atol=1e-4)
