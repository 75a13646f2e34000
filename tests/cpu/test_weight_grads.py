"""Which layers the backward plan moves to a side stream, and when Step plans none (CPU)."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import prune
from torch.utils._python_dispatch import TorchDispatchMode

from nimble_train import _weight_grads
from nimble_train._weight_grads import (SideStream, _conv_padding, eligible, plan_weight_grads,
                                        weight_grads_first)
from step_reference import UsesALayerTwice


def test_convolutions_and_linear_layers_are_eligible_unless_autograd_must_see_them():
    assert eligible(nn.Linear(4, 3)) and eligible(nn.Linear(4, 3, bias=False))
    assert eligible(nn.Conv2d(3, 8, 3, padding=1)) and eligible(nn.Conv1d(3, 8, 5))
    assert eligible(nn.Conv3d(3, 8, 3, stride=2, padding="valid"))
    assert not eligible(nn.BatchNorm2d(3)) and not eligible(nn.Embedding(5, 3))
    assert not eligible(nn.ConvTranspose2d(3, 3, 3))
    frozen = nn.Linear(4, 3)
    frozen.bias.requires_grad_(False)
    assert not eligible(frozen)  # one half of autograd's work would be lost
    hooked = nn.Linear(4, 3)
    hooked.weight.register_hook(lambda g: g)
    assert not eligible(hooked)

    class MyLinear(nn.Linear):  # a subclass may change forward: left alone
        pass
    assert not eligible(MyLinear(4, 3))
    # A weight computed by a forward pre-hook from parameters of other names: its gradient
    # must reach them through autograd.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations'
        assert not eligible(nn.utils.weight_norm(nn.Linear(4, 3)))
    assert not eligible(nn.utils.spectral_norm(nn.Conv2d(3, 8, 3)))
    pruned = nn.Linear(4, 3)
    prune.l1_unstructured(pruned, "weight", amount=0.5)
    assert not eligible(pruned)
    pruned = nn.Conv2d(3, 8, 3)
    prune.random_unstructured(pruned, "bias", amount=0.5)
    assert not eligible(pruned)
    assert not eligible(nn.utils.parametrizations.weight_norm(nn.Linear(4, 3)))


@pytest.mark.parametrize("kwargs, expected", [
    (dict(kernel_size=3, padding=1), [1, 1]),
    (dict(kernel_size=(3, 5), padding="same"), [1, 2]),
    (dict(kernel_size=3, padding="same", dilation=3), [3, 3]),
    (dict(kernel_size=4, padding="valid"), [0, 0]),
    (dict(kernel_size=2, padding="same"), None),        # one more row on one side
    (dict(kernel_size=3, padding=1, padding_mode="circular"), None),
])
def test_padding_for_the_aten_convolution(kwargs, expected):
    conv = nn.Conv2d(2, 2, **kwargs)
    assert _conv_padding(conv) == expected
    if expected is not None:  # the same output as the module's own padding
        x = torch.randn(1, 2, 9, 9, dtype=torch.float64)
        conv = conv.double()
        ref = conv(x)
        got = torch.ops.aten.convolution(x, conv.weight, conv.bias, list(conv.stride), expected,
                                         list(conv.dilation), False, [0, 0], conv.groups)
        torch.testing.assert_close(got, ref)


def test_the_plan_says_why_it_splits_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    cpu = torch.device("cpu")
    assert plan_weight_grads(model, 1, cpu) == (None, "streams=1")
    side, why = plan_weight_grads(nn.Sequential(nn.ReLU(), nn.BatchNorm1d(4)), "auto", cpu)
    assert side is None and "no convolution or linear layer" in why
    in_place = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    in_place.compile()
    for compiled in (torch.compile(model), in_place, nn.Sequential(in_place)):
        side, why = plan_weight_grads(compiled, "auto", cpu)
        assert side is None and "whose backward inductor plans" in why


def test_the_plan_joins_its_side_streams_when_the_backward_ends_unless_told_a_lag(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    cpu = torch.device("cpu")
    side, why = plan_weight_grads(model, "auto", cpu)
    assert why is None and side.lag is None  # Step's default: no bound
    monkeypatch.setattr(_weight_grads, "LAG", 2)
    assert plan_weight_grads(model, "auto", cpu)[0].lag == 2
    for bad in (0, -1):
        with pytest.raises(ValueError, match="the lag must be >= 1 launch, or None"):
            SideStream(cpu, lag=bad)


def test_weight_gradients_fork_before_the_data_gradient_in_a_chain(monkeypatch):
    # None: no forward plan (a chain, or a model torch.fx cannot trace); else the share of the
    # split layers on the launching stream.
    assert weight_grads_first(None) and weight_grads_first(1.0) and weight_grads_first(0.5)
    assert not weight_grads_first(0.49) and not weight_grads_first(0.0)
    assert SideStream(torch.device("cpu")).first is False  # until a plan says
    monkeypatch.setattr(_weight_grads, "WEIGHT_GRADS_FIRST", False)
    assert not weight_grads_first(None)
    monkeypatch.setattr(_weight_grads, "WEIGHT_GRADS_FIRST", True)
    assert weight_grads_first(0.0)
    monkeypatch.setattr(_weight_grads, "WEIGHT_GRADS_FIRST", "yes")
    with pytest.raises(ValueError, match="WEIGHT_GRADS_FIRST must be 'auto', True or False; "
                                         "got 'yes'"):
        weight_grads_first(None)


def test_data_parallel_splits_the_layers_that_alone_use_their_parameters_once():
    # The side stream reports a split layer's gradients to the buckets in place of autograd's
    # accumulation hook, once per backward: a layer called twice (or a weight tied elsewhere)
    # would be reported before its last gradient arrived.
    import torch.distributed as dist

    from nimble_train._gradsync import GradientSync
    from nimble_train.distributed import World
    from nimble_train.optim import FusedOptimizer

    torch.manual_seed(0)
    net = UsesALayerTwice()
    sync = GradientSync(World(0, 1, dist.HashStore(), prefix="w"), torch.device("cpu"), 1e-4)
    with sync.observing(list(net.parameters())) as count_uses:
        loss = net(torch.randn(4, 6)).sum()
        count_uses(loss)
        loss.backward()
    sync.use_buckets(FusedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1)))
    assert eligible(net.a, sync) and eligible(net.head, sync)
    assert not eligible(net.b, sync)
    assert not eligible(net.a)  # one process: hooks on the parameters are the user's
    user_hook = net.head.weight.register_post_accumulate_grad_hook(lambda p: None)
    assert not eligible(net.head, sync)
    user_hook.remove()
    side, why = plan_weight_grads(nn.Sequential(net.b), "auto", torch.device("cpu"),
                                  gradients=sync)
    assert side is None and "data parallel: only layers that alone use their parameters" in why


def test_only_the_steps_own_backward_without_a_graph_of_itself_splits():
    assert not _weight_grads.splits()  # a forward's torch.autograd.grad, a user's backward
    with torch.no_grad():  # as a backward runs its nodes
        assert not _weight_grads.splits()
        with _weight_grads.steps_backward():
            assert _weight_grads.splits()
            with _weight_grads.steps_backward():  # a reentrant checkpoint's inner backward
                assert _weight_grads.splits()
            assert _weight_grads.splits()
            with torch.enable_grad():  # create_graph: autograd must see the gradients
                assert not _weight_grads.splits()
        assert not _weight_grads.splits()
    with pytest.raises(RuntimeError, match="fails"):
        with _weight_grads.steps_backward():
            raise RuntimeError("the backward fails")
    with torch.no_grad():
        assert not _weight_grads.splits()  # left as it was


class _Ops(TorchDispatchMode):
    """The aten operators run inside the block (a backward's too), convolution_backward with
    its output mask."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops.append((name, tuple(args[-1])) if name == "convolution_backward" else name)
        return func(*args, **(kwargs or {}))


_ASKS = {  # a backward other than the step's own, and the gradients it asks for
    "backward": (lambda loss, x, m: loss.backward(), ("x", "weight", "bias")),
    "grad of the input": (lambda loss, x, m: torch.autograd.grad(loss, x), ("x",)),
    "grad of the weight": (lambda loss, x, m: torch.autograd.grad(loss, m.weight), ("weight",)),
    "backward into the bias": (lambda loss, x, m: loss.backward(inputs=[m.bias]), ("bias",)),
    "grad of the input and weight": (
        lambda loss, x, m: torch.autograd.grad(loss, [x, m.weight]), ("x", "weight")),
}


@pytest.mark.parametrize("asks", list(_ASKS))
@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_a_backward_not_the_steps_gets_the_gradients_it_asks_for_and_computes_no_others(
        kind, asks):
    """Outside the step's own backward a split layer gives autograd its gradients, as torch's
    layers do, and, as they do, computes only those the backward asks for: an adversarial
    example's torch.autograd.grad(loss, x) runs no weight gradient (they were computed and
    thrown away, as much work again as the data gradient). The gradients against torch's own
    layers in float64."""
    torch.manual_seed(3)
    ask, asked = _ASKS[asks]
    if kind == "conv":
        m = nn.Conv2d(3, 4, 3, padding=1).double()
        x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
        split = lambda: _weight_grads._Conv.apply(x, m.weight, m.bias, m, None, [1, 1], [1, 1],
                                                  [1, 1], 1)
    else:
        m = nn.Linear(3, 4).double()
        x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
        split = lambda: _weight_grads._Linear.apply(x, m.weight, m.bias, m, None)
    target = torch.randn(m(x).shape, dtype=torch.float64)

    def run(forward):
        x.grad = m.weight.grad = m.bias.grad = None
        loss = (forward() * target).sum()
        with _Ops() as seen:
            got = ask(loss, x, m)
        grads = dict(zip(asked, got)) if got is not None else {
            n: t.grad for n, t in (("x", x), ("weight", m.weight), ("bias", m.bias))
            if t.grad is not None}
        return grads, seen.ops

    want, torch_ops = run(lambda: m(x))
    got, ops = run(split)
    assert set(got) == set(want) == set(asked)
    for name in asked:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)
    if kind == "conv":  # the output mask torch's convolution asks for
        assert ([op for op in ops if op[0] == "convolution_backward"]
                == [op for op in torch_ops if op[0] == "convolution_backward"]
                == [("convolution_backward", tuple(n in asked for n in ("x", "weight", "bias")))])
    else:  # a product per gradient of x or the weight, a sum for the bias
        assert ops.count("mm") == ("x" in asked) + ("weight" in asked)
        assert ops.count("sum") == ("bias" in asked)
