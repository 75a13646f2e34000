"""Fused optimizer updates on a BERT-base-sized parameter set (109.5 M float32 parameters in
BERT's own tensor shapes), against torch's fused and foreach optimizers, in one process.

    python bench/bench_optim.py [--repeats 5] [--iters 20]

First measures device-to-device copy bandwidth (the floor of a memory-bound pass), then for
SGD-momentum, AdamW and LAMB, each with fp16-style unscaling and global-norm clipping on, and
AdamW / SGD also without: the median time per step (CUDA events, median of repeats), the
bandwidth achieved (bytes the algorithm must move / time) and its fraction of the copy
bandwidth, and the ratio to torch's equivalents. Ours is timed as a CUDA graph replay, as
nt.Step runs it; torch's as eager calls (their own fastest way to run).
"""

from __future__ import annotations

import argparse

import torch

from nimble_train.bench.timing import time_ms
from nimble_train.optim import LAMB, FusedOptimizer


def bert_base_shapes() -> list[tuple[tuple[int, ...], bool]]:
    """(shape, decays) of BertModel(bert-base-uncased): 109,482,240 parameters."""
    h, ff, layers = 768, 3072, 12
    shapes = [((30522, h), True), ((512, h), True), ((2, h), True), ((h,), False), ((h,), False)]
    for _ in range(layers):
        for _ in range(4):  # query, key, value, attention output
            shapes += [((h, h), True), ((h,), False)]
        shapes += [((h,), False), ((h,), False)]  # attention LayerNorm
        shapes += [((ff, h), True), ((ff,), False), ((h, ff), True), ((h,), False)]
        shapes += [((h,), False), ((h,), False)]  # output LayerNorm
    shapes += [((h, h), True), ((h,), False)]  # pooler
    return shapes


def make_params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for shape, _ in bert_base_shapes():
        p = (torch.randn(shape, device="cuda", generator=g) * 0.02).requires_grad_()
        p.grad = torch.randn(shape, device="cuda", generator=g) * 1e-3
        params.append(p)
    return params


def param_groups(params, **decay):
    flags = [d for _, d in bert_base_shapes()]
    return [{"params": [p for p, d in zip(params, flags) if d], **decay},
            {"params": [p for p, d in zip(params, flags) if not d], "weight_decay": 0.0}]


def copy_bandwidth(repeats: int) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted)."""
    src = torch.empty(1 << 28, device="cuda")  # 1 GiB of float32
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), repeats, 10)
    del src, dst
    return 2 * (1 << 30) / (ms * 1e-3)


def graph_of(fn):
    """fn captured once (after an eager warm-up on a side stream); returns graph.replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def torch_unscale_clip(params, inv_scale, found_inf, max_norm):
    """GradScaler.unscale_ then clip_grad_norm_, torch's multi-tensor way."""
    grads = [p.grad for p in params]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_optim needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    r, it = args.repeats, args.iters
    n = sum(torch.Size(s).numel() for s, _ in bert_base_shapes())
    bw = copy_bandwidth(r)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"parameters: {n / 1e6:.1f} M float32 in {len(bert_base_shapes())} tensors "
          "(BERT-base), 2 groups (decay / no decay)")
    print(f"device-to-device copy bandwidth: {bw / 1e12:.3f} TB/s "
          f"(floor for 4 bytes/param moved: {4 * n / bw * 1e3:.3f} ms)\n")

    inv_scale = torch.full((1,), 1 / 1024.0, device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    max_norm = 1.0
    # Bytes each algorithm must move per parameter (float32): reads + writes of p, g, state.
    # The norm / overflow pass adds one read of g; LAMB's second pass re-reads p, m, v and
    # rewrites p (its per-tensor trust ratio needs the whole tensor's update norm first).
    algorithms = {
        "SGD-momentum": dict(
            bytes=20, ours=lambda p: torch.optim.SGD(param_groups(p), lr=0.1, momentum=0.9,
                                                     weight_decay=1e-4),
            torch={"fused": lambda p: torch.optim.SGD(param_groups(p), lr=0.1, momentum=0.9,
                                                      weight_decay=1e-4, fused=True),
                   "foreach": lambda p: torch.optim.SGD(param_groups(p), lr=0.1, momentum=0.9,
                                                        weight_decay=1e-4, foreach=True)}),
        "AdamW": dict(
            bytes=28, ours=lambda p: torch.optim.AdamW(param_groups(p, weight_decay=0.01),
                                                       lr=1e-4),
            torch={"fused": lambda p: torch.optim.AdamW(param_groups(p, weight_decay=0.01),
                                                        lr=1e-4, fused=True),
                   "foreach": lambda p: torch.optim.AdamW(param_groups(p, weight_decay=0.01),
                                                          lr=1e-4, foreach=True)}),
        "LAMB": dict(
            bytes=40, ours=lambda p: LAMB(param_groups(p, weight_decay=0.01), lr=1e-3),
            torch={"nimble_train.optim.LAMB eager":
                   lambda p: LAMB(param_groups(p, weight_decay=0.01), lr=1e-3)}),
    }
    targets = {"SGD-momentum": 0.78, "AdamW": 1.08, "LAMB": 1.3}
    header = f"{'':34s} {'ms':>7s} {'TB/s':>6s} {'of copy':>7s} {'vs ours':>8s}"
    for name, spec in algorithms.items():
        for clip in (True, False):
            if name == "LAMB" and not clip:
                continue
            moved = (spec["bytes"] + (4 if clip else 0)) * n
            floor_ms = moved / bw * 1e3
            label = "unscale + clip" if clip else "plain step"
            print(f"{name}, {label}: {moved / n:.0f} bytes/param, floor {floor_ms:.3f} ms"
                  + (f", target {targets[name]} ms" if clip else ""))
            print(header)
            params = make_params(0)
            fused = FusedOptimizer(spec["ours"](params))
            if clip:
                step = lambda: fused.step(inv_scale=inv_scale, found_inf=found_inf,  # noqa: E731
                                          max_grad_norm=max_norm)
            else:
                step = fused.step
            eager_ms = time_ms(step, r, it)  # before capture: eager steps stage by themselves
            replay = graph_of(step)

            def ours_graph():
                fused.stage_host_values()
                replay()

            ours_ms = time_ms(ours_graph, r, it)
            rows = [("ours (graph replay)", ours_ms), ("ours (eager call)", eager_ms)]
            del fused, params, replay, step
            torch.cuda.empty_cache()
            for kind, make in spec["torch"].items():
                params = make_params(0)
                opt = make(params)
                if clip:
                    def torch_step():
                        torch_unscale_clip(params, inv_scale, found_inf, max_norm)
                        opt.step()
                else:
                    torch_step = opt.step
                iters = it if "eager" not in kind else max(2, it // 5)
                rows.append((f"torch {kind}" if "LAMB" not in kind else kind,
                             time_ms(torch_step, r, iters)))
                del opt, params
                torch.cuda.empty_cache()
            for label_row, ms in rows:
                achieved = moved / (ms * 1e-3)
                print(f"  {label_row:32s} {ms:7.3f} {achieved / 1e12:6.3f} {achieved / bw:6.1%} "
                      f"{ms / ours_ms:7.2f}x")
            print()


if __name__ == "__main__":
    main()
