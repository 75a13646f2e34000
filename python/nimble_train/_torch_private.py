"""Every private torch API nimble_train uses, in one place.

torch may change any of these in a release without notice. tests/cpu/test_torch_private.py
checks the behaviour nimble_train relies on for each, so a change fails there, by name,
instead of somewhere deep inside a training step. Nothing else in the package reaches into
torch's private names.
"""

from __future__ import annotations

import functools

import torch

# Pytrees: flattening batches into leaves and back, with key paths for messages. The public
# torch.utils.pytree module is not in every supported release; this one is.
from torch.utils import _pytree as pytree  # noqa: F401  (re-exported)


def batch_statistics_layers() -> tuple[type, ...]:
    """The base classes of normalisation layers (BatchNorm*, InstanceNorm*, SyncBatchNorm):
    (_BatchNorm, _NormBase). Their training-mode output or running statistics depend on every
    sample of the batch."""
    from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

    return _BatchNorm, _NormBase


def is_compiled_module(module: torch.nn.Module) -> bool:
    """True for the wrapper torch.compile returns around a module (OptimizedModule)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def compiled_functions(module: torch.nn.Module) -> list:
    """The compiled functions a module's calls run in place of its own code: its call compiled
    in place (module.compile()), and methods replaced by compiled ones on the instance
    (module.forward = torch.compile(module.forward); Lightning compiles a LightningModule's
    forward and *_step methods so when given torch.compile(module)). Its forward and
    submodules stay the original ones, which torch.fx traces."""
    if is_compiled_module(module):
        return []  # the wrapper, not a module compiled in place
    # module.compile() sets _compiled_call_impl on the instance. dynamo's compiled functions
    # carry their config; torch._dynamo.disable's do not.
    return [value for value in vars(module).values()
            if callable(value) and hasattr(value, "_torchdynamo_orig_callable")
            and callable(getattr(value, "get_compiler_config", None))]


def compiled_in_place(module: torch.nn.Module) -> bool:
    """True for a module compiled in place: :func:`compiled_functions` finds some."""
    return bool(compiled_functions(module))


def has_compiled_modules(model: torch.nn.Module) -> bool:
    """Whether `model` is, or holds, a compiled module: torch.compile(module)'s wrapper or a
    module compiled in place."""
    return any(is_compiled_module(m) or compiled_in_place(m) for m in model.modules())


def replays_cuda_graphs(module: torch.nn.Module) -> bool:
    """Whether `module` is compiled (torch.compile(module), or in place: see
    :func:`compiled_functions`) to code that replays CUDA graphs of its own: inductor with its
    CUDA graphs on (mode="reduce-overhead" or "max-autotune", options={"triton.cudagraphs":
    True}), or dynamo's "cudagraphs" backend. False where this torch says neither (an older one
    keeps the backend elsewhere)."""
    if is_compiled_module(module):
        return _replays_cuda_graphs(module)
    return any(_replays_cuda_graphs(f) for f in compiled_functions(module))


def _replays_cuda_graphs(compiled) -> bool:
    """replays_cuda_graphs of torch.compile's wrapper or of one compiled function."""
    get_config = getattr(compiled, "get_compiler_config", None)
    config = get_config() if callable(get_config) else None
    if isinstance(config, dict) and config.get("triton.cudagraphs"):
        return True
    # A backend given by name: dynamo wraps it (ConvertFrame, then WrapBackendDebug), each
    # wrapper keeping the one it wraps as _torchdynamo_orig_backend. The wrapper's dynamo
    # context holds the outermost; compiled in place, only get_compiler_config reaches the
    # context (it reads the context's config).
    context = getattr(compiled, "dynamo_ctx", None)
    if context is None:
        context = next((v for v in _closed_over(get_config) if hasattr(v, "callback")), None)
    backend = getattr(context, "callback", None)
    for _ in range(4):
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
        if backend is None:
            return False
        if getattr(backend, "compiler_name", None) == "cudagraphs":
            return True
    return False


def stream_besides(device, avoid) -> torch.cuda.Stream:
    """A stream of `device` that is none of the streams `avoid`. torch.cuda.Stream() hands out
    the streams of a fixed pool (32 per device and priority) in turn, so one asked for late
    can be a stream already in use, a launching stream among them; a side stream that is its
    launcher's own would run nothing beside it. Drawing again takes the pool's next."""
    taken = {s.cuda_stream for s in avoid}
    for _ in range(64):
        stream = torch.cuda.Stream(device)
        if stream.cuda_stream not in taken:
            return stream
    raise RuntimeError(f"torch's stream pool gave no stream besides the {len(taken)} in use")


