"""A Step's captured graph: capture through the C++ runtime, and what a failed capture means.

``_C.StepGraph`` (src/capture/step_graph.h) owns the graphs, their shared private pool, the
static inputs and the staging ring; here the Python side drives a capture (the body is Python:
the user's forward, autograd, our update) and turns a failure into the error the user needs.
A failure is classified by mechanism: CUDA *invalidates* a capture when a call it forbids runs
inside it, which is how a host synchronisation (``.item()``, ``.cpu()``, a data-dependent
shape) fails; that, with the host syncs warm-up recorded, is a SyncError. Anything else is a
CaptureError. Either way the capture is abandoned in C++ and nothing of it stays behind.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from . import _torch_private
from ._attention import DenseAttentionMasks
from ._batch_norm import CapturedBatchNorms
from ._max_pool import our_max_pool
from ._small_conv import candidates as small_conv_candidates, small_convs
from ._extension import _C
from ._iteration import LateGradient, MisdirectedGradient
from ._multistream import (CHAIN, COMPILED, build_multistream, traced_submodule,
                           untraced_reason, warn_single_stream)
from ._optimizer_state import HostStateError
from ._weight_grads import eligible, plan_weight_grads, split_weight_grads, weight_grads_first
from .errors import CaptureError, NimbleError, SyncError, one_line

# streams="auto" plans the forward on several streams (and the backward's weight gradients on
# side streams). False: the backward's plan alone; bench/bench_streams.py times what the
# forward's plan adds to it.
PLAN_FORWARD = True
FORWARD_OFF = "the forward's plan is switched off"
# Which batch-norm kernels a training capture runs (see _batch_norm.py): "auto", PyTorch's
# native ones where the forward is planned and cuDNN's where it runs on one stream (the
# backward's plan alone included); "cudnn", cuDNN's everywhere (bench/bench_streams.py times
# both); "native", the native ones in every training capture (tests compare one stream with
# several on the same kernels).
BATCH_NORM_KERNELS = "auto"
# Which max-pooling kernels every capture runs (see _max_pool.py): "ours" on the inputs they
# take, torch's on the rest; "torch", torch's everywhere (benchmarks time one against the other).
MAX_POOL_KERNELS = "ours"
# Which kernels every capture runs for a stem, a convolution of few input channels (see
# _small_conv.py): "ours" on the inputs they take, torch's on the rest; "torch", torch's
# everywhere (bench/bench_small_conv.py times one against the other).
SMALL_CONV_KERNELS = "ours"
# Whether a planned forward runs each batch norm with the activation after it (a ReLU, with a
# residual added in between or not, or an exact GELU) as one operator, on the native statistics
# and kernels of ours (see _batch_norm_act.py); False: as the model calls them
# (bench/bench_batch_norm_act.py times one against the other).
FUSE_BATCH_NORM_ACT = True
# Whether every capture's memset nodes become kernel nodes before its graph is instantiated
# (src/capture/graph_nodes.h: cuDNN's workspace memsets among kernels made each launch cost the
# host microseconds per node, as long as the step on the GPU); False: as captured
# (bench/bench_graph_launch.py times one against the other).
MEMSETS_AS_KERNELS = True

@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's garbage collector off for the block (a capture): a collection inside a capture
    can free CUDA objects of earlier steps (graphs, their pools, events) whose release the
    capture forbids, invalidating it at its next operation or aborting the process from a
    destructor. What became garbage meanwhile is collected after, as usual. (No collection
    first: with torch's modules loaded one takes a good part of a second, a capture's time.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


if TYPE_CHECKING:  # imported when a compiled model needs it: it loads inductor's modules
    from . import _inductor_grads, _inductor_wgrad


@contextlib.contextmanager
def running_in_place(module: torch.nn.Module, forward) -> Iterator[None]:
    """Within the block, calls of `module` run `forward` (its planned forward) instead of its
    own forward; the module's hooks still run around it."""
    missing = object()
    own = module.__dict__.get("forward", missing)
    module.forward = forward
    try:
        yield
    finally:
        if own is missing:
            del module.forward
        else:
            module.forward = own


