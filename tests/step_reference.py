"""Models, data and the plain eager training loop that Step is compared against."""

import copy
import random

import torch
import torch.nn.functional as F

import nimble_train as nt


class MLP(torch.nn.Module):
    def __init__(self, features=12, hidden=32, classes=5, dropout=0.0):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.GELU(), torch.nn.Dropout(dropout),
            torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
            torch.nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class SmallCNN(torch.nn.Module):
    """Convolutions with BatchNorm: its batch statistics forbid padding."""

    def __init__(self, classes=5):
        super().__init__()
        # No conv bias before BatchNorm: its gradient is rounding noise, which Adam amplifies.
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1, stride=2, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class RunningMean(torch.nn.Module):
    """A layer that keeps a running mean of its output by assigning its buffer anew, as user
    code often writes an update (out of place), and counts its calls the same way, in eval mode
    too."""

    def __init__(self, features=12):
        super().__init__()
        self.lin = torch.nn.Linear(features, features)
        self.register_buffer("avg", torch.zeros(features))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            self.avg = 0.9 * self.avg + 0.1 * y.detach().mean(0)
        self.calls = self.calls + 1
        return y - self.avg


class DataMean(torch.nn.Module):
    """A layer that keeps a running mean of its output by giving its buffer new data
    (self.avg.data = ...), as older code often writes an update, and counts its calls the
    same way, in eval mode too; and that, when told to (renorm, set by user code), gives its
    weight new data too: its rows renormalised."""

    def __init__(self, features=12):
        super().__init__()
        self.lin = torch.nn.Linear(features, features)
        self.register_buffer("avg", torch.zeros(features))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.renorm = False

    def forward(self, x):
        if self.renorm:
            self.lin.weight.data = self.lin.weight / self.lin.weight.norm(dim=1, keepdim=True)
        y = self.lin(x)
        if self.training:
            self.avg.data = 0.9 * self.avg + 0.1 * y.detach().mean(0)
        self.calls.data = self.calls + 1
        return y - self.avg


class Tempered(torch.nn.Module):
    """Tensors in plain attributes: a temperature user code sets (a new tensor each time), a
    state the forward carries from call to call by assigning it anew (self.state =
    f(self.state)), in eval mode too, and its last output kept for a look after the step."""

    def __init__(self, features=12):
        super().__init__()
        self.lin = torch.nn.Linear(features, features)
        self.temperature = torch.tensor(2.0)
        self.state = torch.zeros(features)
        self.last = torch.zeros(1)

    def forward(self, x):
        y = self.lin(x) / self.temperature + self.state
        self.state = 0.5 * self.state + 0.5 * y.detach().mean(0)
        self.last = y.detach()
        return y


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 4)
        self.b = torch.nn.Linear(3, 4)

    def forward(self, x, z):
        return self.a(x) * torch.sigmoid(self.b(z))


class OwnLoss(torch.nn.Module):
    """Like a Hugging Face model: given labels, returns an object with .loss."""

    class Output:
        def __init__(self, loss, logits):
            self.loss, self.logits = loss, logits

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        logits = self.out(torch.tanh(self.emb(input_ids)))
        return self.Output(F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits)


def classification_batches(n, batch, features=12, classes=5, device="cpu", seed=0, image=False):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 3, 8, 8) if image else (batch, features)
    return [(torch.randn(shape, generator=g).to(device),
             torch.randint(0, classes, (batch,), generator=g).to(device)) for _ in range(n)]


def twin(model, make_optimizer):
    """The model and a deep copy, each with its own optimizer from make_optimizer(params)."""
    other = copy.deepcopy(model)
    return (model, make_optimizer(model.parameters())), (other, make_optimizer(other.parameters()))


def eager_loop(model, optimizer, loss_fn, batches, *, amp=None, grad_clip=None, scheduler=None):
    """The plain loop Step must reproduce: zero_grad; loss; backward; (clip;) step."""
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        device = next(model.parameters()).device.type
        ctx = torch.autocast(device, dtype=amp) if amp else torch.autocast(device, enabled=False)
        with ctx:
            if isinstance(batch, dict):
                out = model(**batch)
                loss = out.loss if loss_fn is None else loss_fn(out, batch)
            else:
                inputs, target = batch
                out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
                loss = loss_fn(out, target)
        if loss.dim():
            loss = loss.float().mean()
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.detach())
    return losses


