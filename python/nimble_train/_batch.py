"""The batch template: structure, shapes, dtypes and devices, fixed by the first batch.

A captured graph reads its inputs from static buffers of fixed shape (``_C.StaticInputs``, or
an entry of ``_C.StepGraph``): every later batch is flattened into its tensor leaves, which C++
checks against the template and copies in. Here: the structure (tuple, list, dict nesting and
non-tensor entries, which a graph bakes in), and a fast flatten for batches built of plain
tuples, lists and dicts, the common case, where torch's pytree would cost more than the rest of
the replay path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ._torch_private import pytree
from .errors import ShapeError


@dataclass(frozen=True)
class Leaf:
    path: str  # "batch[0]", "batch['input_ids']"
    tensor: torch.Tensor | None  # the first batch's tensor; None for a non-tensor leaf
    batched: bool = False  # dimension 0 is the batch dimension
    value: Any = None  # a non-tensor leaf's value, which the graph bakes in


def describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"a tensor of shape {tuple(leaf.shape)}, {leaf.dtype}, on {leaf.device}"
    return f"{type(leaf).__name__} {leaf!r}"


class BatchTemplate:
    """The first batch's structure; flattens later batches and checks their structure."""

    def __init__(self, batch: Any):
        flat, self.treedef = pytree.tree_flatten_with_path(batch)
        tensors = [leaf for _, leaf in flat if isinstance(leaf, torch.Tensor)]
        self.batch_size = batch_size_of(tensors)
        if self.batch_size is None:
            raise TypeError(
                "a batch must contain tensors whose leading dimension is the batch size, as "
                f"(inputs, target) or a dict of tensors; got {type(batch).__name__} whose first "
                f"tensor is {describe(tensors[0]) if tensors else 'missing'}")
        if self.batch_size == 0:
            raise ShapeError(
                "the first batch is empty (0 samples along dimension 0); the first batch fixes "
                "the step's shapes and must be a full one. Skip empty batches.")
        self.leaves = []
        for key_path, leaf in flat:
            path = "batch" + pytree.keystr(key_path)
            if isinstance(leaf, torch.Tensor):
                batched = leaf.dim() >= 1 and leaf.shape[0] == self.batch_size
                self.leaves.append(Leaf(path, leaf, batched))
            else:
                self.leaves.append(Leaf(path, None, value=leaf))
        self.tensor_index = [i for i, leaf in enumerate(self.leaves) if leaf.tensor is not None]
        self.constants = [(i, leaf) for i, leaf in enumerate(self.leaves) if leaf.tensor is None]
        self._fast = _flattener(batch)

    @property
    def tensor_leaves(self) -> list[Leaf]:
        return [self.leaves[i] for i in self.tensor_index]

    def specs(self) -> list[tuple[str, torch.Tensor, tuple[int, ...], bool]]:
        """(path, example, strides, batched) per tensor leaf, for _C.StaticInputs: the static
        buffer keeps the first batch's dense layout (channels_last stays channels_last, so
        capture sees the tensors warm-up saw), or contiguous when it was not dense."""
        out = []
        for leaf in self.tensor_leaves:
            strides = torch.empty_like(leaf.tensor, device="meta").stride()
            out.append((leaf.path, leaf.tensor, tuple(strides), leaf.batched))
        return out

    def flatten(self, batch: Any) -> list[Any]:
        """All leaves of `batch` in template order; ShapeError when its structure differs."""
        if self._fast is not None:
            try:
                return self._fast(batch)
            except _Mismatch:
                pass  # pytree says what differs, or accepts what the fast path does not
        flat, treedef = pytree.tree_flatten(batch)
        if treedef != self.treedef:
            raise ShapeError(
                f"the batch's structure differs from the first batch's: expected {self.treedef}, "
                f"got {treedef}. Every batch must have the same form (same tuple or dict keys).")
        return flat

    def tensors(self, batch: Any) -> list[Any]:
        """The tensor leaves of `batch` (the C++ side checks them); non-tensor leaves must equal
        the first batch's: ShapeError otherwise."""
        flat = self.flatten(batch)
        for i, leaf in self.constants:
            if not _same_value(flat[i], leaf.value):
                raise ShapeError(
                    f"{leaf.path} was {leaf.value!r} in the first batch and is {flat[i]!r} now; "
                    "a captured step bakes non-tensor batch entries in. Keep them constant, or "
                    "pass them as tensors.")
        return [flat[i] for i in self.tensor_index]

    def explain_non_tensors(self, tensors: list[Any]) -> None:
        """Raises ShapeError naming the first tensor leaf that is not a tensor, if any."""
        for leaf, value in zip(self.tensor_leaves, tensors):
            if not isinstance(value, torch.Tensor):
                t = leaf.tensor
                raise ShapeError(f"{leaf.path} must be a tensor like the first batch's "
                                 f"({describe(t)}); got {describe(value)}")

    def unflatten(self, tensors: list[torch.Tensor]) -> Any:
        """The batch made of these tensor leaves and the template's constants."""
        flat = [leaf.value for leaf in self.leaves]
        for i, t in zip(self.tensor_index, tensors):
            flat[i] = t
        return pytree.tree_unflatten(flat, self.treedef)

    def unflatten_rows(self, buffers: list[torch.Tensor], samples: int) -> Any:
        """The batch made of the first `samples` rows of static buffers laid out like the
        template's tensor leaves (the batched ones narrowed; the others whole)."""
        if samples < self.batch_size:
            buffers = [b.narrow(0, 0, samples) if leaf.batched else b
                       for b, leaf in zip(buffers, self.tensor_leaves)]
        return self.unflatten(buffers)


