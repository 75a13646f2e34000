"""nimble_train's max-pooling (src/ops/max_pool.h) on the CPU: the reference its CUDA kernels
share their per-element code with, against torch's max_pool2d, and the switch that puts it in
captured steps (the kernels themselves run in tests/gpu/test_max_pool_cuda.py)."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nimble_train import _max_pool
from nimble_train._extension import _C

# (N, C, H, W, kernel, stride, padding, ceil_mode): square and not, overlapping windows
# (stride < kernel), padding, ceil_mode windows that hang over the edge.
CASES = [
    (2, 5, 9, 9, 3, 1, 1, False),
    (2, 8, 9, 7, 3, 2, 1, False),
    (1, 3, 10, 11, 3, 2, 0, True),
    (2, 4, 8, 8, 2, 2, 0, False),
    (1, 6, 7, 9, (3, 2), (2, 1), (1, 0), True),
    (3, 2, 5, 5, 5, 1, 2, False),
    (1, 16, 6, 6, 1, 1, 0, False),
    (2, 3, 12, 12, (2, 4), 3, (1, 2), True),
]


def channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


def both(x, kernel, stride, padding, ceil_mode, grad_seed=1):
    """(ours, torch's) outputs and input gradients for the same input and output gradient."""
    xa = x.detach().clone().requires_grad_(True)
    xb = x.detach().clone().requires_grad_(True)
    ya = _max_pool.max_pool2d(xa, kernel, stride, padding, ceil_mode)
    yb = F.max_pool2d(xb, kernel, stride, padding, ceil_mode=ceil_mode)
    g = torch.randn(yb.shape, generator=torch.Generator().manual_seed(grad_seed)).to(x.dtype)
    ya.backward(channels_last(g))
    yb.backward(channels_last(g))
    return (ya, xa.grad), (yb, xb.grad)


@pytest.mark.parametrize("case", CASES)
def test_outputs_and_gradients_equal_torch_on_random_data(case):
    n, c, h, w, kernel, stride, padding, ceil_mode = case
    x = channels_last(torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(0)))
    (ya, ga), (yb, gb) = both(x, kernel, stride, padding, ceil_mode)
    assert ya.shape == yb.shape
    assert ya.is_contiguous(memory_format=torch.channels_last)
    assert ga.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(ya, yb)
    assert torch.equal(ga, gb)  # float32 sums in the same order: the same bits


@pytest.mark.parametrize("case", CASES)
def test_ties_go_to_the_first_largest_value_as_in_torch(case):
    n, c, h, w, kernel, stride, padding, ceil_mode = case
    # Three values only: most windows hold several maxima.
    x = channels_last(torch.randint(0, 3, (n, c, h, w),
                                    generator=torch.Generator().manual_seed(2)).float())
    (ya, ga), (yb, gb) = both(x, kernel, stride, padding, ceil_mode)
    assert torch.equal(ya, yb)
    assert torch.equal(ga, gb)


def test_nan_wins_and_the_last_nan_of_a_window_takes_the_gradient():
    torch.manual_seed(3)
    x = torch.randn(2, 4, 8, 8)
    x[0, 1, 2, 3] = float("nan")
    x[0, 1, 2, 4] = float("nan")
    x[1, 2, 5, 5] = float("nan")
    x = channels_last(x)
    (ya, ga), (yb, gb) = both(x, 3, 2, 1, False)
    assert torch.equal(ya.isnan(), yb.isnan()) and ya.isnan().any()
    assert torch.equal(ya.nan_to_num(), yb.nan_to_num())
    assert torch.equal(ga, gb)


def test_a_window_of_only_minus_infinity_gives_its_gradient_to_element_0_0_if_it_covers_it():
    # The rule of torch's CUDA kernel for channels-last inputs (its index starts at 0); the CPU
    # kernel starts at the window's first element instead, so this is checked by hand here and
    # against torch's CUDA kernel in tests/gpu.
    x = torch.full((1, 1, 4, 4), float("-inf"))
    x[0, 0, 3, 3] = 1.0
    x = channels_last(x.expand(1, 2, 4, 4).clone())
    x.requires_grad_(True)
    y = _max_pool.max_pool2d(x, 2, 2)
    assert torch.equal(y[0, :, 1, 1], torch.ones(2))
    assert y[0, :, 0, 0].eq(float("-inf")).all()
    g = channels_last(torch.arange(1.0, 9.0).reshape(1, 2, 2, 2))
    y.backward(g)
    expected = torch.zeros(1, 2, 4, 4)
    expected[0, :, 0, 0] = g[0, :, 0, 0]  # the window over (0, 0)
    expected[0, :, 3, 3] = g[0, :, 1, 1]  # the window with a maximum
    # windows (0, 1) and (1, 0): only -inf and not covering (0, 0): no element gets theirs
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_keep_the_values_and_sum_gradients_in_float32(dtype):
    torch.manual_seed(4)
    x = channels_last(torch.randn(2, 8, 9, 9).to(dtype)).requires_grad_(True)
    y = _max_pool.max_pool2d(x, 3, 1, 1)
    x32 = x.detach().float().requires_grad_(True)
    y32 = _max_pool.max_pool2d(x32, 3, 1, 1)
    assert y.dtype == dtype and torch.equal(y.float(), y32)
    g = channels_last(torch.randn(y.shape)).to(dtype)
    y.backward(g)
    y32.backward(g.float())
    assert x.grad.dtype == dtype
    # the float32 sum, rounded once
    assert torch.equal(x.grad, x32.grad.to(dtype))


