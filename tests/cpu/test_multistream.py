"""Tracing a forward into an operator DAG and planning it (the CUDA part runs in tests/gpu)."""

import torch

from nimble_train import _C
from nimble_train._multistream import build_multistream, trace_operators
from step_reference import MLP, InceptionNet


def test_inception_cells_plan_four_streams():
    graph = trace_operators(InceptionNet(cells=2))
    plan = _C.assign_streams(len(graph.nodes), graph.edges, 0)
    assert plan.num_streams == 4  # the four branches of a cell run side by side
    # Every cell forks to four branches and joins in the concatenation: at least 3 + 3 syncs.
    assert len(plan.syncs) >= 12
    names = {n.target for n in graph.nodes if n.op == "call_module"}
    assert "cells.0.b1.0" in names and "cells.1.b4.0" in names


def test_a_chain_plans_one_stream():
    graph = trace_operators(MLP())
    plan = _C.assign_streams(len(graph.nodes), graph.edges, 0)
    assert plan.num_streams == 1 and plan.syncs == []


class Untraceable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(x.shape[0] % 3):  # Python control flow on a traced value
            x = self.lin(x)
        return x


def test_untraceable_model_falls_back_with_the_reason():
    forward, reason = build_multistream(Untraceable(), "auto", torch.device("cpu"))
    assert forward is None
    assert reason.startswith("torch.fx could not trace the model (")


def test_one_stream_asked_for():
    forward, reason = build_multistream(InceptionNet(), 1, torch.device("cpu"))
    assert forward is None and reason == "streams=1"


def test_compiled_modules_keep_one_stream_with_the_reason():
    # fx would trace through torch.compile's wrapper and run the original modules uncompiled.
    model = InceptionNet(cells=1)
    for compiled in (torch.compile(model), torch.nn.Sequential(torch.compile(model))):
        forward, reason = build_multistream(compiled, "auto", torch.device("cpu"))
        assert forward is None and "torch.compile'd modules" in reason
