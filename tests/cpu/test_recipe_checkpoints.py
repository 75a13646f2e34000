"""The recipes' checkpoints on the CPU: a resumed run equals one that never stopped (dropout,
the fp16 loss scale and BERT fine-tuning's variable-length batches included), saves that fail or
are stopped leave no temporary file, a bad --save path fails before training, and a damaged or
foreign --resume file ends the run with one line naming it."""

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from nimble_train.bench import workloads

from recipe_reference import (RECIPES, TINY_CIFAR, TINY_FINETUNE, bert, cifar10,  # noqa: F401
                              needs_transformers, one_thread)
from recipe_reference import TINY_BERT as TINY_BERT_ONE_EPOCH

import _train  # recipes/, on the path through recipe_reference

# 8 samples of batch 2: 4 steps per epoch; two epochs.
TINY_BERT = TINY_BERT_ONE_EPOCH + ["--epochs", "2"]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_training_state(a: dict, b: dict) -> None:
    """Weights, optimizer state and schedule of two checkpoints, bit for bit (the CPU runs the
    same operations in the same order, so nothing excuses a difference)."""
    assert (a["step"], a["epoch"]) == (b["step"], b["epoch"])
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")
    for p, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(value, b["optimizer"]["state"][p][name], rtol=0, atol=0,
                                       msg=lambda m, p=p, name=name: f"optimizer {p}.{name}: {m}")
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


def straight_and_resumed(main, common, tmp_path, stop):
    """The checkpoints of one uninterrupted run and of a run stopped after `stop` steps and
    resumed in a fresh model, optimizer and step (main() called again); and the checkpoint
    at the stop."""
    straight, split = str(tmp_path / "straight.pt"), str(tmp_path / "split.pt")
    assert main(common + ["--save", straight]) == 0
    assert main(common + ["--steps", str(stop), "--save", split]) == 0
    at_stop = load(split)
    assert main(common + ["--resume", split, "--save", split]) == 0
    return load(straight), load(split), at_stop


# ---------------------------------------------------------------------- exact resume


@needs_transformers
@pytest.mark.parametrize("mode", ["eager", "step"])
def test_bert_resume_with_dropout_equals_an_uninterrupted_run(mode, tmp_path):
    # Dropout draws from the global generator; without its state in the checkpoint the resumed
    # run draws other masks (its weights 3e-3 apart after 8 steps here).
    assert workloads.bert_config("tiny").hidden_dropout_prob > 0
    straight, resumed, at_stop = straight_and_resumed(
        bert.main, TINY_BERT + ["--mode", mode], tmp_path, stop=3)
    assert_same_training_state(straight, resumed)
    assert at_stop["step"] == 3 and len(at_stop["rng"]) == 1  # one process, mid-epoch
    assert torch.equal(straight["rng"][0]["cpu"], resumed["rng"][0]["cpu"])


@needs_transformers
@pytest.mark.parametrize("mode", ["eager", "step"])
# The first update is skipped (its gradients overflow), which torch takes for a scheduler
# stepped before its optimizer.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_bert_fp16_resume_keeps_the_loss_scale(mode, tmp_path):
    # The first step's loss times 2^16 overflows float16, so the scale has backed off by the
    # stop: a resumed run that started again from 2^16 would skip another update.
    straight, resumed, at_stop = straight_and_resumed(
        bert.main, TINY_BERT + ["--mode", mode, "--amp", "fp16"], tmp_path, stop=3)
    assert_same_training_state(straight, resumed)
    assert at_stop["loss_scale"]["scale"] < 2.0**16
    assert straight["loss_scale"] == resumed["loss_scale"]


@needs_transformers
@pytest.mark.parametrize("mode", ["eager", "step"])
def test_bert_finetune_resume_equals_an_uninterrupted_run(mode, tmp_path):
    # Variable-length batches (on shape buckets under nt.Step), dropout on: the data order and
    # every batch's length follow from the step count, the dropout masks from the saved states.
    straight, resumed, at_stop = straight_and_resumed(
        bert.main, TINY_FINETUNE + ["--epochs", "2", "--mode", mode], tmp_path, stop=3)
    assert_same_training_state(straight, resumed)
    assert at_stop["step"] == 3 and at_stop["config"]["task"] == "finetune"
    assert straight["step"] == 12


