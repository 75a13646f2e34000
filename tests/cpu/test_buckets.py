"""Shape buckets and the evaluator on the CPU (where Step runs eagerly, padding each batch to
its bucket as the graphs do): against the eager loop on the unpadded batches and an eager
no_grad evaluation."""

import copy

import pytest
import torch
import torch.nn.functional as F

import nimble_train as nt
from bucket_reference import (MaskedPool, TokenTagger, correct_and_loss, eager_evaluation,
                              eager_own_loss_loop, lengths_batch, mlm_batches, sample_losses,
                              tiny_bert, token_batches, token_loss, variable_batches)
from step_reference import assert_same_training, eager_accumulation_loop, eager_loop, twin

BUCKETS = nt.Buckets(sizes=(8, 16, 32), dim=1, pad_values={"labels": -100})


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def test_buckets_equal_the_eager_loop_on_unpadded_batches():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MaskedPool(), adamw)
    batches = variable_batches(8, 6, 30, seed=1, short_at=(5,))
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=(8, 16, 32)))
    losses = [step(b) for b in batches]
    expected = eager_loop(m2, o2, sample_losses, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert_same_training(m1, o1, m2, o2)
    buckets = step.stats()["shape_buckets"]
    assert sum(b["eager_steps"] for b in buckets.values()) == len(batches)
    seen = {min(s for s in (8, 16, 32) if s >= b["input_ids"].shape[1]) for b in batches}
    assert {size for size, b in buckets.items() if b["eager_steps"]} == seen


def test_padded_positions_really_are_padded_with_the_pad_values():
    """The batch the model sees: the bucket's length, ids and mask 0 and labels -100 past the
    batch's own length (what makes the semantics exact for a masking model)."""
    seen = []

    class Spy(MaskedPool):
        def forward(self, input_ids, attention_mask, labels=None):
            seen.append((input_ids.clone(), attention_mask.clone(), labels.clone()))
            return super().forward(input_ids, attention_mask)

    def token_sum_loss(logits, batch):  # keeps the labels' shape honest: per-sample
        return sample_losses(logits, {"labels": batch["labels"][:, 0].clamp(min=0) % 3})

    torch.manual_seed(0)
    model = Spy()
    step = nt.Step(model, adamw(model.parameters()), token_sum_loss, buckets=BUCKETS)
    batch = lengths_batch([5, 9, 3])
    batch["labels"] = batch["input_ids"] + 100  # per token, so it is padded too
    step(batch)
    ids, mask, labels = seen[-1]  # the step's forward, after the padding check's
    assert ids.shape == mask.shape == labels.shape == (3, 16)
    assert torch.equal(ids[:, :9], batch["input_ids"]) and not ids[:, 9:].any()
    assert torch.equal(mask[:, :9], batch["attention_mask"]) and not mask[:, 9:].any()
    assert torch.equal(labels[:, :9], batch["labels"]) and (labels[:, 9:] == -100).all()


def test_token_loss_with_tuple_batches_and_pad_values_by_leaf_position():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(TokenTagger(), adamw)
    batches = token_batches(6, 5, 20, seed=2)
    buckets = nt.Buckets(sizes=(8, 24), dim=1, pad_values={2: -100})
    step = nt.Step(m1, o1, token_loss, buckets=buckets)
    losses = [step(b) for b in batches]
    expected = eager_loop(m2, o2, token_loss, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert_same_training(m1, o1, m2, o2)


@pytest.mark.parametrize("task", ["classify", "mlm"])
def test_a_hugging_face_bert_with_attention_masks_equals_the_eager_loop(task):
    pytest.importorskip("transformers")
    m1 = tiny_bert(task, seed=0)
    m2 = copy.deepcopy(m1)
    o1, o2 = adamw(m1.parameters()), adamw(m2.parameters())
    batches = (variable_batches(6, 4, 40, seed=3) if task == "classify"
               else mlm_batches(6, 4, 40, seed=3))
    step = nt.Step(m1, o1, buckets=nt.Buckets(sizes=(16, 32, 64), dim=1,
                                              pad_values={"labels": -100}))
    losses = [step(b) for b in batches]
    expected = eager_own_loss_loop(m2, o2, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-4, atol=1e-5)
    assert_same_training(m1, o1, m2, o2, rtol=1e-4, atol=1e-5)
    assert len({b["input_ids"].shape[1] for b in batches}) > 3  # really variable


def test_accumulation_with_buckets_equals_the_eager_accumulation_loop():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MaskedPool(), adamw)
    batches = variable_batches(8, 4, 30, seed=4)
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=(16, 32)), accumulate=2)
    losses = [step(b) for b in batches]
    expected = eager_accumulation_loop(m2, o2, sample_losses, batches, 2)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert_same_training(m1, o1, m2, o2)


