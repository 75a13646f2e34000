"""NimbleStrategy on a GPU: the Step captures (training calls are replays), the run equals plain
Lightning on the same GPU, the logged losses match, and validation runs through the Step's
captured evaluator.

Where bitwise equality is impossible: the Step's update is the fused AdamW (same math, other
rounding), clipping's norm is computed in another order, and learning rates reach the graph
as float32; float32 throughout, TF32 off, so the runs agree to about 1e-6 relative.
"""

import pytest
import torch
from torch._dynamo.utils import counters

lightning = pytest.importorskip("lightning")

from nimble_train.integrations.lightning import NimbleStrategy  # noqa: E402
from lightning_reference import (assert_same_logs, assert_same_weights, fit,  # noqa: E402
                                 twins)

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tf32")]

TOL = {"rtol": 1e-4, "atol": 1e-5}


def test_captures_and_equals_plain_lightning():
    plain, ours = twins()
    t_plain, log_plain = fit(plain, accelerator="gpu")
    strategy = NimbleStrategy(warmup=2)
    t_ours, log_ours = fit(ours, strategy, accelerator="gpu")

    stats = strategy.stats()  # as the Step was when fit closed it
    assert stats["phase"] == "replay", stats
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
    _, log_ours = fit(torch.compile(ours), strategy, accelerator="gpu")
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
