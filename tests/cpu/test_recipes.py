"""The recipes and the benchmark's plumbing on the CPU: real-format CIFAR-10 loading, a few
training steps of each recipe, checkpoint save/resume, evaluation through step.evaluator against
the eager evaluation, BERT fine-tuning on shape buckets against an unpadded eager loop, and the
benchmark's table/JSON/chart."""

import json
import math
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import nimble_train as nt
from nimble_train.bench import (MODES, add_ratios, busy_fraction, busy_time, format_table, plot,
                                write_json)
from nimble_train.bench import workloads

from recipe_reference import (RECIPES, TINY_BERT, TINY_CIFAR, TINY_FINETUNE,  # noqa: F401
                              bert, cifar10, eager_cifar, eager_cifar_accuracy,
                              eager_classification_accuracy, eager_finetune, eager_masked_accuracy,
                              finetune_data, needs_transformers, one_thread, tiny_cifar)


# ---------------------------------------------------------------------- CIFAR-10 files


def write_cifar_batch(path, images, labels):
    """One batch file as the python CIFAR-10 has it: a dict with bytes keys, (N, 3072) uint8."""
    entry = {b"batch_label": b"testing batch", b"labels": [int(v) for v in labels],
             b"data": images.reshape(len(images), 3072), b"filenames": [b"x.png"] * len(images)}
    with open(path, "wb") as f:
        pickle.dump(entry, f, protocol=2)


