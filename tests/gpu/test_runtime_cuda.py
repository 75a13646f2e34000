"""The C++ step runtime on a GPU, through Step and directly: the one staging ring, rollback at
every point of the replay path, close(), and several graphs sharing one private pool."""

import warnings

import pytest
import torch

import nimble_train as nt
from nimble_train import _C, _torch_private
from step_reference import MLP, assert_same_training, classification_batches, eager_loop, twin

pytestmark = pytest.mark.cuda

per_sample = torch.nn.CrossEntropyLoss(reduction="none")
TOL = {"rtol": 2e-4, "atol": 2e-5}  # fused update and float32 staged values: other rounding


def test_the_staging_ring_survives_a_host_far_ahead_of_the_gpu():
    # Each replay adds its staged value to an accumulator after a long sleep, so the host
    # queues many replays before the GPU reads the first slots; a ring of 4 slots must make
    # it wait, never overwrite a slot still to be read.
    ring = _C.StagingRing(1, torch.device("cuda"), 4)
    total = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _torch_private.cuda_sleep(200_000)
        ring.fetch()
        total.add_(ring.current)
    values = [float(i % 7 + 1) for i in range(40)]
    for v in values:
        ring.stage([v])
        graph.replay()
        ring.launched()
    torch.cuda.synchronize()
    assert total.item() == sum(values)
    assert ring.consumed == ring.staged == 40 and ring.stale == 0
    graph.replay()  # a replay nobody staged for reads a stale slot: counted, then refused
    torch.cuda.synchronize()
    assert ring.stale == 1
    with pytest.raises(RuntimeError, match="read a slot that was not staged for them"):
        ring.stage([1.0])


def _captured_step(model, opt, batches, **options):
    step = nt.Step(model, opt, per_sample, warmup=2, streams=1, **options)
    for b in batches:
        step(b)
    assert step.stats()["phase"] == "replay"
    return step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fused", "as-is"])
def test_a_failure_at_each_point_of_the_replay_path_changes_nothing(dtype):
    # float32: SGD is fused, every hyper-parameter staged. float64: the fused update takes no
    # float64, so torch's fused SGD is captured as it is, with its lr staged.
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP().cuda().to(dtype),
                              lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    batches = [(x.to(dtype), y) for x, y in classification_batches(12, 16, device="cuda")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "captures the optimizer's own step" for float64
        step = _captured_step(m1, o1, batches[:4])
    assert step.stats()["optimizer"] == ("fused" if dtype == torch.float32 else "captured as-is")
    graph = step._graph.graph
    good = batches[4]

    # 1. Reading the staged values fails (a param group's lr is no number): nothing staged.
    lr = o1.param_groups[0]["lr"]
    o1.param_groups[0]["lr"] = None
    with pytest.raises(TypeError):
        step(good)
    o1.param_groups[0]["lr"] = lr
    # 2. The batch does not fit the template: refused before anything is staged.
    with pytest.raises(nt.ShapeError):
        step((good[0][:, :5], good[1]))
    # 3 and 4. The launch fails after staging, and after the copy-in.
    for point in ("after_staging", "after_copy_in"):
        graph.fail_next_launch(point)
        with pytest.raises(RuntimeError, match="injected failure"):
            step(good)
        assert graph.staged == graph.launches, point  # the slot was given back

    for b in batches[4:]:  # training goes on, every launch reading its own values
        step(b)
    torch.cuda.synchronize()
    assert graph.stale == 0 and graph.consumed == graph.launches
    eager_loop(m2, o2, per_sample, batches)  # exactly the successful steps happened
    assert_same_training(m1, o1, m2, o2, **TOL)


def _inside(t: torch.Tensor, flats) -> bool:
    start = t.untyped_storage().data_ptr()
    return any(f.untyped_storage().data_ptr() == start for f in flats)


def test_close_removes_the_hooks_and_leaves_the_optimizer_usable():
    torch.manual_seed(1)
    (m1, o1), (m2, o2) = twin(MLP().cuda(), lambda p: torch.optim.AdamW(p, lr=1e-3))
    batches = classification_batches(8, 16, device="cuda")
    flats = []
    for _ in range(3):  # Steps made and closed one after another
        step = _captured_step(m1, o1, batches[:3])
        flats += [buf for f in step._update.fused._flats for buf in f.state.values()]
        step.close()
        step.close()  # a second close does nothing
    eager_loop(m2, o2, per_sample, batches[:3] * 3)
    assert_same_training(m1, o1, m2, o2, **TOL)
    # The optimizer trains on eagerly, and its state round-trips.
    eager_loop(m1, o1, per_sample, batches[3:])
    eager_loop(m2, o2, per_sample, batches[3:])
    assert_same_training(m1, o1, m2, o2, **TOL)
    # No Step's load_state_dict hook is left: the loaded state stays the optimizer's own
    # tensors instead of being copied into some closed Step's flat buffers.
    o1.load_state_dict(o2.state_dict())
    assert_same_training(m1, o1, m2, o2, **TOL)
    for state in o1.state.values():
        assert not _inside(state["exp_avg"], flats)
    with pytest.raises(nt.NimbleError, match="this Step was closed"):
        step(batches[0])


def test_graphs_captured_into_one_pool_share_its_memory():
    # Two graphs with 64 MiB of intermediates each: captured one after the other into the
    # step graph's one pool, the second reuses what the first freed.
    graph = _C.StepGraph(torch.device("cuda", torch.cuda.current_device()), 0)
    x = torch.randn(1024, 4096, device="cuda")
    entries = [graph.add_entry([("batch[0]", x, x.stride(), True)]) for _ in range(2)]
    outs = []
    side = torch.cuda.Stream()
    for entry in entries:
        with torch.cuda.stream(side):
            graph.begin_capture(entry)
            static = graph.inputs(entry)[0]
            h = static * 2 + 1                 # 16 MiB intermediates, several of them
            h = torch.relu(h) * static - h
            outs.append((h * 3).sum(dim=1) * graph.current[0])
            assert graph.end_capture().ok
    pool = tuple(graph.pool_id)
    pool_bytes = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                     if tuple(seg.get("segment_pool_id", ())) == pool)
    one_graph = 4 * x.numel() * 4  # intermediates of one graph, as allocated at once at most
    assert pool_bytes < 1.5 * one_graph, (pool_bytes, one_graph)
    for i, entry in enumerate(entries):
        y = torch.randn_like(x)
        graph.launch(entry, [y], [])
        h = y * 2 + 1
        expected = ((torch.relu(h) * y - h) * 3).sum(dim=1) * 1024
        torch.testing.assert_close(outs[i], expected, rtol=1e-4, atol=1e-2)
    graph.release()
