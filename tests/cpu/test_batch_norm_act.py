"""Batch norms fused with their ReLU (nimble_train/_batch_norm_act.py, src/ops/batch_norm_act.h)
on the CPU: the reference the CUDA kernel shares its per-element code with, against float64
batch norm + residual + ReLU; the graph rewrite (which chains it fuses, which it leaves, and that
the rewritten forward computes the model's); the stream plan's ordering of a fused layer's
state. The kernel and captured steps run in tests/gpu/test_batch_norm_act_cuda.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nimble_train._batch_norm_act import BatchNormAct, fuse_batch_norm_act
from nimble_train._extension import _C
from nimble_train._multistream import state_edges, trace_operators
from nimble_train.models.airbench import airbench_cifar
from nimble_train.models.branchy import branchy_cifar
from nimble_train.models.resnet_cifar import resnet18_cifar
from step_reference import batch_norm_act_grads, batch_norm_stats_float64, relu_mask_words

TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def channels_last(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).contiguous(
        memory_format=torch.channels_last)


def stats(x, eps=1e-5):
    mean, invstd = batch_norm_stats_float64(x, eps)
    return mean.float(), invstd.float()


# (activation, residual): a residual goes with the ReLU only
ACTS = [("relu", False), ("relu", True), ("gelu", False)]


def activate(z, act):
    return F.gelu(z) if act == "gelu" else torch.relu(z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act, residual", ACTS)
def test_the_reference_is_float64_batch_norm_plus_residual_then_activation(dtype, act,
                                                                          residual):
    x = channels_last(4, 6, 5, 3, dtype=dtype) * 2 + 0.5
    r = channels_last(4, 6, 5, 3, dtype=dtype, seed=1) if residual else None
    w, b = torch.randn(6), torch.randn(6)
    running = [torch.randn(6), torch.rand(6) + 0.5]
    expected_running = [t.double().clone() for t in running]
    gelu = act == "gelu"
    y, mask = _C.batch_norm_relu_forward(x, *stats(x), w, b, r, *running, 0.2, 1e-5, gelu,
                                         not gelu)
    if gelu:
        assert mask is None
    else:  # 360 elements: a last word partly used
        assert mask.dtype == torch.int32
        assert torch.equal(mask.long() & 0xFFFFFFFF, relu_mask_words(y))
    z = F.batch_norm(x.double(), *expected_running, w.double(), b.double(), True, 0.2, 1e-5)
    expected = activate(z + r.double() if residual else z, act)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    scale = expected.abs().max().item()
    assert (y.double() - expected).abs().max().item() <= TOLERANCE[dtype] * scale
    assert (y <= 0).any() and (y > 0).any()
    for got, want in zip(running, expected_running):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act, residual", ACTS)
def test_the_backward_reference_is_autograds_in_float64(dtype, act, residual):
    gelu = act == "gelu"
    x = channels_last(4, 6, 5, 3, dtype=dtype) * 2 + 0.5
    r = channels_last(4, 6, 5, 3, dtype=dtype, seed=1) if residual else None
    w, b = torch.randn(6), torch.randn(6)
    mean, invstd = stats(x)
    y, mask = _C.batch_norm_relu_forward(x, mean, invstd, w, b, r, None, None, 0.1, 1e-5, gelu,
                                         not gelu)
    gy = channels_last(4, 6, 5, 3, dtype=dtype, seed=2).contiguous()  # NCHW: any layout
    grad_x, grad_r, grad_w, grad_b = _C.batch_norm_relu_backward(
        gy, y, x, mean, invstd, w, b, True, residual, gelu)
    if not gelu:  # the mask's bits in the output's place: the same values, bit for bit
        from_mask = _C.batch_norm_relu_backward(gy, None, x, mean, invstd, w, b, True, residual,
                                                gelu, mask)
        for a, e in zip(from_mask, (grad_x, grad_r, grad_w, grad_b)):
            assert (a is None and e is None) or torch.equal(a, e)
    expected = batch_norm_act_grads(x, w, b, r, gy, y, gelu)
    got = [grad_x, grad_w, grad_b] + ([grad_r] if residual else [])
    tol = TOLERANCE[dtype] * 10
    for name, a, e in zip(("x", "weight", "bias", "residual"), got, expected):
        scale = e.abs().max().item()
        assert (a.double() - e).abs().max().item() <= tol * scale, name
    assert grad_x.is_contiguous(memory_format=torch.channels_last) and grad_w.dtype == torch.float32
    assert (grad_r is not None) == residual
    assert _C.batch_norm_relu_backward(gy, y, x, mean, invstd, w, b, False, False)[0] is None
    # early launches are CUDA's (programmatic dependent launch): on the CPU the same values
    late = _C.batch_norm_relu_backward(gy, y, x, mean, invstd, w, b, True, residual, gelu,
                                       early=False)
    for a, b_ in zip(late, (grad_x, grad_r, grad_w, grad_b)):
        assert (a is None and b_ is None) or torch.equal(a, b_)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_statistics_reference_is_float64s(dtype):
    """Sums of x minus the channel's first value: no cancellation with the mean far from 0."""
    x = channels_last(4, 6, 5, 3, dtype=dtype) * 0.5 + 20
    mean, invstd = _C.batch_norm_stats(x, 1e-5)
    want_mean, want_invstd = batch_norm_stats_float64(x)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(invstd.double(), want_invstd, rtol=1e-4, atol=0)
    assert mean.dtype == invstd.dtype == torch.float32


