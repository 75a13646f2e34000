"""DenseAttentionMasks: scaled_dot_product_attention gets masks whose last dimension is
contiguous (the fused kernels' requirement), with the same result; nothing else changes."""

import pytest
import torch
import torch.nn.functional as F

from nimble_train._attention import DenseAttentionMasks, dense_mask


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 5, 4, generator=g) for _ in range(3)]


def broadcast_mask():
    """As Hugging Face builds one while a graph is captured: [B, 1, Q, K] expanded from a view
    whose last dimension has a stride of 0."""
    rows = torch.tensor([True, True, False, True, True]).view(1, 1, 5, 1)
    return rows.expand(2, 1, 5, 5)


def test_a_mask_with_a_zero_last_stride_becomes_contiguous():
    q, k, v = qkv()
    mask = broadcast_mask()
    assert mask.stride(-1) == 0
    for args, kwargs in (((q, k, v, mask), {}), ((q, k, v), {"attn_mask": mask})):
        new_args, new_kwargs = dense_mask(args, kwargs)
        given = new_kwargs.get("attn_mask", new_args[3] if len(new_args) > 3 else None)
        assert given.stride(-1) == 1 and torch.equal(given, mask)
        assert all(a is b for a, b in zip(new_args[:3], (q, k, v)))


@pytest.mark.parametrize("mask", [None, "dense", "row"], ids=["none", "dense", "one-row"])
def test_other_masks_pass_unchanged(mask):
    q, k, v = qkv()
    if mask == "dense":
        mask = torch.rand(2, 1, 5, 5) > 0.3
    elif mask == "row":
        mask = torch.zeros(2, 1, 5, 1).expand(2, 1, 5, 1)  # one key: nothing to make dense
    args, kwargs = dense_mask((q, k, v, mask), {})
    assert args[3] is mask and kwargs == {}


def test_the_mode_gives_sdpa_dense_masks_and_the_same_result():
    q, k, v = (t.requires_grad_() for t in qkv(1))
    mask = broadcast_mask()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    seen = []
    real = F.scaled_dot_product_attention

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is real:
                seen.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
            return func(*args, **kwargs)

    with Spy(), DenseAttentionMasks():  # the mode entered last sees a call first
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        other = torch.matmul(q, k.transpose(-1, -2))  # other calls pass through
    assert len(seen) == 1 and seen[0].stride(-1) == 1
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(other, q @ k.transpose(-1, -2))
    out.sum().backward()
    assert q.grad is not None and k.grad is not None
