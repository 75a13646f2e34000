"""A tiny end-to-end training run through nimble_train, on the GPU when there is one.

A student MLP learns the labels of a fixed random teacher network (a learnable synthetic task,
so no dataset is needed). Gradients are clipped on the device by nimble_train's flat_scale_
kernel: the clip factor is computed and applied without a host sync.

    python recipes/tiny.py [--steps 300] [--batch 256] [--device cuda]
"""

import argparse
import sys
import time

import torch

import nimble_train as nt


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch", type=int, default=256, help="samples per step (default 256)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clip threshold")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        parser.error(f"--steps and --batch must be >= 1; got {args.steps} and {args.batch}")
    return args


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """Scales gradients so their global norm is at most max_norm; returns the norm, on device."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0).float().reshape(1)
    for g in grads:
        nt._C.flat_scale_(g, factor)
    return norm


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not nt.has_cuda():
        sys.exit(f"--device cuda asked for, but {nt.build_info()['cuda']['reason']}")
    torch.manual_seed(args.seed)
    print(nt.describe_build())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {device} ({where}), torch {torch.__version__}")

    features, classes = 32, 10
    teacher = torch.nn.Linear(features, classes).to(device)
    model = torch.nn.Sequential(
        torch.nn.Linear(features, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, classes),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(args.batch, features, device=device)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        losses.append(loss.detach())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        x = torch.randn(4096, features, device=device)
        accuracy = (model(x).argmax(1) == teacher(x).argmax(1)).float().mean().item()
    first, last = losses[0].item(), torch.stack(losses[-10:]).mean().item()
    print(f"tiny: {args.steps} steps on {device}, loss {first:.3f} -> {last:.3f}, "
          f"accuracy {accuracy:.3f}, {args.steps / elapsed:.0f} steps/s")
    if args.steps >= 100 and not last < 0.5 * first:
        print(f"tiny: the loss did not halve ({first:.3f} -> {last:.3f}); training is broken",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
