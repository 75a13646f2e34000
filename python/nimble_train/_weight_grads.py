"""The backward's weight gradients on a side stream, off the critical path.

In a chain network (ResNet, a transformer) the forward has no two operators that can run side
by side, but the backward does: a convolution's or linear layer's backward is two independent
products, the data gradient (which the next layer's backward waits for) and the weight
gradient (which only the update reads). Autograd runs both on one stream, so each weight
gradient delays every layer behind it. Here the eligible convolutions and linear layers run,
while the step is captured, through an autograd function whose backward computes the data
gradient on the current stream and hands the weight gradient (and bias gradient) to a side
stream, which adds it into ``param.grad``. In a chain the side stream forks before the data
gradient, so that the two products run side by side; where the forward runs branches side by
side, after it (weight_grads_first). The backward's caller waits on all of them when the
backward ends, before the backward returns; the tensors a launch reads are kept until then. A
bounded `lag` has the launching stream wait on each launch that many of its own launches later
instead, so that those tensors are released sooner; Step leaves it unbounded (LAG), which
never stalls the critical path on a slow weight gradient and, measured, costs little memory.
Only the step's own backward splits (steps_backward): any other that runs through these layers
(``torch.autograd.grad`` in a forward or loss, a backward that builds a graph of itself) gets
their gradients back as autograd's layers give them, and only those it asks for, as autograd's
own layers compute (adversarial examples' ``torch.autograd.grad(loss, x)`` asks for no
weight's). So does a call whose weight or bias is not the layer's own parameter (a hook or
``torch.func.functional_call`` computed it from others).

Each stream that launches (a layer's forward stream: autograd runs the layer's backward there)
has a side stream of its own. With one side stream for all of them, branches the forward plan
ran side by side would meet again in the backward: the side stream waits on each branch in
turn (and, with a bounded lag, each branch waits on the side stream), so every branch's
weight gradients would queue behind the other branches' progress.

Results are those of autograd's: the same aten products (``convolution_backward`` with one half
of its output mask each; the two matrix products of a linear layer), accumulated into the
same gradient tensors. What changes is which stream runs them and, under autocast, one
rounding: a linear layer's weight and bias gradients are accumulated into the float32
gradients by matrix products (beta=1), from their float32 accumulators, where autograd rounds
each product to bf16/fp16, casts it back and adds it (see _accumulate_product).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import _torch_private


class SideStream:
    """The side streams of weight gradients, one per launching stream, each with a lag behind
    it (`lag` launches; None: joined only when the backward ends; see the module docstring).
    Launches that accumulate into the same gradients (a layer called twice) share one side
    stream, the first one they met, so they stay in order."""

    def __init__(self, device: torch.device, lag: int | None = 1, gradients=None):
        if lag is not None and lag < 1:
            raise ValueError(f"the lag must be >= 1 launch, or None for no bound; got {lag}")
        self.device = torch.device(device)
        self.lag = lag
        # Each weight gradient forked before its layer's data gradient, to run beside it (a
        # chain's forward); False: after it (see weight_grads_first).
        self.first = False
        # Data parallel: the GradientSync whose buckets learn here that a split layer's
        # gradients are complete (autograd's accumulation hooks never see them).
        self.gradients = gradients
        self.launched = 0  # weight gradients handed to a side stream, in all
        self.layers = 0  # layers split in the last split_weight_grads block
        self._side_of_launcher: dict[int, torch.cuda.Stream] = {}  # by launching stream
        self._launchers: list[torch.cuda.Stream] = []
        self._side_of_key: dict[int, torch.cuda.Stream] = {}  # by id of a launch's key
        # Per stream that launches (the current stream in a backward: the forward stream of
        # the layer), its launches not yet waited on: (event, tensors kept alive until then).
        # A launch's inputs are made on its own stream (an input from another stream is kept
        # out of reuse by record_stream, as the multi-stream forward and autograd do), so the
        # launching stream's own wait is what makes them safe to release.
        self._pending: dict[int, collections.deque] = {}

    @property
    def streams(self) -> int:
        """Side streams in use so far."""
        return len(self._side_of_launcher)

    def _side_for(self, main: torch.cuda.Stream, key) -> torch.cuda.Stream:
        side = self._side_of_key.get(id(key)) if key is not None else None
        if side is None:
            side = self._side_of_launcher.get(main.cuda_stream)
            if side is None:  # torch's stream pool: made at its first use, before any capture
                # besides the launchers and side streams met so far
                known = [*self._side_of_launcher.values(), *self._launchers]
                side = _torch_private.stream_besides(self.device, [main, *known])
                self._side_of_launcher[main.cuda_stream] = side
                self._launchers.append(main)
            if key is not None:
                self._side_of_key[id(key)] = side
        return side

    def launch(self, work, keep: tuple, key=None, beside=None):
        """Runs `work()` on the current stream's side stream (`key`'s, when an earlier launch
        with the same key went elsewhere: it accumulates into the same gradients), and
        `beside()` (a data gradient; None: nothing) on the current stream; returns what
        `beside()` returns. The work starts after everything queued on the current stream
        before it, `beside()` included unless `first`. Called from a backward: the first launch
        of a backward has the current stream join every side stream when that backward ends,
        before it returns to its caller."""
        main = torch.cuda.current_stream()
        side = self._side_for(main, key)
        result = None
        if beside is not None and not self.first:
            result = beside()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            work()
            done = torch.cuda.Event()
            done.record(side)
        if beside is not None and self.first:
            result = beside()
        if not self._pending:
            _torch_private.at_end_of_backward(self.join)
        pending = self._pending.setdefault(main.cuda_stream, collections.deque())
        pending.append((done, keep))
        self.launched += 1
        while self.lag is not None and len(pending) > self.lag:
            main.wait_event(pending.popleft()[0])
        return result

    def join(self) -> None:
        """The current stream waits for every launch so far; their inputs are released. At the
        end of a backward that is the stream of its caller."""
        main = torch.cuda.current_stream()
        for pending in self._pending.values():
            while pending:
                main.wait_event(pending.popleft()[0])
        self._pending.clear()

    def accumulated(self, *params: torch.Tensor | None) -> None:
        """Inside a launch's work: these parameters' gradients are complete (on the side
        stream, where the all-reduce buckets must wait for them)."""
        if self.gradients is not None:
            for p in params:
                if p is not None:
                    self.gradients.ready(p)

    def drop(self) -> None:
        """Forgets pending launches without waiting (a capture that failed is thrown away)."""
        self._pending.clear()


# Launches a launching stream may run ahead of its side stream (see SideStream); None: no
# bound, the side streams are joined when the backward ends. Unbounded against a lag of one
# (H100, b32, streams="auto", alternating rounds): the branchy net 3.069 -> 3.030 ms, BERT-base
# 15.02 -> 14.82, ResNet-18 2.028 -> 2.017, airbench b1024 6.94 -> 6.92; the peak memory of
# ResNet-18 383 -> 394 MiB, of the others unchanged.
LAG: int | None = None

# Whether each weight gradient is forked before its layer's data gradient, to run beside it, or
# after it: "auto" (weight_grads_first), True or False.
WEIGHT_GRADS_FIRST = "auto"


# Whether the step's own backward is running (see steps_backward). Global, not thread-local:
# autograd runs a CUDA backward's nodes on a thread of its own.
_in_steps_backward = False


@contextlib.contextmanager
def steps_backward() -> Iterator[None]:
    """The step's own backward (its loss's ``.backward()``) runs inside this block: the only
    backward whose split layers hand their weight gradients to a side stream, which adds them
    into ``.grad``. Any other -- ``torch.autograd.grad`` in a forward or loss (an input-gradient
    penalty, adversarial examples, a penalty on parameters' gradients), a backward that builds
    a graph of itself -- runs them as autograd would: their weight gradients go back to
    autograd, which accumulates them only where that backward asks, and can differentiate
    them."""
    global _in_steps_backward
    before, _in_steps_backward = _in_steps_backward, True
    try:
        yield
    finally:
        _in_steps_backward = before


def splits() -> bool:
    """In a split layer's backward: whether to hand its weight gradients to the side stream
    (the step's own backward, building no graph) or give them back to autograd."""
    return _in_steps_backward and not torch.is_grad_enabled()


def weight_grads_first(share_on_main: float | None) -> bool:
    """Whether to fork each weight gradient before its layer's data gradient, given the share
    of the split layers the forward plan runs on the launching (capture) stream (None: the
    forward is not planned, a chain or a model torch.fx cannot trace).

    In a chain the weight gradients are the backward's only work beside the critical path:
    forked before the data gradient, each starts as soon as its layer's output gradient is
    there and runs beside the data gradient, rather than beside the batch norm's and
    activation's backward that follow it (small kernels that run several times slower beside
    a convolution). Where the forward's branches already give the backward data gradients to
    run side by side, a weight gradient started earlier only crowds the critical path.
    Measured (H100, torch 2.11, streams="auto", alternating rounds, ms per step, after ->
    before): ResNet-18 b32 1.750 -> 1.740 and 1.768 -> 1.757, b128 4.167 -> 4.016, airbench
    b1024 6.081 -> 5.975 and 5.973 -> 5.941, a plain BERT-base encoder b32 14.550 -> 14.419,
    Hugging Face BERT-base b32 14.896 -> 14.818 (86-100% of their split layers on the capture
    stream); the branchy net b32 2.724 -> 2.792, b128 7.825 -> 7.959, GoogLeNet b32 1.612 ->
    1.658, b64 1.988 -> 2.053 (under 30% there). Joining each weight gradient right after its
    data gradient (the two side by side, nothing else) was slower everywhere (ResNet-18 b32
    1.846, the branchy net 3.058)."""
    if WEIGHT_GRADS_FIRST not in ("auto", True, False):
        raise ValueError("WEIGHT_GRADS_FIRST must be 'auto', True or False; got "
                         f"{WEIGHT_GRADS_FIRST!r}")
    if WEIGHT_GRADS_FIRST != "auto":
        return bool(WEIGHT_GRADS_FIRST)
    return share_on_main is None or share_on_main >= 0.5


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad, as AccumulateGrad does (a first gradient is stored in the
    parameter's dtype and layout)."""
    if param.grad is None:
        if grad.dtype != param.dtype or grad.stride() != param.stride():
            grad = torch.empty_like(param).copy_(grad)  # the parameter's layout, as autograd
        param.grad = grad
    else:
        param.grad.add_(grad)


# Operand dtypes whose matrix products cuBLAS can write into a float32 output directly.
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Widest bias summed as a product with a column of ones. Measured in a CUDA graph on an H100
# (bf16, 4096 rows): 768 columns 7.5 us against 11.9 for the column sum and its add, 8192
# columns 26.1 against 37.3, but 30522 columns (a vocabulary) 162 against 100.
_ONES_PRODUCT_MAX_COLUMNS = 8192


def _in_float32(param: torch.Tensor, operand: torch.Tensor) -> bool:
    """Whether products of `operand` (bf16/fp16 under autocast) go straight into `param`'s
    float32 gradient, with a float32 output."""
    grad = param.grad
    return (operand.is_cuda and operand.dtype in _LOW_PRECISION
            and param.dtype == torch.float32
            and (grad is None or (grad.dtype == torch.float32 and grad.is_contiguous())))


def _accumulate_product(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """param.grad += a @ b, in the gradient's dtype. Under autocast (bf16 or fp16 operands, a
    float32 parameter) the product's float32 accumulator goes straight into the float32
    gradient: one matrix product with beta=1, as Megatron-LM's gradient-accumulation fusion
    does, where autograd rounds the product to the operands' dtype, casts it back and adds it
    with two more kernels over the whole gradient. The gradient is that of autograd without the
    rounding of the product to bf16/fp16."""
    grad = param.grad
    fused = _in_float32(param, a)
    if grad is None:
        _accumulate(param, torch.mm(a, b, out_dtype=torch.float32) if fused else a.mm(b))
    elif fused:
        torch.addmm(grad, a, b, out_dtype=torch.float32, out=grad)
    elif a.dtype == grad.dtype and grad.is_contiguous():
        grad.addmm_(a, b)
    else:
        _accumulate(param, a.mm(b))


def _accumulate_sum(param: torch.Tensor, g: torch.Tensor) -> None:
    """param.grad += g.sum(0) for a 2-D g, summed in the gradient's dtype. Under autocast, up
    to _ONES_PRODUCT_MAX_COLUMNS columns, the sum is a matrix product with a column of ones,
    accumulated into the float32 gradient as the weight's is: there cuBLAS is faster than a
    column sum over bf16 rows and its separate add. Every product with 1 is exact, so this is
    the float32 sum of g's rows either way."""
    if (param.grad is not None and _in_float32(param, g)
            and g.shape[1] <= _ONES_PRODUCT_MAX_COLUMNS):
        ones = torch.ones(g.shape[0], 1, dtype=g.dtype, device=g.device)
        column = param.grad.view(-1, 1)
        torch.addmm(column, g.t(), ones, out_dtype=torch.float32, out=column)
        return
    dtype = param.dtype if param.dtype.is_floating_point else None
    _accumulate(param, g.sum(0, dtype=dtype))


def _amp_cast(*tensors):
    """The tensors as autocast would hand them to a convolution or a matrix product."""
    if not torch.is_autocast_enabled("cuda"):
        return tensors
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t
                 for t in tensors)


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, side, stride, padding, dilation, groups):
        x_, w_, b_ = _amp_cast(x, weight, bias)
        with torch.autocast("cuda", enabled=False):
            y = torch.ops.aten.convolution(x_, w_, b_, stride, padding, dilation, False,
                                           [0] * len(stride), groups)
        ctx.save_for_backward(x_, w_)
        ctx.conv = (stride, padding, dilation, groups)
        ctx.module, ctx.side, ctx.has_bias = module, side, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, w = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        module, has_bias = ctx.module, ctx.has_bias
        bias_sizes = [w.shape[0]] if has_bias else None
        zeros = [0] * len(stride)
        if not splits():  # autograd's own: the gradients go back to it, those it asks for
            mask = [_torch_private.backward_asks(ctx, 0), _torch_private.backward_asks(ctx, 1),
                    has_bias and _torch_private.backward_asks(ctx, 2)]
            return (*torch.ops.aten.convolution_backward(
                grad_y, x, w, bias_sizes, stride, padding, dilation, False, zeros, groups,
                mask), None, None, None, None, None, None)

        def data_grad():
            if not ctx.needs_input_grad[0]:
                return None
            return torch.ops.aten.convolution_backward(
                grad_y, x, w, bias_sizes, stride, padding, dilation, False, zeros, groups,
                [True, False, False])[0]

        def weight_grads():
            _, gw, gb = torch.ops.aten.convolution_backward(
                grad_y, x, w, bias_sizes, stride, padding, dilation, False, zeros, groups,
                [False, True, has_bias])
            _accumulate(module.weight, gw)
            if has_bias:
                _accumulate(module.bias, gb)
            ctx.side.accumulated(module.weight, module.bias)

        grad_x = ctx.side.launch(weight_grads, (grad_y, x, w), key=module, beside=data_grad)
        return grad_x, None, None, None, None, None, None, None, None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, side):
        x_, w_, b_ = _amp_cast(x, weight, bias)
        with torch.autocast("cuda", enabled=False):
            y = F.linear(x_, w_, b_)
        ctx.save_for_backward(x_, w_)
        ctx.module, ctx.side, ctx.has_bias = module, side, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, w = ctx.saved_tensors
        module, has_bias = ctx.module, ctx.has_bias

        def data_grad():
            return grad_y.matmul(w) if ctx.needs_input_grad[0] else None

        if not splits():  # autograd's own: the gradients go back to it, those it asks for
            g2 = grad_y.reshape(-1, grad_y.shape[-1])
            asks = _torch_private.backward_asks
            return (grad_y.matmul(w) if asks(ctx, 0) else None,
                    g2.t().mm(x.reshape(-1, x.shape[-1])) if asks(ctx, 1) else None,
                    g2.sum(0) if has_bias and asks(ctx, 2) else None, None, None)

        def weight_grads():
            g2 = grad_y.reshape(-1, grad_y.shape[-1])
            _accumulate_product(module.weight, g2.t(), x.reshape(-1, x.shape[-1]))
            if has_bias:
                _accumulate_sum(module.bias, g2)
            ctx.side.accumulated(module.weight, module.bias)

        grad_x = ctx.side.launch(weight_grads, (grad_y, x, w), key=module, beside=data_grad)
        return grad_x, None, None, None, None


def _conv_padding(m: nn.Conv2d | nn.Conv1d | nn.Conv3d) -> list[int] | None:
    """Integer padding for aten.convolution, or None where it needs more (asymmetric "same",
    a non-zero padding mode)."""
    if m.padding_mode != "zeros":
        return None
    if isinstance(m.padding, str):
        if m.padding == "valid":
            return [0] * len(m.kernel_size)
        total = [d * (k - 1) for d, k in zip(m.dilation, m.kernel_size)]
        if any(t % 2 for t in total):
            return None  # "same" with an even extent pads one side more
        return [t // 2 for t in total]
    return list(m.padding)


def _accepts(p: torch.Tensor, gradients) -> bool:
    """Whether a side stream may accumulate `p`'s gradient: no hooks of the user's on it (they
    expect autograd's accumulation); data parallel (`gradients`, the GradientSync), its
    buckets' hooks are the only ones and only its layer uses it (GradientSync.splittable)."""
    if _torch_private.tensor_hooks(p):
        return False
    if gradients is not None:
        return gradients.splittable(p)
    return not _torch_private.post_accumulate_grad_hooks(p)


def _own_parameters(m: nn.Module) -> list[torch.Tensor] | None:
    """The layer's weight and bias when they are its own parameters, the leaves whose ``.grad``
    a side stream adds into; None when either is a tensor computed from others
    (``torch.nn.utils.weight_norm``, ``spectral_norm`` and ``prune`` replace the parameter by
    one their forward pre-hook computes, whose gradient autograd must carry back to the
    parameters it was computed from)."""
    weight, bias = m._parameters.get("weight"), getattr(m, "bias", None)
    if weight is None or m.weight is not weight:
        return None
    if bias is not None and m._parameters.get("bias") is not bias:
        return None
    return [weight] if bias is None else [weight, bias]


def eligible(m: nn.Module, gradients=None) -> bool:
    """Modules whose weight gradient may leave the critical path: plain convolutions and linear
    layers whose weight and bias are their own parameters (see _own_parameters), whose weight
    requires a gradient and whose parameters a side stream accepts (`gradients`: data
    parallel, the GradientSync; see _accepts)."""
    if type(m) in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        ok = _conv_padding(m) is not None
    elif type(m) is nn.Linear:
        ok = True
    else:
        return False
    params = _own_parameters(m)
    return (ok and params is not None and m.weight.requires_grad
            and all(p.requires_grad and _accepts(p, gradients) for p in params))


def _split_forward(module: nn.Module, side: SideStream, small_convs: bool):
    weight, bias = module.weight, module.bias

    def own(x) -> bool:
        """Whether this call may split: on the GPU, with autograd on, and the layer's own
        parameters in place (torch.func.functional_call puts tensors computed from others
        there for the call, whose gradient autograd must carry back to them)."""
        return (x.is_cuda and torch.is_grad_enabled() and module.weight is weight
                and module.bias is bias)

    if isinstance(module, nn.Linear):
        def forward(x):
            if not own(x):
                return type(module).forward(module, x)
            return _Linear.apply(x, module.weight, module.bias, module, side)
        return forward
    from . import _small_conv  # it builds on this module's helpers
    padding = _conv_padding(module)
    small = small_convs and _small_conv.is_candidate(module)

    def forward(x):
        if not own(x):
            return type(module).forward(module, x)
        if small and _small_conv.takes(x, module.weight):
            return _small_conv.apply(x, module, side)
        return _Conv.apply(x, module.weight, module.bias, module, side, list(module.stride),
                           padding, list(module.dilation), module.groups)
    return forward


def plan_weight_grads(model: nn.Module, streams, device: torch.device, *,
                      gradients=None) -> tuple[SideStream | None, str | None]:
    """The side stream for `model`'s weight gradients, or None with the reason there is none.
    `gradients`: data parallel, the Step's GradientSync (its buckets learn from the side
    stream when a split layer's gradients are complete)."""
    if streams == 1:
        return None, "streams=1"
    if _torch_private.has_compiled_modules(model):
        return None, "the model contains torch.compile'd modules, whose backward inductor plans"
    if not any(eligible(m, gradients) for m in model.modules()):
        why = ("no convolution or linear layer whose weight gradient can move"
               + (" (data parallel: only layers that alone use their parameters, once)"
                  if gradients is not None else ""))
        return None, why
    return SideStream(device, lag=LAG, gradients=gradients), None


@contextlib.contextmanager
def split_weight_grads(model: nn.Module, side: SideStream,
                       small_convs: bool = False) -> Iterator[int]:
    """Within the block, the eligible layers of `model` compute their weight gradients on
    `side`; yields how many layers that is. The layers are restored on exit. With
    `small_convs`, the stems among them run _small_conv's kernels on the inputs those take,
    their weight gradients on `side` too.

    A parameter may also get a gradient from autograd (a weight tied to an embedding, a layer's
    weight read by other code): a hook on it has the current stream join the side stream
    first, so the two accumulations into its ``.grad`` never overlap."""
    patched = [m for m in model.modules()
               if eligible(m, side.gradients) and "forward" not in vars(m)]
    hooks = []
    for m in patched:
        # an instance attribute shadows the class's
        m.forward = _split_forward(m, side, small_convs)
        for p in (m.weight, m.bias):
            if p is not None:
                hooks.append(p.register_hook(lambda grad: side.join() if grad is not None
                                             else None))
    side.layers = len(patched)
    if side.gradients is not None:  # their buckets hear of them from the side stream alone
        side.gradients.reported_by_side([p for m in patched for p in (m.weight, m.bias)
                                         if p is not None])
    try:
        yield len(patched)
    finally:
        if side.gradients is not None:
            side.gradients.reported_by_side([])
        for handle in hooks:
            handle.remove()
        for m in patched:
            del m.forward