@pytest.fixture
def cifar_dir(tmp_path):
    """A cifar-10-batches-py/ with 5 training batches of 8 images and a test batch of 6."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    written = {}
    for name in cifar10.TRAIN_FILES + [cifar10.TEST_FILE]:
        n = 6 if name == cifar10.TEST_FILE else 8
        images = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n)
        write_cifar_batch(folder / name, images, labels)
        written[name] = (images, labels)
    return tmp_path, written


def test_batch_file_layout_is_channel_planes_of_rows(cifar_dir):
    root, written = cifar_dir
    images, labels = cifar10.read_batch_file(root / "cifar-10-batches-py" / "data_batch_3")
    data, expected = written["data_batch_3"]
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and labels.tolist() == list(expected)
    # Row n holds 1024 red, 1024 green, 1024 blue values, each plane row-major.
    for n, c, r, col in [(0, 0, 0, 0), (1, 1, 5, 7), (7, 2, 31, 31), (3, 2, 0, 31)]:
        assert images[n, c, r, col].item() == data[n, c * 1024 + r * 32 + col]


def test_loader_finds_the_folder_and_concatenates_the_training_batches(cifar_dir):
    root, written = cifar_dir
    folder = cifar10.find_cifar10(str(root))
    assert folder == root / "cifar-10-batches-py"
    assert cifar10.find_cifar10(str(folder)) == folder
    assert cifar10.find_cifar10(str(root / "nowhere")) is None
    data = cifar10.load_cifar10(folder)
    x, y = data["train"]
    assert x.shape == (40, 3, 32, 32) and y.shape == (40,)
    second = torch.from_numpy(written["data_batch_2"][0]).view(8, 3, 32, 32)
    assert torch.equal(x[8:16], second)
    assert data["test"][0].shape == (6, 3, 32, 32)


def test_malformed_batch_file_says_what_was_expected(tmp_path):
    path = tmp_path / "data_batch_1"
    with open(path, "wb") as f:
        pickle.dump({b"pixels": np.zeros((2, 3072), np.uint8)}, f)
    with pytest.raises(ValueError, match="b'data' and b'labels'"):
        cifar10.read_batch_file(path)
    write_cifar_batch(path, np.zeros((2, 3072), np.uint8), [1, 2])
    with open(path, "rb") as f:
        entry = pickle.load(f, encoding="bytes")
    entry[b"data"] = np.zeros((2, 1000), np.uint8)
    with open(path, "wb") as f:
        pickle.dump(entry, f)
    with pytest.raises(ValueError, match=r"\(N, 3072\) uint8"):
        cifar10.read_batch_file(path)


@pytest.mark.parametrize("damage", ["first-100-bytes", "random-bytes", "a-list", "wrong-shape"])
def test_damaged_data_file_gives_one_line_naming_it(damage, cifar_dir, capsys):
    root, written = cifar_dir
    path = root / "cifar-10-batches-py" / "data_batch_2"
    if damage == "first-100-bytes":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "random-bytes":
        path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, np.uint8).tobytes())
    elif damage == "a-list":
        path.write_bytes(pickle.dumps([1, 2, 3]))
    else:
        path.write_bytes(pickle.dumps({b"data": written["data_batch_2"][0][:, :1000],
                                       b"labels": [1] * 8}))
    with pytest.raises(SystemExit) as raised:
        cifar10.main(TINY_CIFAR + ["--data", str(root), "--steps", "1"])
    message = str(raised.value)
    assert message.startswith(f"--data {root}: {path}: ") and "\n" not in message, message
    assert "CIFAR-10" in message  # what was expected
    assert "train loss" not in capsys.readouterr().out


def test_epoch_augmentation_is_a_crop_and_flip_of_each_image():
    x = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    y = torch.arange(6)
    data = {"train": (x, y), "test": (x[:2], y[:2])}
    dataset = cifar10.GpuCifar.build(data, torch.device("cpu"))
    images, labels = dataset.epoch(seed=3)
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.float32
    assert sorted(labels.tolist()) == list(range(6))  # a permutation of the epoch
    mean = torch.tensor(cifar10.MEAN).view(3, 1, 1)
    std = torch.tensor(cifar10.STD).view(3, 1, 1)
    padded = torch.nn.functional.pad(x.float() / 255, (4, 4, 4, 4))
    for i, label in enumerate(labels.tolist()):
        pixels = images[i] * std + mean  # back to [0, 1]
        # Some crop offset (dy, dx) in [0, 8]², flipped or not, reproduces the image.
        found = any(
            torch.allclose(pixels, crop.flip(2) if flip else crop, atol=1e-5)
            for dy in range(9) for dx in range(9) for flip in (False, True)
            for crop in [padded[label, :, dy:dy + 32, dx:dx + 32]])
        assert found, f"image {i} is no crop/flip of training image {label}"


# ---------------------------------------------------------------------- CIFAR-10 runs


def summary_of(out: str) -> dict:
    line = next(t for t in out.splitlines() if t.startswith("summary: "))
    return dict(field.split("=", 1) for field in line.split()[2:])


def test_cifar_recipe_trains_on_real_format_files(cifar_dir, capsys):
    root, _ = cifar_dir
    assert cifar10.main(TINY_CIFAR + ["--data", str(root), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "CIFAR-10 from" in out and "SYNTHETIC" not in out
    s = summary_of(out)
    assert s["mode"] == "step" and s["model"] == "branchy" and s["data"] == "real"
    assert s["steps"] == "3" and math.isfinite(float(s["train_loss"]))
    assert 0 <= float(s["test_accuracy"]) <= 1


@pytest.mark.parametrize("mode", ["eager", "step"])
def test_cifar_recipe_says_when_data_is_synthetic(mode, capsys, tmp_path):
    assert cifar10.main(TINY_CIFAR + ["--mode", mode, "--steps", "2",
                                      "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no CIFAR-10 in" in out and "SYNTHETIC data" in out
    assert summary_of(out)["data"] == "synthetic"


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("stop", [5, 3], ids=["at-epoch-end", "mid-epoch"])
def test_cifar_resume_equals_an_uninterrupted_run(stop, tmp_path, capsys):
    # 40 images, batch 8: 5 steps per epoch. Stopping after `stop` steps and resuming must give
    # the two-epoch run bit for bit (CPU, same data order, same schedule).
    common = TINY_CIFAR + ["--epochs", "2"]
    straight, split = str(tmp_path / "straight.pt"), str(tmp_path / "split.pt")
    assert cifar10.main(common + ["--save", straight]) == 0
    assert cifar10.main(common + ["--steps", str(stop), "--save", split]) == 0
    first = load(split)
    assert (first["epoch"], first["step"]) == (stop // 5, stop)
    assert cifar10.main(common + ["--resume", split, "--save", split]) == 0
    out = capsys.readouterr().out
    assert f"resumed {split} at step {stop}" in out
    a, b = load(straight), load(split)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (2, 10)
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0, msg=key)
    for p, state in a["optimizer"]["state"].items():
        torch.testing.assert_close(state["momentum_buffer"],
                                   b["optimizer"]["state"][p]["momentum_buffer"], rtol=0, atol=0)
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 10


@pytest.mark.parametrize("mode", ["step", "eager"])
@pytest.mark.parametrize("model", ["branchy", "airbench"])
def test_cifar_recipe_equals_an_eager_loop(model, mode, tmp_path, capsys):
    # One epoch of 5 steps (40 images, batch 8) against recipe_reference.eager_cifar, each
    # model with its own optimizer and loss (airbench: momentum 0.85, label smoothing 0.2). The
    # loop takes the batch-mean cross entropy where the recipe averages per-sample losses: the
    # float32 sums run in another order, so weights, BatchNorm statistics and momentum agree
    # to float32 tolerances, not bit for bit.
    path = str(tmp_path / "c.pt")
    argv = tiny_cifar(model) + ["--mode", mode, "--epochs", "1", "--lr", "0.05",
                                "--eval-samples", "0", "--log-every", "1"]
    assert cifar10.main(argv + ["--save", path]) == 0
    out = capsys.readouterr().out
    reference, optimizer, losses = eager_cifar(argv)
    assert len(losses) == 5 and summary_of(out)["model"] == model
    state = load(path)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state["model"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    for p, value in optimizer.state_dict()["state"].items():
        torch.testing.assert_close(state["optimizer"]["state"][p]["momentum_buffer"],
                                   value["momentum_buffer"], rtol=1e-4, atol=1e-5)
    assert logged_losses(out) == pytest.approx(losses, abs=2e-4)  # printed to 4 decimals


def test_cifar_recipe_takes_each_models_batch_and_width(capsys):
    assert cifar10.parse_args(["--model", "airbench"]).batch == 1024  # airbench94's batch
    assert cifar10.parse_args([]).batch == cifar10.parse_args(["--model", "branchy"]).batch == 256
    assert cifar10.parse_args(["--model", "airbench", "--batch", "8"]).batch == 8
    with pytest.raises(SystemExit):
        cifar10.parse_args(["--model", "airbench", "--width", "0.5"])
    assert "--width scales the branchy network; airbench has a fixed width" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("recipe", ["cifar10", pytest.param("bert", marks=needs_transformers)])
def test_eval_samples_zero_skips_the_evaluation_and_says_so(recipe, capsys):
    # No accuracy is measured, so none is printed (not a 0.0000 from no samples).
    main, tiny = (cifar10.main, TINY_CIFAR) if recipe == "cifar10" else (bert.main, TINY_BERT)
    assert main(tiny + ["--steps", "2", "--eval-samples", "0"]) == 0
    out = capsys.readouterr().out
    assert "test accuracy skipped (--eval-samples 0)" in out
    assert summary_of(out)["test_accuracy"] == "skipped"
    with pytest.raises(SystemExit):
        main(tiny + ["--steps", "2", "--eval-samples", "-1"])
    assert "--eval-samples must be >= 0 (0 skips the evaluation); got -1" in capsys.readouterr().err


def test_resume_refuses_a_checkpoint_of_other_options(tmp_path, capsys):
    path = str(tmp_path / "c.pt")
    assert cifar10.main(TINY_CIFAR + ["--steps", "1", "--save", path]) == 0
    with pytest.raises(SystemExit, match="batch=8 but this run asks for batch=4"):
        cifar10.main([a if a != "8" else "4" for a in TINY_CIFAR] + ["--resume", path])


def test_schedule_warms_up_then_decays_and_never_goes_negative():
    from _train import warmup_then_decay
    for decay in ("linear", "cosine"):
        f = warmup_then_decay(1000, 100, decay)
        assert f(0) == pytest.approx(0.01) and f(99) == pytest.approx(1.0)
        assert f(550) == pytest.approx(0.5)
        assert f(1000) == pytest.approx(0.0) and f(5000) == pytest.approx(0.0)
        assert all(f(s) >= f(s + 1) for s in range(99, 1200))


def test_compile_inside_step_needs_step_mode(capsys):
    with pytest.raises(SystemExit):
        cifar10.main(TINY_CIFAR + ["--steps", "1", "--mode", "eager", "--compile"])
    assert "--compile compiles the model inside nt.Step (--mode step)" in capsys.readouterr().err


def test_torchrun_needs_step_mode(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cifar10.main(TINY_CIFAR + ["--steps", "1", "--mode", "eager"]) != 0
    assert bert.main(TINY_BERT + ["--steps", "1", "--mode", "compile"]) != 0
    err = capsys.readouterr().err
    assert err.count("the recipes train data-parallel with nt.Step (--mode step)") == 2


def test_cifar10_recipe_under_torchrun_trains_data_parallel_on_the_cpu(tmp_path):
    # Two processes, gloo: each rank trains on its share of every global batch, rank 0 alone
    # prints and saves; both end with identical weights and the job exits by itself.
    recipe = os.path.join(RECIPES, "cifar10.py")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         recipe, *TINY_CIFAR, "--steps", "6", "--save", str(tmp_path / "ckpt.pt")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("summary: cifar10 mode=step") == 1, result.stdout
    assert "gpus=2" in result.stdout and "per GPU x 2 GPUs" in result.stdout
    assert (tmp_path / "ckpt.pt").exists()


# ---------------------------------------------------------------------- BERT


@needs_transformers
def test_bert_recipe_steps_checkpoint_and_resume(tmp_path, capsys):
    path = str(tmp_path / "bert.pt")
    assert bert.main(TINY_BERT + ["--steps", "2", "--save", path]) == 0
    out = capsys.readouterr().out
    assert "SYNTHETIC masked-LM data" in out
    s = summary_of(out)
    assert s["model"] == "bert-tiny" and s["steps"] == "2" and math.isfinite(float(s["train_loss"]))
    assert bert.main(TINY_BERT + ["--epochs", "2", "--steps", "1", "--mode", "eager",
                                  "--resume", path, "--save", path]) == 0
    state = load(path)
    assert state["step"] == 3 and state["recipe"] == "bert"
    assert state["config"]["planned_steps"] == 4  # the first run's plan: 1 epoch of 4 steps


@needs_transformers
@pytest.mark.skipif(not bert.has_lamb(), reason="nimble_train.optim.LAMB is not in this build")
def test_bert_recipe_with_lamb(capsys):
    assert bert.main(TINY_BERT + ["--steps", "2", "--optimizer", "lamb"]) == 0
    assert "LAMB peak lr" in capsys.readouterr().out


def test_bert_without_transformers_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now raises ImportError
    assert bert.main(TINY_BERT + ["--steps", "1"]) == 2
    assert "pip install transformers" in capsys.readouterr().err


@needs_transformers
def test_synthetic_mlm_masks_about_15_percent_with_static_shapes():
    data = workloads.synthetic_mlm(64, 64, 1024, device="cpu", seed=1)
    ids, labels = data["input_ids"], data["labels"]
    assert ids.shape == labels.shape == (64, 64)
    masked = labels != -100
    assert 0.10 < masked[:, 1:-1].float().mean().item() < 0.20
    assert not masked[:, 0].any() and not masked[:, -1].any()
    assert (ids[:, 0] == workloads.CLS_ID).all() and (ids[:, -1] == workloads.SEP_ID).all()
    assert ((ids == workloads.MASK_ID) == masked).float().mean() > 0.95
    assert (labels[masked] >= workloads.FIRST_CONTENT_ID).all()


# ---------------------------------------------------------------------- evaluation


def printed_accuracy(out: str) -> str:
    return summary_of(out)["test_accuracy"]


def evaluated_through_the_step(out: str, mode: str) -> bool:
    """Whether the run says its evaluation went through step.evaluator (nt.Step's modes) or
    not (the plain loop's eager evaluation)."""
    return ("step.evaluator: " in out) == (mode == "step")


@pytest.mark.parametrize("mode", ["step", "eager"])
def test_cifar_accuracy_equals_the_eager_evaluation(mode, tmp_path, capsys):
    # 400 synthetic images: 80 test images, 64 evaluated. The reference is the evaluation the
    # recipe ran before step.evaluator, on the weights the run saved right after evaluating.
    path = str(tmp_path / "c.pt")
    argv = [a if a != "40" else "400" for a in TINY_CIFAR]
    assert cifar10.main(argv + ["--mode", mode, "--steps", "3", "--eval-samples", "64",
                                "--save", path]) == 0
    out = capsys.readouterr().out
    assert evaluated_through_the_step(out, mode), out
    model = workloads.cifar_model("branchy", "cpu", width=0.25)
    model.load_state_dict(load(path)["model"])
    data = cifar10.synthetic_cifar10(400, 80, device="cpu", seed=0)
    expected = eager_cifar_accuracy(model, cifar10.GpuCifar.build(data, torch.device("cpu")), 64)
    assert printed_accuracy(out) == f"{expected:.4f}"


@needs_transformers
@pytest.mark.parametrize("mode", ["step", "eager"])
def test_masked_lm_accuracy_equals_the_eager_evaluation(mode, tmp_path, capsys):
    path = str(tmp_path / "b.pt")
    assert bert.main(TINY_BERT + ["--mode", mode, "--steps", "3", "--eval-samples", "16",
                                  "--save", path]) == 0
    out = capsys.readouterr().out
    assert evaluated_through_the_step(out, mode), out
    model = workloads.bert_model("tiny", "cpu")
    model.load_state_dict(load(path)["model"])
    held_out = workloads.synthetic_mlm(16, 16, model.config.vocab_size, device="cpu",
                                       seed=10_000)
    # batch 2 < 16 samples: several evaluation batches summed on the device
    expected = eager_masked_accuracy(model, held_out, batch=2)
    assert printed_accuracy(out) == f"{expected:.4f}"


# ---------------------------------------------------------------------- BERT fine-tuning


def logged_losses(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"step \d+/\d+ .* loss ([0-9.]+) ", out)]


@needs_transformers
@pytest.mark.parametrize("mode", ["step", "eager"])
def test_bert_finetune_equals_an_unpadded_eager_loop(mode, tmp_path, capsys):
    # Two epochs of 6 steps, dropout off. nt.Step pads each batch (already padded to its
    # longest sequence) on to its bucket; the reference runs every sequence alone, unpadded and
    # unmasked. Masked padding changes nothing but the order of float32 sums: the weights stay
    # within 1e-6 of each other here.
    path = str(tmp_path / "ft.pt")
    argv = TINY_FINETUNE + ["--mode", mode, "--epochs", "2", "--dropout", "0"]
    assert bert.main(argv + ["--save", path]) == 0
    out = capsys.readouterr().out
    reference, held_out, losses = eager_finetune(argv)

    trained = load(path)["model"]
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=1e-4, atol=1e-5, msg=key)
    # --log-every 2: each logged loss is the mean of two steps, printed to 4 decimals
    pairs = [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2])]
    assert logged_losses(out) == pytest.approx(pairs, abs=2e-4)
    # The accuracy through the evaluation step equals sequence-by-sequence eager evaluation of
    # the saved weights.
    model = bert.classifier_model("tiny", "cpu", 0.0)
    model.load_state_dict(trained)
    assert printed_accuracy(out) == f"{eager_classification_accuracy(model, held_out):.4f}"

    assert re.search(r"lengths median \d+, p90 \d+, max \d+ tokens", out), out
    s = summary_of(out)
    assert s["task"] == "finetune" and s["steps"] == "12"
    assert float(s["real_tokens_per_s"]) > 0 and float(s["samples_per_s"]) > 0
    if mode == "step":
        assert evaluated_through_the_step(out, mode), out
        # the batches reach every bucket, and most are padded further (not already at a size)
        line = next(t for t in out.splitlines() if t.startswith("nt.Step buckets: "))
        eager = [int(n) for n in re.findall(r"(\d+) eager", line)]
        assert len(eager) == 3 and all(n > 0 for n in eager), line
        args = bert.parse_args(argv)
        _, train, _ = finetune_data(args, torch.device("cpu"))
        epoch = train.take(bert.epoch_order(args.samples, args.seed, 0))
        lengths = [b["input_ids"].shape[1] for b in epoch.batches(args.batch)]
        assert sum(n not in args.buckets for n in lengths) >= 4, lengths


