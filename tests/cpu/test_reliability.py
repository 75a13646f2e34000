"""Nothing silently wrong: padding that proves itself, a template fixed only by a completed step,
clear errors for bad input, and a data-parallel job (2 gloo ranks) whose replicas agree and
whose failures end in DistributedError within the deadline.

The fault-injection matrix at the end runs every failure below and checks that it ends in the
error named, within its deadline, with the model and optimizer as after the last completed
step:

| fault                         | where                  | error                     |
|-------------------------------|------------------------|---------------------------|
| bad argument                  | nt.Step(...)           | ValueError / TypeError    |
| bad batch (dtype, shape)      | step(batch)            | ShapeError / the user's   |
| failure in the forward        | the model raises       | the user's error          |
| failure in the backward       | a gradient hook raises | the user's error          |
| failure in the update         | an optimizer pre-hook  | the user's error          |
| failure while staging         | the replay path (CUDA) | the injected error (GPU)  |
| a rank raises                 | 2 gloo ranks           | DistributedError on peers, naming it |
| a rank stalls                 | 2 gloo ranks           | DistributedError after timeout_s |
| a rank is killed              | 2 gloo ranks           | DistributedError on peers |

The staging failures run on a GPU only: tests/gpu/test_runtime_cuda.py and
tests/gpu/test_loop_cuda.py.
"""

import copy
import os
import socket
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import nimble_train as nt
from step_reference import MLP, assert_same_training, classification_batches, eager_loop, twin

per_sample = torch.nn.CrossEntropyLoss(reduction="none")


def snapshot(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def assert_as_snapshot(model, optimizer, saved):
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[0][name]), name
    now = optimizer.state_dict()["state"]
    assert now.keys() == saved[1]["state"].keys()
    for key, fields in now.items():
        for field, value in fields.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, saved[1]["state"][key][field]), (key, field)


# ---------------------------------------------------------------------- padding


class Centred(MLP):
    """Centres its hidden layer over the batch: every row depends on every other."""

    def forward(self, x):
        h = self.net[0](x)
        return self.net[3](torch.tanh(h - h.mean(0)))


def in_batch_negatives(outputs, target):
    """A contrastive loss per sample whose negatives are the other rows of the batch."""
    z = F.normalize(outputs, dim=1)
    logits = z @ z.t() / 0.1
    return F.cross_entropy(logits, torch.arange(len(z)), reduction="none")


