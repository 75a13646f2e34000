"""Runs a model's forward on several CUDA streams, as planned by Nimble's stream assignment.

The forward is traced with torch.fx into a DAG of operators (module calls, functions,
methods); src/streams assigns each operator a stream (nimble_train._C.assign_streams). While
the step is captured, each operator runs on its stream and waits, through an event, on the
producers the plan marks as synchronisations; every other cross-stream dependency is implied
by stream order. Autograd runs each backward kernel on the stream of its forward operator and
inserts the waits where gradients cross streams, so the one plan covers the backward too.

Data edges alone would miss what an operator changes in place: a batch norm called twice (on
two branches) updates its running statistics twice, a `relu_` or `x.add_(y)` writes a tensor
other operators read. The graph gets an edge for each such pair, in the order the forward runs
them: the calls of one module that holds buffers follow one another and the operators that
read those buffers, and an operator that writes a tensor in place comes after every earlier
operator and before every later one that reads the same storage (aliasing from the fake run
below; without it, after and before every operator). The trace reads buffers as the forward
runs (fx's proxy_buffer_attributes), not as constants taken when it was traced.

The cost option: an operator too small to gain from running side by side (a view, a shape
query, an element-wise kernel on a few hundred kilobytes) would still cost a fork and a join
on a stream of its own, and keep its inputs out of reuse until the capture ends. Sizes come
from one run of the traced forward on fake tensors shaped like the batch; an operator that is
not a product (convolution, matrix product, attention) and moves fewer than
SMALL_OPERATOR_BYTES, and follows its only producer, is planned as part of that producer: it
runs on its producer's stream, right after it.
"""

from __future__ import annotations

import inspect
import operator
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from . import _torch_private
from ._batch_norm_act import BatchNormAct, fuse_batch_norm_act
from ._extension import _C
from ._sync import warn_at_user
from ._torch_private import pytree
from .errors import one_line

_OPS = ("call_module", "call_function", "call_method")

# Why a traced forward gets no plan when nothing in it can run side by side.
CHAIN = "the traced forward is a chain: no two operators can run side by side"

# With no limit asked for, more streams than this buy nothing on a GPU that runs a handful of
# small kernels side by side, and each stream adds joins at the end of the step.
AUTO_MAX_STREAMS = 8

# Below this many bytes read and written, an element-wise or reduction kernel is over in about
# the time of the fork and join a stream of its own would add (about 1 µs at 1-3 TB/s).
SMALL_OPERATOR_BYTES = 1 << 20

# Products: their time grows with arithmetic, not bytes, so none is small.
_PRODUCT_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                    nn.ConvTranspose3d, nn.Linear, nn.Bilinear, nn.MultiheadAttention,
                    nn.RNNBase)
_PRODUCT_FUNCTIONS = {F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d,
                      F.conv_transpose2d, F.conv_transpose3d, F.scaled_dot_product_attention,
                      torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                      torch.einsum, operator.matmul}
_PRODUCT_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__"}

# Functions that write their first argument (augmented assignment on a value fx records as
# a tensor; on a Proxy Python falls back to the plain operator, which writes nothing).
_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift}
_INPLACE_METHODS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__",
                    "__ilshift__", "__irshift__"}


@dataclass
class OperatorGraph:
    """The traced forward as a DAG: `nodes[i]` is operator i, edges go producer -> consumer."""

    module: torch.fx.GraphModule
    nodes: list[torch.fx.Node]
    edges: list[tuple[int, int]]
    fused: int = 0  # batch norms fused with their activation (fuse_norms)


class AssignsModuleState(Exception):
    """The forward assigns module state that a traced graph would not keep."""


