"""The drop-in transformers.Trainer on a GPU: it captures (the steps are replays), equals
transformers.Trainer, evaluates through the captured evaluator and saves loadable weights."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import BertForSequenceClassification, DataCollatorWithPadding  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from nimble_train.integrations import transformers as nt_transformers  # noqa: E402
from trainer_reference import logged, max_gap, sentences, tokenizer, twin_models  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tf32")]


def arguments(tmp_path, name, **overrides):
    options = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=8,
                   per_device_eval_batch_size=8, gradient_accumulation_steps=2,
                   max_grad_norm=1.0, learning_rate=1e-3, lr_scheduler_type="linear",
                   warmup_steps=2, num_train_epochs=3, logging_steps=1, save_strategy="no",
                   report_to=[], seed=7, disable_tqdm=True)
    options.update(overrides)
    return TrainingArguments(**options)


def run(tmp_path, name, cls, model, train, held_out=None, **overrides):
    tok = tokenizer(tmp_path)
    extra = {"nimble": {"warmup": 2}} if cls is nt_transformers.Trainer else {}
    trainer = cls(model=model.cuda(), args=arguments(tmp_path, name, **overrides),
                  train_dataset=train, eval_dataset=held_out,
                  data_collator=DataCollatorWithPadding(tok), **extra)
    trainer.train()
    return trainer


def test_the_drop_in_captures_and_equals_transformers_trainer(tmp_path):
    """100 sentences of 3..40 tokens (buckets 32 and 64), batches of 8 (the last of 4), windows
    of 2 (each epoch ends on a window of 1), 3 epochs: replays, and Trainer's losses and
    weights up to float reassociation."""
    tok = tokenizer(tmp_path)
    train, held_out = sentences(tok, 100, seed=1), sentences(tok, 36, seed=2)
    ours_model, theirs_model = twin_models()
    ours = run(tmp_path, "ours", nt_transformers.Trainer, ours_model, train, held_out)
    theirs = run(tmp_path, "theirs", transformers.Trainer, theirs_model, train, held_out)
    stats = ours.nimble_step.stats()
    assert stats["phase"] == "replay" and stats["replays"] > 20, stats
    assert stats["updates"] == theirs.state.global_step == 21
    # streams="auto": every linear layer's weight gradient on a side stream (the tiny BERT's
    # 2 layers x 6, the pooler and the classifier), the forward on one stream
    assert stats["weight_grad_layers"] == 14 and stats["weight_grad_streams"] == 1, stats
    assert stats["single_stream_reason"] == nt_transformers._LossModule.nimble_untraced
    assert all(b["captured"] for b in stats["shape_buckets"].values()), stats
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(theirs)),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(logged(ours, "grad_norm")),
                               torch.tensor(logged(theirs, "grad_norm")), rtol=1e-3, atol=1e-5)
    assert max_gap(ours_model, theirs_model) < 1e-4
    # Evaluation: through the evaluator's graphs (36 samples: 4 batches of 8 replay, then 4).
    mine, reference = ours.evaluate(), theirs.evaluate()
    assert mine["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-4)
    evaluator = ours.nimble_step.stats()["evaluators"][0]
    assert evaluator["replays"] == 4 and evaluator["eager"] == 1, evaluator
    # Weights saved from the flat buffers load back as they are.
    ours.save_model(str(tmp_path / "saved"))
    loaded = BertForSequenceClassification.from_pretrained(str(tmp_path / "saved"))
    assert max_gap(loaded.cuda(), ours_model) == 0.0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_without_accumulation_captures(tmp_path, precision):
    """bf16 (the accelerator's autocast) or fp16 (the Step's loss scale on the device), and an
    update every call: Trainer sets the gradients to None after each, before the Step moves
    the update to its fused optimizer."""
    tok = tokenizer(tmp_path)
    train = sentences(tok, 64, seed=3)
    model, reference = twin_models()
    flags = {precision: True, "gradient_accumulation_steps": 1}
    ours = run(tmp_path, "ours", nt_transformers.Trainer, model, train, **flags)
    theirs = run(tmp_path, "theirs", transformers.Trainer, reference, train, **flags)
    stats = ours.nimble_step.stats()
    assert stats["phase"] == "replay" and stats["replays"] > 10, stats
    # Half-precision autocast rounds differently around the fused update: losses agree loosely.
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(theirs)),
                               rtol=3e-2, atol=3e-2)



@pytest.mark.parametrize("how", ["torch_compile", "compiled_by_user"])
def test_a_compiled_model_captures_and_equals_transformers_trainer_compiled_alike(tmp_path, how):
    """TrainingArguments(torch_compile=True): the Step trains torch.compile(model), its warm-up
    compiling once per shape bucket, its captures recording inductor's kernels. A model the
    user compiled is trained as it is (Trainer then needs remove_unused_columns=False: the
    compiled forward's signature names no columns). Trainer compiled alike is the reference."""
    tok = tokenizer(tmp_path)
    train = sentences(tok, 64, seed=4)
    ours_model, theirs_model = twin_models()
    if how == "torch_compile":
        flags = {"torch_compile": True}
        models = ours_model, theirs_model
    else:
        flags = {"remove_unused_columns": False}
        models = torch.compile(ours_model.cuda()), torch.compile(theirs_model.cuda())
    flags["tf32"] = False  # torch_compile would turn TF32 on
    torch._dynamo.reset()
    ours = run(tmp_path, "ours", nt_transformers.Trainer, models[0], train, **flags)
    torch._dynamo.reset()
    theirs = run(tmp_path, "theirs", transformers.Trainer, models[1], train, **flags)
    torch._dynamo.reset()
    from nimble_train import _torch_private

    assert _torch_private.has_compiled_modules(ours.nimble_step.model)
    stats = ours.nimble_step.stats()
    assert stats["phase"] == "replay" and stats["replays"] > 10, stats
    assert all(b["captured"] for b in stats["shape_buckets"].values()), stats
    assert stats["updates"] == theirs.state.global_step
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(theirs)),
                               rtol=1e-3, atol=1e-4)
    assert max_gap(ours_model, theirs_model) < 1e-3
