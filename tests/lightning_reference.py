"""The LightningModule, data and logger that NimbleStrategy is compared against plain Lightning
with (tests/cpu/test_lightning.py, tests/gpu/test_lightning_cuda.py). Import it after
``pytest.importorskip("lightning")``."""

import copy

import lightning
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger

IN, HIDDEN, CLASSES = 12, 32, 5
BATCH = 8
TRAIN = 4 * BATCH + 3  # 5 batches: the last is short (3) and, with K=2, its window too
VALID = 2 * BATCH + 5  # 2 full batches and a short one


class MemoryLogger(Logger):
    """Keeps every logged metric: [(step, {name: value})]."""

    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def values(self, key):
        """[(step, value)] of one metric, in logging order."""
        return [(step, row[key]) for step, row in self.rows if key in row]


class Classifier(lightning.LightningModule):
    """An MLP classifier: per-batch mean cross-entropy, AdamW, a linear warm-up then decay
    stepped every optimizer step; logs the loss every step and an accuracy per step and epoch,
    and a validation loss."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(),
                                       torch.nn.Linear(HIDDEN, CLASSES))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.1)
        warm, total = 3, 20
        schedule = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / (total - warm))))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def twins(make=Classifier, seed=0):
    """Two modules with the same initial weights."""
    torch.manual_seed(seed)
    module = make()
    return module, copy.deepcopy(module)


def loaders(seed=0):
    g = torch.Generator().manual_seed(seed)
    # Large inputs give large gradients: clipping at 1.0 acts on the updates.
    x = torch.randn(TRAIN + VALID, IN, generator=g) * 4
    y = torch.randint(0, CLASSES, (TRAIN + VALID,), generator=g)
    train = torch.utils.data.TensorDataset(x[:TRAIN], y[:TRAIN])
    valid = torch.utils.data.TensorDataset(x[TRAIN:], y[TRAIN:])
    return (torch.utils.data.DataLoader(train, batch_size=BATCH),
            torch.utils.data.DataLoader(valid, batch_size=BATCH))


def trainer(strategy="auto", logger=None, **overrides):
    """3 epochs, windows of 2 batches, clipping at 1.0, every step logged."""
    args = dict(accelerator="cpu", devices=1, max_epochs=3, logger=logger or False,
                enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0,
                accumulate_grad_batches=2, gradient_clip_val=1.0)
    args.update(overrides)
    return lightning.Trainer(strategy=strategy, **args)


def fit(module, strategy="auto", ckpt_path=None, **overrides):
    """Trains `module`; returns the Trainer and its MemoryLogger."""
    logger = MemoryLogger()
    t = trainer(strategy, logger, **overrides)
    train, valid = loaders()
    t.fit(module, train, valid, ckpt_path=ckpt_path)
    return t, logger


LOGGED = ("train_loss", "train_acc_step", "train_acc_epoch", "val_loss")


def assert_same_logs(ours, plain, keys=LOGGED, **tolerance):
    """Each metric logged at the same steps, with the same values."""
    for key in keys:
        a, b = plain.values(key), ours.values(key)
        assert len(a) == len(b) > 0, (key, len(a), len(b))
        assert [s for s, _ in a] == [s for s, _ in b], key
        torch.testing.assert_close(torch.tensor([v for _, v in b]),
                                   torch.tensor([v for _, v in a]), msg=key, **tolerance)


def assert_same_weights(ours, plain, **tolerance):
    for (name, a), b in zip(plain.state_dict().items(), ours.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a.cpu(), msg=name, **tolerance)
