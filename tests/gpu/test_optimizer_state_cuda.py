"""Optimizers Step captures as they are, whose step() keeps state on the host or assigns its state
tensors anew, and sparse gradients: a captured step trains as the eager loop, or refuses, saying
why, with the model and optimizer as after the last completed call -- never trains otherwise,
silently."""

import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import nimble_train as nt
from nimble_train.errors import CaptureError, NimbleError
from step_reference import (MLP, GroupCountSGD, IntStepAdam, ReassigningAdam,
                            assert_same_training, classification_batches, twin)

pytestmark = pytest.mark.cuda

TOL = {"rtol": 1e-4, "atol": 1e-5}  # capturable torch.optim paths: other rounding
loss_fn = torch.nn.functional.cross_entropy


def eager(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()


def run_through_refusals(step, batches) -> list[str]:
    """The calls as a loop that catches a failed capture and calls again would make them: the
    Step's later calls run eagerly. Returns the errors it caught."""
    errors = []
    for batch in batches:
        try:
            step(batch)
        except CaptureError as error:
            errors.append(str(error))
            step(batch)
    return errors


HOST_COUNTERS = {
    "adagrad-lr-decay": (lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.05),
                         "['step'] went from a CPU tensor 2.0 to a CPU tensor 3.0"),
    "python-int-step": (lambda p: IntStepAdam(p), "['step'] went from 2 to 3"),
    "param-group-count": (lambda p: GroupCountSGD(p), "param_groups[0]['count'] went from 2 to 3"),
}


