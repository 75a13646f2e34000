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


# ------------------------------------------------------------ models under torch.compile

def attend(q, k, v, rows, keyword=True):
    """Attention with a broadcast mask built inside the traced code, as transformers does."""
    mask = rows.view(1, 1, 5, 1).expand(2, 1, 5, 5)
    if keyword:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, mask)


def attend_dense(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def dynamo_graph_after_the_pass(fn, *args):
    """fn compiled by dynamo with a backend that runs densify_masks over its graph: the
    rewritten graph, how many calls it rewrote, and the compiled result."""
    from nimble_train._inductor_masks import densify_masks
    seen = []

    def backend(gm, example_inputs):
        seen.append((densify_masks(gm.graph), gm.graph))
        gm.recompile()
        return gm
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend=backend)(*args)
    finally:
        torch._dynamo.reset()
    (count, graph), = seen
    return graph, count, out


def sdpa_masks(graph) -> list:
    """The mask node of each scaled_dot_product_attention call in a dynamo graph."""
    calls = [n for n in graph.nodes if n.target is F.scaled_dot_product_attention]
    return [n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None) for n in calls]


@pytest.mark.parametrize("keyword", [True, False], ids=["keyword", "positional"])
def test_the_pass_gives_a_traced_broadcast_mask_a_contiguous_copy(keyword):
    q, k, v = qkv(2)
    rows = torch.tensor([True, True, False, True, True])
    graph, count, out = dynamo_graph_after_the_pass(
        lambda *a: attend(*a, keyword=keyword), q, k, v, rows)
    assert count == 1
    mask, = sdpa_masks(graph)
    assert mask.op == "call_method" and mask.target == "contiguous"
    assert mask.args[0].target == "expand"  # the broadcast view, copied right before the call
    assert mask.meta["example_value"].stride(-1) == 1
    torch.testing.assert_close(out, attend(q, k, v, rows, keyword), rtol=0, atol=0)


def test_the_pass_leaves_dense_masks_and_calls_without_one():
    q, k, v = qkv(3)
    mask = torch.rand(2, 1, 5, 5) > 0.3
    graph, count, _ = dynamo_graph_after_the_pass(attend_dense, q, k, v, mask)
    assert count == 0 and sdpa_masks(graph)[0].op == "placeholder"
    graph, count, _ = dynamo_graph_after_the_pass(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    assert count == 0 and sdpa_masks(graph) == [None]


def test_inductor_compiles_with_the_pass_inside_the_block_only():
    """As Step's calls use it: inductor runs the pass on what it compiles within the block
    (the forward and the backward of the same result), and not after it."""
    from torch._inductor import config

    from nimble_train._inductor_masks import DenseMaskPass, compiled_dense_masks
    q, k, v = (t.requires_grad_() for t in qkv(4))
    rows = torch.tensor([True, False, True, True, True])
    expected = attend(q, k, v, rows)
    expected.sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    graph_pass = DenseMaskPass()
    torch._dynamo.reset()
    try:
        # compiled here, not served by inductor's caches, so that the pass runs and counts
        with compiled_dense_masks(graph_pass), config.patch(force_disable_caches=True):
            assert config.pre_grad_custom_pass is graph_pass
            out = torch.compile(attend)(q, k, v, rows)
        assert config.pre_grad_custom_pass is None
        out.sum().backward()
    finally:
        torch._dynamo.reset()
    assert graph_pass.masks == 1
    torch.testing.assert_close(out, expected)
    for t, g in zip((q, k, v), want):
        torch.testing.assert_close(t.grad, g)
