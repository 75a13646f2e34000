"""A Hugging Face BERT captured by Step runs SDPA's fused attention kernel: while a graph is
captured, transformers materialises its attention mask as a broadcast view that the fused
kernels refuse, and Step gives SDPA a dense copy (nimble_train/_attention.py)."""

import copy

import pytest
import torch

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
