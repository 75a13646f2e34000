"""The pass that makes a compiled backward's weight products where the update reads them:
which products it rewrites, what the operator computes, how a Step learns whose gradient each
product is, and that a product written into the wrong parameter's view cannot go unnoticed
(on the CPU the products are computed as the graph had them: a product, then its cast)."""

import copy

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from nimble_train import _torch_private
from nimble_train._inductor_grads import (_KEY_BITS, WeightProducts, _backward,
                                          rewrite_weight_products, weight_grad_mm)
from nimble_train._iteration import (MisdirectedGradient, hand_grads_to_autograd,
                                     take_back_grads)

aten = torch.ops.aten
prims = torch.ops.prims
PRODUCT = torch.ops.nimble_train.weight_grad_mm.default


def calls_to(gm, op) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def backward_of_three_layers(tangents_1, x, w1, w2, w3, e):
    """Three linear layers' backward as AOTAutograd's graph has them under autocast: weight
    gradients are half-precision products cast to float32 that reach the output alone, except
    the last layer's, whose weight is tied to an embedding (its product's cast is summed with
    the embedding's gradient); the data gradients feed the layers before."""
    g = tangents_1.to(torch.bfloat16)
    h1 = aten.mm(x, w1.t())
    h2 = aten.mm(h1, w2.t())
    gh2 = aten.mm(g, w3)  # a data gradient: read by the products below
    gw3 = prims.convert_element_type(aten.mm(g.t(), h2), torch.float32)
    gh1 = aten.mm(gh2, w2)
    gw2 = prims.convert_element_type(aten.mm(gh2.t(), h1), torch.float32)
    gw1 = prims.convert_element_type(aten.mm(gh1.t(), x), torch.float32)
    return gw1, gw2, gw3 + e


def three_layer_args():
    g = torch.Generator().manual_seed(3)
    bf16 = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    return (torch.randn(5, 3, generator=g), bf16(5, 4), bf16(6, 4), bf16(7, 6), bf16(3, 7),
            torch.randn(3, 7, generator=g))


