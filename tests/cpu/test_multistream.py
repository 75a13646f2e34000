"""Tracing a forward into an operator DAG and planning it (the CUDA part runs in tests/gpu)."""

import random

import pytest
import torch

from nimble_train import _C
from nimble_train._multistream import (SMALL_OPERATOR_BYTES, build_multistream, operator_bytes,
                                       plan_forward, plan_operators, small_operators,
                                       trace_operators)
from nimble_train.errors import one_line
from step_reference import (MLP, DataMean, InceptionNet, RandomDagNet, RunningMean,
                            SmallSideOperators, TransformerBlock)


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


def test_a_forward_that_assigns_module_state_falls_back_and_leaves_the_model_as_it_was():
    """fx runs `self.avg = 0.9 * self.avg + ...` on proxies: the proxy would land in the model,
    and the traced graph would compute the average without assigning it."""
    model = torch.nn.Sequential(RunningMean(), torch.nn.ReLU())
    avg, calls, attributes = model[0].avg, model[0].calls, dict(vars(model[0]))
    forward, reason = build_multistream(model, "auto", torch.device("cpu"))
    assert forward is None
    assert reason == ("torch.fx could not trace the model (AssignsModuleState: the forward "
                      "assigns 0.avg, 0.calls, which a traced graph computes without assigning; "
                      "the model's own forward runs it)")
    assert model[0].avg is avg and model[0].calls is calls
    assert vars(model[0]) == attributes and list(model[0]._buffers) == ["avg", "calls"]
    model.eval()  # the average is not assigned in eval mode; the counter still is
    _, reason = build_multistream(model, "auto", torch.device("cpu"))
    assert "assigns 0.calls, which" in reason and model[0].calls is calls


def test_a_forward_that_gives_a_tensor_new_data_falls_back_naming_it():
    """fx takes `self.avg.data = ...` as a plain attribute of the buffer's proxy: the traced
    graph would compute the average without assigning it. Named, buffer and parameter alike,
    and fx's proxies are as they were afterwards."""
    model = torch.nn.Sequential(DataMean(), torch.nn.ReLU())
    avg, weight = model[0].avg, model[0].lin.weight
    forward, reason = build_multistream(model, "auto", torch.device("cpu"))
    assert forward is None
    assert reason == ("torch.fx could not trace the model (AssignsModuleState: the forward "
                      "assigns 0.avg.data, 0.calls.data, which a traced graph computes without "
                      "assigning; the model's own forward runs it)")
    model[0].renorm = True
    _, reason = build_multistream(model, "auto", torch.device("cpu"))
    assert "assigns 0.lin.weight.data, 0.avg.data, 0.calls.data, which" in reason, reason
    assert model[0].avg is avg and model[0].lin.weight is weight
    assert torch.equal(avg, torch.zeros(12))  # the trace ran on proxies
    assert "__setattr__" not in vars(torch.fx.Proxy)
    model.eval()  # the average is not given new data in eval mode; the counter still is
    model[0].renorm = False
    _, reason = build_multistream(model, "auto", torch.device("cpu"))
    assert "assigns 0.calls.data, which" in reason, reason


