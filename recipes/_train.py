"""What the recipes share: flags, the step in each mode, the training loop with its progress
lines, checkpoints and the one-line summary.

A recipe (cifar10.py, bert.py) supplies the model, optimizer, scheduler, the batches of an
epoch and an evaluation; ``fit`` runs the epochs. Losses stay on the device: they are summed
there and read back only every --log-every steps (each read is one host sync), so the
captured step is never held up by the host. Evaluation does the same: an evaluation step
(``step.evaluator`` under nt.Step, the plain eager one otherwise) returns device counts, which
are summed on the device and read back once.

A checkpoint holds everything the next steps depend on: the weights, the optimizer, the
scheduler, the steps done (which fix the data order), every rank's random-number state
(dropout) and the fp16 loss scale; a resumed run therefore continues exactly as one that never
stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

import nimble_train as nt
from nimble_train._evaluator import evaluating
from nimble_train.bench.modes import dense_masks_while_compiling
from nimble_train.bench.workloads import forward_loss

MODES = ("eager", "compile", "step")
_AMP = {"none": None, "bf16": "bf16", "fp16": "fp16"}


# ---------------------------------------------------------------------- flags


def _streams(text: str):
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f'must be "auto" or an int >= 1; got {text!r}')
    return value


def base_parser(doc: str, *, batch: int | None, epochs: int, amp_help: str,
                lr_warmup: float, batch_help: str | None = None) -> argparse.ArgumentParser:
    """The flags every recipe has: mode, Step options, length, checkpoints, device. With
    batch=None, --batch defaults to None and the recipe picks the batch after parsing (and says
    how in `batch_help`)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 1)[1] if "\n\n" in doc else None)
    p.add_argument("--mode", choices=MODES, default="step",
                   help="eager PyTorch, torch.compile (model), or nt.Step (default)")
    p.add_argument("--epochs", type=int, default=epochs, help=f"epochs (default {epochs})")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many steps in this run (default: all epochs); the "
                        "learning-rate schedule still spans all epochs")
    p.add_argument("--batch", type=int, default=batch,
                   help=batch_help or f"samples per step (default {batch})")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--lr-warmup", type=float, default=lr_warmup,
                   help=f"fraction of the steps with a linearly rising lr (default {lr_warmup})")
    g = p.add_argument_group("nt.Step options (--mode step)")
    g.add_argument("--streams", type=_streams, default="auto", help='"auto" or at most N')
    g.add_argument("--warmup", type=int, default=3, help="eager steps before capture (3)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model inside nt.Step: the graph captures inductor's "
                        "kernels, on one stream (a longer first step, often faster steps)")
    g.add_argument("--no-capture", action="store_true",
                   help="never capture: same semantics, eager (debugging)")
    g.add_argument("--shard-optimizer", action="store_true",
                   help="under torchrun on GPUs: each rank keeps 1/N of the optimizer state "
                        "(ZeRO stage 1 inside the graph); checkpoints gather it whole")
    p.add_argument("--amp", choices=list(_AMP), default=None, help=amp_help)
    p.add_argument("--grad-clip", type=float, default=None, help="max global gradient norm")
    p.add_argument("--save", metavar="PATH",
                   help="checkpoint here after every epoch and at the end (weights, optimizer, "
                        "schedule, random-number states, fp16 loss scale)")
    p.add_argument("--resume", metavar="PATH", help="continue from this checkpoint")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50,
                   help="read the loss back (one host sync) every N steps (default 50)")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("epochs", "batch", "warmup", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be positive; got {args.lr}")
    if not 0 <= args.lr_warmup < 1:
        parser.error(f"--lr-warmup must be in [0, 1); got {args.lr_warmup}")
    if args.compile and args.mode != "step":
        parser.error(f"--compile compiles the model inside nt.Step (--mode step); with --mode "
                     f"{args.mode} leave it out (--mode compile is the plain loop, compiled)")
    if args.grad_clip is not None and not args.grad_clip > 0:
        parser.error(f"--grad-clip must be positive; got {args.grad_clip}")
    if args.shard_optimizer and args.mode != "step":
        parser.error(f"--shard-optimizer shards nt.Step's fused optimizer (--mode step); with "
                     f"--mode {args.mode} leave it out")
    if args.shard_optimizer and args.no_capture:
        parser.error("--shard-optimizer needs the captured step (its sharded update is the fused "
                     "one that capture sets up); leave out --no-capture or --shard-optimizer")
    if getattr(args, "eval_samples", None) is not None and args.eval_samples < 0:
        parser.error(f"--eval-samples must be >= 0 (0 skips the evaluation); got "
                     f"{args.eval_samples}")


@dataclass
class Job:
    """Where this process sits in a torchrun job (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def join_job(recipe: str, args) -> Job | None:
    """Under torchrun with several processes, joins the job: one GPU per process, data-parallel
    through nt.Step (which all-reduces gradients inside its graph), rank 0 alone printing and
    saving checkpoints. Returns None, after saying why, when the run cannot take part."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world == 1:
        if args.shard_optimizer:
            print("--shard-optimizer: one process keeps the whole optimizer state; it is sharded "
                  "over the ranks of a torchrun job on several GPUs")
        return Job()
    if args.mode != "step":
        print(f"{recipe}: under torchrun (WORLD_SIZE={world}) the recipes train data-parallel "
              f"with nt.Step (--mode step); --mode {args.mode} would train {world} unrelated "
              "models. Use --mode step, or run one process.", file=sys.stderr)
        return None
    if args.device not in (None, "cuda", "cpu"):
        print(f"{recipe}: under torchrun each process takes the GPU torchrun gives it "
              f"(LOCAL_RANK), or --device cpu; --device {args.device} does not apply",
              file=sys.stderr)
        return None
    if args.shard_optimizer and (args.device == "cpu" or not torch.cuda.is_available()):
        print(f"{recipe}: --shard-optimizer shards the state over GPUs (NCCL collectives inside "
              "the captured step); this job runs on the CPU. Leave out --shard-optimizer, or "
              "run on GPUs.", file=sys.stderr)
        return None
    info = nt.init_distributed(device=args.device)  # --device cpu: a small run over gloo
    args.device = str(info.device)
    if info.rank != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports; every rank's errors reach stderr
    return Job(info.rank, info.world_size)


def finish(recipe: str, args, model_name: str, result: Result, train_step, job: Job,
           extra: str) -> None:
    """Prints what Step did and the summary line; under torchrun, releases the step's
    communicator and leaves the process group, so that the job exits by itself."""
    if line := describe_step(train_step):
        print(line)
    print(summary(recipe, args, model_name, result, extra=f"{extra} gpus={job.world_size}"))
    if job.world_size > 1:
        if isinstance(train_step, nt.Step):
            train_step.close()
        # Every rank done with every collective before any tears its connections down: gloo
        # aborts a process whose peer left while it was still closing.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def check_save_path(args, job: Job) -> None:
    """--save PATH, before anything is trained: its folder is made (as the save would make it)
    and a file written there and removed, so that a path that cannot take a checkpoint fails
    now, not after the first epoch. Rank 0 alone saves, and alone checks."""
    if not args.save or not job.main:
        return
    path = args.save
    if os.path.isdir(path):
        raise SystemExit(f"--save {path}: is a folder; give a file path for the checkpoint, "
                         f"e.g. --save {os.path.join(path, 'ckpt.pt')}")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise SystemExit(f"--save {path}: {existing} is a file, not a folder; choose a path "
                         "in a folder")
    probe = _temporary(path)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise SystemExit(f"--save {path}: cannot write a checkpoint there ({exc.strerror or exc}: "
                         f"{exc.filename or folder}); choose a writable folder") from None


def pick_device(name: str | None) -> torch.device:
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    return device


def amp_of(args, device: torch.device, default_on_cuda: str | None) -> str | None:
    if args.amp is None:
        return default_on_cuda if device.type == "cuda" else None
    return _AMP[args.amp]


# ---------------------------------------------------------------------- the schedule


def planned_steps(args, steps_per_epoch: int, recipe: str) -> int:
    """Length of the learning-rate schedule: all --epochs (--steps only stops a run early, so
    a run stopped and resumed equals one that never stopped). A resumed run
    keeps the plan of the run that wrote the checkpoint."""
    planned = args.epochs * steps_per_epoch
    if args.resume:
        saved = checkpoint_config(args.resume, recipe).get("planned_steps", planned)
        if saved != planned:
            print(f"the checkpoint planned its learning-rate schedule over {saved} steps; "
                  f"keeping that (these options would plan {planned})")
        planned = saved
    return planned


def warmup_then_decay(total: int, warmup: int, decay: str) -> Callable[[int], float]:
    """lr factor of step s: rises linearly to 1 over `warmup` steps, then falls to 0 at `total`
    (linearly, or along a half cosine), and stays at 0 past it: a run extended beyond its plan
    never sees a negative or rising lr. With total=1000, warmup=100: 0.01 at step 0, 1 at step
    99, 0.5 at step 550 on either curve."""
    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        t = min(1.0, (s - warmup) / max(1, total - warmup))
        return 1 - t if decay == "linear" else 0.5 * (1 + math.cos(math.pi * t))
    return factor


def make_scheduler(optimizer, args, planned: int, decay: str):
    """LambdaLR writes param_groups[i]["lr"]: Step stages it for the graph, no recapture."""
    warmup = max(1, round(args.lr_warmup * planned))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay(planned, warmup, decay))


