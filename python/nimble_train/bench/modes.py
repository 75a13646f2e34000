"""The ways of running one training step that the benchmark compares.

Every mode builds its own model and optimizer from the same seed and runs the same batches:
eager PyTorch, eager with torch's fused optimizer, torch.compile (default and reduce-overhead),
the whole step captured by hand as one CUDA graph (PyTorch's documented recipe, with its
default optimizer and with torch's fused one), and nt.Step on one stream and with
streams="auto". Each anchor is set up as a competent user would:
reduce-overhead runs torch's fused optimizer (one kernel per step, where the default foreach
optimizer's launches cost 0.5 ms of host time per ResNet-18 step on an H100, while the GPU
waits); ``compile-ro-opt`` compiles the optimizer step too, as PyTorch's compiled-optimizer
recipe does (``torch.compile(optimizer.step)``, default mode: its CUDA graphs under
reduce-overhead overwrite the model graphs' outputs). The hand-written graphs capture with the
dense attention masks Step gives scaled_dot_product_attention (:func:`anchor_capture`), and the
compiled rows compile with them (:func:`dense_masks_while_compiling`), so that every row runs
the same fused attention kernel as Step and the eager loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .._attention import DenseAttentionMasks
from .._torch_private import pytree
from ..step import Step
from .workloads import Workload, forward_loss

StepFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class Mode:
    key: str                                   # what --modes takes
    label: str                                 # what the table and the chart show
    build: Callable[[Workload], StepFn]
    first_fast_call: Callable[[StepFn], int]   # which call is the first fast-path step


@contextlib.contextmanager
def warmed(mode: Mode, w: Workload, fast_calls: int = 20):
    """`mode` built on workload `w` and called past its warm-up and capture, then
    `fast_calls` times more; closed (a Step's pool released) and the cache emptied after the
    block, so that the next mode built starts from the same memory."""
    step = mode.build(w)
    try:
        for i in range(mode.first_fast_call(step) + fast_calls):
            step(w.batches[i % len(w.batches)])
        yield step
    finally:
        close = getattr(step, "close", None)
        if callable(close):
            close()
        del step
        torch.cuda.empty_cache()


def _autocast(amp: str | None, *, cache: bool = True):
    if amp is None:
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    # Inside a captured graph the autocast cache would keep casts made during capture alive.
    return torch.autocast("cuda", dtype=dtype, cache_enabled=cache)


def _fresh(w: Workload, seed: int = 0, **optimizer_options):
    torch.manual_seed(seed)
    model = w.make_model()
    return model, w.make_optimizer(model, **optimizer_options)


def _eager_loop(w: Workload, forward: Callable, model, optimizer, *,
                update: Callable | None = None) -> StepFn:
    """zero_grad, forward, loss, backward, update (`update`, else optimizer.step)."""
    update = update or optimizer.step

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        with _autocast(w.amp):
            loss = forward_loss(forward, w.loss_fn, batch)
        loss.backward()
        update()
        return loss.detach()
    step.model = model  # keeps the module alive with the step function
    return step


def eager(w: Workload) -> StepFn:
    model, optimizer = _fresh(w)
    return _eager_loop(w, model, model, optimizer)


def eager_fused(w: Workload) -> StepFn:
    model, optimizer = _fresh(w, fused=True)
    return _eager_loop(w, model, model, optimizer)


def _compiled(mode: str | None, *, fused: bool | None = None,
              compile_update: bool = False) -> Callable[[Workload], StepFn]:
    """torch.compile(model, mode=mode); the optimizer fused (`fused`) or its step compiled
    (`compile_update`, PyTorch's compiled-optimizer recipe)."""
    def build(w: Workload) -> StepFn:
        torch._dynamo.reset()  # no reuse of an earlier mode's compiled code
        model, optimizer = _fresh(w, fused=fused)
        forward = dense_masks_while_compiling(torch.compile(model, mode=mode))
        update = torch.compile(optimizer.step) if compile_update else None
        return _eager_loop(w, forward, model, optimizer, update=update)
    return build


def dense_masks_while_compiling(forward: Callable, calls: int | None = 3) -> Callable:
    """`forward` (a compiled model) whose first `calls` calls (every call: None), where
    torch.compile traces and reduce-overhead records, compile with the dense attention masks
    Step's compiled models get; later calls go straight to `forward`. Fixed shapes need the
    first three; shapes that vary recompile later, and need every call.

    Traced, Hugging Face's masking code (transformers 5.17, no mask given) builds an all-True
    broadcast mask that SDPA's fused kernels refuse, so inductor compiles SDPA's math path, in
    float32 for bfloat16 inputs; later versions of transformers give no mask there. A user
    finds the float32 products in a profile; the anchor compiles the dense mask Step's pass
    makes (nimble_train/_inductor_masks.py), so that rows compare compilers, not attention
    kernels or transformers' versions."""
    from .._inductor_masks import DenseMaskPass, compiled_dense_masks  # loads inductor's
    graph_pass, seen = DenseMaskPass(), 0

    def call(*args, **kwargs):
        nonlocal seen
        if calls is not None and seen >= calls:
            return forward(*args, **kwargs)
        seen += 1
        with compiled_dense_masks(graph_pass):
            return forward(*args, **kwargs)
    return call


@contextlib.contextmanager
def anchor_capture(graph: torch.cuda.CUDAGraph):
    """torch.cuda.graph(graph), with the attention masks Step's captures give SDPA.

    Captured, a Hugging Face model builds even an all-ones attention mask, as a broadcast view
    that SDPA's fused kernels refuse; SDPA then runs its math path (a BERT-base b32 graph on
    an H100: 26.41 ms instead of 20.73). A user tuning a hand-written graph finds that in a
    profile and hands SDPA a dense mask, as Step does (nimble_train/_attention.py); the anchor
    does the same, so that it compares graphs, not attention kernels."""
    with torch.cuda.graph(graph), DenseAttentionMasks():
        yield


def hand_graph(w: Workload, *, fused: bool = False, memsets_as_kernels: bool = False) -> StepFn:
    """PyTorch's whole-network capture recipe, written out by hand: three warm-up steps on a
    side stream, then forward, backward and optimizer step captured with gradients set to None
    (so backward writes fresh gradients rather than accumulating into old ones); SDPA gets
    dense attention masks in the capture (:func:`anchor_capture`). The recipe's optimizer is
    torch's default (foreach, capturable where torch asks for it); `fused`: torch's fused one,
    one kernel per parameter group, which a user tuning the graph would pick.
    `memsets_as_kernels`: the captured graph's memset nodes rewritten as kernels before it is
    instantiated, as Step's captures are (src/capture/graph_nodes.h): the recipe with the
    launch cost Step removes removed too."""
    # fused=None, not False: torch's default then picks foreach, which False would turn off.
    model, optimizer = _fresh(w, fused=fused or None, capturable=True)
    static = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                             w.batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for batch in w.batches[:3]:
            optimizer.zero_grad(set_to_none=True)
            with _autocast(w.amp):
                loss = forward_loss(model, w.loss_fn, batch)
            loss.backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=memsets_as_kernels)
    optimizer.zero_grad(set_to_none=True)
    with anchor_capture(graph):
        with _autocast(w.amp, cache=False):
            static_loss = forward_loss(model, w.loss_fn, static)
        static_loss.backward()
        optimizer.step()
    if memsets_as_kernels:
        from .._extension import _C
        _C.graph_memsets_as_kernels(graph.raw_cuda_graph(), torch.cuda.current_device())
        graph.instantiate()
    return graph_step(graph, static, static_loss, model, optimizer)


def graph_step(graph: torch.cuda.CUDAGraph, static, static_loss: torch.Tensor, model,
               optimizer: torch.optim.Optimizer) -> StepFn:
    """The replay of a hand-captured whole-step graph: each call copies the batch into the
    static inputs the graph was captured with and launches it. The step function keeps the
    model and the optimizer alive: the graph reads and writes their tensors (the optimizer's
    state, made in the warm-up outside the graph's pool, among them), and memory freed with
    them would be handed to other allocations while replays still wrote it."""
    static_leaves = [t for t in pytree.tree_leaves(static) if isinstance(t, torch.Tensor)]

    def step(batch):
        leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
        for dst, src in zip(static_leaves, leaves):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_loss
    step.model, step.optimizer = model, optimizer
    return step


def _nt_step(streams, compiled: bool = False) -> Callable[[Workload], StepFn]:
    def build(w: Workload) -> StepFn:
        if compiled:
            torch._dynamo.reset()  # no reuse of an earlier mode's compiled code
        model, optimizer = _fresh(w)
        forward = torch.compile(model) if compiled else model
        return Step(forward, optimizer, w.loss_fn, streams=streams, amp=w.amp)
    return build


MODES: dict[str, Mode] = {m.key: m for m in [
    Mode("eager", "eager", eager, lambda s: 1),
    Mode("eager-fused", "eager + fused optimizer", eager_fused, lambda s: 1),
    Mode("compile", "torch.compile", _compiled(None), lambda s: 1),
    # cudagraph trees warm up on the first call, record on the second, replay from the third.
    Mode("compile-ro", "torch.compile reduce-overhead", _compiled("reduce-overhead",
                                                                  fused=True), lambda s: 3),
    Mode("compile-ro-opt", "reduce-overhead + compiled optimizer",
         _compiled("reduce-overhead", compile_update=True), lambda s: 3),
    Mode("graph", "hand-written whole-step graph", hand_graph, lambda s: 1),
    Mode("graph-fused", "hand-written graph, fused opt.",
         lambda w: hand_graph(w, fused=True), lambda s: 1),
    Mode("graph-fused-kernels", "hand-written graph, fused opt., memsets as kernels",
         lambda w: hand_graph(w, fused=True, memsets_as_kernels=True), lambda s: 1),
    Mode("step", "nt.Step, 1 stream", _nt_step(1), lambda s: s.warmup + 1),
    Mode("step-auto", 'nt.Step, streams="auto"', _nt_step("auto"), lambda s: s.warmup + 1),
    # Step's default streams: a compiled model's weight gradients go to a side stream
    Mode("step-compile", "nt.Step over torch.compile(model)", _nt_step("auto", compiled=True),
         lambda s: s.warmup + 1),
]}
