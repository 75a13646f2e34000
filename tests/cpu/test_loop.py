"""Real training loops on the CPU: gradient accumulation and an EMA of the weights, against the
plain eager loops a user would write."""

import copy

import pytest
import torch

import nimble_train as nt
from step_reference import (MLP, SmallCNN, assert_same_training, classification_batches,
                            eager_accumulation_loop, grad_scaler_accumulation_loop,
                            hand_written_ema, random_loop, run_accumulating, twin, with_short)

per_sample = torch.nn.CrossEntropyLoss(reduction="none")
mean_loss = torch.nn.CrossEntropyLoss()


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05),
}


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_accumulation_equals_the_eager_accumulation_loop(k, name):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP(), OPTIMIZERS[name])
    s1 = torch.optim.lr_scheduler.LinearLR(o1, start_factor=0.2, total_iters=3)
    s2 = torch.optim.lr_scheduler.LinearLR(o2, start_factor=0.2, total_iters=3)
    # A short micro-batch in the middle of the second window, padded and masked.
    batches = with_short(classification_batches(4 * k, 16, seed=3), k + k // 2, 9)
    step, losses, stepped = run_accumulating(m1, o1, per_sample, batches, k, scheduler=s1,
                                             grad_clip=0.5)
    expected = eager_accumulation_loop(m2, o2, per_sample, batches, k, grad_clip=0.5,
                                       scheduler=s2)
    assert stepped == [(i + 1) % k == 0 for i in range(4 * k)]
    assert step.stats()["updates"] == 4 and step.stats()["steps"] == 4 * k
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert_same_training(m1, o1, m2, o2)
    assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"]


def test_a_scalar_loss_is_divided_by_k_as_in_the_plain_loop():
    torch.manual_seed(1)
    (m1, o1), (m2, o2) = twin(MLP(), OPTIMIZERS["sgd-momentum"])
    batches = classification_batches(9, 16, seed=4)  # ends inside a window: no update for it
    _, losses, stepped = run_accumulating(m1, o1, mean_loss, batches, 3)
    expected = eager_accumulation_loop(m2, o2, mean_loss, batches, 3)
    assert stepped == [False, False, True] * 3
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert_same_training(m1, o1, m2, o2)


def test_a_window_left_open_keeps_its_gradients_for_the_next_calls():
    torch.manual_seed(2)
    (m1, o1), (m2, o2) = twin(MLP(), OPTIMIZERS["adamw"])
    batches = classification_batches(6, 8, seed=5)
    step = nt.Step(m1, o1, per_sample, accumulate=3, warmup=1)
    for b in batches[:4]:
        step(b)
    # Mid-window: the gradients hold the window's first micro-batch, weighted 1/3.
    eager_accumulation_loop(m2, o2, per_sample, batches[:3], 3)
    o2.zero_grad()
    x, y = batches[3]
    (per_sample(m2(x), y).mean() / 3).backward()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    for b in batches[4:]:
        step(b)
    eager_accumulation_loop(m2, o2, per_sample, batches[3:], 3)
    assert_same_training(m1, o1, m2, o2)


def test_a_short_batchnorm_micro_batch_runs_eagerly_with_its_weight():
    torch.manual_seed(3)
    (m1, o1), (m2, o2) = twin(SmallCNN(), OPTIMIZERS["sgd-momentum"])
    batches = with_short(classification_batches(6, 8, image=True, seed=6), 4, 5)
    step, _, _ = run_accumulating(m1, o1, per_sample, batches, 2)
    eager_accumulation_loop(m2, o2, per_sample, batches, 2)
    assert step.stats()["eager_steps"] == 6
    assert_same_training(m1, o1, m2, o2)  # BatchNorm statistics included


def test_fp16_overflow_skips_the_whole_accumulated_update():
    torch.manual_seed(4)
    (m1, o1), (m2, o2) = twin(MLP(), lambda p: torch.optim.SGD(p, lr=0.1))
    batches = classification_batches(4, 8, seed=7)
    x, y = batches[2]
    batches[2] = (x.clone().fill_(float("inf")), y)  # an overflow in the second window
    step = nt.Step(m1, o1, per_sample, accumulate=2, amp="fp16", capture=False)
    for b in batches:
        step(b)
    grad_scaler_accumulation_loop(m2, o2, per_sample, batches[:2], 2)
    after_first = copy.deepcopy(m2.state_dict())
    grad_scaler_accumulation_loop(m2, o2, per_sample, batches[2:], 2)
    for name, value in m1.state_dict().items():
        torch.testing.assert_close(value, after_first[name], msg=name)  # the window skipped
        torch.testing.assert_close(value, m2.state_dict()[name], msg=name)


# ---------------------------------------------------------------------- EMA


@pytest.mark.parametrize("k", [1, 2])
def test_ema_equals_a_hand_written_ema(k):
    torch.manual_seed(5)
    (m1, o1), (m2, o2) = twin(SmallCNN(), OPTIMIZERS["sgd-momentum"])
    batches = classification_batches(8, 8, image=True, seed=8)
    step = nt.Step(m1, o1, per_sample, ema=0.9, accumulate=k, warmup=2)
    for b in batches:
        step(b)
    averages = hand_written_ema(m2, o2, per_sample, batches, 0.9, k)
    ema_state = step.ema_state_dict()
    assert ema_state.keys() == m1.state_dict().keys()
    for name, value in ema_state.items():
        if name in averages:
            torch.testing.assert_close(value, averages[name], rtol=1e-5, atol=1e-6, msg=name)
        else:  # num_batches_tracked: the model's own
            assert torch.equal(value, m1.state_dict()[name]), name
    assert_same_training(m1, o1, m2, o2)  # the EMA does not touch the training


def test_ema_weights_swap_in_and_back_and_training_waits():
    torch.manual_seed(6)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    step = nt.Step(model, opt, per_sample, ema=0.5)
    batches = classification_batches(3, 8, image=True, seed=9)
    for b in batches:
        step(b)
    trained = copy.deepcopy(model.state_dict())
    ema_state = step.ema_state_dict()
    with step.ema_weights() as swapped:
        assert swapped is model
        for name, value in model.state_dict().items():
            assert torch.equal(value, ema_state[name]), name
        with pytest.raises(nt.NimbleError, match="EMA weights are in the model"):
            step(batches[0])
        with pytest.raises(nt.NimbleError, match="do not nest"):
            with step.ema_weights():
                pass
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    step(batches[0])  # trains again


def test_ema_state_dict_round_trips_and_checks_what_it_loads():
    torch.manual_seed(7)
    model = MLP()
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample, ema=0.9)
    for b in classification_batches(3, 8, seed=10):
        step(b)
    saved = step.ema_state_dict()
    for b in classification_batches(2, 8, seed=11):
        step(b)
    assert not torch.equal(step.ema_state_dict()["net.0.weight"], saved["net.0.weight"])
    step.load_ema_state_dict(saved)
    for name, value in step.ema_state_dict().items():
        assert torch.equal(value, saved[name]), name
    bad = dict(saved)
    bad["net.0.weight"] = bad["net.0.weight"][:3]
    with pytest.raises(nt.NimbleError, match=r"net.0.weight has shape \(32, 12\)"):
        step.load_ema_state_dict(bad)
    with pytest.raises(nt.NimbleError, match=r"missing \['net.0.bias'\]"):
        step.load_ema_state_dict({k: v for k, v in saved.items() if k != "net.0.bias"})
    with pytest.raises(nt.NimbleError, match=r"unexpected \['head.weight'\]"):
        step.load_ema_state_dict({**saved, "head.weight": torch.zeros(1)})
    for name, value in step.ema_state_dict().items():  # a refused state changed nothing
        assert torch.equal(value, saved[name]), name