# ---------------------------------------------------------------------- evaluator


@pytest.mark.parametrize("buckets", [None, BUCKETS], ids=["no-buckets", "buckets"])
def test_the_evaluator_equals_an_eager_no_grad_pass_and_restores_the_modes(buckets):
    torch.manual_seed(0)
    model = MaskedPool()
    model.head.eval()  # a module the user left in eval mode stays so
    step = nt.Step(model, adamw(model.parameters()), sample_losses, buckets=buckets)
    if buckets is None:  # one shape: lengths of 16, the last batch short
        g = torch.Generator().manual_seed(5)
        train = [lengths_batch([16] * 4, generator=g) for _ in range(3)]
        held_out = [lengths_batch([16] * 6, generator=g) for _ in range(3)]
        held_out.append(lengths_batch([16] * 2, generator=g))
    else:
        train = variable_batches(3, 4, 16, seed=5)
        held_out = variable_batches(4, 6, 30, seed=6, short_at=(3,))
    for b in train:
        step(b)
    ev = step.evaluator(correct_and_loss)
    outs = [ev(b) for b in held_out]
    total = {k: sum(o[k] for o in outs) for k in outs[0]}
    expected = eager_evaluation(model, held_out)
    assert total["correct"].item() == expected["correct"].item()
    torch.testing.assert_close(total["loss_sum"], expected["loss_sum"], rtol=1e-5, atol=1e-5)
    assert model.training and model.mix.training and not model.head.training
    assert ev.stats()["eager"] == len(held_out)


def test_the_evaluator_takes_a_tensor_result_and_no_gradient_flows():
    torch.manual_seed(0)
    model = MaskedPool()
    step = nt.Step(model, adamw(model.parameters()), sample_losses, buckets=BUCKETS)
    batch = lengths_batch([3, 12])
    ev = step.evaluator(lambda m, b: m(b["input_ids"], b["attention_mask"]))
    logits = ev(batch)
    with torch.no_grad():
        model.eval()
        expected = model(batch["input_ids"], batch["attention_mask"])
        model.train()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert not logits.requires_grad


def test_eager_evaluator_calls_see_the_batch_copied_into_static_inputs():
    """fn sees the batch in the evaluator's static inputs, laid out as the captured graph's
    are: the values given, in tensors that are not views of the caller's (slices of one
    held-out tensor here, whose base a compiled model's guards may read), the same tensors
    every call; a short batch their first rows."""
    torch.manual_seed(0)
    model = MaskedPool()
    step = nt.Step(model, adamw(model.parameters()), sample_losses)
    whole = lengths_batch([16] * 14, generator=torch.Generator().manual_seed(8))
    held_out = [{k: v[i:j] for k, v in whole.items()} for i, j in ((0, 4), (4, 8), (8, 12),
                                                                   (12, 14))]
    seen = []

    def logits(m, b):
        ids = b["input_ids"]
        seen.append((ids.clone(), ids.data_ptr(), ids._is_view() and ids._base.data_ptr()))
        return m(ids, b["attention_mask"])

    ev = step.evaluator(logits)
    outs = [ev(b) for b in held_out]
    model.eval()
    with torch.no_grad():
        for out, b, (given, _, _) in zip(outs, held_out, seen):
            assert torch.equal(given, b["input_ids"])
            torch.testing.assert_close(out, model(b["input_ids"], b["attention_mask"]),
                                       rtol=1e-5, atol=1e-6)
    model.train()
    where = {ptr for _, ptr, _ in seen}
    assert len(where) == 1 and where.isdisjoint({b["input_ids"].data_ptr() for b in held_out})
    assert [base for _, _, base in seen[:3]] == [False] * 3  # the short one: a narrowed view
    assert seen[3][0].shape == (2, 16)


def test_a_bert_evaluator_equals_eager():
    pytest.importorskip("transformers")
    model = tiny_bert("classify", seed=1)
    step = nt.Step(model, adamw(model.parameters()), buckets=BUCKETS)
    ev = step.evaluator(correct_and_loss)
    held_out = variable_batches(3, 5, 30, seed=7)
    outs = [ev(b) for b in held_out]
    expected = eager_evaluation(model, held_out)
    torch.testing.assert_close(sum(o["loss_sum"] for o in outs), expected["loss_sum"],
                               rtol=1e-5, atol=1e-5)
    assert sum(o["correct"] for o in outs).item() == expected["correct"].item()


