"""HostState: what an optimizer captured as it is does outside the device in its step(), seen
between a snapshot and the step, and put back. The capture that uses it runs on a GPU
(tests/gpu/test_optimizer_state_cuda.py); here the optimizers step on the host, with "meta"
tensors standing for device tensors (neither on the CPU nor read by value)."""

import copy

import pytest
import torch

from nimble_train._optimizer_state import HostState, HostStateError
from step_reference import IntStepAdam, ReassigningAdam


class Scripted(torch.optim.Optimizer):
    """An optimizer whose step() does to its state what a test tells it to."""

    def __init__(self, params, action):
        super().__init__(params, dict(lr=0.1))
        self.action = action
        for p in self.param_groups[0]["params"]:
            self.state[p]["m"] = torch.zeros(p.shape, device="meta")
            self.state[p]["decay"] = 0.5

    def step(self, closure=None):
        self.action(self)


def params(n=2, device="cpu"):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(3, 4, device=device)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def name(k):
    return f"parameter {k}"


def stepped(optimizer, staged):
    """A snapshot taken, then one step(): what the check inside a capture meets."""
    host = HostState(optimizer, staged)
    host.take(name)
    optimizer.step()
    return host


def snapshot(optimizer):
    return copy.deepcopy(optimizer.state_dict())


