"""The weight gradients of a torch.compile'd model, made where the update reads them.

A compiled backward makes each linear layer's weight gradient with a matrix product whose
result reaches the backward's output alone; under autocast it rounds the product to the
operands' half precision and then casts it to the float32 parameter's dtype, a kernel per
layer. Step then copies every gradient into the parameter's view of its flat gradient buffer
after the backward (the hand-over, _iteration.py). The post-grad pass here rewrites each such
product, and its cast, into one operator, ``nimble_train::weight_grad_mm``, which

- computes the product in the gradient's dtype: under autocast cuBLAS writes its float32
  accumulator as it is (``mm`` with ``out_dtype``), as the eager split of _weight_grads does,
  where the graph rounded it to bf16 and cast it back (FLOAT32_PRODUCTS);
- in a captured step that handed its gradients to autograd, writes it into the parameter's flat
  view, which autograd then keeps as the gradient: the copy after the backward has nothing to do
  for it, nor had the zeroing before (INTO_FLAT).

Which product is whose gradient is learned in eager steps: each rewritten product has a key
(its graph's digest and its place among the graph's outputs); an eager step that hands its
gradients to autograd records where each product put its result, in the order they were made,
and a parameter whose gradient autograd kept at that address is the last product's made there
(an earlier one's memory was freed before the allocator handed the address out again)
(:meth:`WeightProducts.learn`). A
captured step gives each learned product its parameter's view, once per backward
(:meth:`WeightProducts.writing`).

Nothing can go silently wrong if a key is shared by products of different parameters (two
copies of a compiled graph) or the learning was mistaken: after a captured backward every
gradient that lies in a flat buffer must be its own parameter's view, else the capture fails
with _iteration.MisdirectedGradient and is made again with the products written apart
(CapturedStep.capture). A product that reaches a gradient some other way (summed with another
gradient of the same parameter outside the graph) is copied in after the backward, over what
it wrote, as any gradient autograd made.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
from typing import Iterator

import torch

from . import _torch_private
from ._iteration import is_view, same_layout

aten = torch.ops.aten
prims = torch.ops.prims

# Under autocast, products in the gradient's dtype from cuBLAS's float32 accumulator (False:
# rounded to the operands' dtype and cast, as the graph had them).
FLOAT32_PRODUCTS = True
# Captured steps write the products into the parameters' flat gradient views.
INTO_FLAT = True

_KEY_BITS = 23  # a product's place among its graph's outputs: the key's low bits


class _Backward:
    """The running backward's products, for every thread (autograd runs a CUDA backward on a
    thread of its own): `targets`, key -> the flat view a captured step's product is written
    into (taken once); `made`, (key, address) of each of an eager step's products, in the order
    they were made."""
    targets: dict[int, torch.Tensor] | None = None
    made: list[tuple[int, int]] | None = None


_backward = _Backward()


def _product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b in `dtype` (into `out` if given)."""
    if a.dtype == dtype:
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    if FLOAT32_PRODUCTS and a.is_cuda and dtype == torch.float32:
        if out is None:
            return torch.mm(a, b, out_dtype=dtype)
        return torch.mm(a, b, out_dtype=dtype, out=out)
    result = torch.mm(a, b).to(dtype)  # the graph's own rounding and cast
    return result if out is None else out.copy_(result)


def _fits(view: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return (view.shape == (a.shape[0], b.shape[1]) and view.dtype == dtype
            and view.device == a.device and view.is_contiguous())


@torch.library.custom_op("nimble_train::weight_grad_mm", mutates_args=())
def weight_grad_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
                   key: int) -> torch.Tensor:
    """A weight gradient's product a @ b in `dtype`: into the flat view a captured step gave
    `key`, if any (a new alias of it, which autograd can keep), else into a new tensor."""
    targets = _backward.targets
    view = targets.pop(key, None) if targets else None
    if view is not None and _fits(view, a, b, dtype):
        _product(a, b, dtype, out=view)
        return view.detach()  # a tensor of its own over the view's memory
    result = _product(a, b, dtype)
    made = _backward.made
    if made is not None:
        made.append((key, result.data_ptr()))
    return result


@weight_grad_mm.register_fake
def _(a, b, dtype, key):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


def _digest(graph: torch.fx.Graph) -> int:
    text = "\n".join(f"{n.op} {n.target} {n.args} {n.kwargs}" for n in graph.nodes)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=5).digest(), "little")


