"""One rank of tests/dist/test_step_dist.py: nt.Step data-parallel under torchrun.

    torchrun --nproc_per_node=N step_worker.py CASE

CASE: equivalence, clipped, unfused, sharded, accumulating, syncbn, overlap or mismatch.

Prints "rank R/N ok <wall time>" (or "rank R/N error: ...") as its last line before it leaves
the process group; the test checks the lines and how soon the job exits after them.
"""

import copy
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

import nimble_train as nt

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from step_reference import MLP, SmallCNN, classification_batches, eager_loop  # noqa: E402

per_sample = torch.nn.CrossEntropyLoss(reduction="none")


def checksum(model) -> torch.Tensor:
    return torch.stack([p.detach().double().sum() for p in model.parameters()]).cpu()


def _as_one_gpu(info, make_optimizer, *, grad_clip=None, bucket_mb=0.05, shard=False,
                after=None, after_close=None, **options):
    """N ranks of batch b train as one GPU with batch N*b; replicas stay identical.
    after(step, optimizer, reference optimizer) runs last, before the step is closed;
    after_close(optimizer, reference optimizer) once it is."""
    rank, world, device = info.rank, info.world_size, info.device
    per_rank = 8
    torch.manual_seed(0)
    model = MLP(features=32, hidden=256, classes=7).to(device)
    start = copy.deepcopy(model)
    opt = make_optimizer(model.parameters())
    step = nt.Step(model, opt, per_sample, warmup=2, grad_clip=grad_clip, bucket_mb=bucket_mb,
                   shard_optimizer=shard, **options)
    batches = classification_batches(8, per_rank * world, features=32, classes=7, seed=3,
                                     device=device)
    mine = [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
            for x, y in batches]
    for b in mine:
        step(b)
    torch.cuda.synchronize()
    stats = step.stats()
    assert stats["captured"] and stats["replays"] == 6 and stats["world_size"] == world, stats

    sums = [torch.zeros(len(list(model.parameters())), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, checksum(model))  # gloo: CPU tensors
    for other in sums[1:]:
        assert torch.equal(other, sums[0]), "replicas differ after training"

    # One process, the whole batch, the plain eager loop.
    ref_opt = make_optimizer(start.parameters())
    eager_loop(start, ref_opt, per_sample, batches, grad_clip=grad_clip)
    for (name, a), b in zip(model.named_parameters(), start.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    if after is not None:
        after(step, opt, ref_opt)
    step.close()
    if after_close is not None:
        after_close(opt, ref_opt)
    return stats


def equivalence(info):
    # Tiny buckets: several all-reduces per step, launched as their gradients arrive, each
    # bucket updated right after its all-reduce (or, overlap_update=False, after the backward).
    for overlap, expected in ((True, "yes"), (False, "no: overlap_update=False")):
        stats = _as_one_gpu(info, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                                 weight_decay=1e-4),
                            overlap_update=overlap)
        assert stats["buckets"] >= 3, stats
        assert stats["update_in_buckets"] == expected, stats
    # LAMB too: each bucket's trust ratios from its own whole tensors.
    stats = _as_one_gpu(info, lambda params: nt.optim.LAMB(
        _two_groups(params, weight_decay=0.0), lr=2e-3, weight_decay=0.05))
    assert stats["update_in_buckets"] == "yes", stats


def clipped(info):
    """The clip sees the global norm of the averaged gradients, not of a rank's own."""
    torch.manual_seed(0)
    probe = MLP(features=32, hidden=256, classes=7)
    x, y = classification_batches(1, 8 * info.world_size, features=32, classes=7, seed=3)[0]
    per_sample(probe(x), y).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(probe.parameters(), float("inf"))
    assert norm > 0.2, f"the clip at 0.05 would not act (first gradient norm {norm:.3f})"
    _as_one_gpu(info, lambda params: torch.optim.AdamW(params, lr=1e-3), grad_clip=0.05)


def sharded(info):
    """ZeRO-1: reduce-scatter, each rank updates its parts, all-gather, all in the graph; each
    rank holds 1/N of the state, and a consolidated state_dict is torch's whole one."""
    def check(step, opt, ref_opt):
        stats = step.stats()
        assert stats["optimizer_shards"] == info.world_size, stats
        whole = 2 * 4 * sum(p.numel() for p in step.model.parameters())  # 2 fp32 moments
        assert stats["optimizer_state_bytes"] <= 1.05 * whole / info.world_size, (stats, whole)
        try:
            opt.state_dict()
            raise AssertionError("state_dict() of a sharded optimizer did not refuse")
        except RuntimeError as exc:
            assert "consolidate_optimizer_state" in str(exc), exc
        step.consolidate_optimizer_state()
        ours, ref = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        assert ours.keys() == ref.keys()
        for key in ref:
            for field in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours[key][field], ref[key][field], rtol=1e-3,
                                           atol=1e-6, msg=lambda m, f=field: f"{key} {f}: {m}")
            assert float(ours[key]["step"]) == float(ref[key]["step"])

    def closed(opt, ref_opt):
        # close() gathers the shards back and removes its hooks: the optimizer is whole again.
        ours, ref = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        for key in ref:
            torch.testing.assert_close(ours[key]["momentum_buffer"], ref[key]["momentum_buffer"],
                                       rtol=1e-3, atol=1e-6)

    stats = _as_one_gpu(info, lambda params: torch.optim.AdamW(params, lr=1e-3), grad_clip=0.05,
                        shard=True, after=check)
    assert stats["update_in_buckets"].startswith("statistics only: grad_clip"), stats
    stats = _as_one_gpu(info, lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                        shard=True, after_close=closed)
    assert stats["update_in_buckets"] == "yes", stats  # each part's update and all-gather
    # LAMB: right after each bucket's reduce-scatter, the ranks add their parts of its tensors'
    # norms, then update their parts with the whole tensors' trust ratios and all-gather the
    # bucket. The second group, without weight decay, keeps ratio 1.
    stats = _as_one_gpu(info, lambda params: nt.optim.LAMB(
        _two_groups(params, weight_decay=0.0), lr=2e-3, weight_decay=0.05), shard=True,
        after=check)
    assert stats["optimizer_shards"] == info.world_size, stats
    assert stats["update_in_buckets"] == "yes", stats