class _ModelState:
    """Every module's attributes and its tables of children, parameters and buffers, as before
    a trace. fx runs the forward's Python on proxies: what it assigns (``self.avg = 0.9 *
    self.avg + ...``, an out-of-place running average) lands in the model as a proxy, and the
    traced graph computes the value without assigning it."""

    def __init__(self, model: nn.Module):
        self._saved = [(name, m, [(table, dict(table)) for table in _tables(m)])
                       for name, m in model.named_modules()]

    def changed(self) -> list[str]:
        """What the trace assigned, added or deleted: 'name.attribute' each."""
        out = []
        for name, _, tables in self._saved:
            for table, old in tables:
                out += [".".join(part for part in (name, str(k)) if part)
                        for k in {**old, **table} if table.get(k, _GONE) is not old.get(k, _GONE)]
        return out

    def restore(self) -> None:
        for _, _, tables in self._saved:
            for table, old in tables:
                if len(table) != len(old) or any(table.get(k, _GONE) is not v
                                                 for k, v in old.items()):
                    table.clear()
                    table.update(old)


class _DataAssignments:
    """While a trace runs: the traced values the forward gives new data (``self.avg.data =
    0.9 * self.avg + ...``, a buffer's or a parameter's), which fx takes as a plain attribute
    of the proxy, so that the traced graph computes the value without assigning it."""

    def __init__(self):
        self.names: list[str] = []

    def __enter__(self) -> _DataAssignments:
        names, self._had = self.names, vars(torch.fx.Proxy).get("__setattr__")
        assign = self._had or object.__setattr__

        def setattr_(proxy, name, value):
            if name == "data":
                node = vars(proxy).get("node")  # an Attribute's is made lazily: left alone
                held = node is not None and node.op == "get_attr"
                names.append(f"{node.target if held else 'a tensor'}.data")
            assign(proxy, name, value)
        torch.fx.Proxy.__setattr__ = setattr_
        return self

    def __exit__(self, *exc) -> None:
        if self._had is None:
            del torch.fx.Proxy.__setattr__
        else:
            torch.fx.Proxy.__setattr__ = self._had


_GONE = object()
_FX_CONSTANT = re.compile(r"_tensor_constant\d+")


def _tables(module: nn.Module) -> list[dict]:
    return [vars(module), module._modules, module._parameters, module._buffers]


def trace_operators(model: torch.nn.Module, fuse_norms: bool = False) -> OperatorGraph:
    """Traces `model` with torch.fx; raises what fx raises when the model is not traceable,
    and AssignsModuleState when its forward assigns module state, or makes a tensor from Python
    values alone, which the trace would freeze (fresh noise, torch.randn(4, 8), made once): the
    model is left as it was either way. Buffers are read when the forward runs (a batch norm's
    running mean read by the model's own code), not folded into constants of the trace.
    `fuse_norms`: batch norms and the ReLUs after them become single operators
    (_batch_norm_act)."""
    tracer = torch.fx.Tracer()
    tracer.proxy_buffer_attributes = True
    state = _ModelState(model)
    try:
        with _DataAssignments() as data:
            traced = tracer.trace(model)
    finally:
        assigned = state.changed()
        state.restore()
    assigned += data.names
    # fx's own: a tensor the forward makes from Python values, held by the trace's root
    constants = [name for name in assigned if _FX_CONSTANT.fullmatch(name)]
    assigned = [name for name in assigned if name not in constants]
    if assigned:
        raise AssignsModuleState(
            f"the forward assigns {', '.join(assigned[:3])}"
            f"{f' and {len(assigned) - 3} more' if len(assigned) > 3 else ''}, which a traced "
            "graph computes without assigning; the model's own forward runs it")
    if constants:
        raise AssignsModuleState(
            f"the forward makes {len(constants)} tensor(s) from Python values alone "
            "(torch.tensor(...), torch.randn(4, 8)), which a traced graph would hold as "
            "constants made once; the model's own forward runs it")
    module = torch.fx.GraphModule(tracer.root, traced, type(model).__name__)
    fused = fuse_batch_norm_act(module) if fuse_norms else 0
    nodes = [n for n in module.graph.nodes if n.op in _OPS]
    index = {n: i for i, n in enumerate(nodes)}
    edges = sorted({(index[u], index[v]) for v in nodes for u in v.all_input_nodes if u in index})
    return OperatorGraph(module, nodes, edges, fused)