def test_finetune_lengths_and_tokens():
    data = bert.synthetic_classification(4000, 512, 64, 1024, device="cpu", seed=3)
    lengths = data.lengths
    assert lengths.min() >= bert.MIN_LEN and lengths.max() <= 512
    median, p90 = torch.quantile(lengths.double(), torch.tensor([0.5, 0.9],
                                                                dtype=torch.float64)).tolist()
    assert 58 <= median <= 70 and 135 <= p90 <= 180  # log-normal: 64 and 157
    assert (lengths < 128).float().mean() > 0.75 and lengths.max() > 300
    ids = data.input_ids
    for i in range(50):
        n = int(lengths[i])
        assert ids[i, 0] == workloads.CLS_ID and ids[i, n - 1] == workloads.SEP_ID
        assert (ids[i, n:] == workloads.PAD_ID).all() and (ids[i, 1:n - 1] >= 104).all()
        first = 1024 - bert.NUM_LABELS * bert.KEYWORDS + int(data.labels[i]) * bert.KEYWORDS
        content = ids[i, 1:n - 1]
        assert ((content >= first) & (content < first + bert.KEYWORDS)).any()  # its class's
        assert not ((content >= 1024 - bert.NUM_LABELS * bert.KEYWORDS)
                    & ((content < first) | (content >= first + bert.KEYWORDS))).any()
    # a batch is padded to its longest sequence, with the mask 0 exactly on the padding
    (batch,) = list(data.take(torch.tensor([5, 9, 2])).batches(3))
    assert batch["input_ids"].shape[1] == int(lengths[[5, 9, 2]].max())
    assert batch["attention_mask"].sum(1).tolist() == lengths[[5, 9, 2]].tolist()
    assert bert.step_tokens(lengths[:10], 4) == [int(lengths[:4].sum()), int(lengths[4:8].sum())]