def test_an_evaluator_that_counts_the_padding_is_refused_and_one_that_masks_it_is_exact():
    """fn's outputs on the first batch its bucket pads are checked once against fn on the batch
    as given: a token accuracy whose mean counts the padded positions is refused before
    anything runs, naming the output; one counting only labels != -100 equals eager."""
    torch.manual_seed(0)
    model = TokenTagger()
    step = nt.Step(model, adamw(model.parameters()), token_loss,
                   buckets=nt.Buckets(sizes=(8, 24), dim=1, pad_values={2: -100}))
    batches = token_batches(4, 5, 20, seed=9)
    step(batches[0])

    def mean_accuracy(m, b):
        return {"accuracy": (m(*b[0]).argmax(-1) == b[1]).float().mean()}

    def correct(m, b):
        labels = b[1]
        return {"correct": ((m(*b[0]).argmax(-1) == labels) & (labels != -100)).sum()}

    before = copy.deepcopy(model.state_dict())
    bad = step.evaluator(mean_accuracy)
    for _ in range(2):
        with pytest.raises(nt.ShapeError, match=r"step\.evaluator: padding a batch of length "
                           r"\d+ to its bucket's \d+ changed it: fn's output 'accuracy' moved by "
                           r"up to .*fn or the model does not ignore the padded positions.*"
                           r"batch\[1\] -100.*exact=False.*Nothing was run"):
            bad(batches[1])
    assert bad.stats()["eager"] == 0 and bad.stats()["bucket_padding"].startswith("refused")
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    good = step.evaluator(correct)
    total = sum(good(b)["correct"] for b in batches)
    model.eval()
    with torch.no_grad():
        expected = sum(correct(model, b)["correct"] for b in batches)
    model.train()
    assert total.item() == expected.item() and good.stats()["bucket_padding"] == "exact"
    step.close()
    step = nt.Step(model, adamw(model.parameters()), token_loss,
                   buckets=nt.Buckets(sizes=(8, 24), dim=1, pad_values={2: -100}, exact=False))
    loose = step.evaluator(mean_accuracy)
    loose(batches[1])
    assert loose.stats()["bucket_padding"] == "unchecked: nt.Buckets(exact=False)"


def test_evaluator_errors():
    torch.manual_seed(0)
    model = MaskedPool()
    step = nt.Step(model, adamw(model.parameters()), sample_losses, buckets=BUCKETS)
    with pytest.raises(TypeError, match="callable"):
        step.evaluator("accuracy")
    ev = step.evaluator(lambda m, b: {"n": 3})
    with pytest.raises(TypeError, match="tensor or a dict of tensors.*'n': int"):
        ev(lengths_batch([4, 4]))
    assert model.training
    ok = step.evaluator(correct_and_loss)
    with pytest.raises(nt.ShapeError, match="longer than the largest bucket"):
        ok(lengths_batch([40, 3]))
    step.close()
    with pytest.raises(nt.NimbleError, match="closed"):
        ok(lengths_batch([4, 4]))
    with pytest.raises(nt.NimbleError, match="closed"):
        step.evaluator(correct_and_loss)


# ---------------------------------------------------------------------- errors


def test_a_batch_longer_than_the_largest_bucket_is_refused_with_the_fix():
    torch.manual_seed(0)
    model = MaskedPool()
    before = copy.deepcopy(model.state_dict())
    step = nt.Step(model, adamw(model.parameters()), sample_losses, buckets=BUCKETS)
    with pytest.raises(nt.ShapeError, match=r"length 33 along dimension 1, longer than the "
                                            r"largest bucket \(32\).*at least 33"):
        step(lengths_batch([33, 2]))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    step(lengths_batch([20, 2]))  # the failed first call fixed nothing
    with pytest.raises(nt.ShapeError, match="longer than the largest bucket"):
        step(lengths_batch([40, 2]))
    assert step.stats()["steps"] == 1


def test_a_dim_that_no_leaf_has_is_refused():
    torch.manual_seed(0)
    model = MaskedPool()
    step = nt.Step(model, adamw(model.parameters()), sample_losses,
                   buckets=nt.Buckets(sizes=(8, 16), dim=2))
    with pytest.raises(nt.ShapeError, match=r"no tensor of the batch has a dimension 2.*"
                                            r"batch\['input_ids'\] \(2, 5\)"):
        step(lengths_batch([5, 2]))


