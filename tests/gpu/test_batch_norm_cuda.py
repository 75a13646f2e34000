"""Captured steps advance their batch norms' counters in one kernel at the end (see
nimble_train/_batch_norm.py): the same counts as the eager loop, one graph node for them all."""

import copy

import pytest
import torch
from torch import nn

import nimble_train as nt
from nimble_train import _batch_norm
from step_reference import assert_same_training, classification_batches, eager_loop

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_cudnn")]

per_sample = nn.CrossEntropyLoss(reduction="none")


class Net(nn.Module):
    """Two branches (several streams with "auto"), a batch norm called twice, a 1-d one."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.left = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.right = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.shared = nn.BatchNorm2d(8)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.stem(x)
        a, b = self.shared(self.left(x)), self.shared(self.right(x))
        return self.head(self.norm(torch.cat([a, b], 1).mean((2, 3))))


CALLS = 6  # batch-norm calls per forward: stem, left, right, shared twice, norm
LAYERS = 5


def counters(model):
    return {n: int(b) for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}


def make_opt(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("streams", [1, "auto"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_counters_and_the_training_are_the_eager_loops(streams, accumulate):
    torch.manual_seed(0)
    model = Net().cuda()
    reference = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    # Without accumulation: the warm-up and two graph steps, over which the eager loop is
    # compared (past them batch norms amplify the last-bit differences of the captured step:
    # see test_multistream_cuda.py's three_ways); with it, four updates.
    batches = classification_batches(4 * accumulate, 16, device="cuda", image=True)
    step = nt.Step(model, opt, per_sample, streams=streams, warmup=2, accumulate=accumulate)
    for b in batches:
        step(b)
    stats = step.stats()
    assert stats["captured"] and stats["replays"] > 0
    assert stats["batch_norm_counters"] == LAYERS
    assert counters(model) == {n: len(batches) * (2 if "shared" in n else 1)
                               for n in counters(model)}
    if accumulate == 1:  # the eager loop (accumulation's: test_loop_cuda.py)
        eager_loop(reference, ref_opt, per_sample, batches)
        assert counters(reference) == counters(model)
        assert_same_training(model, opt, reference, ref_opt, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("streams", [1, "auto"])
def test_one_graph_node_advances_every_counter(streams, monkeypatch):
    torch.manual_seed(0)
    batches = classification_batches(4, 16, device="cuda", image=True)
    nodes = {}
    for defer in (True, False):
        monkeypatch.setattr(_batch_norm, "DEFER_COUNTERS", defer)
        torch.manual_seed(0)
        model = Net().cuda()
        step = nt.Step(model, make_opt(model.parameters()), per_sample, streams=streams,
                       warmup=2)
        for b in batches:
            step(b)
        stats = step.stats()
        assert stats["captured"]
        assert stats["batch_norm_counters"] == (LAYERS if defer else 0)
        nodes[defer] = stats["graph_nodes"]
        assert counters(model)["shared.num_batches_tracked"] == 2 * len(batches)
        step.close()
    # each call's own add against one multi-tensor add for all of them
    assert nodes[False] - nodes[True] == CALLS - 1


def test_a_capture_failing_after_some_batch_norms_leaves_the_counters_as_they_were():
    torch.manual_seed(0)
    model = Net().cuda()
    opt = make_opt(model.parameters())
    batches = classification_batches(4, 16, device="cuda", image=True)
    step = nt.Step(model, opt, per_sample, streams="auto", warmup=2)
    while step.stats()["warmup_left"] > 0:
        step(batches[0])  # warm-up, eager: the next call captures
    before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())
    steps = counters(model)["stem.1.num_batches_tracked"]

    def fail(module, args):  # the last batch norm: the others have run, counters held back
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("injected failure inside the captured forward")
    handle = model.norm.register_forward_pre_hook(fail)
    with pytest.raises(nt.CaptureError, match="injected failure"):
        step(batches[1])
    handle.remove()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    for a, b in zip(opt.state_dict()["state"].values(), opt_before["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    assert counters(model)["shared.num_batches_tracked"] == 2 * steps
    assert all(isinstance(m._buffers.get("num_batches_tracked"), torch.Tensor)
               for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
    assert not any("forward" in vars(m) for m in model.modules())
    loss = step(batches[2])  # later calls run eagerly, and count as eager does
    assert torch.isfinite(loss)
    assert counters(model)["shared.num_batches_tracked"] == 2 * (steps + 1)
