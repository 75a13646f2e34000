"""The CPU reference of the stem's kernels (src/ops/small_conv.h, through
nimble_train/_small_conv.py) against torch's convolution in float64, and which layers a capture
gives them."""

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nimble_train import _small_conv

# (N, C, H, W, out channels, kernel, stride, padding, dilation, bias, channels-last weight)
CASES = [
    (4, 3, 9, 11, 8, 3, 1, 1, 1, False, True),
    (2, 3, 12, 12, 5, 2, 2, 0, 1, True, False),
    (3, 2, 15, 10, 6, (3, 2), (2, 1), (1, 2), (2, 1), True, True),
    (2, 1, 8, 8, 4, 5, 2, 2, 1, False, False),
    (2, 4, 5, 6, 3, 1, 1, 0, 1, True, True),
]


@pytest.mark.parametrize("channels_last_input", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_the_product_and_its_weight_gradients_are_the_convolution_s(case, channels_last_input):
    n, c, h, w, out, kernel, stride, padding, dilation, bias, cl_weight = case
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=g)
    if channels_last_input:
        x = x.contiguous(memory_format=torch.channels_last)
    conv = nn.Conv2d(c, out, kernel, stride, padding, dilation, bias=bias)
    if cl_weight:
        conv = conv.to(memory_format=torch.channels_last)
    c64 = copy.deepcopy(conv).double()
    ref = c64(x.double())
    grad_y = torch.randn(ref.shape, generator=g)
    ref.backward(grad_y.double())
    ref_w = c64.weight.grad
    ref_b = c64.bias.grad if bias else None

    y = _small_conv.conv2d(x, conv.weight, conv.bias, stride, padding, dilation)
    assert y.shape == ref.shape and y.is_contiguous(memory_format=torch.channels_last)
    y.backward(grad_y)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv.weight.grad.double(), ref_w, rtol=1e-5, atol=1e-4)
    layout = torch.channels_last if cl_weight else torch.contiguous_format
    assert conv.weight.grad.is_contiguous(memory_format=layout)  # the weight's own layout
    if bias:
        torch.testing.assert_close(conv.bias.grad.double(), ref_b, rtol=1e-5, atol=1e-4)


def test_no_input_gradient_is_computed_so_an_input_that_needs_one_is_refused():
    conv = nn.Conv2d(3, 4, 3)
    x = torch.randn(1, 3, 6, 6, requires_grad=True)
    with pytest.raises(ValueError, match="requires one"):
        _small_conv.conv2d(x, conv.weight, conv.bias)


@pytest.mark.parametrize("x, weight, bias, match", [
    (torch.randn(1, 3, 2, 2), torch.randn(4, 3, 3, 3), None, "smaller than the kernel"),
    (torch.randn(1, 3, 8, 8), torch.randn(4, 2, 3, 3), None, "x's 3 channels"),
    (torch.randn(1, 4, 8, 8), torch.randn(4, 4, 3, 3), None, "at most 32 input channels"),
    (torch.randn(1, 3, 8, 8), torch.randn(300, 3, 1, 1), None, "at most 256 output"),
    (torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3).double(), None, "the weight must be x's"),
    (torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(5), "the bias must be [4]"),
    (torch.randn(1, 3, 8, 8).long(), torch.randn(4, 3, 3, 3), None, "float32, float16"),
], ids=["kernel", "channels", "columns", "out-channels", "weight-dtype", "bias", "dtype"])
def test_what_the_kernels_refuse_is_said(x, weight, bias, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        _small_conv.conv2d(x, weight, bias)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.gray = nn.Conv2d(1, 8, 3, padding="same")
        self.wide = nn.Conv2d(8, 8, 3, padding=1)            # too many input channels
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.reflect = nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect")
        self.even_same = nn.Conv2d(3, 8, 2, padding="same")  # pads one side more
        self.conv1d = nn.Conv1d(3, 8, 3)

    def forward(self, x):
        return self.stem(x)


def test_candidates_are_plain_conv2d_layers_of_few_input_channels():
    net = Net()
    assert _small_conv.candidates(net) == [net.stem, net.gray]
    net.gray.forward = lambda x: x  # a forward of the user's own is left alone
    assert _small_conv.candidates(net) == [net.stem]


def test_the_layers_get_their_forward_back_whatever_happens():
    net = Net()
    with pytest.raises(RuntimeError, match="failed"):
        with _small_conv.small_convs(net) as layers:
            assert layers == 2 and "forward" in vars(net.stem)
            # On the CPU the layer runs torch's convolution: the product is for CUDA inputs.
            x = torch.randn(2, 3, 6, 6)
            torch.testing.assert_close(net(x), F.conv2d(x, net.stem.weight, net.stem.bias,
                                                        padding=1))
            raise RuntimeError("the capture failed")
    assert "forward" not in vars(net.stem) and "forward" not in vars(net.gray)