class CapturedStep:
    """The C++ step graph of one Step: per shape bucket (one without buckets) an entry with the
    bucket's static inputs, further entries over the same inputs (the micro-batch and update
    graphs of accumulation), and the entries of evaluators, with inputs of their own.

    Each training launch stages [valid samples, *extra, *update values]: `extra` values of the
    Step's own (accumulation's loss weight and gradient correction), then the update's."""

    def __init__(self, device: torch.device, extra: int, update_values: int, layout):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.graph = _C.StepGraph(torch.device("cuda", index), extra + update_values)
        # bucket b's inputs are entry bases[b]; batches[b] is the static batch its capture reads
        self.bases = [self.graph.add_entry(layout.specs(b)) for b in range(len(layout.sizes))]
        self.batches = [layout.template.unflatten(self.graph.inputs(e)) for e in self.bases]
        self.outputs: dict[int, object] = {}  # each captured entry's output (a training loss)
        # Each training graph's loss, outside the pool (_loss_out): a 0-dim buffer per entry of
        # loss_dtype (the Step's, from its eager steps: float32, or a scalar loss's own),
        # allocated before its first capture; and, by a buffer's data address, the loss
        # its capture's body returned, which a replay's result stands for (an integration finds
        # what that body recorded by its address: Step._loss_made). Held, so that no later
        # capture's loss takes that address.
        self._loss_buffers: dict[int, torch.Tensor] = {}
        self.loss_made: dict[int, torch.Tensor] = {}
        self.loss_dtype = torch.float32
        # For the same reason, an update graph's gradient norm when the optimizer runs as it is
        # (clip_grad_norm_'s, made in the graph; the fused update's is in its own table): a
        # 0-dim buffer per entry of the norm's dtype (norm_buffer), written as the loss is.
        self._norm_buffers: dict[int, torch.Tensor] = {}
        self.unplanned: set[int] = set()  # entries of evaluation graphs
        self.dense_masks = False  # captures give SDPA dense attention masks (plan_streams)
        self.current = self.graph.current  # [1 + extra + update_values]
        self.update_values = self.current[1 + extra:]
        # Accumulation's loss weight (0-dim) and gradient correction ([1]), as launches stage.
        self.scales = (self.current[1], self.current[2:3]) if extra else (None, None)
        self.multistream = None  # the forward on several streams, once planned
        # The submodule whose forward that plan is, run in its place (traced_submodule); None:
        # the plan is the model's forward, which the step body is given.
        self._inside: torch.nn.Module | None = None
        self.single_stream_reason: str | None = None
        self.weight_grads = None  # the backward's weight-gradient side stream, once planned
        self.weight_grads_off: str | None = None  # why there is none
        self._split_model: torch.nn.Module | None = None  # whose layers the plan splits
        # A compiled model's: the pass that splits its backward (the Step's)
        self.compiled_split: _inductor_wgrad.SplitBackward | None = None
        self.compiled_launches = 0  # its launches on side streams in the last capture
        # and the one that makes its weight products in their flat views (the Step's)
        self.compiled_products: _inductor_grads.WeightProducts | None = None
        # The model whose batch norms every capture wraps (their batch counters advanced in one
        # kernel), the model whose batch norms a planned capture runs with the native kernels,
        # if any, how many the last planned capture ran so, and how many batch counters the
        # last training capture advanced together.
        self._bn_model: torch.nn.Module | None = None
        self._native_bn_model: torch.nn.Module | None = None
        self.native_bn_layers = 0
        self.bn_counters = 0
        self.fused_bn_layers = 0
        # The model whose max-pools every capture runs on our kernels, and how many the last
        # capture wrapped.
        self._max_pool_model: torch.nn.Module | None = None
        self.max_pool_layers = 0
        # The model whose stems every capture runs on our kernels, and how many layers the
        # last capture wrapped.
        self._small_conv_model: torch.nn.Module | None = None
        self.small_conv_layers = 0

    @property
    def splits_compiled(self) -> bool:
        """Whether compiled code has run weight gradients on side streams."""
        return self.compiled_split is not None and self.compiled_split.launched > 0

    @property
    def valid(self) -> torch.Tensor:
        """The running launch's valid-sample count, on the device (0-dim view)."""
        return self.current[0]

    @property
    def captured(self) -> bool:
        """Whether any graph is captured."""
        return any(self.graph.captured(e) for e in range(self.graph.num_entries))

    def new_entry(self, bucket: int) -> int:
        """Another graph over bucket `bucket`'s static inputs."""
        return self.graph.add_entry_sharing_inputs(self.bases[bucket])

    def add_unplanned_entry(self, specs: list) -> int:
        """An evaluation graph's entry, with static inputs of its own."""
        entry = self.graph.add_entry(specs)
        self.unplanned.add(entry)
        return entry

    def plan_streams(self, model: torch.nn.Module, streams, device: torch.device, *,
                     gradients=None, example: tuple | None = None,
                     compiled_split: _inductor_wgrad.SplitBackward | None = None,
                     compiled_products: _inductor_grads.WeightProducts | None = None,
                     inside_example: tuple | None = None) -> None:
        """Plans the streams, once, before the first capture: the forward traced and assigned
        to several streams, and the backward's weight gradients on a side stream
        (`gradients`: data parallel, the GradientSync that side stream reports to). `example`:
        the model's (args, kwargs), which size the operators. `compiled_split`: a compiled
        model's, the pass that put its weight gradients on a side stream as
        inductor compiled it; `compiled_products`, the pass that rewrote its weight products.
        A model that names a submodule to trace in its place
        (traced_submodule) gets that submodule's forward planned, sized by `inside_example`
        (its last (args, kwargs); None plans every operator)."""
        self.compiled_split = compiled_split
        self.compiled_products = compiled_products
        # Attention masks the fused kernels accept (see _attention.py), unless inductor plans.
        self.dense_masks = not _torch_private.has_compiled_modules(model)
        if self.weight_grads is None and self.weight_grads_off is None:
            self.weight_grads, self.weight_grads_off = plan_weight_grads(
                model, streams, device, gradients=gradients)
            self._split_model = model if self.weight_grads is not None else None
        if self.multistream is None and self.single_stream_reason is None:
            inside = traced_submodule(model)
            traced, sizes = (inside, inside_example) if inside is not None else (model, example)
            self.multistream, self.single_stream_reason = (
                build_multistream(traced, streams, device, sizes,
                                  fuse_norms=FUSE_BATCH_NORM_ACT)
                if PLAN_FORWARD or streams == 1 else (None, FORWARD_OFF))
            self._inside = inside if self.multistream is not None else None
            planned = self.weight_grads is not None or self.splits_compiled
            # A chain's forward loses nothing when the backward is planned, nor a compiled
            # model's, whose forward inductor plans: no warning. Nor for a model that says it is
            # not to be traced (a trainer's loss module: its streams are the trainer's default).
            quiet = (CHAIN, COMPILED, FORWARD_OFF)
            if (self.multistream is None and streams != 1 and untraced_reason(model) is None
                    and not (planned and self.single_stream_reason in quiet)):
                warn_single_stream(self.single_stream_reason, planned)
        if self.weight_grads is not None:
            share = (self.multistream.share_on_main(lambda m: eligible(m, gradients))
                     if self.multistream is not None else None)
            self.weight_grads.first = weight_grads_first(share)
        kernels = BATCH_NORM_KERNELS
        if kernels not in ("auto", "cudnn", "native"):
            raise ValueError("BATCH_NORM_KERNELS must be 'auto', 'cudnn' or 'native'; got "
                             f"{kernels!r}")
        native = kernels == "native" or (kernels == "auto" and self.multistream is not None)
        self._native_bn_model = model if native else None
        self._bn_model = model
        if MAX_POOL_KERNELS not in ("ours", "torch"):
            raise ValueError("MAX_POOL_KERNELS must be 'ours' or 'torch'; got "
                             f"{MAX_POOL_KERNELS!r}")
        self._max_pool_model = model if MAX_POOL_KERNELS == "ours" else None
        if SMALL_CONV_KERNELS not in ("ours", "torch"):
            raise ValueError("SMALL_CONV_KERNELS must be 'ours' or 'torch'; got "
                             f"{SMALL_CONV_KERNELS!r}")
        self._small_conv_model = model if SMALL_CONV_KERNELS == "ours" else None

    def capture(self, entry: int, body: Callable, stream: torch.cuda.Stream,
                sync_records: list, undo: Callable[[], None] = lambda: None) -> None:
        """Captures `body(forward)`, which returns the loss, on `stream` (`forward` is the
        multi-stream forward, or None for the model itself); on failure raises SyncError or
        CaptureError, the capture abandoned. The plan's streams are an optimisation: when a
        capture on several streams fails for another reason than a host sync, it is tried once
        more on one stream. `body` must start from scratch each time (zeroing gradients);
        `undo()` puts back, before it is tried again, what its forwards did to the model.
        A capture whose backward left a gradient in another parameter's flat view (a compiled
        model's weight product written into the wrong one) is made again with the products
        written apart."""
        try:
            self._capture_once(entry, body, stream, sync_records)
            return
        except NimbleError as failure:
            retry = self._one_more_try(entry, failure)
            if retry is None:
                raise
        # Out of the handler: the first attempt's failure is gone before the second begins.
        undo()
        if retry == "apart":
            self.capture(entry, body, stream, sync_records, undo)
            return
        warn_single_stream(self.single_stream_reason)
        self._capture_once(entry, body, stream, sync_records)

    def _one_more_try(self, entry: int, failure: NimbleError) -> str | None:
        """What to try after a failed capture: "apart" (weight products written apart), "one
        stream" (the plan dropped), or None (nothing: the failure is the user's)."""
        products = self.compiled_products
        if (isinstance(failure.__cause__, MisdirectedGradient) and products is not None
                and products.off is None):
            products.off = f"a capture misdirected a gradient ({failure.__cause__})"
            return "apart"
        several = (self.multistream is not None or self.weight_grads is not None
                   or self.splits_compiled)
        if (not several or isinstance(failure, SyncError)
                or isinstance(failure.__cause__, (HostStateError, LateGradient))):
            return None
        cause = root_message(failure.__cause__) if failure.__cause__ else str(failure)
        self.multistream = self.weight_grads = self._split_model = self._inside = None
        if BATCH_NORM_KERNELS == "auto":  # on one stream cuDNN's kernels are the faster
            self._native_bn_model = None
        self.single_stream_reason = f"capture on several streams failed ({cause})"
        self.weight_grads_off = self.single_stream_reason
        for other in list(self.outputs):  # every training graph on one stream alike
            if other != entry and other not in self.unplanned:
                self.graph.drop(other)
                self.outputs.pop(other, None)
        if self.splits_compiled:  # compiled code keeps its launches, on this stream now
            self.compiled_split.on_one_stream = True
        return "one stream"

    def capture_unplanned(self, entry: int, body: Callable, stream: torch.cuda.Stream,
                          sync_records: list) -> None:
        """Captures `body()`, a graph that reads no staged value (an evaluation step), on one
        stream; its output is outputs[entry]. Failures as capture()'s."""
        self._capture_once(entry, lambda forward: body(), stream, sync_records, planned=False)

    def _capture_once(self, entry: int, body: Callable, stream: torch.cuda.Stream,
                      sync_records: list, planned: bool = True) -> None:
        forward = self.multistream if planned else None
        inside = self._inside if planned else None
        side = self.weight_grads if planned else None
        small = self._small_conv_model
        # Every small convolution: the split's own forward runs the split ones, small_convs
        # the rest (entered after the split, it takes the layers left without a forward).
        small_layers = len(small_conv_candidates(small)) if small is not None else 0
        split = (split_weight_grads(self._split_model, side, small_convs=small is not None)
                 if side is not None else contextlib.nullcontext())
        convs = small_convs(small) if small is not None else contextlib.nullcontext()
        masks = DenseAttentionMasks() if self.dense_masks else contextlib.nullcontext()
        norms = CapturedBatchNorms(self._bn_model,
                                   native=planned and self._native_bn_model is not None)
        pools = (our_max_pool(self._max_pool_model) if self._max_pool_model is not None
                 else contextlib.nullcontext())
        if planned and (entry not in self._loss_buffers
                        or self._loss_buffers[entry].dtype != self.loss_dtype):
            self._loss_buffers[entry] = torch.empty((), dtype=self.loss_dtype,
                                                    device=stream.device)
        # As torch.cuda.graph does: no work still queued from before (the allocator cannot
        # process its events once this thread captures).
        torch.cuda.synchronize(stream.device)
        launched = self.compiled_split.launched if self.compiled_split is not None else 0
        calls = forward.calls if forward is not None else 0
        in_place = running_in_place(inside, forward) if inside is not None else (
            contextlib.nullcontext())
        with collector_paused(), torch.cuda.stream(stream):
            try:
                self.graph.begin_capture(entry, staged=planned,
                                         memsets_as_kernels=MEMSETS_AS_KERNELS)
            except RuntimeError as exc:
                raise failure(False, root_message(exc), []) from exc
            try:
                with split, masks, norms, pools as pool_layers, convs, in_place:
                    # (a backward joins its side streams)
                    loss = body(forward if inside is None else None)
                if planned:
                    self.native_bn_layers = norms.native_layers
                    self.bn_counters = norms.counters
                    self.fused_bn_layers = norms.fused_layers
                self.max_pool_layers = pool_layers or 0
                self.small_conv_layers = small_layers
                if forward is not None:
                    forward.join()  # every side stream rejoins the capture stream
                made = loss
                if planned:
                    loss = self._loss_out(entry, loss)
            except BaseException as exc:
                for part in (forward, side):
                    if part is not None:
                        try:
                            part.join()  # side streams rejoin, so the capture can end cleanly
                        except Exception:
                            pass  # the capture is abandoned whatever happens here
                if side is not None:
                    side.drop()
                if self.compiled_split is not None:  # compiled code's launches, if any
                    from ._inductor_wgrad import join_pending
                    join_pending(stream)
                result = self.graph.abandon_capture()
                # The frames the failure left (the body's, the forward's) hold the abandoned
                # capture's tensors, in the graphs' pool, and its autograd graph, for as long as
                # anyone holds the error: it keeps its lines, not their locals.
                traceback.clear_frames(exc.__traceback__)
                raise failure(result.invalidated, root_message(exc), sync_records) from exc
            result = self.graph.end_capture()
        if not result.ok:
            raise failure(result.invalidated, result.error.splitlines()[0], sync_records)
        self.outputs[entry] = _detached(loss)
        if loss is not made:
            self.loss_made[loss.data_ptr()] = made.detach()
        if inside is not None and forward.calls == calls:
            # The step never called the submodule (training_step called its layers itself):
            # the forward ran as it is, on one stream; later captures need no plan of it.
            self.multistream = self._inside = None
            self.single_stream_reason = (f"the step did not call {type(inside).__name__}'s "
                                         "forward, the one traced")
        if planned and self.compiled_split is not None:
            self.compiled_launches = self.compiled_split.launched - launched

    def stats(self) -> dict:
        entries = [e for e in range(self.graph.num_entries) if self.graph.captured(e)]
        nodes = [self.graph.node_count(e) for e in entries]  # training and evaluation graphs
        return {"graph_nodes": sum(nodes) if nodes and min(nodes) >= 0 else None,
                "memset_nodes_as_kernels": sum(self.graph.memset_nodes(e) for e in entries),
                "graphs": len(nodes), "pool_bytes": self.pool_bytes()}

    def pool_bytes(self) -> int | None:
        """Bytes of the segments of the graphs' shared private memory pool."""
        pool = tuple(self.graph.pool_id)
        segments = [seg for seg in torch.cuda.memory_snapshot()
                    if tuple(seg.get("segment_pool_id", ())) == pool]
        return sum(seg["total_size"] for seg in segments) if segments else None

    def _loss_out(self, entry: int, loss):
        """A training graph's loss written into its entry's buffer outside the pool, which the
        graph returns. A graph's own tensors may take memory that a graph captured before it freed
        (the pool is shared), which that graph's replays overwrite: an evaluator's replay would
        change the loss a loop holds from the step's last call. A loss of another dtype or
        shape stays the graph's own (write_out)."""
        return self.write_out(loss, self._loss_buffers[entry])

    def norm_buffer(self, entry: int, dtype: torch.dtype) -> torch.Tensor:
        """The buffer outside the pool that an update graph's gradient norm is written into
        (write_out); allocated before its capture begins."""
        out = self._norm_buffers.get(entry)
        if out is None or out.dtype != dtype:
            out = self._norm_buffers[entry] = torch.empty((), dtype=dtype,
                                                          device=self.current.device)
        return out

    @staticmethod
    def write_out(value, out: torch.Tensor):
        """`value` written into `out`, a 0-dim buffer outside the pool, inside a capture; `out`
        is returned. With a kernel, not copy_() (a memcpy node: a graph that is not all kernels
        launches slowly, src/capture/graph_nodes.h). A value of another dtype, shape or device
        is returned as it is."""
        if (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == out.dtype
                and value.device == out.device):
            torch.mul(value.detach(), 1, out=out)
            return out
        return value

    def drop_all(self) -> None:
        """Every captured graph (the training ones and the evaluators') dropped: each is
        captured again when next called. The pool and the buffers outside it stay."""
        for entry in range(self.graph.num_entries):
            if self.graph.captured(entry):
                self.graph.drop(entry)
            self.outputs.pop(entry, None)

    def release(self) -> None:
        self.outputs = {}
        self.graph.release()  # waits for the device: no replay still writes the loss
        self._loss_buffers = {}
        self._norm_buffers = {}
        self.loss_made = {}


