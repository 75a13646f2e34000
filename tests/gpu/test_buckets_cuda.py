"""Shape buckets and the captured evaluator on the GPU: captured graphs per bucket in one pool,
against the eager loop on the unpadded batches and an eager no_grad evaluation."""

import copy

import pytest
import torch

import nimble_train as nt
from bucket_reference import (MaskedPool, correct_and_loss, eager_evaluation,
                              eager_own_loss_loop, lengths_batch, mlm_batches, sample_losses,
                              tiny_bert, variable_batches)
from step_reference import assert_same_training, eager_accumulation_loop, eager_loop, twin

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
SIZES = (8, 16, 32, 64)
TOL = {"rtol": 2e-4, "atol": 2e-5}  # other shapes, fused update: other rounding


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def test_static_inputs_pad_a_shorter_batch_on_the_device():
    """The copy-in's 2-D copy and memset (and the fill for another pad value) against F.pad."""
    from nimble_train import _C
    ids = torch.randint(1, 9, (3, 5), device=DEVICE)
    feats = torch.randn(3, 5, 4, device=DEVICE)
    labels = torch.randint(0, 9, (3, 5), device=DEVICE)
    like = [torch.empty((), dtype=t.dtype, device=DEVICE).expand(3, 12, *t.shape[2:])
            for t in (ids, feats, labels)]
    specs = [(f"batch[{i}]", t, t.contiguous().stride(), True, 1, pad)
             for i, (t, pad) in enumerate(zip(like, (0.0, 0.0, -100.0)))]
    inputs = _C.StaticInputs(specs)
    inputs.copy_in([ids, feats, labels], 3)
    F = torch.nn.functional
    assert torch.equal(inputs.buffers[0], F.pad(ids, (0, 7)))
    assert torch.equal(inputs.buffers[1], F.pad(feats, (0, 0, 0, 7)))
    assert torch.equal(inputs.buffers[2], F.pad(labels, (0, 7), value=-100))
    inputs.copy_in([ids[:2, :4], feats[:2, :4], labels[:2, :4]], 2)  # short and shorter
    assert torch.equal(inputs.buffers[0][:2], F.pad(ids[:2, :4], (0, 8)))
    assert torch.equal(inputs.buffers[2][:2], F.pad(labels[:2, :4], (0, 8), value=-100))
    assert torch.equal(inputs.buffers[0][2], F.pad(ids[2], (0, 7)))  # the row it left


def test_buckets_are_captured_largest_first_and_equal_the_eager_loop():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MaskedPool().to(DEVICE), sgd)
    batches = variable_batches(14, 8, 60, seed=1, device=DEVICE, short_at=(9,))
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=SIZES))
    losses = [step(b).clone() for b in batches]
    expected = eager_loop(m2, o2, sample_losses, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), **TOL)
    assert_same_training(m1, o1, m2, o2, **TOL)
    stats = step.stats()
    assert stats["captured"] and stats["graphs"] == len(SIZES)  # every bucket at once
    buckets = stats["shape_buckets"]
    assert all(b["captured"] and b["deferred"] is None for b in buckets.values())
    after_warmup = batches[3:]
    for size, counts in buckets.items():
        fits = [b for b in after_warmup
                if min(s for s in SIZES if s >= b["input_ids"].shape[1]) == size]
        assert counts["replays"] == len(fits), (size, counts)
    assert stats["replays"] == len(after_warmup) and stats["eager_steps"] == 3


def test_a_hugging_face_bert_with_attention_masks_equals_the_eager_loop():
    m1 = tiny_bert("mlm", device=DEVICE, seed=0)
    m2 = copy.deepcopy(m1)
    o1, o2 = sgd(m1.parameters()), sgd(m2.parameters())
    batches = mlm_batches(10, 4, 60, seed=2, device=DEVICE)
    step = nt.Step(m1, o1, buckets=nt.Buckets(sizes=SIZES, pad_values={"labels": -100}))
    losses = [step(b).clone() for b in batches]
    expected = eager_own_loss_loop(m2, o2, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), **TOL)
    assert_same_training(m1, o1, m2, o2, **TOL)
    assert step.stats()["replays"] == len(batches) - 3


