"""A captured graph's structure and its serial replay (src/capture/graph_structure.h), and a
Step's floor measured with them (nimble_train/bench/floor.py): the structure has the edges the
capture's streams made, the serial clone computes what the graph does, and a Step replayed
serially trains as one replayed as captured."""

import pytest
import torch
import torch.nn.functional as F

import nimble_train as nt
from nimble_train._extension import _C
from nimble_train.bench.floor import step_floor
from step_reference import InceptionNet, assert_same_training, classification_batches, twin

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_cudnn")]


def reaches(deps, a, b) -> bool:
    """Whether node b depends on node a, directly or not."""
    stack, seen = [b], set()
    while stack:
        n = stack.pop()
        for d in deps[n]:
            if d == a:
                return True
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return False


def forked_graph(x):
    """A graph of four kernels: a on the capture stream, then b and c on two side streams
    forked from it after a, d joining all three."""
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        a = x * 2
        s1.wait_stream(main)
        s2.wait_stream(main)
        with torch.cuda.stream(s1):
            b = x + 1
        with torch.cuda.stream(s2):
            c = x - 3
        main.wait_stream(s1)
        main.wait_stream(s2)
        d = torch.addcmul(a, b, c)
    return graph, d


def test_the_structure_has_the_edges_the_capture_streams_made():
    x = torch.randn(1000, device="cuda")
    graph, _ = forked_graph(x)
    kinds, deps = _C.graph_structure(graph.raw_cuda_graph())
    assert kinds == ["kernel"] * 4
    assert all(all(d < i for d in ds) for i, ds in enumerate(deps))
    a, b, c, d = range(4)  # ready nodes are placed in launch order
    assert deps == [[], [a], [a], [a, b, c]]
    assert not reaches(deps, b, c) and not reaches(deps, c, b)  # the two side streams


def test_the_serial_clone_computes_what_the_graph_does_and_only_adds_edges_where_needed():
    x = torch.randn(1000, device="cuda")
    graph, d = forked_graph(x)
    graph.instantiate()
    graph.replay()
    expected = d.clone()
    d.zero_()
    serial = _C.SerialGraph(graph.raw_cuda_graph(), torch.cuda.current_device())
    assert serial.added_edges == 1  # c after b: b already follows a, d follows c
    serial.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(d, expected, rtol=0, atol=0)
    torch.testing.assert_close(expected, x * 2 + (x + 1) * (x - 3))

    one_stream = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(one_stream):
        y = (x * 2).relu() + 1
    assert _C.SerialGraph(one_stream.raw_cuda_graph(), torch.cuda.current_device()).added_edges == 0
    assert _C.graph_structure(one_stream.raw_cuda_graph())[1] == [[], [0], [1]]
    del y


def test_a_graph_kept_by_nobody_is_refused_with_the_reason():
    with pytest.raises(Exception, match="keep_graph=True"):
        _C.graph_structure(0)


def per_sample(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


def test_a_step_replayed_serially_trains_as_one_replayed_as_captured_and_has_a_floor():
    torch.manual_seed(0)
    batches = classification_batches(12, 16, device="cuda", image=True)
    (m_a, o_a), (m_b, o_b) = twin(InceptionNet().cuda().to(memory_format=torch.channels_last),
                                  lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    a = nt.Step(m_a, o_a, per_sample, streams="auto")
    b = nt.Step(m_b, o_b, per_sample, streams="auto")
    for batch in batches[:6]:
        a(batch)
        b(batch)
    assert a.stats()["captured"] and a.stats()["streams"] > 1
    graph, entry = b._graph.graph, b._last_entry
    kinds, deps = graph.structure(entry)
    assert kinds.count("kernel") > 20 and all(all(d < i for d in ds) for i, ds in enumerate(deps))
    graph.replay_serially(entry, True)
    for batch in batches[6:9]:
        a(batch)
        b(batch)
    graph.replay_serially(entry, False)
    for batch in batches[9:]:
        a(batch)
        b(batch)
    torch.cuda.synchronize()
    # The same kernels on the same data, in another order across streams: the same bits.
    assert_same_training(m_a, o_a, m_b, o_b, rtol=0, atol=0)

    floor = step_floor(b, batches, steps=4, timed_steps=5)
    assert floor.nodes == len(kinds) and floor.work_nodes > 20
    assert 0 < floor.critical_path < floor.kernel_sum  # the streams' branches are off the path
    assert 0 < floor.path_products <= floor.critical_path
    assert floor.serial_ms > 0 and 0 < floor.path_nodes < floor.work_nodes
    assert floor.path_with_gaps >= floor.critical_path
    # every work node's time, by its kernel's name: the same total
    assert sum(floor.totals.values()) == pytest.approx(floor.kernel_sum, rel=1e-9)
    assert set(floor.by_name) <= set(floor.totals)
    before = [p.detach().clone() for p in m_b.parameters()]
    b(batches[0])  # replays as captured again
    assert b._last_entry == entry and not all(
        torch.equal(p, q) for p, q in zip(before, m_b.parameters()))