def test_pad_values_for_a_key_not_in_the_batch_are_refused():
    torch.manual_seed(0)
    model = MaskedPool()
    step = nt.Step(model, adamw(model.parameters()), sample_losses,
                   buckets=nt.Buckets(sizes=(8,), pad_values={"label_ids": -100}))
    with pytest.raises(nt.ShapeError, match="'label_ids', which is not a key of the batch "
                                            r"\(its keys: 'attention_mask', 'input_ids', "
                                            r"'labels'\)"):
        step(lengths_batch([5, 2]))
    step = nt.Step(model, adamw(model.parameters()), token_loss,
                   buckets=nt.Buckets(sizes=(8,), pad_values={3: -100}))
    with pytest.raises(nt.ShapeError, match="leaf position 3, but the batch has 3 tensors"):
        step(token_batches(1, 2, 5)[0])


def test_a_leaf_that_loses_the_bucketed_dim_later_is_refused():
    torch.manual_seed(0)
    model = TokenTagger()
    step = nt.Step(model, adamw(model.parameters()), token_loss,
                   buckets=nt.Buckets(sizes=(8,), pad_values={2: -100}))
    (ids, mask), labels = token_batches(1, 2, 5)[0]
    step(((ids, mask), labels))
    with pytest.raises(nt.ShapeError, match=r"batch\[1\] must be a tensor of shape "
                                            r"\(N<=2, L<=8\)"):
        step(((ids, mask), labels[:, 0]))


def test_leaves_that_disagree_on_the_length_are_refused():
    torch.manual_seed(0)
    model = MaskedPool()
    step = nt.Step(model, adamw(model.parameters()), sample_losses, buckets=BUCKETS)
    batch = lengths_batch([5, 2])
    step(batch)
    bad = dict(batch, attention_mask=torch.ones(2, 7, dtype=torch.long))
    with pytest.raises(nt.ShapeError, match=r"batch\['attention_mask'\] has length 7 along "
                                            r"dimension 1 but batch\['input_ids'\] has 5; "
                                            "every entry that varies"):
        step(bad)


class UnmaskedPool(MaskedPool):
    """Pools over every position, the padding included: a bucket changes its outputs."""

    def forward(self, input_ids, attention_mask, labels=None):
        return self.head(self.norm(torch.tanh(self.mix(self.emb(input_ids)))).mean(1))


def test_labels_padded_with_a_class_are_refused_before_anything_runs_and_minus_100_trains():
    """Token labels padded with 0 (pad_values not naming them) are a class the loss counts:
    the first padded batch's losses with the padding differ from those without it, and that
    call, and each later padded one, is refused before anything runs, naming the pad values.
    Named -100, the same batches train as the eager loop on the unpadded batches."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(TokenTagger(), adamw)
    batches = token_batches(4, 5, 20, seed=5)
    step = nt.Step(m1, o1, token_loss, buckets=nt.Buckets(sizes=(8, 24), dim=1))
    before = copy.deepcopy(m1.state_dict())
    for _ in range(2):
        with pytest.raises(nt.ShapeError, match=r"padding a batch of length \d+ to its bucket's "
                           r"\d+ changed it: its losses moved by up to .* without the padding, "
                           r".* with it\)\. The model or the loss does not ignore the padded "
                           r"positions.*Pad values used: batch\[0\]\[0\] 0, batch\[0\]\[1\] 0, "
                           r"batch\[1\] 0 .*pad_values=\{'labels': -100\}.*Nothing was run"):
            step(batches[0])
        for key, value in m1.state_dict().items():
            assert torch.equal(value, before[key]), key
        assert not o1.state and step.stats()["steps"] == 0
    assert step.stats()["bucket_padding"].startswith("refused: padding a batch")
    step = nt.Step(m1, o1, token_loss,
                   buckets=nt.Buckets(sizes=(8, 24), dim=1, pad_values={2: -100}))
    losses = [step(b) for b in batches]
    expected = eager_loop(m2, o2, token_loss, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert_same_training(m1, o1, m2, o2)
    assert step.stats()["bucket_padding"] == "exact"


def test_a_model_that_pools_over_the_padding_is_refused_unless_buckets_are_not_exact():
    """A mean over every position changes with the padding: refused at the first padded batch
    (a batch of a bucket's length before it is not padded, and passes). With
    nt.Buckets(exact=False) it trains on the padded batches, as the eager loop on them."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(UnmaskedPool(), adamw)
    g = torch.Generator().manual_seed(6)
    exactly_8 = lengths_batch([8, 3, 8], generator=g)
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=(8, 16)))
    step(exactly_8)
    assert step.stats()["bucket_padding"] is None
    with pytest.raises(nt.ShapeError, match=r"padding a batch of length 5 to its bucket's 8"):
        step(lengths_batch([5, 2, 4], generator=g))
    step.close()

    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(UnmaskedPool(), adamw)
    batches = variable_batches(5, 4, 16, seed=7)
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=(8, 16), exact=False))
    losses = [step(b) for b in batches]

    def padded(batch):
        size = 8 if batch["input_ids"].shape[1] <= 8 else 16
        return {k: F.pad(v, (0, size - v.shape[1])) if v.dim() == 2 else v
                for k, v in batch.items()}

    expected = eager_loop(m2, o2, sample_losses, [padded(b) for b in batches])
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert_same_training(m1, o1, m2, o2)
    assert step.stats()["bucket_padding"] == "unchecked: nt.Buckets(exact=False)"
    assert "exact=False" in repr(nt.Buckets(sizes=(8,), exact=False))


