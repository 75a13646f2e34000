"""assign_streams from Python: results, argument handling and errors."""

import random

import pytest

import nimble_train._C as C


def _closure(num_nodes, edges):
    """reach[u] = the set of nodes reachable from u by one or more edges."""
    succ = [[] for _ in range(num_nodes)]
    for u, v in edges:
        succ[u].append(v)
    reach = [set() for _ in range(num_nodes)]
    for u in reversed(range(num_nodes)):
        for v in succ[u]:
            reach[u].add(v)
            reach[u] |= reach[v]
    return reach


def _execution_edges(plan):
    """The ordering a plan enforces: consecutive nodes of each stream, plus the syncs."""
    edges = list(plan.syncs)
    last = {}
    for v, s in enumerate(plan.stream_of):
        if s in last:
            edges.append((last[s], v))
        last[s] = v
    return edges


def test_diamond_uses_two_streams_and_two_syncs():
    plan = C.assign_streams(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    assert plan.num_streams == 2
    assert plan.stream_of in ([0, 0, 1, 0], [0, 1, 0, 0])
    other = 2 if plan.stream_of[1] == 0 else 1
    assert plan.syncs == [(0, other), (other, 3)]
    assert repr(plan) == "StreamPlan(num_nodes=4, num_streams=2, syncs=2)"


def test_keyword_arguments_and_limit():
    plan = C.assign_streams(num_nodes=4, edges=[(0, 1), (0, 2), (1, 3), (2, 3)], max_streams=1)
    assert plan.num_streams == 1
    assert plan.stream_of == [0, 0, 0, 0]
    assert plan.syncs == []


def test_empty_graph():
    plan = C.assign_streams(0, [])
    assert plan.num_streams == 0 and plan.stream_of == [] and plan.syncs == []


def test_properties_are_read_only():
    plan = C.assign_streams(2, [(0, 1)])
    with pytest.raises(AttributeError):
        plan.num_streams = 5


def test_backward_edge_raises_value_error_naming_it():
    with pytest.raises(ValueError, match=r"edge 1 \(3, 2\) must go forward .*got u=3 >= v=2"):
        C.assign_streams(4, [(0, 1), (3, 2)])


def test_out_of_range_node_and_bad_limit_raise_value_error():
    with pytest.raises(ValueError, match=r"ids must be in \[0, 4\); got 4"):
        C.assign_streams(4, [(0, 4)])
    with pytest.raises(ValueError, match=r"max_streams must be >= 0 \(0 means no limit\); got -1"):
        C.assign_streams(4, [(0, 1)], max_streams=-1)


@pytest.mark.parametrize("max_streams", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_dag_plan_enforces_every_edge(seed, max_streams):
    rng = random.Random(seed)
    n = 60
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.06]
    plan = C.assign_streams(n, edges, max_streams=max_streams)

    assert len(plan.stream_of) == n
    assert all(0 <= s < plan.num_streams for s in plan.stream_of)
    assert set(plan.stream_of) == set(range(plan.num_streams))
    if max_streams:
        assert plan.num_streams <= max_streams
    assert plan.syncs == sorted(set(plan.syncs))

    graph = _closure(n, edges)
    enforced = _closure(n, _execution_edges(plan))
    for u, v in edges:
        assert v in enforced[u], f"edge ({u}, {v}) not enforced"
    if max_streams == 0:
        # Nothing beyond the graph's own ordering, and independent nodes never share a stream.
        assert enforced == graph
        for u in range(n):
            for v in range(u + 1, n):
                if plan.stream_of[u] == plan.stream_of[v]:
                    assert v in graph[u], f"independent nodes {u} and {v} share a stream"