def _detached(output):
    if isinstance(output, torch.Tensor):
        return output.detach()
    return {key: value.detach() for key, value in output.items()}


def failure(invalidated: bool, cause: str, sync_records: list) -> NimbleError:
    """The error for a failed capture: SyncError when CUDA invalidated it and warm-up saw host
    syncs, else CaptureError."""
    if invalidated and sync_records:
        found = "\n".join(f"  - {r}" for r in sync_records)
        return SyncError(
            "capturing the step failed because it synchronises with the host; warm-up saw "
            f"these host syncs:\n{found}\nKeep values on the device (no .item(), .cpu(), "
            "printing CUDA tensors or data-dependent shapes such as nonzero / boolean "
            "indexing inside the step), or pass capture=False. The model and optimizer "
            "are as after the last step; later calls run eagerly. Cause: " + cause)
    how = (" (CUDA invalidated the capture: a call it forbids while capturing ran, such as a "
           "host synchronisation or a synchronous copy)" if invalidated else "")
    end = "" if cause.endswith(".") and not cause.endswith("...") else "."
    return CaptureError(
        f"capturing the step as a CUDA graph failed{how}: {cause}{end} The model and optimizer "
        "are as after the last completed step; later calls run eagerly (capture=False does that "
        "from the start).")


def root_message(exc: BaseException) -> str:
    """The first error of a chain: a later failure often hides the real cause."""
    seen = exc
    while seen.__context__ is not None and seen.__context__ is not seen:
        seen = seen.__context__
    if isinstance(seen, NimbleError):  # ours, written to be read whole: what to do is at its end
        return f"{type(seen).__name__}: {seen}"
    return one_line(f"{type(seen).__name__}: {seen}")
