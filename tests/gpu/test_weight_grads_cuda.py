"""Weight gradients on a side stream equal autograd's, and Step uses them only where safe."""

import copy
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

import nimble_train as nt
from nimble_train._weight_grads import SideStream, eligible, split_weight_grads, steps_backward
from step_reference import (assert_same_training, classification_batches, eager_accumulation_loop,
                            eager_loop)

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_cudnn")]

per_sample = nn.CrossEntropyLoss(reduction="none")


def grads_both_ways(model, inputs, *, amp=None, backwards=1, lag=1, calls=None, first=False):
    """The gradients of sum(model(*inputs)) by autograd and with the split (same weights);
    `calls`: layer calls per forward, when a layer is called more than once; `first`: each
    weight gradient forked before its data gradient."""
    ref, split = model.cuda(), copy.deepcopy(model).cuda()
    side = SideStream(torch.device("cuda"), lag=lag)
    side.first = first

    def run(m):
        for _ in range(backwards):  # accumulates, as micro-batches do
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp is not None):
                out = m(*inputs)
            out.float().square().sum().backward()

    run(ref)
    with split_weight_grads(split, side) as layers, steps_backward():
        run(split)
    # the backward's end joined the side stream: the gradients are ready on this stream
    assert layers > 0 and side.launched == (calls or layers) * backwards
    return ([p.grad for p in ref.parameters()], [p.grad for p in split.parameters()],
            ref, split)


def image(n=4, c=6, hw=10, channels_last=False, grad=False):
    x = torch.randn(n, c, hw, hw, device="cuda")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(grad)


@pytest.mark.parametrize("conv", [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, stride=2, padding=1, bias=False),
    dict(kernel_size=3, padding="same", dilation=2),
    dict(kernel_size=1, groups=2),
    dict(kernel_size=5, padding="valid"),
])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("first", [False, True], ids=["after", "first"])
def test_convolution_gradients_equal_autograds(conv, channels_last, first):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(6, 8, **conv), nn.ReLU(), nn.Conv2d(8, 4, 3))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    x = image(channels_last=channels_last, grad=True)
    ref, got, _, _ = grads_both_ways(model, (x,), first=first)
    for a, b in zip(ref, got):
        assert a.stride() == b.stride()
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first", [False, True], ids=["after", "first"])
def test_conv1d_and_linear_on_3d_inputs_and_accumulation(first):
    torch.manual_seed(1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(5, 7, 3, padding=1)
            self.fc = nn.Linear(7, 3)

        def forward(self, x):  # [n, 5, t] -> [n, t, 3]
            return self.fc(torch.tanh(self.conv(x)).transpose(1, 2))

    x = torch.randn(4, 5, 9, device="cuda")  # the first layer's input needs no gradient
    ref, got, _, _ = grads_both_ways(Net(), (x,), backwards=3, first=first)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_gradients_match_autocast_autograd():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 5, 32, device="cuda")
    ref, got, _, _ = grads_both_ways(model, (x,), amp="bf16")
    for a, b in zip(ref, got):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("backwards", [1, 3])
