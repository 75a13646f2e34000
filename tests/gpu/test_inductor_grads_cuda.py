"""A compiled model's weight products made where the update reads them (_inductor_grads): in
the gradients' dtype, and, in captured steps, into the parameters' flat gradient views. The
training is bit for bit the one with the products written apart and copied in; a product
written into the wrong view is caught and the step captured again without; a capture failing
after the products were handed their views loses nothing."""

import copy

import pytest
import torch
from torch import nn

import nimble_train as nt
from nimble_train import _inductor_grads
from step_reference import assert_same_training, eager_loop

pytestmark = pytest.mark.cuda

per_sample = nn.CrossEntropyLoss(reduction="none")


class Layers(nn.Module):
    """Linear layers, two of one shape (their products can be mistaken for each other), a
    layer norm and a parameter no backward reaches."""

    def __init__(self, width=32):
        super().__init__()
        self.up = nn.Linear(12, width)
        self.mid1 = nn.Linear(width, width)
        self.mid2 = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 5)
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x):
        x = torch.relu(self.up(x))
        x = self.norm(x + torch.tanh(self.mid2(torch.relu(self.mid1(x)))))
        return self.head(x)


def batches(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=g).cuda(),
             torch.randint(0, 5, (16,), generator=g).cuda()) for _ in range(n)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def trained(data, *, streams=1, amp="bf16", poison=False):
    """Step over the compiled model on `data`; with `poison`, every gradient set to NaN after
    warm-up (a step must overwrite or zero each)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Layers().cuda()
    opt = sgd(model.parameters())
    step = nt.Step(torch.compile(model), opt, per_sample, streams=streams, warmup=2, amp=amp)
    losses = [step(b).clone() for b in data[:2]]
    if poison:
        for p in model.parameters():
            if p.grad is not None:  # none for the unused parameter, which the update skips
                p.grad.fill_(float("nan"))
    losses += [step(b).clone() for b in data[2:]]
    torch.cuda.synchronize()
    torch._dynamo.reset()
    return step, model, opt, torch.stack(losses)


# inductor pads a product whose sizes are not multiples of 8 (in bf16) where it timed the
# padded one faster (pad_mm, shape_padding): the up and head layers' here (12 inputs, 5
# outputs). Its product is then sliced, not an output of the graph as it is, and stays apart.
@pytest.mark.parametrize("streams,padded", [(1, False), ("auto", False), (1, True)])
def test_products_written_in_place_train_bit_for_bit_as_written_apart(streams, padded,
                                                                       monkeypatch):
    from torch._inductor import config
    monkeypatch.setattr(config, "shape_padding", padded)  # else a timing decides
    monkeypatch.setattr(config, "force_shape_pad", padded)
    data = batches()
    step, model, opt, losses = trained(data, streams=streams, poison=True)
    stats = step.stats()
    assert stats["captured"] and stats["replays"] == 5, stats
    # every linear layer's weight, or the two whose products were not padded (mid1, mid2)
    assert stats["weight_products_in_place"] == (2 if padded else 4), stats
    monkeypatch.setattr(_inductor_grads, "INTO_FLAT", False)
    step_b, model_b, opt_b, losses_b = trained(data, streams=streams)
    assert step_b.stats()["captured"] and step_b.stats()["weight_products_in_place"] == 0
    assert torch.equal(losses, losses_b)
    assert_same_training(model, opt, model_b, opt_b, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), model_b.parameters()):
        if name != "unused":  # the last step's gradients, the poison gone
            assert torch.equal(p.grad, q.grad), name
    assert model.unused.grad is None and model_b.unused.grad is None


def test_the_training_is_the_eager_loops():
    data = batches(6, seed=1)
    _, model, opt, losses = trained(data, amp=None)
    torch.manual_seed(0)
    reference = Layers().cuda()
    ref_opt = sgd(reference.parameters())
    expected = torch.stack(eager_loop(reference, ref_opt, per_sample, data))
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    assert_same_training(model, opt, reference, ref_opt, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_product_is_kept_in_float32_where_the_graph_rounded_it(dtype):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(96, 4000, generator=g).to(dtype).cuda()
    b = torch.randn(4000, 80, generator=g).to(dtype).cuda()
    exact = a.double() @ b.double()
    flat = torch.full((96 * 80 + 7,), float("nan"), device="cuda")
    view = flat[3:3 + 96 * 80].view(96, 80)  # a view into a flat buffer, at an offset
    _inductor_grads._backward.targets = {5: view}
    try:
        into = _inductor_grads.weight_grad_mm(a, b, torch.float32, 5)
    finally:
        _inductor_grads._backward.targets = None
    assert into.data_ptr() == view.data_ptr()
    assert flat[:3].isnan().all() and flat[3 + 96 * 80:].isnan().all()
    rounded = torch.mm(a, b).float()  # what the graph computed: rounded, then cast
    ours = (view.double() - exact).norm() / exact.norm()
    theirs = (rounded.double() - exact).norm() / exact.norm()
    assert ours < 1e-5 and ours < theirs / 10, (ours, theirs)


def test_a_misdirected_product_is_caught_and_the_step_captured_with_products_apart(
        monkeypatch):
    learn = _inductor_grads.WeightProducts.learn

    def mistaken(self, made, handed, params):  # the two hidden layers' products swapped
        learn(self, made, handed, params)
        shapes = {}
        for key, i in self.owner.items():
            shapes.setdefault(tuple(params[i].shape), []).append(key)
        (one, other), = [keys for keys in shapes.values() if len(keys) == 2]
        self.owner[one], self.owner[other] = self.owner[other], self.owner[one]

    monkeypatch.setattr(_inductor_grads.WeightProducts, "learn", mistaken)
    data = batches(6, seed=3)
    step, model, opt, losses = trained(data)
    stats = step.stats()
    assert stats["captured"] and stats["replays"] == 4, stats
    assert stats["weight_products_in_place"] == 0
    assert "misdirected" in step._compiled_products.off
    monkeypatch.undo()
    monkeypatch.setattr(_inductor_grads, "INTO_FLAT", False)
    _, model_b, opt_b, losses_b = trained(data)
    assert torch.equal(losses, losses_b)
    assert_same_training(model, opt, model_b, opt_b, rtol=0, atol=0)


def test_a_capture_failing_after_the_products_were_given_their_views_loses_nothing(
        monkeypatch):
    data = batches(5, seed=4)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Layers().cuda()
    opt = sgd(model.parameters())
    step = nt.Step(torch.compile(model), opt, per_sample, streams=1, warmup=2)
    step(data[0])
    step(data[1])
    state = copy.deepcopy((model.state_dict(), opt.state_dict()))
    views = [p.grad for p in model.parameters()]
    product = _inductor_grads._product
    calls = []

    def failing(a, b, dtype, out=None):
        if torch.cuda.is_current_stream_capturing():
            calls.append(out is not None)  # written into a view
            if len(calls) == 3:
                raise RuntimeError("injected product failure")
        return product(a, b, dtype, out)

    monkeypatch.setattr(_inductor_grads, "_product", failing)
    with pytest.raises(nt.CaptureError, match="injected product failure"):
        step(data[2])
    monkeypatch.undo()
    assert calls == [True, True, True]
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[0][key]), key
    for a, b in zip(opt.state_dict()["state"].values(), state[1]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    # later calls run eagerly and train as the eager loop from that state
    losses = torch.stack([step(b).clone() for b in data[2:]])
    reference = Layers().cuda()
    reference.load_state_dict(state[0])
    ref_opt = sgd(reference.parameters())
    ref_opt.load_state_dict(state[1])
    expected = torch.stack(eager_loop(reference, ref_opt, per_sample, data[2:]))
    torch._dynamo.reset()
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    assert_same_training(model, opt, reference, ref_opt, rtol=1e-4, atol=1e-5)