def test_ema_calls_without_an_ema_say_how_to_get_one():
    model = MLP()
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample)
    with pytest.raises(nt.NimbleError, match=r"keeps no EMA; build it with nt.Step\(\.\.\., "
                                             r"ema=0.999\)"):
        step.ema_state_dict()


@pytest.mark.parametrize("value,match", [
    (0, "accumulate must be an int >= 1"), (-2, "accumulate must be an int >= 1"),
    (2.0, "accumulate must be an int >= 1"), (True, "accumulate must be an int >= 1"),
])
def test_bad_accumulate_is_refused(value, match):
    model = MLP()
    with pytest.raises(ValueError, match=match):
        nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample,
                accumulate=value)


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1, True, "0.99"])
def test_bad_ema_is_refused(value):
    model = MLP()
    with pytest.raises(ValueError, match="ema must be None or a decay strictly between 0 and 1"):
        nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample, ema=value)


def varying_window_loop(model, optimizer, loss_fn, batches, windows, weights, grad_clip):
    """The eager loop of a caller whose windows vary (an epoch ending mid-window) and who
    weighs each micro-batch's loss itself: loss * weight, backward; clip, step per window."""
    losses, norms, i = [], [], 0
    for size in windows:
        optimizer.zero_grad()
        for _ in range(size):
            x, y = batches[i]
            loss = loss_fn(model(x), y)
            (loss * weights[i] if weights is not None else loss / 3).backward()
            losses.append(loss.detach())
            i += 1
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
        optimizer.step()
    return losses, norms