@pytest.mark.parametrize("streams", [1, "auto"])
@pytest.mark.parametrize("kind", list(HOST_COUNTERS))
def test_an_optimizer_counting_on_the_host_is_refused_at_capture_and_trains_eagerly_after(
        kind, streams):
    make, seen = HOST_COUNTERS[kind]
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), make)
    batches = classification_batches(8, 16, device="cuda", seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "captures the optimizer's own step"
        step = nt.Step(m1, o1, loss_fn, warmup=2, streams=streams)
        step(batches[0])
        step(batches[1])
        with pytest.raises(CaptureError) as error:
            step(batches[2])
    message = str(error.value)
    assert seen in message and "cannot carry from one replay to the next" in message, message
    assert "capturable=True" in message and "capture=False" in message, message
    eager(m2, o2, batches[:2])
    assert_same_training(m1, o1, m2, o2, **TOL)  # as after the last completed call
    for x, y in batches[2:]:
        step((x, y))  # eagerly from here on
    eager(m2, o2, batches[2:])
    stats = step.stats()
    assert not stats["captured"] and stats["eager_steps"] == 8, stats
    assert seen in stats["capture_error"]
    assert_same_training(m1, o1, m2, o2, **TOL)


@pytest.mark.parametrize("streams", [1, "auto"])
def test_an_optimizer_assigning_its_state_tensors_anew_trains_as_the_eager_loop(streams):
    """Each replay must read the moments the last one wrote: the capture copies the new ones
    into the tensors it began with."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), lambda p: ReassigningAdam(p))
    batches = classification_batches(12, 16, device="cuda", seed=2)
    began = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = nt.Step(m1, o1, loss_fn, warmup=2, streams=streams)
        for i, batch in enumerate(batches):
            step(batch)
            if i == 1:
                began = [o1.state[p]["m"] for p in m1.parameters()]
    eager(m2, o2, batches)
    stats = step.stats()
    assert stats["captured"] and stats["replays"] == 10, stats
    assert all(o1.state[p]["m"] is m for p, m in zip(m1.parameters(), began))
    assert_same_training(m1, o1, m2, o2, **TOL)


def _zoo():
    cases = [pytest.param(lambda p, c=c: c(p, lr=1e-2), id=c.__name__) for c in (
        torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
        torch.optim.ASGD, torch.optim.Rprop, torch.optim.Adadelta, torch.optim.RMSprop)]
    for name in ("adamp", "sgdp", "adabelief", "lamb", "lars", "lion", "adan", "nadamw",
                 "madgrad", "novograd", "adafactor", "adopt", "laprop", "mars"):
        cases.append(pytest.param(name, id=f"timm-{name}"))
    return cases


@pytest.mark.parametrize("make", _zoo())
def test_torch_and_timm_optimizers_train_as_the_eager_loop_or_refuse(make):
    """Whatever an optimizer's step() does -- a sync, a count on the host, state assigned anew
    -- the Step trains as the eager loop: its captured replays, or its eager calls after a
    capture it refused (a failed capture leaves the optimizer as after the last step)."""
    if isinstance(make, str):
        timm_optim = pytest.importorskip("timm.optim", reason="timm's optimizers")
        make = (lambda name: lambda p: timm_optim.create_optimizer_v2(
            list(p), name, lr=1e-2))(make)
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), make)
    batches = classification_batches(10, 16, device="cuda", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = nt.Step(m1, o1, loss_fn, warmup=2, streams=1)
        errors = run_through_refusals(step, batches)
    eager(m2, o2, batches)
    stats = step.stats()
    assert stats["captured"] != bool(errors), (stats, errors)
    assert_same_training(m1, o1, m2, o2, **TOL)


class SparseBag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(40, 12, sparse=True)
        self.head = torch.nn.Linear(12, 5)

    def forward(self, x):
        return self.head(self.embedding((x.abs() * 13).long().clamp(max=39)))


@pytest.mark.parametrize("make, refused_at", [
    (lambda p: torch.optim.SGD(p, lr=0.1), 1),        # fused at the second warm-up call
    (lambda p: torch.optim.Adagrad(p, lr=0.1), 2),    # captured as it is, after warm-up
], ids=["sgd-fused", "adagrad-as-is"])
def test_a_sparse_gradient_is_refused_before_anything_runs(make, refused_at):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(SparseBag().cuda(), make)
    batches = classification_batches(4, 16, device="cuda", seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = nt.Step(m1, o1, loss_fn, warmup=2, streams=1)
        for batch in batches[:refused_at]:
            step(batch)
        for _ in range(2):  # refused again, not half-done
            with pytest.raises(NimbleError, match=r"embedding\.weight gets a sparse gradient "
                                                  r"\(torch\.sparse_coo"):
                step(batches[refused_at])
    eager(m2, o2, batches[:refused_at])
    assert_same_training(m1, o1, m2, o2, **TOL)


def clamp_weights(optimizer, args, kwargs):
    """A step post-hook, as a WGAN critic's weight clipping can be written."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.clamp_(-0.05, 0.05)


def shrink_weights(optimizer, args, kwargs):
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.mul_(0.99)


def test_step_hooks_of_a_fused_optimizer_are_refused_before_anything_runs():
    """The fused update is not optimizer.step(): a hook would stop running after warm-up."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    o1.register_step_post_hook(clamp_weights)
    o2.register_step_post_hook(clamp_weights)
    batches = classification_batches(6, 16, device="cuda", seed=5)
    step = nt.Step(m1, o1, loss_fn, warmup=2, streams=1)
    step(batches[0])  # warm-up, eager: optimizer.step() and its hook
    for _ in range(2):
        with pytest.raises(NimbleError, match=r"SGD has hooks that its step\(\) runs: "
                                              r"clamp_weights \(a step post-hook\)"):
            step(batches[1])
    eager(m2, o2, batches[:1])
    assert_same_training(m1, o1, m2, o2, **TOL)


def test_a_step_hook_registered_after_capture_is_refused_and_once_removed_training_goes_on():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), lambda p: torch.optim.AdamW(p, lr=1e-2))
    batches = classification_batches(8, 16, device="cuda", seed=6)
    step = nt.Step(m1, o1, loss_fn, warmup=2, streams=1)
    for batch in batches[:4]:
        step(batch)
    handle = register_optimizer_step_post_hook(shrink_weights)
    try:
        with pytest.raises(NimbleError, match=r"AdamW has hooks .* shrink_weights"):
            step(batches[4])
    finally:
        handle.remove()
    for batch in batches[4:]:
        step(batch)
    eager(m2, o2, batches)
    stats = step.stats()
    assert stats["captured"] and stats["replays"] == 6, stats
    assert_same_training(m1, o1, m2, o2, **TOL)


def test_step_hooks_of_an_optimizer_captured_as_it_is_run_in_its_graphs_and_a_new_one_recaptures():
    """Captured as it is, optimizer.step() runs in the capture, its hooks with it (what they do
    to tensors replays); a hook registered after capture has the update captured again."""
    make = lambda p: torch.optim.RMSprop(p, lr=1e-2)  # noqa: E731
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), make)
    o1.register_step_post_hook(clamp_weights)
    o2.register_step_post_hook(clamp_weights)
    batches = classification_batches(10, 16, device="cuda", seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "captures the optimizer's own step"
        step = nt.Step(m1, o1, loss_fn, warmup=2, streams=1)
        for batch in batches[:5]:
            step(batch)
        captures = step.stats()["captures"]
        o1.register_step_post_hook(shrink_weights)
        for batch in batches[5:]:
            step(batch)
    eager(m2, o2, batches[:5])
    o2.register_step_post_hook(shrink_weights)
    eager(m2, o2, batches[5:])
    stats = step.stats()
    assert captures == 1 and stats["captures"] == 2 and stats["replays"] == 8, stats
    assert_same_training(m1, o1, m2, o2, **TOL)