@needs_transformers
def test_resume_of_the_other_task_says_which(tmp_path, capsys):
    path = str(tmp_path / "mlm.pt")
    assert bert.main(TINY_BERT + ["--steps", "1", "--save", path]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as raised:
        bert.main(TINY_FINETUNE + ["--steps", "1", "--resume", path])
    assert str(raised.value) == (f"--resume {path}: a checkpoint of --task pretrain, not --task "
                                 "finetune; pass --task pretrain to continue it")
    assert capsys.readouterr().out == ""  # refused before anything was built


@needs_transformers
def test_checkpoint_written_before_the_task_option_still_resumes(tmp_path, capsys):
    # Checkpoints of masked-LM pretraining written before --task and --dropout existed record
    # neither; they were pretraining with BERT's dropout, and resume as such.
    path = str(tmp_path / "old.pt")
    assert bert.main(TINY_BERT + ["--steps", "1", "--save", path]) == 0
    state = load(path)
    del state["config"]["task"], state["config"]["dropout"]
    torch.save(state, path)
    assert bert.main(TINY_BERT + ["--steps", "1", "--resume", path, "--save", path]) == 0
    assert f"resumed {path} at step 1" in capsys.readouterr().out
    assert load(path)["step"] == 2
    with pytest.raises(SystemExit, match="has dropout=0.1 but this run asks for dropout=0.0"):
        bert.main(TINY_BERT + ["--steps", "1", "--dropout", "0", "--resume", path])


def test_each_rank_restores_the_state_its_rank_saved():
    # Under torchrun rank 0 saves every rank's state (gathered); each rank takes its own back.
    saved = torch.get_rng_state()
    try:
        states = []
        for seed in (11, 22):
            torch.manual_seed(seed)
            states.append(_train.rng_state(torch.device("cpu")))
        assert not torch.equal(states[0]["cpu"], states[1]["cpu"])
        for rank in (1, 0):
            torch.manual_seed(99)
            _train.restore_rng(states, _train.Job(rank=rank, world_size=2), torch.device("cpu"))
            assert torch.equal(torch.get_rng_state(), states[rank]["cpu"])
        gathered = _train.gather_rng_states(_train.Job(), torch.device("cpu"))
        assert len(gathered) == 1 and torch.equal(gathered[0]["cpu"], torch.get_rng_state())
    finally:
        torch.set_rng_state(saved)


# ---------------------------------------------------------------------- --save


@pytest.mark.parametrize("where", ["under-a-file", "a-folder"])
def test_bad_save_path_fails_before_training(where, tmp_path, capsys):
    if where == "under-a-file":
        (tmp_path / "notes.txt").write_text("a file, not a folder")
        path, named = str(tmp_path / "notes.txt" / "ckpt.pt"), str(tmp_path / "notes.txt")
    else:
        path = named = str(tmp_path)
    with pytest.raises(SystemExit) as raised:
        cifar10.main(TINY_CIFAR + ["--steps", "1", "--save", path])
    message = str(raised.value)
    assert message.startswith(f"--save {path}: ") and named in message and "\n" not in message
    out = capsys.readouterr().out
    assert "train loss" not in out and "summary:" not in out  # nothing was trained
    assert os.listdir(tmp_path) == (["notes.txt"] if where == "under-a-file" else [])


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError(28, "No space left on device")],
                         ids=["ctrl-c", "disk-full"])
