"""The recipes and the benchmark on the GPU: captured steps of each recipe (tiny configs) that
learn a learnable synthetic task, BERT fine-tuning captured on shape buckets against an unpadded
eager loop, checkpoint resume into a captured step, and every benchmark mode running (timings
are printed by the benchmark, never asserted here)."""

import dataclasses
import json
import os
import re

import pytest
import torch

from recipe_reference import (bert, cifar10, eager_classification_accuracy, eager_finetune,
                              finetune_data, needs_transformers)

import _train  # recipes/, on the path through recipe_reference

pytestmark = pytest.mark.cuda

# 3200 synthetic images, batch 64: 50 steps per epoch.
CIFAR = ["--device", "cuda", "--batch", "64", "--synthetic-size", "3200", "--log-every", "10",
         "--eval-samples", "640"]
BERT = ["--size", "tiny", "--device", "cuda", "--batch", "16", "--seq", "64", "--samples", "2048",
        "--eval-samples", "64", "--log-every", "8", "--lr", "2e-3"]


def logged_losses(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"step \d+/\d+ .* loss ([0-9.]+) ", out)]


def summary_of(out: str) -> dict:
    line = next(t for t in out.splitlines() if t.startswith("summary: "))
    return dict(field.split("=", 1) for field in line.split()[2:])