def _cast_to(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype `node` casts its only input to, if it is a plain cast."""
    if node.op != "call_function":
        return None
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    if node.target is aten._to_copy.default and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def rewrite_weight_products(graph: torch.fx.Graph) -> int:
    """Rewrites `graph`, a post-grad graph, as the module docstring says: each ``mm`` of a
    backward whose result is one of the outputs, directly or through a cast alone, becomes
    ``weight_grad_mm``; returns how many."""
    if not _torch_private.is_backward_graph(graph):
        return 0
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    digest = _digest(graph)
    rewritten = 0
    for place, result in enumerate(results):
        if not isinstance(result, torch.fx.Node) or results.count(result) != 1:
            continue
        cast, product = None, result
        dtype = _cast_to(result)
        if dtype is not None:
            cast, product = result, result.args[0]
            if not isinstance(product, torch.fx.Node) or len(product.users) != 1:
                continue
        if product.op != "call_function" or product.target is not aten.mm.default:
            continue
        val = product.meta.get("val")
        if not isinstance(val, torch.Tensor) or len(result.users) != 1:
            continue
        dtype = dtype if dtype is not None else val.dtype
        if not (dtype.is_floating_point and val.dtype.is_floating_point):
            continue
        a, b = product.args
        with graph.inserting_before(result):
            node = graph.call_function(torch.ops.nimble_train.weight_grad_mm.default,
                                       (a, b, dtype, (digest << _KEY_BITS) | place))
        node.meta["val"] = result.meta.get("val")
        result.replace_all_uses_with(node)
        graph.erase_node(result)
        if cast is not None:
            graph.erase_node(product)
        rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten


class WeightProducts(_torch_private.custom_graph_pass_base()):
    """`rewrite_weight_products` as inductor's post-grad pass, and one Step's use of the
    products: `owner`, key -> the index of the parameter whose gradient the product is;
    `rewritten` counts the products rewritten (a graph inductor's cache served, rewritten when
    first compiled, is not counted); `written`, the products the last captured backward wrote
    into their parameters' views; `off`, why captures no longer do (None: they do)."""

    def __init__(self):
        self.rewritten = 0
        self.owner: dict[int, int] = {}
        self.written = 0
        self.off: str | None = None if INTO_FLAT else "INTO_FLAT is off"

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.rewritten += rewrite_weight_products(graph)

    def uuid(self):
        """Inductor's caches key compiled graphs on it: this file's contents."""
        with open(__file__, "rb") as source:
            return hashlib.sha256(source.read()).hexdigest()

    @contextlib.contextmanager
    def learning(self, handed: list, params: list[torch.Tensor]) -> Iterator[None]:
        """An eager backward within the block, whose parameters `handed` ((param, view)
        pairs) gave autograd their gradients, teaches which product is whose gradient;
        :meth:`learn` takes what it saw."""
        saved = _backward.made
        _backward.made = []
        try:
            yield
            self.learn(_backward.made, handed, params)
        finally:
            _backward.made = saved

    def learn(self, made: list[tuple[int, int]], handed: list,
              params: list[torch.Tensor]) -> None:
        """Each product that made one result, kept by autograd as the gradient of a handed
        parameter, is that parameter's. Two products made at one address did not live there
        together: the gradient there is the last one's (a product autograd summed into another
        gradient and freed may have given its address to a later one). A product made more
        than once, or whose result autograd did not keep, teaches nothing."""
        last: dict[int, int] = {}
        times = collections.Counter()
        for key, ptr in made:
            last[ptr] = key
            times[key] += 1
        index = {id(p): i for i, p in enumerate(params)}
        for p, view in handed:
            grad = p.grad
            if grad is None or not same_layout(grad, view):
                continue
            key = last.get(grad.data_ptr())
            if key is not None and times[key] == 1:
                self.owner[key] = index[id(p)]

    @contextlib.contextmanager
    def writing(self, handed: list, params: list[torch.Tensor]) -> Iterator[None]:
        """Within the block (a captured backward), each learned product of a handed parameter
        is written into that parameter's flat view."""
        views = {id(p): view for p, view in handed}
        targets = {}
        if self.off is None:
            for key, i in self.owner.items():
                view = views.get(id(params[i]))
                if view is not None:
                    targets[key] = view
        given = {id(view) for view in targets.values()}
        saved = _backward.targets
        _backward.targets = targets
        try:
            yield
        finally:
            _backward.targets = saved
            self.written = sum(1 for p, view in handed
                               if id(view) in given and is_view(p.grad, view))
