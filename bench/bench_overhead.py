"""Host cost of one training step: eager, a hand-written graph, bare replay and nt.Step.

    python bench/bench_overhead.py                       # tiny MLP b64 and ResNet-18/CIFAR b32
    python bench/bench_overhead.py --workloads mlp --calls 12 --steps 400

For each workload, in one process on one GPU, four ways of running the same training step:

- eager: zero_grad, forward, loss, backward, optimizer.step() (torch's default foreach SGD);
- hand-written graph: PyTorch's documented whole-step capture recipe, each call copying the
  batch into the static inputs and calling ``graph.replay()``;
- bare replay: the same graph's ``replay()`` alone, no copy-in (a floor for any replay path);
- nt.Step: ``nt.Step(model, optimizer, loss_fn)`` with its defaults, as a new user writes it
  (streams="auto": ResNet-18's plan puts its downsampling shortcuts on a second stream), and
  with streams=1, the graph the hand-written one is comparable to.

Two figures per way:

- host µs per call: the CPU time of a call while the GPU is kept busy by a sleep kernel, so
  that no call waits on the GPU (calls queue up behind the sleep). Median of repeats of
  --calls calls (12: within any staging ring's depth). A ResNet step's graph holds about a
  thousand kernels and fills CUDA's launch queue within a replay or two, after which a launch
  waits for the GPU: there each sample is one call;
- wall µs per step: CUDA events around a run of consecutive steps (median of repeats): the
  larger of the host cost and the GPU's own time per step.

The tiny MLP (256-256-10, batch 64, SGD momentum) is host-bound: there the host cost is the
step's cost. ResNet-18/CIFAR at batch 32 is GPU-bound: there nothing should regress.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import nimble_train as nt
from nimble_train._torch_private import cuda_sleep
from nimble_train.bench.workloads import cifar_model, cifar_optimizer, random_cifar_batches


# ---------------------------------------------------------------------- workloads


def _mlp(batch: int, device):
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10)).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator(device=device).manual_seed(0)
    batches = [(torch.randn(batch, 256, device=device, generator=g),
                torch.randint(0, 10, (batch,), device=device, generator=g)) for _ in range(8)]
    return make, F.cross_entropy, batches


def _resnet18(batch: int, device):
    def make():
        torch.manual_seed(0)
        model = cifar_model("resnet18", device)
        return model, cifar_optimizer(model, 0.05)
    return make, torch.nn.CrossEntropyLoss(reduction="none"), random_cifar_batches(
        batch, 8, device)


WORKLOADS = {
    "mlp": ("tiny MLP 256-256-10, SGD momentum", _mlp, 64),
    "resnet18": ("ResNet-18/CIFAR, SGD Nesterov, channels-last", _resnet18, 32),
}


def _mean_loss(loss_fn, outputs, target):
    loss = loss_fn(outputs, target)
    return loss.mean() if loss.dim() else loss


# ---------------------------------------------------------------------- the four ways


def eager(make, loss_fn, batches):
    model, optimizer = make()

    def step(batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        loss = _mean_loss(loss_fn, model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step, None


def hand_graph(make, loss_fn, batches):
    """PyTorch's recipe: warm-up on a side stream, then forward, backward and step captured
    with the gradients set to None; the replay copies the batch into the static inputs."""
    model, optimizer = make()
    static = tuple(t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:3]:
            optimizer.zero_grad(set_to_none=True)
            _mean_loss(loss_fn, model(x), y).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _mean_loss(loss_fn, model(static[0]), static[1])
        static_loss.backward()
        optimizer.step()

    def step(batch):
        for dst, src in zip(static, batch):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_loss
    step.model = model
    return step, graph


def bare_replay(make, loss_fn, batches):
    _, graph = hand_graph(make, loss_fn, batches)

    def step(batch):
        graph.replay()
    step.graph = graph
    return step, None


def nt_step(make, loss_fn, batches):
    model, optimizer = make()
    step = nt.Step(model, optimizer, loss_fn)
    return step, None


def nt_step_one_stream(make, loss_fn, batches):
    model, optimizer = make()
    step = nt.Step(model, optimizer, loss_fn, streams=1)
    return step, None


WAYS = {"eager": eager, "hand-written copy-in + replay": hand_graph,
        "bare graph.replay()": bare_replay, "nt.Step": nt_step,
        "nt.Step, streams=1": nt_step_one_stream}


# ---------------------------------------------------------------------- timing


def _sleep_cycles_per_ms() -> float:
    cycles = 10_000_000
    cuda_sleep(cycles)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    cuda_sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def host_us(step, batches, calls: int, repeats: int, sleep_cycles: int) -> float:
    """CPU µs per call with the GPU busy, so no call waits for it (median of repeats)."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        cuda_sleep(sleep_cycles)
        t0 = time.perf_counter()
        for i in range(calls):
            step(batches[i % len(batches)])
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        samples.append((t1 - t0) / calls * 1e6)
    return statistics.median(samples)


def wall_us(step, batches, steps: int, repeats: int) -> float:
    """µs per step over `steps` consecutive steps, CUDA events (median of repeats)."""
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(steps):
            step(batches[i % len(batches)])
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / steps * 1e3)
    return statistics.median(samples)


def run(name: str, args, cycles_per_ms: float) -> list[tuple[str, float, float]]:
    title, build, batch = WORKLOADS[name]
    make, loss_fn, batches = build(batch, "cuda")
    rows = []
    for way, factory in WAYS.items():
        step, _ = factory(make, loss_fn, batches)
        for i in range(30):  # warm-up, capture and a few replays
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
        # A ResNet step launches about a thousand kernels, eagerly or in a graph: one call fits
        # CUDA's launch queue, more would wait on the GPU and time it instead of the host.
        calls = args.calls if name == "mlp" else 1
        # The sleep outlasts the calls' host time several times over.
        sleep = int(cycles_per_ms * max(20.0, 0.5 * calls))
        h = host_us(step, batches, calls, args.repeats, sleep)
        w = wall_us(step, batches, args.steps, args.repeats)
        rows.append((way, h, w))
        print(f"  {name:9s} {way:32s} host {h:8.1f} µs/call   wall {w:8.1f} µs/step",
              flush=True)
        if hasattr(step, "close"):
            step.close()
        del step
        gc.collect()
        torch.cuda.synchronize()
    print(f"\n{title}, batch {batch}")
    print("| way | host µs per call | wall µs per step | host ÷ hand-written "
          "| wall ÷ hand-written |")
    print("|---|---|---|---|---|")
    hand = next(r for r in rows if r[0].startswith("hand"))
    for way, h, w in rows:
        print(f"| {way} | {h:.1f} | {w:.1f} | {h / hand[1]:.2f} | {w / hand[2]:.3f} |")
    print()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=list(WORKLOADS))
    parser.add_argument("--calls", type=int, default=12,
                        help="calls per host-time sample on the MLP (12)")
    parser.add_argument("--steps", type=int, default=300, help="steps per wall-time sample")
    parser.add_argument("--repeats", type=int, default=15, help="samples; the median is kept")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_overhead times steps on a CUDA GPU; torch.cuda.is_available() is False",
              file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, nimble_train "
          f"{nt.__version__}")
    cycles = _sleep_cycles_per_ms()
    for name in args.workloads:
        run(name, args, cycles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