def written_input(module: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node | None:
    """The input `node` writes in place, if any: a method or function named with a trailing
    underscore (``x.add_``, ``torch.relu_``), an in-place operator, a call with
    ``inplace=True``, or a module built with ``inplace=True`` (``nn.ReLU(True)``)."""
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node):
        return None
    if node.op == "call_method":
        name = node.target
        writes = name in _INPLACE_METHODS or (name.endswith("_") and not name.startswith("_"))
    elif node.op == "call_module":
        writes = getattr(module.get_submodule(node.target), "inplace", False) is True
    else:
        name = getattr(node.target, "__name__", "")
        writes = (node.target in _INPLACE_FUNCTIONS
                  or (name.endswith("_") and not name.startswith("_"))
                  or _inplace_argument(node) is True)
    return first if writes else None


def _inplace_argument(node: torch.fx.Node):
    """The value of a call's `inplace` parameter (F.relu(x, True), F.dropout(..., inplace=...))."""
    if "inplace" in node.kwargs:
        return node.kwargs["inplace"]
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # builtins without a signature, or a call it refuses
        return None
    return bound.arguments.get("inplace")


def state_edges(graph: OperatorGraph, aliasing: bool) -> set[tuple[int, int]]:
    """The edges that order what operators change in place (see the module's docstring), each
    from the earlier operator to the later. `aliasing`: the nodes hold their fake values
    (operator_bytes ran), which say which tensors share storage; otherwise an operator that
    writes in place is ordered against every other."""
    module, nodes = graph.module, graph.nodes
    edges: set[tuple[int, int]] = set()
    last_call: dict[str, int] = {}
    owners = {i: _state_owner(module, node) for i, node in enumerate(nodes)
              if node.op == "call_module"}
    stateful = [i for i, owner in owners.items()
                if any(True for _ in module.get_submodule(owner).buffers())]
    for i in stateful:
        target = owners[i]
        if target in last_call:
            edges.add((last_call[target], i))
        last_call[target] = i
        # operators that read the module's state directly (self.norm.running_mean)
        edges |= _ordered(i, nodes, lambda u, target=target: u.op == "get_attr"
                          and u.target.startswith(target + "."))
    for i, node in enumerate(nodes):
        written = written_input(module, node)
        if written is not None:
            edges |= _ordered(i, nodes, lambda u, written=written: not aliasing
                              or _aliased(written, u))
    return edges


