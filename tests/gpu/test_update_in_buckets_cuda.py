"""A data-parallel Step's update in buckets, on one GPU: a job of one rank.

torch.distributed makes no data-parallel world of one process, so these tests hand Step a
World of one rank over a file store: its buckets, NCCL communicator, collectives and the
update of each bucket right after its collective then run as they do on N GPUs (the
collectives of one rank copy nothing). tests/dist runs the same on 2 and more GPUs.
"""

import pytest
import torch
import torch.distributed as dist

import nimble_train as nt
import nimble_train.step as step_module
from nimble_train import _C
from nimble_train.distributed import World
from step_reference import (MLP, ReadsTheHeadLate, SmallCNN, UsesALayerTwice,
                            assert_same_training, classification_batches, eager_loop, twin)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not _C.has_nccl(), reason="built without NCCL")]

per_sample = torch.nn.CrossEntropyLoss(reduction="none")
TOL = {"rtol": 2e-4, "atol": 2e-5}


@pytest.fixture
def one_rank(monkeypatch, tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    monkeypatch.setattr(step_module, "current_world",
                        lambda: World(0, 1, store, timeout_s=60.0))


def train(model, optimizer, batches, bucket_mb=0.05, **options):
    step = nt.Step(model, optimizer, per_sample, warmup=2, bucket_mb=bucket_mb, init_sync=False,
                   **options)
    for batch in batches:
        step(batch)
    torch.cuda.synchronize()
    return step


def features_of(model):
    return 20 if isinstance(model, ReadsTheHeadLate) else 12


@pytest.mark.parametrize("net, make_opt, shard, expected", [
    ("mlp", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                      weight_decay=1e-4), False, "yes"),
    ("mlp", lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=0.05), True, "yes"),
    ("reads-late", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), False,
     "yes, but 1 bucket(s) after the backward"),
    ("reads-late", lambda p: torch.optim.Adam(p, lr=2e-3), True,
     "yes, but 1 bucket(s) after the backward"),
    ("mlp", lambda p: nt.optim.LAMB(p, lr=2e-3, weight_decay=0.05), False, "yes"),
    ("reads-late", lambda p: nt.optim.LAMB(p, lr=2e-3, weight_decay=0.05), True,
     "yes, but 1 bucket(s) after the backward"),
], ids=["sgd", "adamw-sharded", "reads-late", "reads-late-sharded", "lamb",
        "lamb-reads-late-sharded"])
