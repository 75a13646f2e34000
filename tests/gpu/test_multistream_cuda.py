"""Multi-stream captured steps equal single-stream ones and the eager loop."""

import copy

import pytest
import torch

import nimble_train as nt
from nimble_train import _capture, _weight_grads
from step_reference import (InceptionNet, RandomDagNet, SmallSideOperators, TransformerBlock,
                            assert_same_training, classification_batches, eager_loop,
                            float32_weight_grads, nudged, training_gap)

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_cudnn")]

per_sample = torch.nn.CrossEntropyLoss(reduction="none")
# Not bitwise: where gradients of one tensor arrive from several streams, autograd sums them
# in another order than on one stream, and BatchNorm's backward amplifies that rounding.
TOL = {"rtol": 1e-3, "atol": 1e-4}
BF16_TOL = {"rtol": 2e-2, "atol": 2e-3}
LOSS_TOL = {"rtol": 1e-3, "atol": 1e-3}


def three_ways(model, make_opt, batches, tol=TOL, bitwise=True, eager_tol=None,
               eager_check="state", eager_reference=None, **options):
    """Step on planned streams (twice), on one stream, and the eager loop, from equal starts.

    The one-stream run captures the batch-norm kernels the multi-stream capture ran (see
    nimble_train/_batch_norm.py), so that the two differ only in their streams.

    With `bitwise`, the two multi-stream runs must agree exactly: a captured graph fixes the
    order of every sum, so a difference would be a race between streams. The eager loop is
    compared over the warm-up and the first two graph steps only: the captured step divides
    the loss by the valid-sample count it reads on the device (a rounding step eager does not
    take), and BatchNorm nets amplify that last-bit difference step after step, on one stream
    as on several; the long run is compared against single-stream Step instead.

    `eager_check` says how: "state" compares weights, buffers and optimizer state within
    `eager_tol`. For chaotic nets (deep BatchNorm stacks over a few samples) even that short run
    magnifies last-bit differences past any fixed tolerance: a nudge of one float32 rounding
    step to the starting weights flips ReLU and max-pool choices and moves some gradients by
    1e-4 of their norm in the first step. There the gap to eager, in norm over all weights,
    buffers and optimizer state, must stay within 10x the gap between two eager runs whose
    starting weights differ by that nudge ("floor"): a real error (a skipped update, a wrong
    step size, a race) moves the training by far more. Where even the nudge moves the training
    by most of its norm in a few steps ("first-graph-loss"), only the losses up to the first
    graph step, which starts from the eager state up to rounding, are compared, tightly.

    With amp, the eager loop runs under the same autocast; `eager_reference(model)` gives the
    eager model, from the first graph step on, the numerics Step's captured steps document
    where they differ from autograd's.
    """
    warmup = 2
    start = copy.deepcopy(model).cpu()
    models = [model.cuda()] + [copy.deepcopy(model).cuda() for _ in range(2)]
    opts = [make_opt(m.parameters()) for m in models]
    multi = nt.Step(models[0], opts[0], per_sample, streams="auto", warmup=warmup, **options)
    again = nt.Step(models[1], opts[1], per_sample, streams="auto", warmup=warmup, **options)
    single = nt.Step(models[2], opts[2], per_sample, streams=1, warmup=warmup, **options)
    losses_multi = torch.stack([multi(b).clone() for b in batches])
    losses_again = torch.stack([again(b).clone() for b in batches])
    # One stream with the kernels the planned capture ran: PyTorch's batch norms where the
    # plan has several streams (cuDNN's differ in more than the order of sums).
    saved = _capture.BATCH_NORM_KERNELS
    if multi.stats()["native_batch_norm_layers"]:
        _capture.BATCH_NORM_KERNELS = "native"
    try:
        losses_single = torch.stack([single(b).clone() for b in batches])
    finally:
        _capture.BATCH_NORM_KERNELS = saved
    if bitwise:
        assert torch.equal(losses_multi, losses_again)
        for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()):
            assert torch.equal(a, b)
    torch.testing.assert_close(losses_multi, losses_single, **tol)
    assert_same_training(models[0], opts[0], models[2], opts[2], **tol)

    short = batches[:warmup + 2]
    short_model, eager_model = copy.deepcopy(start).cuda(), copy.deepcopy(start).cuda()
    short_opt, eager_opt = make_opt(short_model.parameters()), make_opt(eager_model.parameters())
    short_step = nt.Step(short_model, short_opt, per_sample, streams="auto", warmup=warmup,
                         **options)
    losses_short = torch.stack([short_step(b).clone() for b in short])
    assert short_step.stats()["replays"] == 2
    assert short_step.stats()["streams"] == multi.stats()["streams"]
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options.get("amp"))
    losses_eager = eager_loop(eager_model, eager_opt, per_sample, short[:warmup], amp=amp)
    if eager_reference is not None:  # from the first graph step on, as in Step
        eager_model = eager_reference(eager_model)
    losses_eager += eager_loop(eager_model, eager_opt, per_sample, short[warmup:], amp=amp)
    losses_eager = torch.stack(losses_eager)
    eager_tol = eager_tol or tol
    if eager_check == "first-graph-loss":
        torch.testing.assert_close(losses_short[:warmup + 1], losses_eager[:warmup + 1], **TOL)
        return multi.stats()
    torch.testing.assert_close(losses_short, losses_eager, **eager_tol)
    if eager_check == "state":
        assert_same_training(short_model, short_opt, eager_model, eager_opt, **eager_tol)
        return multi.stats()
    floor_model = nudged(start).cuda()
    floor_opt = make_opt(floor_model.parameters())
    eager_loop(floor_model, floor_opt, per_sample, short, amp=amp)
    floor = training_gap(floor_model, floor_opt, eager_model, eager_opt)
    gap = training_gap(short_model, short_opt, eager_model, eager_opt)
    assert gap <= 10 * floor + 1e-6, f"relative gap to eager {gap:.3g}, rounding floor {floor:.3g}"
    # The check can fail: a step size off by 5% lands far outside it.
    off_model = copy.deepcopy(start).cuda()
    off_opt = make_opt(off_model.parameters())
    for group in off_opt.param_groups:
        group["lr"] *= 1.05
    eager_loop(off_model, off_opt, per_sample, short, amp=amp)
    off = training_gap(off_model, off_opt, eager_model, eager_opt)
    assert off > 10 * floor + 1e-6, f"a 5% lr error gives {off:.3g}, rounding floor {floor:.3g}"
    return multi.stats()


