"""nimble_train.integrations.lightning on the CPU: Trainer(strategy=NimbleStrategy()) trains a
LightningModule as plain Lightning does (weights, logged losses, validation metrics), and what
cannot be mapped onto a Step is refused with the Lightning argument's name.

On the CPU the Step runs eagerly (same semantics as its captured step); the comparison is with
the same module, weights and batches under Lightning's own single-device strategy. Both runs do
the same float32 operations in the same order (loss / K vs loss * (1/K) is exact for K=2), so
they agree to rounding; tolerances are tight.
"""

import subprocess
import sys

import pytest

lightning = pytest.importorskip("lightning")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nimble_train as nt  # noqa: E402
from nimble_train.integrations.lightning import NimbleStrategy  # noqa: E402
from lightning_reference import (Classifier, assert_same_logs, assert_same_weights,  # noqa: E402
                                 fit, trainer, twins)


def test_equals_plain_lightning():
    plain, ours = twins()
    t_plain, log_plain = fit(plain)
    strategy = NimbleStrategy(warmup=2)
    t_ours, log_ours = fit(ours, strategy)

    # 3 epochs of 5 batches, windows of 2: 3 updates an epoch, the last on a short window.
    assert t_plain.global_step == t_ours.global_step == 9
    stats = strategy.stats()
    assert (stats["steps"], stats["updates"], stats["accumulate"]) == (15, 9, 2)
    assert stats["phase"] == "eager"  # on the CPU; strategy.stats() is taken before close()
    assert stats["evaluators"][0]["eager"] == 3 * 3  # every validation batch went through it
    assert_same_weights(ours, plain, rtol=1e-5, atol=1e-6)
    assert_same_logs(log_ours, log_plain, rtol=1e-5, atol=1e-6)


def test_the_comparison_sees_clipping():
    """Clipping acts in these runs: without it the weights end elsewhere (so the comparison
    above checks that gradient_clip_val reached the Step)."""
    plain, ours = twins()
    fit(plain)
    fit(ours, NimbleStrategy(warmup=2), gradient_clip_val=None)
    assert not torch.allclose(ours.net[0].weight, plain.net[0].weight, atol=1e-3)


def test_bf16_mixed_equals_plain_lightning():
    """precision="bf16-mixed" is the Step's amp="bf16": the same autocast regions (on the CPU,
    Lightning also runs "16-mixed" as bf16)."""
    plain, ours = twins()
    _, log_plain = fit(plain, precision="bf16-mixed")
    _, log_ours = fit(ours, NimbleStrategy(warmup=2), precision="bf16-mixed")
    assert_same_weights(ours, plain, rtol=1e-5, atol=1e-6)
    assert_same_logs(log_ours, log_plain, rtol=1e-5, atol=1e-6)


def test_checkpoints_save_and_resume_as_plain_lightning(tmp_path):
    """Lightning's default callbacks run; a checkpoint holds the trained weights and the
    optimizer's state, and resuming from it (the state loaded after the Step is built) trains
    on as plain Lightning does."""
    plain, ours = twins()
    fit(plain, max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path / "plain")
    fit(ours, NimbleStrategy(warmup=2), max_epochs=2, enable_checkpointing=True,
        enable_progress_bar=True, enable_model_summary=True, default_root_dir=tmp_path / "ours")
    saved = {}
    for name in ("plain", "ours"):
        (path,) = (tmp_path / name).rglob("*.ckpt")
        saved[name] = path
        checkpoint = torch.load(path, weights_only=False)
        module = plain if name == "plain" else ours
        for key, value in module.state_dict().items():
            torch.testing.assert_close(checkpoint["state_dict"][key], value, rtol=0, atol=0)
        assert len(checkpoint["optimizer_states"][0]["state"]) == 4  # exp_avg etc. per tensor

    resumed_plain, resumed_ours = Classifier(), Classifier()
    fit(resumed_plain, max_epochs=3, ckpt_path=saved["plain"])
    fit(resumed_ours, NimbleStrategy(warmup=2), max_epochs=3, ckpt_path=saved["ours"])
    assert_same_weights(resumed_ours, resumed_plain, rtol=1e-5, atol=1e-6)