@pytest.mark.parametrize("model_fn,loss_fn", [
    (Centred, per_sample), (MLP, in_batch_negatives),
], ids=["centred-over-the-batch", "in-batch-negatives"])
def test_a_model_that_mixes_samples_runs_short_batches_eagerly_and_exactly(model_fn, loss_fn):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(model_fn(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    batches = classification_batches(3, 16, seed=1) + classification_batches(1, 5, seed=2)
    step = nt.Step(m1, o1, loss_fn)
    for b in batches:
        step(b)
    eager_loop(m2, o2, loss_fn, batches)
    stats = step.stats()
    assert stats["padding"].startswith("refused: the model mixes samples"), stats["padding"]
    assert_same_training(m1, o1, m2, o2)


class Counting(MLP):
    """Keeps a running count in a buffer, as custom running statistics would."""

    def __init__(self, dropout):
        super().__init__(dropout=dropout)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += len(x)
        return super().forward(x)


def test_a_model_that_keeps_samples_apart_is_padded_even_with_dropout():
    torch.manual_seed(1)
    model = MLP(dropout=0.3)
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample)
    for b in classification_batches(3, 16, seed=3) + classification_batches(1, 5, seed=4):
        step(b)
    assert step.stats()["padding"] == "proven"  # the same masks in both of the check's passes


def test_the_padding_check_leaves_no_trace():
    from nimble_train._batch import BatchTemplate
    from nimble_train._iteration import Iteration
    from nimble_train._padding import mixing_reason

    torch.manual_seed(2)
    model = Counting(dropout=0.3)
    (x, y), = classification_batches(1, 16, seed=5)
    template = BatchTemplate((x, y))
    iteration = Iteration(model, per_sample, None, None, list(model.parameters()),
                          torch.device("cpu"), None, None, None)
    rng = torch.get_rng_state()
    assert mixing_reason(iteration.sample_losses, model, template, [x[:5], y[:5]], 5) is None
    assert torch.equal(torch.get_rng_state(), rng)  # no random numbers of the training's
    assert model.seen.item() == 0  # buffers as they were


# ---------------------------------------------------------------------- the template


def test_a_failed_first_call_does_not_fix_the_template():
    torch.manual_seed(2)
    (m1, o1), (m2, o2) = twin(MLP(), lambda p: torch.optim.SGD(p, lr=0.1))
    step = nt.Step(m1, o1, per_sample)
    x, y = classification_batches(1, 8, seed=5)[0]
    with pytest.raises(RuntimeError):  # float64 input into a float32 model: the user's error
        step((x.double(), y))
    assert step.stats()["phase"] == "template" and step.stats()["steps"] == 0
    batches = classification_batches(4, 8, seed=6)
    for b in batches:
        step(b)
    eager_loop(m2, o2, per_sample, batches)
    assert_same_training(m1, o1, m2, o2)


def test_the_batch_size_is_what_most_leaves_share_not_the_first_leaf():
    class Positions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 8)
            self.pos = torch.nn.Embedding(6, 8)
            self.out = torch.nn.Linear(8, 11)

        def forward(self, position_ids, input_ids, labels=None):
            return self.out(torch.tanh(self.emb(input_ids) + self.pos(position_ids)))

    def loss_fn(logits, batch):  # one loss per sample
        return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").mean(1)

    torch.manual_seed(3)
    (m1, o1), (m2, o2) = twin(Positions(), lambda p: torch.optim.SGD(p, lr=0.1))
    g = torch.Generator().manual_seed(7)

    def batch(n):
        return {"position_ids": torch.arange(6).unsqueeze(0),
                "input_ids": torch.randint(0, 11, (n, 6), generator=g),
                "labels": torch.randint(0, 11, (n, 6), generator=g)}
    batches = [batch(4), batch(4), batch(3)]
    step = nt.Step(m1, o1, lambda out, b: loss_fn(out, b))
    for b in batches:
        step(b)
    assert step.stats()["padding"] == "proven"  # the short one was padded, per sample
    for b in batches:
        o2.zero_grad()
        loss_fn(m2(b["position_ids"], b["input_ids"]), b).mean().backward()
        o2.step()
    assert_same_training(m1, o1, m2, o2)


def test_a_dict_with_its_keys_in_another_order_is_the_same_batch():
    torch.manual_seed(4)
    from step_reference import OwnLoss
    (m1, o1), (m2, o2) = twin(OwnLoss(), lambda p: torch.optim.SGD(p, lr=0.1))
    g = torch.Generator().manual_seed(8)
    batches = [{"input_ids": torch.randint(0, 11, (4, 5), generator=g),
                "labels": torch.randint(0, 11, (4, 5), generator=g)} for _ in range(4)]
    step = nt.Step(m1, o1)
    for i, b in enumerate(batches):
        step(b if i % 2 == 0 else {"labels": b["labels"], "input_ids": b["input_ids"]})
    eager_loop(m2, o2, None, batches)
    assert_same_training(m1, o1, m2, o2)


def test_small_mistakes_say_the_fix_before_anything_runs():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"grad_clip must be None or a positive number.*True"):
        nt.Step(model, opt, per_sample, grad_clip=True)
    with pytest.raises(ValueError, match="LBFGS re-evaluates the model through a closure"):
        nt.Step(model, torch.optim.LBFGS(model.parameters()), per_sample)
    saved = snapshot(model, opt)
    step = nt.Step(model, opt)  # no loss_fn
    x, y = classification_batches(1, 8)[0]
    with pytest.raises(TypeError, match=r"a tuple/list batch \(inputs, target\) needs a loss_fn"):
        step((x, y))
    with pytest.raises(nt.ShapeError, match="the first batch is empty"):
        nt.Step(model, opt, per_sample)((x[:0], y[:0]))
    assert_as_snapshot(model, opt, saved)


def _add_group(model, opt):
    opt.add_param_group({"params": list(model.net[3].parameters())})