def test_output_sizes_equal_torch_over_a_sweep():
    for size, kernel, stride, ceil_mode in itertools.product(range(1, 12), (1, 2, 3, 4),
                                                             (1, 2, 3), (False, True)):
        for padding in range(kernel // 2 + 1):
            x = torch.zeros(1, 1, size, size + 1)
            try:
                expected = F.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode).shape
            except RuntimeError:
                with pytest.raises(ValueError, match="output would be empty"):
                    _C.max_pool2d_forward(channels_last(x.expand(1, 2, -1, -1)),
                                          [kernel] * 2, [stride] * 2, [padding] * 2, ceil_mode)
                continue
            y, argmax = _C.max_pool2d_forward(channels_last(x.expand(1, 2, -1, -1)),
                                              [kernel] * 2, [stride] * 2, [padding] * 2,
                                              ceil_mode)
            assert y.shape[2:] == expected[2:], (size, kernel, stride, padding, ceil_mode)
            assert argmax.shape == y.shape and argmax.dtype == torch.uint8


def test_bad_input_is_refused_with_what_was_expected():
    x = channels_last(torch.randn(1, 4, 6, 6))
    with pytest.raises(ValueError, match="channels-last contiguous.*memory_format"):
        _C.max_pool2d_forward(torch.randn(1, 4, 6, 6), [2, 2], [2, 2], [0, 0], False)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        _C.max_pool2d_forward(x.double(), [2, 2], [2, 2], [0, 0], False)
    with pytest.raises(ValueError, match=r"padding must be in \[0, kernel / 2\]"):
        _C.max_pool2d_forward(x, [2, 2], [2, 2], [2, 2], False)
    with pytest.raises(ValueError, match="at most 255 positions"):
        _C.max_pool2d_forward(channels_last(torch.randn(1, 1, 20, 20).expand(1, 2, -1, -1)),
                              [16, 16], [1, 1], [0, 0], False)
    with pytest.raises(ValueError, match="4-D"):
        _C.max_pool2d_forward(torch.randn(4, 6, 6), [2, 2], [2, 2], [0, 0], False)
    with pytest.raises(ValueError, match="a pair"):
        _C.max_pool2d_forward(x, [2], [2, 2], [0, 0], False)
    y, argmax = _C.max_pool2d_forward(x, [2, 2], [2, 2], [0, 0], False)
    with pytest.raises(ValueError, match="grad_y must have the output's sizes"):
        _C.max_pool2d_backward(torch.randn(1, 4, 2, 2), argmax, [1, 4, 6, 6], [2, 2], [2, 2],
                               [0, 0], False)
    with pytest.raises(ValueError, match="argmax must be the forward's"):
        _C.max_pool2d_backward(torch.randn_like(y), argmax.float(), [1, 4, 6, 6], [2, 2],
                               [2, 2], [0, 0], False)
    # any layout of the output gradient is taken
    grad = _C.max_pool2d_backward(torch.ones(1, 4, 3, 3), argmax, [1, 4, 6, 6], [2, 2], [2, 2],
                                  [0, 0], False)
    assert grad.sum().item() == 36


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = nn.MaxPool2d(3, stride=1, padding=1)
        self.ceil = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.dilated = nn.MaxPool2d(3, dilation=2)
        self.indices = nn.MaxPool2d(2, return_indices=True)
        self.own = nn.MaxPool2d(2)
        self.own.forward = lambda x: x  # a forward of the user's own: left alone

    def forward(self, x):
        return self.ceil(self.plain(x))


def test_the_switch_wraps_plain_max_pools_and_restores_them_whatever_happens():
    net = Pools()
    assert _max_pool.candidates(net) == [net.plain, net.ceil]
    x = channels_last(torch.randn(2, 4, 9, 9))
    reference = net(x)
    with _max_pool.our_max_pool(net) as layers:
        assert layers == 2
        assert "forward" in vars(net.plain) and "forward" in vars(net.ceil)
        # CPU input: not taken, torch's forward runs
        assert not _max_pool.takes(x)
        assert torch.equal(net(x), reference)
    assert "forward" not in vars(net.plain) and "forward" not in vars(net.ceil)
    assert "forward" in vars(net.own)
    with pytest.raises(RuntimeError, match="boom"):
        with _max_pool.our_max_pool(net):
            raise RuntimeError("boom")
    assert "forward" not in vars(net.plain) and "forward" not in vars(net.ceil)


def test_which_inputs_the_kernels_take():
    x = channels_last(torch.randn(2, 4, 6, 6))
    assert not _max_pool.takes(x)  # CPU
    meta = torch.empty(2, 4, 6, 6, device="meta").contiguous(memory_format=torch.channels_last)
    assert not _max_pool.takes(meta)
    assert not _max_pool.takes(torch.randn(4, 6, 6))
    assert not _max_pool.takes(None)
