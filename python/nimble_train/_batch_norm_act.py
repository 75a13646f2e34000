"""A batch norm and the ReLU after it (a residual added in between or not), or the exact GELU
after it, as one operator of a planned forward.

In training PyTorch's native batch norm runs three kernels (the batch statistics, the running
averages' update, the normalisation), then the activation runs one more, and a residual block's
addition another, each reading and writing the whole activation. Where the traced forward
(_multistream) has a 2-D batch norm whose only reader is a ReLU, or an addition whose only
reader is a ReLU, or a batch norm whose only reader is an exact GELU (nn.GELU(), F.gelu), the
two or three operators become one: the batch statistics (ours: the per-channel sums, then
their totals; torch's kernel zeroes its semaphores with a memset first and takes longer), then
one kernel of ours (src/ops/batch_norm_act.h) that normalises, adds the residual, applies the
activation and updates the running averages (and, for the ReLU, writes its mask as a bit per
element). The backward is ours too: torch's batch-norm backward of the gradient the
activation lets through, in three kernels (the per-channel sums, deterministic: the blocks'
partial sums added in a fixed order; the weight's and bias's gradients; the input's), where
torch would first write that gradient out (a kernel and a pass over memory more). The ReLU's
mask is read from the forward's bits as the kernels go (a bit where the output is positive or
NaN, as threshold_backward lets the gradient through): a 32nd of the reads of the float32
output it stands for; the GELU's derivative is taken at the normalised value, recomputed from
the input. The residual's gradient is the masked gradient, as the addition's would be.

A chain (a forward the plan puts on one stream) with something to fuse runs its traced forward
on that one stream, fused; without, the model's own forward as before.

The rewrite is of the traced graph only; the model is not touched. The fused operator runs
fused only inside a planned capture that runs the native batch-norm kernels (CapturedBatchNorms
with native=True), on channels-last CUDA activations (float32, or float16/bfloat16 under
autocast, with float32 parameters) of a layer in training; anywhere else (the fake-tensor run
that sizes operators, another dtype or layout, a broadcast residual, a layer in eval mode) it
calls the batch norm, the addition and the activation as the model would.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from . import _batch_norm, _torch_private
from ._extension import _C

_RELU_FUNCTIONS = {F.relu, torch.relu, torch.relu_, F.relu_}
_RELU_METHODS = {"relu", "relu_"}
# Additions that may write their first operand: fused only when that operand is the batch
# norm's output (which nothing else reads), never the residual.
_ADD_WRITING_FIRST = {operator.iadd}
_ADD_WRITING_METHODS = {"add_", "__iadd__"}
_ADD_FUNCTIONS = {operator.add, torch.add}
# The backward: our kernels, which read the ReLU's mask from the output as they go (True), or
# torch's threshold_backward and native batch-norm backward (bench/bench_batch_norm_act.py
# times one against the other).
OUR_BACKWARD = True
# The batch statistics: ours (True), or torch.batch_norm_stats (bench/bench_batch_norm_act.py
# times one against the other).
OUR_STATS = True
# Our backward's ReLU mask: bits the forward writes (True: a bit per element read back, where
# the output is 32 bits in float32), or the output itself (bench/bench_batch_norm_act.py times
# one against the other).
MASK_BITS = True
# Our kernels' chains (statistics, finish, forward; sums, finish, gradients) each launched early,
# programmatic dependent launch (True: the next kernel's blocks wait on the GPU as the one
# before it ends, the launch latency between them hidden), or one after the other
# (bench/bench_streams.py times one against the other).
EARLY_LAUNCHES = True
# Activations the kernel stores; its arithmetic and the statistics are float32 for all three.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class BatchNormAct(nn.Module):
    """relu(bn(x) [+ residual]), or gelu(bn(x)), fused where it can be (see the module's
    docstring). Uses the model's own batch norm, `layer_name` in the traced module: parameters,
    buffers and mode are that layer's. The layer is not a child of this module, so its tensors
    are reached by their one path (the fake-tensor run swaps them by name)."""

    def __init__(self, bn: nn.BatchNorm2d, layer_name: str, gelu: bool = False,
                 activation: nn.Module | None = None):
        super().__init__()
        self.layer_name = layer_name
        self.gelu = gelu
        # the model's nn.ReLU / nn.GELU when it called one (None: a function), not children
        self._layer = (bn, activation)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        norms = _batch_norm.active()
        bn, activation = self._layer
        if (norms is None or not norms.native or not _fusable(bn, x, residual)
                or _hooked(bn) or (activation is not None and _hooked(activation))):
            y = bn(x)
            if residual is not None:
                y = y + residual
            if activation is not None:
                return activation(y)
            return F.gelu(y) if self.gelu else torch.relu(y)
        norms.count_call(bn)
        return _BatchNormAct.apply(x, residual, bn.weight, bn.bias, bn.running_mean,
                                   bn.running_var, bn.momentum, bn.eps, self.gelu)


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` would run hooks (its own or every module's): the fused
    operator does not call the layers, so it leaves such calls to them."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _torch_private.global_module_hooks())


def _fusable(bn: nn.BatchNorm2d, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether this call can run fused: a layer in training with a momentum, on channels-last
    CUDA data (float32, or float16/bfloat16 under autocast) with more than one value per
    channel, float32 parameters and running averages, and a residual (if any) of x's shape,
    dtype and layout."""
    if not (bn.training and bn.momentum is not None and x.is_cuda and x.dim() == 4
            and x.dtype in _DTYPES and x.is_contiguous(memory_format=torch.channels_last)
            and x.numel() > x.shape[1]):
        return False
    if any(t is None or t.dtype != torch.float32
           for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var)):
        return False
    return residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                and residual.device == x.device
                                and residual.is_contiguous(memory_format=torch.channels_last))


