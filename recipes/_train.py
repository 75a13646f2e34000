"""What the recipes share: flags, the step in each mode, the training loop with its progress
lines, checkpoints and the one-line summary.

A recipe (cifar10.py, bert.py) supplies the model, optimizer, scheduler, the batches of an
epoch and an evaluation; ``fit`` runs the epochs. Losses stay on the device: they are summed
there and read back only every --log-every steps (each read is one host sync), so the
captured step is never held up by the host.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

import nimble_train as nt
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


def base_parser(doc: str, *, batch: int, epochs: int, amp_help: str,
                lr_warmup: float) -> argparse.ArgumentParser:
    """The flags every recipe has: mode, Step options, length, checkpoints, device."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 1)[1] if "\n\n" in doc else None)
    p.add_argument("--mode", choices=MODES, default="step",
                   help="eager PyTorch, torch.compile (model), or nt.Step (default)")
    p.add_argument("--epochs", type=int, default=epochs, help=f"epochs (default {epochs})")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many steps in this run (default: all epochs); the "
                        "learning-rate schedule still spans all epochs")
    p.add_argument("--batch", type=int, default=batch, help=f"samples per step (default {batch})")
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
    p.add_argument("--amp", choices=list(_AMP), default=None, help=amp_help)
    p.add_argument("--grad-clip", type=float, default=None, help="max global gradient norm")
    p.add_argument("--save", metavar="PATH", help="checkpoint here after every epoch and at the end")
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
        torch.distributed.destroy_process_group()


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


def planned_steps(args, steps_per_epoch: int) -> int:
    """Length of the learning-rate schedule: all --epochs (--steps only stops a run early, so
    a run stopped and resumed equals one that never stopped). A resumed run
    keeps the plan of the run that wrote the checkpoint."""
    planned = args.epochs * steps_per_epoch
    if args.resume:
        saved = checkpoint_config(args.resume).get("planned_steps", planned)
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
                    capture: bool, compile_model: bool = False
                    ) -> Callable[[Any], torch.Tensor]:
    """One training step in `mode`; returns the mean loss of the batch as a device tensor.

    eager and compile run the plain loop (zero_grad, forward, backward, clip, step) with the
    model itself or torch.compile(model); fp16 there uses torch's GradScaler. step is nt.Step,
    over torch.compile(model) with compile_model.
    """
    if mode == "step":
        forward = torch.compile(model) if compile_model else model
        return nt.Step(forward, optimizer, loss_fn, streams=1 if compile_model else streams,
                       warmup=warmup, amp=amp, grad_clip=grad_clip, capture=capture)
    forward = torch.compile(model) if mode == "compile" else model
    scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, amp):
            loss = forward_loss(forward, loss_fn, batch)
        if scaler is None:
            loss.backward()
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if grad_clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()
    return step


# ---------------------------------------------------------------------- checkpoints


# Execution choices of an optimizer's param groups (not training state): a checkpoint written
# by a captured Step (fused SGD, capturable Adam) resumes in any mode and on any device.
_EXECUTION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def save_checkpoint(path: str, *, recipe: str, model, optimizer, scheduler, step: int,
                    steps_per_epoch: int, config: dict) -> None:
    """Model, optimizer, scheduler and the steps done (epochs done: step // steps_per_epoch);
    written atomically, so an interrupted save leaves the previous checkpoint intact."""
    state = {"recipe": recipe, "config": config, "step": step,
             "epoch": step // steps_per_epoch, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def checkpoint_config(path: str) -> dict:
    """The options a checkpoint was written with (memory-mapped: nothing else is read)."""
    if not os.path.exists(path):
        raise SystemExit(f"--resume {path}: no such file")
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["config"]


def load_checkpoint(path: str, *, recipe: str, model, optimizer, scheduler, config: dict,
                    device: torch.device) -> int:
    """Restores a checkpoint in place; returns the steps done."""
    if not os.path.exists(path):
        raise SystemExit(f"--resume {path}: no such file")
    state = torch.load(path, map_location=device, weights_only=True)
    if state.get("recipe") != recipe:
        raise SystemExit(f"--resume {path}: a checkpoint of the {state.get('recipe')!r} recipe, "
                         f"not of {recipe!r}")
    for key, value in config.items():
        if state["config"].get(key) != value:
            saved = state["config"].get(key)
            raise SystemExit(f"--resume {path}: the checkpoint has {key}={saved!r} but this run "
                             f"asks for {key}={value!r}; pass the same options")
    model.load_state_dict(state["model"])
    chosen = [{k: g[k] for k in _EXECUTION_KEYS if k in g} for g in optimizer.param_groups]
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
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]


# ---------------------------------------------------------------------- the loop