class TokenBatchNorm(MaskedPool):
    """A BatchNorm (or an InstanceNorm keeping running statistics) over the channels of every
    position before the masked pool: in training its statistics count the padded positions."""

    def __init__(self, after_pool=False, instance=False):
        super().__init__()
        self.after_pool = after_pool
        norm = torch.nn.InstanceNorm1d if instance else torch.nn.BatchNorm1d
        self.bn = norm(self.mix.out_features, track_running_stats=True)

    def forward(self, input_ids, attention_mask, labels=None):
        h = torch.tanh(self.mix(self.emb(input_ids)))
        if not self.after_pool:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * mask).sum(1) / mask.sum(1)
        return self.head(self.bn(pooled) if self.after_pool else pooled)


@pytest.mark.parametrize("instance", [False, True], ids=["batch-norm", "instance-norm"])
def test_a_batch_norm_over_the_padded_positions_is_refused_and_one_after_the_pool_trains(
        instance):
    """In eval mode BatchNorm (InstanceNorm keeping running statistics) normalises with its
    running statistics, which padding leaves alone; a training step normalises with the
    batch's, which count the padded positions where it runs along the padded dimension: the
    check keeps it in training mode, and refuses it (buffers as they were), where a BatchNorm
    over the pooled features is exact and trains as the eager loop on the unpadded batches."""
    torch.manual_seed(0)
    (m1, o1), _ = twin(TokenBatchNorm(instance=instance), adamw)
    g = torch.Generator().manual_seed(8)
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=(8, 16)))
    before = copy.deepcopy(m1.state_dict())
    with pytest.raises(nt.ShapeError, match=r"padding a batch of length 5 to its bucket's 8 "
                       r"changed it: its losses moved by up to .*a BatchNorm along the padded "
                       r"dimension.*Nothing was run"):
        step(lengths_batch([5, 2, 4], generator=g))
    for key, value in m1.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert m1.training and m1.bn.training and not o1.state

    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(TokenBatchNorm(after_pool=True), adamw)
    batches = variable_batches(5, 4, 16, seed=9)
    step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=(8, 16)))
    losses = [step(b) for b in batches]
    expected = eager_loop(m2, o2, sample_losses, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert_same_training(m1, o1, m2, o2)
    torch.testing.assert_close(m1.bn.running_mean, m2.bn.running_mean)
    assert step.stats()["bucket_padding"] == "exact"


def test_a_loss_that_draws_random_numbers_is_left_unchecked():
    """A loss that draws random numbers (noise of the batch's shape) cannot be compared across
    shapes: the check says so and the step trains."""
    torch.manual_seed(0)
    model = MaskedPool()

    def noisy(logits, batch):
        return sample_losses(logits + 0.01 * torch.randn_like(logits), batch)

    step = nt.Step(model, adamw(model.parameters()), noisy, buckets=BUCKETS)
    step(lengths_batch([5, 3]))
    assert step.stats()["bucket_padding"] == ("unchecked: the forward or the loss draws random "
                                              "numbers in eval mode")


@pytest.mark.parametrize("args, error, match", [
    (dict(sizes=()), ValueError, "positive integers"),
    (dict(sizes=(8, 0)), ValueError, "positive integers"),
    (dict(sizes=(8, 8)), ValueError, "twice"),
    (dict(sizes=(8,), dim=0), ValueError, "dimension >= 1"),
    (dict(sizes=(8,), pad_values={"labels": "pad"}), TypeError, "must be a number"),
    (dict(sizes=8), TypeError, "sequence of lengths"),
    (dict(sizes=(8,), exact="yes"), TypeError, "True or False"),
])
def test_bad_buckets_are_refused(args, error, match):
    with pytest.raises(error, match=match):
        nt.Buckets(**args)


def test_buckets_must_be_a_buckets_object():
    model = MaskedPool()
    with pytest.raises(TypeError, match="nt.Buckets"):
        nt.Step(model, adamw(model.parameters()), sample_losses, buckets=(8, 16))