class _BatchNormAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, running_mean, running_var, momentum, eps, gelu):
        early = EARLY_LAUNCHES
        if OUR_STATS:
            mean, invstd = _C.batch_norm_stats(x, eps, early)
        else:
            mean, invstd = torch.batch_norm_stats(x, eps)
        bits = not gelu and OUR_BACKWARD and MASK_BITS
        y, mask = _C.batch_norm_relu_forward(x, mean, invstd, weight, bias, residual,
                                             running_mean, running_var, momentum, eps, gelu,
                                             bits, early)
        # The ReLU's mask is its bits, or else the output; the GELU's derivative is recomputed
        # from x.
        ctx.save_for_backward(x, None if gelu or bits else y, mask, weight, bias, mean, invstd)
        ctx.eps, ctx.gelu, ctx.early = eps, gelu, early
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, y, mask, weight, bias, mean, invstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if OUR_BACKWARD:
            grad_x, grad_z, grad_w, grad_b = _C.batch_norm_relu_backward(
                grad_y, y, x, mean, invstd, weight, bias, needs[0], needs[1], ctx.gelu, mask,
                ctx.early)
        else:
            if ctx.gelu:
                z = torch.batch_norm_elemt(x, weight, bias, mean, invstd, ctx.eps)
                grad_z = torch.ops.aten.gelu_backward(grad_y, z)
            else:
                grad_z = torch.ops.aten.threshold_backward(grad_y, y, 0)
            grad_x, grad_w, grad_b = torch.ops.aten.native_batch_norm_backward(
                grad_z, x, weight, None, None, mean, invstd, True, ctx.eps,
                [needs[0], needs[2], needs[3]])
        return (grad_x if needs[0] else None, grad_z if needs[1] else None,
                grad_w if needs[2] else None, grad_b if needs[3] else None,
                None, None, None, None, None)


# ---------------------------------------------------------------------- the graph rewrite

