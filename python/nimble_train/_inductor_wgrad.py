"""The weight gradients of a torch.compile'd model on side streams.

Inductor plans a compiled model's backward on one stream: each convolution's backward computes
the data gradient, which the next layer's backward waits for, and the weight gradient, which
only the update reads, one after the other; a linear layer's two matrix products alike. The
graph pass here rewrites the backward graph after autograd (inductor's post-grad graph, where
every model that compiles traces, Hugging Face ones included):

- each ``convolution_backward`` that computes both gradients computes the data gradient alone,
  and a custom operator launches the weight gradient on a side stream (SIDE_STREAMS of them,
  taken in turn);
- with SPLIT_MATMULS, each matrix product of the backward whose result reaches the graph's
  output alone, through views and casts (a linear layer's weight gradient: a data gradient
  feeds the layers before), is launched on the side stream the same way;
- one join before the backward returns has the launching stream wait for the side streams, and
  what the graph does with a launch's result (a view, a cast to the parameter's dtype) moves
  after it.

Results are those of the unsplit graph: the same aten products (``convolution_backward`` with
one half of its output mask each, as the eager split in _weight_grads runs; the same ``mm``).

Inductor reuses a dead buffer for a later kernel's output without asking the allocator, so the
tensors a launch reads are passed to the join too: they stay alive until the launching stream
has waited for the launch, and are freed on it after. That orders the allocator's reuse too, so
nothing needs ``record_stream``. A launch's result, made on the side stream, is read on the
launching stream after the join only; freed there, the side stream reuses its block after its
next launch's wait for the launching stream, which comes after those reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
from typing import Callable, Iterator

import torch

from . import _torch_private

aten = torch.ops.aten


class _State:
    """What the block running sets, for every thread (autograd runs a CUDA backward on a
    thread of its own): `active`, the SplitBackward of the split_compiled_backward block,
    which counts the launches and may keep them on the current stream."""
    active = None


_state = _State()

# Off: on BERT-base (Hugging Face, bf16, batch 32 x 128 tokens, H100) the 73 weight products
# on a side stream made the captured step 1.8% slower (13.38 -> 13.62 ms) and its pool 180 MiB
# larger. Products that large fill the GPU alone; what runs beside them only slows them.
SPLIT_MATMULS = False

# Side streams per launching stream, the launches taking them in turn. Two: ResNet-18/CIFAR
# b32 over torch.compile 1.790 -> 1.766 ms a step (1.014x), the branchy net b32 3.221 -> 3.171
# (1.016x), ResNet-18 b128 4.058 -> 4.042 (1.004x) (H100, torch 2.11, alternating rounds): a
# weight gradient no longer waits for the one before it when the data gradients outrun them.
SIDE_STREAMS = 2

# Per launching stream (by device and handle): its side streams, the next launch's, and those
# with work the launching stream has not waited for (a launch that failed half-way included).
_side_of: dict[tuple[int, int], list[torch.cuda.Stream]] = {}
_turn: dict[tuple[int, int], int] = {}
_forked: dict[tuple[int, int], set[int]] = {}


def _key(stream: torch.cuda.Stream) -> tuple[int, int]:
    return (stream.device.index, stream.cuda_stream)


def _weight_grad(args: tuple) -> torch.Tensor:
    return aten.convolution_backward(*args)[1]


def _on_side_stream(compute: Callable[[], torch.Tensor],
                    reads: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`compute()` (which reads `reads`) launched on the current stream's side stream."""
    active = _state.active
    if not reads[0].is_cuda or (active is not None and active.on_one_stream):
        return compute()
    main = torch.cuda.current_stream(reads[0].device)
    key = _key(main)
    sides = _side_of.setdefault(key, [])
    while len(sides) < SIDE_STREAMS:
        sides.append(_torch_private.stream_besides(reads[0].device, [main, *sides]))
    turn = _turn.get(key, 0) % SIDE_STREAMS
    _turn[key] = turn + 1
    side = sides[turn]
    side.wait_stream(main)
    _forked.setdefault(key, set()).add(turn)
    with torch.cuda.stream(side):
        result = compute()
    if active is not None:
        active.launched += 1
    return result


@torch.library.custom_op("nimble_train::side_conv_weight_grad", mutates_args=())
def side_conv_weight_grad(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                          stride: list[int], padding: list[int], dilation: list[int],
                          transposed: bool, output_padding: list[int],
                          groups: int) -> torch.Tensor:
    """``convolution_backward``'s weight gradient, launched on the current stream's side
    stream when on CUDA (on the current stream elsewhere)."""
    args = (grad, input, weight, None, stride, padding, dilation, transposed, output_padding,
            groups, [False, True, False])
    return _on_side_stream(lambda: _weight_grad(args), (grad, input, weight))


@side_conv_weight_grad.register_fake
def _(grad, input, weight, stride, padding, dilation, transposed, output_padding, groups):
    return aten.convolution_backward(grad, input, weight, None, stride, padding, dilation,
                                     transposed, output_padding, groups,
                                     [False, True, False])[1]


@torch.library.custom_op("nimble_train::side_mm", mutates_args=())
def side_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mm(a, b)``, launched on the current stream's side stream when on CUDA."""
    return _on_side_stream(lambda: aten.mm(a, b), (a, b))


