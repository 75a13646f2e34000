"""Runs a model's forward on several CUDA streams, as planned by Nimble's stream assignment.

The forward is traced with torch.fx into a DAG of operators (module calls, functions,
methods); src/streams assigns each operator a stream (nimble_train._C.assign_streams). While
the step is captured, each operator runs on its stream and waits, through an event, on the
producers the plan marks as synchronisations; every other cross-stream dependency is implied
by stream order. Autograd runs each backward kernel on the stream of its forward operator and
inserts the waits where gradients cross streams, so the one plan covers the backward too.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx

from . import _torch_private
from ._extension import _C
from ._torch_private import pytree

_OPS = ("call_module", "call_function", "call_method")

# Why a traced forward gets no plan when nothing in it can run side by side.
CHAIN = "the traced forward is a chain: no two operators can run side by side"

# With no limit asked for, more streams than this buy nothing on a GPU that runs a handful of
# small kernels side by side, and each stream adds joins at the end of the step.
AUTO_MAX_STREAMS = 8


@dataclass
class OperatorGraph:
    """The traced forward as a DAG: `nodes[i]` is operator i, edges go producer -> consumer."""

    module: torch.fx.GraphModule
    nodes: list[torch.fx.Node]
    edges: list[tuple[int, int]]


def trace_operators(model: torch.nn.Module) -> OperatorGraph:
    """Traces `model` with torch.fx; raises what fx raises when the model is not traceable."""
    module = torch.fx.symbolic_trace(model)
    nodes = [n for n in module.graph.nodes if n.op in _OPS]
    index = {n: i for i, n in enumerate(nodes)}
    edges = sorted({(index[u], index[v]) for v in nodes for u in v.all_input_nodes if u in index})
    return OperatorGraph(module, nodes, edges)


class MultiStreamForward:
    """Calls the traced forward with each operator on its planned stream (for capture)."""

    def __init__(self, graph: OperatorGraph, max_streams: int, device: torch.device):
        plan = _C.assign_streams(len(graph.nodes), graph.edges, max_streams)
        self.graph = graph
        self.num_streams = max(plan.num_streams, 1)
        self.num_syncs = len(plan.syncs)
        self.stream_of = {node: plan.stream_of[i] for i, node in enumerate(graph.nodes)}
        self.waits_on: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for u, v in plan.syncs:
            self.waits_on.setdefault(graph.nodes[v], []).append(graph.nodes[u])
        self.signals = {graph.nodes[u] for u, _ in plan.syncs}
        self.device = device
        self._side_streams = [torch.cuda.Stream(device) for _ in range(self.num_streams - 1)]

    def __call__(self, *args, **kwargs):
        main = torch.cuda.current_stream(self.device)
        streams = [main] + self._side_streams
        # Fork: side streams start after everything queued so far (and so join a capture).
        for side in self._side_streams:
            side.wait_stream(main)
        runner = _StreamInterpreter(self, streams)
        out = runner.run(*self._positional(args, kwargs))
        self.join(main)
        # The loss and backward run on the main stream: tensors made elsewhere are used there.
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(main)
        return out

    def join(self, main: torch.cuda.Stream | None = None) -> None:
        """Makes `main` (the current stream) wait for all work queued on the side streams."""
        main = main or torch.cuda.current_stream(self.device)
        for side in self._side_streams:
            main.wait_stream(side)

    def _positional(self, args: tuple, kwargs: dict) -> list:
        """The call's arguments in placeholder order, defaults filled in (fx runs positionally)."""
        placeholders = [n for n in self.graph.module.graph.nodes if n.op == "placeholder"]
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
        if n not in self.forward.stream_of:
            return super().run_node(n)
        s = self.forward.stream_of[n]
        stream = self.streams[s]
        for u in self.forward.waits_on.get(n, ()):
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
            if n in self.forward.signals:
                event = torch.cuda.Event()
                event.record(stream)
                self.events[n] = event
        self.produced_on[n] = s
        return result


def build_multistream(model: torch.nn.Module, streams, device: torch.device):
    """The multi-stream forward for `streams` ("auto" or a limit), or None with the reason.

    None means one stream: streams == 1, a model fx cannot trace (the reason names the
    error), or a plan with a single stream (nothing runs side by side).
    """
    if streams == 1:
        return None, "streams=1"
    if _compiled(model):
        # fx would trace the original modules and run them uncompiled; inductor's own kernels
        # run on one stream.
        return None, "the model contains torch.compile'd modules, whose kernels inductor plans"
    try:
        graph = trace_operators(model)
    except Exception as exc:  # fx raises many kinds of errors on untraceable code
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"torch.fx could not trace the model ({type(exc).__name__}: {first})"
    limit = AUTO_MAX_STREAMS if streams == "auto" else int(streams)
    forward = MultiStreamForward(graph, limit, device)
    if forward.num_streams == 1:
        return None, CHAIN
    return forward, None


def _compiled(model: torch.nn.Module) -> bool:
    return any(_torch_private.is_compiled_module(m) for m in model.modules())


def warn_single_stream(reason: str, backward_planned: bool = False) -> None:
    if backward_planned:
        what = ("nimble_train.Step plans only the backward (weight gradients on a side "
                f"stream); the forward runs on one stream: {reason}")
    else:
        what = f"nimble_train.Step runs on one stream: {reason}"
    warnings.warn(
        f"{what}. The step is still captured; only independent operators will not overlap. "
        "Pass streams=1 to silence this.",
        # The user's step(batch): here, CapturedStep, Step._capture, Step._call, Step.__call__.
        stacklevel=6)
