"""The drop-in transformers.Trainer against transformers.Trainer itself, on the CPU (the Step
runs its eager path there, with the same windows, weights, clipping and bucket padding the
graph uses)."""

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import DataCollatorWithPadding, TrainingArguments  # noqa: E402

import nimble_train as nt  # noqa: E402
from nimble_train.errors import NimbleError  # noqa: E402
from nimble_train.integrations import transformers as nt_transformers  # noqa: E402
from trainer_reference import logged, max_gap, sentences, tokenizer, twin_models  # noqa: E402


def arguments(tmp_path, name, **overrides):
    options = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                   per_device_eval_batch_size=8, gradient_accumulation_steps=2,
                   max_grad_norm=1.0, learning_rate=2e-3, lr_scheduler_type="linear",
                   warmup_steps=2, num_train_epochs=2, logging_steps=1, save_strategy="no",
                   report_to=[], use_cpu=True, seed=7, disable_tqdm=True)
    options.update(overrides)
    return TrainingArguments(**options)


def train_both(tmp_path, train, evaluate=None, nimble=None, padding=True, **overrides):
    tok = tokenizer(tmp_path)
    collator = DataCollatorWithPadding(tok, padding=padding,
                                       max_length=48 if padding == "max_length" else None)
    ours, theirs = twin_models()
    runs = {}
    for name, cls, model, extra in (
            ("theirs", transformers.Trainer, theirs, {}),
            ("ours", nt_transformers.Trainer, ours, {"nimble": nimble or {}})):
        trainer = cls(model=model, args=arguments(tmp_path, name, **overrides),
                      train_dataset=train, eval_dataset=evaluate, data_collator=collator, **extra)
        trainer.train()
        runs[name] = trainer
    return runs["ours"], runs["theirs"], ours, theirs


def test_equals_transformers_trainer_with_accumulation_clipping_schedule_and_padding(tmp_path):
    """34 sentences of 3..40 tokens, batches of 4 padded to their longest: 9 micro-batches an
    epoch (the last of 2 samples) in windows of 2, the epoch ending on a window of 1; 10
    optimizer steps; a linear schedule with warm-up; clipping at 1.0."""
    tok = tokenizer(tmp_path)
    train = sentences(tok, 34, seed=1)
    ours, theirs, m_ours, m_theirs = train_both(tmp_path, train)
    step = ours.nimble_step
    stats = step.stats()
    assert stats["updates"] == 10 == theirs.state.global_step == ours.state.global_step
    assert stats["steps"] == 18 and stats["accumulate"] == 2
    assert sorted(stats["shape_buckets"]) == [32, 64]  # from the tokenizer's 64
    assert sum(b["eager_steps"] for b in stats["shape_buckets"].values()) == 18
    losses, expected = logged(ours), logged(theirs)
    assert len(losses) == 10
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(logged(ours, "grad_norm")),
                               torch.tensor(logged(theirs, "grad_norm")), rtol=1e-5, atol=1e-6)
    assert logged(ours, "learning_rate") == logged(theirs, "learning_rate")
    assert max_gap(m_ours, m_theirs) < 1e-5
    # The optimizer's state is the user's, and equal.
    for a, b in zip(ours.optimizer.state_dict()["state"].values(),
                    theirs.optimizer.state_dict()["state"].values()):
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_evaluation_goes_through_the_evaluator_and_equals(tmp_path):
    tok = tokenizer(tmp_path)
    train, held_out = sentences(tok, 16, seed=2), sentences(tok, 20, seed=3)
    ours, theirs, _, _ = train_both(tmp_path, train, held_out, num_train_epochs=1)
    mine, reference = ours.evaluate(), theirs.evaluate()
    assert mine["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    evaluators = ours.nimble_step.stats()["evaluators"]
    assert len(evaluators) == 1 and evaluators[0]["eager"] == 3  # 8 + 8 + 4 samples
    predictions, expected = ours.predict(held_out), theirs.predict(held_out)
    torch.testing.assert_close(torch.as_tensor(predictions.predictions),
                               torch.as_tensor(expected.predictions), rtol=1e-5, atol=1e-5)


def test_fixed_length_batches_without_clipping_or_accumulation(tmp_path):
    """Batches padded to max_length: no buckets (the collator does not pad dynamically)."""
    tok = tokenizer(tmp_path)
    train = sentences(tok, 24, seed=4)
    ours, theirs, m_ours, m_theirs = train_both(
        tmp_path, train, padding="max_length", gradient_accumulation_steps=1,
        max_grad_norm=0.0)
    assert ours.nimble_step.stats()["shape_buckets"] is None
    assert logged(ours, "grad_norm") == []  # no norm computed without clipping (documented)
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(theirs)),
                               rtol=1e-5, atol=1e-6)
    assert max_gap(m_ours, m_theirs) < 1e-5