def test_failed_save_leaves_no_temporary_file(failure, tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    assert cifar10.main(TINY_CIFAR + ["--steps", "1", "--save", path]) == 0
    before = load(path)
    real_save = torch.save

    def save_then_fail(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # the whole temporary file is written, not renamed
        raise failure

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(type(failure)):
        cifar10.main(TINY_CIFAR + ["--steps", "2", "--resume", path, "--save", path])
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert load(path)["step"] == before["step"] == 1  # the previous checkpoint, intact


def test_sigterm_during_save_removes_the_temporary_file_and_still_terminates(tmp_path):
    # torchrun and batch schedulers stop a job with SIGTERM: the save's cleanup runs, then the
    # process dies of the signal as it would have.
    script = textwrap.dedent(f"""
        import os, signal, sys
        import torch
        sys.path.insert(0, {RECIPES!r})
        import _train
        real_save = torch.save
        def save_then_terminated(obj, f, *args, **kwargs):
            real_save(obj, f, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)
        _train.write_atomically({{"weights": torch.zeros(4)}}, {str(tmp_path / "ckpt.pt")!r})
        torch.save = save_then_terminated
        _train.write_atomically({{"weights": torch.ones(4)}}, {str(tmp_path / "ckpt.pt")!r})
        print("not reached")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr
    assert "not reached" not in result.stdout
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert torch.equal(load(tmp_path / "ckpt.pt")["weights"], torch.zeros(4))


# ---------------------------------------------------------------------- --resume


@pytest.fixture(scope="module")
def cifar_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("real") / "cifar.pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cifar10.main(TINY_CIFAR + ["--steps", "1", "--save", path]) == 0
    finally:
        torch.set_num_threads(threads)
    return path


def write_foreign(kind: str, real: str, path: str) -> None:
    with open(real, "rb") as f:
        data = f.read()
    if kind == "first-100-bytes":
        with open(path, "wb") as f:
            f.write(data[:100])
    elif kind == "cut-in-half":
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])
    elif kind == "random-bytes":
        with open(path, "wb") as f:
            f.write(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    elif kind == "empty":
        open(path, "wb").close()
    elif kind == "pickle":
        with open(path, "wb") as f:
            pickle.dump({"step": 3}, f)
    elif kind == "plain-dict":
        torch.save({"a": 1}, path)
    elif kind == "a-state-dict":
        torch.save(load(real)["model"], path)
    elif kind == "a-module":
        torch.save(torch.nn.Linear(2, 2), path)
    elif kind == "model-edited":
        state = load(real)
        state["model"].pop(next(iter(state["model"])))
        torch.save(state, path)
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["first-100-bytes", "cut-in-half", "random-bytes", "empty",
                                  "pickle", "plain-dict", "a-state-dict", "a-module",
                                  "model-edited"])
def test_damaged_or_foreign_resume_file_gives_one_line(kind, cifar_checkpoint, tmp_path,
                                                       capsys):
    path = str(tmp_path / "resume.pt")
    write_foreign(kind, cifar_checkpoint, path)
    with pytest.raises(SystemExit) as raised:
        cifar10.main(TINY_CIFAR + ["--steps", "1", "--resume", path])
    message = str(raised.value)
    assert message.startswith(f"--resume {path}: ") and "\n" not in message, message
    assert "expected a checkpoint" in message
    assert "weights_only" not in message  # torch's advice to load untrusted pickles
    assert "train loss" not in capsys.readouterr().out


@needs_transformers
def test_resume_of_the_other_recipes_checkpoint_names_both(cifar_checkpoint, capsys):
    with pytest.raises(SystemExit) as raised:
        bert.main(TINY_BERT + ["--steps", "1", "--resume", cifar_checkpoint])
    message = str(raised.value)
    assert message == (f"--resume {cifar_checkpoint}: a checkpoint of recipes/cifar10.py, not "
                       "of recipes/bert.py; expected a checkpoint written by recipes/bert.py "
                       "--save")
    assert "planned its learning-rate schedule" not in capsys.readouterr().out


# ---------------------------------------------------------------------- --shard-optimizer


@pytest.mark.parametrize("extra, says", [
    (["--mode", "eager"], "--shard-optimizer shards nt.Step's fused optimizer (--mode step)"),
    (["--no-capture"], "--shard-optimizer needs the captured step")])
def test_shard_optimizer_needs_the_captured_step(extra, says, capsys):
    with pytest.raises(SystemExit):
        cifar10.main(TINY_CIFAR + ["--steps", "1", "--shard-optimizer", *extra])
    assert says in capsys.readouterr().err


def test_shard_optimizer_under_torchrun_on_the_cpu_is_refused_before_joining(monkeypatch,
                                                                            capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the job is never joined: nothing listens
    assert cifar10.main(TINY_CIFAR + ["--steps", "1", "--shard-optimizer"]) == 2
    assert "--shard-optimizer shards the state over GPUs" in capsys.readouterr().err


def test_shard_optimizer_in_one_process_trains_on_and_says_there_is_nothing_to_shard(
        tmp_path, monkeypatch, capsys):
    # Every checkpoint gathers a sharded state first, on every rank, before rank 0 saves.
    import nimble_train as nt
    order = []
    consolidate = nt.Step.consolidate_optimizer_state
    monkeypatch.setattr(nt.Step, "consolidate_optimizer_state",
                        lambda self: order.append("consolidate") or consolidate(self))
    save = _train.write_atomically
    monkeypatch.setattr(_train, "write_atomically",
                        lambda state, path: order.append("save") or save(state, path))
    path = str(tmp_path / "ckpt.pt")
    assert cifar10.main(TINY_CIFAR + ["--steps", "2", "--shard-optimizer", "--save", path]) == 0
    out = capsys.readouterr().out
    assert "--shard-optimizer: one process keeps the whole optimizer state" in out
    assert "state sharded over" not in out
    assert order == ["consolidate", "save"]
    plain = str(tmp_path / "plain.pt")
    assert cifar10.main(TINY_CIFAR + ["--steps", "2", "--save", plain]) == 0
    assert_same_training_state(load(path), load(plain))  # one process: nothing changes