def batch_size_of(tensors: list[torch.Tensor]) -> int | None:
    """The batch size: the leading size most tensors (of at least one dimension) share, the
    larger on a tie, so that a broadcast leaf such as position_ids [1, L] does not set it."""
    sizes = [t.shape[0] for t in tensors if t.dim() >= 1]
    if not sizes:
        return None
    return max(set(sizes), key=lambda n: (sizes.count(n), n))


class _Mismatch(Exception):
    """The batch is not shaped like the template (the fast path hands over to pytree)."""


def _flattener(template: Any) -> Callable[[Any], list[Any]] | None:
    """A function that flattens batches built exactly like `template` from plain tuples, lists
    and dicts (pytree's order: sequences in order, dicts in key order), raising _Mismatch on
    any other batch; None when the template holds other containers (named tuples, mappings of
    other types), which pytree flattens."""
    kind = type(template)
    if kind in (tuple, list, dict):
        keys = list(template) if kind is dict else list(range(len(template)))
        children = [_flattener(template[k]) for k in keys]
        if any(c is None for c in children):
            return None
        shape = frozenset(template) if kind is dict else len(template)

        def flatten(batch):
            # A dict's keys may come in another order: its leaves are taken in the template's.
            if type(batch) is not kind or _shape(batch) != shape:
                raise _Mismatch
            out = []
            for child, key in zip(children, keys):
                out += child(batch[key])
            return out
        return flatten
    leaves = pytree.tree_leaves(template)
    if isinstance(template, (tuple, list, dict)) or len(leaves) != 1 or leaves[0] is not template:
        return None  # a named tuple, another mapping, or a container registered with pytree
    return _leaf


def _shape(container: Any) -> Any:
    """What must match between a plain container and its template: the dict's keys (in any
    order: a key view equals the template's frozenset), or the sequence's length."""
    return container.keys() if type(container) is dict else len(container)


def _leaf(item: Any) -> list[Any]:
    if isinstance(item, (tuple, list, dict)):
        raise _Mismatch  # a container where the template has a leaf
    return [item]


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # objects whose == does not give a bool
        return a is b