def eager_accumulation_loop(model, optimizer, loss_fn, batches, k, *, grad_clip=None,
                            scheduler=None):
    """The eager loop Step(accumulate=k) must equal: windows of k micro-batches, each loss
    weighted by the micro-batch's samples over the window's (per-sample losses; with full
    micro-batches that is loss / k), then clip, step, schedule."""
    def forward(batch):  # (inputs, target), or a dict with labels: (loss, samples)
        if isinstance(batch, dict):
            return loss_fn(model(**batch), batch), len(batch["labels"])
        x, y = batch
        return loss_fn(model(x), y), len(y)

    losses = []
    for start in range(0, len(batches) - k + 1, k):
        window = batches[start: start + k]
        total = sum(forward_samples(b) for b in window)
        optimizer.zero_grad()
        for batch in window:
            loss, samples = forward(batch)
            if loss.dim():
                loss = loss.mean()
                (loss * (samples / total)).backward()
            else:
                (loss / k).backward()  # a scalar loss: the DESIGN's loop
            losses.append(loss.detach())
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return losses


def forward_samples(batch) -> int:
    return len(batch["labels"]) if isinstance(batch, dict) else len(batch[1])


def grad_scaler_accumulation_loop(model, optimizer, loss_fn, batches, k):
    """The eager fp16 accumulation loop: autocast, GradScaler over (loss / k) per micro-batch,
    step and update every k (an overflow anywhere in a window skips its update)."""
    device = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device)
    for i, (x, y) in enumerate(batches):
        if i % k == 0:
            optimizer.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = loss_fn(model(x), y).float().mean()
        scaler.scale(loss / k).backward()
        if i % k == k - 1:
            scaler.step(optimizer)
            scaler.update()
    return scaler


def run_accumulating(model, optimizer, loss_fn, batches, k, *, scheduler=None, **options):
    """nt.Step(accumulate=k) over `batches`, the scheduler stepped when the step updated;
    returns the step, its losses and which calls updated."""
    import nimble_train as nt

    step = nt.Step(model, optimizer, loss_fn, accumulate=k, **options)
    losses, stepped = [], []
    for batch in batches:
        losses.append(step(batch).clone())
        stepped.append(step.stepped)
        if scheduler is not None and step.stepped:
            scheduler.step()
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    return step, losses, stepped


def with_short(batches, where, size):
    """The batches with batch `where` cut to its first `size` samples (a short micro-batch)."""
    out = list(batches)
    x, y = out[where]
    out[where] = (x[:size], y[:size])
    return out


def hand_written_ema(model, optimizer, loss_fn, batches, decay, k=1):
    """EMA the usual way: after each optimizer step, avg = decay * avg + (1 - decay) * value
    for every floating-point parameter and buffer."""
    averages = {name: t.detach().clone() for name, t in model.state_dict().items()
                if t.is_floating_point()}
    for start in range(0, len(batches) - k + 1, k):
        optimizer.zero_grad()
        for x, y in batches[start: start + k]:
            (loss_fn(model(x), y).mean() / k).backward()
        optimizer.step()
        for name, t in model.state_dict().items():
            if name in averages:
                averages[name] = decay * averages[name] + (1 - decay) * t.detach()
    return averages


def grad_scaler_loop(model, optimizer, loss_fn, batches, *, grad_clip):
    """The eager fp16 loop Step must reproduce: autocast, GradScaler, unscale, clip, step."""
    device = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = loss_fn(model(x), y).float().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.detach())
    return losses


def assert_same_training(model_a, opt_a, model_b, opt_b, *, rtol=1e-5, atol=1e-6):
    """Parameters, buffers (BatchNorm statistics) and optimizer state agree."""
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for field in state_a[key]:
            a, b = state_a[key][field], state_b[key][field]
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(
                    a.float().cpu(), b.float().cpu(), rtol=rtol, atol=atol,
                    msg=lambda m, key=key, field=field: f"state {key} {field}: {m}")
            else:
                assert a == b