def test_accumulation_with_buckets_equals_the_eager_accumulation_loop():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MaskedPool().to(DEVICE), adamw)
    batches = variable_batches(12, 4, 60, seed=3, device=DEVICE)
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=SIZES), accumulate=2)
    losses = [step(b).clone() for b in batches]
    expected = eager_accumulation_loop(m2, o2, sample_losses, batches, 2)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), **TOL)
    assert_same_training(m1, o1, m2, o2, **TOL)
    assert step.stats()["graphs"] == 2 * len(SIZES)


def test_the_pool_of_four_buckets_stays_close_to_the_largest_alone():
    """All bucket graphs share one pool: memory is about the largest bucket's, not the sum."""
    def pool(sizes):
        model = tiny_bert("mlm", device=DEVICE, seed=0, hidden_size=256, num_attention_heads=4,
                          intermediate_size=1024, max_position_embeddings=256)
        step = nt.Step(model, adamw(model.parameters()),
                       buckets=nt.Buckets(sizes=sizes, pad_values={"labels": -100}))
        for batch in mlm_batches(5, 32, 256, seed=1, device=DEVICE):
            step(batch)
        stats = step.stats()
        assert stats["graphs"] == len(sizes)
        step.close()
        return stats["pool_bytes"]

    largest = pool((256,))
    four = pool((32, 64, 128, 256))
    assert four <= 1.2 * largest, (four, largest)


def test_a_bucket_whose_capture_fails_unmet_runs_eagerly_once_then_is_captured():
    """A model that synchronises for one length only: that bucket's capture fails while no
    eager step has met it (deferred: its next batch runs eagerly), and fails again once met,
    which is an error; the other buckets replay meanwhile, and nothing is lost."""
    class SyncsAt32(MaskedPool):
        def forward(self, input_ids, attention_mask, labels=None):
            if input_ids.shape[1] == 32:
                assert attention_mask.sum().item() >= 0  # a host sync at this length only
            return super().forward(input_ids, attention_mask)

    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(SyncsAt32().to(DEVICE), sgd)
    g = torch.Generator().manual_seed(4)
    batches = [lengths_batch([5] * 4, device=DEVICE, generator=g) for _ in range(4)]
    batches += [lengths_batch([20] * 4, device=DEVICE, generator=g)] * 2
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=(8, 32)))
    losses = [step(b).clone() for b in batches[:5]]
    buckets = step.stats()["shape_buckets"]
    assert buckets[8]["captured"] and not buckets[32]["captured"]
    assert buckets[32]["deferred"] and buckets[32]["eager_steps"] == 1
    with pytest.raises((nt.SyncError, nt.CaptureError)):
        step(batches[5])  # met now, and failing again: the usual capture error
    expected = eager_loop(m2, o2, sample_losses, batches[:5])
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), **TOL)
    assert_same_training(m1, o1, m2, o2, **TOL)  # the failed capture changed nothing
    step(batches[5])  # and the step goes on, eagerly


@pytest.mark.parametrize("point", ["after_staging", "after_copy_in"])
def test_a_failed_bucket_launch_leaves_the_model_and_optimizer_as_they_were(point):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MaskedPool().to(DEVICE), adamw)
    batches = variable_batches(8, 4, 60, seed=5, device=DEVICE)
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=SIZES))
    for b in batches[:6]:
        step(b)
    step._graph.graph.fail_next_launch(point)
    with pytest.raises(RuntimeError, match="injected failure"):
        step(batches[6])
    for b in batches[6:]:
        step(b)
    eager_loop(m2, o2, sample_losses, batches)
    assert_same_training(m1, o1, m2, o2, **TOL)