@pytest.mark.parametrize("argv, message", [
    (["--seq", "32"], "--seq is for --task pretrain"),
    (["--buckets", "16,32"], "--buckets 16,32: the largest is shorter than --max-len 64"),
    (["--buckets", "16,x"], "must be comma-separated positive lengths"),
    (["--median-len", "100"], "--median-len must be in [8, --max-len 64]; got 100"),
])
def test_finetune_options_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        bert.main(TINY_FINETUNE + argv + ["--steps", "1"])
    assert message in capsys.readouterr().err


def test_finetune_options_are_refused_for_pretraining(capsys):
    with pytest.raises(SystemExit):
        bert.main(TINY_BERT + ["--steps", "1", "--max-len", "64", "--buckets", "64"])
    assert "--max-len, --buckets: for --task finetune" in capsys.readouterr().err


# ---------------------------------------------------------------------- benchmark plumbing


def fake_rows():
    rows = [
        {"model": "resnet18", "batch": 32, "mode": "eager", "label": "eager",
         "ms_per_step": 6.8, "samples_per_s": 4706.0, "first_step_s": 1.5, "gpu_busy": 0.25,
         "note": "", "error": None},
        {"model": "resnet18", "batch": 32, "mode": "compile-ro",
         "label": "torch.compile reduce-overhead", "ms_per_step": 2.96, "samples_per_s": 10811.0,
         "first_step_s": 40.2, "gpu_busy": float("nan"), "note": "", "error": None},
        {"model": "resnet18", "batch": 32, "mode": "compile", "label": "torch.compile",
         "ms_per_step": None, "samples_per_s": None, "first_step_s": None, "gpu_busy": None,
         "note": "", "error": "RuntimeError: no triton here"},
        {"model": "resnet18", "batch": 32, "mode": "step", "label": "nt.Step, 1 stream",
         "ms_per_step": 2.21, "samples_per_s": 14480.0, "first_step_s": 2.0, "gpu_busy": 0.93,
         "note": "1 stream(s), 412 graph nodes", "error": None},
    ]
    meta = {"model": "resnet18", "description": "ResNet-18, CIFAR", "gpu": "FakeGPU",
            "torch": "0.0", "steps": 50, "repeats": 5}
    return add_ratios(rows), meta


def test_ratios_and_table_of_fake_rows():
    rows, meta = fake_rows()
    step = rows[-1]
    assert step["vs_eager"] == pytest.approx(6.8 / 2.21)
    assert step["vs_reduce_overhead"] == pytest.approx(2.96 / 2.21)
    assert rows[2]["vs_eager"] is None
    table = format_table(rows, meta)
    assert "FakeGPU" in table and "torch.compile reduce-overhead" in table
    assert "failed: RuntimeError: no triton here" in table
    assert "3.08x" in table and "1.34x" in table and "93%" in table
    line = next(t for t in table.splitlines() if "torch.compile reduce-overhead" in t)
    assert line.split()[-3] == "-"  # NaN GPU-busy shows as "-"
    assert line.split()[-2:] == ["-", "-"]  # no GPU time measured, no ratio over it