def random_loop(seed, device="cpu", *, rtol=1e-5, atol=1e-6):
    """A random loop (from `seed`) against the plain eager one, window by window: accumulate 1
    to 4, windows ended early (update=True), short micro-batches, loss weights given for whole
    windows, clipping, SGD or AdamW, learning rates changed between windows, an EMA, and an
    evaluator called between calls (mid-window too). Parameters, optimizer state, the averages
    and stepped agree after every window, each evaluation with the eager loop's model, and a
    loss held across an evaluation keeps its value; on a GPU the Step captures a graph per kind
    of call and pads the short micro-batches in them, and the evaluator is captured wherever
    it is first called once the Step replays."""
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    make = rng.choice([
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05)])
    clip = rng.choice([None, 0.3, 0.6])
    decay = rng.choice([None, 0.7])
    torch.manual_seed(seed)
    (m1, o1), (m2, o2) = twin(MLP().to(device), make)
    per_sample = torch.nn.CrossEntropyLoss(reduction="none")
    step = nt.Step(m1, o1, per_sample, accumulate=k, grad_clip=clip, ema=decay)
    evaluate = step.evaluator(lambda m, b: m(b[0]))
    held_out = classification_batches(2, 16, device=device, seed=7 + seed)
    held_out.append((held_out[1][0][:5], held_out[1][1][:5]))
    evaluations = 0
    averages = ({name: t.detach().clone() for name, t in m2.state_dict().items()
                 if t.is_floating_point()} if decay is not None else None)
    run = f"seed {seed}: accumulate {k}, clip {clip}, ema {decay}"
    base_lr = o1.param_groups[0]["lr"]
    calls = 0
    for w in range(8):
        size = rng.randint(1, k) if rng.random() < 0.25 else k  # ended early, or full
        lr = base_lr * rng.uniform(0.5, 1.5)
        for group in o1.param_groups + o2.param_groups:
            group["lr"] = lr
        weighted = k > 1 and rng.random() < 0.35
        window, weights = [], []
        for i in range(size):
            samples = 16 if calls == 0 or rng.random() < 0.75 else rng.randint(1, 15)
            window += classification_batches(1, samples, device=device, seed=1000 * seed + calls)
            weights.append(rng.choice([0.1, 0.3, 0.5, 0.7]))
            last = i == size - 1
            loss = step(window[-1], update=True if last else None,
                        loss_weight=weights[-1] if weighted else None)
            calls += 1
            assert step.stepped == last, f"{run}, window {w}"
            if not last and rng.random() < 0.35:  # mid-window: the model is the loop's as it was
                held = loss.clone()
                batch = held_out[0 if evaluations == 0 else rng.randrange(3)]  # a full one first
                evaluations += 1
                with torch.no_grad():
                    expected = m2(batch[0])  # the MLP has no dropout or batch statistics
                torch.testing.assert_close(evaluate(batch), expected, rtol=10 * rtol,
                                           atol=10 * atol)
                assert torch.equal(loss, held), f"{run}: an evaluation changed the held loss"
        o2.zero_grad()
        total = sum(y.shape[0] for _, y in window)
        for (x, y), weight in zip(window, weights):
            losses = per_sample(m2(x), y)
            (losses.mean() * weight if weighted else losses.sum() / total).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m2.parameters(), clip)
        o2.step()
        if averages is not None:
            for name, t in m2.state_dict().items():
                if name in averages:
                    averages[name].lerp_(t.detach(), 1 - decay)
        assert_same_training(m1, o1, m2, o2, rtol=rtol, atol=atol)
        if averages is not None:
            ema = step.ema_state_dict()
            for name, average in averages.items():
                torch.testing.assert_close(ema[name], average, rtol=rtol, atol=atol,
                                           msg=lambda m, name=name: f"{run}: ema {name}: {m}")
    assert step.stats()["updates"] == 8, run
    counts = evaluate.stats()
    assert counts["replays"] + counts["eager"] == evaluations, run
    if device != "cpu":  # the graphs ran: the step's, and the evaluator's once it replays
        assert step.stats()["replays"] > 0 and not counts["eager_buckets"], (run, counts)
    return step


def batch_norm_stats_float64(x, eps=1e-5):
    """torch.batch_norm_stats(x, eps) in float64: each channel's mean and 1/sqrt(var + eps),
    var the biased variance over N, H and W."""
    var, mean = torch.var_mean(x.double(), (0, 2, 3), unbiased=False)
    return mean, (var + eps).rsqrt()


