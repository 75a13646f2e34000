"""A Hugging Face BERT captured by Step runs SDPA's fused attention kernel: while a graph is
captured, transformers materialises its attention mask as a broadcast view that the fused
kernels refuse, and Step gives SDPA a dense copy (nimble_train/_attention.py); a compiled model
gets the copy in the graph inductor compiles."""

import copy

import pytest
import torch
import torch._inductor.config
import torch.nn.functional as F
from torch import nn

import nimble_train as nt
from bucket_reference import eager_own_loss_loop, mlm_batches, tiny_bert
from step_reference import assert_same_training

pytestmark = pytest.mark.cuda
pytest.importorskip("transformers")


def attention_kernels(step, batch):
    """Names of the kernels one replay runs that compute attention in one fused kernel."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(batch)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA}
    return {n for n in names if "fmha" in n or "flash" in n or "attention" in n.lower()}


def fixed_length(batch, length, padded):
    """The batch padded to `length` (ids 0, mask 0, labels -100); not `padded`: every position
    a real token, so the mask is all ones (which eager transformers drops)."""
    out = {}
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
        t = batch[key]
        out[key] = torch.nn.functional.pad(t, (0, length - t.shape[1]), value=fill)
    if not padded:
        out["input_ids"] = torch.where(out["attention_mask"].bool(), out["input_ids"], 7)
        out["attention_mask"] = torch.ones_like(out["attention_mask"])
    return out


@pytest.mark.parametrize("padded", [False, True], ids=["all-ones-mask", "padding"])
def test_a_captured_bert_runs_fused_attention_and_equals_the_eager_loop(no_tf32, padded):
    model = tiny_bert("mlm", device="cuda", seed=0, hidden_size=64, num_attention_heads=2,
                      attn_implementation="sdpa")
    reference = copy.deepcopy(model)
    make = lambda p: torch.optim.AdamW(p, lr=3e-3)  # noqa: E731
    o1, o2 = make(model.parameters()), make(reference.parameters())
    batches = [fixed_length(b, 32, padded) for b in mlm_batches(7, 4, 32, seed=1, device="cuda")]
    step = nt.Step(model, o1, warmup=2)
    losses = [step(b).clone() for b in batches]
    assert step.stats()["replays"] == len(batches) - 2, step.stats()
    assert attention_kernels(step, batches[0]), "the captured step computes attention unfused"
    expected = eager_own_loss_loop(reference, o2, batches + [batches[0]])
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected[:-1]), rtol=2e-4,
                               atol=2e-5)
    assert_same_training(model, o1, reference, o2, rtol=2e-4, atol=2e-5)
    step.close()


def test_the_benchmarks_hand_written_graph_runs_fused_attention_as_step_does(monkeypatch):
    """The benchmark's hand-written whole-step graph (bench.modes.hand_graph; bench_dist's
    DDP graph uses the same capture) gives SDPA the masks Step gives it; captured plainly, it
    would run the math path and make Step look faster than it is."""
    from nimble_train.bench import modes
    from nimble_train.bench.workloads import make_workload
    w = make_workload("bert", 8, "cuda", seq=64, bert_size="tiny", count=4)
    monkeypatch.setattr(modes, "anchor_capture", torch.cuda.graph)
    plain = modes.hand_graph(w)
    assert not attention_kernels(plain, w.batches[1]), (
        "captured without dense masks, transformers' attention is fused already: "
        "anchor_capture (and Step's DenseAttentionMasks) may no longer be needed")
    monkeypatch.undo()
    assert attention_kernels(modes.hand_graph(w), w.batches[1]), \
        "the hand-written graph anchor computes attention unfused"


class BroadcastMaskAttention(nn.Module):
    """Self-attention whose all-True mask is a broadcast view built in the forward, as
    transformers builds one while torch.compile traces it; a linear head on the mean."""

    def __init__(self, dim=64, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), \
            nn.Linear(dim, 5)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = torch.ones((), dtype=torch.bool, device=x.device).expand(b, 1, s, s)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(self.out(h.transpose(1, 2).reshape(b, s, d)).mean(1))


def attention_batches(count=6):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 32, 64, generator=g).cuda(),
             torch.randint(0, 5, (8,), generator=g).cuda()) for _ in range(count)]


@pytest.mark.parametrize("streams", [1, "auto"])
def test_a_compiled_model_in_step_runs_fused_attention_and_equals_the_eager_loop(no_tf32,
                                                                                 streams):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BroadcastMaskAttention().cuda()
    reference = copy.deepcopy(model)
    # SGD: the key projection's bias has no gradient but rounding (softmax ignores it), which
    # Adam would turn into steps of about lr
    make = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    o1, o2 = make(model.parameters()), make(reference.parameters())
    batches = attention_batches()
    step = nt.Step(torch.compile(model), o1, F.cross_entropy, streams=streams, warmup=2)
    # compiled here, not served by inductor's caches, so that the pass runs and counts
    with torch._inductor.config.patch(force_disable_caches=True):
        losses = [step(b).clone() for b in batches]
    stats = step.stats()
    assert stats["replays"] == len(batches) - 2 and stats["dense_attention_masks"] == 1, stats
    assert attention_kernels(step, batches[0]), "the compiled step computes attention unfused"
    expected = []
    for x, y in batches + [batches[0]]:
        o2.zero_grad()
        loss = F.cross_entropy(reference(x), y)
        loss.backward()
        o2.step()
        expected.append(loss.detach())
    # the eager reference runs SDPA's math path over the broadcast mask, Step the fused kernel
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected[:-1]), rtol=1e-4,
                               atol=1e-5)
    assert_same_training(model, o1, reference, o2, rtol=1e-4, atol=1e-5)
    step.close()
    torch._dynamo.reset()


def test_compiled_without_the_pass_the_same_model_runs_attention_unfused():
    """What the pass changes: torch.compile alone keeps SDPA's math path for that mask."""
    from torch.profiler import ProfilerActivity, profile
    torch._dynamo.reset()
    model = torch.compile(BroadcastMaskAttention().cuda())
    x, y = attention_batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.cross_entropy(model(x), y).backward()
        torch.cuda.synchronize()
    torch._dynamo.reset()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert not {n for n in names if "fmha" in n or "flash" in n or "attention" in n.lower()}, (
        "torch.compile runs this mask's attention fused by itself: DenseMaskPass may no longer "
        "be needed")


@pytest.mark.parametrize("mode", ["compile", "compile-ro"])
def test_the_benchmarks_compiled_rows_run_fused_attention_as_step_does(mode):
    """The benchmark's compiled rows compile with the masks Step's compiled models get
    (bench.modes._dense_masks_while_compiling), whichever version of transformers decides
    whether an all-ones mask is built while torch.compile traces."""
    from nimble_train.bench import modes
    from nimble_train.bench.workloads import make_workload
    w = make_workload("bert", 8, "cuda", seq=64, bert_size="tiny", count=4)
    step = modes.MODES[mode].build(w)
    for b in w.batches[:3]:
        step(b)
    assert attention_kernels(step, w.batches[3]), f"the {mode} row computes attention unfused"
    torch._dynamo.reset()