def _append_to_group(model, opt):
    opt.param_groups[0]["params"].extend(model.net[3].parameters())


def _move_between_groups(model, opt):
    opt.param_groups[1]["params"].append(opt.param_groups[0]["params"].pop())


def _replace_in_group(model, opt):
    params = opt.param_groups[0]["params"]
    params[1] = torch.nn.Parameter(torch.randn_like(params[1]))


@pytest.mark.parametrize("change, said", [
    (_add_group, r"its param groups held \[2\] tensors, now \[2, 2\]"),
    (_append_to_group, r"its param groups held \[2\] tensors, now \[4\]"),
    (_move_between_groups, r"its param groups held \[1, 1\] tensors, now \[0, 2\]"),
    (_replace_in_group, r"param group 0's tensor 1 is another tensor than the one it held "
                        r"\(shape \(32,\), was \(32,\)\)"),
], ids=["group-added", "tensors-added-to-a-group", "tensor-moved-to-another-group",
        "tensor-replaced"])
@pytest.mark.parametrize("before_the_first_call", [False, True], ids=["later", "first-call"])
def test_a_change_of_the_optimizers_param_groups_after_construction_is_refused(
        change, said, before_the_first_call):
    """A param group added after the Step was built, or a group's tensors added to, removed,
    moved to another group (a learning rate of another group's) or replaced by another tensor
    (which the step would never update), is refused before the call runs anything, naming the
    groups' sizes or the tensor: at a later call, or at the first."""
    model = MLP()
    first = list(model.net[0].parameters())
    groups = [{"params": first}] if change is not _move_between_groups else \
        [{"params": first[:1]}, {"params": first[1:], "lr": 0.01}]
    opt = torch.optim.SGD(groups, lr=0.1)
    step = nt.Step(model, opt, per_sample)
    batches = classification_batches(2, 8)
    if not before_the_first_call:
        step(batches[0])
    change(model, opt)
    saved = snapshot(model, opt)
    with pytest.raises(ValueError, match=rf"the optimizer's parameters changed after nt.Step was "
                                         rf"built: {said}.*Nothing was run"):
        step(batches[1])
    assert_as_snapshot(model, opt, saved)


# ---------------------------------------------------------------------- one process: faults


def _hook_raises(*_):
    raise RuntimeError("injected failure")