class MakesTensors(torch.nn.Module):
    """Makes a tensor from Python values alone (noise, a scale), and holds a temperature in a
    plain attribute that it assigns anew."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.temperature = torch.tensor(2.0)

    def forward(self, x):
        y = self.lin(x) / self.temperature + 0.1 * torch.randn(4, 8)
        if self.training:
            self.temperature = self.temperature * 0.5
        return y


def test_a_forward_that_makes_tensors_from_python_values_falls_back_saying_so():
    """fx runs torch.randn(4, 8) once and keeps its tensor as a constant of the trace
    (_tensor_constant0 on the root): the traced forward would add the same noise each step.
    Reported as what the forward does, not as a module attribute it assigns."""
    model = MakesTensors()
    temperature = model.temperature
    _, reason = build_multistream(model, "auto", torch.device("cpu"))
    assert "the forward assigns temperature, which a traced graph" in reason, reason
    assert "_tensor_constant" not in reason and model.temperature is temperature
    assert not hasattr(model, "_tensor_constant0")
    model.eval()
    forward, reason = build_multistream(model, "auto", torch.device("cpu"))
    assert forward is None
    assert reason == ("torch.fx could not trace the model (AssignsModuleState: the forward "
                      "makes 1 tensor(s) from Python values alone (torch.tensor(...), "
                      "torch.randn(4, 8)), which a traced graph would hold as constants made "
                      "once; the model's own forward runs it)")


class CallsTheExtension(torch.nn.Module):
    """Hands its input to a function of the extension, which a proxy cannot stand in for."""

    def forward(self, x):
        mean, _ = _C.batch_norm_stats(x, 1e-5)
        return x - mean.view(1, -1, 1, 1)


def test_the_fallback_reason_says_what_a_binding_was_given_in_one_line():
    forward, reason = build_multistream(CallsTheExtension(), "auto", torch.device("cpu"))
    assert forward is None
    # pybind11's first line ends "...are supported:"; the types and the proxy follow it.
    assert reason.startswith("torch.fx could not trace the model (TypeError: "
                             "batch_norm_stats(): incompatible function arguments.")
    assert "supported: 1. (x: torch.Tensor" in reason
    assert "Invoked with: Proxy(" in reason and "\n" not in reason


def test_one_line_keeps_what_follows_a_colon_and_cuts_long_messages():
    assert one_line("") == "" and one_line("  \n ") == ""
    assert one_line("first\nsecond") == "first"
    assert one_line("no match:\n  1. (a: int)\n\nInvoked with: 'x'") == \
        "no match: 1. (a: int); Invoked with: 'x'"
    assert one_line("x" * 500, limit=10) == "xxxxxxx..."
    assert one_line(ValueError("bad:\nvalue")) == "bad: value"


class SaysUntraced(torch.nn.Module):
    """A module whose forward must not run on proxies: it counts its calls."""

    nimble_untraced = "its forward is a training loop's loss"

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


def test_a_model_that_says_it_is_not_traced_is_not_traced():
    model = SaysUntraced()
    forward, reason = build_multistream(model, "auto", torch.device("cpu"))
    assert forward is None and reason == SaysUntraced.nimble_untraced
    assert model.calls == 0  # fx never ran it
    assert build_multistream(model, 1, torch.device("cpu")) == (None, "streams=1")


@pytest.mark.parametrize("streams", ["auto", 2])
def test_a_model_not_traced_plans_its_backward_without_a_warning(recwarn, streams):
    step = _unplanned_step()
    model = SaysUntraced()
    step.plan_streams(model, streams, torch.device("cpu"))
    assert step.multistream is None and step.single_stream_reason == model.nimble_untraced
    assert step.weight_grads is not None  # the linear layer's weight gradient leaves the path
    assert not [w for w in recwarn if "stream" in str(w.message)]
    assert model.calls == 0


def test_a_model_not_traced_with_nothing_to_plan_says_why_without_a_warning(recwarn):
    class Untraced(torch.nn.Module):
        nimble_untraced = "its forward is a training loop's loss"

        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.scale

    step = _unplanned_step()
    step.plan_streams(Untraced(), "auto", torch.device("cpu"))
    assert step.weight_grads is None and step.weight_grads_off.startswith("no convolution")
    assert step.single_stream_reason == Untraced.nimble_untraced
    assert not [w for w in recwarn if "stream" in str(w.message)]


def test_one_stream_asked_for():
    forward, reason = build_multistream(InceptionNet(), 1, torch.device("cpu"))
    assert forward is None and reason == "streams=1"


def test_compiled_modules_keep_one_stream_with_the_reason():
    # fx would trace through torch.compile's wrapper, or past a module compiled in place (fx
    # calls its forward), and run the original modules uncompiled.
    model = InceptionNet(cells=1)
    in_place = InceptionNet(cells=1)
    in_place.compile()
    for compiled in (torch.compile(model), torch.nn.Sequential(torch.compile(model)), in_place,
                     torch.nn.Sequential(in_place)):
        forward, reason = build_multistream(compiled, "auto", torch.device("cpu"))
        assert forward is None and "torch.compile'd modules" in reason


def happens_before(graph, plan) -> dict:
    """For each operator, the operators certainly finished when it starts, given the traced
    module's order of execution, stream order, and the plan's events."""
    done_on_stream: dict[int, frozenset] = {}
    event: dict = {}
    before = {}
    for node in graph.module.graph.nodes:
        if node not in plan.stream_of:
            continue
        s = plan.stream_of[node]
        known = set(done_on_stream.get(s, frozenset()))
        for u in plan.waits_on.get(node, ()):
            known |= event[u]  # KeyError: a wait on an event not recorded yet
        before[node] = frozenset(known)
        done_on_stream[s] = frozenset(known | {node})
        if node in plan.signals:
            event[node] = done_on_stream[s]
    return before


def assert_plan_orders_every_edge(graph, plan):
    before = happens_before(graph, plan)
    for u, v in graph.edges:
        assert graph.nodes[u] in before[graph.nodes[v]], (graph.nodes[u], graph.nodes[v])


def test_small_operators_run_with_their_producer():
    torch.manual_seed(0)
    model, x = SmallSideOperators(), torch.randn(8, 64)
    full = plan_forward(trace_operators(model), 0)
    graph = trace_operators(model)
    nbytes = operator_bytes(graph, (x,), {})
    sizes = dict(zip((n.name for n in graph.nodes), nbytes))
    shape = next(b for n, b in zip(graph.nodes, nbytes) if n.target is getattr)
    assert shape == sizes["getitem"] == sizes["view"] == 0  # no kernel runs for these
    assert sizes["mean"] == 8 * 64 * 4 + 8 * 4  # reads h, writes one value per row
    assert sizes["b"] == 8 * 64 * 4 * 2 + (64 * 64 + 64) * 4  # input, output and parameters
    plan = plan_forward(graph, 0, small_operators(graph, nbytes))
    # Without sizes the shape query, the mean and the two products each get a stream; with
    # them only the products run side by side.
    assert (full.num_streams, full.num_syncs, full.kept) == (4, 6, 0)
    assert (plan.num_streams, plan.num_syncs, plan.kept) == (2, 2, 4)
    by_name = {n.name: n for n in graph.nodes}
    assert plan.stream_of[by_name["mean"]] == plan.stream_of[by_name["relu"]]
    assert_plan_orders_every_edge(graph, plan)
    torch.testing.assert_close(graph.module(x), model(x), rtol=0, atol=0)


def test_products_are_never_small_and_large_operators_are_not():
    model = SmallSideOperators(dim=4)
    graph = trace_operators(model)
    small = dict(zip((n.name for n in graph.nodes),
                     small_operators(graph, operator_bytes(graph, (torch.randn(2, 4),), {}))))
    assert not small["a"] and not small["b"] and small["mean"] and small["relu"]
    big = torch.randn(SMALL_OPERATOR_BYTES // (4 * 4) + 1, 4)  # relu reads and writes it
    small = small_operators(graph, operator_bytes(graph, (big,), {}))
    assert not small[[n.name for n in graph.nodes].index("relu")]


def test_sizing_runs_on_fake_tensors_and_changes_nothing():
    model = InceptionNet(cells=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph = trace_operators(model)
    nbytes = operator_bytes(graph, (torch.randn(4, 3, 16, 16),), {})
    assert all(b > 0 for b in nbytes)
    for k, v in model.state_dict().items():  # batch-norm statistics and counters included
        assert torch.equal(v, before[k]), k


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h)[torch.nonzero(h[:, 0] > 0).squeeze(1)].sum() + h.sum()


def test_a_forward_fake_tensors_cannot_size_plans_every_operator():
    graph = trace_operators(DataDependent())
    nbytes = operator_bytes(graph, (torch.randn(8, 4),), {})
    assert nbytes is None
    assert small_operators(graph, nbytes) == [False] * len(graph.nodes)


def test_sizes_from_keyword_arguments():
    model = TransformerBlock()
    graph = trace_operators(model)
    nbytes = operator_bytes(graph, (), {"x": torch.randn(2, 8, 32)})
    assert nbytes is not None and len(nbytes) == len(graph.nodes)
    plan = plan_forward(graph, 0, small_operators(graph, nbytes))
    assert plan.num_streams >= 3 and plan.kept > 0  # q, k, v side by side; views with them
    assert_plan_orders_every_edge(graph, plan)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_streams", [0, 2, 3])
def test_every_dependency_is_ordered_with_random_small_operators(seed, max_streams):
    model = RandomDagNet(seed, nodes=16)
    graph = trace_operators(model)
    rng = random.Random(seed)
    small = [rng.random() < 0.5 for _ in graph.nodes]
    plan = plan_forward(graph, max_streams, small)
    assert plan.kept > 0
    if max_streams:
        assert plan.num_streams <= max_streams
    assert_plan_orders_every_edge(graph, plan)
    x = torch.randn(3, 16)
    torch.testing.assert_close(graph.module(x), model(x), rtol=0, atol=0)


def test_the_check_finds_a_missing_wait():
    graph = trace_operators(InceptionNet(cells=1))
    plan = plan_forward(graph, 0)
    cat = next(n for n in graph.nodes if n.name == "cat")
    plan.waits_on[cat] = plan.waits_on[cat][1:]
    with pytest.raises(AssertionError):
        assert_plan_orders_every_edge(graph, plan)


def _unplanned_step():
    """A CapturedStep before its plan, without the CUDA graph (plan_streams needs none)."""
    from nimble_train._capture import CapturedStep
    step = object.__new__(CapturedStep)
    step.multistream = step.weight_grads = step._split_model = step.compiled_split = None
    step.single_stream_reason = step.weight_grads_off = None
    return step


@pytest.mark.parametrize("streams", ["auto", 1])
def test_the_forwards_plan_switched_off_leaves_the_backwards(monkeypatch, recwarn, streams):
    from nimble_train import _capture
    monkeypatch.setattr(_capture, "PLAN_FORWARD", False)
    step = _unplanned_step()
    step.plan_streams(InceptionNet(cells=1), streams, torch.device("cpu"))
    assert step.multistream is None
    if streams == 1:
        assert step.single_stream_reason == "streams=1" and step.weight_grads is None
    else:
        assert step.single_stream_reason == _capture.FORWARD_OFF
        assert step.weight_grads is not None  # the weight gradients still leave the path
    assert not [w for w in recwarn if "stream" in str(w.message)]  # asked for: no warning


@pytest.mark.parametrize("kernels", ["auto", "cudnn", "native"])
def test_which_batch_norm_kernels_a_capture_runs(monkeypatch, kernels):
    from nimble_train import _capture
    monkeypatch.setattr(_capture, "PLAN_FORWARD", False)  # the plan needs no CUDA then
    monkeypatch.setattr(_capture, "BATCH_NORM_KERNELS", kernels)
    model = InceptionNet(cells=1)
    several, one = _unplanned_step(), _unplanned_step()
    several.plan_streams(model, "auto", torch.device("cpu"))
    one.plan_streams(model, 1, torch.device("cpu"))
    # "auto": the native kernels where the forward is planned only; with the backward's plan
    # alone (weight gradients on a side stream) cuDNN's, as on one stream
    assert several.weight_grads is not None and several.multistream is None
    assert several._native_bn_model is (model if kernels == "native" else None)
    assert one._native_bn_model is (model if kernels == "native" else None)


def test_an_unknown_batch_norm_kernel_setting_says_what_it_takes(monkeypatch):
    from nimble_train import _capture
    monkeypatch.setattr(_capture, "BATCH_NORM_KERNELS", True)
    with pytest.raises(ValueError, match="'auto', 'cudnn' or 'native'; got True"):
        _unplanned_step().plan_streams(InceptionNet(cells=1), 1, torch.device("cpu"))


class SharedNorm(torch.nn.Module):
    """Two branches through one batch norm (it updates its running statistics on each call)
    and one ReLU module (no state: the branches stay apart)."""

    def __init__(self):
        super().__init__()
        self.left, self.right = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.norm, self.act = torch.nn.BatchNorm1d(8), torch.nn.ReLU()

    def forward(self, x):
        a = self.act(self.norm(self.left(x)))
        b = self.act(self.norm(self.right(x)))
        return a + b


class InPlace(torch.nn.Module):
    """A branch reads `y`, then `y` (through a view of it) is written in place, then another
    branch reads it: eager's order is the only right one."""

    def __init__(self, through_view: bool):
        super().__init__()
        self.through_view = through_view
        self.lin, self.left, self.right = (torch.nn.Linear(8, 8) for _ in range(3))
        self.other = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        a = self.left(y)
        z = self.other(x)  # touches nothing y shares: stays free
        target = y.view(-1) if self.through_view else y
        target.mul_(2)
        b = self.right(y)
        return a + b + z


