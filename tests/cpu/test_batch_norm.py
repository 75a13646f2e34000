"""The native batch-norm switch of planned captures (the CUDA part runs in tests/gpu)."""

import pytest
import torch
from torch import nn

from nimble_train._batch_norm import native_batch_norm, native_candidates


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
    with native_batch_norm(net) as layers:
        assert layers == 2  # bn and sync; not own
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
        with native_batch_norm(net):
            net(torch.randn(2, 5, 6, 6))
    assert not any("forward" in vars(m) for m in net.modules())
    enabled = torch.backends.cudnn.enabled

    def fail(module, args):
        raise ValueError("inside the layer")
    handle = net.bn.register_forward_pre_hook(fail)
    with pytest.raises(ValueError, match="inside the layer"):
        with native_batch_norm(net):
            net(torch.randn(2, 3, 6, 6))
    handle.remove()
    assert torch.backends.cudnn.enabled == enabled
    assert not any("forward" in vars(m) for m in net.modules())


def test_compiled_models_keep_their_batch_norms():
    net = Net()
    assert native_candidates(net) == [net.bn, net.own, net.sync]
    assert native_candidates(nn.Sequential(torch.compile(net))) == []