def batch_norm_act_grads(x, weight, bias, residual, grad_y, y, gelu=False):
    """The float64 gradients (x, weight, bias[, residual]) of act(batch_norm(x) [+ residual])
    in training, for the output's gradient grad_y: autograd's reference for the fused batch
    norm. The ReLU's mask is that of y, the output as the kernel stored it (a float64 output
    can round to the other side of zero)."""
    inputs = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    z = F.batch_norm(inputs[0], None, None, inputs[1], inputs[2], True, 0.1, 1e-5)
    if residual is not None:
        inputs.append(residual.detach().double().requires_grad_())
        z = z + inputs[3]
    if gelu:
        return torch.autograd.grad(F.gelu(z), inputs, grad_y.double())
    return torch.autograd.grad(z, inputs, grad_y.double() * (y.double() > 0))


def relu_mask_words(y):
    """The ReLU mask the fused batch norm's forward writes for its output y, as int64 words:
    bit i % 32 of word i // 32 set where y's element i (channels-last order) is not <= 0 (NaN
    included), the bits past the last element clear."""
    flat = y.detach().cpu().permute(0, 2, 3, 1).reshape(-1)
    words = (flat.numel() + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:flat.numel()] = (~(flat <= 0)).long()
    return (bits.view(words, 32) << torch.arange(32)).sum(1)


def training_gap(model_a, opt_a, model_b, opt_b) -> float:
    """||a - b|| / ||b|| over all floating tensors of the models and their optimizer state.

    One norm over everything: a single tensor whose gradient nearly cancels (a BatchNorm bias
    deep in a net) can change by a large fraction of its own small norm through one flipped
    ReLU or max-pool choice, while the training as a whole moved by a rounding step.
    """
    pairs = list(zip(model_a.state_dict().values(), model_b.state_dict().values()))
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    pairs += [(state_a[key][field], state_b[key][field])
              for key in state_a for field in state_a[key]
              if isinstance(state_a[key][field], torch.Tensor)]
    diff = ref = 0.0
    for a, b in pairs:
        if a.is_floating_point():
            a, b = a.double().cpu(), b.double().cpu()
            diff += (a - b).square().sum().item()
            ref += b.square().sum().item()
    return (diff / max(ref, 1e-300)) ** 0.5


class _Float32WeightGradLinear(torch.autograd.Function):
    """A linear layer under autocast whose weight and bias gradients are float64 sums of the
    bf16/fp16 operands' products, rounded once to float32: the reference for Step's split
    linear layers, which accumulate the product's float32 accumulator into the gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dtype = torch.get_autocast_dtype(x.device.type)
        x_, w_ = x.to(dtype), weight.to(dtype)
        b_ = bias.to(dtype) if bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x_, w_, b_)
        ctx.save_for_backward(x_, w_)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, w = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.shape[-1]).double()
        grad_w = g.t().mm(x.reshape(-1, x.shape[-1]).double()).float()
        grad_b = g.sum(0).float() if ctx.has_bias else None
        return grad_y.matmul(w), grad_w, grad_b


def float32_weight_grads(model):
    """`model` with every nn.Linear run, under autocast, through _Float32WeightGradLinear
    (outside autocast, as it was)."""
    def forward_of(layer):
        def forward(x):
            if not torch.is_autocast_enabled(x.device.type):
                return torch.nn.Linear.forward(layer, x)
            return _Float32WeightGradLinear.apply(x, layer.weight, layer.bias)
        return forward
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.forward = forward_of(m)
    return model


def nudged(model):
    """A copy whose floating parameters are scaled by 1 + 2^-22 (a float32 rounding step)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            if p.is_floating_point():
                p.mul_(1 + 2.0 ** -22)
    return other


