"""Data parallelism on the CPU: bucket planning, rank agreement, and a 2-rank gloo job."""

import copy
import os
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nimble_train as nt
from nimble_train import _torch_private
from nimble_train._extension import _C
from nimble_train._gradsync import plan_buckets
from nimble_train.distributed import World
from step_reference import (MLP, ReadsTheHeadLate, assert_same_training, classification_batches,
                            eager_loop)


# ---------------------------------------------------------------------- buckets


def _offsets(sizes):
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_buckets_are_whole_contiguous_segments_within_the_size(seed):
    g = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 40, (1,), generator=g))
    sizes = torch.randint(1, 3000, (count,), generator=g).tolist()
    offsets = _offsets(sizes)
    ready = torch.randperm(count, generator=g).tolist()
    limit = int(torch.randint(4, 20000, (1,), generator=g))
    last = int(torch.randint(4, 20000, (1,), generator=g))
    buckets = plan_buckets(offsets, ready, 4, limit, last_bucket_bytes=last)
    covered = sorted(i for b in buckets for i in b.members)
    assert covered == list(range(count))  # every segment once
    for b in buckets:
        assert b.members == list(range(b.members[0], b.members[-1] + 1))  # contiguous
        assert (b.start, b.stop) == (offsets[b.members[0]], offsets[b.members[-1] + 1])
        assert (b.stop - b.start) * 4 <= limit or len(b.members) == 1
        assert b.ready_at == max(ready[i] for i in b.members)
    assert [b.ready_at for b in buckets] == sorted(b.ready_at for b in buckets)
    # Limits double going away from the end whose gradients arrive last.
    by_start = sorted(buckets, key=lambda b: b.start)
    half = count // 2
    if not (half and sum(ready[half:]) < sum(ready[:half])):  # the high end arrives last
        by_start.reverse()
    cap = min(limit, last)
    for b in by_start:
        assert (b.stop - b.start) * 4 <= cap or len(b.members) == 1
        cap = min(2 * cap, limit)


def test_buckets_shrink_toward_the_end_whose_gradients_arrive_last():
    # The backward reaches the first layers last: the last bucket to fill holds at most
    # last_bucket_bytes, and each bucket before it at most twice the one after.
    sizes = [100] * 10
    ready = list(range(9, -1, -1))  # segment 9 arrives first, segment 0 last
    buckets = plan_buckets(_offsets(sizes), ready, 4, 4 * 400, last_bucket_bytes=4 * 100)
    assert [b.members for b in buckets] == [[7, 8, 9], [3, 4, 5, 6], [1, 2], [0]]
    assert [b.ready_at for b in buckets] == [2, 6, 8, 9]
    buckets = plan_buckets(_offsets(sizes), list(range(10)), 4, 4 * 400,
                           last_bucket_bytes=4 * 100)
    assert [b.members for b in buckets] == [[0, 1, 2], [3, 4, 5, 6], [7, 8], [9]]
    # A limit under the last bucket's size caps every bucket.
    buckets = plan_buckets(_offsets(sizes), ready, 4, 4 * 250, last_bucket_bytes=4 * 1000)
    assert [b.members for b in buckets] == [[8, 9], [6, 7], [4, 5], [2, 3], [0, 1]]


def test_bucket_planning_rejects_bad_input():
    with pytest.raises(ValueError, match="3 segments but 2 ready ranks"):
        plan_buckets([0, 1, 2, 3], [0, 1], 4, 100)
    with pytest.raises(ValueError, match="bucket_bytes and last_bucket_bytes must be positive"):
        plan_buckets([0, 1], [0], 4, 0)
    with pytest.raises(ValueError, match="must be positive; got 4 and 0"):
        plan_buckets([0, 1], [0], 4, 4, last_bucket_bytes=0)


# ---------------------------------------------------------------------- agreement


def _run_ranks(facts_of_rank, size=2):
    """World.agree on `size` threads sharing one store; returns each rank's error or None."""
    store = dist.HashStore()
    errors = [None] * size

    def run(rank):
        try:
            World(rank, size, store, timeout_s=10, prefix="t").agree("test facts",
                                                                    facts_of_rank(rank))
        except nt.DistributedError as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_agreeing_ranks_pass():
    assert _run_ranks(lambda rank: {"parameters": 10, "batch": [[32, 3]]}, size=3) == [None] * 3


