"""The batch norms of captures: the native-kernel switch of planned ones, and the batch counters
advanced together (the CUDA part runs in tests/gpu)."""

import pytest
import torch
from torch import nn

from nimble_train._batch_norm import CapturedBatchNorms, candidates, defers_counter


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.own = nn.BatchNorm2d(4)
        self.sync = nn.SyncBatchNorm(4)
        self.ln = nn.LayerNorm(4)

    def forward(self, x):
        return self.ln(self.own(self.bn(self.conv(x))).mean((2, 3)))


def seen_cudnn_switch(module):
    """Records torch.backends.cudnn.enabled as the class's forward of `module` sees it."""
    seen = []
    cls = type(module)

    class Recording(cls):
        def forward(self, x):
            seen.append(torch.backends.cudnn.enabled)
            return cls.forward(self, x)
    module.__class__ = Recording
    return seen


def test_batch_norms_run_with_cudnn_off_inside_the_block_and_are_restored():
    torch.manual_seed(0)
    net = Net()
    net.own.forward = net.own.forward  # a forward of the user's own: left alone
    seen_bn, seen_own = seen_cudnn_switch(net.bn), seen_cudnn_switch(net.own)
    x = torch.randn(2, 3, 6, 6)
    reference = net(x)
    flags = (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32)
    with CapturedBatchNorms(net, native=True) as norms:
        assert norms.native_layers == 2  # bn and sync; not own
        torch.testing.assert_close(net(x), reference)
        assert torch.backends.cudnn.enabled == flags[0]  # only inside the layers' forward
    assert seen_bn == [flags[0], False]
    assert all(s == flags[0] for s in seen_own)
    assert "forward" not in vars(net.bn) and "forward" not in vars(net.sync)
    assert "forward" in vars(net.own)
    assert (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32) == flags


def test_the_layers_are_restored_when_the_block_raises():
    net = Net()
    with pytest.raises(RuntimeError, match="shape|size|channels"):
        with CapturedBatchNorms(net, native=True):
            net(torch.randn(2, 5, 6, 6))
    assert not any("forward" in vars(m) for m in net.modules())
    enabled = torch.backends.cudnn.enabled

    def fail(module, args):
        raise ValueError("inside the layer")
    handle = net.bn.register_forward_pre_hook(fail)
    with pytest.raises(ValueError, match="inside the layer"):
        with CapturedBatchNorms(net, native=True):
            net(torch.randn(2, 3, 6, 6))
    handle.remove()
    assert torch.backends.cudnn.enabled == enabled
    assert not any("forward" in vars(m) for m in net.modules())


def test_compiled_models_keep_their_batch_norms():
    net = Net()
    assert candidates(net) == [net.bn, net.own, net.sync]
    assert candidates(nn.Sequential(torch.compile(net))) == []
    net.compile()  # in place
    assert candidates(net) == [] and candidates(nn.Sequential(net)) == []


class Counting(nn.Module):
    """A batch norm called twice, one with momentum=None (a cumulative average: its counter
    feeds the running statistics), one without running statistics."""

    def __init__(self):
        super().__init__()
        self.twice = nn.BatchNorm2d(4)
        self.cumulative = nn.BatchNorm2d(4, momentum=None)
        self.untracked = nn.BatchNorm2d(4, track_running_stats=False)
        self.once = nn.BatchNorm1d(4)

    def forward(self, x):
        x = self.twice(self.twice(x) * 2 + 1)
        x = self.untracked(self.cumulative(x))
        return self.once(x.mean((2, 3)))


def _state(net):
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_the_batch_counters_advance_together_when_the_block_ends():
    torch.manual_seed(0)
    net, reference = Counting(), Counting()
    reference.load_state_dict(net.state_dict())
    x = torch.randn(3, 4, 5, 5)
    expected = reference(x)
    counters = {n: b for n, b in net.named_buffers() if n.endswith("num_batches_tracked")}
    assert set(counters) == {"twice.num_batches_tracked", "cumulative.num_batches_tracked",
                             "once.num_batches_tracked"}
    norms = CapturedBatchNorms(net, native=False, defer=True)
    with norms:
        out = net(x)
        # inside the block only the cumulative average's counter has moved (it reads it)
        assert [int(counters[n]) for n in sorted(counters)] == [1, 0, 0]
        assert net.twice.num_batches_tracked is counters["twice.num_batches_tracked"]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    after = _state(net)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)
    assert int(net.twice.num_batches_tracked) == 2  # called twice: two
    assert norms.counters == 2  # twice and once; not the cumulative average
    assert not any("forward" in vars(m) for m in net.modules())


def test_counters_count_each_call_as_eager_does_and_not_in_evaluation():
    torch.manual_seed(1)
    net, reference = Counting(), Counting()
    reference.load_state_dict(net.state_dict())
    x = torch.randn(2, 4, 3, 3)
    for _ in range(3):  # three blocks, as three captured steps would replay
        with CapturedBatchNorms(net, native=False, defer=True):
            net(x)
        reference(x)
    net.eval()
    reference.eval()
    with CapturedBatchNorms(net, native=False, defer=True) as norms:
        torch.testing.assert_close(net(x), reference(x), rtol=0, atol=0)
    assert norms.counters == 0
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(net.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert int(net.twice.num_batches_tracked) == 6


def test_counters_left_to_each_layer_when_deferring_is_off():
    net = Counting()
    with CapturedBatchNorms(net, native=False, defer=False) as norms:
        net(torch.randn(2, 4, 3, 3))
        assert int(net.twice.num_batches_tracked) == 2  # at each call, as eager
    assert norms.counters == 0 and int(net.twice.num_batches_tracked) == 2


def test_an_error_in_the_block_leaves_the_counters_and_the_layers_as_they_were():
    net = Counting()
    counters = [b for n, b in net.named_buffers() if n.endswith("num_batches_tracked")]
    before = _state(net)
    with pytest.raises(RuntimeError, match="boom"):
        with CapturedBatchNorms(net, native=False, defer=True):
            net(torch.randn(2, 4, 3, 3))
            raise RuntimeError("boom")
    assert [b for n, b in net.named_buffers() if n.endswith("num_batches_tracked")] == counters
    assert int(net.twice.num_batches_tracked) == 0 and int(net.once.num_batches_tracked) == 0
    assert int(net.cumulative.num_batches_tracked) == 1  # it counted as eager does

    def fail(module, args):
        raise ValueError("inside the layer")
    handle = net.once.register_forward_pre_hook(fail)
    with pytest.raises(ValueError, match="inside the layer"):
        with CapturedBatchNorms(net, native=False, defer=True):
            net(torch.randn(2, 4, 3, 3))
    handle.remove()
    assert net.twice.num_batches_tracked is counters[0]  # the buffer is back
    assert int(net.twice.num_batches_tracked) == 0
    assert not any("forward" in vars(m) for m in net.modules())
    assert before.keys() == net.state_dict().keys()


def test_a_subclass_with_a_forward_of_its_own_counts_as_it_does():
    class Own(nn.BatchNorm2d):
        def forward(self, x):  # reads its counter: must see every call at once
            out = super().forward(x)
            return out + self.num_batches_tracked.to(out.dtype)
    net = nn.Sequential(Own(2))
    with CapturedBatchNorms(net, native=False, defer=True) as norms:
        out = net(torch.zeros(2, 2, 1, 1))
    assert norms.counters == 0
    torch.testing.assert_close(out, torch.ones(2, 2, 1, 1))
    assert not defers_counter(nn.SyncBatchNorm(2))