def _closed_over(fn) -> list:
    """The values `fn` closes over (its closure's cells that hold one)."""
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return values


def default_store():
    """The torch.distributed store of the default process group (rendezvous key-value store)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def import_before_process_group() -> None:
    """Imports torch._dynamo, which torch.optim otherwise imports on the first optimizer built.
    Some torch.distributed modules it brings in keep references to the default process group
    when they are first imported after it exists. Those references survive
    destroy_process_group, so the gloo group outlives it and its worker threads are still
    running when the interpreter shuts down. Releasing a finished collective's tensors there
    takes the GIL and aborts the process ("terminate called without an active exception").
    Imported before the group exists, those modules hold no reference to it."""
    import torch._dynamo  # noqa: F401


def amp_update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor,
                      found_inf: torch.Tensor, growth_factor: float, backoff_factor: float,
                      growth_interval: int) -> None:
    """GradScaler's own on-device update of the loss scale (in place, no host sync)."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                             growth_interval)


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tells LR schedulers that optimizer.step() ran (they warn when a scheduler steps first);
    a fused update that stands for optimizer.step() sets it."""
    optimizer._opt_called = True


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> tuple:
    """The hooks optimizer.step() runs besides the update: its own (register_step_pre_hook,
    register_step_post_hook) and every optimizer's (register_optimizer_step_pre_hook, ..._post_
    hook), as (kind, handle id, hook), in the order step() runs them."""
    from torch.optim import optimizer as module
    kinds = (("pre-hook", module._global_optimizer_pre_hooks),
             ("pre-hook", getattr(optimizer, "_optimizer_step_pre_hooks", {})),
             ("post-hook", getattr(optimizer, "_optimizer_step_post_hooks", {})),
             ("post-hook", module._global_optimizer_post_hooks))
    return tuple((kind, key, hook) for kind, hooks in kinds for key, hook in hooks.items())


def declare_amp_scaling(optimizer: torch.optim.Optimizer) -> None:
    """Tells GradScaler that optimizer.step() unscales gradients itself (fused SGD sets this only
    when built with fused=True; Step switches groups to fused after construction)."""
    optimizer._step_supports_amp_scaling = True


def at_end_of_backward(callback) -> None:
    """Runs `callback()` when the running backward has finished every node, before it returns,
    with its caller's current streams (as DistributedDataParallel finishes its reduction)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_asks(ctx, i: int) -> bool:
    """In a custom autograd function's backward: whether the running backward uses the
    gradient of the function's `i`-th tensor input (a tensor argument of ``apply``, Nones and
    other values not counted). ``ctx.needs_input_grad`` says only whether the input required
    one when the forward ran; ``torch.autograd.grad(loss, x)`` asks for none of the
    parameters', and autograd's own operators then skip them (their
    ``task_should_compute_output``). True for a gradient ``torch.autograd.grad`` returns, and
    wherever the engine cannot say (it raises for a leaf whose gradient it returns)."""
    if i >= len(ctx.next_functions):
        return False
    node = ctx.next_functions[i][0]
    if node is None:  # needs no gradient
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True


def cuda_sleep(cycles: int) -> None:
    """Enqueues a kernel that spins for `cycles` GPU clock cycles (tests and benchmarks keep the
    GPU busy with it while the host runs ahead)."""
    torch.cuda._sleep(cycles)


def disable_compile_caches() -> None:
    """Makes torch.compile compile cold (no on-disk caches), so that a benchmark's time to the
    first step is what a first run costs. Does nothing where inductor has no such switch."""
    try:
        import torch._inductor.config as inductor_config
    except ImportError:
        return
    if hasattr(inductor_config, "force_disable_caches"):
        inductor_config.force_disable_caches = True


