"""Shape buckets: variable-length batches on a few captured graphs.

``nt.Buckets(sizes=(64, 128, 256, 512), dim=1, pad_values={"labels": -100})``: a batch whose
length along `dim` (the same for every tensor leaf that has that dimension) is at most a bucket
size is padded up to the smallest such size and runs on that bucket's graph. The padding is
done in C++ as the batch is copied into the bucket's static inputs (``LeafSpec.vary_dim``): the
real positions are copied, the rest of each row is set to the leaf's pad value (0 unless
`pad_values` names it). That is exact when the model masks padded positions, as a Hugging Face
model does with ``attention_mask`` 0 and labels -100 (the loss ignores them, and attention gives
them zero weight, so their gradients are exactly zero).

Here: the option's checks, and per batch template the layout of the buckets (which leaves vary,
their pad values, the static-input specs of each bucket, and the bucket of a length).
"""

from __future__ import annotations

import bisect
import numbers
import torch

from ._batch import BatchTemplate
from .errors import ShapeError


class Buckets:
    """Sequence-length buckets for nt.Step(..., buckets=...) and its evaluators.

    Args:
        sizes: the bucket lengths along `dim`, e.g. (64, 128, 256, 512); a batch is padded up
            to the smallest that fits it, and one longer than the largest is refused.
        dim: the varying dimension (1 for [batch, sequence] tensors; dimension 0 is the batch).
        pad_values: what fills a leaf's padded positions, by dict key for dict batches
            (``{"labels": -100}``) or by leaf position for tuple batches (``{2: -100}``);
            0 for any leaf not named (input ids of the pad token 0, attention mask 0). A named
            leaf without the dimension (sequence-classification labels) is left as it is.
        exact: True (the default): the first batch that is padded is checked once, its
            per-sample losses with the padding against those without it (_padding.py); a
            model whose losses move (labels padded with a class rather than -100, attention
            over the padding) is refused, saying so. False: trains on the padded batches as
            they are, unchecked (a model that pools over the padded length, knowingly).
    """

    def __init__(self, sizes, dim: int = 1, pad_values: dict | None = None, *,
                 exact: bool = True):
        try:
            sizes = tuple(sizes)
        except TypeError:
            raise TypeError(f"Buckets(sizes=...) must be a sequence of lengths such as "
                            f"(64, 128, 256, 512); got {sizes!r}") from None
        if not sizes or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                                and s >= 1 for s in sizes):
            raise ValueError(f"Buckets(sizes=...) must be positive integers such as "
                             f"(64, 128, 256, 512); got {sizes!r}")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"Buckets(sizes=...) has a size twice: {sizes!r}")
        if not isinstance(dim, numbers.Integral) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"Buckets(dim=...) must be a dimension >= 1 (dimension 0 is the "
                             f"batch; a short batch is padded there already); got {dim!r}")
        pad_values = dict(pad_values or {})
        for key, value in pad_values.items():
            if not isinstance(key, (str, numbers.Integral)) or isinstance(key, bool):
                raise TypeError(f"Buckets(pad_values=...) keys are dict keys (str) or leaf "
                                f"positions (int); got {key!r}")
            if not isinstance(value, numbers.Number):
                raise TypeError(f"Buckets(pad_values=...)[{key!r}] must be a number such as "
                                f"-100 or 0; got {value!r}")
        if not isinstance(exact, bool):
            raise TypeError(f"Buckets(exact=...) must be True or False; got {exact!r}")
        self.sizes = tuple(sorted(int(s) for s in sizes))
        self.dim = int(dim)
        self.pad_values = pad_values
        self.exact = exact

    def __repr__(self) -> str:
        exact = "" if self.exact else ", exact=False"
        return (f"nt.Buckets(sizes={self.sizes}, dim={self.dim}, "
                f"pad_values={self.pad_values}{exact})")


def check_buckets(buckets) -> None:
    if buckets is not None and not isinstance(buckets, Buckets):
        raise TypeError(f"buckets must be None or nt.Buckets(sizes=..., dim=..., "
                        f"pad_values=...); got {buckets!r}")


