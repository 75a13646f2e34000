"""The private torch APIs nimble_train relies on (all in nimble_train._torch_private) still
behave as it expects: when a torch release changes one, the failure names it here."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from nimble_train import _torch_private


def test_pytree_flattens_with_key_paths_and_round_trips():
    batch = {"ids": torch.zeros(2, 3), "extra": (torch.ones(2), 5)}
    flat, treedef = _torch_private.pytree.tree_flatten_with_path(batch)
    paths = ["batch" + _torch_private.pytree.keystr(path) for path, _ in flat]
    assert paths == ["batch['ids']", "batch['extra'][0]", "batch['extra'][1]"]
    leaves, spec = _torch_private.pytree.tree_flatten(batch)
    assert spec == treedef and leaves[2] == 5
    rebuilt = _torch_private.pytree.tree_unflatten(leaves, spec)
    assert rebuilt.keys() == batch.keys() and rebuilt["extra"][1] == 5
    assert _torch_private.pytree.tree_leaves(torch.ones(1))[0].shape == (1,)
    assert _torch_private.pytree.tree_flatten((1, 2))[1] != _torch_private.pytree.tree_flatten(
        [1, 2])[1]  # a tuple and a list are different structures


def test_batch_statistics_layers_are_the_bases_of_the_norm_layers():
    batch_norm, norm_base = _torch_private.batch_statistics_layers()
    for layer in (torch.nn.BatchNorm1d(3), torch.nn.BatchNorm2d(3), torch.nn.SyncBatchNorm(3)):
        assert isinstance(layer, batch_norm) and isinstance(layer, norm_base)
    instance = torch.nn.InstanceNorm2d(3, track_running_stats=True)
    assert isinstance(instance, norm_base) and not isinstance(instance, batch_norm)
    assert instance.track_running_stats
    assert not isinstance(torch.nn.LayerNorm(3), norm_base)


def test_compiled_modules_are_recognised():
    model = torch.nn.Linear(2, 2)
    assert _torch_private.is_compiled_module(torch.compile(model))
    assert not _torch_private.is_compiled_module(model)
    holder = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2)))
    assert _torch_private.has_compiled_modules(holder)
    assert not _torch_private.has_compiled_modules(torch.nn.Sequential(model))
    # compiled in place: the module itself, its calls the compiled code's
    in_place = torch.nn.Linear(2, 2)
    in_place.compile()
    assert _torch_private.compiled_in_place(in_place)
    assert not _torch_private.is_compiled_module(in_place)
    assert not _torch_private.compiled_in_place(model)
    assert not _torch_private.compiled_in_place(torch.compile(torch.nn.Linear(2, 2)))
    assert _torch_private.has_compiled_modules(in_place)
    assert _torch_private.has_compiled_modules(torch.nn.Sequential(torch.nn.ReLU(), in_place))
    # a method replaced by a compiled one (Lightning does so with a compiled LightningModule's)
    forward_compiled = torch.nn.Linear(2, 2)
    forward_compiled.forward = torch.compile(forward_compiled.forward)
    assert _torch_private.compiled_in_place(forward_compiled)
    assert _torch_private.compiled_functions(forward_compiled) == [forward_compiled.forward]
    # torch._dynamo.disable wraps a function too, compiling nothing
    disabled = torch.nn.Linear(2, 2)
    disabled.forward = torch._dynamo.disable(disabled.forward)
    assert not _torch_private.has_compiled_modules(disabled)


@pytest.mark.parametrize("compile_kwargs, replays", [
    ({}, False),
    ({"mode": "default"}, False),
    ({"mode": "reduce-overhead"}, True),
    ({"mode": "max-autotune"}, True),
    ({"mode": "max-autotune-no-cudagraphs"}, False),
    ({"options": {"triton.cudagraphs": True}}, True),
    ({"options": {"max_autotune": True}}, False),
    ({"backend": "cudagraphs"}, True),
    ({"backend": "eager"}, False),
    ({"backend": "aot_eager"}, False),
], ids=lambda v: repr(v) if isinstance(v, dict) else str(v))
def test_compiled_modules_that_replay_cuda_graphs_of_their_own_are_recognised(compile_kwargs,
                                                                               replays):
    compiled = torch.compile(torch.nn.Linear(2, 2), **compile_kwargs)
    assert _torch_private.replays_cuda_graphs(compiled) is replays
    assert not _torch_private.replays_cuda_graphs(torch.nn.Linear(2, 2))
    in_place = torch.nn.Linear(2, 2)
    in_place.compile(**compile_kwargs)
    assert _torch_private.replays_cuda_graphs(in_place) is replays
    forward_compiled = torch.nn.Linear(2, 2)
    forward_compiled.forward = torch.compile(forward_compiled.forward, **compile_kwargs)
    assert _torch_private.replays_cuda_graphs(forward_compiled) is replays


def test_the_default_store_is_the_process_groups():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        default = _torch_private.default_store()
        default.set("nimble_train/probe", "1")
        assert default.get("nimble_train/probe") == b"1"
    finally:
        dist.destroy_process_group()


def test_amp_update_scale_backs_off_and_grows_as_grad_scaler_does():
    scale = torch.full((1,), 1024.0)
    tracker = torch.zeros(1, dtype=torch.int32)
    found = torch.ones(1)
    _torch_private.amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2)
    assert scale.item() == 512.0 and tracker.item() == 0
    found.zero_()
    for _ in range(2):
        _torch_private.amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2)
    assert scale.item() == 1024.0 and tracker.item() == 0


def test_marking_the_optimizer_stepped_silences_the_scheduler_warning():
    def scheduler_warnings(mark: bool) -> list:
        p = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([p], lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        if mark:
            _torch_private.mark_optimizer_stepped(opt)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            scheduler.step()
        return [w for w in seen if "optimizer.step()" in str(w.message)]
    assert scheduler_warnings(mark=False), "torch no longer warns: the mark is not needed"
    assert not scheduler_warnings(mark=True)


def test_declaring_amp_scaling_makes_grad_scaler_leave_unscaling_to_the_optimizer():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    _torch_private.declare_amp_scaling(opt)
    assert getattr(opt, "_step_supports_amp_scaling", False)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(p.sum()).backward()  # a scaled gradient: 4 everywhere
    seen = {}

    def step():  # what reaches the step is what matters here
        seen.update(grad_scale=float(opt.grad_scale), found_inf=float(opt.found_inf),
                    grad=p.grad.clone())
    opt.step = step
    scaler.step(opt)
    # With the declaration GradScaler hands the step its scale and leaves the gradient scaled.
    assert seen["grad_scale"] == 4.0 and seen["found_inf"] == 0.0
    assert torch.equal(seen["grad"], torch.full((3,), 4.0))


def test_compile_caches_can_be_disabled():
    import torch._inductor.config as inductor_config

    saved = inductor_config.force_disable_caches
    try:
        _torch_private.disable_compile_caches()
        assert inductor_config.force_disable_caches is True
    finally:
        inductor_config.force_disable_caches = saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for its streams")
def test_streams_come_from_a_pool_and_stream_besides_avoids_those_in_use():
    main = torch.cuda.Stream()
    # torch's pool hands the same stream out again within one round of it
    assert any(torch.cuda.Stream().cuda_stream == main.cuda_stream for _ in range(64))
    side = _torch_private.stream_besides(main.device, [main])
    for _ in range(64):
        other = _torch_private.stream_besides(main.device, [main, side])
        assert other.cuda_stream not in (main.cuda_stream, side.cuda_stream)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the sleep kernel")
def test_cuda_sleep_keeps_the_gpu_busy():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _torch_private.cuda_sleep(10_000_000)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) > 1.0


def test_a_callback_runs_once_the_backward_has_finished_every_node():
    seen = []
    x = torch.randn(3, requires_grad=True)

    class Tap(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            _torch_private.at_end_of_backward(lambda: seen.append(("end", x.grad.clone())))
            seen.append("tap")
            return grad * 2

    (Tap.apply(x) * x).sum().backward()  # the callback sees x's finished gradient
    assert [s if isinstance(s, str) else s[0] for s in seen] == ["tap", "end"]
    torch.testing.assert_close(seen[1][1], x.grad)
    (x * 3).sum().backward()  # queued for one backward only
    assert len(seen) == 2


def test_backward_asks_says_which_inputs_gradients_the_running_backward_uses():
    asked = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b, k):  # b may be None, k is no tensor: neither counts
            return x * w * k

        @staticmethod
        def backward(ctx, grad):
            asked.append(tuple(_torch_private.backward_asks(ctx, i) for i in range(3)))
            return grad, grad, None, None

    w = torch.ones(3, requires_grad=True)
    x0 = torch.ones(3, requires_grad=True)
    frozen = torch.ones(3)
    for ask, want in [(lambda y, x: y.backward(), (True, True, False)),
                      (lambda y, x: torch.autograd.grad(y, x), (True, False, False)),
                      (lambda y, x: torch.autograd.grad(y, w), (False, True, False)),
                      (lambda y, x: torch.autograd.grad(y, [x0]), (True, False, False)),
                      (lambda y, x: y.backward(inputs=[w]), (False, True, False))]:
        x = x0 * 2
        ask(Scale.apply(x, w, None, 2.0).sum(), x)
        assert asked.pop() == want
    Scale.apply(x0 * 2, frozen, None, 2.0).sum().backward()  # needs no gradient
    assert asked.pop() == (True, False, False)


def test_fake_tensor_values_give_shapes_and_leave_the_module_alone():
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    traced = torch.fx.symbolic_trace(model)
    _torch_private.fake_tensor_values(traced, (torch.randn(5, 6),))
    shapes = {n.name: tuple(n.meta["val"].shape) for n in traced.graph.nodes
              if n.op != "output"}
    assert shapes == {"input_1": (5, 6), "_0": (5, 4), "_1": (5, 4)}
    for k, v in model.state_dict().items():  # running statistics and the batch counter
        assert torch.equal(v, before[k]), k


def test_a_parameters_gradient_hooks_are_seen_by_kind():
    p = torch.nn.Parameter(torch.ones(3))
    assert _torch_private.tensor_hooks(p) == {}
    assert _torch_private.post_accumulate_grad_hooks(p) == {}
    handle = p.register_hook(lambda g: g * 2)
    assert len(_torch_private.tensor_hooks(p)) == 1
    assert _torch_private.post_accumulate_grad_hooks(p) == {}
    seen = []
    after = p.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.clone()))
    assert len(_torch_private.post_accumulate_grad_hooks(p)) == 1
    (p * 3).sum().backward()
    assert torch.equal(seen[0], torch.full((3,), 6.0))  # after the tensor hook doubled it
    handle.remove()
    after.remove()
    assert not _torch_private.tensor_hooks(p) and not _torch_private.post_accumulate_grad_hooks(p)


def test_shares_storage_sees_views_of_fake_and_real_tensors():
    t = torch.randn(4, 4)
    assert _torch_private.shares_storage(t.t(), t) and not _torch_private.shares_storage(
        t.clone(), t)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        f = mode.from_tensor(t)
        assert _torch_private.shares_storage(f.view(16), f)
        assert not _torch_private.shares_storage(f + 1, f)



def test_global_module_hooks_are_seen():
    assert not _torch_private.global_module_hooks()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert _torch_private.global_module_hooks()
    finally:
        handle.remove()
    assert not _torch_private.global_module_hooks()


_GROUP_RELEASED = r"""
import sys
import torch
import torch.distributed as dist
import nimble_train as nt