def _state_owner(module: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """The path of the module whose state a call_module node changes: its target, or for a
    batch norm fused with its ReLU, the batch norm's."""
    called = module.get_submodule(node.target)
    return called.layer_name if isinstance(called, BatchNormAct) else node.target


def _ordered(i: int, nodes: list[torch.fx.Node], touches) -> set[tuple[int, int]]:
    """Edges between operator i and every other operator with an input that `touches`
    says shares its state, from the earlier of the two to the later."""
    return {(min(i, j), max(i, j)) for j, other in enumerate(nodes)
            if j != i and any(touches(u) for u in other.all_input_nodes)}


def _aliased(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether the values of two nodes share storage, from their fake values (True when a
    node has none: unknown)."""
    if a is b:
        return True
    if "val" not in a.meta or "val" not in b.meta:
        return True
    return any(_torch_private.shares_storage(x, y) for x in _tensors(a.meta["val"])
               for y in _tensors(b.meta["val"]))


def operator_bytes(graph: OperatorGraph, args: tuple, kwargs: dict) -> list[int] | None:
    """The bytes each operator reads and writes, from one run of the traced forward on fake
    tensors shaped like `args` and `kwargs`: 0 where no kernel runs (a view, whose outputs
    share storage with an input; a shape query, which makes no tensor); None for every
    operator when the fake run fails (data-dependent shapes, say)."""
    try:
        _torch_private.fake_tensor_values(graph.module,
                                          tuple(positional(graph.module, args, kwargs)))
    except Exception:  # an optimisation: the plan then has no small operators
        return None
    return [_traffic(graph.module, node) for node in graph.nodes]


def _traffic(module: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    outs = _tensors(node.meta.get("val"))
    ins = [t for u in node.all_input_nodes for t in _tensors(u.meta.get("val"))]
    if all(any(_torch_private.shares_storage(o, i) for i in ins) for o in outs):
        return 0
    held = []
    if node.op == "call_module":
        sub = module.get_submodule(node.target)
        held = [*sub.parameters(), *sub.buffers()]
    return sum(t.numel() * t.element_size() for t in (*ins, *outs, *held))


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _is_product(module: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(module.get_submodule(node.target), _PRODUCT_MODULES)
    if node.op == "call_method":
        return node.target in _PRODUCT_METHODS
    return node.target in _PRODUCT_FUNCTIONS


def small_operators(graph: OperatorGraph, nbytes: list[int] | None,
                    limit: int | None = None) -> list[bool]:
    """Which operators are too small to gain from a stream of their own (the cost option):
    fewer than `limit` bytes (default SMALL_OPERATOR_BYTES) and not a product."""
    if nbytes is None:
        return [False] * len(graph.nodes)
    limit = SMALL_OPERATOR_BYTES if limit is None else limit
    return [b < limit and not _is_product(graph.module, n) for n, b in zip(graph.nodes, nbytes)]


def group_operators(graph: OperatorGraph, small: list[bool]) -> list[int]:
    """The head of each operator's group: a small operator joins the group of its only
    producer when that group's last operator runs just before it; every other operator heads
    its own. Groups are then runs of consecutive operators, and every edge into a group ends
    at its head, so the groups, in the order of their heads, form a DAG in topological order
    whose stream order is the order the operators run in. (Moving an operator next to its
    producer would reach more, but would change the order autograd sums gradients in.)"""
    producers: list[set[int]] = [set() for _ in graph.nodes]
    for u, v in graph.edges:
        producers[v].add(u)
    head = list(range(len(graph.nodes)))
    for v, p in enumerate(producers):
        if small[v] and len(p) == 1 and head[v - 1] == head[next(iter(p))]:
            head[v] = head[v - 1]
    return head


@dataclass
class ForwardPlan:
    """Which stream runs each operator, and the events it records and waits on."""

    stream_of: dict[torch.fx.Node, int]
    waits_on: dict[torch.fx.Node, list[torch.fx.Node]]  # before running: wait on their events
    signals: set[torch.fx.Node]  # after running: record an event
    num_streams: int
    num_syncs: int
    kept: int  # small operators planned as part of their producer


def plan_forward(graph: OperatorGraph, max_streams: int,
                 small: list[bool] | None = None) -> ForwardPlan:
    """Nimble's plan over the operator groups (group_operators)."""
    head = group_operators(graph, small or [False] * len(graph.nodes))
    heads = sorted(set(head))
    group = {h: g for g, h in enumerate(heads)}
    edges = sorted({(group[head[u]], group[head[v]]) for u, v in graph.edges
                    if head[u] != head[v]})
    plan = _C.assign_streams(len(heads), edges, max_streams)
    last = {}  # each group's last operator: a group's consumers wait on its event
    for i, h in enumerate(head):
        last[group[h]] = graph.nodes[i]
    waits_on: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for u, v in plan.syncs:
        waits_on.setdefault(graph.nodes[heads[v]], []).append(last[u])
    return ForwardPlan(
        stream_of={node: plan.stream_of[group[head[i]]] for i, node in enumerate(graph.nodes)},
        waits_on=waits_on, signals={last[u] for u, _ in plan.syncs},
        num_streams=max(plan.num_streams, 1), num_syncs=len(plan.syncs),
        kept=len(graph.nodes) - len(heads))


def plan_operators(graph: OperatorGraph, streams, example: tuple[tuple, dict] | None = None
                   ) -> ForwardPlan:
    """The plan for `streams` ("auto" or a limit): the fake run on `example` (sizes for the
    cost option, aliasing for the in-place edges; None: neither), the graph's edges completed
    with state_edges, then Nimble's assignment."""
    limit = AUTO_MAX_STREAMS if streams == "auto" else int(streams)
    nbytes = operator_bytes(graph, *example) if example else None
    graph.edges = sorted(set(graph.edges) | state_edges(graph, aliasing=nbytes is not None))
    return plan_forward(graph, limit, small_operators(graph, nbytes))


class MultiStreamForward:
    """Calls the traced forward with each operator on its planned stream (for capture)."""

    def __init__(self, graph: OperatorGraph, plan: ForwardPlan, device: torch.device):
        self.graph, self.plan, self.device = graph, plan, device
        self.calls = 0
        self._forked = False  # side streams forked from the main one and not joined since
        self._side_streams: list[torch.cuda.Stream] = []
        for _ in range(plan.num_streams - 1):
            self._side_streams.append(_torch_private.stream_besides(
                device, [torch.cuda.current_stream(device), *self._side_streams]))

    def share_on_main(self, counts: Callable[[torch.nn.Module], bool]) -> float | None:
        """The share of the calls of modules that `counts` the plan runs on the launching
        stream (None: no such call)."""
        calls = [self.plan.stream_of[node] == 0 for node in self.graph.nodes
                 if node.op == "call_module"
                 and counts(self.graph.module.get_submodule(node.target))]
        return sum(calls) / len(calls) if calls else None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        main = torch.cuda.current_stream(self.device)
        # torch's stream pool hands its streams out in turn: one drawn before the capture
        # stream can be that stream, and would run its operators in the main stream's order.
        for i, side in enumerate(self._side_streams):
            if side == main:
                self._side_streams[i] = _torch_private.stream_besides(
                    self.device, [main, *self._side_streams])
        streams = [main] + self._side_streams
        # Fork: side streams start after everything queued so far (and so join a capture).
        for side in self._side_streams:
            side.wait_stream(main)
        self._forked = True
        runner = _StreamInterpreter(self, streams)
        out = runner.run(*positional(self.graph.module, args, kwargs))
        self.join(main)
        # The loss and backward run on the main stream: tensors made elsewhere are used there.
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(main)
        return out

    def join(self, main: torch.cuda.Stream | None = None) -> None:
        """Makes `main` (the current stream) wait for all work queued on the side streams
        since the last fork; nothing when there was none (in a capture, a wait on a stream
        that captured nothing would be a dependency on uncaptured work)."""
        if not self._forked:
            return
        main = main or torch.cuda.current_stream(self.device)
        for side in self._side_streams:
            main.wait_stream(side)
        self._forked = False


def positional(module: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The call's arguments in placeholder order, defaults filled in (fx runs positionally)."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    values = list(args)
    for node in placeholders[len(args):]:
        if node.target in kwargs:
            values.append(kwargs[node.target])
        elif node.args:
            values.append(node.args[0])
        else:
            raise TypeError(f"the traced forward needs argument {node.target!r}")
    return values


class _StreamInterpreter(torch.fx.Interpreter):
    def __init__(self, forward: MultiStreamForward, streams: list[torch.cuda.Stream]):
        super().__init__(forward.graph.module, garbage_collect_values=True)
        self.forward = forward
        self.streams = streams
        self.events: dict[torch.fx.Node, torch.cuda.Event] = {}
        self.produced_on: dict[torch.fx.Node, int] = {}

    def run_node(self, n: torch.fx.Node):
        if n not in self.forward.plan.stream_of:
            return super().run_node(n)
        s = self.forward.plan.stream_of[n]
        stream = self.streams[s]
        for u in self.forward.plan.waits_on.get(n, ()):
            stream.wait_event(self.events[u])
        # A block made on one stream and read on another must not be reused by its own stream
        # until the reader is done: record_stream tells the allocator (and, during capture,
        # keeps the block out of reuse until the capture ends).
        for u in n.all_input_nodes:
            if self.produced_on.get(u, 0) != s:
                for t in pytree.tree_leaves(self.env[u]):
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(stream)
        with torch.cuda.stream(stream):
            result = super().run_node(n)
            if n in self.forward.plan.signals:
                event = torch.cuda.Event()
                event.record(stream)
                self.events[n] = event
        self.produced_on[n] = s
        return result


# Why a compiled model's forward runs on one stream.
COMPILED = "the model contains torch.compile'd modules, whose kernels inductor plans"

# A module whose forward runs code torch.fx cannot trace and must not run on proxies (a
# training loop's loss computation, with its logging) says why in this attribute; Step then
# plans only its backward, without trying the trace or warning.
UNTRACED = "nimble_untraced"


def untraced_reason(model: torch.nn.Module) -> str | None:
    """Why `model`'s forward is not to be traced, if it says so (UNTRACED)."""
    return getattr(model, UNTRACED, None)


# Such a module may name a submodule whose forward its own calls (a LightningModule, which
# training_step calls as self(x)): Step traces and plans that forward instead, sized by the
# arguments of its last eager call, and runs the plan in its place while it captures.
TRACED_INSIDE = "nimble_traced_submodule"


def traced_submodule(model: torch.nn.Module) -> torch.nn.Module | None:
    """The submodule whose forward the plan traces in `model`'s place, if it names one
    (TRACED_INSIDE)."""
    name = getattr(model, TRACED_INSIDE, None)
    return model.get_submodule(name) if name is not None else None


def build_multistream(model: torch.nn.Module, streams, device: torch.device,
                      example: tuple[tuple, dict] | None = None, fuse_norms: bool = False):
    """The multi-stream forward for `streams` ("auto" or a limit), or None with the reason.
    `example`: the forward's (args, kwargs) for the cost option; None plans every operator.
    `fuse_norms`: see trace_operators.

    None means one stream: streams == 1, a model fx cannot trace (the reason names the
    error) or that says it is not to be traced (UNTRACED), or a plan with a single stream
    (nothing runs side by side), unless it fuses batch norms with their activations: then the
    traced forward on one stream, with the reason.
    """
    if streams == 1:
        return None, "streams=1"
    if _torch_private.has_compiled_modules(model):
        # fx would trace the original modules and run them uncompiled; inductor's own kernels
        # run on one stream.
        return None, COMPILED
    if untraced_reason(model) is not None:
        return None, untraced_reason(model)
    try:
        graph = trace_operators(model, fuse_norms)
    except Exception as exc:  # fx raises many kinds of errors on untraceable code
        return None, (f"torch.fx could not trace the model ({type(exc).__name__}: "
                      f"{one_line(exc)})")
    plan = plan_operators(graph, streams, example)
    if plan.num_streams == 1:
        # A chain: its traced forward only where it fuses batch norms (on the one stream).
        return (MultiStreamForward(graph, plan, device) if graph.fused else None), CHAIN
    return MultiStreamForward(graph, plan, device), None


def warn_single_stream(reason: str, backward_planned: bool = False) -> None:
    if backward_planned:
        what = ("nimble_train.Step plans only the backward (weight gradients on a side "
                f"stream); the forward runs on one stream: {reason}")
    else:
        what = f"nimble_train.Step runs on one stream: {reason}"
    warn_at_user(f"{what}. The step is still captured; only independent operators will not "
                 "overlap. Pass streams=1 to silence this.")