def test_disagreeing_ranks_all_fail_naming_the_difference():
    errors = _run_ranks(lambda rank: {"parameters": 10, "batch": [[32 + rank, 3]]})
    assert errors[0] == errors[1] and errors[0] is not None
    assert "batch is [[33, 3]] on rank 1 and [[32, 3]] on rank 0" in errors[0]


def test_a_missing_rank_times_out_with_a_message():
    store = dist.HashStore()
    with pytest.raises(nt.DistributedError, match="waited 1 s for every rank"):
        World(0, 2, store, timeout_s=1, prefix="t").agree("test facts", {"a": 1})


def test_init_distributed_outside_torchrun_says_how_to_start(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(nt.DistributedError, match="torchrun --nproc_per_node=N"):
        nt.init_distributed()


def test_bucket_mb_must_be_positive():
    model = MLP()
    with pytest.raises(ValueError, match="bucket_mb must be a positive number"):
        nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), bucket_mb=0)


# ---------------------------------------------------------------------- a 2-rank job


PER_RANK = 8


def _worker(rank, world, init_file, result_file, mismatch, accumulate=1):
    # As nt.init_distributed does: modules that torch.optim imports on its first optimizer,
    # imported after the group exists, keep it alive past destroy_process_group, and its gloo
    # threads abort the process at exit ("terminate called without an active exception").
    _torch_private.import_before_process_group()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        model = MLP(hidden=32 + (rank if mismatch else 0))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = nt.Step(model, opt, torch.nn.CrossEntropyLoss(reduction="none"), warmup=2,
                       accumulate=accumulate)
        batches = classification_batches(4 * accumulate, PER_RANK * world, seed=5)
        calls, real_all_reduce = [], dist.all_reduce

        def counting_all_reduce(*args, **kwargs):
            calls[-1] += 1
            return real_all_reduce(*args, **kwargs)
        dist.all_reduce = counting_all_reduce  # how many gradient all-reduces each call ran
        try:
            losses = []
            for x, y in batches:
                calls.append(0)
                losses.append(step(((x[rank * PER_RANK:(rank + 1) * PER_RANK]),
                                    y[rank * PER_RANK:(rank + 1) * PER_RANK])))
        except nt.DistributedError as exc:
            torch.save({"error": str(exc)}, f"{result_file}.{rank}")
            return
        finally:
            dist.all_reduce = real_all_reduce
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "losses": torch.stack(losses), "stats": step.stats(),
                    "all_reduces": calls}, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


def _launch(world, mismatch=False, accumulate=1):
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result = os.path.join(tmp, "init"), os.path.join(tmp, "result")
        mp.start_processes(_worker, args=(world, init_file, result, mismatch, accumulate),
                           nprocs=world, start_method="spawn")
        return [torch.load(f"{result}.{r}", weights_only=False) for r in range(world)]


def test_two_ranks_train_as_one_process_with_the_whole_batch():
    results = _launch(2)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = classification_batches(4, PER_RANK * 2, seed=5)
    losses = eager_loop(model, opt, torch.nn.CrossEntropyLoss(reduction="none"), batches)
    reference = copy.deepcopy(model)
    for result in results:
        assert result["stats"]["world_size"] == 2
        trained = MLP()
        trained.load_state_dict(result["model"])
        trained_opt = torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9)
        trained_opt.load_state_dict(result["optimizer"])
        assert_same_training(trained, trained_opt, reference, opt, rtol=1e-5, atol=1e-6)
    # Each rank's loss is its half's mean; together they average to the whole batch's loss.
    mean = (results[0]["losses"] + results[1]["losses"]) / 2
    torch.testing.assert_close(mean, torch.stack(losses), rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0]["model"].values(), results[1]["model"].values()):
        assert torch.equal(a, b)  # identical replicas


def test_accumulating_ranks_train_as_one_process_with_the_whole_batch():
    """2 ranks x 2 micro-batches of 8 per update: one process with batches of 32, and the
    gradients are all-reduced only in the calls that update (DDP's no_sync)."""
    results = _launch(2, accumulate=2)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = classification_batches(8, PER_RANK * 2, seed=5)
    whole = [(torch.cat([batches[i][0], batches[i + 1][0]]),
              torch.cat([batches[i][1], batches[i + 1][1]])) for i in range(0, 8, 2)]
    eager_loop(model, opt, torch.nn.CrossEntropyLoss(reduction="none"), whole)
    for result in results:
        assert result["stats"]["updates"] == 4
        calls = result["all_reduces"]  # micro-batch calls none; updating calls theirs
        assert calls[0::2] == [0] * 4 and min(calls[1::2]) >= 1, calls
        trained = MLP()
        trained.load_state_dict(result["model"])
        trained_opt = torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9)
        trained_opt.load_state_dict(result["optimizer"])
        assert_same_training(trained, trained_opt, model, opt, rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0]["model"].values(), results[1]["model"].values()):
        assert torch.equal(a, b)  # identical replicas


