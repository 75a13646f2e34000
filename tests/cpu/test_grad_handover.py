"""The gradient hand-over's mechanism, on CPU: parameters whose gradients are views into a flat
buffer hand them to autograd for a backward and take them back with one copy; the buffer ends
as autograd's accumulation into the zeroed views would leave it, bit for bit."""

import copy

import pytest
import torch

from nimble_train._iteration import (MisdirectedGradient, hand_grads_to_autograd, hooked,
                                     take_back_grads)


class Net(torch.nn.Module):
    """A layer used twice, batch norm, a parameter a hook doubles, one the backward misses."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 3)
        self.hooked = torch.nn.Parameter(torch.randn(3))
        self.unused = torch.nn.Parameter(torch.randn(5))

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(x))))
        return self.head(self.norm(h)) * self.hooked


def with_flat_grads(model) -> torch.Tensor:
    """Each parameter's .grad becomes a view into one zeroed flat buffer, as Step keeps them."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def twins(seed=0):
    torch.manual_seed(seed)
    a = Net().double()
    b = copy.deepcopy(a)
    for m in (a, b):
        m.hooked.register_hook(lambda g: g * 2)
    return a, b


def loss_of(model, x):
    return model(x).square().mean()


def test_handed_over_gradients_are_copied_in_as_accumulation_would_add_them():
    a, b = twins()
    flat_a, flat_b = with_flat_grads(a), with_flat_grads(b)
    x = torch.randn(8, 6, dtype=torch.float64)
    loss_of(b, x).backward()  # autograd adds into the zeroed views: the reference
    views = [p.grad for p in a.parameters()]
    handed = hand_grads_to_autograd(list(a.parameters()))
    assert [p for p, _ in handed] == [p for p in a.parameters() if p is not a.hooked]
    assert all(p.grad is None for p, _ in handed)
    assert a.hooked.grad is dict(zip(a.parameters(), views))[a.hooked]  # kept: a hook watches
    loss_of(a, x).backward()
    assert a.unused.grad is None  # nothing reached it: no tensor for it
    take_back_grads(handed)
    for p, view in zip(a.parameters(), views):
        assert p.grad is view  # the flat buffer's views, back in place
    assert torch.equal(flat_a, flat_b)  # same values, bit for bit, the shared layer's sum too
    assert flat_a.abs().sum() > 0
    assert torch.equal(a.unused.grad, torch.zeros(5, dtype=torch.float64))


def test_taking_back_without_the_copy_leaves_the_buffer_as_it_was():
    a, _ = twins(1)
    flat = with_flat_grads(a)
    flat.uniform_()  # what an earlier backward left
    before = flat.clone()
    views = [p.grad for p in a.parameters()]
    handed = hand_grads_to_autograd(list(a.parameters()))
    loss_of(a, torch.randn(4, 6, dtype=torch.float64)).backward()
    take_back_grads(handed, copy=False)  # a failed capture: the views back, nothing copied
    assert all(p.grad is v for p, v in zip(a.parameters(), views))
    hooked_slice = torch.cat([v.flatten() for p, v in zip(a.parameters(), views)
                              if p is a.hooked])
    changed = ~torch.isclose(flat, before)
    assert changed.sum() == hooked_slice.numel()  # only the hooked one, accumulated in place


def test_nothing_handed_over_is_nothing_taken_back():
    take_back_grads(None)
    take_back_grads([])


@pytest.mark.parametrize("kind", ["tensor", "post-accumulate", "none"])
def test_hooked_sees_either_kind_of_gradient_hook(kind):
    p = torch.nn.Parameter(torch.ones(2))
    if kind == "tensor":
        p.register_hook(lambda g: g)
    elif kind == "post-accumulate":
        p.register_post_accumulate_grad_hook(lambda t: None)
    assert hooked(p) == (kind != "none")


def test_a_captured_calls_handover_zeroes_what_it_does_not_overwrite():
    """A captured call zeroes no flat buffer: handing over zeroes the views a backward adds
    into (the hooked one), and taking back zeroes the handed views no gradient reached; every
    other view is overwritten. Nothing keeps what the buffer held before."""
    a, b = twins(2)
    flat_a, flat_b = with_flat_grads(a), with_flat_grads(b)
    x = torch.randn(8, 6, dtype=torch.float64)
    loss_of(b, x).backward()  # into zeroed views: the reference
    flat_a.fill_(float("nan"))  # what an earlier step or user code left
    handed = hand_grads_to_autograd(list(a.parameters()), zero_kept=True)
    assert torch.equal(a.hooked.grad, torch.zeros(3, dtype=torch.float64))
    loss_of(a, x).backward()
    take_back_grads(handed, zero_unreached=True)
    assert torch.equal(flat_a, flat_b)
    assert torch.equal(a.unused.grad, torch.zeros(5, dtype=torch.float64))


def test_a_gradient_left_in_another_parameters_view_is_refused_and_nothing_copied():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    flat = torch.zeros(6)
    views = [flat[:3], flat[3:]]
    p.grad, q.grad = views
    handed = hand_grads_to_autograd([p, q])
    p.grad = views[1].detach()  # p's gradient in q's view: a copy into both would race
    q.grad = torch.full((3,), 2.0)
    with pytest.raises(MisdirectedGradient, match=r"shape \(3,\)"):
        take_back_grads(handed)
    assert p.grad is views[0] and q.grad is views[1]
    assert torch.equal(flat, torch.zeros(6))
    p.grad = views[0].detach()  # its own view: nothing to copy for it
    handed = hand_grads_to_autograd([p, q])
    p.grad, q.grad = views[0].detach().fill_(3.0), torch.full((3,), 2.0)
    take_back_grads(handed)
    assert torch.equal(flat, torch.tensor([3.0, 3, 3, 2, 2, 2]))