def test_ratios_are_over_the_best_reduce_overhead_row_and_the_best_hand_written_graph():
    rows, meta = fake_rows()
    rows.append({"model": "resnet18", "batch": 32, "mode": "compile-ro-opt",
                 "label": "reduce-overhead + compiled optimizer", "ms_per_step": 2.60,
                 "error": None})
    rows.append({"model": "resnet18", "batch": 32, "mode": "graph",
                 "label": "hand-written whole-step graph", "ms_per_step": 2.40, "error": None})
    rows.append({"model": "resnet18", "batch": 32, "mode": "graph-fused",
                 "label": "hand-written graph, fused opt.", "ms_per_step": 2.35, "error": None})
    rows.append({"model": "resnet18", "batch": 64, "mode": "step", "label": "nt.Step, 1 stream",
                 "ms_per_step": 3.0, "error": None})
    add_ratios(rows)
    step = next(r for r in rows if r["mode"] == "step" and r["batch"] == 32)
    assert step["vs_reduce_overhead"] == pytest.approx(2.60 / 2.21)  # the faster r-o row
    assert step["vs_graph"] == pytest.approx(2.35 / 2.21)  # the faster graph row
    other = rows[-1]  # no references at batch 64
    assert other["vs_eager"] is None and other["vs_graph"] is None
    assert "vs graph" in format_table(rows, meta)


def test_the_gpu_ratio_is_over_the_reduce_overhead_rows_gpu_time():
    rows, meta = fake_rows()
    rows[1]["gpu_ms"] = 1.90  # compile-ro: 2.96 ms of wall time, host-bound
    rows.append({"model": "resnet18", "batch": 32, "mode": "compile-ro-opt",
                 "label": "reduce-overhead + compiled optimizer", "ms_per_step": 3.10,
                 "gpu_ms": 1.70, "error": None})
    rows[3]["gpu_ms"] = 2.10
    add_ratios(rows)
    step = rows[3]
    assert step["vs_reduce_overhead"] == pytest.approx(2.96 / 2.21)  # wall: the faster row
    assert step["vs_reduce_overhead_gpu"] == pytest.approx(1.70 / 2.21)  # GPU: the smaller
    table = format_table(rows, meta)
    line = next(t for t in table.splitlines() if "nt.Step" in t)
    assert "2.100" in line and "0.77x" in line
    fake_rows_gpu_free, _ = fake_rows()  # no GPU times measured: no ratio
    assert all(r["vs_reduce_overhead_gpu"] is None for r in fake_rows_gpu_free)


def test_json_is_strict_and_round_trips(tmp_path):
    rows, meta = fake_rows()
    path = write_json(str(tmp_path / "r.json"), rows, meta)
    with open(path) as f:
        text = f.read()
    assert "NaN" not in text
    data = json.loads(text)
    assert data["meta"]["gpu"] == "FakeGPU" and len(data["rows"]) == 4
    assert data["rows"][1]["gpu_busy"] is None and data["rows"][2]["error"].startswith("Runtime")


def test_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    rows, meta = fake_rows()
    rows += [dict(r, batch=128) for r in rows[:2]]
    path = plot(str(tmp_path / "r.png"), add_ratios(rows), meta)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_busy_fraction_is_the_union_of_intervals_over_the_span():
    assert busy_fraction([(0, 10)]) == 1.0
    assert busy_fraction([(0, 4), (6, 10)]) == pytest.approx(0.8)
    assert busy_fraction([(0, 6), (2, 4), (5, 10)]) == 1.0  # nested and overlapping
    assert busy_fraction([(8, 10), (0, 2), (1, 12)]) == 1.0  # unsorted; the last end wins
    assert busy_fraction([(0, 2), (0, 1), (4, 5)]) == pytest.approx(0.6)
    assert math.isnan(busy_fraction([]))


def test_busy_time_is_the_union_and_the_span():
    assert busy_time([(0, 4), (6, 10)]) == (8, 10)
    assert busy_time([(3, 9), (5, 7), (10, 13)]) == (9, 10)
    assert busy_time([(2, 2)]) == (0.0, 0.0)  # an empty interval counts for nothing


def test_overlap_finds_what_runs_alone_what_runs_together_and_the_idle_gaps():
    from nimble_train.bench import overlap
    # a: 0-10 alone 0-4; b: 4-8 beside a; c: 8-12 (touches b, beside a until 10); idle 12-15;
    # d: 15-20 alone; e: 20-21 right after d (touching: no overlap); idle 21-23; a again 23-25
    o = overlap([(0, 10, "a"), (4, 8, "b"), (8, 12, "c"), (15, 20, "d"), (20, 21, "e"),
                 (23, 25, "a"), (30, 30, "empty")])
    assert (o.span, o.busy, o.idle, o.kernel_sum) == (25, 20, 5, 26)
    assert o.alone == {"a": 6, "c": 2, "d": 5, "e": 1}
    assert o.gaps == {("c", "d"): 3, ("e", "a"): 2}
    assert o.total == {"a": 12, "b": 4, "c": 4, "d": 5, "e": 1}  # the empty one left out
    assert o.count == {"a": 2, "b": 1, "c": 1, "d": 1, "e": 1}
    assert o.concurrency == pytest.approx(26 / 20)  # 2 at once for 6 of the 20 busy units
    # the alone time and the time shared add up to the busy time, in any input order
    shuffled = overlap([(23, 25, "a"), (15, 20, "d"), (8, 12, "c"), (0, 10, "a"),
                        (20, 21, "e"), (4, 8, "b")])
    assert shuffled.alone == o.alone and shuffled.gaps == o.gaps
    empty = overlap([])
    assert (empty.span, empty.busy, empty.alone) == (0.0, 0.0, {})