def fuse_batch_norm_act(module: torch.fx.GraphModule) -> int:
    """Rewrites `module`'s graph in place: each batch norm -> ReLU, batch norm -> addition ->
    ReLU and batch norm -> GELU chain whose inner values have no other reader becomes one call
    of a BatchNormAct (at the activation's place). Returns how many chains it fused."""
    graph = module.graph
    fused = 0
    for node in list(graph.nodes):
        bn = _batch_norm_layer(module, node)
        if bn is None:
            continue
        user = _only_user(node)
        if user is None:
            continue
        residual = _residual(user, node)
        last = _only_user(user) if residual is not None else user
        if last is None:
            continue
        gelu = residual is None and _is_gelu(module, last, node)
        if not gelu and not _is_relu(module, last, user if residual is not None else node):
            continue
        if _buffers_read_between(module, node, last, node.target):
            continue  # moving the update to the activation's place would change what they read
        name = _fresh_name(module, "nt_fused_" + node.target.replace(".", "_")
                           + ("_gelu" if gelu else "_relu"))
        activation = module.get_submodule(last.target) if last.op == "call_module" else None
        module.add_submodule(name, BatchNormAct(bn, node.target, gelu, activation))
        with graph.inserting_before(last):
            args = (node.args[0],) if residual is None else (node.args[0], residual)
            new = graph.call_module(name, args)
        last.replace_all_uses_with(new)
        graph.erase_node(last)
        if residual is not None:
            graph.erase_node(user)
        graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
        module.recompile()
    return fused


def _batch_norm_layer(module: torch.fx.GraphModule, node: torch.fx.Node) -> nn.Module | None:
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return None
    m = module.get_submodule(node.target)
    batch_norm, _ = _torch_private.batch_statistics_layers()
    ok = (isinstance(m, nn.BatchNorm2d) and type(m).forward is batch_norm.forward
          and "forward" not in vars(m) and m.affine and m.track_running_stats
          and m.momentum is not None)
    return m if ok else None


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _residual(node: torch.fx.Node, source: torch.fx.Node) -> torch.fx.Node | None:
    """The other operand of `node` when it adds `source` and another node (no alpha), writing
    nothing but `source` if it writes in place; else None."""
    if node.kwargs or len(node.args) != 2 or not all(isinstance(a, torch.fx.Node)
                                                       for a in node.args):
        return None
    a, b = node.args
    if a is b:
        return None
    writes_first = ((node.op == "call_function" and node.target in _ADD_WRITING_FIRST)
                    or (node.op == "call_method" and node.target in _ADD_WRITING_METHODS))
    plain = ((node.op == "call_function" and node.target in _ADD_FUNCTIONS)
             or (node.op == "call_method" and node.target == "add"))
    if writes_first:
        return b if a is source else None
    if plain:
        return b if a is source else a if b is source else None
    return None


def _is_relu(module: torch.fx.GraphModule, node: torch.fx.Node, source: torch.fx.Node) -> bool:
    if not node.args or node.args[0] is not source:
        return False
    rest, kwargs = node.args[1:], node.kwargs
    if node.op == "call_module":
        return type(module.get_submodule(node.target)) is nn.ReLU and not rest and not kwargs
    if node.op == "call_method":
        return node.target in _RELU_METHODS and not rest and not kwargs
    if node.op == "call_function" and node.target in _RELU_FUNCTIONS:
        inplace = list(rest) + list(kwargs.values())  # F.relu(x, True) or inplace=True
        return (set(kwargs) <= {"inplace"} and len(inplace) <= 1
                and all(isinstance(v, bool) for v in inplace))
    return False


def _is_gelu(module: torch.fx.GraphModule, node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """The exact GELU (approximate="none") of `source`, and nothing else."""
    if not node.args or node.args[0] is not source or len(node.args) > 1:
        return False
    if node.op == "call_module":
        m = module.get_submodule(node.target)
        return type(m) is nn.GELU and m.approximate == "none" and not node.kwargs
    if node.op == "call_function" and node.target is F.gelu:
        return set(node.kwargs) <= {"approximate"} and node.kwargs.get(
            "approximate", "none") == "none"
    return False


def _buffers_read_between(module: torch.fx.GraphModule, first: torch.fx.Node,
                          last: torch.fx.Node, prefix: str) -> bool:
    """Whether a node after `first` and before `last` reads an attribute of the layer at
    `prefix` (its running averages, read by the model's own code)."""
    node = first.next
    while node is not last:
        if node.op == "get_attr" and node.target.startswith(prefix + "."):
            return True
        node = node.next
    return False


def _fresh_name(module: torch.fx.GraphModule, name: str) -> str:
    candidate, i = name, 1
    while hasattr(module, candidate):
        candidate, i = f"{name}_{i}", i + 1
    return candidate