def test_training_step_outputs_reach_on_train_batch_end():
    seen = []

    class WithOutputs(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            return {"loss": F.cross_entropy(logits, y), "correct": (logits.argmax(1) == y).sum()}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.append((outputs["loss"].item(), outputs["correct"].item()))

    plain, ours = twins(WithOutputs)
    fit(plain, max_epochs=1)
    reference, seen[:] = list(seen), []
    fit(ours, NimbleStrategy(warmup=2), max_epochs=1)
    assert len(seen) == len(reference) == 5
    torch.testing.assert_close(torch.tensor(seen), torch.tensor(reference))


# ---------------------------------------------------------------------- refusals


def fit_error(module, strategy=None, **overrides):
    with pytest.raises((nt.NimbleError, ValueError, TypeError)) as info:
        fit(module, strategy or NimbleStrategy(), **{"max_epochs": 1, **overrides})
    return str(info.value)


def test_refuses_manual_optimization():
    class Manual(Classifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = F.cross_entropy(self(batch[0]), batch[1])
            self.manual_backward(loss)
            opt.step()

    message = fit_error(Manual(), accumulate_grad_batches=1, gradient_clip_val=None)
    assert "automatic_optimization" in message and "Manual" in message


def test_refuses_two_optimizers():
    class Two(Classifier):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                    torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    message = fit_error(Two())
    assert "configure_optimizers" in message and "several optimizers" in message


def test_refuses_no_optimizer():
    class NoOptimizer(Classifier):
        def configure_optimizers(self):
            return None

    assert "configure_optimizers" in fit_error(NoOptimizer())


def test_refuses_clipping_by_value():
    message = fit_error(Classifier(), gradient_clip_algorithm="value")
    assert "gradient_clip_algorithm='value'" in message and "'norm'" in message


def test_refuses_precisions_it_cannot_reproduce():
    message = fit_error(Classifier(), precision="bf16-true")
    assert "precision='bf16-true'" in message and "bf16-mixed" in message


@pytest.mark.parametrize("streams", [0, "two", True, 1.5])
def test_refuses_a_streams_setting_when_built(streams):
    with pytest.raises(ValueError, match=f'streams must be "auto" or an int >= 1; got {streams!r}'):
        NimbleStrategy(streams=streams)


def test_refuses_several_devices():
    with pytest.raises(ValueError, match=r"devices=\.\.\.\) asked for 2"):
        trainer(NimbleStrategy(), devices=2)


def test_refuses_hooks_that_would_run_inside_the_step():
    class Observes(Classifier):
        def on_after_backward(self):
            pass

    assert "LightningModule.on_after_backward" in fit_error(Observes())

    class GradientLogger(lightning.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            pass

    message = fit_error(Classifier(), callbacks=[GradientLogger()])
    assert "GradientLogger" in message and "on_before_optimizer_step" in message


def test_refuses_an_optimizer_step_that_bypasses_the_closure():
    class CallsClosureItself(Classifier):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            optimizer_closure()
            optimizer.step()

    message = fit_error(CallsClosureItself())
    assert "LightningModule.optimizer_step" in message and "optimizer.step(closure=" in message


def test_an_optimizer_step_override_that_runs_the_closure_trains_as_lightning():
    class Stepping(Classifier):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            optimizer.step(closure=optimizer_closure)
            self.steps_seen = getattr(self, "steps_seen", 0) + 1

    plain, ours = twins(Stepping)
    fit(plain, max_epochs=1)
    fit(ours, NimbleStrategy(warmup=2), max_epochs=1)
    assert plain.steps_seen == ours.steps_seen == 3
    assert_same_weights(ours, plain, rtol=1e-5, atol=1e-6)


def test_refuses_skipped_batches_and_metric_objects():
    class Skips(Classifier):
        def training_step(self, batch, batch_idx):
            return None

    assert "returned None" in fit_error(Skips())

    class LogsMetric(Classifier):
        def training_step(self, batch, batch_idx):
            self.log("thing", object())
            return F.cross_entropy(self(batch[0]), batch[1])

    assert "self.log('thing', object)" in fit_error(LogsMetric())


def test_refuses_accumulation_that_changes():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    message = fit_error(Classifier(), accumulate_grad_batches=1, max_epochs=2,
                        callbacks=[GradientAccumulationScheduler({1: 2})])
    assert "accumulate_grad_batches changed" in message


def test_package_does_not_import_lightning_and_the_module_says_how_to_install_it():
    code = ("import sys, nimble_train; assert 'lightning' not in sys.modules, 'imported'\n"
            "sys.modules['lightning'] = None\n"
            "try:\n"
            "    import nimble_train.integrations.lightning\n"
            "except ImportError as error:\n"
            "    print(error)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "pip install 'nimble_train[lightning]'" in out.stdout


def test_the_batch_index_each_call_passes_to_training_step_is_not_a_watched_number():
    """batch_idx is the captured one in a replay (the strategy's contract), and every call
    passes the next: the Step's watch of the numbers a forward reads (a tuple of them among
    those) must not refuse the call that hands it over, nor its keyword arguments."""
    from nimble_train._model_watch import ModelWatch
    from nimble_train.integrations.lightning import _TrainingStepModule

    wrapper = _TrainingStepModule(Classifier())
    wrapper._step_args, wrapper._step_kwargs = (2,), {}
    watch = ModelWatch(wrapper)
    watch.captured = True
    wrapper._step_args, wrapper._step_kwargs = (3,), {"dataloader_idx": 0}
    assert watch.first_changed() == -1
    watch.refuse_replaced_objects()
    watch.check_constants()