def test_a_warmed_mode_is_called_past_its_first_fast_call_and_closed_after_the_block():
    from types import SimpleNamespace

    from nimble_train.bench.modes import Mode, warmed

    class Fn:
        def __init__(self):
            self.calls, self.closed = [], False

        def __call__(self, batch):
            self.calls.append(batch)

        def close(self):
            self.closed = True

    built = []
    mode = Mode("fake", "fake", lambda w: built.append(Fn()) or built[-1], lambda s: 3)
    w = SimpleNamespace(batches=["a", "b"])
    with warmed(mode, w, fast_calls=2) as step:
        assert step.calls == ["a", "b", "a", "b", "a"] and not step.closed
    assert step.closed
    with pytest.raises(RuntimeError, match="inside"):
        with warmed(mode, w, fast_calls=0):
            raise RuntimeError("inside the block")
    assert built[-1].closed  # closed when the block fails too


def test_bench_floor_reports_each_mode_beside_its_floor_and_refuses_without_a_gpu(capsys):
    bench = _bench_script("bench_floor")
    rows = [{"mode": "compile-ro", "label": "reduce-overhead", "ms": 2.5, "busy": 2.0,
             "kernels": 2.1},
            {"mode": "step-auto", "label": "Step auto", "ms": 1.8, "busy": 1.7, "kernels": 2.6,
             "sum": 2.2, "serial": 2.3, "path": 1.4, "products": 0.8, "gaps": 1.5, "nodes": 9,
             "work": 8, "path_nodes": 5, "top": [("void conv_kernel<1>", 0.25), ("relu", 0.1)],
             "stretch": [("void bn_backward<2>", 0.1, 0.2), ("wgrad", 0.5, 0.55)]}]
    text = bench.report(rows, [1.25], top=1)
    assert "| reduce-overhead | 2.500 | 2.000 | 2.100 | 2.100 | - | - | - | - |" in text
    assert ("| Step auto | 1.800 | 1.700 | 2.600 | 2.200 | 2.300 | 1.400 (0.800) | 1.500 | 1.20 |"
            in text)
    assert "   0.250  conv_kernel<1>" in text and "relu" not in text  # top 1, 'void ' dropped
    assert "   0.100 -> 0.200  bn_backward<2>" in text and "wgrad" not in text
    assert "step-auto 2.200 / 1.500" in text
    assert "over compile-ro (busy 2.000): 1.25x: 1.600" in text
    if not torch.cuda.is_available():
        assert bench.main(["--model", "resnet18", "--batch", "2"]) == 2
        assert "CUDA GPU" in capsys.readouterr().err


def test_bench_profile_names_kernels_briefly_and_refuses_without_a_gpu(capsys):
    bench = _bench_script("bench_profile")
    assert bench.short("void at::native::reduce_kernel<512, 1, Op<float, (int)2>>(Op<float>)") \
        == "at::native::reduce_kernel<512, 1, Op<float, (int)2>>"
    assert bench.short("void at::native::(anonymous namespace)::cat<int>(int)") \
        == "at::native::cat<int>"
    assert bench.short("Memset (Unknown)") == "Memset (Unknown)"
    assert bench.short("x" * 100, width=10) == "xxxxxxx..."
    from nimble_train.bench import overlap
    text = bench.report("nt.Step", overlap([(0, 10, "void k<1>(int)"), (5, 8, "j"),
                                            (12, 14, "k<1>(int)")]), steps=2, top=5)
    assert "span 7.0, busy 6.0, idle 1.0, kernels 7.5" in text
    assert "     4.5  k<1>" in text and "     1.0  k<1> -> k<1>" in text
    assert "kernel time by name" not in text
    text = bench.report("nt.Step", overlap([(0, 10, "void k<1>(int)"), (5, 8, "j"),
                                            (12, 14, "k<1>(int)")]), steps=2, top=5,
                        totals=True)
    assert "     6.0  (1)  k<1>" in text and "     1.5  (0.5)  j" in text
    if not torch.cuda.is_available():
        assert bench.main(["--model", "branchy", "--batch", "2"]) == 2
        assert "CUDA GPU" in capsys.readouterr().err