def assert_same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for key, value in a["state"][k].items():
            other = b["state"][k][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (k, key)
            else:
                assert value == other, (k, key)


@pytest.mark.parametrize("make, seen", [
    (lambda ps: IntStepAdam(ps), "['step'] went from 1 to 2"),
    (lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
     "['step'] went from a CPU tensor 1.0 to a CPU tensor 2.0"),
], ids=["python-int-step", "adagrad-cpu-step"])
def test_a_step_count_advanced_on_the_host_is_refused_and_put_back(make, seen):
    ps = params()
    optimizer = make(ps)
    optimizer.step()  # warm-up made the state
    before = snapshot(optimizer)
    host = stepped(optimizer, [False])
    with pytest.raises(HostStateError) as error:
        host.check_and_keep()
    message = str(error.value)
    assert seen in message and "the state of parameter 0" in message, message
    assert "capturable=True" in message and "capture=False" in message
    host.restore()
    assert_same_state(snapshot(optimizer), before)
    host.release()
    assert not host.taken


def test_a_count_in_a_param_group_is_refused_and_put_back():
    ps = params()

    def action(opt):
        group = opt.param_groups[0]
        group["step"] = group.get("step", 0) + 1
        group["extra"] = 1.0

    optimizer = Scripted(ps, action)
    optimizer.param_groups[0]["step"] = 4
    host = stepped(optimizer, [False])
    with pytest.raises(HostStateError) as error:
        host.check_and_keep()
    assert "param_groups[0]['step'] went from 4 to 5 (and 1 more)" in str(error.value)
    host.restore()
    assert optimizer.param_groups[0]["step"] == 4 and "extra" not in optimizer.param_groups[0]


def test_the_optimizers_own_numbers_are_watched():
    ps = params()

    def action(opt):
        opt.t = opt.t + 1

    optimizer = Scripted(ps, action)
    optimizer.t = 7
    host = stepped(optimizer, [False])
    with pytest.raises(HostStateError, match=r"Scripted\.t went from 7 to 8"):
        host.check_and_keep()
    host.restore()
    assert optimizer.t == 7


def test_a_device_tensor_assigned_anew_goes_back_where_the_graph_reads_it():
    ps = params()
    new = {}

    def action(opt):
        for p in opt.param_groups[0]["params"]:
            new[id(p)] = opt.state[p]["m"] * 0.9  # out of place: a new tensor
            opt.state[p]["m"] = new[id(p)]

    optimizer = Scripted(ps, action)
    began = {id(p): optimizer.state[p]["m"] for p in ps}
    host = stepped(optimizer, [False])
    host.check_and_keep()  # nothing refused
    for p in ps:
        assert optimizer.state[p]["m"] is began[id(p)]  # the tensor the next replay reads
        assert optimizer.state[p]["m"] is not new[id(p)]


def test_a_device_tensor_assigned_in_another_shape_is_refused_and_put_back():
    ps = params()

    def action(opt):
        p = opt.param_groups[0]["params"][1]
        opt.state[p]["m"] = torch.zeros(5, device="meta")

    optimizer = Scripted(ps, action)
    began = optimizer.state[ps[1]]["m"]
    host = stepped(optimizer, [False])
    with pytest.raises(HostStateError, match=r"\['m'\] went from a meta tensor of shape "
                                             r"\(3, 4\) \(float32\) to a meta tensor of "
                                             r"shape \(5,\) \(float32\)"):
        host.check_and_keep()
    host.restore()
    assert optimizer.state[ps[1]]["m"] is began


def test_state_made_or_removed_in_the_step_is_refused_and_put_back():
    ps = params(3)

    def action(opt):
        del opt.state[ps[0]]["decay"]
        opt.state[ps[1]]["count"] = 1
        opt.state[ps[2]]["made"] = torch.zeros(1)  # state for a parameter that had none

    optimizer = Scripted(ps[:2], action)
    optimizer.add_param_group({"params": [ps[2]]})  # no state yet
    assert ps[2] not in optimizer.state
    before = {id(p): dict(optimizer.state[p]) for p in ps[:2]}
    host = stepped(optimizer, [False, False])
    with pytest.raises(HostStateError) as error:
        host.check_and_keep()
    message = str(error.value)
    assert "['decay'] was removed (and 2 more)" in message, message
    host.restore()
    assert ps[2] not in optimizer.state
    for p in ps[:2]:
        assert dict(optimizer.state[p]) == before[id(p)]


def test_a_step_that_changes_only_device_tensors_in_place_passes():
    ps = params()

    def action(opt):
        for p in opt.param_groups[0]["params"]:
            opt.state[p]["m"].mul_(0.9)

    optimizer = Scripted(ps, action)
    optimizer.param_groups[0]["betas"] = (0.9, 0.99)
    host = stepped(optimizer, [False])
    host.check_and_keep()


def test_a_staged_learning_rate_is_not_watched():
    """While capturing, a staged group's lr is the graph's device value (lr_on_device)."""
    ps = params()

    def action(opt):
        opt.param_groups[0]["lr"] = 0.2

    optimizer = Scripted(ps, action)
    host = stepped(optimizer, [True])
    host.check_and_keep()
    unstaged = HostState(optimizer, [False])
    unstaged.take(name)
    optimizer.param_groups[0]["lr"] = 0.3
    with pytest.raises(HostStateError, match=r"\['lr'\] went from 0.2 to 0.3"):
        unstaged.check_and_keep()


def test_nan_stays_nan_and_equal_values_in_new_objects_pass():
    ps = params()

    def action(opt):
        for p in opt.param_groups[0]["params"]:
            opt.state[p]["decay"] = float("nan")
            opt.state[p]["scale"] = torch.tensor([float("nan"), 1.0])

    optimizer = Scripted(ps, action)
    for p in ps:
        optimizer.state[p]["decay"] = float("nan")
        optimizer.state[p]["scale"] = torch.tensor([float("nan"), 1.0])
    host = stepped(optimizer, [False])
    host.check_and_keep()


def test_a_failed_capture_says_our_refusal_whole_and_cuts_foreign_messages():
    from nimble_train._capture import failure, root_message

    ps = params()
    optimizer = IntStepAdam(ps)
    optimizer.step()
    host = stepped(optimizer, [False])
    with pytest.raises(HostStateError) as refusal:
        host.check_and_keep()
    ours = str(refusal.value)
    assert len(ours) > 400 and ours.endswith("capture=False).")
    message = str(failure(False, root_message(refusal.value), []))
    assert ours in message and ".." not in message.replace("...,", ""), message
    assert message.endswith("later calls run eagerly (capture=False does that from the start).")
    foreign = str(failure(False, root_message(RuntimeError("x" * 1000)), []))
    assert "RuntimeError: " + "x" * 300 in foreign and "x" * 500 not in foreign


def test_state_kept_under_keys_of_its_own_is_watched_and_put_back():
    """Some optimizers keep global values in optimizer.state under a key of their own."""
    ps = params()

    def action(opt):
        opt.state["step"] += 1
        opt.state["global"]["decay"] *= 0.5

    optimizer = Scripted(ps, action)
    optimizer.state["step"] = 10
    optimizer.state["global"] = {"decay": 1.0}
    host = stepped(optimizer, [False])
    with pytest.raises(HostStateError) as error:
        host.check_and_keep()
    message = str(error.value)
    assert "optimizer.state['global']['decay'] went from 1.0 to 0.5 (and 1 more)" in message, \
        message
    host.restore()
    assert optimizer.state["step"] == 10 and optimizer.state["global"] == {"decay": 1.0}


@pytest.mark.parametrize("make", [IntStepAdam, ReassigningAdam])
def test_the_hand_written_adams_the_gpu_tests_use_are_torch_adam(make):
    """Their state is kept otherwise (which the GPU tests are about); their update is Adam's."""
    ours, reference = params(), params()
    a, b = make(ours, lr=1e-2), torch.optim.Adam(reference, lr=1e-2, eps=1e-8)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(ours, reference):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, reference):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_device_scalar_is_named_without_reading_it():
    """Inside a capture, reading a device value would synchronise: the message shows its shape
    and dtype (a meta tensor, which cannot be read, stands for it)."""
    ps = params()

    def action(opt):
        opt.state[ps[0]]["count"] = torch.zeros((), dtype=torch.float64, device="meta")

    optimizer = Scripted(ps, action)
    optimizer.state[ps[0]]["count"] = torch.zeros((), device="meta")
    host = stepped(optimizer, [False])
    with pytest.raises(HostStateError, match=r"\['count'\] went from a meta tensor of shape "
                                             r"\(\) \(float32\) to a meta tensor of shape "
                                             r"\(\) \(float64\)"):
        host.check_and_keep()