# ---------------------------------------------------------------------- the step


def autocast(device: torch.device, amp: str | None):
    if amp is None:
        return torch.autocast(device.type, enabled=False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    return torch.autocast(device.type, dtype=dtype)


def make_train_step(mode: str, model, optimizer, loss_fn, *, device: torch.device,
                    amp: str | None, streams, warmup: int, grad_clip: float | None,
                    capture: bool, compile_model: bool = False,
                    buckets: nt.Buckets | None = None,
                    shard_optimizer: bool = False) -> Callable[[Any], torch.Tensor]:
    """One training step in `mode`; returns the mean loss of the batch as a device tensor.

    eager and compile run the plain loop (zero_grad, forward, backward, clip, step) with the
    model itself or torch.compile(model); fp16 there uses torch's GradScaler. step is nt.Step,
    over torch.compile(model) with compile_model, padding variable-length batches to `buckets`
    (the plain loop takes each batch as it comes), its optimizer state sharded over the ranks
    of a data-parallel job with shard_optimizer.
    """
    if mode == "step":
        forward = torch.compile(model) if compile_model else model
        # A compiled model runs its weight gradients on a side stream unless streams=1;
        # inductor plans the rest.
        return nt.Step(forward, optimizer, loss_fn, streams=streams,
                       warmup=warmup, amp=amp, grad_clip=grad_clip, capture=capture,
                       buckets=buckets, shard_optimizer=shard_optimizer)
    # compile: with the dense attention masks Step's compiled models get, so that both run the
    # same attention kernels (nimble_train/_inductor_masks.py); at every call, as lengths vary
    forward = (dense_masks_while_compiling(torch.compile(model), calls=None)
               if mode == "compile" else model)
    return PlainStep(forward, optimizer, loss_fn, device=device, amp=amp, grad_clip=grad_clip)


class PlainStep:
    """The plain loop's step: zero_grad, forward, backward, clip, step; under fp16 through
    torch's GradScaler (`scaler`, None otherwise)."""

    def __init__(self, forward, optimizer, loss_fn, *, device: torch.device, amp: str | None,
                 grad_clip: float | None):
        self.forward, self.optimizer, self.loss_fn = forward, optimizer, loss_fn
        self.device, self.amp, self.grad_clip = device, amp, grad_clip
        self.scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
        self.params = [p for g in optimizer.param_groups for p in g["params"]]

    def __call__(self, batch) -> torch.Tensor:
        optimizer, scaler, clip = self.optimizer, self.scaler, self.grad_clip
        optimizer.zero_grad(set_to_none=True)
        with autocast(self.device, self.amp):
            loss = forward_loss(self.forward, self.loss_fn, batch)
        if scaler is None:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(self.params, clip)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(self.params, clip)
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()


def loss_scaler(train_step):
    """The fp16 loss scaler of a train step, None without one: the plain loop's GradScaler, or
    nt.Step's (torch's GradScaler in its eager steps until the update is fused, a
    DeviceLossScaler after). Both keep GradScaler's state_dict format."""
    if isinstance(train_step, nt.Step):
        # nt.Step offers no public accessor for its loss scaler; this is the one place that
        # reaches inside it.
        update = train_step._update
        return update.scaler if update.scaler is not None else update.grad_scaler
    return getattr(train_step, "scaler", None)


# ---------------------------------------------------------------------- evaluation


class EagerEvaluator:
    """The plain loop's evaluation step (--mode eager, compile): ``fn(model, batch)`` in eval
    mode, without autograd, under the run's autocast; every module's own mode back after. It
    keeps the contract of nt.Step's ``step.evaluator(fn)``, which captures the same call."""

    def __init__(self, model, fn: Callable[[Any, Any], dict], *, device: torch.device,
                 amp: str | None):
        self.model, self.fn, self.device, self.amp = model, fn, device, amp

    def __call__(self, batch) -> dict:
        with evaluating(self.model), torch.no_grad(), autocast(self.device, self.amp):
            return self.fn(self.model, batch)


def make_evaluator(train_step, model, fn: Callable[[Any, Any], dict], *, device: torch.device,
                   amp: str | None) -> Callable[[Any], dict]:
    """An evaluation step running ``fn(model, batch) -> {name: device count}``: nt.Step's
    ``evaluator`` (captured into the step's pool once the step replays, each batch padded to its
    bucket), or the eager one for the plain loop (which evaluates the model itself, not
    torch.compile's wrapper, as it always has)."""
    if isinstance(train_step, nt.Step):
        return train_step.evaluator(fn)
    return EagerEvaluator(model, fn, device=device, amp=amp)


def evaluate_counts(evaluator: Callable[[Any], dict], batches: Iterable) -> dict[str, float]:
    """The evaluator's outputs summed over `batches`: the sums stay on the device and are read
    back together at the end (one host sync); empty when there are no batches."""
    sums: dict[str, torch.Tensor] = {}
    for batch in batches:
        for name, value in evaluator(batch).items():
            sums[name] = sums[name] + value if name in sums else value
    if not sums:
        return {}
    # float64 holds every count below 2^53 exactly
    values = torch.stack([v.to(torch.float64) for v in sums.values()]).tolist()
    return dict(zip(sums, values))


# ---------------------------------------------------------------------- checkpoints


# Execution choices of an optimizer's param groups (not training state): a checkpoint written
# by a captured Step (fused SGD, capturable Adam) resumes in any mode and on any device.
_EXECUTION_KEYS = ("fused", "foreach", "capturable", "differentiable")
# What every recipe checkpoint holds ("rng" and "loss_scale" came later: older checkpoints lack
# them).
_CHECKPOINT_KEYS = ("recipe", "config", "step", "epoch", "model", "optimizer", "scheduler")


def rng_state(device: torch.device) -> dict:
    """This process's random-number state: the CPU generator's and, training on a GPU, that
    GPU's (dropout draws from the generator of the device it runs on)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def gather_rng_states(job: Job, device: torch.device) -> list[dict]:
    """Every rank's random-number state, in rank order. Under torchrun this is a collective:
    every rank calls it, and rank 0 saves the list."""
    mine = rng_state(device)
    if job.world_size == 1:
        return [mine]
    states = [None] * job.world_size
    torch.distributed.all_gather_object(states, mine)
    return states


def restore_rng(states: list[dict], job: Job, device: torch.device) -> None:
    """Sets this rank's generators to the state its rank saved. A job of another size cannot
    continue exactly anyway (each rank's share of the data changes): a rank the checkpoint
    has no state for takes rank 0's."""
    if len(states) != job.world_size:
        print(f"the checkpoint holds the random-number states of {len(states)} process(es), "
              f"this run has {job.world_size}: dropout does not continue exactly")
    state = states[job.rank] if job.rank < len(states) else states[0]
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def loss_scale_state(train_step) -> dict | None:
    """The fp16 loss scale and its growth tracker (GradScaler's format; one host sync), or
    None without fp16. Gradients are averaged before the overflow check, so every rank holds
    the same scale and rank 0's stands for all."""
    scaler = loss_scaler(train_step)
    return (scaler.state_dict() or None) if scaler is not None else None


def _temporary(path: str) -> str:
    return f"{path}.tmp{os.getpid()}"


class _Terminated(BaseException):
    """SIGTERM arrived while a checkpoint was being written."""


@contextlib.contextmanager
def _sigterm_raises():
    """Inside the block, SIGTERM (how torchrun and batch schedulers stop a job) raises instead
    of killing the process outright, so that the block's cleanup runs; the process then dies
    of it as it would have. Only where SIGTERM has its default action, and only in the main
    thread (the one that may set handlers): a program's own handler is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def terminate(signum, frame):
        raise _Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_atomically(state: dict, path: str) -> None:
    """torch.save to PATH.tmpPID, then a rename over PATH: a save that fails or is stopped
    (an exception, Ctrl-C, SIGTERM) leaves the previous checkpoint as it was and removes its
    temporary file. Only SIGKILL, which no process can catch, leaves the file behind."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = _temporary(path)
    with _sigterm_raises():
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise


def save_checkpoint(path: str, *, recipe: str, model, optimizer, scheduler, step: int,
                    steps_per_epoch: int, config: dict, rng: list[dict],
                    loss_scale: dict | None) -> None:
    """Model, optimizer, scheduler, the steps done (epochs done: step // steps_per_epoch), every
    rank's random-number state (`rng`, by rank) and the fp16 loss scale (None without fp16)."""
    state = {"recipe": recipe, "config": config, "step": step,
             "epoch": step // steps_per_epoch, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": rng, "loss_scale": loss_scale}
    write_atomically(state, path)


def _why_unreadable(path: str, exc: BaseException) -> str:
    """Why torch.load could not read `path`, in a few words. torch's own messages advise
    weights_only=False or saving again with other options, neither of which fits here."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if not head:
        return "the file is empty"
    if head != b"PK\x03\x04":  # torch.save writes a zip archive
        return "not a file written by torch.save (it is no zip archive)"
    if isinstance(exc, pickle.UnpicklingError):
        return "it holds Python objects other than tensors and plain values"
    return "truncated or corrupt (torch cannot read its zip archive; a save cut short?)"


def _describe(value) -> str:
    """What a loaded file holds, in a few words: `a dict with the keys ['a', 'b']`, or the first
    few of many (a bare model state_dict has hundreds)."""
    if not isinstance(value, dict):
        return f"a {type(value).__name__}"
    keys = sorted(str(k) for k in value)
    if len(keys) <= 8:
        return f"a dict with the keys {keys}"
    return f"a dict of {len(keys)} keys ({', '.join(keys[:3])}, ...)"


def read_checkpoint(path: str, recipe: str, **load_options) -> dict:
    """A checkpoint of `recipe`, checked: a readable torch.save file holding what
    save_checkpoint writes, written by this recipe. Anything else ends the run with one line
    that names the file and says what was expected."""
    expected = f"expected a checkpoint written by recipes/{recipe}.py --save"
    if not os.path.exists(path):
        raise SystemExit(f"--resume {path}: no such file")
    if os.path.isdir(path):
        raise SystemExit(f"--resume {path}: is a folder; {expected}")
    try:
        state = torch.load(path, weights_only=True, **load_options)
    except Exception as exc:  # a foreign file fails in the zip reader or the unpickler, any type
        raise SystemExit(f"--resume {path}: {_why_unreadable(path, exc)}; {expected}") from None
    if (not isinstance(state, dict) or not all(key in state for key in _CHECKPOINT_KEYS)
            or not isinstance(state["config"], dict)):
        raise SystemExit(f"--resume {path}: holds {_describe(state)}, not a recipe checkpoint "
                         f"({', '.join(_CHECKPOINT_KEYS)}); {expected}")
    if state["recipe"] != recipe:
        raise SystemExit(f"--resume {path}: a checkpoint of recipes/{state['recipe']}.py, not of "
                         f"recipes/{recipe}.py; {expected}")
    return state


def checkpoint_config(path: str, recipe: str) -> dict:
    """The options a checkpoint was written with (memory-mapped: nothing else is read)."""
    return read_checkpoint(path, recipe, map_location="cpu", mmap=True)["config"]


@contextlib.contextmanager
def _must_fit(path: str, what: str):
    """A checkpoint of the right recipe and options whose `what` still does not load (edited,
    or damaged inside) ends the run with one line, not torch's multi-line report."""
    try:
        yield
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        detail = " ".join(str(exc).split())
        detail = detail if len(detail) <= 200 else detail[:197] + "..."
        raise SystemExit(f"--resume {path}: its {what} does not fit this run "
                         f"({type(exc).__name__}: {detail}); expected a checkpoint of the same "
                         "recipe and options, unmodified") from None


def load_checkpoint(path: str, *, recipe: str, model, optimizer, scheduler, train_step,
                    config: dict, device: torch.device, job: Job,
                    config_defaults: dict | None = None) -> int:
    """Restores a checkpoint in place (this rank's random-number state, and the loss scale
    into the train step's scaler); returns the steps done. `config_defaults`: the values of
    options that older checkpoints do not record (they were written before the option)."""
    state = read_checkpoint(path, recipe, map_location=device)
    defaults = config_defaults or {}
    for key, value in config.items():
        saved = state["config"].get(key, defaults.get(key))
        if saved != value:
            raise SystemExit(f"--resume {path}: the checkpoint has {key}={saved!r} but this run "
                             f"asks for {key}={value!r}; pass the same options")
    with _must_fit(path, "model"):
        model.load_state_dict(state["model"])
    chosen = [{k: g[k] for k in _EXECUTION_KEYS if k in g} for g in optimizer.param_groups]
    with _must_fit(path, "optimizer state"):
        optimizer.load_state_dict(state["optimizer"])
    for group, keep in zip(optimizer.param_groups, chosen):
        group.update(keep)
        if not (group.get("capturable") or group.get("fused")):
            # Adam's step counter lives on the host unless captured or fused (Step moves it
            # back to the device when it captures).
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                    optimizer.state[p]["step"] = step.cpu()
    with _must_fit(path, "scheduler state"):
        scheduler.load_state_dict(state["scheduler"])
    if state.get("rng") is None:
        print(f"{path} holds no random-number state (an older checkpoint): dropout does not "
              "continue exactly")
    else:
        with _must_fit(path, "random-number state"):
            restore_rng(state["rng"], job, device)
    scaler, saved_scale = loss_scaler(train_step), state.get("loss_scale")
    if scaler is not None and saved_scale is not None:
        # Before the step's first call this is torch's GradScaler, whose scale nt.Step carries
        # into its device-side scaler when it fuses the update.
        with _must_fit(path, "loss scale"):
            scaler.load_state_dict(saved_scale)
    return state["step"]


# ---------------------------------------------------------------------- the loop


@dataclass
class Progress:
    """Sums losses on the device; reads them back every `every` steps and prints a line.

    Throughput counts only training time (evaluation and checkpoints excluded). The summary's
    steady-state rate starts after the first `skip` steps of the run, which hold the warm-up,
    the capture or the compilation. Variable-length batches also count their real tokens
    (padding excluded), which the host gives with each step.
    """

    device: torch.device
    batch: int
    every: int
    skip: int
    total: torch.Tensor = None
    steps: int = 0                      # steps of this run
    read: float = 0.0                   # the loss sum at the last read-back
    read_steps: int = 0
    last_mean: float = float("nan")     # mean loss of the last interval read back
    last_count: int = 0                 # steps in that interval
    interval_start: float = 0.0
    interval_steps: int = 0
    interval_tokens: int = 0
    train_seconds: float = 0.0          # all training time of this run
    train_tokens: int = 0
    steady_seconds: float = 0.0         # after the first `skip` steps
    steady_steps: int = 0
    steady_tokens: int = 0
    counts_tokens: bool = False         # whether the steps give their tokens

    def __post_init__(self):
        self.total = torch.zeros((), dtype=torch.float64, device=self.device)  # no drift
        self.resume_clock()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def resume_clock(self) -> None:
        self._sync()
        self.interval_start = time.perf_counter()
        self.interval_steps = self.interval_tokens = 0

    def _close_interval(self) -> tuple[float, float]:
        """Ends the timed interval; its samples/s and real tokens/s."""
        self._sync()
        now = time.perf_counter()
        seconds = now - self.interval_start
        self.train_seconds += seconds
        self.train_tokens += self.interval_tokens
        if self.steps - self.interval_steps >= self.skip:  # the interval is past the skip
            self.steady_seconds += seconds
            self.steady_steps += self.interval_steps
            self.steady_tokens += self.interval_tokens
        self.interval_start = now
        steps, tokens = self.interval_steps, self.interval_tokens
        self.interval_steps = self.interval_tokens = 0
        if seconds <= 0:
            return float("nan"), float("nan")
        return steps / seconds * self.batch, tokens / seconds

    def update(self, loss: torch.Tensor, describe: Callable[[], str],
               tokens: int | None = None) -> None:
        """One step's loss (a device tensor) and, for variable-length batches, its real tokens
        over every rank (a host int)."""
        self.total += loss.detach().float()  # a device add: no host sync
        self.steps += 1
        self.interval_steps += 1
        if tokens is not None:
            self.counts_tokens = True
            self.interval_tokens += tokens
        if self.steps % self.every == 0:
            rate, token_rate = self._close_interval()
            mean = self.read_back()
            rates = f"{rate:,.0f} samples/s" + (f"  {token_rate:,.0f} real tokens/s"
                                               if self.counts_tokens else "")
            print(f"{describe()}  loss {mean:.4f}  {rates}", flush=True)
        elif self.steps == self.skip:
            self._close_interval()  # a silent boundary: what follows is steady state

    def read_back(self) -> float:
        """Mean loss since the last read-back (one host sync)."""
        now = self.total.item()
        if self.steps > self.read_steps:
            self.last_count = self.steps - self.read_steps
            self.last_mean = (now - self.read) / self.last_count
        self.read, self.read_steps = now, self.steps
        return self.last_mean

    def pause(self) -> None:
        """Before evaluation or a checkpoint: closes the timed interval."""
        self._close_interval()

    def _steady(self) -> tuple[float, int, int]:
        """Seconds, steps and tokens of the steady state; of the whole run when it was too
        short to have one."""
        if self.steady_steps == 0:
            return self.train_seconds, self.steps, self.train_tokens
        return self.steady_seconds, self.steady_steps, self.steady_tokens

    def samples_per_s(self) -> float:
        seconds, steps, _ = self._steady()
        return steps * self.batch / seconds if seconds > 0 else float("nan")

    def tokens_per_s(self) -> float | None:
        """Real (non-padding) tokens per second, None when the steps count no tokens."""
        if not self.counts_tokens:
            return None
        seconds, _, tokens = self._steady()
        return tokens / seconds if seconds > 0 else float("nan")


@dataclass
class Result:
    epochs_done: float  # 1.5: one epoch and half of the next
    steps_done: int
    train_loss: float
    accuracy: float | None  # None: evaluation skipped (--eval-samples 0)
    samples_per_s: float
    tokens_per_s: float | None = None  # real tokens (padding excluded); None: not counted


def resume(args, *, recipe: str, model, optimizer, scheduler, train_step, config: dict,
           device: torch.device, steps_per_epoch: int, job: Job | None = None,
           config_defaults: dict | None = None) -> int:
    """--resume: restores the checkpoint (after the train step is made: its loss scaler takes
    the saved scale) and says where training goes on; returns the steps already done (0
    without --resume)."""
    if not args.resume:
        return 0
    step = load_checkpoint(args.resume, recipe=recipe, model=model, optimizer=optimizer,
                           scheduler=scheduler, train_step=train_step, config=config,
                           device=device, job=job or Job(), config_defaults=config_defaults)
    print(f"resumed {args.resume} at step {step} (epoch {step / steps_per_epoch:.3g})")
    return step


def _accuracy_text(accuracy: float | None) -> str:
    return "skipped (--eval-samples 0)" if accuracy is None else f"{accuracy:.4f}"


def fit(args, *, recipe: str, model, optimizer, scheduler, train_step,
        epoch_batches: Callable[[int], Iterable], steps_per_epoch: int,
        evaluate: Callable[[], float] | None, device: torch.device, start_step: int,
        config: dict, job: Job | None = None,
        epoch_tokens: Callable[[int], Sequence[int]] | None = None) -> Result:
    """Trains from step `start_step` to the end of args.epochs (or for args.steps steps),
    evaluating (unless `evaluate` is None) and checkpointing after every epoch and where
    --steps stops the run.

    Every epoch has `steps_per_epoch` batches in an order fixed by its number, so the step
    count alone says where training stands: a run resumed in the middle of an epoch skips the
    batches already seen and continues exactly. `epoch_tokens(epoch)`, for variable-length
    batches: the real tokens of each of the epoch's steps over every rank, known on the host
    (counting them on the device would cost a sync a step); the rates then count tokens too.
    """
    job = job or Job()
    progress = Progress(device=device, batch=args.batch * job.world_size, every=args.log_every,
                        skip=max(5, args.warmup + 2))
    step_count, accuracy = start_step, None
    cap = args.steps if args.steps is not None else math.inf
    while step_count < args.epochs * steps_per_epoch and progress.steps < cap:
        epoch, seen = divmod(step_count, steps_per_epoch)
        tokens = epoch_tokens(epoch) if epoch_tokens is not None else None
        model.train()
        for i, batch in enumerate(epoch_batches(epoch)):
            if i < seen:
                continue  # already trained on before the checkpoint: slices, nothing computed
            if progress.steps >= cap:
                break
            loss = train_step(batch)
            scheduler.step()
            step_count += 1
            progress.update(loss, lambda: (f"epoch {epoch + 1} step {i + 1}/{steps_per_epoch}"
                                           f"  lr {optimizer.param_groups[0]['lr']:.3g}"),
                            tokens=None if tokens is None else int(tokens[i]))
        progress.pause()
        train_loss = progress.read_back()
        accuracy = evaluate() if evaluate is not None else None
        done = step_count - epoch * steps_per_epoch
        where = f"epoch {epoch + 1}/{args.epochs}"
        if done < steps_per_epoch:
            where += f" (stopped by --steps after {done}/{steps_per_epoch} steps)"
        print(f"{where}: train loss {train_loss:.4f} (mean of the last {progress.last_count} "
              f"steps)  test accuracy {_accuracy_text(accuracy)}", flush=True)
        if args.save:
            rng = gather_rng_states(job, device)  # every rank takes part
            if isinstance(train_step, nt.Step):  # a sharded state, whole on every rank
                train_step.consolidate_optimizer_state()
            if job.main:
                save_checkpoint(args.save, recipe=recipe, model=model, optimizer=optimizer,
                                scheduler=scheduler, step=step_count,
                                steps_per_epoch=steps_per_epoch, config=config, rng=rng,
                                loss_scale=loss_scale_state(train_step))
                print(f"saved {args.save} (step {step_count}, epoch "
                      f"{step_count / steps_per_epoch:.3g})")
        progress.resume_clock()
    if progress.steps == 0 and evaluate is not None:
        accuracy = evaluate()  # nothing left to train (a resumed, finished run): still evaluate
    return Result(epochs_done=step_count / steps_per_epoch, steps_done=step_count,
                  train_loss=progress.last_mean, accuracy=accuracy,
                  samples_per_s=progress.samples_per_s(), tokens_per_s=progress.tokens_per_s())


def describe_step(train_step) -> str | None:
    """What nt.Step did (captured or not, replays, eager steps; per shape bucket; its
    evaluators), one line each, else None."""
    if not isinstance(train_step, nt.Step):
        return None
    s = train_step.stats()
    if not s.get("captured"):
        why = s.get("capture_error") or "capture is off, or the model is not on a CUDA device"
        lines = [f"nt.Step: {s.get('eager_steps')} eager steps, no graph ({why})"]
    else:
        lines = [f"nt.Step: captured, {s.get('replays')} graph replays and "
                 f"{s.get('eager_steps')} eager steps, {s.get('streams')} stream(s), "
                 f"{s.get('graph_nodes')} graph nodes, pool "
                 f"{(s.get('pool_bytes') or 0) / 2**20:.0f} MiB"]
    if (s.get("optimizer_shards") or 1) > 1:
        lines.append(f"nt.Step optimizer: state sharded over {s['optimizer_shards']} ranks")
    if s.get("shape_buckets"):
        lines.append("nt.Step buckets: " + ", ".join(
            f"{size} ({'captured, ' if b['captured'] else ''}{b['replays']} replays, "
            f"{b['eager_steps']} eager)" for size, b in s["shape_buckets"].items()))
    for e in s.get("evaluators") or []:
        buckets = [str(size) for size in e["captured_buckets"] if size is not None]
        where = f" (buckets {', '.join(buckets)})" if buckets else ""
        lines.append(f"step.evaluator: {e['graphs']} graph(s){where}, {e['replays']} replays, "
                     f"{e['eager']} eager calls")
    return "\n".join(lines)


def summary(recipe: str, args, model_name: str, result: Result, extra: str = "") -> str:
    """The run's one-line result; samples/s (and for variable-length batches real_tokens/s,
    padding excluded) is the steady-state training rate."""
    accuracy = "skipped" if result.accuracy is None else f"{result.accuracy:.4f}"
    tokens = ("" if result.tokens_per_s is None
              else f" real_tokens_per_s={result.tokens_per_s:.0f}")
    return (f"summary: {recipe} mode={args.mode} model={model_name} "
            f"epochs={result.epochs_done:.3g} steps={result.steps_done} "
            f"train_loss={result.train_loss:.4f} test_accuracy={accuracy} "
            f"samples_per_s={result.samples_per_s:.0f}{tokens}" + (f" {extra}" if extra else ""))


def describe_run(device: torch.device, args, amp) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    step = ""
    if args.mode == "step":
        step = (f", streams={args.streams}, warmup={args.warmup}"
                + (", model compiled" if args.compile else "")
                + (", capture off" if args.no_capture or device.type != "cuda" else ""))
    return (f"device {device} ({where}), torch {torch.__version__}, nimble_train "
            f"{nt.__version__}; mode {args.mode}{step}, amp {amp or 'off'}, "
            f"loss read back every {args.log_every} steps")
