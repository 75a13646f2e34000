"""SmallCnn training step in C++ and Python, side by side in one process on one GPU.

The C++ quick start's model (examples/cpp/model.h: three 3x3 convolutions and a linear layer,
3x32x32 images, 10 classes), SGD with momentum 0.9 at a fixed lr of 0.05, cross-entropy:

    C++ eager               LibTorch's loop: zero_grad, forward, loss, backward, step
    C++ hand-written graph  warm-up on a side stream, then the whole step captured once with
                            at::cuda::CUDAGraph on static inputs; copy the batch in, replay
    C++ nimble_train::Step  the defaults, the loss a mean
    Python nt.Step          the same layers in torch.nn, torch.optim.SGD; streams=1 and the
                            default streams="auto"

    python bench/bench_cpp_step.py [--batch 32] [--steps 100] [--repeats 5] [--json out.json]

The C++ rows are a shared library (bench/cpp) that this script builds with CMake against the
installed package, into build/bench-cpp/, and loads with ctypes after torch: every row runs on
the same torch libraries and GPU context, with cuDNN autotuning on. Each row is the median
over --repeats of the mean of --steps consecutive steps, timed with CUDA events after --warm
untimed ones. Without a GPU it exits with code 2 (--build-only still builds and loads the
library).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys

import torch

import nimble_train as nt
from nimble_train.bench.timing import ms_per_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPP_SOURCE = os.path.join(ROOT, "bench", "cpp")
BATCHES = 4          # distinct batches, cycled (as the C++ rows)
LR, MOMENTUM = 0.05, 0.9

# Every row's label, in the order they run and print: the C++ library's modes, then
# Python's nt.Step by its streams argument.
CPP_ROWS = {"eager": "C++ eager (LibTorch)",
            "graph": "C++ hand-written whole-step graph",
            "step": "C++ nimble_train::Step"}
PY_ROWS = {1: "Python nt.Step, streams=1",
           "auto": 'Python nt.Step, streams="auto"'}


def build_library(build_dir: str) -> str | None:
    """Configures and builds bench/cpp against the installed package; the library's path, or
    None after printing CMake's output."""
    if shutil.which("cmake") is None:
        print("error: building the C++ rows needs cmake on PATH (pip install cmake)",
              file=sys.stderr)
        return None
    steps = [
        ["cmake", "-S", CPP_SOURCE, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
         f"-DCMAKE_PREFIX_PATH={nt.cmake_prefix_path}"]
        + (["-G", "Ninja"] if shutil.which("ninja") else []),
        ["cmake", "--build", build_dir],
    ]
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"error: {' '.join(command)} failed (exit code {done.returncode}):\n"
                  f"{done.stdout}{done.stderr}", file=sys.stderr)
            return None
    return os.path.join(build_dir, "libnt_bench_cpp.so")


def load_library(path: str) -> ctypes.CDLL:
    """The C++ rows; torch is imported first, so the library binds to the torch libraries this
    process has loaded."""
    lib = ctypes.CDLL(path)
    lib.nt_bench_ms_per_step.argtypes = [ctypes.c_char_p] + [ctypes.c_int] * 4
    lib.nt_bench_ms_per_step.restype = ctypes.c_double
    lib.nt_bench_last_error.argtypes = []
    lib.nt_bench_last_error.restype = ctypes.c_char_p
    return lib


def cpp_ms(lib: ctypes.CDLL, mode: str, args) -> float:
    ms = lib.nt_bench_ms_per_step(mode.encode(), args.batch, args.warm, args.steps,
                                  args.repeats)
    if ms < 0:
        raise RuntimeError(lib.nt_bench_last_error().decode(errors="replace"))
    return ms


