"""The pass that splits a compiled backward's convolutions: which calls it rewrites, and the
gradients it leaves (on the CPU the weight gradients run inline, on the current stream)."""

import copy

import torch
import torch._functorch.config
import torch._inductor.config
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from nimble_train._inductor_wgrad import (_VIEWS_AND_CASTS, split_backward,
                                          split_compiled_backward)

aten = torch.ops.aten
LAUNCH_CONV = torch.ops.nimble_train.side_conv_weight_grad.default
LAUNCH_MM = torch.ops.nimble_train.side_mm.default
JOIN = torch.ops.nimble_train.join_side_streams.default


def calls_to(gm, op) -> list:
    """`gm`'s nodes calling `op`, in the graph's order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


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
    assert split_backward(gm.graph) == 1
    gm.recompile()
    masks = [n.args[10] for n in calls_to(gm, aten.convolution_backward.default)]
    # the split call keeps the data and bias gradients; the other one is as it was
    assert masks == [[True, False, True], [False, True, False]]
    side, join = calls_to(gm, LAUNCH_CONV), calls_to(gm, JOIN)
    assert len(side) == 1 and len(join) == 1
    grads, held = join[0].args
    assert grads == side and [n.name for n in held] == ["grad_1", "convolution", "w2_1"]  # read
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
    assert split_backward(gm.graph) == 3
    gm.recompile()
    launches, joins = calls_to(gm, LAUNCH_CONV), calls_to(gm, JOIN)
    assert len(launches) == 3 and len(joins) == 1 and list(gm.graph.nodes)[-2] is joins[0]
    grads, held = joins[0].args
    assert grads == launches
    assert set(held) == {t for n in launches for t in n.args[:3]}  # gradients, inputs, weights
    torch.testing.assert_close(gm(*args), backward_of_a_chain(*args), rtol=0, atol=0)


def backward_of_two_linear_layers(tangents_1, x, w1, w2):
    """Two linear layers' backward as AOTAutograd's graph has them under bf16 autocast: the
    weight gradients are products cast to float32 that reach the output alone; the data
    gradient of the second feeds the first's."""
    h = aten.mm(x, w1.t())
    gh = aten.mm(tangents_1, w2)  # the data gradient: read by the products below
    gw2 = aten.mm(tangents_1.t(), h)
    gw1 = aten.mm(gh.t(), x)
    return (aten._to_copy(gw1, dtype=torch.float64).t(), aten._to_copy(gw2, dtype=torch.float64))


def test_the_backwards_weight_products_are_launched_and_their_casts_follow_the_join():
    torch.manual_seed(2)
    args = (torch.randn(5, 3, dtype=torch.float32), torch.randn(5, 4), torch.randn(6, 4),
            torch.randn(3, 6))
    gm = make_fx(backward_of_two_linear_layers)(*args)
    assert split_backward(gm.graph, matmuls=False) == 0  # the default: see SPLIT_MATMULS
    assert split_backward(gm.graph, matmuls=True) == 2
    gm.recompile()
    nodes = list(gm.graph.nodes)
    side, plain = calls_to(gm, LAUNCH_MM), calls_to(gm, aten.mm.default)
    (join,) = calls_to(gm, JOIN)
    assert len(side) == 2 and len(plain) == 2  # the forward's product and the data gradient
    assert join.args[0] == side
    # the casts and views of the products run after the join, nothing else does
    after = nodes[nodes.index(join) + 1:-1]
    assert after and all(n.target in _VIEWS_AND_CASTS for n in after)
    reached = set(side)
    for n in after:  # each reads a launch's result, or what one of them made of it
        assert set(n.all_input_nodes) & reached
        reached.add(n)
    for got, want in zip(gm(*args), backward_of_two_linear_layers(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_forward_graphs_products_stay():
    gm = make_fx(lambda x, w: aten.mm(x, w))(torch.randn(3, 4), torch.randn(4, 5))
    assert split_backward(gm.graph, matmuls=True) == 0  # no tangents: not a backward


def test_a_graph_without_such_calls_is_left_alone():
    gm = make_fx(lambda a, b: (a @ b).relu())(torch.randn(3, 4), torch.randn(4, 5))
    before = str(gm.graph)
    assert split_backward(gm.graph) == 0
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
            with split_compiled_backward() as split:
                nn.functional.cross_entropy(torch.compile(model)(x), y).backward()
    finally:
        torch._dynamo.reset()
    assert split.split == 2  # the first convolution's input is the batch
    assert split.launched == 0  # on the CPU they run inline
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)
