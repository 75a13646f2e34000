"""nimble_train's max-pooling kernels against torch's CUDA kernels for channels-last inputs,
bit for bit, and in captured steps."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nimble_train as nt
from nimble_train import _capture, _max_pool
from nimble_train.models.branchy import branchy_cifar

pytestmark = [pytest.mark.cuda]

# (N, C, H, W, kernel, stride, padding, ceil_mode). Channel counts: multiples of 8 take the
# 16-byte packs in every dtype; 4 and 12 in float32 only; 5 and 6 one channel at a time.
CASES = [
    (4, 64, 16, 16, 3, 1, 1, False),
    (4, 128, 16, 16, 3, 2, 1, False),
    (2, 8, 15, 15, 3, 2, 0, True),
    (3, 12, 9, 7, (3, 2), (2, 1), (1, 0), True),
    (2, 5, 9, 9, 3, 1, 1, False),
    (2, 6, 8, 8, 2, 2, 0, False),
    (2, 4, 12, 12, 5, 1, 2, False),
    (1, 16, 14, 14, (2, 4), 3, (1, 2), True),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


def both(x, kernel, stride, padding, ceil_mode, seed=1):
    xa = x.detach().clone().requires_grad_(True)
    xb = x.detach().clone().requires_grad_(True)
    ya = _max_pool.max_pool2d(xa, kernel, stride, padding, ceil_mode)
    yb = F.max_pool2d(xb, kernel, stride, padding, ceil_mode=ceil_mode)
    g = torch.randn(yb.shape, generator=torch.Generator().manual_seed(seed)).to(x)
    ya.backward(channels_last(g))
    yb.backward(channels_last(g))
    return (ya, xa.grad), (yb, xb.grad)


def assert_bitwise(a, b):
    """Same layout and the same bits (NaNs included)."""
    assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.view(as_int), b.view(as_int))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_bit_for_bit_torchs_kernels_on_random_data(case, dtype):
    n, c, h, w, kernel, stride, padding, ceil_mode = case
    x = channels_last(torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(0))
                      .to("cuda", dtype))
    (ya, ga), (yb, gb) = both(x, kernel, stride, padding, ceil_mode)
    assert_bitwise(ya, yb)
    assert_bitwise(ga, gb)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES[:4])
def test_ties_nan_and_windows_of_minus_infinity_as_torchs_kernels(case, dtype):
    n, c, h, w, kernel, stride, padding, ceil_mode = case
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 3, (n, c, h, w), generator=g).float()
    x[torch.rand(x.shape, generator=g) < 0.02] = float("nan")
    # whole rows and columns of -inf: some windows see nothing else
    x[:, : c // 2, : h // 2, :] = float("-inf")
    x[:, :, :, : w // 3] = float("-inf")
    x = channels_last(x.to("cuda", dtype))
    (ya, ga), (yb, gb) = both(x, kernel, stride, padding, ceil_mode)
    assert ya.isnan().any() and ya.isneginf().any()
    assert_bitwise(ya, yb)
    assert_bitwise(ga, gb)


def test_unaligned_tensors_take_the_one_channel_path():
    buffer = torch.randn(1 + 4 * 9 * 9 * 64, device="cuda")
    x = buffer[1:].view(4, 9, 9, 64).permute(0, 3, 1, 2)  # channels-last, 4 bytes off 16
    assert x.is_contiguous(memory_format=torch.channels_last) and x.data_ptr() % 16 == 4
    (ya, ga), (yb, gb) = both(x, 3, 2, 1, False)
    assert_bitwise(ya, yb)
    assert_bitwise(ga, gb)


def test_captured_in_a_cuda_graph():
    x = channels_last(torch.randn(8, 32, 16, 16, device="cuda")).requires_grad_(True)
    g = channels_last(torch.randn(8, 32, 8, 8, device="cuda"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _max_pool.max_pool2d(x, 3, 2, 1).backward(g)
    torch.cuda.current_stream().wait_stream(stream)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _max_pool.max_pool2d(x, 3, 2, 1)
        y.backward(g)
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
        graph.replay()  # rewrites y and x.grad (autograd made it in the graph's pool)
        torch.cuda.synchronize()
        ref = x.detach().clone().requires_grad_(True)
        F.max_pool2d(ref, 3, 2, 1).backward(g)
        assert torch.equal(y, F.max_pool2d(x.detach(), 3, 2, 1))
        assert torch.equal(x.grad, ref.grad)


def test_the_backward_cannot_be_differentiated_and_says_so():
    x = channels_last(torch.randn(2, 8, 6, 6, device="cuda")).requires_grad_(True)
    y = _max_pool.max_pool2d(x, 2)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|_MaxPool2d"):
        gx.sum().backward()


@pytest.mark.parametrize("streams", [1, "auto"])
def test_a_step_runs_our_kernels_and_trains_bit_for_bit_as_with_torchs(streams,
                                                                       deterministic_cudnn):
    torch.manual_seed(0)
    model = branchy_cifar(width=0.25).cuda().to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(1)
    batches = [(channels_last(torch.randn(8, 3, 32, 32, generator=g)).cuda(),
                torch.randint(0, 10, (8,), generator=g).cuda()) for _ in range(6)]
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    runs = []
    for kernels in ("ours", "torch"):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        saved = _capture.MAX_POOL_KERNELS
        _capture.MAX_POOL_KERNELS = kernels
        try:
            step = nt.Step(m, opt, loss_fn, streams=streams, warmup=2)
            losses = torch.stack([step(b).clone() for b in batches])
        finally:
            _capture.MAX_POOL_KERNELS = saved
        stats = step.stats()
        assert stats["captured"]
        runs.append((m, losses, stats["max_pool_layers"]))
    (ours, ours_losses, ours_layers), (theirs, theirs_losses, theirs_layers) = runs
    assert ours_layers == 10 and theirs_layers == 0  # 8 cells' pool branches, 2 between stages
    assert torch.equal(ours_losses, theirs_losses)
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()):
        assert torch.equal(a, b)
    assert "forward" not in vars(ours.features[1].branch_pool[0])  # restored after capture