def test_products_reaching_the_output_alone_or_through_a_cast_are_rewritten():
    args = three_layer_args()
    gm = make_fx(backward_of_three_layers)(*args)
    assert rewrite_weight_products(gm.graph) == 2  # gw1, gw2; gw3's cast is summed after
    gm.recompile()
    products = calls_to(gm, PRODUCT)
    assert [n.args[2] for n in products] == [torch.float32, torch.float32]
    assert sorted(n.args[3] & ((1 << _KEY_BITS) - 1) for n in products) == [0, 1]  # places
    assert len({n.args[3] >> _KEY_BITS for n in products}) == 1  # one graph's digest
    assert len(calls_to(gm, aten.mm.default)) == 5  # the forward's two, gh2, gh1, gw3's
    assert len(calls_to(gm, prims.convert_element_type.default)) == 1  # gw3's
    for got, want in zip(gm(*args), backward_of_three_layers(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_product_in_the_parameters_dtype_is_rewritten_without_a_cast():
    def backward(tangents_1, x, w):
        return aten.mm(tangents_1.t(), x), aten.mm(tangents_1, w)

    args = (torch.randn(5, 3), torch.randn(5, 4), torch.randn(3, 4))
    gm = make_fx(backward)(*args)
    assert rewrite_weight_products(gm.graph) == 2
    gm.recompile()
    assert [n.args[2] for n in calls_to(gm, PRODUCT)] == [torch.float32] * 2
    for got, want in zip(gm(*args), backward(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_forward_graph_and_products_read_elsewhere_are_left_alone():
    gm = make_fx(lambda x, w: aten.mm(x, w))(torch.randn(3, 4), torch.randn(4, 5))
    assert rewrite_weight_products(gm.graph) == 0  # no tangents: not a backward

    def reused(tangents_1, x):
        p = aten.mm(tangents_1.t(), x)
        return p, p.sum()

    gm = make_fx(reused)(torch.randn(5, 3), torch.randn(5, 4))
    before = str(gm.graph)
    assert rewrite_weight_products(gm.graph) == 0
    assert str(gm.graph) == before


def test_the_operator_writes_into_the_view_it_is_given_once_and_records_what_it_made():
    a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    flat = torch.full((30,), float("nan"), dtype=torch.float64)
    view = flat[3:27].view(6, 4)
    _backward.targets, _backward.made = {7: view}, []
    try:
        into = weight_grad_mm(a, b, torch.float64, 7)
        again = weight_grad_mm(a, b, torch.float64, 7)  # taken once: a new tensor
        other = weight_grad_mm(a, b, torch.float64, 8)
        made = _backward.made
    finally:
        _backward.targets = _backward.made = None
    assert into.data_ptr() == view.data_ptr() and into is not view
    torch.testing.assert_close(view, a @ b, rtol=0, atol=0)
    assert flat[:3].isnan().all() and flat[27:].isnan().all()  # nothing around it written
    torch.testing.assert_close(again, a @ b, rtol=0, atol=0)
    assert made == [(7, again.data_ptr()), (8, other.data_ptr())]


@pytest.mark.parametrize("order", [(1, 2), (2, 1)])
def test_a_gradient_at_an_address_two_products_were_made_at_is_the_last_ones(order):
    """The first product was summed into another gradient and freed, and the allocator gave
    its address to the second, which autograd kept."""
    weights = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    views = [torch.zeros(3, 4) for _ in weights]
    kept, once, twice = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    weights[0].grad, weights[1].grad, weights[2].grad = kept, once, twice
    first, last = order
    made = [(first, kept.data_ptr()), (last, kept.data_ptr()), (3, once.data_ptr()),
            (4, twice.data_ptr()), (4, torch.randn(3, 4).data_ptr())]
    products = WeightProducts()
    products.learn(made, list(zip(weights, views)), weights)
    assert products.owner == {last: 0, 3: 1}  # 4 made two results: it teaches nothing


def test_a_view_of_another_shape_or_dtype_is_not_written():
    a, b = torch.randn(6, 5), torch.randn(5, 4)
    view = torch.zeros(4, 6)
    _backward.targets = {1: view}
    try:
        out = weight_grad_mm(a, b, torch.float32, 1)
    finally:
        _backward.targets = None
    assert out.data_ptr() != view.data_ptr() and view.eq(0).all()


class MLP(nn.Module):
    """Two hidden layers of one shape (their products can be mistaken for each other)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.mid1 = nn.Linear(8, 8)
        self.mid2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.tanh(self.up(x))
        return self.head(torch.tanh(self.mid2(torch.tanh(self.mid1(x)))))


def with_flat_grads(model) -> torch.Tensor:
    """Each parameter's .grad a view into one zeroed flat buffer, as Step keeps them."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


@pytest.fixture
def compiled_under_the_pass():
    """A compiled MLP whose backward the pass rewrote, and an eager twin."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    products = WeightProducts()
    torch._dynamo.reset()
    # compiled here, not served by inductor's caches, so that the pass runs and counts
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), \
            _torch_private.post_grad_pass(products):
        compiled = torch.compile(model)
        compiled(torch.randn(5, 6)).sum().backward()  # the shape the tests use: no recompile
    model.zero_grad(set_to_none=True)
    yield compiled, model, twin, products
    torch._dynamo.reset()


def backward_handed_over(compiled, model, products, x, way):
    """One backward of `compiled` on `x` with the gradients handed to autograd, `way` being
    products.learning or products.writing; returns the flat buffer."""
    flat = with_flat_grads(model)
    params = list(model.parameters())
    handed = hand_grads_to_autograd(params)
    with way(handed, params):
        compiled(x).square().mean().backward()
    take_back_grads(handed)
    return flat


def test_a_step_learns_whose_gradient_each_product_is_then_writes_it_in_place(
        compiled_under_the_pass):
    compiled, model, twin, products = compiled_under_the_pass
    assert products.rewritten == 4  # every layer's weight
    x = torch.randn(5, 6)
    backward_handed_over(compiled, model, products, x, products.learning)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    weights = [index[id(layer.weight)] for layer in
               (model.up, model.mid1, model.mid2, model.head)]
    assert sorted(products.owner.values()) == sorted(weights)
    flat = backward_handed_over(compiled, model, products, x, products.writing)
    assert products.written == 4
    twin(x).square().mean().backward()
    offset = 0
    for p, q in zip(model.parameters(), twin.parameters()):
        view = flat[offset:offset + p.numel()].view_as(p)
        assert p.grad is not None and p.grad.data_ptr() == view.data_ptr()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        offset += p.numel()


def test_a_product_written_into_another_parameters_view_is_caught(compiled_under_the_pass):
    compiled, model, _, products = compiled_under_the_pass
    x = torch.randn(5, 6)
    backward_handed_over(compiled, model, products, x, products.learning)
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    mid1, mid2 = index[id(model.mid1.weight)], index[id(model.mid2.weight)]
    swapped = {mid1: mid2, mid2: mid1}
    products.owner = {k: swapped.get(i, i) for k, i in products.owner.items()}
    flat = with_flat_grads(model)
    flat.uniform_()
    views = [p.grad for p in params]
    handed = hand_grads_to_autograd(params)
    with products.writing(handed, params):
        compiled(x).square().mean().backward()
    with pytest.raises(MisdirectedGradient, match=r"shape \(8, 8\)"):
        take_back_grads(handed)
    assert all(p.grad is v for p, v in zip(params, views))  # every view back in place
