"""Real training loops on the GPU: eager steps after capture, gradient accumulation and EMA in
the graph, each against the plain eager loop."""

import warnings

import pytest
import torch

import nimble_train as nt
from step_reference import (MLP, SmallCNN, assert_same_training, classification_batches,
                            eager_accumulation_loop, grad_scaler_accumulation_loop,
                            hand_written_ema, random_loop, run_accumulating, twin, with_short)

pytestmark = pytest.mark.cuda


class BatchNormMLP(torch.nn.Module):
    def __init__(self, features=12, hidden=32, classes=5):
        super().__init__()
        self.net = torch.nn.Sequential(
            # No bias before BatchNorm: its gradient is rounding noise, which Adam amplifies.
            torch.nn.Linear(features, hidden, bias=False), torch.nn.BatchNorm1d(hidden),
            torch.nn.ReLU(), torch.nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


per_sample = torch.nn.CrossEntropyLoss(reduction="none")
TOL = {"rtol": 2e-4, "atol": 2e-5}  # fused update and float32 staged values: other rounding


def max_gap(model_a, model_b) -> float:
    return max((a.double() - b.double()).abs().max().item()
               for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values())
               if a.is_floating_point())


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
}


@pytest.mark.parametrize("make_opt", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
@pytest.mark.parametrize("loss_fn,partial_batch", [
    (torch.nn.CrossEntropyLoss(), "pad"),                     # a scalar loss cannot be padded
    (torch.nn.CrossEntropyLoss(reduction="none"), "pad"),     # BatchNorm forbids padding
    (torch.nn.CrossEntropyLoss(reduction="none"), "eager"),   # the user asked for eager
], ids=["scalar-loss", "per-sample-loss", "partial-eager"])
def test_a_short_batchnorm_batch_after_capture_equals_eager(loss_fn, partial_batch, make_opt):
    """Six full batches of 32 (warm-up, capture, replays), then one of 20 that runs eagerly
    after capture, then full ones again: every step equals the eager loop's."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(BatchNormMLP().cuda(), make_opt)
    batches = (classification_batches(6, 32, device="cuda")
               + classification_batches(1, 20, device="cuda", seed=1)
               + classification_batches(2, 32, device="cuda", seed=2))
    step = nt.Step(m1, o1, loss_fn, warmup=2, streams=1, partial_batch=partial_batch)
    gaps = []
    for x, y in batches:
        step((x, y))
        o2.zero_grad()
        loss = loss_fn(m2(x), y)
        (loss.mean() if loss.dim() else loss).backward()
        o2.step()
        torch.cuda.synchronize()
        gaps.append(max_gap(m1, m2))
    stats = step.stats()
    assert stats["captured"] and stats["eager_steps"] == 3 and stats["replays"] == 6, stats
    assert max(gaps) <= 1e-6, gaps  # parameters and running statistics


# ---------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("name", ["sgd-momentum", "adamw"])
def test_captured_accumulation_equals_the_eager_accumulation_loop(k, name):
    make = {"sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9,
                                                      weight_decay=1e-3),
            "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05)}[name]
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), make)
    s1 = torch.optim.lr_scheduler.LinearLR(o1, start_factor=0.2, total_iters=4)
    s2 = torch.optim.lr_scheduler.LinearLR(o2, start_factor=0.2, total_iters=4)
    # Warm-up ends inside a window; a short micro-batch, padded in the graph, comes later.
    batches = with_short(classification_batches(6 * k, 16, device="cuda", seed=3), 4 * k + 1, 9)
    step, losses, stepped = run_accumulating(m1, o1, per_sample, batches, k, scheduler=s1,
                                             grad_clip=0.5, warmup=3, streams=1)
    expected = eager_accumulation_loop(m2, o2, per_sample, batches, k, grad_clip=0.5,
                                       scheduler=s2)
    stats = step.stats()
    assert stepped == [(i + 1) % k == 0 for i in range(6 * k)]
    assert stats["updates"] == 6 and stats["eager_steps"] == 3, stats
    assert stats["replays"] == 6 * k - 3 and stats["graphs"] == min(k, 3), stats
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), **TOL)
    assert_same_training(m1, o1, m2, o2, **TOL)


def test_an_optimizer_captured_as_is_accumulates_too():
    torch.manual_seed(1)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), lambda p: torch.optim.RMSprop(p, lr=1e-3))
    batches = classification_batches(12, 16, device="cuda", seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "captures the optimizer's own step"
        step, losses, _ = run_accumulating(m1, o1, per_sample, batches, 3, warmup=2,
                                           grad_clip=1.0, streams=1)
    expected = eager_accumulation_loop(m2, o2, per_sample, batches, 3, grad_clip=1.0)
    stats = step.stats()
    assert stats["optimizer"] == "captured as-is" and stats["graphs"] == 3, stats
    assert stats["eager_steps"] == 3, stats  # warm-up covers the first window: state exists
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), **TOL)
    assert_same_training(m1, o1, m2, o2, **TOL)


def test_fp16_overflow_in_the_graph_skips_the_whole_accumulated_update():
    torch.manual_seed(2)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    batches = classification_batches(16, 16, device="cuda", seed=5)
    x, y = batches[11]
    batches[11] = (torch.full_like(x, float("inf")), y)  # an overflow in the 6th window
    step, losses, _ = run_accumulating(m1, o1, per_sample, batches, 2, amp="fp16", warmup=2,
                                       streams=1)
    scaler = grad_scaler_accumulation_loop(m2, o2, per_sample, batches, 2)
    assert step.stats()["replays"] == 14
    assert step._update.scaler.state_dict()["scale"] == scaler.get_scale()  # backed off once
    assert_same_training(m1, o1, m2, o2, **TOL)


def test_a_failed_call_leaves_the_window_where_it_was():
    torch.manual_seed(3)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    batches = classification_batches(12, 16, device="cuda", seed=6)
    step = nt.Step(m1, o1, per_sample, accumulate=3, warmup=2, streams=1)
    for b in batches[:4]:
        step(b)
    graph = step._graph.graph
    for point in ("after_staging", "after_copy_in"):  # the 2nd call of a window fails
        graph.fail_next_launch(point)
        with pytest.raises(RuntimeError, match="injected failure"):
            step(batches[4])
        assert step.stats()["micro_batch"] == 1 and step.stats()["steps"] == 4
    with pytest.raises(nt.ShapeError):
        step((batches[4][0][:, :5], batches[4][1]))
    for b in batches[4:]:
        step(b)
    torch.cuda.synchronize()
    assert graph.stale == 0
    eager_accumulation_loop(m2, o2, per_sample, batches, 3)
    assert_same_training(m1, o1, m2, o2, **TOL)


def _pool_bytes(k):
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = nt.Step(model, opt, per_sample, accumulate=k, warmup=1, streams=1)
    for x, y in classification_batches(2 * k + 2, 256, features=512, classes=10,
                                       device="cuda"):
        step((x, y))
    stats = step.stats()
    step.close()
    return stats["graphs"], stats["pool_bytes"]


def test_the_graphs_of_a_window_share_one_pool():
    graphs_one, one = _pool_bytes(1)
    graphs_four, four = _pool_bytes(4)
    assert (graphs_one, graphs_four) == (1, 3)
    assert four <= 1.2 * one, (four, one)


# ---------------------------------------------------------------------- EMA


@pytest.mark.parametrize("k", [1, 2])
def test_captured_ema_equals_a_hand_written_ema(k):
    torch.manual_seed(5)
    (m1, o1), (m2, o2) = twin(SmallCNN().cuda(), lambda p: torch.optim.SGD(p, lr=0.05,
                                                                          momentum=0.9))
    batches = classification_batches(10 * k, 16, image=True, device="cuda", seed=7)
    step = nt.Step(m1, o1, per_sample, ema=0.9, accumulate=k, warmup=2, streams=1)
    for b in batches:
        step(b)
    torch.cuda.synchronize()
    assert step.stats()["captured"]
    averages = hand_written_ema(m2, o2, per_sample, batches, 0.9, k)
    ema_state = step.ema_state_dict()
    for name, value in ema_state.items():
        if name in averages:
            torch.testing.assert_close(value, averages[name], **TOL, msg=name)
    assert_same_training(m1, o1, m2, o2, **TOL)
    with step.ema_weights():
        for name, value in m1.state_dict().items():
            assert torch.equal(value, ema_state[name]), name
    step(batches[0])  # the graph replays on the trained weights again


@pytest.mark.parametrize("name", ["adamw", "rmsprop"])
def test_a_trainer_style_loop_equals_eager_in_the_graph(name):
    """What transformers.Trainer does around Step: windows the epoch ends early
    (update=True), its own loss weights, ``model.zero_grad()`` (gradients to None) after every
    update, and a short micro-batch that runs eagerly in the middle of a window after replays:
    the eager call must add to what the window's graphs accumulated."""
    make = (OPTIMIZERS["adamw"] if name == "adamw"  # fused, or captured as it is
            else lambda p: torch.optim.RMSprop(p, lr=1e-3))
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(BatchNormMLP().cuda(), make)
    loss_fn = torch.nn.CrossEntropyLoss()
    windows = [3, 3, 2, 3, 3, 1, 3, 3]
    batches = classification_batches(sum(windows), 32, device="cuda", seed=4)
    short = 3 * 5 + 1  # the second call of the fifth window: 20 samples, eager (BatchNorm)
    batches[short] = classification_batches(1, 20, device="cuda", seed=9)[0]
    step = nt.Step(m1, o1, loss_fn, accumulate=3, warmup=3, streams=1, grad_clip=1.0)
    i, norms = 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RMSprop: "captures the optimizer's own step"
        for size in windows:
            for micro in range(size):
                last = micro == size - 1
                step(batches[i], update=True if last and size < 3 else None,
                     loss_weight=1.0 / size)
                i += 1
            assert step.stepped
            norms.append(step.grad_norm.clone())
            m1.zero_grad()  # set_to_none, as Trainer's loop does after each update
    # the eager loop with the same windows and weights
    i, expected = 0, []
    for size in windows:
        o2.zero_grad()
        for _ in range(size):
            x, y = batches[i]
            (loss_fn(m2(x), y) / size).backward()
            i += 1
        expected.append(torch.nn.utils.clip_grad_norm_(m2.parameters(), 1.0))
        o2.step()
    stats = step.stats()
    assert stats["replays"] > 0 and stats["eager_steps"] > 3, stats
    torch.testing.assert_close(torch.stack(norms), torch.stack(expected), **TOL)
    assert max_gap(m1, m2) < 1e-4


def test_gradients_set_to_none_mid_window_survive_the_move_to_the_fused_update():
    """warmup=2, accumulate=2: the update is fused at the second call, in the middle of the
    first window, after the loop set the first call's gradients to None (Lightning's zero_grad
    hook does): they must move into the flat buffers, and every later window accumulate."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), OPTIMIZERS["adamw"])
    batches = classification_batches(10, 16, device="cuda", seed=13)
    step = nt.Step(m1, o1, per_sample, accumulate=2, warmup=2, streams=1)
    for batch in batches:
        step(batch)
        o1.zero_grad()
    expected = eager_accumulation_loop(m2, o2, per_sample, batches, 2)
    assert step.stats()["replays"] > 0 and step.stats()["updates"] == 5 == len(expected) // 2
    assert_same_training(m1, o1, m2, o2, **TOL)


@pytest.mark.parametrize("seed", range(8))
def test_random_loops_in_graphs_equal_the_eager_loop_window_by_window(seed):
    """step_reference.random_loop on the GPU: every kind of call captured as it comes (a window
    of one included), short micro-batches padded in the graphs, loss weights staged."""
    step = random_loop(seed, "cuda", **TOL)
    assert step.stats()["phase"] == "replay", step.stats()