@pytest.mark.parametrize("width", [96, 9000])  # the bias as a product with ones, and as a sum
def test_bf16_linear_gradients_are_summed_in_float32(backwards, width):
    """Under autocast a split linear layer's gradients are the float32 sums of the bf16
    operands' products (the float64 reference to float32 rounding), where autograd rounds each
    product to bf16 first; a second and third backward accumulate in the same precision."""
    torch.manual_seed(3)
    model = nn.Linear(384, width)
    x = torch.randn(2, 64, 384, device="cuda")
    ref, got, ref_model, _ = grads_both_ways(model, (x,), amp="bf16", backwards=backwards)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = ref_model(x)  # the weights never moved: every backward saw this output
    # loss = sum(out.float() ** 2): the output's gradient is 2 * out, exact in bf16
    g = (2 * out.double()).reshape(-1, width)
    xs = x.to(torch.bfloat16).double().reshape(-1, 384)
    want = [backwards * g.t().mm(xs), backwards * g.sum(0)]

    def error(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    for name, a, b, w in zip(("weight", "bias"), ref, got, want):
        assert b.dtype == torch.float32
        assert error(b, w) < 1e-5, name  # float32 sums of exact products
        assert error(a, w) > 10 * error(b, w), name  # autograd: each product rounded to bf16


class Tied(nn.Module):
    """A decoder whose weight is the embedding's, as in BERT's and GPT-2's language heads, and
    a layer called twice."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)
        self.decoder = nn.Linear(16, 50)
        self.decoder.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = self.mix(torch.tanh(self.mix(h)))
        return self.decoder(h)


def test_tied_weights_and_a_layer_called_twice_accumulate_in_order():
    torch.manual_seed(3)
    ids = torch.randint(0, 50, (6, 11), device="cuda")
    for lag in (1, 3, None):
        ref, got, _, split = grads_both_ways(Tied(), (ids,), lag=lag, backwards=2, calls=3)
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert not any("forward" in vars(m) for m in split.modules())  # restored
        assert not split.embed.weight._backward_hooks  # its hook removed


def test_layers_with_hooks_of_their_own_keep_autograds_path():
    fc = nn.Linear(4, 4).cuda()
    assert eligible(fc)
    handle = fc.weight.register_post_accumulate_grad_hook(lambda p: None)
    assert not eligible(fc)
    handle.remove()
    fc.weight.requires_grad_(False)
    assert not eligible(fc)
    assert not eligible(nn.Conv2d(3, 3, 2, padding="same"))  # pads one side more
    assert not eligible(nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"))


def in_a_backward(body) -> None:
    """Runs body() inside a backward, where the split layers' launches happen."""
    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            body()
            return grad

    x = torch.ones(2, device="cuda", requires_grad=True)
    Backward.apply(x).sum().backward()


def test_a_launch_is_released_once_its_own_stream_has_waited_on_it():
    # Two forward streams launching in turn. A launch's inputs are made on its stream, which
    # reuses their memory once released: only that stream's own wait (one of its launches
    # later) may release them, never another stream's; the backward's end releases the rest.
    side = SideStream(torch.device("cuda"), lag=1)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    kept, alive = [], []

    def launches():
        for stream in (a, b, a, a, b):
            with torch.cuda.stream(stream):
                t = torch.ones(4, device="cuda")
                kept.append(weakref.ref(t))
                side.launch(lambda: None, (t,))
                del t
            alive.append([r() is not None for r in kept])

    in_a_backward(launches)
    assert alive == [[True], [True, True], [False, True, True], [False, True, False, True],
                     [False, False, False, True, True]]
    assert all(r() is None for r in kept) and side.launched == 5
    torch.cuda.synchronize()


@pytest.mark.parametrize("first", [False, True], ids=["after", "first"])
def test_a_weight_gradient_forked_first_runs_beside_its_data_gradient(first):
    # The data gradient (`beside`) is a long kernel on the launching stream: a weight
    # gradient forked before it ends first, one forked after it ends after it.
    side = SideStream(torch.device("cuda"), lag=None)
    side.first = first
    ends = {}

    def mark(name):
        ends[name] = torch.cuda.Event(enable_timing=True)
        ends[name].record()

    def beside():
        torch.cuda._sleep(20_000_000)  # some ms
        mark("data")
        return "data gradient"

    def launches():
        ends["fork"] = torch.cuda.Event(enable_timing=True)
        ends["fork"].record()
        assert side.launch(lambda: mark("weight"), (), beside=beside) == "data gradient"

    in_a_backward(launches)
    torch.cuda.synchronize()
    data, weight = (ends["fork"].elapsed_time(ends[k]) for k in ("data", "weight"))  # ms
    assert data > 1.0  # the sleep ran: the test can tell the orders apart
    assert (weight < data) == first, (weight, data)


def test_each_launching_stream_has_a_side_stream_and_a_layer_keeps_its_first():
    # Branches the forward runs side by side launch from their own streams: each gets a side
    # stream of its own, so that their backwards stay apart. A layer launched again from
    # another stream (called twice) stays on its first side stream: its accumulations in order.
    side = SideStream(torch.device("cuda"), lag=1)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x_layer, y_layer = nn.Linear(1, 1), nn.Linear(1, 1)
    ran_on = []

    def launches():
        for stream, key in ((a, x_layer), (b, y_layer), (b, x_layer), (a, y_layer), (b, None)):
            with torch.cuda.stream(stream):
                side.launch(lambda: ran_on.append(torch.cuda.current_stream()), (), key=key)

    in_a_backward(launches)
    side_a, side_b = ran_on[0], ran_on[1]
    assert side.streams == 2 and side_a != side_b and not {side_a, side_b} & {a, b}
    assert ran_on == [side_a, side_b, side_a, side_b, side_b]
    torch.cuda.synchronize()


def test_a_failing_forward_restores_the_layers():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).cuda()
    side = SideStream(torch.device("cuda"))
    with pytest.raises(RuntimeError, match="shape"):
        with split_weight_grads(model, side):
            model(torch.randn(3, 5, device="cuda"))
    assert not any("forward" in vars(m) for m in model.modules())
    assert not model[0].weight._backward_hooks


class SmallCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    lambda p: torch.optim.AdamW(p, lr=1e-3),
    lambda p: torch.optim.RMSprop(p, lr=1e-3),  # captured as it is: gradients made in the graph
], ids=["sgd", "adamw", "rmsprop"])
@pytest.mark.parametrize("forward", ["planned", "unplanned"])
def test_step_with_the_backward_planned_equals_one_stream_and_eager(make_opt, forward,
                                                                     monkeypatch):
    """The chain's forward planned (its batch norms fused with their ReLUs, on PyTorch's
    statistics kernels) or not (the backward's plan alone, as for a forward torch.fx cannot
    trace: cuDNN's batch norms, as on one stream)."""
    from nimble_train import _capture
    monkeypatch.setattr(_capture, "PLAN_FORWARD", forward == "planned")
    torch.manual_seed(4)
    batches = classification_batches(6, 8, classes=5, device="cuda", image=True)
    model = SmallCnn()
    models = [copy.deepcopy(model).cuda() for _ in range(3)]
    opts = [make_opt(m.parameters()) for m in models]
    auto = nt.Step(models[0], opts[0], per_sample, streams="auto", warmup=2)
    single = nt.Step(models[1], opts[1], per_sample, streams=1, warmup=2)
    losses_auto = torch.stack([auto(b).clone() for b in batches])
    losses_single = torch.stack([single(b).clone() for b in batches])
    losses_eager = torch.stack(eager_loop(models[2], opts[2], per_sample, batches))
    stats = auto.stats()
    assert stats["captured"] and stats["replays"] == 4
    assert stats["weight_grad_layers"] == 4 and single.stats()["weight_grad_layers"] == 0
    assert stats["weight_grads_first"] is True  # a chain: weight gradients beside data's
    assert single.stats()["weight_grads_first"] is None
    # a planned forward: PyTorch's kernels; the backward's plan alone: cuDNN's
    assert stats["native_batch_norm_layers"] == (2 if forward == "planned" else 0)
    assert single.stats()["native_batch_norm_layers"] == 0
    assert single.stats()["weight_grads_off"] == "streams=1"
    torch.testing.assert_close(losses_auto, losses_single, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses_auto, losses_eager, rtol=1e-3, atol=1e-4)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not any("forward" in vars(m) for m in models[0].modules())


class Reparametrized(nn.Module):
    """Layers whose weight a forward pre-hook computes from parameters of other names
    (torch.nn.utils' weight_norm, spectral_norm, pruning of a weight and of a bias), and a
    plain head."""

    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations'
            self.conv = nn.utils.weight_norm(nn.Conv2d(3, 8, 3, padding=1))
        self.conv2 = nn.utils.spectral_norm(nn.Conv2d(8, 8, 3, padding=1))
        self.fc = nn.Linear(8, 16)
        prune.l1_unstructured(self.fc, "weight", amount=0.3)
        self.fc2 = nn.Linear(16, 16)
        prune.l1_unstructured(self.fc2, "bias", amount=0.5)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = F.relu(self.conv(x))
        x = F.relu(self.conv2(x)).mean((2, 3))
        return self.head(F.relu(self.fc2(F.relu(self.fc(x)))))