def _two_groups(params, **second):
    params = list(params)
    return [{"params": params[::2]}, {"params": params[1::2], **second}]


def unfused(info):
    """An optimizer Step cannot fuse: one all-reduce of the concatenated gradients."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "captures the optimizer's own step()"
        # eps well above rounding: a gradient that differs from the reference's by rounding
        # near zero must not move its update by more than the tolerance.
        stats = _as_one_gpu(info, lambda params: torch.optim.RMSprop(params, lr=1e-3, eps=1e-4))
    assert stats["buckets"] == 0, stats


def accumulating(info):
    """Two micro-batches per update on every rank train as one GPU with the whole window, plain
    and sharded; the buckets are all-reduced only in the calls that update (DDP's no_sync)."""
    rank, world, device = info.rank, info.world_size, info.device
    per_rank, k = 8, 2
    for shard in (False, True):
        torch.manual_seed(0)
        model = MLP(features=32, hidden=256, classes=7).to(device)
        start = copy.deepcopy(model)
        make = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
        opt = make(model.parameters())
        step = nt.Step(model, opt, per_sample, warmup=2, accumulate=k, bucket_mb=0.05,
                       shard_optimizer=shard)
        batches = classification_batches(8 * k, per_rank * world, features=32, classes=7,
                                         seed=3, device=device)
        outside = []  # bucket collectives launched (or captured) by calls that do not update
        real_launch = step._gradsync._launch

        def launch(index, real_launch=real_launch, step=step, outside=outside):
            if step.stats()["micro_batch"] != k - 1:
                outside.append(step.stats()["micro_batch"])
            real_launch(index)
        step._gradsync._launch = launch
        for x, y in batches:
            step((x[rank * per_rank:(rank + 1) * per_rank],
                  y[rank * per_rank:(rank + 1) * per_rank]))
        torch.cuda.synchronize()
        stats = step.stats()
        assert stats["captured"] and stats["updates"] == 8 and stats["graphs"] == 2, stats
        assert not outside, f"micro-batch calls launched collectives: {outside}"
        sums = [torch.zeros(len(list(model.parameters())), dtype=torch.float64)
                for _ in range(world)]
        dist.all_gather(sums, checksum(model))
        for other in sums[1:]:
            assert torch.equal(other, sums[0]), "replicas differ after training"
        whole = [(torch.cat([batches[i][0], batches[i + 1][0]]),
                  torch.cat([batches[i][1], batches[i + 1][1]])) for i in range(0, 8 * k, k)]
        eager_loop(start, make(start.parameters()), per_sample, whole)
        for (name, a), b in zip(model.named_parameters(), start.parameters()):
            torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        step.close()


def syncbn(info):
    """SyncBatchNorm inside the captured step: its statistics span every rank's samples, so N
    ranks of batch b train as one process with plain BatchNorm and batch N*b, running
    statistics included."""
    rank, world, device = info.rank, info.world_size, info.device
    torch.backends.cudnn.allow_tf32 = False  # the one-process reference sums in another order
    per_rank = 8
    torch.manual_seed(0)
    start = SmallCNN(classes=7).to(device)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(start))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = nt.Step(model, opt, per_sample, warmup=2, bucket_mb=0.001)
    batches = classification_batches(8, per_rank * world, classes=7, seed=5, device=device,
                                     image=True)
    # Ranks get different halves: with per-replica statistics the result would differ.
    for x, y in batches:
        step((x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]))
    torch.cuda.synchronize()
    stats = step.stats()
    assert stats["captured"] and stats["replays"] == 6 and stats["world_size"] == world, stats

    state = [t.detach().double().sum() for t in model.state_dict().values()]
    sums = [torch.zeros(len(state), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, torch.stack(state).cpu())
    for other in sums[1:]:
        assert torch.equal(other, sums[0]), "replicas differ after training"

    ref_opt = torch.optim.SGD(start.parameters(), lr=0.05, momentum=0.9)
    eager_loop(start, ref_opt, per_sample, batches)
    ours, ref = model.state_dict(), start.state_dict()
    assert list(ours) == list(ref), (list(ours), list(ref))
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    step.close()


def overlap(info):
    """The first bucket's all-reduce, and its update, start while the backward is still
    running."""
    torch.manual_seed(1)
    model = nt.models.resnet18_cifar().to(info.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = nt.Step(model, opt, per_sample, warmup=2, bucket_mb=4)
    x = torch.randn(32, 3, 32, 32, device=info.device)
    y = torch.randint(0, 10, (32,), device=info.device)
    for _ in range(4):
        step((x, y))
    torch.cuda.synchronize()
    assert step.stats()["captured"] and step.stats()["buckets"] >= 3, step.stats()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step((x, y))
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.elapsed_us() >= 0), key=lambda e: e.time_range.start)
    nccl = [e for e in kernels if "nccl" in e.name.lower()]
    assert nccl, [e.name for e in kernels][:20]
    first = nccl[0].time_range.start
    during = [e.name for e in kernels if "nccl" not in e.name.lower()
              and "nimble_train" not in e.name and e.time_range.start > first]
    assert during, "no backward kernel ran after the first all-reduce started: no overlap"
    updates = [e.time_range.start for e in kernels if "sgd_kernel" in e.name]
    assert len(updates) == step.stats()["buckets"], [e.name for e in kernels]
    assert any(e.time_range.start > min(updates) for e in kernels
               if "nccl" not in e.name.lower() and "nimble_train" not in e.name), \
        "no backward kernel ran after the first bucket's update: the update did not overlap"
    print(f"rank {info.rank}: {len(nccl)} all-reduce kernels; {len(during)} backward kernels "
          "started after the first one", flush=True)
    step.close()


def say(line: str) -> None:
    """One write of the whole line: the ranks share the launcher's stdout, and print() writes
    the text and its newline apart when Python runs unbuffered (PYTHONUNBUFFERED), so two
    ranks' lines could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def mismatch(info):
    """Rank 1 builds a wider model: every rank fails at its first step with the reason."""
    model = MLP(hidden=32 + info.rank).to(info.device)
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample)
    x = torch.randn(8, 12, device=info.device)
    step((x, torch.zeros(8, dtype=torch.long, device=info.device)))


def main():
    case = sys.argv[1]
    info = nt.init_distributed(timeout_s=60)
    prefix = f"rank {info.rank}/{info.world_size}"
    try:
        cases = {"equivalence": equivalence, "clipped": clipped, "unfused": unfused,
                 "sharded": sharded, "accumulating": accumulating,
                 "syncbn": syncbn, "overlap": overlap, "mismatch": mismatch}
        cases[case](info)
        say(f"{prefix} ok {time.time():.3f}")
    except nt.DistributedError as exc:
        say(f"{prefix} error: {exc} {time.time():.3f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