def test_bench_refuses_to_time_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; tests/gpu runs the benchmark")
    from nimble_train.bench import main
    assert main(["--model", "resnet18", "--modes", "eager"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def _bench_script(name: str):
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_memory():
    return _bench_script("bench_memory")


def test_bench_streams_refuses_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; bench/bench_streams.py measures there")
    assert _bench_script("bench_streams").main(["--workloads", "encoder:2"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_bench_batch_norm_switches_the_counters_only_while_it_builds(capsys, monkeypatch):
    from nimble_train import _batch_norm
    bench = _bench_script("bench_batch_norm")
    seen = []
    monkeypatch.setattr(bench, "build", lambda *args: seen.append(
        (args[2], _batch_norm.DEFER_COUNTERS)) or "built")
    assert [bench.build_with("resnet18", 2, streams, defer, torch.device("cpu"))
            for _, streams, defer in bench.WAYS] == ["built"] * 4
    assert seen == [(1, False), (1, True), ("auto", False), ("auto", True)]
    assert _batch_norm.DEFER_COUNTERS is True
    if not torch.cuda.is_available():
        assert bench.main([]) == 2
        assert "CUDA GPU" in capsys.readouterr().err


def test_bench_small_conv_builds_each_way_with_its_kernels_and_prints_the_gains(capsys,
                                                                               monkeypatch):
    bench = _bench_script("bench_small_conv")
    seen = []
    monkeypatch.setattr(bench, "build", lambda name, batch, streams, device, switches: seen.append(
        (streams, switches)) or "built")
    assert [bench.build_with("resnet18", 2, streams, small, torch.device("cpu"))
            for _, streams, small in bench.WAYS] == ["built"] * 4
    assert seen == [(1, {"SMALL_CONV_KERNELS": "torch"}), (1, {"SMALL_CONV_KERNELS": "ours"}),
                    ("auto", {"SMALL_CONV_KERNELS": "torch"}),
                    ("auto", {"SMALL_CONV_KERNELS": "ours"})]
    row = {"workload": "resnet18 b32", "layers": 1, **dict(zip(
        (way for way, _, _ in bench.WAYS), (2.2, 2.0, 1.6, 1.5)))}
    _bench_script("bench_streams").print_switch_table([row], bench.WAYS, "layers")
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| network | layers | 1 stream, cuDNN | 1 stream, ours |")
    assert table[2] == ("| resnet18 b32 | 1 | 2.200 | 2.000 | 1.600 | 1.500 | 1.100x "
                        "| 1.067x |")
    if not torch.cuda.is_available():
        assert bench.main([]) == 2
        assert "CUDA GPU" in capsys.readouterr().err


def test_bench_max_pool_finds_each_distinct_max_pool_and_refuses_without_a_gpu(capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    try:
        bench = _bench_script("bench_max_pool")
    finally:
        sys.path.pop(0)
    shapes = bench.pool_shapes("branchy", 2, torch.device("cpu"))
    # 8 cells' pool branches and 2 pools between stages; cells 4-6 share one shape
    assert [(s, k, st) for s, k, st, _, _ in shapes] == [
        ((2, 64, 32, 32), 3, 1), ((2, 128, 32, 32), 3, 1), ((2, 128, 32, 32), 3, 2),
        ((2, 128, 16, 16), 3, 1), ((2, 256, 16, 16), 3, 1), ((2, 256, 16, 16), 3, 2),
        ((2, 256, 8, 8), 3, 1), ((2, 512, 8, 8), 3, 1)]
    if not torch.cuda.is_available():
        assert bench.main([]) == 2
        assert "CUDA GPU" in capsys.readouterr().err


def test_bench_streams_encoder_is_bert_shaped_and_its_forward_plans_three_streams():
    from nimble_train._multistream import plan_forward, trace_operators
    bench = _bench_script("bench_streams")
    torch.manual_seed(0)
    model, optimizer, loss_fn, batches, amp = bench.encoder(2, torch.device("cpu"), seq=16,
                                                            vocab=50)
    assert amp == "bf16" and isinstance(optimizer, torch.optim.AdamW)
    assert len(model.layers) == 12 and model.layers[0].query.in_features == 768
    ids, labels = batches[0]
    loss = loss_fn(model(ids), labels)
    assert loss.dim() == 0 and abs(loss.item() - math.log(50)) < 0.5  # near-uniform at init
    # the query, key and value projections side by side: what the forward's plan gains from
    plan = plan_forward(trace_operators(model), 0)
    assert plan.num_streams == 3 and plan.num_syncs > 0


def test_bench_dist_takes_lamb_for_bert_alone_and_says_why_the_ddp_rows_are_missing(capsys):
    bench = _bench_script("bench_dist")
    with pytest.raises(SystemExit):
        bench.main(["--model", "resnet18", "--optimizer", "lamb"])
    assert "resnet18 trains with its recipe's SGD" in capsys.readouterr().err
    meta = {"model": "bert", "batch": 32, "repeats": 5, "steps": 50, "gpu": "G", "torch": "t",
            "optimizer": "lamb"}
    rows = [{"label": "nt.Step", "gpus": 2, "batch": 32, "ms_per_step": 20.0,
             "samples_per_s": 3200.0, "scaling": 0.95}]
    table = bench.format_table(rows, meta)
    assert "LAMB (no DDP rows: torch has no fused LAMB)" in table.splitlines()[0]
    assert "LAMB" not in bench.format_table(rows, {**meta, "optimizer": None})


def test_bench_memory_refuses_to_measure_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; bench/bench_memory.py measures there")
    assert _bench_memory().main(["--workloads", "resnet18"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_bench_memory_table_divides_each_peak_by_its_workloads_anchors(capsys):
    mib = 2 ** 20
    rows = [{"workload": "w b8", "mode": "eager", "peak": 200 * mib},
            {"workload": "w b8", "mode": "compiled", "peak": 160 * mib},
            {"workload": "w b8", "mode": "step-auto", "peak": 240 * mib, "pool": 150 * mib,
             "weight_grads": 3},
            {"workload": "v b8", "mode": "step-1", "peak": 100 * mib, "pool": 90 * mib,
             "weight_grads": 0},
            {"workload": "v b8", "mode": "step-auto", "error": "Traceback\nValueError: no"}]
    _bench_memory()._table(rows)
    lines = {tuple(line.split()[:3]): line.split()[3:]
             for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines[("w", "b8", "eager")] == ["200", "1.00x", "1.25x", "-", "-"]
    assert lines[("w", "b8", "step-auto")] == ["240", "1.20x", "1.50x", "150", "3"]
    assert lines[("v", "b8", "step-1")] == ["100", "-", "-", "90", "0"]  # no anchors: no ratio
    assert lines[("v", "b8", "step-auto")] == ["failed:", "ValueError:", "no"]


@pytest.mark.parametrize("mode", ["eager", "eager-fused", "step"])
@pytest.mark.parametrize("model", ["branchy", "airbench"])
def test_bench_modes_train_on_the_cpu(model, mode):
    # The modes that need no GPU build and step on the CPU: same workload, falling loss.
    w = workloads.make_workload(model, 4, "cpu", count=1)
    if model == "branchy":
        w.make_model = lambda: workloads.cifar_model("branchy", "cpu", width=0.25)
    step = MODES[mode].build(w)
    losses = [float(step(w.batches[0])) for _ in range(6)]
    assert losses[-1] < losses[0]


def test_airbench_workload_is_sgd_nesterov_with_label_smoothing():
    w = workloads.make_workload("airbench", 4, "cpu", count=2)
    assert w.description == "airbench94 net, CIFAR 32×32, SGD Nesterov, label smoothing 0.2"
    assert len(w.batches) == 2 and w.batches[0][0].shape == (4, 3, 32, 32) and w.amp is None
    model = w.make_model()
    assert isinstance(model, type(nt.models.airbench_cifar()))
    (group,) = w.make_optimizer(model).param_groups
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (
        0.2, 0.85, True, 5e-4)
    assert len(group["params"]) == len(list(model.parameters()))
    logits, labels = torch.randn(4, 10), torch.tensor([0, 3, 9, 3])
    losses = w.loss_fn(logits, labels)  # per sample, smoothed
    assert losses.shape == (4,)
    torch.testing.assert_close(
        losses, torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.2,
                                                  reduction="none"))
    # the other CIFAR workloads keep plain cross entropy and momentum 0.9
    (group,) = workloads.make_workload("resnet18", 4, "cpu", count=1).make_optimizer(
        nt.models.branchy_cifar(width=0.25)).param_groups
    assert (group["lr"], group["momentum"]) == (0.05, 0.9)
    assert workloads.make_workload("branchy", 4, "cpu", count=1).loss_fn.label_smoothing == 0


def test_cifar_workloads_take_bf16_autocast_and_refuse_fp16():
    w = workloads.make_workload("airbench", 4, "cpu", count=1, amp="bf16")
    assert w.amp == "bf16" and w.description.endswith(", bf16 autocast")
    with pytest.raises(ValueError, match="amp must be None or 'bf16'.*got 'fp16'"):
        workloads.make_workload("resnet18", 4, "cpu", count=1, amp="fp16")


@needs_transformers
def test_bert_workload_trains_with_the_optimizer_it_is_given():
    # BERT's decay groups with either optimizer; LAMB's plain step cannot be fused by torch
    # or captured by hand, which the anchors would otherwise ask of it silently.
    lamb = workloads.make_workload("bert", 2, "cpu", seq=16, bert_size="tiny", count=1,
                                   optimizer="lamb")
    adamw = workloads.make_workload("bert", 2, "cpu", seq=16, bert_size="tiny", count=1)
    assert lamb.description.endswith(", bf16, LAMB") and adamw.description.endswith(", AdamW")
    model = lamb.make_model()
    opt = lamb.make_optimizer(model)
    assert isinstance(opt, nt.optim.LAMB)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert isinstance(adamw.make_optimizer(model), torch.optim.AdamW)
    for option in ({"fused": True}, {"capturable": True}):
        with pytest.raises(ValueError, match="nt.Step runs it as fused kernels"):
            lamb.make_optimizer(model, **option)


def test_only_bert_workloads_take_an_optimizer():
    with pytest.raises(ValueError, match="resnet18 trains with its recipe's SGD"):
        workloads.make_workload("resnet18", 4, "cpu", count=1, optimizer="lamb")
    with pytest.raises(ValueError, match='optimizer must be None, "adamw" or "lamb"; got .sgd.'):
        workloads.make_workload("bert", 4, "cpu", count=1, optimizer="sgd")


def test_the_benchmarks_workload_options_build_the_workload_they_name():
    import argparse
    one = argparse.ArgumentParser()
    workloads.add_workload_arguments(one, model="branchy")
    args = one.parse_args(["--batch", "4", "--amp", "bf16"])
    w = workloads.workload_from(args, "cpu")
    assert (w.name, w.batch, w.amp) == ("branchy", 4, "bf16")
    args = one.parse_args(["--model", "bert", "--bert-size", "tiny", "--seq", "16",
                           "--batch", "2"])
    assert workloads.workload_from(args, "cpu").batches[0]["input_ids"].shape == (2, 16)
    several = argparse.ArgumentParser()
    workloads.add_workload_arguments(several, several_batches=True)
    args = several.parse_args(["--batch", "2", "8"])
    assert args.model == "resnet18" and args.batch == [2, 8]
    assert workloads.workload_from(args, "cpu", batch=8).batch == 8


def test_models_are_exported_with_the_advertised_sizes():
    branchy = nt.models.branchy_cifar()
    assert sum(p.numel() for p in branchy.parameters()) == 1_663_210
    assert branchy(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    cells = [m for m in branchy.modules() if type(m).__name__ == "BranchyCell"]
    assert len(cells) == 8


def test_bench_adversarial_attacks_within_eps_and_prints_the_gains(capsys):
    bench = _bench_script("bench_adversarial")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    images, labels = torch.randn(4, 3, 2, 2), torch.tensor([0, 2, 1, 0])
    fgsm = bench.Adversarial(net, torch.nn.functional.cross_entropy, 1, eps=0.1)
    x = images.clone().requires_grad_()
    torch.nn.functional.cross_entropy(net(x), labels).backward()
    want = torch.nn.functional.cross_entropy(net(images + 0.1 * x.grad.sign()), labels)
    torch.testing.assert_close(fgsm(images, labels), want)
    net.zero_grad()
    fgsm(images, labels).backward()  # the attack's gradients reach no parameter's .grad
    want_grads = torch.autograd.grad(want, list(net.parameters()))
    for p, g in zip(net.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g)
    seen = []
    net.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    bench.Adversarial(net, torch.nn.functional.cross_entropy, 3, eps=0.1)(images, labels)
    assert len(seen) == 4  # three attack steps, then the examples trained on
    assert torch.equal(seen[0], images)
    for x in seen[1:]:
        assert 0 < (x - images).abs().max() <= 0.1 + 1e-6
    row = {"workload": "resnet18 b32", "attack": "PGD-3",
           **dict(zip(bench.WAYS, (20.0, 8.0, 6.0, 7.2)))}
    bench.print_table([row])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| workload | attack | eager | step | step-auto |")
    assert table[2] == ("| resnet18 b32 | PGD-3 | 20.000 | 8.000 | 6.000 | 7.200 | **3.33x** "
                        "| **1.200x** |")
    if not torch.cuda.is_available():
        assert bench.main([]) == 2
        assert "CUDA GPU" in capsys.readouterr().err


def test_bench_captured_calls_a_step_through_its_capture_under_switches_set_back_after():
    from types import SimpleNamespace

    from nimble_train.bench.timing import captured

    switches = SimpleNamespace(A=1, B="x")

    class FakeStep:  # warm-up 2 calls, then the capture, then replays; records the switches
        def __init__(self, captures=True, fails_at=None):
            self.calls, self.captures, self.fails_at = [], captures, fails_at

        def stats(self):
            return {"warmup_left": max(0, 2 - len(self.calls)),
                    "captured": self.captures and len(self.calls) > 2,
                    "capture_error": None if self.captures else "a host sync"}

        def __call__(self, batch):
            if len(self.calls) == self.fails_at:
                raise RuntimeError("the step failed")
            self.calls.append((batch, switches.A, switches.B))

    step = FakeStep()
    assert captured(step, ["b0", "b1", "b2"], "way", [(switches, "A", 2), (switches, "B", "y")]
                    ) is step
    assert step.calls == [("b0", 2, "y"), ("b1", 2, "y"), ("b2", 2, "y"), ("b0", 2, "y")]
    assert (switches.A, switches.B) == (1, "x")
    with pytest.raises(RuntimeError, match="the step failed"):
        captured(FakeStep(fails_at=1), ["b"], "way", [(switches, "A", 3)])
    assert switches.A == 1
    with pytest.raises(RuntimeError, match="auto: the step was not captured: a host sync"):
        captured(FakeStep(captures=False), ["b"], "auto")