# ---------------------------------------------------------------------- evaluator


def test_the_evaluator_is_captured_per_bucket_and_equals_eager():
    torch.manual_seed(0)
    model = MaskedPool().to(DEVICE)
    step = nt.Step(model, adamw(model.parameters()), sample_losses,
                   buckets=nt.Buckets(sizes=SIZES))
    ev = step.evaluator(correct_and_loss)
    held_out = variable_batches(12, 16, 60, seed=6, device=DEVICE, short_at=(11,))
    before = [ev(b) for b in held_out[:2]]  # before capture: eager
    for b in variable_batches(5, 8, 60, seed=7, device=DEVICE):
        step(b)
    outs = [ev(b) for b in held_out]
    total = {k: sum(o[k] for o in outs) for k in outs[0]}
    expected = eager_evaluation(model, held_out)
    assert total["correct"].item() == expected["correct"].item()
    torch.testing.assert_close(total["loss_sum"], expected["loss_sum"], **TOL)
    stats = ev.stats()
    assert stats["graphs"] == len(SIZES) and stats["captures"] == len(SIZES)
    assert stats["replays"] == len(held_out) - 1 and stats["eager"] == 2 + 1  # short: eager
    assert model.training and all(m.training for m in model.modules())
    assert outs[0]["correct"].data_ptr() != outs[1]["correct"].data_ptr()  # fresh outputs
    assert before[0]["correct"].device.type == "cuda"
    step(variable_batches(1, 8, 60, seed=8, device=DEVICE)[0])  # training goes on
    again = ev(held_out[0])
    expected = eager_evaluation(model, held_out[:1])  # the new weights, by address
    torch.testing.assert_close(again["loss_sum"], expected["loss_sum"], **TOL)


def test_the_evaluator_inside_ema_weights_evaluates_the_ema():
    torch.manual_seed(0)
    model = MaskedPool().to(DEVICE)
    step = nt.Step(model, adamw(model.parameters()), sample_losses,
                   buckets=nt.Buckets(sizes=SIZES), ema=0.9)
    for b in variable_batches(8, 8, 60, seed=9, device=DEVICE):
        step(b)
    ev = step.evaluator(correct_and_loss)
    held_out = variable_batches(3, 16, 60, seed=10, device=DEVICE)
    trained = [ev(b) for b in held_out]
    with step.ema_weights():
        averaged = [ev(b) for b in held_out]
    ema_model = copy.deepcopy(model)
    ema_model.load_state_dict(step.ema_state_dict())
    expected = eager_evaluation(ema_model, held_out)
    torch.testing.assert_close(sum(o["loss_sum"] for o in averaged), expected["loss_sum"], **TOL)
    assert not torch.allclose(sum(o["loss_sum"] for o in trained), expected["loss_sum"])
    assert ev.stats()["replays"] == 2 * len(held_out)


def test_an_evaluator_that_syncs_runs_eagerly_with_a_warning():
    torch.manual_seed(0)
    model = MaskedPool().to(DEVICE)
    step = nt.Step(model, adamw(model.parameters()), sample_losses,
                   buckets=nt.Buckets(sizes=(64,)))
    for b in variable_batches(5, 8, 60, seed=11, device=DEVICE):
        step(b)

    def accuracy(m, b):  # .item(): a host sync in every call
        return torch.tensor(correct_and_loss(m, b)["correct"].item(), device=DEVICE)

    ev = step.evaluator(accuracy)
    held_out = variable_batches(3, 16, 60, seed=12, device=DEVICE)
    with pytest.warns(UserWarning, match="runs eagerly"):
        outs = [ev(b) for b in held_out]
    assert sum(outs).item() == eager_evaluation(model, held_out)["correct"].item()
    assert ev.stats()["graphs"] == 0 and 64 in ev.stats()["eager_buckets"]