def test_checkpoint_save_and_resume_equal_transformers_trainer(tmp_path):
    """Save at step 4 (weights as copies, the optimizer's state, the schedule), resume into a
    model with other weights, train on: the same as transformers.Trainer doing the same."""
    tok = tokenizer(tmp_path)
    train = sentences(tok, 32, seed=5)
    collator = DataCollatorWithPadding(tok)
    finals = {}
    for name, cls in (("theirs", transformers.Trainer), ("ours", nt_transformers.Trainer)):
        model, _ = twin_models(seed=3)
        cls(model=model, args=arguments(tmp_path, name, save_strategy="steps", save_steps=4,
                                        max_steps=4),
            train_dataset=train, data_collator=collator).train()
        resumed, _ = twin_models(seed=11)  # other weights: the checkpoint must set them
        trainer = cls(model=resumed, args=arguments(tmp_path, name), train_dataset=train,
                      data_collator=collator)
        trainer.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-4"))
        assert trainer.state.global_step == 8
        finals[name] = resumed
    assert max_gap(finals["ours"], finals["theirs"]) < 1e-5


@pytest.mark.parametrize("overrides,argument", [
    ({"torch_compile_mode": "reduce-overhead"}, "torch_compile_mode"),
    ({"torch_compile": True, "torch_compile_mode": "max-autotune"}, "torch_compile_mode"),
    ({"torch_compile_backend": "cudagraphs"}, "torch_compile_backend"),
])
def test_what_does_not_map_is_refused_by_name(tmp_path, overrides, argument):
    model, _ = twin_models()
    with pytest.raises(NimbleError, match=f"TrainingArguments.{argument}="):
        nt_transformers.Trainer(model=model, args=arguments(tmp_path, "x", **overrides))


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"])
def test_torch_compile_trains_the_model_compiled_with_the_arguments_mode(tmp_path, mode):
    from nimble_train import _torch_private

    model, _ = twin_models()
    trainer = nt_transformers.Trainer(model=model, args=arguments(
        tmp_path, "x", torch_compile=True, torch_compile_mode=mode, use_cpu=True))
    trainer.create_optimizer()
    step = trainer._step_for_training()
    compiled = step.model.model
    assert _torch_private.is_compiled_module(compiled) and compiled._orig_mod is model
    if mode is not None:  # the mode's inductor options (max_autotune, no CUDA graphs)
        config = compiled.get_compiler_config()
        options = torch._inductor.list_mode_options(mode)
        assert options and all(config[key] == value for key, value in options.items())
    step.close()


@pytest.mark.parametrize("nimble,match", [
    ({"accumulate": 4}, "follows TrainingArguments' gradient_accumulation_steps"),
    ({"grad_clip": 1.0}, "follows TrainingArguments' max_grad_norm"),
    ({"warmpu": 3}, "'warmpu'.*is not an nt.Step option"),
])
def test_bad_nimble_options_are_refused(tmp_path, nimble, match):
    model, _ = twin_models()
    with pytest.raises(ValueError, match=match):
        nt_transformers.Trainer(model=model, args=arguments(tmp_path, "x"), nimble=nimble)


def test_default_buckets_follow_the_collator():
    tok_like = type("Tok", (), {"pad_token_id": 0, "pad_token_type_id": 0,
                                "model_max_length": 512})()
    collator = DataCollatorWithPadding(tok_like, pad_to_multiple_of=8)
    model, _ = twin_models()
    model.config.max_position_embeddings = 512
    buckets = nt_transformers.default_buckets(collator, model)
    assert isinstance(buckets, nt.Buckets)
    assert buckets.sizes == (32, 64, 128, 256, 512) and buckets.dim == 1
    assert buckets.pad_values["labels"] == -100
    assert nt_transformers.default_buckets(DataCollatorWithPadding(tok_like, padding="max_length"),
                                           model) is None


def test_torchrun_data_parallel_equals_transformers_trainer(tmp_path):
    """Two gloo ranks under torchrun, each starting from other weights: the drop-in (the Step
    broadcasts rank 0's weights and all-reduces the gradients itself, Trainer's DDP wrapper
    bypassed) ends as transformers.Trainer with DDP does, on every rank."""
    worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "trainer_dist_worker.py")
    results = {}
    for which in ("theirs", "ours"):
        out = tmp_path / f"{which}.pt"
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             worker, which, str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        results[which] = torch.load(out)
    ours, theirs = results["ours"], results["theirs"]
    assert '"world_size": 2' in ours["stats"] and '"updates": 6' in ours["stats"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]),
                               rtol=1e-5, atol=1e-6)
    for rank in range(2):
        for name, value in theirs["weights"][rank].items():
            torch.testing.assert_close(ours["weights"][rank][name], value, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, name=name: f"rank {rank} {name}: {m}")
