"""The recipes as importable modules (recipes/ is not a package), their tiny CPU settings, the
transformers check, and eager references for what the recipes compute through nt.Step: the
evaluations as the recipes ran them before step.evaluator, CIFAR training as a plain loop, and
fine-tuning as a plain loop over unpadded sequences."""

import os
import sys

import pytest

RECIPES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "recipes"))
sys.path.insert(0, RECIPES)

import _train  # noqa: E402
import bert  # noqa: E402
import cifar10  # noqa: E402
import torch  # noqa: E402
from nimble_train.bench import workloads  # noqa: E402

# Runs of a few seconds on the CPU.
TINY_CIFAR = ["--device", "cpu", "--model", "branchy", "--width", "0.25", "--batch", "8",
              "--synthetic-size", "40", "--eval-samples", "16", "--log-every", "2"]
TINY_BERT = ["--size", "tiny", "--device", "cpu", "--batch", "2", "--seq", "16",
             "--samples", "8", "--eval-samples", "4", "--log-every", "2"]
# 24 sequences of 8 to 64 tokens (median 16), batch 4: 6 steps per epoch over buckets 16, 32, 64.
TINY_FINETUNE = ["--task", "finetune", "--size", "tiny", "--device", "cpu", "--batch", "4",
                 "--max-len", "64", "--median-len", "16", "--buckets", "16,32,64",
                 "--samples", "24", "--eval-samples", "10", "--log-every", "2"]


def tiny_cifar(model: str) -> list[str]:
    """TINY_CIFAR with `model`: branchy at a quarter width, the fixed-width models as they are."""
    argv = list(TINY_CIFAR)
    argv[argv.index("--model") + 1] = model
    if model != "branchy":
        i = argv.index("--width")
        del argv[i:i + 2]
    return argv


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread avoids OpenMP oversubscription on busy CI machines and keeps CPU
    results reproducible. Autouse in the modules that import it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


try:
    import transformers  # noqa: F401  (only whether it imports)
    HAVE_TRANSFORMERS = True
except ImportError:
    HAVE_TRANSFORMERS = False
needs_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason="transformers is not installed here (pip install transformers)")


# ---------------------------------------------------------------------- eager references


@torch.no_grad()
def eager_cifar_accuracy(model, dataset, limit: int | None, batch: int = 1000) -> float:
    """Top-1 accuracy on the test images as cifar10.py computed it before step.evaluator."""
    was_training = model.training
    model.eval()
    n = dataset.test_y.numel() if limit is None else min(limit, dataset.test_y.numel())
    correct = 0
    for start in range(0, n, batch):
        end = min(start + batch, n)
        logits = model(dataset.test_x[start:end])
        correct += int((logits.argmax(1) == dataset.test_y[start:end]).sum())
    model.train(was_training)
    return correct / max(n, 1)


@torch.no_grad()
def eager_masked_accuracy(model, data: dict, batch: int) -> float:
    """Masked-token accuracy as bert.py computed it before step.evaluator."""
    was_training = model.training
    model.eval()
    correct = total = 0
    for start in range(0, data["input_ids"].shape[0], batch):
        ids = data["input_ids"][start:start + batch]
        labels = data["labels"][start:start + batch]
        predicted = model(input_ids=ids).logits.argmax(-1)
        masked = labels != -100
        correct += int(((predicted == labels) & masked).sum())
        total += int(masked.sum())
    model.train(was_training)
    return correct / max(total, 1)


