"""The floor's arithmetic (nimble_train/bench/floor.py): the critical path of a graph against
every path enumerated, and the split of a serial replay's profile into its nodes."""

import random

import pytest

from nimble_train.bench.floor import (Floor, critical_path, graph_activities, is_product,
                                      own_times, stretch)


def random_dag(rng: random.Random, nodes: int, density: float):
    deps = [sorted(d for d in range(i) if rng.random() < density) for i in range(nodes)]
    durations = [rng.choice([0.0, rng.uniform(0.1, 5.0)]) for _ in range(nodes)]
    return deps, durations


def every_path_length(deps, durations) -> float:
    """The longest path by enumerating every path from each node backwards (exponential: for
    small graphs)."""
    def longest_ending_at(i):
        return durations[i] + max((longest_ending_at(d) for d in deps[i]), default=0.0)
    return max((longest_ending_at(i) for i in range(len(deps))), default=0.0)


@pytest.mark.parametrize("seed", range(40))
def test_the_critical_path_is_the_longest_of_every_path(seed):
    rng = random.Random(seed)
    deps, durations = random_dag(rng, rng.randint(1, 14), rng.choice([0.1, 0.3, 0.6]))
    length, chain = critical_path(deps, durations)
    assert length == pytest.approx(every_path_length(deps, durations), rel=1e-12)
    # the chain it names is a path of the graph, and that long
    assert all(a in deps[b] for a, b in zip(chain, chain[1:]))
    assert sum(durations[n] for n in chain) == pytest.approx(length, rel=1e-12)
    assert length <= sum(durations) + 1e-12


def test_a_chain_is_its_sum_and_parallel_branches_their_longest():
    assert critical_path([[], [0], [1]], [1.0, 2.0, 3.0]) == (6.0, [0, 1, 2])
    # fork 0 -> {1, 2, 3} -> join 4: the longest branch counts
    deps = [[], [0], [0], [0], [1, 2, 3]]
    assert critical_path(deps, [1.0, 5.0, 2.0, 7.0, 1.0]) == (9.0, [0, 3, 4])
    assert critical_path([], []) == (0.0, [])


def test_dependencies_that_are_not_a_topological_order_are_refused():
    with pytest.raises(ValueError, match="topological order"):
        critical_path([[1], []], [1.0, 1.0])
    with pytest.raises(ValueError, match="2 nodes but 1 durations"):
        critical_path([[], [0]], [1.0])


def serial_profile(rng, calls, copies, names):
    """`calls` serial replays of a graph whose work nodes are `names`, each after `copies`
    copies of the batch, one after another, in shuffled order (as a profile may list them)."""
    events, t = [], 0.0
    for _ in range(calls):
        for c in range(copies):
            events.append((t, t + 1.0, f"Memcpy DtoD {c}"))
            t += 1.5
        for n in names:
            d = rng.uniform(0.5, 3.0)
            events.append((t, t + d, n))
            t += d + 0.25
    rng.shuffle(events)
    return events


def test_a_serial_profile_splits_into_each_calls_nodes_in_order():
    rng = random.Random(0)
    names = ["fetch", "gemm", "relu", "gemm", "sgd"]
    calls = graph_activities(serial_profile(rng, 4, 2, names), 4, len(names))
    assert len(calls) == 4
    for call in calls:
        assert [n for _, _, n in call] == names
        assert all(a[1] <= b[0] for a, b in zip(call, call[1:]))  # one after another


def test_a_profile_that_does_not_split_into_the_graphs_nodes_is_refused():
    rng = random.Random(1)
    events = serial_profile(rng, 3, 1, ["a", "b", "c"])
    with pytest.raises(ValueError, match="do not split into 5 calls"):
        graph_activities(events, 5, 3)
    with pytest.raises(ValueError, match="fewer than the graph's 5 work nodes"):
        graph_activities(events, 3, 5)
    events[0] = (events[0][0], events[0][1], "other")  # one call ran another kernel
    with pytest.raises(ValueError, match="ran other kernels"):
        graph_activities(events, 3, 3)


def test_products_are_told_by_their_libraries_names():
    assert is_product("sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc")
    assert is_product("nvjet_tst_128x64_64x8_1x2_h_bz_NTN")
    assert is_product("void cudnn::cnn::wgrad2d_grouped_direct_kernel<float>")
    assert not is_product("void cudnn::bn_fw_tr_1C11_kernel_NHWC<float, float, true>")
    assert not is_product("triton_poi_fused_add_relu_0")
    assert not is_product("void at::native::vectorized_elementwise_kernel<4>")


def test_a_node_launched_early_counts_only_its_time_after_its_predecessor():
    # b starts (a programmatic launch) while a runs and ends 2 after it: its own time is 2
    call = [(0.0, 5.0, "a"), (3.0, 7.0, "b"), (8.0, 9.5, "c")]
    assert own_times(call) == [5.0, 2.0, 1.5]


def test_the_path_with_gaps_adds_the_serial_replays_latency_per_node_along_the_path():
    # 100 nodes, 2.0 ms alone, serial 2.1: 1 us between nodes; 40 nodes on a 1.2 ms path
    f = Floor(nodes=100, work_nodes=100, kernel_sum=2.0, critical_path=1.2, serial_ms=2.1,
              path_products=0.6, path_nodes=40)
    assert f.gap == pytest.approx(0.001)
    assert f.path_with_gaps == pytest.approx(1.24)
    assert Floor(nodes=1, work_nodes=1, kernel_sum=2.0, critical_path=2.0, serial_ms=1.9,
                 path_products=0.0, path_nodes=1).gap == 0.0  # no negative latency


def test_stretch_lists_the_kernels_that_lost_most_beside_the_others_first():
    alone = {"bn": 0.10, "conv": 0.50, "relu": 0.02, "only_alone": 0.01}
    as_run = {"bn": 0.20, "conv": 0.55, "relu": 0.02, "only_run": 0.03}
    rows = stretch(alone, as_run)
    assert [r[0] for r in rows] == ["bn", "conv", "only_run", "relu", "only_alone"]
    assert rows[0] == ("bn", 0.10, 0.20)
    assert ("only_run", 0.0, 0.03) in rows and ("only_alone", 0.01, 0.0) in rows
    assert stretch({}, {}) == []