def test_the_statistics_say_what_they_expected():
    x = channels_last(2, 4, 3, 3)
    with pytest.raises(ValueError, match="channels-last contiguous"):
        _C.batch_norm_stats(x.contiguous(), 1e-5)
    with pytest.raises(ValueError, match="x must be a 4-D"):
        _C.batch_norm_stats(x[0], 1e-5)
    with pytest.raises(ValueError, match="no values per channel"):
        _C.batch_norm_stats(channels_last(0, 4, 3, 3), 1e-5)


def test_no_running_averages_leaves_them_out():
    x = channels_last(2, 4, 3, 3)
    w, b = torch.ones(4), torch.zeros(4)
    y, mask = _C.batch_norm_relu_forward(x, *stats(x), w, b, None, None, None, 0.1, 1e-5)
    assert mask is None
    expected = torch.relu(F.batch_norm(x.double(), None, None, None, None, True, 0.1, 1e-5))
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_bad_arguments_say_what_was_expected():
    x = channels_last(2, 4, 3, 3)
    m, s = stats(x)
    w, b = torch.ones(4), torch.zeros(4)
    with pytest.raises(ValueError, match="channels-last contiguous"):
        _C.batch_norm_relu_forward(x.contiguous(), m, s, w, b, None, None, None, 0.1, 1e-5)
    with pytest.raises(ValueError, match=r"weight must be a contiguous float32 \[4\]"):
        _C.batch_norm_relu_forward(x, m, s, torch.ones(5), b, None, None, None, 0.1, 1e-5)
    with pytest.raises(ValueError, match="go together"):
        _C.batch_norm_relu_forward(x, m, s, w, b, None, torch.zeros(4), None, 0.1, 1e-5)
    with pytest.raises(ValueError, match="residual must be channels-last"):
        _C.batch_norm_relu_forward(x, m, s, w, b, x.contiguous(), None, None, 0.1, 1e-5)
    with pytest.raises(ValueError, match="a residual goes with the ReLU only"):
        _C.batch_norm_relu_forward(x, m, s, w, b, x, None, None, 0.1, 1e-5, True)
    with pytest.raises(ValueError, match="more than one value per channel"):
        one = channels_last(1, 4, 1, 1)
        _C.batch_norm_relu_forward(one, m, s, w, b, None, torch.zeros(4), torch.ones(4), 0.1,
                                   1e-5)
    with pytest.raises(ValueError, match="the mask is the ReLU's"):
        _C.batch_norm_relu_forward(x, m, s, w, b, None, None, None, 0.1, 1e-5, True, True)
    y, mask = _C.batch_norm_relu_forward(x, m, s, w, b, None, None, None, 0.1, 1e-5, False, True)
    assert mask.shape == (3,)  # 72 elements
    gy = torch.ones_like(y)
    with pytest.raises(ValueError, match="needs the output y or its mask"):
        _C.batch_norm_relu_backward(gy, None, x, m, s, w, b, True, False)
    with pytest.raises(ValueError, match=r"mask must be the int32 \[3\] tensor"):
        _C.batch_norm_relu_backward(gy, None, x, m, s, w, b, True, False, False, mask[:2])
    with pytest.raises(ValueError, match=r"mask must be the int32 \[3\] tensor"):
        _C.batch_norm_relu_backward(gy, None, x, m, s, w, b, True, False, False, mask.float())