assert "torch._dynamo" not in sys.modules  # a fresh interpreter, as a job starts
nt.init_distributed(device="cpu")
group = dist.group.WORLD
before = sys.getrefcount(group)
torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)  # imports torch._dynamo's modules
after_optimizer = sys.getrefcount(group)
dist.barrier()
dist.destroy_process_group()
print(before, after_optimizer, sys.getrefcount(group))
"""


def test_the_process_group_is_released_by_destroy_when_an_optimizer_was_built_after_init():
    """init_distributed imports torch._dynamo before the group exists
    (import_before_process_group): imported after it, some torch.distributed modules keep
    references to the default group, which then outlives destroy_process_group and lets gloo's
    threads run into interpreter shutdown (an abort at exit)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    out = subprocess.run([sys.executable, "-c", _GROUP_RELEASED], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    before, after_optimizer, after_destroy = map(int, out.stdout.split()[-3:])
    assert after_optimizer == before  # the optimizer's imports hold no reference to the group
    assert after_destroy == 2  # only `group` and getrefcount's argument: nothing keeps it alive


def test_a_post_grad_pass_sees_the_backward_graph_and_keys_the_caches():
    """inductor runs the pass on the forward and the backward after autograd; the backward's
    incoming gradients are named tangents_*; the pass's uuid() is part of the cache key."""
    import torch._functorch.config
    from torch._inductor import config

    base = _torch_private.custom_graph_pass_base()
    seen = []

    class Record(base):
        def __call__(self, graph):
            seen.append(_torch_private.is_backward_graph(graph))

        def uuid(self):
            return "nimble_train.test.record"

    assert base is not object and hasattr(base, "uuid")
    graph_pass = Record()
    torch._dynamo.reset()
    try:
        with _torch_private.post_grad_pass(graph_pass):
            assert config.post_grad_custom_post_pass is graph_pass
            with config.patch(fx_graph_cache=False), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                x = torch.randn(4, 3, requires_grad=True)
                torch.compile(lambda t: (t.sin() * 2).sum())(x).backward()
        assert config.post_grad_custom_post_pass is None
    finally:
        torch._dynamo.reset()
    assert seen == [False, True]  # the forward, then the backward


def test_a_pre_grad_pass_sees_dynamos_graph_of_torch_functions():
    """inductor runs the pass on dynamo's graph, before autograd: torch functions, not aten
    operators; the setting is restored after the block."""
    import torch._functorch.config
    from torch._inductor import config

    base = _torch_private.custom_graph_pass_base()
    seen = []

    class Record(base):
        def __call__(self, graph):
            graph = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
            seen.append([n.target for n in graph.nodes if n.op == "call_function"])

        def uuid(self):
            return "nimble_train.test.record-pre-grad"

    torch._dynamo.reset()
    try:
        with _torch_private.pre_grad_pass(Record()):
            with config.patch(fx_graph_cache=False), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                x = torch.randn(4, 3, requires_grad=True)
                torch.compile(lambda t: (torch.sin(t) * 2).sum())(x).backward()
        assert config.pre_grad_custom_pass is None
    finally:
        torch._dynamo.reset()
    assert len(seen) == 1 and torch.sin in seen[0]  # once, before the forward and backward split


def test_our_passes_run_after_the_users_and_leave_them_set():
    """A pass the user set in inductor's config still runs, first, within our blocks; the two
    are keyed for the caches together, and the user's is back after the block."""
    from torch._inductor import config

    base = _torch_private.custom_graph_pass_base()
    order = []

    class Named(base):
        def __init__(self, name):
            self.name = name

        def __call__(self, graph):
            order.append(self.name)

        def uuid(self):
            return self.name

    users = Named("user")
    with config.patch(pre_grad_custom_pass=users, post_grad_custom_post_pass=users):
        for block, setting in ((_torch_private.pre_grad_pass, "pre_grad_custom_pass"),
                               (_torch_private.post_grad_pass, "post_grad_custom_post_pass")):
            with block(Named("ours")):
                chained = getattr(config, setting)
                chained(torch.fx.Graph())
                assert chained.uuid() == "user+ours"
            assert getattr(config, setting) is users
    assert order == ["user", "ours", "user", "ours"]

    class NoUuid:
        def __call__(self, graph):
            pass
    with config.patch(pre_grad_custom_pass=NoUuid()), _torch_private.pre_grad_pass(Named("x")):
        assert config.pre_grad_custom_pass.uuid() is None  # inductor bypasses its caches


def test_binding_grad_accumulators_keeps_a_held_graph_accumulating_into_the_leaves():
    """_C.bind_grad_accumulators remakes the input metadata of a leaf's accumulator that an
    earlier graph keeps alive (torch's Node API, clear_input_metadata/add_input_metadata): the
    held graph's backward then still accumulates into the same leaves, as a fresh graph's does.
    On the CPU every tensor is on the one default stream, so none is bound to another; the CUDA
    case (a loss kept from an eager step) is tests/gpu/test_step_cuda.py's."""
    from nimble_train._extension import _C
    torch.manual_seed(3)
    lin, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(5, 4)
    assert _C.bind_grad_accumulators(list(lin.parameters())) == 0  # none alive yet
    held = lin(x).square().sum()
    assert _C.bind_grad_accumulators(list(lin.parameters())) == 0
    held.backward()
    ref(x).square().sum().backward()
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    with pytest.raises(ValueError, match="takes leaf tensors .* got a non-leaf tensor"):
        _C.bind_grad_accumulators([held])


def test_optimizer_step_hooks_are_the_instances_and_every_optimizers_in_step_order():
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([p], lr=0.1)
    assert _torch_private.optimizer_step_hooks(optimizer) == ()
    ran = []

    def hook(name):
        def run(opt, args, kwargs):
            ran.append(name)
        run.__qualname__ = name
        return run

    handles = [register_optimizer_step_post_hook(hook("global post")),
               optimizer.register_step_post_hook(hook("post")),
               optimizer.register_step_pre_hook(hook("pre")),
               register_optimizer_step_pre_hook(hook("global pre"))]
    try:
        found = _torch_private.optimizer_step_hooks(optimizer)
        p.grad = torch.ones(2)
        optimizer.step()
        assert [h.__qualname__ for _, _, h in found] == ran  # the order step() runs them in
        assert [kind for kind, _, _ in found] == ["pre-hook"] * 2 + ["post-hook"] * 2
        assert ran == ["global pre", "pre", "post", "global post"]
        assert len({key for _, key, _ in found}) == 4
    finally:
        for handle in handles:
            handle.remove()
    assert _torch_private.optimizer_step_hooks(optimizer) == ()