def _index(graph, name):
    return next(i for i, n in enumerate(graph.nodes) if n.name == name)


def _reaches(edges, a, b):
    """Whether a path leads from operator a to operator b."""
    out = {}
    for u, v in edges:
        out.setdefault(u, []).append(v)
    seen, stack = set(), [a]
    while stack:
        u = stack.pop()
        if u == b:
            return True
        if u not in seen:
            seen.add(u)
            stack.extend(out.get(u, ()))
    return False


def test_the_calls_of_a_module_with_buffers_follow_one_another():
    from nimble_train._multistream import state_edges
    graph = trace_operators(SharedNorm())
    calls = [i for i, n in enumerate(graph.nodes) if n.target == "norm"]
    acts = [i for i, n in enumerate(graph.nodes) if n.target == "act"]
    edges = state_edges(graph, aliasing=False)
    assert edges == {(calls[0], calls[1])}  # the norm's calls; not the ReLU's
    assert not _reaches(graph.edges, acts[0], acts[1])
    plan = plan_operators(graph, "auto")
    assert (calls[0], calls[1]) in graph.edges
    # the two products still run side by side
    assert plan.stream_of[graph.nodes[_index(graph, "left")]] != \
        plan.stream_of[graph.nodes[_index(graph, "right")]]


class ReadsStatistics(SharedNorm):
    """Reads the norm's running mean between its calls (eager: after the first update)."""

    def forward(self, x):
        a = self.norm(self.left(x))
        shift = self.norm.running_mean * 2
        b = self.norm(self.right(x))
        return a + b + shift


