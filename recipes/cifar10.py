"""CIFAR-10 training: ResNet-18, the branchy inception-style network or airbench94's network,
one GPU (or the CPU).

    python recipes/cifar10.py --data ~/data --epochs 10            # nt.Step, captured
    python recipes/cifar10.py --model branchy --streams auto --steps 300
    python recipes/cifar10.py --model airbench --data ~/data --epochs 10   # batch 1024
    python recipes/cifar10.py --mode eager --batch 128 --save ckpt.pt
    python recipes/cifar10.py --device cpu --steps 5 --batch 8 --synthetic-size 512
    python recipes/cifar10.py --model airbench --device cpu --steps 5 --batch 8 --synthetic-size 512

The dataset lives in GPU memory, as in MLPerf: each epoch's augmentation (random crop with 4
pixels of padding, horizontal flip, normalisation) is a few batched tensor ops over the whole
epoch, and the batches are slices of the result, so the loader never starves the graph and
shapes never change. The real CIFAR-10 is read from --data (the python pickle batches of
cifar-10-batches-py/); without it, a synthetic dataset of the same shape is used and the
output says so. SGD with Nesterov momentum and weight decay; the learning rate rises linearly
for 15% of the steps, then follows a cosine to zero (momentum stays fixed: a captured step
bakes it in, while the lr is read by the graph each step). Each model brings its own training
settings (workloads.CIFAR_TRAINING): ResNet-18 and branchy default to batch 256, momentum 0.9
and a peak lr of 0.1 per 128 images; airbench to airbench94's batch of 1024, momentum 0.85 and
label smoothing 0.2, with a peak lr of 0.2 per 1024 images (airbench's own schedule and
augmentation, 2-pixel translations and flips alternating by epoch, its lookahead and its
test-time augmentation are not reproduced: see nimble_train.models.airbench).
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _train  # noqa: E402  (the recipes' shared loop, beside this file)

from nimble_train.bench import workloads  # noqa: E402

RECIPE = "cifar10"
MEAN = (0.4914, 0.4822, 0.4465)  # per channel, of the CIFAR-10 training images
STD = (0.2470, 0.2435, 0.2616)
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILE = "test_batch"
PAD = 4  # pixels of zero padding around each image for the random crop


# ---------------------------------------------------------------------- data


def find_cifar10(data_dir: str | None) -> Path | None:
    """The folder holding data_batch_1..5 and test_batch: DIR/cifar-10-batches-py or DIR."""
    if not data_dir:
        return None
    for folder in (Path(data_dir) / "cifar-10-batches-py", Path(data_dir)):
        if all((folder / name).is_file() for name in TRAIN_FILES + [TEST_FILE]):
            return folder
    return None


def read_batch_file(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One pickle batch of the python CIFAR-10: images [N, 3, 32, 32] uint8, labels [N] int64.

    The file is a pickled dict with b'data', an (N, 3072) uint8 array (each row 1024 red, then
    1024 green, then 1024 blue values, row-major), and b'labels', N ints in [0, 10).
    """
    import numpy as np  # unpickling the arrays needs numpy; torch already depends on it

    with open(path, "rb") as f:
        try:
            entry = pickle.load(f, encoding="bytes")
        except Exception as exc:  # unpickling foreign bytes can fail with almost any type
            raise ValueError(f"{path}: not a pickle of the python CIFAR-10 format (unpickling "
                             f"failed: {type(exc).__name__}); the file is truncated, corrupt "
                             "or another dataset's: extract cifar-10-python.tar.gz again") from exc
    if not isinstance(entry, dict) or b"data" not in entry or b"labels" not in entry:
        found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"{path}: expected a dict with b'data' and b'labels' (the python "
                         f"CIFAR-10 format); found {found}")
    data = np.asarray(entry[b"data"])
    labels = np.asarray(entry[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"{path}: b'data' must be an (N, 3072) uint8 array (N images of "
                         f"3 x 32 x 32: the python CIFAR-10 format); got {data.shape} {data.dtype}")
    in_range = labels.size == 0 or 0 <= labels.min() <= labels.max() < 10
    if labels.shape != (data.shape[0],) or not in_range:
        raise ValueError(f"{path}: b'labels' must be {data.shape[0]} ints in [0, 10); got "
                         f"{labels.shape[0]} values")
    images = torch.from_numpy(np.ascontiguousarray(data)).view(-1, 3, 32, 32)
    return images, torch.from_numpy(labels)


def load_cifar10(folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    parts = [read_batch_file(folder / name) for name in TRAIN_FILES]
    train = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
    return {"train": train, "test": read_batch_file(folder / TEST_FILE)}


def synthetic_cifar10(train_size: int, test_size: int, *, device, seed: int = 0):
    """Learnable stand-in data of CIFAR-10's shape: each class has a smooth colour pattern
    (4×4 random values upsampled to 32×32), and an image is its class's pattern under strong
    per-pixel noise and a random brightness shift, as uint8. Crops and flips keep the class."""
    g = torch.Generator(device=device).manual_seed(seed + 1234)
    patterns = torch.randn(10, 3, 4, 4, device=device, generator=g)
    patterns = torch.nn.functional.interpolate(patterns, size=32, mode="bilinear",
                                               align_corners=False)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, 10, (n,), device=device, generator=g)
        images = torch.empty(n, 3, 32, 32, dtype=torch.uint8, device=device)
        for start in range(0, n, 8192):  # bounded float memory
            y = labels[start:start + 8192]
            noise = torch.randn(y.numel(), 3, 32, 32, device=device, generator=g)
            shift = torch.randn(y.numel(), 1, 1, 1, device=device, generator=g)
            x = 128 + 30 * patterns[y] + 60 * noise + 20 * shift
            images[start:start + y.numel()] = x.clamp_(0, 255).to(torch.uint8)
        return images, labels

    return {"train": make(train_size), "test": make(test_size)}


@dataclass
class GpuCifar:
    """CIFAR-10 held on the training device, augmented a whole epoch at a time."""

    padded: torch.Tensor     # [N, 3, 32 + 2·PAD, 32 + 2·PAD] uint8, zero borders
    labels: torch.Tensor     # [N] int64
    test_x: torch.Tensor     # [M, 3, 32, 32] float32, normalised
    test_y: torch.Tensor     # [M] int64
    mean: torch.Tensor       # [1, 3, 1, 1]
    std: torch.Tensor

    @classmethod
    def build(cls, data: dict, device: torch.device) -> GpuCifar:
        x, y = data["train"]
        mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        padded = torch.nn.functional.pad(x.to(device), (PAD, PAD, PAD, PAD))
        test_x, test_y = data["test"]
        test_x = (test_x.to(device).float() / 255 - mean) / std
        return cls(padded, y.to(device), _layout(test_x), test_y.to(device), mean, std)

    @property
    def size(self) -> int:
        return self.labels.numel()

    def epoch(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The epoch's shuffled, augmented images [N, 3, 32, 32] (float32) and labels [N].

        A random crop of each padded image is a gather whose row and column indices are offset
        per image; flipping reverses the column indices, so crop and flip are one indexing op.
        Indices are laid out (image, row, column, channel), which makes the result
        channels-last: the layout cuDNN is fastest with.
        """
        device = self.padded.device
        g = torch.Generator(device=device).manual_seed(seed)
        n = self.size
        order = torch.randperm(n, device=device, generator=g)
        dy = torch.randint(0, 2 * PAD + 1, (n, 1), device=device, generator=g)
        dx = torch.randint(0, 2 * PAD + 1, (n, 1), device=device, generator=g)
        flip = torch.rand(n, 1, device=device, generator=g) < 0.5
        span = torch.arange(32, device=device)
        rows = dy + span                                          # [n, 32]
        cols = torch.where(flip, dx + span.flip(0), dx + span)    # [n, 32]
        channels = torch.arange(3, device=device)
        images = self.padded[order.view(n, 1, 1, 1), channels.view(1, 1, 1, 3),
                             rows.view(n, 32, 1, 1), cols.view(n, 1, 32, 1)]  # [n, 32, 32, 3]
        images = images.permute(0, 3, 1, 2)                      # [n, 3, 32, 32] channels-last
        images = (images.float() / 255 - self.mean) / self.std
        return images, self.labels[order]


def _layout(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if x.is_cuda else x.contiguous()


# ---------------------------------------------------------------------- training


def parse_args(argv=None):
    batches = ", ".join(f"{t.batch} for {name}" for name, t in workloads.CIFAR_TRAINING.items())
    p = _train.base_parser(__doc__, batch=None, epochs=10, lr_warmup=0.15,
                           amp_help="autocast: none (default), bf16 or fp16",
                           batch_help=f"samples per step (default: {batches})")
    p.add_argument("--model", choices=workloads.CIFAR_MODELS, default="resnet18")
    p.add_argument("--data", metavar="DIR", default=None,
                   help="folder with cifar-10-batches-py/ (default: synthetic data)")
    p.add_argument("--synthetic-size", type=int, default=50000,
                   help="training images of the synthetic data (test: a fifth)")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="evaluate on the first N test images (default: all; 0 skips the "
                        "evaluation)")
    p.add_argument("--keep-last-batch", action="store_true",
                   help="train on the short last batch of each epoch too (Step pads it, or "
                        "runs it eagerly for BatchNorm models); default: drop it")
    p.add_argument("--width", type=float, default=1.0, help="branchy: width multiplier")
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = workloads.CIFAR_TRAINING[args.model].batch
    _train.check_args(p, args)
    if args.width != 1.0 and args.model != "branchy":
        p.error(f"--width scales the branchy network; {args.model} has a fixed width")
    if args.synthetic_size < 10:
        p.error(f"--synthetic-size must be >= 10; got {args.synthetic_size}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    job = _train.join_job(RECIPE, args)
    if job is None:
        return 2
    _train.check_save_path(args, job)
    device = _train.pick_device(args.device)
    amp = _train.amp_of(args, device, default_on_cuda=None)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True

    folder = find_cifar10(args.data)
    if folder is not None:
        try:
            data = load_cifar10(folder)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--data {args.data}: {exc}") from None
        source = f"CIFAR-10 from {folder}"
    else:
        if args.data:
            print(f"no CIFAR-10 in {args.data} (expected cifar-10-batches-py/ with "
                  f"{', '.join(TRAIN_FILES)} and {TEST_FILE})")
        size = args.synthetic_size
        data = synthetic_cifar10(size, max(10, size // 5), device=device, seed=args.seed)
        source = (f"SYNTHETIC data ({size} training images of CIFAR-10's shape, learnable "
                  "class patterns): accuracies are not CIFAR-10 accuracies")
    dataset = GpuCifar.build(data, device)
    del data
    # Under torchrun every rank takes its own slice of each global batch of world x --batch.
    span = args.batch * job.world_size
    batches_per_epoch = (dataset.size // span if not args.keep_last_batch or job.world_size > 1
                         else -(-dataset.size // span))
    if batches_per_epoch == 0:
        print(f"--batch {args.batch} x {job.world_size} process(es) is larger than the "
              f"{dataset.size} training images", file=sys.stderr)
        return 2

    training = workloads.CIFAR_TRAINING[args.model]
    model = workloads.cifar_model(args.model, device, width=args.width)
    # linear scaling from the model's lr at its default batch
    lr = args.lr if args.lr is not None else training.lr * span / training.batch
    optimizer = training.optimizer(model, lr)
    planned = _train.planned_steps(args, batches_per_epoch, RECIPE)
    scheduler = _train.make_scheduler(optimizer, args, planned, decay="cosine")
    config = {"model": args.model, "batch": args.batch, "width": args.width,
              "steps_per_epoch": batches_per_epoch, "planned_steps": planned}

    print(source)
    print(_train.describe_run(device, args, amp))
    print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
          f"batch {args.batch}" + (f" per GPU x {job.world_size} GPUs" if job.world_size > 1
                                    else "") +
          f", {batches_per_epoch} steps per epoch, peak lr {lr:.3g}")
    try:
        train_step = _train.make_train_step(
            args.mode, model, optimizer, training.loss_fn, device=device, amp=amp,
            streams=args.streams, warmup=args.warmup, grad_clip=args.grad_clip,
            capture=not args.no_capture, compile_model=args.compile,
            shard_optimizer=args.shard_optimizer)
    except NotImplementedError as exc:
        print(f"--mode {args.mode} --amp {args.amp}: {exc}", file=sys.stderr)
        return 2
    start_step = _train.resume(args, recipe=RECIPE, model=model, optimizer=optimizer,
                               scheduler=scheduler, train_step=train_step, config=config,
                               device=device, steps_per_epoch=batches_per_epoch, job=job)

    def epoch_batches(epoch: int):
        x, y = dataset.epoch(seed=args.seed * 1000 + epoch)  # the same order on every rank
        for i in range(batches_per_epoch):
            start = i * span + job.rank * args.batch
            yield x[start:start + args.batch], y[start:start + args.batch]

    evaluator = _train.make_evaluator(train_step, model, count_correct, device=device, amp=amp)

    def evaluate() -> float:
        return evaluate_accuracy(evaluator, dataset, args.eval_samples)

    result = _train.fit(args, recipe=RECIPE, model=model, optimizer=optimizer,
                        scheduler=scheduler, train_step=train_step, epoch_batches=epoch_batches,
                        steps_per_epoch=batches_per_epoch,
                        evaluate=evaluate if args.eval_samples != 0 else None, device=device,
                        start_step=start_step, config=config, job=job)
    data_kind = "real" if folder is not None else "synthetic"
    _train.finish(RECIPE, args, args.model, result, train_step, job, extra=f"data={data_kind}")
    return 0


def count_correct(model, batch) -> dict:
    """The evaluation step: how many images of the batch (images, labels) the model ranks
    their class first, as a device count."""
    images, labels = batch
    return {"correct": (model(images).argmax(1) == labels).sum()}


def evaluate_accuracy(evaluator, dataset: GpuCifar, limit: int | None,
                      batch: int = 1000) -> float:
    """Top-1 accuracy on the first `limit` test images (all of them for None) through the
    evaluation step (count_correct, in eval mode); the counts are summed on the device and
    read back once."""
    n = dataset.test_y.numel() if limit is None else min(limit, dataset.test_y.numel())

    def batches():
        for start in range(0, n, batch):
            end = min(start + batch, n)
            yield dataset.test_x[start:end], dataset.test_y[start:end]

    counts = _train.evaluate_counts(evaluator, batches())
    return counts.get("correct", 0) / max(n, 1)


if __name__ == "__main__":
    sys.exit(main())