def test_inception_net_runs_its_branches_on_four_streams():
    torch.manual_seed(0)
    batches = classification_batches(8, 16, image=True, device="cuda")
    stats = three_ways(InceptionNet(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                       batches, eager_tol=LOSS_TOL, eager_check="floor")
    assert stats["captured"] and stats["streams"] == 4 and stats["syncs"] > 0
    assert stats["traced_ops"] > 40 and stats["replays"] == 6
    # Most convolutions run on the branches' streams: each weight gradient forked after its
    # data gradient, not beside it.
    assert stats["weight_grads_first"] is False


def test_weight_gradients_forked_first_on_several_forward_streams(monkeypatch):
    # The order a chain gets, forced where the forward runs branches side by side: each
    # launching stream's weight gradients start beside its data gradients, and the two
    # planned runs still agree bit for bit (no race).
    monkeypatch.setattr(_weight_grads, "WEIGHT_GRADS_FIRST", True)
    torch.manual_seed(0)
    batches = classification_batches(8, 16, image=True, device="cuda")
    stats = three_ways(InceptionNet(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                       batches, eager_tol=LOSS_TOL, eager_check="floor")
    assert stats["streams"] == 4 and stats["weight_grads_first"] is True
    assert stats["weight_grad_streams"] > 1


def test_transformer_block_with_parallel_projections():
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 10, 32, generator=g).cuda(),
                torch.randint(0, 5, (8,), generator=g).cuda()) for _ in range(6)]
    # Attention's backward kernels are not deterministic: no bitwise comparison here. The
    # projections' weight gradients leave the critical path, summed in float32 (the eager
    # reference does the same, in float64).
    stats = three_ways(TransformerBlock(), lambda p: torch.optim.AdamW(p, lr=1e-3), batches,
                       tol=BF16_TOL, bitwise=False, amp="bf16",
                       eager_reference=float32_weight_grads)
    assert stats["streams"] >= 3


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_dag_models(seed):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(16, 16, generator=g).cuda(),
                torch.randint(0, 5, (16,), generator=g).cuda()) for _ in range(6)]
    stats = three_ways(RandomDagNet(seed), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                       batches)
    assert stats["captured"]


def test_small_operators_run_on_their_producers_stream():
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(8, 64, generator=g).cuda(),
                torch.randint(0, 64, (8,), generator=g).cuda()) for _ in range(6)]
    stats = three_ways(SmallSideOperators(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                       batches)
    # The two products side by side; the shape query, the mean and the views on their
    # producers' streams (tests/cpu/test_multistream.py checks the plan itself).
    assert (stats["streams"], stats["syncs"], stats["small_ops_kept"]) == (2, 2, 4)


def test_googlenet_from_torchvision():
    torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
    torch.manual_seed(2)
    # No dropout: graph replays draw other random numbers than the eager generator.
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True,
                                         num_classes=5, dropout=0.0)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 3, 64, 64, generator=g).cuda(),
                torch.randint(0, 5, (8,), generator=g).cuda()) for _ in range(5)]
    # 57 convolutions with BatchNorm over 8 samples: nudging the starting weights by one
    # float32 rounding step moves the whole training state by most of its norm within four
    # steps (measured on an H100), so eager is compared up to the first graph step only;
    # several streams against one stream loosely, and two multi-stream runs bit for bit.
    loose = {"rtol": 3e-2, "atol": 3e-3}
    stats = three_ways(model, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), batches,
                       tol=loose, eager_check="first-graph-loss")
    assert stats["streams"] >= 4