@side_mm.register_fake
def _(a, b):
    return aten.mm(a, b)


@torch.library.custom_op("nimble_train::join_side_streams", mutates_args=("grads",))
def join_side_streams(grads: list[torch.Tensor], held: list[torch.Tensor]) -> None:
    """The current stream waits for its side stream. `grads` are the launches' results
    (declared written here, so nothing reads them before); `held`, the tensors the launches
    read, kept alive until now."""
    if grads and grads[0].is_cuda:
        join_pending(torch.cuda.current_stream(grads[0].device))


@join_side_streams.register_fake
def _(grads, held):
    return None


def join_pending(stream: torch.cuda.Stream) -> None:
    """`stream` waits for its side streams' work, if any (a backward that failed between a
    launch and the join leaves some: a capture cannot end before the side streams rejoin).
    The next backward's launches take the side streams from the first again."""
    key = _key(stream)
    for turn in sorted(_forked.pop(key, ())):
        stream.wait_stream(_side_of[key][turn])
    _turn.pop(key, None)


# What may stand between a weight gradient and the output: views and casts, moved after the
# join with the launch.
_VIEWS_AND_CASTS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.t.default, aten.transpose.int, aten.squeeze.dim, aten.squeeze.dims,
    aten.unsqueeze.default, aten.clone.default, aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
}


def _consumers(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The views and casts `node`'s result reaches the output through, if it reaches nothing
    else (a weight gradient); None otherwise."""
    seen, todo = {}, [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "output" or user in seen:
                continue
            if user.op != "call_function" or user.target not in _VIEWS_AND_CASTS:
                return None
            seen[user] = None
            todo.append(user)
    return list(seen)


def split_backward(graph: torch.fx.Graph, matmuls: bool | None = None) -> int:
    """Rewrites `graph`, a post-grad graph, as the module docstring says (`matmuls`: the
    matrix products too; None: SPLIT_MATMULS); returns how many weight gradients it launches
    on the side stream."""
    launches, held, consumers = [], [], set()
    matmuls = SPLIT_MATMULS if matmuls is None else matmuls
    backward = _torch_private.is_backward_graph(graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.convolution_backward.default:
            (grad, input, weight, _bias_sizes, stride, padding, dilation, transposed,
             output_padding, groups, mask) = node.args
            if not (mask[0] and mask[1]):
                continue
            users = {u.args[1]: u for u in node.users
                     if u.op == "call_function" and u.target is operator.getitem}
            after = _consumers(users[1]) if 1 in users else None
            if after is None or len(users) != len(node.users):
                continue
            with graph.inserting_after(node):
                side = graph.call_function(
                    torch.ops.nimble_train.side_conv_weight_grad.default,
                    (grad, input, weight, stride, padding, dilation, transposed,
                     output_padding, groups))
            side.meta["val"] = users[1].meta.get("val")
            users[1].replace_all_uses_with(side)
            graph.erase_node(users[1])
            node.args = node.args[:10] + ([True, False, mask[2]],)
            val = node.meta.get("val")
            if isinstance(val, (tuple, list)):
                node.meta["val"] = (val[0], None, val[2])
            reads = (grad, input, weight)  # the weight too: under autocast, a cast copy
        elif matmuls and backward and node.target is aten.mm.default:
            after = _consumers(node)
            if after is None:
                continue
            with graph.inserting_after(node):
                side = graph.call_function(torch.ops.nimble_train.side_mm.default, node.args)
            side.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(side)
            graph.erase_node(node)
            reads = node.args
        else:
            continue
        launches.append(side)
        consumers.update(after)
        held.extend(t for t in reads if isinstance(t, torch.fx.Node))
    if not launches:
        return 0
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    with graph.inserting_before(output):
        join = graph.call_function(torch.ops.nimble_train.join_side_streams.default,
                                   (launches, list(dict.fromkeys(held))))
    join.meta["val"] = None
    # What reads a launch's result runs after the join, in the graph's order
    anchor = join
    for n in [n for n in graph.nodes if n in consumers]:
        anchor.append(n)
        anchor = n
    graph.lint()
    return len(launches)


class SplitBackward(_torch_private.custom_graph_pass_base()):
    """`split_backward` as inductor's post-grad pass, and what it did: `split` counts the
    weight gradients it moved (a graph inductor's cache served, split when first compiled, is
    not counted), `launched` the launches on side streams within split_compiled_backward
    blocks that name it."""

    def __init__(self):
        self.split = 0
        self.launched = 0
        # Launches stay on the current stream (a Step whose capture on several streams failed)
        self.on_one_stream = False

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.split += split_backward(graph)

    def uuid(self):
        """Inductor's caches key compiled graphs on it: this file's contents and the switch."""
        with open(__file__, "rb") as source:
            return hashlib.sha256(source.read()).hexdigest() + f".{int(SPLIT_MATMULS)}"


@contextlib.contextmanager
def split_compiled_backward(split: SplitBackward | None = None) -> Iterator[SplitBackward]:
    """Within the block, graphs inductor compiles run their weight gradients on a side
    stream (see the module docstring); `split` (a new one if None) counts them."""
    split = split if split is not None else SplitBackward()
    saved = _state.active
    _state.active = split
    try:
        with _torch_private.post_grad_pass(split):
            yield split
    finally:
        _state.active = saved