@dataclass
class Progress:
    """Sums losses on the device; reads them back every `every` steps and prints a line.

    Throughput counts only training time (evaluation and checkpoints excluded). The summary's
    steady-state rate starts after the first `skip` steps of the run, which hold the warm-up,
    the capture or the compilation.
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
    train_seconds: float = 0.0          # all training time of this run
    steady_seconds: float = 0.0         # after the first `skip` steps
    steady_steps: int = 0

    def __post_init__(self):
        self.total = torch.zeros((), dtype=torch.float64, device=self.device)  # no drift
        self.resume_clock()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def resume_clock(self) -> None:
        self._sync()
        self.interval_start = time.perf_counter()
        self.interval_steps = 0

    def _close_interval(self) -> float:
        self._sync()
        now = time.perf_counter()
        seconds = now - self.interval_start
        self.train_seconds += seconds
        if self.steps - self.interval_steps >= self.skip:  # the interval is past the skip
            self.steady_seconds += seconds
            self.steady_steps += self.interval_steps
        self.interval_start = now
        elapsed_steps, self.interval_steps = self.interval_steps, 0
        return elapsed_steps / seconds * self.batch if seconds > 0 else float("nan")

    def update(self, loss: torch.Tensor, describe: Callable[[], str]) -> None:
        self.total += loss.detach().float()  # a device add: no host sync
        self.steps += 1
        self.interval_steps += 1
        if self.steps % self.every == 0:
            rate = self._close_interval()
            mean = self.read_back()
            print(f"{describe()}  loss {mean:.4f}  {rate:,.0f} samples/s", flush=True)
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

    def samples_per_s(self) -> float:
        seconds, steps = self.steady_seconds, self.steady_steps
        if steps == 0:  # a run too short to have a steady state: all of it
            seconds, steps = self.train_seconds, self.steps
        return steps * self.batch / seconds if seconds > 0 else float("nan")


@dataclass
class Result:
    epochs_done: float  # 1.5: one epoch and half of the next
    steps_done: int
    train_loss: float
    accuracy: float
    samples_per_s: float




def resume(args, *, recipe: str, model, optimizer, scheduler, config: dict,
           device: torch.device, steps_per_epoch: int) -> int:
    """--resume: restores the checkpoint and says where training goes on; returns the steps
    already done (0 without --resume)."""
    if not args.resume:
        return 0
    step = load_checkpoint(args.resume, recipe=recipe, model=model, optimizer=optimizer,
                           scheduler=scheduler, config=config, device=device)
    print(f"resumed {args.resume} at step {step} (epoch {step / steps_per_epoch:.3g})")
    return step

def fit(args, *, recipe: str, model, optimizer, scheduler, train_step,
        epoch_batches: Callable[[int], Iterable], steps_per_epoch: int,
        evaluate: Callable[[], float], device: torch.device, start_step: int,
        config: dict, job: Job | None = None) -> Result:
    """Trains from step `start_step` to the end of args.epochs (or for args.steps steps),
    evaluating and checkpointing after every epoch and where --steps stops the run.

    Every epoch has `steps_per_epoch` batches in an order fixed by its number, so the step
    count alone says where training stands: a run resumed in the middle of an epoch skips the
    batches already seen and continues exactly.
    """
    job = job or Job()
    progress = Progress(device=device, batch=args.batch * job.world_size, every=args.log_every,
                        skip=max(5, args.warmup + 2))
    step_count, accuracy = start_step, float("nan")
    cap = args.steps if args.steps is not None else math.inf
    while step_count < args.epochs * steps_per_epoch and progress.steps < cap:
        epoch, seen = divmod(step_count, steps_per_epoch)
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
                                           f"  lr {optimizer.param_groups[0]['lr']:.3g}"))
        progress.pause()
        train_loss = progress.read_back()
        accuracy = evaluate()
        done = step_count - epoch * steps_per_epoch
        where = f"epoch {epoch + 1}/{args.epochs}"
        if done < steps_per_epoch:
            where += f" (stopped by --steps after {done}/{steps_per_epoch} steps)"
        print(f"{where}: train loss {train_loss:.4f} (mean of the last {progress.last_count} "
              f"steps)  test accuracy {accuracy:.4f}", flush=True)
        if args.save and job.main:
            save_checkpoint(args.save, recipe=recipe, model=model, optimizer=optimizer,
                            scheduler=scheduler, step=step_count,
                            steps_per_epoch=steps_per_epoch, config=config)
            print(f"saved {args.save} (step {step_count}, epoch "
                  f"{step_count / steps_per_epoch:.3g})")
        progress.resume_clock()
    if progress.steps == 0:  # nothing left to train (a resumed, finished run): still evaluate
        accuracy = evaluate()
    return Result(epochs_done=step_count / steps_per_epoch, steps_done=step_count,
                  train_loss=progress.last_mean, accuracy=accuracy,
                  samples_per_s=progress.samples_per_s())


def describe_step(train_step) -> str | None:
    """One line on what nt.Step did (captured or not, replays, eager steps), else None."""
    if not isinstance(train_step, nt.Step):
        return None
    s = train_step.stats()
    if not s.get("captured"):
        why = s.get("capture_error") or "capture is off, or the model is not on a CUDA device"
        return f"nt.Step: {s.get('eager_steps')} eager steps, no graph ({why})"
    return (f"nt.Step: captured, {s.get('replays')} graph replays and {s.get('eager_steps')} "
            f"eager steps, {s.get('streams')} stream(s), {s.get('graph_nodes')} graph nodes, "
            f"pool {(s.get('pool_bytes') or 0) / 2**20:.0f} MiB")


def summary(recipe: str, args, model_name: str, result: Result, extra: str = "") -> str:
    """The run's one-line result; samples/s is the steady-state training rate."""
    return (f"summary: {recipe} mode={args.mode} model={model_name} "
            f"epochs={result.epochs_done:.3g} steps={result.steps_done} "
            f"train_loss={result.train_loss:.4f} test_accuracy={result.accuracy:.4f} "
            f"samples_per_s={result.samples_per_s:.0f}" + (f" {extra}" if extra else ""))


def describe_run(device: torch.device, args, amp) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    step = ""
    if args.mode == "step":
        streams = 1 if args.compile else args.streams
        step = (f", streams={streams}, warmup={args.warmup}"
                + (", model compiled" if args.compile else "")
                + (", capture off" if args.no_capture or device.type != "cuda" else ""))
    return (f"device {device} ({where}), torch {torch.__version__}, nimble_train "
            f"{nt.__version__}; mode {args.mode}{step}, amp {amp or 'off'}, "
            f"loss read back every {args.log_every} steps")