def test_updates_in_buckets_train_as_the_eager_loop(one_rank, no_tf32, net, make_opt, shard,
                                                    expected):
    torch.manual_seed(0)
    model = MLP(hidden=256) if net == "mlp" else ReadsTheHeadLate(hidden=256)
    (m1, o1), (m2, o2) = twin(model.cuda(), make_opt)
    batches = classification_batches(8, 16, features=features_of(model), device="cuda")
    step = train(m1, o1, batches, shard_optimizer=shard)
    stats = step.stats()
    assert stats["captured"] and stats["replays"] == 6 and stats["buckets"] >= 3, stats
    assert stats["update_in_buckets"].startswith(expected), stats["update_in_buckets"]
    # Every linear layer's weight gradient on the side stream, which reports it to the buckets.
    assert stats["weight_grad_layers"] == 3 and stats["weight_grads_off"] is None, stats
    eager_loop(m2, o2, per_sample, batches)
    if shard:
        step.consolidate_optimizer_state()
    assert_same_training(m1, o1, m2, o2, **TOL)
    step.close()


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("net, make_opt", [
    ("mlp", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    ("cnn", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    ("mlp", lambda p: nt.optim.LAMB(p, lr=2e-3, weight_decay=0.05)),
], ids=["mlp", "cnn", "mlp-lamb"])
def test_the_update_in_buckets_is_the_update_after_the_backward_bit_for_bit(
        one_rank, deterministic_cudnn, net, make_opt, shard):
    """The same kernels on the same values, only earlier: identical parameters and state
    (LAMB: each tensor's norms summed over the same chunks, in the same order)."""
    torch.manual_seed(0)
    model = MLP(hidden=256) if net == "mlp" else SmallCNN()
    (m1, o1), (m2, o2) = twin(model.cuda(), make_opt)
    batches = classification_batches(8, 16, image=net == "cnn", device="cuda")
    early = train(m1, o1, batches, shard_optimizer=shard)
    late = train(m2, o2, batches, overlap_update=False, shard_optimizer=shard)
    assert early.stats()["update_in_buckets"] == "yes"
    assert late.stats()["update_in_buckets"] == "no: overlap_update=False"
    if shard:
        early.consolidate_optimizer_state()
        late.consolidate_optimizer_state()
    assert_same_training(m1, o1, m2, o2, rtol=0, atol=0)


def test_a_layer_called_twice_keeps_its_weight_gradient_on_autograd_s_stream(one_rank,
                                                                             no_tf32):
    """Data parallel, the side stream reports a split layer's gradient to the buckets once:
    a layer called twice is not split (its bucket would go out before its second gradient)."""
    torch.manual_seed(0)
    make_opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    (m1, o1), (m2, o2) = twin(UsesALayerTwice().cuda(), make_opt)
    batches = classification_batches(8, 16, features=6, classes=3, device="cuda")
    step = train(m1, o1, batches, bucket_mb=1e-4)
    stats = step.stats()
    assert stats["captured"] and stats["buckets"] >= 3, stats
    assert stats["weight_grad_layers"] == 2, stats  # a and head, not b
    eager_loop(m2, o2, per_sample, batches)
    assert_same_training(m1, o1, m2, o2, **TOL)


def test_accumulation_updates_in_buckets_in_the_window_s_last_call(one_rank, no_tf32):
    from step_reference import eager_accumulation_loop
    torch.manual_seed(0)
    make_opt = lambda p: torch.optim.AdamW(p, lr=2e-3)  # noqa: E731
    (m1, o1), (m2, o2) = twin(MLP(hidden=256).cuda(), make_opt)
    batches = classification_batches(12, 8, device="cuda")
    step = train(m1, o1, batches, accumulate=3)
    assert step.stats()["update_in_buckets"] == "yes" and step.stats()["updates"] == 4
    eager_accumulation_loop(m2, o2, per_sample, batches, 3)
    assert_same_training(m1, o1, m2, o2, **TOL)


@pytest.mark.parametrize("shard", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("options, why", [
    ({"grad_clip": 0.05}, "grad_clip needs the global gradient norm"),
    ({"amp": "fp16"}, "the fp16 loss scale needs every gradient's overflow check"),
    ({"amp": "fp16", "grad_clip": 0.05}, "grad_clip needs the global gradient norm"),
], ids=["clip", "fp16", "fp16-clip"])
def test_a_step_that_needs_a_global_quantity_takes_its_statistics_in_buckets(
        one_rank, no_tf32, options, why, shard):
    """Each bucket's share of the norm and overflow check right after its collective, the
    update after the backward: as the whole step after the backward, to the rounding of the
    norm's sums (taken per bucket instead of per flat buffer); and as the eager loop."""
    torch.manual_seed(0)
    make_opt = lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=0.05)  # noqa: E731
    (m1, o1), (m2, o2) = twin(MLP(hidden=256).cuda(), make_opt)
    batches = classification_batches(8, 16, device="cuda")
    m3, o3 = twin(m1, make_opt)[1]
    early = train(m1, o1, batches, shard_optimizer=shard, **options)
    late = train(m2, o2, batches, shard_optimizer=shard, overlap_update=False, **options)
    stats = early.stats()
    assert stats["captured"] and stats["replays"] == 6 and stats["buckets"] >= 3, stats
    assert stats["update_in_buckets"].startswith(f"statistics only: {why}"), stats
    if "grad_clip" in options:
        assert early.grad_norm is not None and float(early.grad_norm) > 0.1  # the clip acts
        torch.testing.assert_close(early.grad_norm, late.grad_norm, rtol=1e-5, atol=0)
    if shard:
        early.consolidate_optimizer_state()
        late.consolidate_optimizer_state()
    # Adam divides by the root of small second moments: over 8 steps the norm's rounding moves
    # a few elements by up to ~1e-4 relative
    assert_same_training(m1, o1, m2, o2, rtol=1e-4, atol=1e-6)
    if "amp" not in options:
        eager_loop(m3, o3, per_sample, batches, grad_clip=options["grad_clip"])
        assert_same_training(m1, o1, m3, o3, **TOL)
    early.close()
    late.close()


class Poisonable(torch.nn.Module):
    """An MLP and a parameter whose gradient is the batch's `z`: an inf there is an overflow
    in that parameter's bucket alone (z is zero otherwise, and changes nothing)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(hidden=256)
        self.w = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x, z):
        return self.mlp(x), (z * self.w).sum(1)


def test_an_overflow_in_one_bucket_skips_the_update_in_every_bucket(one_rank):
    """fp16, statistics in buckets: an inf gradient in one bucket skips the whole update (the
    parameters stay, the loss scale backs off); the next steps train on."""
    torch.manual_seed(0)
    model = Poisonable().cuda()
    batches = [((x, torch.zeros(16, 4, device="cuda")), y)
               for x, y in classification_batches(6, 16, device="cuda")]
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                   lambda out, y: per_sample(out[0], y) + out[1], warmup=2, bucket_mb=0.05,
                   init_sync=False, amp="fp16")
    for batch in batches:
        step(batch)
    stats = step.stats()
    assert stats["replays"] == 4 and stats["buckets"] >= 3, stats
    assert stats["update_in_buckets"].startswith("statistics only"), stats
    (x, z), y = batches[0]
    poisoned = z.clone()
    poisoned[3, 1] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scale = float(step._update.scaler.scale)
    step(((x, poisoned), y))
    torch.cuda.synchronize()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert float(step._update.scaler.scale) == scale / 2
    step(batches[1])
    torch.cuda.synchronize()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    step.close()


@pytest.mark.parametrize("options, kernel, expected", [
    ({}, "sgd_kernel", "yes"),
    ({"grad_clip": 1.0}, "grad_stats_kernel", "statistics only"),
], ids=["update", "clip-statistics"])
def test_the_first_bucket_is_updated_while_the_backward_runs(one_rank, options, kernel,
                                                             expected):
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(1)
    model = nt.models.resnet18_cifar().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(32, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    step = train(model, opt, [(x, y)] * 4, bucket_mb=4, **options)
    assert step.stats()["update_in_buckets"].startswith(expected), step.stats()
    assert step.stats()["buckets"] >= 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step((x, y))
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.time_range.elapsed_us() >= 0]
    updates = [e for e in kernels if kernel in e.name]
    backward = [e for e in kernels if "nimble_train" not in e.name
                and "nccl" not in e.name.lower()]
    assert len(updates) == step.stats()["buckets"], [e.name for e in updates]
    first_update = min(e.time_range.start for e in updates)
    after = [e for e in backward if e.time_range.start > first_update]
    assert after, "no backward kernel started after the first bucket's update: no overlap"
    step.close()