def small_cnn() -> torch.nn.Sequential:
    """examples/cpp/model.h's SmallCnn in torch.nn: the same layers, torch.nn's initialisation
    (the same as LibTorch's)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


def python_ms(streams: int | str, args) -> float:
    torch.manual_seed(0)
    model = small_cnn().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    batches = [(torch.randn(args.batch, 3, 32, 32, device="cuda"),
                torch.randint(0, 10, (args.batch,), device="cuda")) for _ in range(BATCHES)]
    step = nt.Step(model, optimizer, torch.nn.functional.cross_entropy, streams=streams)
    try:
        ms = ms_per_step(step, batches, steps=args.steps, repeats=args.repeats, warm=args.warm)
        stats = step.stats()
        if stats["phase"] != "replay":
            raise RuntimeError(f"nt.Step did not replay: phase {stats['phase']}, "
                               f"capture error {stats['capture_error']}")
        return ms
    finally:
        step.close()


def ratio_lines(ms: dict[str, float | None]) -> list[tuple[str, float | None, str, bool | None]]:
    """(what, value, target, met) of each ratio the benchmark is judged by; ms is keyed by
    row label, None for a row that failed."""
    def div(a, b):
        return None if ms.get(a) is None or ms.get(b) is None else ms[a] / ms[b]

    step = CPP_ROWS["step"]
    rows = [("C++ Step speed-up over C++ eager (eager time / Step time)",
             div(CPP_ROWS["eager"], step), ">= 3x", lambda r: r >= 3.0),
            ("C++ Step time / hand-written graph time",
             div(step, CPP_ROWS["graph"]), "<= 1.0", lambda r: r <= 1.0)]
    rows += [(f"C++ Step time / {label} time", div(step, label), "<= 1.0", lambda r: r <= 1.0)
             for label in PY_ROWS.values()]
    return [(what, value, target, None if value is None else met(value))
            for what, value, target, met in rows]


def print_table(ms: dict[str, float | None], errors: dict[str, str], batch: int) -> None:
    width = max(len(label) for label in ms)
    print(f"{'mode':<{width}}  {'ms/step':>8}  {'samples/s':>10}")
    for label, value in ms.items():
        if value is None:
            print(f"{label:<{width}}  failed: {errors[label]}")
        else:
            print(f"{label:<{width}}  {value:8.3f}  {batch * 1000.0 / value:10.0f}")
    print()
    for what, value, target, met in ratio_lines(ms):
        shown = "n/a" if value is None else f"{value:.2f}"
        verdict = "" if met is None else ("met" if met else "NOT met")
        print(f"{what:<62} {shown:>6}  target {target:<6} {verdict}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per repeat")
    parser.add_argument("--warm", type=int, default=20,
                        help="untimed steps first (Step: warm-up 3 and capture 1 among them)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build", "bench-cpp"))
    parser.add_argument("--build-only", action="store_true",
                        help="build and load the C++ library, time nothing (no GPU needed)")
    args = parser.parse_args(argv)
    if min(args.batch, args.steps, args.repeats) < 1 or args.warm < 5:
        parser.error("--batch, --steps and --repeats must be at least 1, and --warm at least "
                     "5 (Step's warm-up and capture must be behind the timed steps)")
    if not args.build_only and not torch.cuda.is_available():
        print("bench_cpp_step times CUDA graphs on a GPU, and torch.cuda.is_available() is "
              "False here; run it on a GPU machine (--build-only checks the build)",
              file=sys.stderr)
        return 2

    path = build_library(args.build_dir)
    if path is None:
        return 1
    try:
        lib = load_library(path)
    except OSError as e:  # an installed nimble_train older than the headers it was built with
        print(f"error: {path} does not load: {e}; reinstall nimble_train and run again",
              file=sys.stderr)
        return 1
    if args.build_only:
        print(f"built and loaded {path}")
        return 0

    torch.backends.cudnn.benchmark = True  # the C++ rows set the same (one global context)
    ms: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    runs = ([(label, lambda key=key: cpp_ms(lib, key, args)) for key, label in CPP_ROWS.items()]
            + [(label, lambda s=s: python_ms(s, args)) for s, label in PY_ROWS.items()])
    for label, run in runs:
        try:
            ms[label] = run()
        except Exception as e:  # one failed row still leaves the others to compare
            ms[label], errors[label] = None, f"{type(e).__name__}: {e}"
        torch.cuda.empty_cache()

    print(f"SmallCnn, batch {args.batch}, SGD momentum {MOMENTUM} lr {LR}; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"nimble_train {nt.__version__}")
    print_table(ms, errors, args.batch)
    if args.json:
        result = {
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "nimble_train": nt.__version__, "batch": args.batch, "steps": args.steps,
            "warm": args.warm, "repeats": args.repeats,
            "rows": [{"mode": label, "ms_per_step": value,
                      "samples_per_s": None if value is None else args.batch * 1000.0 / value,
                      "error": errors.get(label)} for label, value in ms.items()],
            "ratios": [{"what": what, "value": value, "target": target, "met": met}
                       for what, value, target, met in ratio_lines(ms)],
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
