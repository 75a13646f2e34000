"""Attention masks SDPA's fused kernels accept, in the graphs inductor compiles.

torch.compile traces a model, and Hugging Face's masking code (transformers 5.17, with no
attention mask given) builds in the traced graph the all-True broadcast mask it builds while a
CUDA graph is captured (see _attention.py). There SDPA's kernel is chosen once, as the graph is
traced: the math path, which for bfloat16 inputs computes in float32 (BERT-base b32 on an H100:
0.8 ms of float32 batched products a step, on CUDA cores). A mode around a compiled model would
make dynamo recompile it wherever the mode was not there before; instead :class:`DenseMaskPass`,
one of inductor's pre-grad passes (on dynamo's graph of torch functions, before autograd traces
it), inserts the same contiguous copy before each scaled_dot_product_attention whose mask needs
one, while Step's calls compile the model. This module loads inductor's; it is imported when a
compiled model needs it.
"""

from __future__ import annotations

import hashlib

import torch

from . import _torch_private
from ._attention import _MASK, _SDPA


def densify_masks(graph: torch.fx.Graph) -> int:
    """Rewrites dynamo's `graph` in place: each scaled_dot_product_attention whose mask's last
    dimension is not contiguous (as the traced example value says) reads a contiguous copy of
    it. Returns how many calls it rewrote."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        keyword = "attn_mask" in node.kwargs
        mask = node.kwargs["attn_mask"] if keyword else (
            node.args[_MASK] if len(node.args) > _MASK else None)
        if not isinstance(mask, torch.fx.Node) or not _traced_needs_copy(mask):
            continue
        with graph.inserting_before(node):
            dense = graph.call_method("contiguous", (mask,))
        dense.meta.update(mask.meta)
        try:
            dense.meta["example_value"] = mask.meta["example_value"].contiguous()
        except Exception:  # noqa: BLE001 (a value its fake mode cannot copy: none then)
            dense.meta.pop("example_value", None)
        if keyword:
            node.kwargs = {**node.kwargs, "attn_mask": dense}
        else:
            node.args = (*node.args[:_MASK], dense, *node.args[_MASK + 1:])
        rewritten += 1
    return rewritten


def _traced_needs_copy(mask: torch.fx.Node) -> bool:
    """_needs_copy for a traced value; a stride or size only known symbolically counts as
    dense (asking would add a guard to the compiled code)."""
    value = mask.meta.get("example_value", mask.meta.get("val"))
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    stride, size = value.stride(-1), value.size(-1)
    return (isinstance(stride, int) and stride != 1
            and not (isinstance(size, int) and size <= 1))


class DenseMaskPass(_torch_private.custom_graph_pass_base()):
    """:func:`densify_masks` as one of inductor's pre-grad passes; `masks` counts the calls
    it rewrote (a graph dynamo compiled before, or one inductor's caches serve, rewritten when
    first compiled, is not counted)."""

    def __init__(self):
        self.masks = 0

    def __call__(self, graph) -> None:
        self.masks += densify_masks(graph.graph if isinstance(graph, torch.fx.GraphModule)
                                    else graph)

    def uuid(self):
        """Inductor's caches key compiled graphs on it: this file's contents."""
        with open(__file__, "rb") as source:
            return hashlib.sha256(source.read()).hexdigest()


def compiled_dense_masks(graph_pass: DenseMaskPass):
    """Within the block, the graphs inductor compiles give SDPA dense masks (`graph_pass`
    counts them)."""
    return _torch_private.pre_grad_pass(graph_pass)