class Untraceable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 5)

    def forward(self, x):
        for _ in range(x.shape[0] % 3):  # fx cannot trace this; eager and capture can
            x = torch.tanh(self.a(x))
        return self.b(x)


def test_untraceable_model_runs_on_one_stream_with_a_warning():
    torch.manual_seed(3)
    batches = classification_batches(5, 16, features=16, device="cuda")
    with pytest.warns(UserWarning,
                      match="runs on one stream: torch.fx could not trace") as record:
        stats = three_ways(Untraceable(), lambda p: torch.optim.SGD(p, lr=0.1), batches)
    assert record[0].filename == __file__  # the step(batch) line, however deep it was raised
    assert stats["captured"] and stats["streams"] == 1
    assert "torch.fx" in stats["single_stream_reason"]


class InPlaceBranches(torch.nn.Module):
    """One branch reads `y`, then `y` is written in place through a view, then another reads
    it: the plan must keep eager's order (see _multistream.state_edges)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(12, 256)
        self.left, self.right = torch.nn.Linear(256, 5), torch.nn.Linear(256, 5)

    def forward(self, x):
        y = self.lin(x)
        a = (y * 3).tanh()
        y.view(-1).mul_(2)
        return self.left(a) + self.right(y)


def test_writes_in_place_keep_eagers_order_on_several_streams():
    torch.manual_seed(3)
    batches = classification_batches(4, 64, device="cuda")
    model = InPlaceBranches().cuda()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step = nt.Step(model, opt, per_sample, streams="auto", warmup=2)
    losses = torch.stack([step(b).clone() for b in batches])
    assert step.stats()["captured"] and step.stats()["streams"] > 1
    expected = torch.stack(eager_loop(reference, ref_opt, per_sample, batches))
    torch.testing.assert_close(losses, expected, **LOSS_TOL)
    assert_same_training(model, opt, reference, ref_opt, **TOL)


def test_a_side_stream_that_is_the_launching_stream_is_drawn_again():
    """torch's stream pool hands its 32 streams out in turn: a side stream drawn before the
    capture stream can be it. The forward then draws another, and computes what eager does."""
    from nimble_train._multistream import build_multistream

    torch.manual_seed(0)
    model = InceptionNet().cuda().eval()
    x = torch.randn(8, 3, 16, 16, device="cuda")
    forward, reason = build_multistream(model, "auto", torch.device("cuda"))
    assert reason is None and len(forward._side_streams) == 3
    sides = forward._side_streams
    assert len({s.cuda_stream for s in sides}) == 3  # distinct among themselves
    launching = sides[1]
    with torch.no_grad(), torch.cuda.stream(launching):
        out = forward(x)
    torch.cuda.synchronize()
    streams = {s.cuda_stream for s in forward._side_streams}
    assert launching.cuda_stream not in streams and len(streams) == 3, streams
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


class LossModule(torch.nn.Module):
    """What an integration trains: its forward is not to be traced, but the network it calls
    is (as NimbleStrategy's module names the LightningModule)."""

    nimble_untraced = "a loss module"
    nimble_traced_submodule = "net"

    def __init__(self):
        super().__init__()
        self.net = InceptionNet()
        self.armed = False

    def forward(self, x):
        out = self.net(x)
        if self.armed and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("injected failure after the planned forward")
        return out


def test_a_named_submodules_forward_is_planned_and_runs_in_its_place():
    torch.manual_seed(0)  # the inception net's weights and batches of the test above
    batches = classification_batches(8, 16, image=True, device="cuda")
    stats = three_ways(LossModule(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                       batches, eager_tol=LOSS_TOL, eager_check="floor")
    assert stats["captured"] and stats["streams"] == 4 and stats["syncs"] > 0, stats
    assert stats["single_stream_reason"] is None and stats["weight_grad_layers"] > 0, stats


def test_a_capture_failing_while_the_submodules_plan_runs_leaves_the_step_as_it_was():
    torch.manual_seed(7)
    batches = classification_batches(4, 16, image=True, device="cuda")
    model = LossModule().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = nt.Step(model, opt, per_sample, streams="auto", warmup=1)
    while step.stats()["warmup_left"] > 0:
        step(batches[0])  # warm-up, eager: the next call plans and captures
    before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())
    model.armed = True
    with pytest.warns(UserWarning, match="capture on several streams failed"):
        with pytest.raises(nt.CaptureError, match="injected failure after the planned forward"):
            step(batches[1])
    model.armed = False
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    for a, b in zip(opt.state_dict()["state"].values(), opt_before["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    assert not any("forward" in vars(m) for m in model.modules())  # the plan is gone
    loss = step(batches[2])  # later calls run eagerly, and train
    assert torch.isfinite(loss) and step.stats()["phase"] == "eager"