class InceptionCell(torch.nn.Module):
    """Four parallel branches (1x1; 3x3; 3x3-3x3; pool-1x1), concatenated."""

    def __init__(self, cin, width):
        super().__init__()

        def conv(i, o, k):
            return torch.nn.Sequential(torch.nn.Conv2d(i, o, k, padding=k // 2, bias=False),
                                       torch.nn.BatchNorm2d(o), torch.nn.ReLU())

        self.b1 = conv(cin, width, 1)
        self.b2 = torch.nn.Sequential(conv(cin, width, 1), conv(width, width, 3))
        self.b3 = torch.nn.Sequential(conv(cin, width, 1), conv(width, width, 3),
                                      conv(width, width, 3))
        self.b4 = torch.nn.Sequential(torch.nn.MaxPool2d(3, 1, 1), conv(cin, width, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1)


class InceptionNet(torch.nn.Module):
    def __init__(self, classes=5, width=8, cells=3):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4 * width, 3, padding=1, bias=False)
        self.cells = torch.nn.Sequential(*[InceptionCell(4 * width, width) for _ in range(cells)])
        self.head = torch.nn.Linear(4 * width, classes)

    def forward(self, x):
        return self.head(self.cells(self.stem(x)).mean(dim=(2, 3)))


class TransformerBlock(torch.nn.Module):
    """Attention with separate q/k/v projections (three parallel matmuls), then an MLP."""

    def __init__(self, dim=32, heads=4, classes=5, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        # No key bias: softmax ignores it, so its gradient is rounding noise Adam would amplify.
        self.q, self.v = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))
        self.drop = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):  # x: [batch, seq, dim]
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        x = x + self.drop(self.mlp(self.norm2(x)))
        return self.head(x.mean(dim=1))


class RandomDagNet(torch.nn.Module):
    """A random DAG of small Linear+activation operators, each summing a random set of inputs."""

    def __init__(self, seed, nodes=12, dim=16, classes=5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inputs = []
        for v in range(nodes):
            k = int(torch.randint(1, 3, (1,), generator=g)) if v else 0
            self.inputs.append(sorted({int(torch.randint(0, v + 1, (1,), generator=g))
                                       for _ in range(k)}) or [0])
        self.ops = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh()) for _ in range(nodes))
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):
        values = [x]  # values[i + 1] is node i's output; values[0] the input
        for op, inputs in zip(self.ops, self.inputs):
            values.append(op(sum(values[i] for i in inputs)))
        return self.head(values[-1] + values[len(values) // 2])


class SmallSideOperators(torch.nn.Module):
    """Two products and small reads of one hidden tensor: a shape, a mean, views."""

    def __init__(self, dim=64):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        h = torch.relu(self.a(x))
        n = h.shape[0]
        m = h.mean(dim=1, keepdim=True)
        return (self.b(h) + self.c(h) + m).view(n, -1)


class ReadsTheHeadLate(torch.nn.Module):
    """An MLP whose backward reads the head's weight after the head's gradient arrived: the
    hidden layer is scaled by a detached row of it (saved for the backward of the product)."""

    def __init__(self, features=20, hidden=48, classes=5):
        super().__init__()
        self.body = torch.nn.Linear(features, hidden)
        self.mid = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        h = torch.relu(self.body(x)) * self.head.weight.detach()[0]
        return self.head(torch.relu(self.mid(h)))


class UsesALayerTwice(torch.nn.Module):
    """A linear layer called twice between two called once."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.b(torch.relu(self.b(torch.relu(self.a(x))))))


class _HandWrittenAdam(torch.optim.Optimizer):
    """Adam as third-party code writes it; a subclass says how it keeps and advances its state."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.initial_state(p))
                self.advance(state, p.grad, b1, b2)
                m = state["m"] / (1 - b1 ** state["step"])
                v = state["v"] / (1 - b2 ** state["step"])
                p.addcdiv_(m, v.sqrt().add_(1e-8), value=-group["lr"])


class IntStepAdam(_HandWrittenAdam):
    """The common third-party form: a Python int step count, the bias corrections computed from
    it on the host."""

    def initial_state(self, p):
        return {"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)}

    def advance(self, state, g, b1, b2):
        state["step"] += 1
        state["m"].mul_(b1).add_(g, alpha=1 - b1)
        state["v"].mul_(b2).addcmul_(g, g, value=1 - b2)


class ReassigningAdam(_HandWrittenAdam):
    """Moments assigned anew (``m = b1 * m + (1 - b1) * g``) rather than updated in place; the
    step count a device tensor counted in place."""

    def initial_state(self, p):
        return {"step": torch.zeros((), device=p.device), "m": torch.zeros_like(p),
                "v": torch.zeros_like(p)}

    def advance(self, state, g, b1, b2):
        state["step"].add_(1)
        state["m"] = b1 * state["m"] + (1 - b1) * g
        state["v"] = b2 * state["v"] + (1 - b2) * g * g


class GroupCountSGD(torch.optim.Optimizer):
    """SGD whose step size decays with a count kept in the param group (timm's Lamb and Adan
    keep theirs there)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / group["count"] ** 0.5)