def test_ranks_with_different_models_fail_clearly_on_every_rank():
    results = _launch(2, mismatch=True)
    for result in results:
        assert "the ranks disagree on the model, optimizer and Step options" in result["error"]
        assert "parameters is" in result["error"]


def test_buckets_go_out_in_the_planned_order_whatever_order_they_fill():
    # NCCL matches collectives by their order on each rank: a bucket that fills early waits
    # until every bucket planned before it has gone out.
    from nimble_train._gradsync import Bucket, GradientSync

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(6)]
    sync = GradientSync(World(0, 2, dist.HashStore(), prefix="t"), torch.device("cpu"), 1.0)
    sync._buckets = [Bucket(torch.float32, 4 * i, 4 * i + 4, [2 * i, 2 * i + 1],
                            params=params[2 * i:2 * i + 2]) for i in range(3)]
    sync._bucket_of = {id(p): i // 2 for i, p in enumerate(params)}
    launched = []
    sync._launch = launched.append
    for order in ([5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5], [2, 4, 0, 3, 5, 1]):
        launched.clear()
        sync.begin()
        trace = []
        for i in order:
            sync._on_ready(params[i])
            trace.append(list(launched))
        assert launched == [0, 1, 2], order
        # Nothing goes out before bucket 0 is complete.
        first_full = max(order.index(0), order.index(1))
        assert all(t == [] for t in trace[:first_full]), (order, trace)
    sync._active = False
    sync._on_ready(params[0])  # outside a step: ignored
    assert launched == [0, 1, 2]


def test_a_side_stream_s_report_replaces_autograd_s_hook_while_its_layers_are_split():
    # Autograd's accumulation hook fires for a split layer's parameters too, with no gradient
    # (the side stream accumulates it): counted twice, a bucket would go out before it is full.
    from nimble_train._gradsync import Bucket, GradientSync

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    sync = GradientSync(World(0, 2, dist.HashStore(), prefix="t"), torch.device("cpu"), 1.0)
    sync._buckets = [Bucket(torch.float32, 0, 4, [0, 1], params=params)]
    sync._bucket_of = {id(p): 0 for p in params}
    launched = []
    sync._launch = launched.append
    sync.reported_by_side([params[0]])
    sync.begin()
    sync._on_ready(params[0])  # autograd's hook, after the side stream's launch: ignored
    sync._on_ready(params[0])
    sync._on_ready(params[1])
    assert launched == []
    sync.ready(params[0])  # the side stream's report
    assert launched == [0]
    sync.reported_by_side([])
    sync.begin()
    sync._on_ready(params[0])
    sync._on_ready(params[1])
    assert launched == [0, 0]


def test_buckets_over_the_fused_flat_buffers_follow_the_backward():
    # The set-up the captured step uses, on the CPU with a one-rank store: the first backward
    # notes the arrival order, buckets are cut from the fused optimizer's flat gradients, and
    # in a later backward every bucket goes out, in the planned order, as soon as it fills.
    from nimble_train._gradsync import GradientSync
    from nimble_train.optim import FusedOptimizer

    torch.manual_seed(0)
    model = MLP(features=64, hidden=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = classification_batches(1, 8, features=64)[0]
    loss_fn = torch.nn.CrossEntropyLoss()
    sync = GradientSync(World(0, 1, dist.HashStore(), prefix="t"), torch.device("cpu"), 0.05)
    with sync.observing(list(model.parameters())):
        loss_fn(model(x), y).backward()
    with sync.observing(list(model.parameters())):
        pass  # only the first backward is noted
    fused = FusedOptimizer(opt)
    sync.use_buckets(fused)
    assert sync.num_buckets >= 3
    bucketed = [p for b in sync._buckets for p in b.params]
    assert sorted(map(id, bucketed)) == sorted(id(p) for p in model.parameters())
    launched = []
    sync._launch = launched.append
    sync.begin()
    fused.zero_grad()
    loss_fn(model(x), y).backward()
    assert launched == list(range(sync.num_buckets))  # all, in order, during the backward
    # The head's gradients arrive first: the first bucket holds the last layer.
    assert sync._buckets[0].params[-1] is list(model.parameters())[-1]


# ---------------------------------------------------------------------- sharded optimizer


class ThreadComm:
    """NCCL's in-place collectives between threads that stand for the ranks (CPU tensors)."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots = [None] * size

    def rank(self, r):
        comm = self

        class Rank:
            def all_reduce_(self, flat, offset, count, op):
                comm._exchange(r, flat[offset: offset + count])
                total = sum(comm.slots)
                comm.barrier.wait()
                flat[offset: offset + count] = total / comm.size if op == "avg" else total

            def reduce_scatter_(self, flat, offset, count, op):
                part = count // comm.size
                comm._exchange(r, flat[offset: offset + count])
                mine = sum(s[r * part: (r + 1) * part] for s in comm.slots)
                comm.barrier.wait()
                flat[offset + r * part: offset + (r + 1) * part] = (
                    mine / comm.size if op == "avg" else mine)

            def all_gather_(self, flat, offset, count):
                part = count // comm.size
                comm._exchange(r, flat[offset: offset + count])
                gathered = torch.cat([s[q * part: (q + 1) * part]
                                      for q, s in enumerate(comm.slots)])
                comm.barrier.wait()
                flat[offset: offset + count] = gathered
        return Rank()

    def _exchange(self, r, t):
        self.slots[r] = t.clone()
        self.barrier.wait()


def _on_threads(size, fn):
    """Runs fn(rank) on `size` threads; returns their results, re-raising the first error."""
    results, errors = [None] * size, []

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


SHARD_OPTIMIZERS = {
    "sgd-nesterov": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True,
                                                   weight_decay=1e-3),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=2e-3, weight_decay=0.05),
    "adam-amsgrad": lambda groups: torch.optim.Adam(groups, lr=2e-3, amsgrad=True),
    # LAMB's trust ratios need each whole tensor's norms: the ranks add their parts of them.
    # The second group without weight decay: its ratios are 1 unless always_adapt.
    "lamb": lambda groups: nt.optim.LAMB(
        [{**groups[0], "weight_decay": 0.05}, {**groups[1], "weight_decay": 0.0}], lr=2e-3),
    "lamb-always-adapt": lambda groups: nt.optim.LAMB(groups, lr=2e-3, weight_decay=0.0,
                                                      always_adapt=True),
}


def _groups(model):
    # Two groups with different learning rates: pieces cut across parameters of both.
    params = list(model.parameters())
    return [{"params": params[::2]}, {"params": params[1::2], "lr": 1e-3}]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("name", list(SHARD_OPTIMIZERS))
def test_sharded_optimizer_trains_as_one_process_and_saves_whole_state(name, clip, ranks):
    # Each rank: its share of the batch, buckets reduce-scattered into its parts, the fused
    # update of its parts alone (clip norms summed over the ranks), the parameters
    # all-gathered. Reference: torch.optim on one model with the whole batch.
    from nimble_train._gradsync import GradientSync
    from nimble_train.optim import FusedOptimizer

    make = SHARD_OPTIMIZERS[name]
    torch.manual_seed(0)
    start = MLP(features=20, hidden=48, classes=5)
    batches = classification_batches(5, 6 * ranks, features=20, seed=2)
    loss_fn = torch.nn.CrossEntropyLoss()
    store, comm = dist.HashStore(), ThreadComm(ranks)

    def rank_run(r):
        model = copy.deepcopy(start)
        opt = make(_groups(model))
        sync = GradientSync(World(r, ranks, store, prefix="s"), torch.device("cpu"), 0.002,
                            shard=True)
        sync.comm = comm.rank(r)
        mine = [(x[6 * r: 6 * (r + 1)], y[6 * r: 6 * (r + 1)]) for x, y in batches]
        with sync.observing(list(model.parameters())):
            loss_fn(model(mine[0][0]), mine[0][1]).backward()
        fused = FusedOptimizer(opt, shard_world=ranks)
        whole_bytes = fused.state_bytes
        sync.use_buckets(fused)
        assert sync.num_buckets >= 3
        assert fused.state_bytes * ranks == whole_bytes  # 1/N of the state on each rank
        with pytest.raises(RuntimeError, match="consolidate_optimizer_state"):
            opt.state_dict()
        for i, (x, y) in enumerate(mine):
            if i:
                fused.zero_grad()
                loss_fn(model(x), y).backward()
            for b in sync._buckets:  # what the backward hooks launch, in the same order
                sync.comm.reduce_scatter_(sync._flat[b.dtype], b.start, b.stop - b.start, "avg")
            fused.step(max_grad_norm=clip)
            sync.after_update()
        fused.consolidate(sync.gather)
        saved = copy.deepcopy(opt.state_dict())
        params = [p.detach().clone() for p in model.parameters()]
        fused.step(max_grad_norm=clip)  # shards move on: the whole copies are dropped again
        with pytest.raises(RuntimeError, match="consolidate_optimizer_state"):
            opt.state_dict()
        fused.close()  # its hooks go: state_dict no longer refuses (Step.close consolidates)
        opt.state_dict()
        return params, saved

    results = _on_threads(ranks, rank_run)

    reference = copy.deepcopy(start)
    ref_opt = make(_groups(reference))
    # The first step's gradient is noted eagerly above; every step is an update on both sides.
    eager_loop(reference, ref_opt, loss_fn, batches, grad_clip=clip)
    for params, saved in results:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))  # identical replicas
        for a, b in zip(params, reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        expected = ref_opt.state_dict()
        assert saved["param_groups"] == expected["param_groups"]
        for key, state in expected["state"].items():
            for field, value in state.items():
                torch.testing.assert_close(saved["state"][key][field].float(), value.float(),
                                           rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=key, f=field: f"state {k} {f}: {m}")


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["update", "clip"])
@pytest.mark.parametrize("shard", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("net", ["mlp", "reads-late"])
@pytest.mark.parametrize("lamb", [False, True], ids=["plain", "lamb"])
def test_updates_in_buckets_during_the_backward_train_as_one_process(lamb, net, shard, clip,
                                                                      ranks):
    # Each rank: from its second step on, every bucket is reduced (sharded: reduce-scattered),
    # updated (sharded: this rank's part, then all-gathered) as soon as its gradients are
    # complete, while the backward goes on; buckets whose parameters the backward still reads
    # wait for its end. Clipping needs the global norm: each bucket's share of it is taken as
    # soon as it is reduced (late ones too: they read only gradients), the update follows the
    # backward. LAMB: each bucket's trust ratios from its own tensors' norms (sharded: the
    # ranks' parts of them added, bucket by bucket). Reference: torch.optim (our LAMB's eager
    # step) on one model with the whole batch.
    from nimble_train._gradsync import GradientSync
    from nimble_train.optim import FusedOptimizer

    make = SHARD_OPTIMIZERS["lamb" if lamb else "adamw" if shard else "sgd-nesterov"]
    torch.manual_seed(0)
    start = MLP(features=20, hidden=48, classes=5) if net == "mlp" else ReadsTheHeadLate()
    batches = classification_batches(5, 6 * ranks, features=20, seed=2)
    loss_fn = torch.nn.CrossEntropyLoss()
    store, comm = dist.HashStore(), ThreadComm(ranks)

    def rank_run(r):
        model = copy.deepcopy(start)
        params = list(model.parameters())
        opt = make(_groups(model))
        sync = GradientSync(World(r, ranks, store, prefix="u"), torch.device("cpu"), 0.002,
                            shard=shard)
        sync.comm = comm.rank(r)
        mine = [(x[6 * r: 6 * (r + 1)], y[6 * r: 6 * (r + 1)]) for x, y in batches]
        with sync.observing(params):
            loss_fn(model(mine[0][0]), mine[0][1]).backward()
        fused = FusedOptimizer(opt, shard_world=ranks if shard else 1)
        sync.use_buckets(fused, update_in_buckets=True)
        assert sync.num_buckets >= 3
        late = sync.num_buckets - sync.early_buckets
        assert late == (0 if net == "mlp" else 1), late
        # The first step after the backward, as one pass (an eager step's way).
        for b in sync._buckets:
            if shard:
                sync.comm.reduce_scatter_(sync._flat[b.dtype], b.start, b.stop - b.start, "avg")
            else:
                sync.comm.all_reduce_(sync._flat[b.dtype], b.start, b.stop - b.start, "avg")
        fused.step(max_grad_norm=clip)
        sync.after_update()
        arrived, during = [0], []
        hooks = [p.register_post_accumulate_grad_hook(
            lambda p: arrived.__setitem__(0, arrived[0] + 1)) for p in params]
        real_update = fused.update_part
        fused.update_part = lambda i: (during.append(arrived[0] < len(params)),
                                       real_update(i))
        for x, y in mine[1:]:
            fused.zero_grad()
            arrived[0] = 0
            sync.begin(fused, max_grad_norm=clip)
            loss_fn(model(x), y).backward()
            norm = sync.finish()
            assert (norm is None) == (clip is None)
            assert clip is None or float(norm) > 2 * clip  # the clip acts
        for hook in hooks:
            hook.remove()
        # Every bucket once per step; all but the late ones before the backward ended.
        assert len(during) == (len(mine) - 1) * sync.num_buckets
        early = sync.num_buckets if clip else sync.early_buckets
        assert sum(during) == (len(mine) - 1) * early, during
        return [p.detach().clone() for p in params]

    results = _on_threads(ranks, rank_run)

    reference = copy.deepcopy(start)
    eager_loop(reference, make(_groups(reference)), loss_fn, batches, grad_clip=clip)
    for params in results:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0]))  # identical replicas
        for a, b in zip(params, reference.parameters()):
            # Adam's update divides by the root of tiny second moments: the ranks' average
            # summed in another order moves a few elements by ~1e-4 relative (the same with
            # the update after the backward).
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_loaded_state_reaches_the_shards():
    # load_state_dict puts whole tensors back; each rank keeps its parts and trains on from them.
    from nimble_train._gradsync import GradientSync
    from nimble_train.optim import FusedOptimizer

    torch.manual_seed(1)
    start = MLP(features=20, hidden=48, classes=5)
    batches = classification_batches(3, 8, features=20, seed=4)
    loss_fn = torch.nn.CrossEntropyLoss()
    reference = copy.deepcopy(start)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3)
    eager_loop(reference, ref_opt, loss_fn, batches[:2])
    checkpoint = (copy.deepcopy(reference.state_dict()), copy.deepcopy(ref_opt.state_dict()))
    eager_loop(reference, ref_opt, loss_fn, batches[2:])
    store, comm = dist.HashStore(), ThreadComm(2)

    def rank_run(r):
        model = copy.deepcopy(start)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        sync = GradientSync(World(r, 2, store, prefix="l"), torch.device("cpu"), 0.002,
                            shard=True)
        sync.comm = comm.rank(r)
        fused = FusedOptimizer(opt, shard_world=2)
        sync.use_buckets(fused)
        model.load_state_dict(checkpoint[0])
        opt.load_state_dict(checkpoint[1])
        # The whole tensors went to the shards and were let go.
        assert all(set(opt.state[p]) == {"step"} for p in model.parameters())
        x, y = batches[2]
        fused.zero_grad()
        loss_fn(model(x[4 * r: 4 * (r + 1)]), y[4 * r: 4 * (r + 1)]).backward()
        for b in sync._buckets:
            sync.comm.reduce_scatter_(sync._flat[b.dtype], b.start, b.stop - b.start, "avg")
        fused.step()
        sync.after_update()
        return [p.detach().clone() for p in model.parameters()]

    for params in _on_threads(2, rank_run):
        for a, b in zip(params, reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_shard_optimizer_is_refused_where_it_cannot_work(monkeypatch):
    from nimble_train import distributed

    monkeypatch.setattr(distributed, "current_world",
                        lambda timeout_s=0: World(0, 2, dist.HashStore(), prefix="r"))
    monkeypatch.setattr(nt.step, "current_world", distributed.current_world)
    model = MLP()
    with pytest.raises(ValueError, match="shard_optimizer=True needs CUDA GPUs.*on cpu"):
        nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer=True)
    with pytest.raises(ValueError, match="shard_optimizer must be True or False"):
        nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer=1)
    from nimble_train.optim import FusedOptimizer, LAMB
    lamb = LAMB(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    fused = FusedOptimizer(lamb, shard_world=2)
    n = fused.flat_params[torch.float32].numel()
    fused.shard([(torch.float32, *_C.shard_slice(0, n, 2, 0))])  # rank 0's half
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="LAMB's trust ratios need every rank's part"):
        fused.step()  # without reduce_partials, the norms would be this rank's part alone
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_sharded_lamb_step_whose_sum_over_the_ranks_fails_changes_nothing(clip):
    # Each sum over the ranks of a step fails in turn (clipping: the gradient statistics, then
    # LAMB's per-tensor norms): the parameters, this rank's state and the step counts stay as
    # after the last completed step, and the next step is the one a run without the failures
    # takes.
    from nimble_train.optim import FusedOptimizer, LAMB

    def build():
        torch.manual_seed(0)
        model = MLP()
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        fused = FusedOptimizer(LAMB(model.parameters(), lr=1e-2, weight_decay=0.01),
                               shard_world=2)
        n = fused.flat_params[torch.float32].numel()
        fused.shard([(torch.float32, *_C.shard_slice(0, n, 2, 0))])  # rank 0's half
        return model, fused

    def held(model, fused):
        return ([p.detach().clone() for p in model.parameters()]
                + [t.clone() for piece in fused._state.pieces for t in piece.state.values()]
                + [fused._tables.param_steps.clone(), fused._tables.hyper.clone()])

    model, fused = build()
    twin, twin_fused = build()
    calls, fail_at = [0], [0]

    def reduce(t):  # one rank of two stands alone here: its part is the sum
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise RuntimeError("injected: the sum over the ranks failed")
    fused.reduce_partials = reduce
    twin_fused.reduce_partials = lambda t: None
    fused.step(max_grad_norm=clip)
    twin_fused.step(max_grad_norm=clip)
    before = held(model, fused)
    for k in range(1 if clip is None else 2):
        fail_at[0] = calls[0] + 1 + k
        with pytest.raises(RuntimeError, match="injected"):
            fused.step(max_grad_norm=clip)
        assert all(torch.equal(a, b) for a, b in zip(held(model, fused), before)), k
    fail_at[0] = 0
    fused.step(max_grad_norm=clip)
    twin_fused.step(max_grad_norm=clip)
    assert all(torch.equal(a, b) for a, b in zip(held(model, fused), held(twin, twin_fused)))
    assert not all(torch.equal(a, b) for a, b in zip(held(model, fused), before))


def test_an_overflow_in_one_shard_skips_the_update_on_every_rank():
    # fp16 loss scaling: a non-finite gradient in rank 1's part must skip the update on rank 0
    # too (the overflow flags are summed over the ranks), or the replicas would part.
    from nimble_train._gradsync import GradientSync
    from nimble_train.optim import DeviceLossScaler, FusedOptimizer

    torch.manual_seed(2)
    start = MLP(features=20, hidden=48, classes=5)
    x, y = classification_batches(1, 8, features=20, seed=6)[0]
    store, comm = dist.HashStore(), ThreadComm(2)

    def rank_run(r):
        model = copy.deepcopy(start)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sync = GradientSync(World(r, 2, store, prefix="o"), torch.device("cpu"), 0.002,
                            shard=True)
        sync.comm = comm.rank(r)
        fused = FusedOptimizer(opt, shard_world=2)
        sync.use_buckets(fused)
        scaler = DeviceLossScaler("cpu", init_scale=1024.0)
        before = [p.detach().clone() for p in model.parameters()]
        steps = []
        for overflow in (True, False):
            fused.zero_grad()
            scaler.scale_loss(torch.nn.functional.cross_entropy(
                model(x[4 * r: 4 * (r + 1)]), y[4 * r: 4 * (r + 1)])).backward()
            for b in sync._buckets:
                sync.comm.reduce_scatter_(sync._flat[b.dtype], b.start, b.stop - b.start, "avg")
            if overflow and r == 1:
                _, start_1, _, _, _ = sync.pieces()[-1]
                sync._flat[torch.float32][start_1] = float("inf")  # in rank 1's part only
            scaler.step(fused)
            sync.after_update()
            steps.append([p.detach().clone() for p in model.parameters()])
        return before, steps, float(scaler.scale)

    (before0, steps0, scale0), (before1, steps1, scale1) = _on_threads(2, rank_run)
    assert all(torch.equal(a, b) for a, b in zip(steps0[0], before0))  # skipped on rank 0 too
    assert all(torch.equal(a, b) for a, b in zip(steps1[0], before1))
    assert scale0 == scale1 == 512.0  # both backed off
    assert all(torch.equal(a, b) for a, b in zip(steps0[1], steps1[1]))  # then both update
    assert not all(torch.equal(a, b) for a, b in zip(steps0[1], before0))
