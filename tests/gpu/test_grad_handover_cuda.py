"""Captured steps let autograd keep the gradients it makes and copy them into the flat buffer
once, after the backward: the training is the eager loop's, hooks and tied parameters
included, and a capture that fails part-way gives every parameter its flat view back."""

import pytest
import torch
import torch.nn.functional as F

import nimble_train as nt
from nimble_train import _iteration
from step_reference import (SmallCNN, assert_same_training, classification_batches, eager_loop,
                            twin)

pytestmark = pytest.mark.cuda

per_sample = torch.nn.CrossEntropyLoss(reduction="none")
TOL = {"rtol": 2e-4, "atol": 2e-5}


class TiedAndHooked(torch.nn.Module):
    """Batch norm, a parameter read twice, and one whose gradient a user's hook halves."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.proj = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.head = torch.nn.Linear(8, 5)
        self.offset = torch.nn.Parameter(torch.zeros(5))

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        h = self.proj(h * self.scale) * self.scale
        return self.head(torch.tanh(h)) + self.offset


def halve_offset_grads(model):
    model.offset.register_hook(lambda g: g * 0.5)


def handovers(monkeypatch) -> list[tuple[int, int]]:
    """(parameters handed to autograd, gradients copied back) of each captured backward."""
    seen = []
    original = _iteration.take_back_grads

    def counting(handed, copy=True, **options):
        if handed is not None:
            seen.append((len(handed), sum(p.grad is not None for p, _ in handed)))
        original(handed, copy, **options)
    monkeypatch.setattr(_iteration, "take_back_grads", counting)
    return seen


@pytest.mark.parametrize("streams, handed", [(1, 8), ("auto", 3)])
def test_gradients_autograd_made_are_copied_in_once_and_train_as_eager(monkeypatch, streams,
                                                                       handed):
    torch.manual_seed(0)
    make_opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4)  # noqa: E731
    (m1, o1), (m2, o2) = twin(TiedAndHooked().cuda(), make_opt)
    halve_offset_grads(m1)
    halve_offset_grads(m2)
    seen = handovers(monkeypatch)
    batches = classification_batches(8, 16, image=True, device="cuda")
    step = nt.Step(m1, o1, per_sample, warmup=2, streams=streams)
    views = None
    for i, batch in enumerate(batches):
        step(batch)
        if i == 2:  # the first replay: the captured gradients live in the flat buffer
            views = [p.grad.data_ptr() for p in m1.parameters()]
    torch.cuda.synchronize()
    assert step.stats()["captured"] and step.stats()["replays"] == 6
    # One capture: every parameter but the hooked ones (the user's on offset; with "auto" the
    # weight-gradient side stream's on conv, proj and head) handed over, each one copied back.
    assert seen == [(handed, handed)], seen
    eager_loop(m2, o2, per_sample, batches)
    assert_same_training(m1, o1, m2, o2, **TOL)
    for p, q, ptr in zip(m1.parameters(), m2.parameters(), views):
        assert p.grad.data_ptr() == ptr  # still the flat buffer's view
        torch.testing.assert_close(p.grad, q.grad, **TOL)  # the last step's gradient


class _RaisesInCapturedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("this backward cannot be captured")
        return grad


class FailsInCapturedBackward(SmallCNN):
    def forward(self, x):
        x = _RaisesInCapturedBackward.apply(F.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def _fail_the_copy(monkeypatch):
    original = torch._foreach_copy_

    def copy(dst, src, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the gradient copy failed")
        return original(dst, src, *args, **kwargs)
    monkeypatch.setattr(torch, "_foreach_copy_", copy)


@pytest.mark.parametrize("where", ["backward", "copy"])
def test_a_capture_failing_after_the_handover_keeps_the_views_and_the_state(monkeypatch, where):
    torch.manual_seed(4)
    model = FailsInCapturedBackward() if where == "backward" else SmallCNN()
    (m1, o1), (m2, o2) = twin(model.cuda(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    if where == "copy":
        _fail_the_copy(monkeypatch)
    seen = handovers(monkeypatch)
    batches = classification_batches(5, 16, image=True, device="cuda")
    step = nt.Step(m1, o1, per_sample, warmup=2, streams=1)
    step(batches[0])
    step(batches[1])
    views = [p.grad for p in m1.parameters()]
    with pytest.raises(nt.CaptureError, match=f"this backward cannot be captured|"
                                              "the gradient copy failed"):
        step(batches[2])
    assert seen and seen[0][0] == len(views)  # the handover happened before the failure
    for p, view in zip(m1.parameters(), views):
        assert p.grad is view  # every parameter has its flat view back
    eager_loop(m2, o2, per_sample, batches[:2])
    assert_same_training(m1, o1, m2, o2, **TOL)  # as after the last completed step
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    # Training goes on eagerly, as the eager loop does.
    step(batches[3])
    step(batches[4])
    eager_loop(m2, o2, per_sample, batches[3:])
    assert_same_training(m1, o1, m2, o2, **TOL)


class WithUnused(TiedAndHooked):
    """TiedAndHooked, and a parameter no backward reaches."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.randn(4))


@pytest.mark.parametrize("streams", [1, "auto"])
def test_captured_steps_zero_no_buffer_and_overwrite_every_gradient(streams):
    """A captured step that hands its gradients over zeroes no flat buffer before the
    backward: the views autograd adds into (hooked) are zeroed, the others overwritten or,
    unreached, zeroed after. Gradients poisoned between calls do not leak into a step."""
    torch.manual_seed(6)
    make_opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4)  # noqa: E731
    (m1, o1), (m2, o2) = twin(WithUnused().cuda(), make_opt)
    halve_offset_grads(m1)
    halve_offset_grads(m2)
    batches = classification_batches(7, 16, image=True, device="cuda")
    step = nt.Step(m1, o1, per_sample, warmup=2, streams=streams)
    for i, batch in enumerate(batches):
        if i >= 2:  # what a step must overwrite or zero: warm-up is over, it captures or replays
            for p in m1.parameters():
                if p.grad is not None:  # none for the unused parameter, which the update skips
                    p.grad.fill_(float("nan"))
        step(batch)
    torch.cuda.synchronize()
    assert step.stats()["captured"] and step.stats()["replays"] == 5
    eager_loop(m2, o2, per_sample, batches)
    assert_same_training(m1, o1, m2, o2, **TOL)
    for p, q in zip(m1.parameters(), m2.parameters()):
        if q.grad is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, q.grad, **TOL)
