"""The batch template: structure, shapes, dtypes and devices fixed by the first batch.

A captured graph reads its inputs from static buffers of fixed shape. Every later batch is
checked against the template and copied into those buffers; a batch with fewer samples than
the template fills only the leading rows (the rest are masked out of the loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .errors import ShapeError


@dataclass(frozen=True)
class _Leaf:
    path: str  # "batch[0]", "batch['input_ids']"
    shape: tuple[int, ...] | None  # None for a non-tensor leaf
    dtype: torch.dtype | None
    device: torch.device | None
    batched: bool  # leading dimension is the batch dimension
    value: Any = None  # a non-tensor leaf's value, which the graph bakes in
    # The first batch's memory layout (channels_last stays channels_last), or contiguous when
    # it was not dense: the static buffer keeps it, so capture sees the tensors warm-up saw.
    stride: tuple[int, ...] | None = None


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"a tensor of shape {tuple(leaf.shape)}, {leaf.dtype}, on {leaf.device}"
    return f"{type(leaf).__name__} {leaf!r}"


class BatchTemplate:
    """Shapes, dtypes and devices of the first batch; checks later batches against them."""

    def __init__(self, batch: Any):
        flat, self.treedef = pytree.tree_flatten_with_path(batch)
        tensors = [leaf for _, leaf in flat if isinstance(leaf, torch.Tensor)]
        if not tensors or tensors[0].dim() == 0:
            raise TypeError(
                "a batch must contain tensors whose leading dimension is the batch size, as "
                f"(inputs, target) or a dict of tensors; got {type(batch).__name__} whose first "
                f"tensor is {_describe(tensors[0]) if tensors else 'missing'}"
            )
        self.batch_size = tensors[0].shape[0]
        self.leaves = []
        for key_path, leaf in flat:
            path = "batch" + pytree.keystr(key_path)
            if isinstance(leaf, torch.Tensor):
                batched = leaf.dim() >= 1 and leaf.shape[0] == self.batch_size
                stride = torch.empty_like(leaf, device="meta").stride()  # dense layout kept
                self.leaves.append(_Leaf(path, tuple(leaf.shape), leaf.dtype, leaf.device, batched,
                                         stride=tuple(stride)))
            else:
                self.leaves.append(_Leaf(path, None, None, None, False, leaf))

    @property
    def tensor_leaves(self) -> list[_Leaf]:
        return [leaf for leaf in self.leaves if leaf.shape is not None]

    def check(self, batch: Any) -> tuple[list[Any], int]:
        """Returns the batch's leaves and its number of samples; raises ShapeError on mismatch."""
        flat, treedef = pytree.tree_flatten(batch)
        if treedef != self.treedef:
            raise ShapeError(
                f"the batch's structure differs from the first batch's: expected {self.treedef}, "
                f"got {treedef}. Every batch must have the same form (same tuple or dict keys)."
            )
        samples = None
        for spec, leaf in zip(self.leaves, flat):
            if spec.shape is None:
                if not _same_value(leaf, spec.value):
                    raise ShapeError(
                        f"{spec.path} was {spec.value!r} in the first batch and is {leaf!r} now; "
                        "a captured step bakes non-tensor batch entries in. Keep them constant, "
                        "or pass them as tensors."
                    )
                continue
            if not isinstance(leaf, torch.Tensor):
                raise ShapeError(f"{spec.path} must be {self._expected(spec)}; got {_describe(leaf)}")
            n = self._check_tensor(spec, leaf)
            if spec.batched:
                if samples is not None and n != samples:
                    raise ShapeError(
                        f"{spec.path} has {n} samples but an earlier entry of the batch has "
                        f"{samples}; all batched entries must agree."
                    )
                samples = n
        return flat, samples

    def _expected(self, spec: _Leaf) -> str:
        shape = ("N<=" + str(spec.shape[0]),) + spec.shape[1:] if spec.batched else spec.shape
        shape_text = "(" + ", ".join(str(s) for s in shape) + ")"
        return f"a tensor of shape {shape_text}, {spec.dtype}, on {spec.device}"

    def _check_tensor(self, spec: _Leaf, t: torch.Tensor) -> int:
        fix = (
            "The first batch fixed the template; pad or bucket inputs to that shape (a shorter "
            "last batch is handled), or build a Step per shape."
        )
        if t.dtype != spec.dtype or t.device != spec.device:
            raise ShapeError(f"{spec.path} must be {self._expected(spec)}; got {_describe(t)}. {fix}")
        if spec.batched:
            ok = t.dim() == len(spec.shape) and t.shape[1:] == spec.shape[1:]
            if ok and t.shape[0] > spec.shape[0]:
                raise ShapeError(
                    f"{spec.path} has {t.shape[0]} samples, more than the {spec.shape[0]} of the "
                    f"first batch; got {_describe(t)}. Use the same batch size throughout (the "
                    "first batch must be a full one), or build a Step for the larger size."
                )
            if ok and t.shape[0] >= 1:
                return t.shape[0]
        elif tuple(t.shape) == spec.shape:
            return spec.shape[0] if t.dim() else 1
        raise ShapeError(f"{spec.path} must be {self._expected(spec)}; got {_describe(t)}. {fix}")


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # objects whose == does not give a bool
        return a is b


class StaticBatch:
    """Static buffers shaped and laid out like the template's tensors, which a captured graph
    reads its inputs from."""

    def __init__(self, template: BatchTemplate, leaves: list[Any], samples: int):
        self.template = template
        self.leaves = [
            torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=spec.device)
            if spec.shape is not None else leaf
            for spec, leaf in zip(template.leaves, leaves)
        ]
        self.batch = pytree.tree_unflatten(self.leaves, template.treedef)
        self.copy_in(leaves, samples, fill_padding=True)

    def copy_in(self, leaves: list[Any], samples: int, fill_padding: bool = False) -> None:
        """Copies a checked batch in; a short one fills the leading `samples` rows.

        The other rows keep an earlier batch's samples: they are masked out of the loss, and
        being real data they are finite (a NaN there would still poison 0 * NaN in backward).
        `fill_padding` fills them with copies of the first sample, for the first batch.
        """
        for spec, static, leaf in zip(self.template.leaves, self.leaves, leaves):
            if spec.shape is None:
                continue
            if spec.batched and samples < spec.shape[0]:
                static[:samples].copy_(leaf, non_blocking=True)
                if fill_padding:
                    static[samples:].copy_(leaf[:1].expand_as(static[samples:]))
            else:
                static.copy_(leaf, non_blocking=True)