def test_operators_reading_a_modules_buffers_keep_their_place_among_its_calls():
    from nimble_train._multistream import state_edges
    model = ReadsStatistics()
    graph = trace_operators(model)
    calls = [i for i, n in enumerate(graph.nodes) if n.target == "norm"]
    reader = _index(graph, "mul")
    assert calls[0] < reader < calls[1]
    # read when the forward runs, not folded into a constant when it was traced
    assert [u.target for u in graph.nodes[reader].all_input_nodes] == ["norm.running_mean"]
    model.norm.running_mean.fill_(3.0)
    x = torch.randn(4, 8)
    model.eval()
    torch.testing.assert_close(graph.module.eval()(x), model(x))
    assert state_edges(graph, aliasing=False) == {(calls[0], calls[1]), (calls[0], reader),
                                                  (reader, calls[1])}


@pytest.mark.parametrize("through_view", [False, True])
def test_an_operator_writing_in_place_comes_after_earlier_readers_and_before_later_ones(
        through_view):
    from nimble_train._multistream import state_edges, written_input
    model = InPlace(through_view)
    graph = trace_operators(model)
    writer = _index(graph, "mul_")
    assert written_input(graph.module, graph.nodes[writer]).name == ("view" if through_view
                                                                      else "lin")
    left, right, other = (_index(graph, n) for n in ("left", "right", "other"))
    assert not _reaches(graph.edges, left, writer) and not _reaches(graph.edges, writer, right)
    operator_bytes(graph, (torch.randn(4, 8),), {})  # the fake values say what aliases
    edges = state_edges(graph, aliasing=True)
    assert (left, writer) in edges and (writer, right) in edges
    assert not any(other in e for e in edges)  # reads only x: free to run beside
    # Without aliasing (no fake run) the writer is ordered against every operator.
    blunt = state_edges(trace_operators(model), aliasing=False)
    assert {(min(i, writer), max(i, writer)) for i in range(len(graph.nodes)) if i != writer} \
        == blunt
    graph = trace_operators(model)
    plan_operators(graph, "auto", ((torch.randn(4, 8),), {}))
    assert _reaches(graph.edges, left, writer) and _reaches(graph.edges, writer, right)


def test_which_operators_write_in_place():
    from nimble_train._multistream import written_input
    import torch.nn.functional as F

    class Writers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.relu, self.drop = torch.nn.ReLU(inplace=True), torch.nn.Dropout(0.1)

        def forward(self, x):
            a = self.relu(x + 1)          # module with inplace=True: writes
            b = self.drop(x * 2)          # dropout without inplace: does not
            c = F.relu(x - 1, True)       # positional inplace: writes
            d = F.relu(x - 2)             # does not
            e = torch.relu_(x * 3)        # trailing underscore: writes
            f = (x + 4).add_(1)           # a method with a trailing underscore: writes
            return a + b + c + d + e + f

    graph = trace_operators(Writers())
    writes = {n.name: written_input(graph.module, n) is not None for n in graph.nodes}
    assert writes["relu"] and writes["relu_1"] and writes["relu_"] and writes["add_"]
    assert not writes["drop"] and not writes["relu_2"] and not writes["add"]