@pytest.mark.parametrize("given_weights", [False, True])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_windows_ended_early_and_given_loss_weights(name, given_weights):
    """update=True ends a window before its K calls (the update sees only them); loss_weight
    replaces Step's 1/K; grad_norm is the norm the eager clip saw."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP(), OPTIMIZERS[name])
    windows = [3, 2, 3, 1, 3]  # accumulate=3; the 2 and the 1 end early (epoch ends)
    batches = classification_batches(sum(windows), 16, seed=5)
    weights = None
    if given_weights:  # a window's weights: 1 / its calls, as transformers.Trainer's
        weights = [1.0 / size for size in windows for _ in range(size)]
    step = nt.Step(m1, o1, mean_loss, accumulate=3, grad_clip=0.7)
    losses, norms, i = [], [], 0
    for size in windows:
        for micro in range(size):
            last = micro == size - 1
            loss = step(batches[i], update=True if last and size < 3 else None,
                        loss_weight=weights[i] if weights else None)
            losses.append(loss.clone())
            assert step.stepped == last
            i += 1
        norms.append(step.grad_norm.clone())
    expected, expected_norms = varying_window_loop(m2, o2, mean_loss, batches, windows,
                                                   weights, grad_clip=0.7)
    assert step.stats()["updates"] == len(windows)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(norms), torch.stack(expected_norms), rtol=1e-5,
                               atol=1e-6)
    assert_same_training(m1, o1, m2, o2)


def test_call_keywords_are_checked():
    model = MLP()
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), mean_loss, accumulate=2)
    x, y = classification_batches(1, 8)[0]
    step((x, y))
    with pytest.raises(ValueError, match="update=False on the call that completes a window"):
        step((x, y), update=False)
    with pytest.raises(TypeError, match="loss_weight must be a float or None; got str"):
        step((x, y), loss_weight="0.5")
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="loss_weight must be a finite number"):
            step((x, y), loss_weight=bad)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert step.stats()["steps"] == 1 and step.stats()["micro_batch"] == 1
    single = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), mean_loss)
    with pytest.raises(ValueError, match="loss_weight=0.5 needs accumulate > 1"):
        single((x, y), loss_weight=0.5)
    assert single.grad_norm is None  # no grad_clip: no norm


def test_gradients_set_to_none_after_each_update_do_not_hide_used_parameters():
    """A loop that zeroes with set_to_none after every update (as transformers.Trainer
    does): when the update moves to the fused optimizer, every parameter a backward reached
    is still known to be trained."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP(), OPTIMIZERS["adamw"])
    batches = classification_batches(5, 16, seed=8)
    step = nt.Step(m1, o1, mean_loss)
    for batch in batches:
        step(batch)
        o1.zero_grad()
    assert step._iteration.got_gradients() == [True] * len(list(m1.parameters()))
    for x, y in batches:
        o2.zero_grad()
        mean_loss(m2(x), y).backward()
        o2.step()
    assert_same_training(m1, o1, m2, o2)


def test_gradients_set_to_none_inside_a_window_are_kept():
    """A loop that sets the gradients to None after every call (Lightning's zero_grad hook
    runs after a window's first call): the window still accumulates all its micro-batches."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP(), OPTIMIZERS["sgd-momentum"])
    batches = classification_batches(9, 16, seed=12)
    step = nt.Step(m1, o1, per_sample, accumulate=3)
    for batch in batches:
        step(batch)
        o1.zero_grad()
    eager_accumulation_loop(m2, o2, per_sample, batches, 3)
    assert step.stats()["updates"] == 3
    assert_same_training(m1, o1, m2, o2)


@pytest.mark.parametrize("seed", range(16))
def test_random_loops_equal_the_eager_loop_window_by_window(seed):
    """Accumulation, windows ended early, short micro-batches, loss weights, clipping, an EMA
    and learning-rate changes, drawn at random (step_reference.random_loop)."""
    random_loop(seed)