class BucketLayout:
    """The buckets of one batch template: the leaves that vary along `dim`, their pad values,
    and each bucket's static-input specs. Without buckets, one bucket: the template itself."""

    def __init__(self, template: BatchTemplate, buckets: Buckets | None):
        self.template, self.buckets = template, buckets
        leaves = template.tensor_leaves
        if buckets is None:
            self.sizes: tuple = (None,)
            self.varying: list[int] = []
            self.pads: dict[int, float] = {}
            return
        dim = buckets.dim
        self.sizes = buckets.sizes
        self.varying = [i for i, leaf in enumerate(leaves) if leaf.tensor.dim() > dim]
        if not self.varying:
            shapes = ", ".join(f"{leaf.path} {tuple(leaf.tensor.shape)}" for leaf in leaves)
            raise ShapeError(
                f"nt.Buckets(dim={dim}): no tensor of the batch has a dimension {dim} to pad "
                f"({shapes}). Give the sequence dimension (dim=1 for [batch, sequence] "
                "tensors).")
        # A named leaf without the dimension (classification labels [batch] beside token
        # labels elsewhere) has nothing to pad: its pad value is unused. An unknown name is
        # refused (a typo would leave labels padded with 0, counted by the loss).
        self.pads = {}
        for key, value in buckets.pad_values.items():
            index = self._leaf_of(key)
            if index in self.varying:
                self.pads[index] = float(value)
        lengths = {leaves[i].tensor.shape[dim] for i in self.varying}
        if len(lengths) > 1:
            found = ", ".join(f"{leaves[i].path} {leaves[i].tensor.shape[dim]}"
                              for i in self.varying)
            raise ShapeError(
                f"nt.Buckets(dim={dim}): every tensor with a dimension {dim} must have the same "
                f"length there (the batch's sequence length); got {found}.")
        # bucket index by length: one list lookup on the replay path
        self.by_length = [bisect.bisect_left(self.sizes, n) for n in range(self.sizes[-1] + 1)]
        self.lead = self.varying[0]

    def _leaf_of(self, key) -> int:
        leaves = self.template.tensor_leaves
        if isinstance(key, str):
            for i, leaf in enumerate(leaves):
                if leaf.path.startswith(f"batch[{key!r}]"):
                    return i
            keys = sorted({leaf.path.split("]")[0][len("batch["):] for leaf in leaves})
            raise ShapeError(f"nt.Buckets(pad_values=...) names {key!r}, which is not a key "
                             f"of the batch (its keys: {', '.join(keys)}).")
        if 0 <= key < len(leaves):
            return int(key)
        raise ShapeError(f"nt.Buckets(pad_values=...) names leaf position {key}, but the batch "
                         f"has {len(leaves)} tensors (positions 0 to {len(leaves) - 1}).")

    def bucket(self, tensors: list) -> int:
        """The bucket of a batch's tensor leaves (0 without buckets); ShapeError when the batch
        is longer than the largest."""
        if self.buckets is None:
            return 0
        dim, leaf = self.buckets.dim, self.template.tensor_leaves[self.lead]
        t = tensors[self.lead]
        if not isinstance(t, torch.Tensor) or t.dim() <= dim:
            return 0  # the static inputs' check names what is wrong
        length = t.shape[dim]
        if length > self.sizes[-1]:
            raise ShapeError(
                f"{leaf.path} has length {length} along dimension {dim}, longer than the "
                f"largest bucket ({self.sizes[-1]}); add a bucket of at least {length} to "
                f"nt.Buckets(sizes={self.sizes}), or truncate the batches (e.g. the "
                f"tokenizer's truncation=True, max_length={self.sizes[-1]}).")
        return self.by_length[length]

    def padded(self, tensors: list, bucket: int) -> list:
        """The tensor leaves padded to the bucket's length with their pad values (the batch the
        bucket's static inputs hold), as new tensors; the others as they are."""
        dim, size = self.buckets.dim, self.sizes[bucket]
        out = list(tensors)
        for i in self.varying:
            t = tensors[i]
            shape = list(t.shape)
            shape[dim] = size
            padded = t.new_full(shape, self.pads.get(i, 0.0))
            padded.narrow(dim, 0, t.shape[dim]).copy_(t)
            out[i] = padded
        return out

    def pad_values_said(self) -> str:
        """Each padded leaf's pad value, for messages."""
        leaves = self.template.tensor_leaves
        return ", ".join(f"{leaves[i].path} {self.pads.get(i, 0.0):g}" for i in self.varying)

    def specs(self, bucket: int) -> list[tuple]:
        """The static-input specs of a bucket (_C.StaticInputs, StepGraph.add_entry)."""
        specs = self.template.specs()
        if self.buckets is None:
            return specs
        dim, size = self.buckets.dim, self.sizes[bucket]
        out = []
        for i, (path, example, strides, batched) in enumerate(specs):
            if i not in self.varying:
                out.append((path, example, strides, batched))
                continue
            sizes = list(example.shape)
            sizes[dim] = size
            like = torch.empty((), dtype=example.dtype, device=example.device).expand(sizes)
            out.append((path, like, dense_strides(sizes, strides), batched, dim,
                        self.pads.get(i, 0.0)))
        return out


def dense_strides(sizes: list[int], like: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides for `sizes` with the dimensions ordered as in the strides `like` (a
    channels-last leaf stays channels-last)."""
    order = sorted(range(len(sizes)), key=lambda d: (like[d], -d))  # innermost first
    strides = [0] * len(sizes)
    step = 1
    for d in order:
        strides[d] = step
        step *= max(sizes[d], 1)
    return tuple(strides)
