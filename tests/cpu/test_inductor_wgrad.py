"""The pass that splits a compiled backward's convolutions: which calls it rewrites, and the
gradients it leaves (on the CPU the weight gradients run inline, on the current stream)."""

import copy

import torch
import torch._functorch.config
import torch._inductor.config
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from nimble_train._inductor_wgrad import split_compiled_conv_backward, split_conv_backward

aten = torch.ops.aten


def backward_of_two_convolutions(grad, x, w1, w2, b2):
    """Two convolutions' backward as inductor's post-grad graph has them: the first layer's
    input needs no gradient (mask [False, True, False]), the second's does, with a bias."""
    h = aten.convolution(x, w1, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    gh, gw2, gb2 = aten.convolution_backward(grad, h, w2, [w2.shape[0]], [2, 2], [1, 1],
                                             [1, 1], False, [0, 0], 1, [True, True, True])
    _, gw1, _ = aten.convolution_backward(gh, x, w1, None, [1, 1], [1, 1], [1, 1], False,
                                          [0, 0], 1, [False, True, False])
    return gw1, gw2, gb2


def inputs():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    w1 = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    w2 = torch.randn(6, 4, 3, 3, dtype=torch.float64)
    b2 = torch.randn(6, dtype=torch.float64)
    grad = torch.randn(2, 6, 4, 4, dtype=torch.float64)
    return grad, x, w1, w2, b2


def test_only_calls_computing_both_gradients_are_split_and_results_are_unchanged():
    args = inputs()
    gm = make_fx(backward_of_two_convolutions)(*args)
    assert split_conv_backward(gm.graph) == 1
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    masks = [n.args[10] for n in calls if n.target is aten.convolution_backward.default]
    # the split call keeps the data and bias gradients; the other one is as it was
    assert masks == [[True, False, True], [False, True, False]]
    side = [n for n in calls if n.target is torch.ops.nimble_train.side_conv_weight_grad.default]
    join = [n for n in calls if n.target is torch.ops.nimble_train.join_side_streams.default]
    assert len(side) == 1 and len(join) == 1
    grads, held = join[0].args
    assert grads == side and [n.name for n in held] == ["grad_1", "convolution"]  # read by it
    assert list(gm.graph.nodes)[-2] is join[0]  # last before the output
    for got, want in zip(gm(*args), backward_of_two_convolutions(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def backward_of_a_chain(grad, x, w):
    """Three convolutions' backward, each input needing a gradient."""
    for _ in range(3):
        grad, _, _ = aten.convolution_backward(grad, x, w, None, [1, 1], [1, 1], [1, 1], False,
                                               [0, 0], 1, [True, True, False])
    return grad


def chain_args():
    return (torch.randn(2, 4, 6, 6, dtype=torch.float64),
            torch.randn(2, 4, 6, 6, dtype=torch.float64),
            torch.randn(4, 4, 3, 3, dtype=torch.float64))


def test_one_join_before_the_output_waits_for_every_launch():
    args = chain_args()
    gm = make_fx(backward_of_a_chain)(*args)
    assert split_conv_backward(gm.graph) == 3
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    launches = [n for n in calls
                if n.target is torch.ops.nimble_train.side_conv_weight_grad.default]
    joins = [n for n in calls if n.target is torch.ops.nimble_train.join_side_streams.default]
    assert len(launches) == 3 and len(joins) == 1 and list(gm.graph.nodes)[-2] is joins[0]
    grads, held = joins[0].args
    assert grads == launches
    assert set(held) == {t for n in launches for t in n.args[:2]}  # the gradients and inputs
    torch.testing.assert_close(gm(*args), backward_of_a_chain(*args), rtol=0, atol=0)


def test_with_a_lag_each_launch_is_joined_after_the_next_data_gradient():
    args = chain_args()
    gm = make_fx(backward_of_a_chain)(*args)
    assert split_conv_backward(gm.graph, lag=1) == 3
    gm.recompile()
    order = [n for n in gm.graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.nimble_train.side_conv_weight_grad.default,
                              torch.ops.nimble_train.join_side_streams.default)]
    launches = [n for n in order
                if n.target is torch.ops.nimble_train.side_conv_weight_grad.default]
    joins = [n for n in order if n.target is torch.ops.nimble_train.join_side_streams.default]
    mains = [n for n in gm.graph.nodes if n.target is aten.convolution_backward.default]
    assert len(launches) == len(joins) == len(mains) == 3
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for k, join in enumerate(joins):
        grads, held = join.args
        assert grads == [launches[k]]
        if k < 2:  # after the next launch's data gradient, which it reads: no scheduler can
            # move it up to its own launch, where the launching stream would wait at once
            data_grad = next(u for u in mains[k + 1].users if u.args[1] == 0)
            assert data_grad in held
            assert position[join] > position[data_grad] > position[launches[k + 1]]
        else:
            assert list(gm.graph.nodes)[-2] is join  # the last one's, before the output
    torch.testing.assert_close(gm(*args), backward_of_a_chain(*args), rtol=0, atol=0)


def test_a_graph_without_such_calls_is_left_alone():
    gm = make_fx(lambda a, b: (a @ b).relu())(torch.randn(3, 4), torch.randn(4, 5))
    before = str(gm.graph)
    assert split_conv_backward(gm.graph) == 0
    assert str(gm.graph) == before


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.ReLU(),
                                  nn.Conv2d(8, 4, 3, stride=2, padding=1))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def test_a_model_compiled_under_the_pass_has_the_gradients_of_one_compiled_without():
    torch.manual_seed(1)
    model = Net()
    twin = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
    torch._dynamo.reset()
    # compiled here, not served by inductor's caches, so that the pass runs and counts
    no_caches = (torch._inductor.config.patch(fx_graph_cache=False),
                 torch._functorch.config.patch(enable_autograd_cache=False))
    try:
        with no_caches[0], no_caches[1]:
            nn.functional.cross_entropy(torch.compile(twin)(x), y).backward()
            torch._dynamo.reset()
            with split_compiled_conv_backward() as split:
                nn.functional.cross_entropy(torch.compile(model)(x), y).backward()
    finally:
        torch._dynamo.reset()
    assert split.split == 2  # the first convolution's input is the batch
    assert split.launched == 0  # on the CPU they run inline
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)