FAULTS = {
    "forward": lambda m, o: m.net[0].register_forward_hook(_hook_raises),
    "backward": lambda m, o: m.net[0].weight.register_hook(_hook_raises),
    "update": lambda m, o: o.register_step_pre_hook(_hook_raises),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_failure_in_a_step_leaves_model_and_optimizer_as_after_the_last_one(fault, accumulate):
    torch.manual_seed(5)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = nt.Step(model, opt, per_sample, accumulate=accumulate)
    batches = classification_batches(6, 8, seed=9)
    for b in batches[:2 * accumulate]:
        step(b)
    saved = snapshot(model, opt)
    handle = FAULTS[fault](model, opt)
    with pytest.raises(RuntimeError, match="injected failure"):
        for b in batches[2 * accumulate:]:  # the update's fault comes at a window's end
            step(b)
    handle.remove()
    assert_as_snapshot(model, opt, saved)  # with accumulation: the window's update failed


# ---------------------------------------------------------------------- 2 gloo ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoHeads(torch.nn.Module):
    """Picks head a or b from the sign of its input: ranks use different heads."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(12, 16)
        self.a = torch.nn.Linear(16, 5)
        self.b = torch.nn.Sequential(torch.nn.Linear(16, 7), torch.nn.Linear(7, 5))

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.a(h) if x.sum() > 0 else self.b(h)


def _rank_batches(rank, n=4, size=8):
    g = torch.Generator().manual_seed(100 + rank)
    sign = 1.0 if rank == 0 else -1.0
    return [(torch.rand(size, 12, generator=g) * sign, torch.randint(0, 5, (size,), generator=g))
            for _ in range(n)]


def _loader_broke(*_):
    raise ValueError("rank 1's data loader broke")


def _scenario(rank, world, port, scenario, out, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    nt.init_distributed(timeout_s=timeout_s, device="cpu")
    result = {}
    try:
        torch.manual_seed(rank if scenario in ("seeds", "seeds-kept") else 0)
        model = TwoHeads() if scenario == "branch" else MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * (1 + (scenario == "lr") * rank),
                              momentum=0.9)
        step = nt.Step(model, opt, per_sample, init_sync=scenario != "seeds-kept", warmup=2)
        batches = (_rank_batches(rank) if scenario == "branch"
                   else classification_batches(4, 8, seed=rank))
        start = time.time()
        try:
            for i, b in enumerate(batches):
                if i == 2 and rank == 1 and scenario in ("raises", "stalls", "killed"):
                    if scenario == "raises":  # inside the step: its forward fails
                        model.net[0].register_forward_hook(_loader_broke)
                        step(b)
                    if scenario == "killed":
                        os._exit(3)
                    time.sleep(timeout_s + 8)  # alive, but not stepping
                    break
                result["before_last"] = copy.deepcopy((model.state_dict(), opt.state_dict()))
                step(b)
            if scenario == "extra-step" and rank == 0:
                nt.Step(model, opt, per_sample)(batches[0])  # a Step the other rank never makes
        except (nt.NimbleError, ValueError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["seconds"] = time.time() - start
        result["model"] = model.state_dict()
        result["optimizer"] = opt.state_dict()
    finally:
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        if scenario not in ("raises", "killed"):
            torch.distributed.destroy_process_group()


def _launch(scenario, timeout_s=30.0, world=2):
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_scenario, args=(r, world, port, scenario, out, timeout_s))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s + 60)
            if p.is_alive():
                p.kill()
                raise AssertionError(f"{scenario}: a rank did not end within its deadline")
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False)
                if os.path.exists(os.path.join(out, f"rank{r}.pt")) else None
                for r in range(world)]


def _same(state_a, state_b) -> bool:
    return all(torch.equal(a, b) for a, b in zip(state_a.values(), state_b.values()))


def test_ranks_taking_different_branches_average_over_every_parameter():
    results = _launch("branch")
    assert all("error" not in r for r in results), results
    assert _same(results[0]["model"], results[1]["model"])  # one replica
    # The reference: each rank's gradients, zeros for the head it did not use, averaged.
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step_batches in zip(_rank_batches(0), _rank_batches(1)):
        grads = []
        for x, y in step_batches:
            model.zero_grad()
            per_sample(model(x), y).mean().backward()
            grads.append([p.grad.clone() if p.grad is not None else None
                          for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            both = [g for g in (g0, g1) if g is not None]
            p.grad = None if not both else sum(both) / 2
        opt.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(results[0]["model"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=name)


def test_ranks_start_from_rank_0s_weights_unless_told_not_to():
    synced, kept = _launch("seeds"), _launch("seeds-kept")
    assert _same(synced[0]["model"], synced[1]["model"])
    assert not _same(kept[0]["model"], kept[1]["model"])


def test_ranks_with_different_hyper_parameters_fail_naming_them():
    results = _launch("lr")
    for r in results:
        assert "DistributedError" in r["error"] and "param_groups[0]" in r["error"], r["error"]
        assert "'lr'" in r["error"]


@pytest.mark.parametrize("scenario,deadline", [
    ("raises", 15.0), ("killed", 15.0), ("stalls", 5.0 + 15.0), ("extra-step", 5.0 + 15.0),
])
def test_a_failing_rank_ends_its_peers_with_distributed_error_within_the_deadline(scenario,
                                                                                   deadline):
    results = _launch(scenario, timeout_s=5.0)
    peer = results[0]
    assert peer["error"].startswith("DistributedError"), peer["error"]
    assert peer["seconds"] < deadline, peer["seconds"]
    if scenario == "raises":
        assert "rank 1: ValueError: rank 1's data loader broke" in peer["error"], peer["error"]
    if scenario != "extra-step":  # the failed call changed nothing on the peer
        before_model, before_opt = peer["before_last"]
        assert _same(peer["model"], before_model)


def test_captures_run_with_the_garbage_collector_paused_and_restored():
    import gc

    from nimble_train._capture import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with collector_paused():
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()  # a program that runs without it keeps it off
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