@pytest.mark.parametrize("model, streams", [("resnet18", "1"), ("branchy", "auto")])
def test_cifar_recipe_captures_and_learns(model, streams, capsys):
    assert cifar10.main(CIFAR + ["--model", model, "--streams", streams, "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "nt.Step: captured" in out, out
    losses = logged_losses(out)
    assert len(losses) == 10, out
    assert losses[-1] < 0.6 * losses[0], f"the loss did not fall: {losses}"
    s = summary_of(out)
    assert s["mode"] == "step" and s["steps"] == "100" and float(s["test_accuracy"]) > 0.3


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_cifar_recipe_other_modes_run(mode, capsys):
    # branchy at a quarter width keeps torch.compile's first step short.
    assert cifar10.main(CIFAR + ["--model", "branchy", "--width", "0.25", "--mode", mode,
                                 "--steps", "12"]) == 0
    s = summary_of(capsys.readouterr().out)
    assert s["mode"] == mode and s["steps"] == "12"


@needs_transformers
def test_bert_recipe_compiled_inside_step_is_captured(capsys):
    assert bert.main(BERT + ["--amp", "bf16", "--compile", "--steps", "24"]) == 0
    out = capsys.readouterr().out
    assert "model compiled" in out and "nt.Step: captured" in out, out
    assert summary_of(out)["steps"] == "24"
    # 4 held-out batches: one eager call (dynamo compiles for eval mode), then replays.
    assert "step.evaluator: 1 graph(s), 3 replays, 1 eager calls" in out, out


@needs_transformers
def test_bert_recipe_compile_mode_runs(capsys):
    """The plain loop over torch.compile(model), compiled with the dense attention masks Step's
    compiled models get."""
    assert bert.main(BERT + ["--amp", "bf16", "--mode", "compile", "--steps", "12"]) == 0
    s = summary_of(capsys.readouterr().out)
    assert s["mode"] == "compile" and s["steps"] == "12"


def test_cifar_resume_continues_in_a_captured_step(tmp_path, capsys):
    path = str(tmp_path / "c.pt")
    common = CIFAR + ["--model", "branchy", "--width", "0.5", "--epochs", "2", "--save", path]
    assert cifar10.main(common + ["--steps", "50"]) == 0
    first = logged_losses(capsys.readouterr().out)
    assert cifar10.main(common + ["--resume", path]) == 0
    out = capsys.readouterr().out
    assert "resumed" in out and "nt.Step: captured" in out
    resumed = logged_losses(out)
    assert resumed[0] < first[0], f"resuming lost the training: {first} then {resumed}"
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert (state["epoch"], state["step"]) == (2, 100)


@needs_transformers
def test_bert_recipe_captures_and_learns(capsys):
    assert bert.main(BERT + ["--amp", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "nt.Step: captured" in out, out
    losses = logged_losses(out)
    assert len(losses) == 16, out
    # From ln(1024) = 6.9 towards the tokens' Zipf entropy (5.1 nats) and below: on the CPU the
    # mean of steps 1-8 is about 6.7 and that of steps 121-128 about 5.3.
    assert losses[-1] < losses[0] - 0.7, f"the loss did not fall: {losses}"


@needs_transformers
def test_bert_recipe_eager_with_grad_clip(capsys):
    assert bert.main(BERT + ["--mode", "eager", "--steps", "20", "--grad-clip", "1.0"]) == 0
    assert summary_of(capsys.readouterr().out)["steps"] == "20"


# 256 sequences of 8 to 128 tokens (median 32), batch 4: the batches reach buckets 64 and 128
# (and now and then 32); dropout off and float32, to compare with the eager loop.
FINETUNE = ["--task", "finetune", "--size", "tiny", "--device", "cuda", "--batch", "4",
            "--max-len", "128", "--median-len", "32", "--buckets", "32,64,128",
            "--samples", "256", "--eval-samples", "64", "--log-every", "8", "--amp", "none",
            "--dropout", "0", "--steps", "24"]


@needs_transformers
def test_bert_finetune_captures_buckets_and_equals_an_unpadded_eager_loop(tmp_path, monkeypatch,
                                                                        capsys):
    made, make = [], _train.make_train_step

    def recording(*args, **kwargs):  # keeps the Step bert.main makes, for its stats
        made.append(make(*args, **kwargs))
        return made[-1]

    path = str(tmp_path / "ft.pt")
    with monkeypatch.context() as patch:
        patch.setattr(_train, "make_train_step", recording)
        assert bert.main(FINETUNE + ["--save", path]) == 0
    out = capsys.readouterr().out
    (step,) = made
    stats = step.stats()
    assert stats["captured"], out
    replayed = [size for size, b in stats["shape_buckets"].items()
                if b["captured"] and b["replays"] > 0]
    assert len(replayed) >= 2, stats["shape_buckets"]
    (evaluator,) = stats["evaluators"]
    assert evaluator["replays"] > 0 and len(evaluator["captured_buckets"]) >= 2, evaluator

    # The same steps as the plain eager loop on every sequence alone, unpadded: the kernels differ
    # with the shapes (cuBLAS and SDPA pick per shape and mask), so the sums reassociate; the
    # weights' distance is judged against the distance training moved them.
    reference, held_out, _ = eager_finetune(FINETUNE)
    initial, _, _ = finetune_data(bert.parse_args(FINETUNE), torch.device("cuda"))
    trained = torch.load(path, map_location="cuda", weights_only=True)["model"]
    keys = list(reference.state_dict())

    def flat(state: dict) -> torch.Tensor:
        return torch.cat([state[key].flatten().double() for key in keys])

    ref, start = flat(reference.state_dict()), flat(initial.state_dict())
    gap = (flat(trained) - ref).norm() / (ref - start).norm()
    assert gap < 1e-3, f"nt.Step's weights are {gap:.2e} of the training distance off"
    # The accuracy through the captured evaluator, against sequence-by-sequence eager evaluation
    # of the saved weights: at most one of the 64 sequences may flip on a near-tie of logits.
    initial.load_state_dict(trained)
    expected = eager_classification_accuracy(initial, held_out)
    assert abs(float(summary_of(out)["test_accuracy"]) - expected) <= 1 / 64 + 1e-9


def run_bench(tmp_path, argv):
    from nimble_train.bench import main
    assert main(argv + ["--steps", "5", "--repeats", "2", "--out", str(tmp_path)]) == 0
    (path,) = [p for p in os.listdir(tmp_path) if p.endswith(".json")]
    with open(tmp_path / path) as f:
        return json.load(f)["rows"]


def test_alternating_rounds_time_each_way_on_its_own_batches():
    from nimble_train.bench import alternating_ms
    small = [torch.randn(256, 256, device="cuda") for _ in range(2)]
    large = [torch.randn(2048, 2048, device="cuda") for _ in range(2)]
    calls = {"small": 0, "large": 0}

    def way(name):
        def step(x):
            calls[name] += 1
            return x @ x
        return step

    ms = alternating_ms({"small": (way("small"), small), "large": (way("large"), large)},
                        rounds=3, steps=4, warm=2)
    assert set(ms) == {"small", "large"} and 0 < ms["small"] < ms["large"]
    assert calls == {"small": 3 * (2 + 4), "large": 3 * (2 + 4)}


def test_bench_runs_every_graph_mode_on_branchy(tmp_path):
    modes = ["eager", "eager-fused", "graph", "graph-fused", "graph-fused-kernels", "step",
             "step-auto"]
    rows = run_bench(tmp_path, ["--model", "branchy", "--batch", "16", "--modes", *modes])
    assert [r["mode"] for r in rows] == modes
    for r in rows:
        assert r["error"] is None, r
        assert r["ms_per_step"] > 0 and r["first_step_s"] > 0
    assert rows[0]["vs_eager"] == pytest.approx(1.0)


def test_bench_amp_runs_every_mode_under_bf16_autocast(tmp_path):
    # --amp bf16: the anchors and Step run the same bf16 step (the first conv's output dtype
    # seen in each mode's forward), and the table says so.
    from nimble_train.bench import modes
    from nimble_train.bench.workloads import make_workload
    w = make_workload("airbench", 16, "cuda", count=2, amp="bf16")
    for key in ("eager", "graph-fused", "step"):
        seen = []
        make_model = w.make_model

        def hooked_model():
            model = make_model()
            first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
            first.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
            return model
        step = modes.MODES[key].build(dataclasses.replace(w, make_model=hooked_model))
        for batch in w.batches * 2:
            step(batch)
        assert seen and set(seen) == {torch.bfloat16}, (key, seen)
        del step
    rows = run_bench(tmp_path, ["--model", "airbench", "--batch", "16", "--amp", "bf16",
                                "--modes", "eager", "graph-fused", "step-auto"])
    assert [r["error"] for r in rows] == [None] * 3
    (path,) = [p for p in os.listdir(tmp_path) if p.endswith(".json")]
    assert path == "airbench-bf16.json"


@needs_transformers
def test_bench_runs_bert(tmp_path):
    modes = ["eager", "graph", "graph-fused", "step"]
    rows = run_bench(tmp_path, ["--model", "bert", "--bert-size", "tiny", "--batch", "8",
                                "--seq", "64", "--modes", *modes])
    for r in rows:
        assert r["error"] is None, r
