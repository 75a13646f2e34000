"""NimbleStrategy on a GPU: the Step captures (training calls are replays), the run equals plain
Lightning on the same GPU, the logged losses match, and validation runs through the Step's
captured evaluator.

Where bitwise equality is impossible: the Step's update is the fused AdamW (same math, other
rounding), clipping's norm is computed in another order, and learning rates reach the graph
as float32; float32 throughout, TF32 off, so the runs agree to about 1e-6 relative.
"""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

lightning = pytest.importorskip("lightning")

from nimble_train._multistream import CHAIN  # noqa: E402
from nimble_train.integrations.lightning import NimbleStrategy  # noqa: E402
from lightning_reference import (MemoryLogger, assert_same_logs,  # noqa: E402
                                 assert_same_weights, fit, trainer, twins)
from step_reference import InceptionNet  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tf32")]

TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.parametrize("streams", ["auto", 1])
def test_captures_and_equals_plain_lightning(streams):
    """streams="auto" (the default): the linear layers' weight gradients on a side stream, the
    forward on one (the module's forward, traced in training_step's place, is a chain),
    without a warning."""
    plain, ours = twins()
    t_plain, log_plain = fit(plain, accelerator="gpu")
    strategy = NimbleStrategy(warmup=2, streams=streams)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t_ours, log_ours = fit(ours, strategy, accelerator="gpu")
    assert not [w for w in caught if "one stream" in str(w.message)], caught

    stats = strategy.stats()  # as the Step was when fit closed it
    assert stats["phase"] == "replay", stats
    if streams == "auto":
        assert stats["weight_grad_layers"] == 2 and stats["weight_grad_streams"] == 1, stats
        # the module's forward traced in training_step's place: a chain of two layers
        assert stats["single_stream_reason"] == CHAIN, stats
    else:
        assert stats["weight_grad_layers"] == 0, stats
    assert stats["captured"] and stats["optimizer"] == "fused", stats
    # 15 calls: 2 warm-up steps, a short last batch per epoch (a scalar loss: eager), and
    # replays of the two kinds of call of a window of 2 for the rest.
    assert stats["replays"] == 15 - 2 - 3 and stats["eager_steps"] == 2 + 3, stats
    assert (stats["updates"], t_ours.global_step, t_plain.global_step) == (9, 9, 9)
    # Each validation: 2 full batches replayed (the first of them captured), a short one eager.
    evaluator = stats["evaluators"][0]
    assert evaluator["replays"] == 2 * 3 and evaluator["eager"] == 3, evaluator
    assert evaluator["captures"] == 1, evaluator

    assert_same_weights(ours, plain, **TOL)
    assert_same_logs(log_ours, log_plain, **TOL)


def test_a_compiled_lightning_module_captures_and_equals_plain_lightning():
    """trainer.fit(torch.compile(module)), as Lightning's docs show it: Lightning replaces the
    module's training_step by the compiled one, which the Step's warm-up compiles and its
    capture records; the model's layers are left as inductor compiled them."""
    torch._dynamo.reset()
    plain, ours = twins()
    _, log_plain = fit(plain, accelerator="gpu")
    strategy = NimbleStrategy(warmup=2)
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, log_ours = fit(torch.compile(ours), strategy, accelerator="gpu")
    assert not [w for w in caught if "one stream" in str(w.message)], caught
    assert ours._compiler_ctx is not None  # Lightning's compiled module
    assert counters["stats"]["unique_graphs"] > 0  # dynamo compiled what the Step ran
    stats = strategy.stats()
    assert stats["phase"] == "replay" and stats["captured"], stats
    assert stats["replays"] == 15 - 2 - 3 and stats["optimizer"] == "fused", stats
    assert_same_weights(ours, plain, **TOL)
    assert_same_logs(log_ours, log_plain, **TOL)
    torch._dynamo.reset()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_captures_and_follows_plain_lightning(precision):
    """precision="bf16-mixed" is the Step's amp="bf16", "16-mixed" its amp="fp16" (the loss
    scale on the device, starting and moving as Lightning's GradScaler): the same autocast
    regions. The fused update's last-bit differences can round a weight's half-precision copy
    the other way, so the runs drift apart and the check is loose (and leaves out the
    accuracy, which such a drift can move by a whole sample)."""
    plain, ours = twins()
    _, log_plain = fit(plain, accelerator="gpu", precision=precision)
    strategy = NimbleStrategy(warmup=2)
    _, log_ours = fit(ours, strategy, accelerator="gpu", precision=precision)
    stats = strategy.stats()
    assert stats["replays"] > 0 and stats["optimizer"] == "fused", stats
    assert_same_weights(ours, plain, rtol=0.05, atol=5e-3)
    assert_same_logs(log_ours, log_plain, keys=("train_loss", "val_loss"), rtol=0.05, atol=5e-3)


class Cells(lightning.LightningModule):
    """Inception cells (four branches each, batch norms) on 8x8 images: training_step calls
    the module itself, whose forward the Step traces and plans on four streams."""

    def __init__(self):
        super().__init__()
        self.net = InceptionNet(classes=5, width=8, cells=2)

    def forward(self, x):
        return self.net(x)

    def logits(self, x):
        return self(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.logits(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class CellsCalledDirectly(Cells):
    """The same, but training_step calls the network, not the module's forward."""

    def logits(self, x):
        return self.net(x)


def fit_cells(module, strategy="auto"):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6 * 16, 3, 8, 8, generator=g), torch.randint(0, 5, (6 * 16,), generator=g)
    logger = MemoryLogger()
    t = trainer(strategy, logger, accelerator="gpu", max_epochs=2)
    t.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                              batch_size=16))
    return logger


@pytest.mark.usefixtures("deterministic_cudnn")
@pytest.mark.parametrize("make", [Cells, CellsCalledDirectly])
def test_the_modules_forward_is_planned_on_streams_and_equals_plain_lightning(make):
    """The LightningModule's forward, traced (training_step is not), runs its plan where
    training_step calls it; a training_step that calls the layers itself runs them as they
    are, and stats say why. Either way: equal to plain Lightning (up to the order in which
    gradients from several streams are summed)."""
    plain, ours = twins(make)
    log_plain = fit_cells(plain)
    strategy = NimbleStrategy(warmup=2)
    log_ours = fit_cells(ours, strategy)
    stats = strategy.stats()
    assert stats["phase"] == "replay" and stats["replays"] > 0, stats
    assert stats["weight_grad_layers"] > 0, (stats["single_stream_reason"],
                                             stats["weight_grads_off"])
    if make is Cells:
        assert stats["streams"] == 4 and stats["syncs"] > 0, stats
        assert stats["single_stream_reason"] is None, stats
    else:
        assert stats["streams"] == 1, stats
        assert stats["single_stream_reason"] == (
            "the step did not call CellsCalledDirectly's forward, the one traced"), stats
    assert "forward" not in ours.__dict__  # the plan ran in its place only while captured
    assert_same_weights(ours, plain, rtol=1e-3, atol=1e-4)
    assert_same_logs(log_ours, log_plain, keys=("train_loss",), rtol=1e-3, atol=1e-4)