class CallsALayerFunctionally(nn.Module):
    """A layer called through torch.func.functional_call with a weight computed from its own
    and a learned scale (as weight-space ensembles and meta-learning do), and called plainly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 12)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 12).unsqueeze(1))
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        x = x.mean((2, 3))
        scaled = torch.func.functional_call(
            self.fc, {"weight": self.fc.weight * self.scale, "bias": self.fc.bias}, (x,))
        return self.head(torch.tanh(scaled) + self.fc(x))


@pytest.mark.parametrize("streams", [1, "auto"])
@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    lambda p: torch.optim.AdamW(p, lr=1e-3),
], ids=["sgd", "adamw"])
@pytest.mark.parametrize("make_model, split", [(Reparametrized, 1),
                                               (CallsALayerFunctionally, 2)],
                         ids=["hooks", "functional_call"])
def test_layers_whose_weight_is_computed_from_parameters_train_as_the_eager_loop(
        make_model, split, make_opt, streams):
    """A layer whose weight or bias is computed from parameters, by a forward pre-hook
    (weight_norm, spectral_norm, pruning) or for one call (torch.func.functional_call), keeps
    autograd's path there, which carries its gradient back to them (the weight_norm'ed
    convolution's g and v, the pruned layer's weight_orig, the learned scale): planned on
    several streams, only the plain layers' calls move their weight gradients to a side stream,
    and the step trains as the eager loop. (Split, their gradient went into the computed
    tensor's .grad, and the parameters it was computed from did not train.)"""
    models = []
    for _ in range(2):  # weight_norm's computed weight cannot be deep-copied
        torch.manual_seed(6)
        models.append(make_model().cuda())
    opts = [make_opt(m.parameters()) for m in models]
    batches = classification_batches(7, 8, classes=5, device="cuda", image=True, seed=6)
    step = nt.Step(models[0], opts[0], per_sample, streams=streams, warmup=2)
    losses = torch.stack([step(b).clone() for b in batches])
    expected = torch.stack(eager_loop(models[1], opts[1], per_sample, batches))
    stats = step.stats()
    assert stats["replays"] == 5
    assert stats["weight_grad_layers"] == (split if streams == "auto" else 0)
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    assert_same_training(models[0], opts[0], models[1], opts[1], rtol=1e-4, atol=1e-5)


class AsksAutogradInside(nn.Module):
    """A loss that asks autograd for gradients inside the forward: of the input, to train on
    adversarial examples (FGSM), or of the input with a graph of them, for a penalty on them."""

    def __init__(self, kind):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(8 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 5))
        self.kind = kind

    def forward(self, x, labels):
        x0 = x.detach().requires_grad_()
        if self.kind == "adversarial":
            g, = torch.autograd.grad(F.cross_entropy(self.net(x0), labels), x0)
            return F.cross_entropy(self.net(x + 0.05 * g.sign()), labels)
        out = self.net(x0)
        g, = torch.autograd.grad(out.logsumexp(1).sum(), x0, create_graph=True)
        return F.cross_entropy(out, labels) + 0.1 * g.square().sum((1, 2, 3)).mean()


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("kind", ["adversarial", "penalty"])
def test_autograd_asked_inside_the_forward_leaves_the_split_layers_gradients_as_eager(
        kind, accumulate):
    """torch.autograd.grad inside the forward runs the split layers' backward too: there they
    give their gradients back to autograd, which adds none into .grad (the input's gradient
    alone was asked for) or builds their graph (create_graph); only the step's own backward
    moves them to the side stream. The step captures on several streams and trains as the
    eager loop, accumulating or not. (The side stream added the adversarial pass's weight
    gradients into .grad, which accumulation kept; with a graph asked for, the capture on
    several streams failed.)"""
    torch.manual_seed(8)
    m1 = AsksAutogradInside(kind).cuda()
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (m1, m2))
    batches = [{"x": x, "labels": y}
               for x, y in classification_batches(8, 8, device="cuda", image=True, seed=8)]
    step = nt.Step(m1, o1, streams="auto", warmup=2, accumulate=accumulate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fx cannot trace autograd.grad: the backward is planned
        losses = torch.stack([step(b).clone() for b in batches])
    expected = torch.stack(eager_accumulation_loop(m2, o2, lambda loss, batch: loss, batches,
                                                   accumulate))
    stats = step.stats()
    assert stats["replays"] == 6 and stats["weight_grad_layers"] == 4
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    assert_same_training(m1, o1, m2, o2, rtol=1e-4, atol=1e-5)


class MovesItsParameters(nn.Module):
    """The loss's gradients by every parameter (torch.autograd.grad) and the loss again at
    parameters moved along them (torch.func.functional_call), whose gradients the step's
    backward carries back to the parameters where they are: sharpness-aware minimization
    ("sam": up the gradients, scaled to a norm of rho, taken as constants) or a MAML-style
    inner step ("maml": down them, differentiated through, a second-order gradient)."""

    def __init__(self, net: nn.Module, kind: str):
        super().__init__()
        self.net, self.kind = net, kind

    def forward(self, x, labels):
        params = dict(self.net.named_parameters())
        grads = torch.autograd.grad(per_sample(self.net(x), labels).mean(), list(params.values()),
                                    create_graph=self.kind == "maml")
        if self.kind == "sam":
            scale = 0.05 / (torch.stack([g.norm() for g in grads]).norm() + 1e-12)
        else:
            scale = -0.1
        moved = {name: p + g * scale for (name, p), g in zip(params.items(), grads)}
        return per_sample(torch.func.functional_call(self.net, moved, (x,)), labels).mean()


@pytest.mark.parametrize("streams", [1, "auto"])
@pytest.mark.parametrize("kind", ["sam", "maml"])
def test_a_forward_that_moves_its_parameters_along_their_gradients_trains_as_the_eager_loop(
        kind, streams):
    """torch.autograd.grad by the parameters inside the forward asks the split layers for their
    weight gradients (a leaf's that the call returns), with a graph of them or not; the second
    forward's layers run on weights functional_call put in place, which keep autograd's path,
    and the step's backward runs through the first forward's split layers again where the
    gradients were differentiated. The step, batch norms' running statistics included, trains
    as the same module in the eager loop."""
    torch.manual_seed(9)
    m1 = MovesItsParameters(SmallCnn(), kind).cuda()
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (m1, m2))
    batches = [{"x": x, "labels": y}
               for x, y in classification_batches(6, 8, classes=5, device="cuda", image=True)]
    step = nt.Step(m1, o1, streams=streams, warmup=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fx cannot trace autograd.grad: the backward is planned
        losses = torch.stack([step(b).clone() for b in batches])
    expected = torch.stack(eager_loop(m2, o2, lambda loss, batch: loss, batches))
    stats = step.stats()
    assert stats["replays"] == 4
    assert stats["weight_grad_layers"] == (4 if streams == "auto" else 0)  # no fallback
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    assert_same_training(m1, o1, m2, o2, rtol=1e-4, atol=1e-5)


def test_a_capture_failing_in_the_backward_leaves_the_step_as_it_was():
    torch.manual_seed(5)
    batches = classification_batches(4, 8, classes=5, device="cuda", image=True)
    model = SmallCnn().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = nt.Step(model, opt, per_sample, streams="auto", warmup=1)
    while step.stats()["warmup_left"] > 0:
        step(batches[0])  # warm-up, eager: the next call captures
    before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())

    armed = [True]

    def fail(grad):  # runs in the capture's backward
        if armed[0]:
            raise RuntimeError("injected backward failure")
        return grad

    handle = model.body[4].weight.register_hook(fail)  # a BatchNorm weight: autograd's path
    with pytest.raises(nt.CaptureError, match="injected backward failure"):
        step(batches[1])
    armed[0] = False
    handle.remove()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    for a, b in zip(opt.state_dict()["state"].values(), opt_before["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    assert not any("forward" in vars(m) for m in model.modules())
    # later calls run eagerly, and train
    loss = step(batches[2])
    assert torch.isfinite(loss) and step.stats()["phase"] == "eager"


@pytest.mark.parametrize("streams", [1, "auto"])
def test_a_capture_on_several_streams_runs_the_native_batch_norm_kernels(streams):
    # cuDNN's channels-last batch norm fills every SM (see _batch_norm.py): a capture on
    # several streams runs PyTorch's, and its backward follows; warm-up and one stream, cuDNN's.
    torch.manual_seed(8)
    batches = [(x.contiguous(memory_format=torch.channels_last), y)
               for x, y in classification_batches(4, 8, classes=5, device="cuda", image=True)]
    model = SmallCnn().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = nt.Step(model, opt, per_sample, streams=streams, warmup=1)
    seen = []
    handle = model.body[1].register_forward_hook(lambda module, args, out: seen.append(
        (torch.cuda.is_current_stream_capturing(), out.grad_fn.name())))
    for b in batches:
        step(b)
    handle.remove()
    assert step.stats()["captured"] and step.stats()["replays"] > 0
    eager = {name for capturing, name in seen if not capturing}
    capture = [name for capturing, name in seen if capturing]
    assert eager == {"CudnnBatchNormBackward0"} and len(capture) == 1
    assert capture[0] == ("CudnnBatchNormBackward0" if streams == 1
                          else "NativeBatchNormBackward0")
    assert "forward" not in vars(model.body[1])