def fake_tensor_values(module: torch.fx.GraphModule, args: tuple) -> None:
    """Runs `module` on fake tensors (shapes, dtypes and aliasing only: no data, no kernels)
    made like `args` and leaves each node's fake output in ``node.meta["val"]``. The module's
    parameters and buffers are swapped for fake ones while it runs, so nothing it holds is
    changed (a batch norm's counters included). Raises what the propagation raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    class Propagate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.traced = module

        def forward(self, *values):
            return FakeTensorProp(self.traced, mode).propagate(*values)

    holder = Propagate()
    held = [*holder.named_parameters(remove_duplicate=False),
            *holder.named_buffers(remove_duplicate=False)]
    state = {name: mode.from_tensor(t) for name, t in held}  # tied tensors: one fake
    fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    torch.func.functional_call(holder, state, fake_args)


def global_module_hooks() -> bool:
    """Whether hooks registered for every module (torch.nn.modules.module's
    register_module_forward_hook and kin) are in place."""
    return any(table for _, table in global_module_hook_dicts())


_GLOBAL_HOOKS = (("forward pre-hook", "_global_forward_pre_hooks"),
                 ("forward hook", "_global_forward_hooks"),
                 ("backward pre-hook", "_global_backward_pre_hooks"),
                 ("backward hook", "_global_backward_hooks"))


def global_module_hook_dicts() -> list[tuple[str, dict]]:
    """(kind, dict) per dict of the hooks registered for every module."""
    from torch.nn.modules import module
    return [(kind, table) for kind, name in _GLOBAL_HOOKS
            if isinstance(table := getattr(module, name, None), dict)]


def tensor_hooks(p: torch.Tensor) -> dict:
    """The hooks registered on `p` with ``p.register_hook`` (they see its gradient before it
    is accumulated); empty when there are none."""
    return gradient_hook_dicts(p)[0] or {}


def post_accumulate_grad_hooks(p: torch.Tensor) -> dict:
    """The hooks registered on `p` with ``p.register_post_accumulate_grad_hook`` (they run
    after its ``.grad`` is accumulated); empty when there are none."""
    return gradient_hook_dicts(p)[1] or {}


def gradient_hook_dicts(p: torch.Tensor) -> tuple[dict | None, dict | None]:
    """The dicts of the hooks on `p`'s gradient: ``p.register_hook``'s, then
    ``p.register_post_accumulate_grad_hook``'s; None for one that never held a hook."""
    return (getattr(p, "_backward_hooks", None), getattr(p, "_post_accumulate_grad_hooks", None))


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors (fake ones included) are views of one storage."""
    return torch._C._is_alias_of(a, b)


def custom_graph_pass_base() -> type:
    """inductor's base class of a custom graph pass whose uuid() keys inductor's caches
    (CustomGraphPass); `object` where torch has none, and a pass then bypasses the caches."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return object
    return CustomGraphPass


def post_grad_pass(graph_pass):
    """A context in which inductor runs `graph_pass(graph)` on each graph it compiles, after
    its own post-grad passes (the graph after autograd: aten operators, forward and backward
    apart), and after a pass of the user's set there."""
    return _custom_pass("post_grad_custom_post_pass", graph_pass)


def pre_grad_pass(graph_pass):
    """A context in which inductor runs `graph_pass(graph)` on each graph it compiles, after
    its own pre-grad passes (dynamo's graph of torch functions, before autograd), and after a
    pass of the user's set there."""
    return _custom_pass("pre_grad_custom_pass", graph_pass)


def _custom_pass(setting: str, graph_pass):
    from torch._inductor import config

    users = getattr(config, setting)
    if users is not None:
        graph_pass = _chained_pass_type()(users, graph_pass)
    return config.patch(**{setting: graph_pass})


@functools.cache
def _chained_pass_type() -> type:
    """Two custom passes as one: the user's, then ours. Keyed for inductor's caches when both
    are (a pass without a uuid makes inductor bypass them, as the user's alone would). Made on
    first use: inductor's base class loads inductor."""

    class Chained(custom_graph_pass_base()):
        def __init__(self, first, then):
            self.first, self.then = first, then

        def __call__(self, graph) -> None:
            for graph_pass in _passes(self.first):
                graph_pass(graph)
            self.then(graph)

        def uuid(self):
            ids = [_uuid(p) for p in (*_passes(self.first), self.then)]
            return None if None in ids else "+".join(map(str, ids))

    return Chained


def _passes(setting) -> tuple:
    return tuple(setting) if isinstance(setting, (list, tuple)) else (setting,)


def _uuid(graph_pass):
    uuid = getattr(graph_pass, "uuid", None)
    return uuid() if callable(uuid) else None


def is_backward_graph(graph: torch.fx.Graph) -> bool:
    """Whether an AOTAutograd graph is a backward: its incoming gradients are placeholders
    named tangents_*."""
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