# ---------------------------------------------------------------------- the rewrite

def fused_count(module):
    return sum(isinstance(m, BatchNormAct) for m in module.modules())


@pytest.mark.parametrize("make, fused, removed", [
    (resnet18_cifar, 17, 25),  # 9 batch norm -> ReLU, 8 batch norm -> addition -> ReLU
    (branchy_cifar, 57, 57),   # every conv_bn_relu
    (airbench_cifar, 6, 6),    # each conv group's two batch norm -> GELU
])
def test_the_rewrite_fuses_the_networks_chains_and_computes_the_model(make, fused, removed):
    torch.manual_seed(0)
    model = make()
    twin = copy.deepcopy(model)
    plain, rewritten = trace_operators(model), trace_operators(twin, fuse_norms=True)
    assert fused_count(rewritten.module) == fused
    assert len(plain.nodes) - len(rewritten.nodes) == removed
    x = torch.randn(4, 3, 32, 32)
    # training mode: batch statistics and running averages, as the model's own forward
    torch.testing.assert_close(rewritten.module(x), model(x), rtol=0, atol=0)
    for (name, a), (_, b) in zip(model.named_buffers(), twin.named_buffers()):
        assert torch.equal(a, b), name


class Chains(nn.Module):
    """Chains the rewrite must leave alone, and one it fuses."""

    def __init__(self):
        super().__init__()
        self.bns = nn.ModuleList(nn.BatchNorm2d(4) for _ in range(9))
        self.bns[5].momentum = None  # a cumulative average: torch's forward reads the counter
        self.relu = nn.ReLU()
        self.gelu = nn.GELU()

    def forward(self, x):
        a = self.bns[0](x)
        y = F.relu(a) + a                       # the output read twice
        b = self.bns[1](x)
        x = x + 0
        x += b                                  # the addition writes the residual: not fused
        y = y + F.relu(x)
        c = self.bns[2](x)
        y = y + F.relu(torch.add(c, y, alpha=2))  # alpha
        d = self.bns[3](x)
        y = y + torch.threshold(d, 0.1, 0.0)     # not a ReLU
        e = self.bns[4](x)
        mean = self.bns[4].running_mean          # read between the norm and its ReLU
        y = y + self.relu(e) + mean.view(1, -1, 1, 1)
        y = y + self.relu(self.bns[5](x))        # momentum None
        y = y + F.gelu(self.bns[7](x), approximate="tanh")  # not the exact GELU
        y = y + self.gelu(self.bns[8](x))         # fused
        return y + torch.relu(x + self.bns[6](x))  # fused: the sum's other operand first


def test_the_rewrite_leaves_chains_it_cannot_fuse():
    model = Chains()
    graph = trace_operators(copy.deepcopy(model), fuse_norms=True)
    fused = [m for m in graph.module.modules() if isinstance(m, BatchNormAct)]
    assert sorted((m.layer_name, m.gelu) for m in fused) == [("bns.6", False), ("bns.8", True)]
    x = torch.randn(2, 4, 3, 3)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(graph.module(x), twin(x), rtol=0, atol=0)


class Shared(nn.Module):
    """One batch norm called twice: fused on one branch, not on the other."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        a = torch.relu(self.bn(x))
        b = self.bn(x * 2)
        return a + b * b


def test_a_fused_call_and_a_plain_call_of_one_layer_stay_ordered():
    graph = trace_operators(Shared(), fuse_norms=True)
    calls = [i for i, n in enumerate(graph.nodes) if n.op == "call_module"]
    assert len(calls) == 2 and fused_count(graph.module) == 1
    assert (calls[0], calls[1]) in state_edges(graph, aliasing=False)