def eager_cifar(argv: list[str]):
    """cifar10.main(argv)'s training (one process, synthetic data, no --resume) as the plain
    eager loop: SGD with the model's Nesterov momentum and weight decay over the batch-mean
    cross entropy with its label smoothing (one reduction, where nt.Step averages per-sample
    losses). Returns the trained model and each step's loss."""
    args = cifar10.parse_args(argv)
    assert args.data is None and args.resume is None, "the reference trains on synthetic data"
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    size = args.synthetic_size
    data = cifar10.synthetic_cifar10(size, max(10, size // 5), device=device, seed=args.seed)
    dataset = cifar10.GpuCifar.build(data, device)
    training = workloads.CIFAR_TRAINING[args.model]
    model = workloads.cifar_model(args.model, device, width=args.width)
    lr = args.lr if args.lr is not None else training.lr * args.batch / training.batch
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=training.momentum,
                                nesterov=True, weight_decay=training.weight_decay)
    steps_per_epoch = size // args.batch
    scheduler = _train.make_scheduler(optimizer, args, args.epochs * steps_per_epoch, "cosine")
    steps = args.epochs * steps_per_epoch if args.steps is None else args.steps
    smoothing = training.loss_fn.label_smoothing
    losses = []
    model.train()
    for step in range(steps):
        epoch, i = divmod(step, steps_per_epoch)
        if i == 0:
            images, labels = dataset.epoch(seed=args.seed * 1000 + epoch)
        rows = slice(i * args.batch, (i + 1) * args.batch)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images[rows]), labels[rows],
                                                 label_smoothing=smoothing)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return model, optimizer, losses


def unpadded(data, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `index` of bert.Sequences at its own length, [1, L], and its label [1]: no
    padding and no attention mask at all."""
    length = int(data.lengths[index])
    return data.input_ids[index:index + 1, :length], data.labels[index:index + 1]


@torch.no_grad()
def eager_classification_accuracy(model, data) -> float:
    """Classification accuracy of bert.Sequences, one unpadded sequence at a time, eval mode."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(data.lengths.numel()):
        ids, label = unpadded(data, i)
        correct += int(model(input_ids=ids).logits.argmax(-1).item() == label.item())
    model.train(was_training)
    return correct / max(data.lengths.numel(), 1)


def finetune_data(args, device):
    """The training and held-out sequences bert.main(argv) draws, and a fresh classifier with
    the initial weights it starts from."""
    torch.manual_seed(args.seed)
    model = bert.classifier_model(args.size, device, args.dropout)
    vocab = model.config.vocab_size
    train = bert.synthetic_classification(args.samples, args.max_len, args.median_len, vocab,
                                          device=device, seed=args.seed)
    held_out = bert.synthetic_classification(args.eval_samples, args.max_len, args.median_len,
                                             vocab, device=device, seed=args.seed + 10_000)
    return model, train, held_out


def eager_finetune(argv: list[str]):
    """bert.main(argv)'s fine-tuning (--dropout 0, one process) as the plain eager loop, with no
    padding anywhere: each batch's loss is the mean of its sequences' losses, each sequence run
    alone at its own length. Returns the trained model, its held-out sequences and the losses."""
    args = bert.parse_args(argv)
    assert args.task == "finetune" and args.dropout == 0, "the reference runs without dropout"
    device = torch.device(args.device)
    model, train, held_out = finetune_data(args, device)
    lr = args.lr if args.lr is not None else bert.DEFAULT_LR[args.size]
    optimizer = workloads.bert_optimizer(model, lr, kind=args.optimizer)
    steps_per_epoch = args.samples // args.batch
    scheduler = _train.make_scheduler(optimizer, args, args.epochs * steps_per_epoch, "linear")
    steps = args.epochs * steps_per_epoch if args.steps is None else args.steps
    losses = []
    model.train()
    for step in range(steps):
        epoch, i = divmod(step, steps_per_epoch)
        order = bert.epoch_order(args.samples, args.seed, epoch)
        rows = order[i * args.batch:(i + 1) * args.batch].tolist()
        optimizer.zero_grad()
        loss = torch.stack([model(input_ids=ids, labels=label).loss
                            for ids, label in (unpadded(train, j) for j in rows)]).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return model, held_out, losses


__all__ = ["HAVE_TRANSFORMERS", "RECIPES", "TINY_BERT", "TINY_CIFAR", "TINY_FINETUNE", "bert",
           "cifar10", "eager_cifar", "eager_cifar_accuracy", "eager_classification_accuracy",
           "eager_finetune", "eager_masked_accuracy", "finetune_data", "needs_transformers",
           "one_thread", "tiny_cifar", "unpadded"]
