"""FusedOptimizer's CUDA kernels: against the CPU reference and torch.optim, overflow skip,
clipping, the device loss scale, and replays of a captured step with a new lr every step.

float32 cannot be bitwise equal to torch or to the CPU reference: nvcc contracts a * b + c into
FMAs and torch's CUDA kernels contract differently, so results differ in the last bits; the
tolerances are a few ulps. float16/bfloat16: ours must be within 2x of torch's error against a
float64 run.
"""

import threading

import pytest
import torch

from nimble_train import _C
from nimble_train.optim import LAMB, DeviceLossScaler, FusedOptimizer
import optim_reference
from optim_reference import clone_params, groups, max_error, random_grads, set_grads

pytestmark = pytest.mark.cuda

SHAPES = optim_reference.SHAPES + [(278011,)]  # one tensor spanning many chunks


def make_params(dtype=torch.float32, seed=0):
    return optim_reference.make_params(dtype, "cuda", seed, SHAPES)


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(
        groups(p, dict(lr=0.05, momentum=0.8, dampening=0.1)), lr=0.1, momentum=0.9,
        weight_decay=0.01),
    "sgd-nesterov": lambda p: torch.optim.SGD(
        groups(p, dict(weight_decay=0.0)), lr=0.1, momentum=0.9, nesterov=True,
        weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(
        groups(p, dict(betas=(0.8, 0.99), weight_decay=0.0)), lr=1e-2, weight_decay=0.01,
        eps=1e-4),
    "adamw": lambda p: torch.optim.AdamW(
        groups(p, dict(lr=3e-3, weight_decay=0.0)), lr=1e-2, weight_decay=0.1, eps=1e-4),
    "adam-amsgrad": lambda p: torch.optim.Adam(groups(p, dict(eps=1e-6)), lr=1e-2, amsgrad=True,
                                               eps=1e-4),
    "lamb": lambda p: LAMB(groups(p, dict(weight_decay=0.0)), lr=1e-2, weight_decay=0.01,
                           eps=1e-4),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_cuda_matches_the_cpu_reference(name, dtype):
    make = OPTIMIZERS[name]
    base = make_params(dtype)
    cuda_params, cpu_params = clone_params(base), clone_params(base, device="cpu")
    on_cuda, on_cpu = FusedOptimizer(make(cuda_params)), FusedOptimizer(make(cpu_params))
    for step in range(3):
        grads = random_grads(cuda_params, step)
        set_grads(cuda_params, grads)
        set_grads(cpu_params, grads)
        on_cuda.step(max_grad_norm=50.0)
        on_cpu.step(max_grad_norm=50.0)
    # Same math; float32 differs by FMA contraction and the order of the norm reductions; a
    # 16-bit value may round the other way once the float32 results differ in the last bit.
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for a, b in zip(cuda_params, cpu_params):
        torch.testing.assert_close(a.cpu().double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float32_matches_torch(name):
    make = OPTIMIZERS[name]
    ref_params, params = make_params(), make_params()
    ref, fused = make(ref_params), FusedOptimizer(make(params))
    for step in range(4):
        grads = random_grads(params, step)
        set_grads(ref_params, grads)
        set_grads(params, grads)
        ref.step()
        fused.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["sgd-nesterov", "adamw", "adam", "lamb"])
def test_low_precision_error_within_twice_torch(name, dtype):
    make = OPTIMIZERS[name]
    base = make_params(dtype)
    exact, torch_params, params = (clone_params(base, torch.float64), clone_params(base),
                                   clone_params(base))
    opt_exact, opt_torch, fused = make(exact), make(torch_params), FusedOptimizer(make(params))
    for step in range(5):
        grads = random_grads(params, step, dtype)
        set_grads(exact, [g.double() for g in grads])
        set_grads(torch_params, grads)
        set_grads(params, grads)
        opt_exact.step()
        opt_torch.step()
        fused.step()
    err_ours, err_torch = max_error(params, exact), max_error(torch_params, exact)
    assert err_ours <= 2 * err_torch + 1e-6, (err_ours, err_torch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("n", [1, 3, 8, 113, 278011])
def test_grad_stats_against_float64(n, offset, dtype):
    g = torch.Generator(device="cuda").manual_seed(n)
    flat = (torch.randn(n + offset, device="cuda", generator=g) * 30).to(dtype)
    grads = flat[offset:]
    inv_scale = torch.tensor([0.125], device="cuda")
    partials = torch.full((_C.optim_grad_stats_rows(n), 2), -1.0, device="cuda")
    _C.optim_grad_stats_(grads, inv_scale, partials)
    expected = ((grads.double() * 0.125) ** 2).sum()
    torch.testing.assert_close(partials[:, 0].double().sum(), expected, rtol=1e-5, atol=0)
    assert torch.all(partials[:, 1] == 0)
    grads[n // 2] = float("nan")
    _C.optim_grad_stats_(grads, inv_scale, partials)
    assert partials[:, 1].sum().item() == 1.0


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov", "lamb"])
def test_skipped_fp16_overflow_step_changes_nothing(name):
    make = OPTIMIZERS[name]
    base = make_params(torch.float16)
    params, twin_params = clone_params(base), clone_params(base)
    opt = make(params)
    fused, twin = FusedOptimizer(opt), FusedOptimizer(make(twin_params))
    inv_scale = torch.tensor([1 / 512.0], device="cuda")
    found_inf = torch.full((1,), -1.0, device="cuda")
    for step in range(3):
        grads = [g * 512 for g in random_grads(params, step, torch.float16)]
        if step == 1:
            grads[6][1000] = float("inf")
            before = [p.detach().clone() for p in params]
            state = [v.clone() for s in opt.state.values() for v in s.values()]
        set_grads(params, grads)
        fused.step(inv_scale=inv_scale, found_inf=found_inf)
        assert found_inf.item() == float(step == 1)
        if step == 1:
            assert all(torch.equal(p, b) for p, b in zip(params, before))
            after = [v for s in opt.state.values() for v in s.values()]
            assert all(torch.equal(a, b) for a, b in zip(after, state))  # step counts too
        else:
            set_grads(twin_params, grads)
            twin.step(inv_scale=inv_scale)
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum", "lamb"])
def test_clipping_and_unscale_match_torch(name):
    make = OPTIMIZERS[name]
    ref_params, params = make_params(), make_params()
    ref, fused = make(ref_params), FusedOptimizer(make(params))
    inv_scale = torch.tensor([0.25], device="cuda")
    for step in range(3):
        grads = random_grads(params, step)
        set_grads(params, grads)
        set_grads(ref_params, [g * 0.25 for g in grads])
        expected = torch.nn.utils.clip_grad_norm_(ref_params, 10.0)
        norm = fused.step(inv_scale=inv_scale, max_grad_norm=10.0)
        ref.step()
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ring_slots", [2, 16])
@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov", "lamb"])
def test_graph_replays_follow_a_new_lr_every_step(name, ring_slots):
    """Capture zero_grad; grads; step once, replay 30 times back to back, the lr changed by a
    scheduler before each replay, no synchronisation between replays; a slow matmul in the
    graph lets the host run ahead, so a racy staging buffer would hand replays later lrs."""
    make = OPTIMIZERS[name]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    fused = FusedOptimizer(opt, ring_slots=ring_slots)
    sources = random_grads(params, 0)
    counter = torch.zeros(1, device="cuda")
    slow = torch.randn(2048, 2048, device="cuda")

    def fill_grads(ps, k):  # different gradients every replay, computed on the device
        for p, s in zip(ps, sources):
            p.grad.copy_(torch.sin(s * k))

    def body():
        fused.zero_grad()
        counter.add_(1)
        for _ in range(8):
            slow.copy_(torch.tanh(slow @ slow * 1e-3))
        fill_grads(params, counter)
        fused.step(max_grad_norm=20.0)

    schedule = lambda s: 1.0 / (1 + 0.3 * s)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up: an eager step, its lr from param_groups now
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for _ in range(30):
        sched.step()
        fused.stage_host_values()
        graph.replay()
    torch.cuda.synchronize()
    assert fused.staging_errors() == 0

    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, schedule)
    ref_counter = torch.zeros(1, device="cuda")
    for step in range(31):
        if step > 0:  # step 0 is the warm-up, at the initial lr; replay i runs at schedule(i)
            ref_sched.step()
        ref_counter.add_(1)
        for p in ref_params:
            p.grad = torch.zeros_like(p)
        fill_grads(ref_params, ref_counter)
        torch.nn.utils.clip_grad_norm_(ref_params, 20.0)
        ref.step()
    # 31 steps of float32 with differently contracted FMAs: a few ulps per step.
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_a_cuda_tensor_lr_is_read_on_the_device_with_no_host_sync(name):
    """Learning rates held as CUDA tensors (as a compiled optimizer's recipe keeps them, filled
    by a schedule): each step copies them over their staged values on the device, so neither
    staging nor the replays wait for the device (sync debug mode "error" around them), each
    replay reads the values filled before it, and every step equals torch's."""
    make = OPTIMIZERS[name]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    for o in (ref, opt):
        for group in o.param_groups:
            group["lr"] = torch.tensor(group["lr"], device="cuda")
            if "capturable" in group:
                group["capturable"] = True  # torch's Adam takes a CUDA lr only so
    base = [group["lr"].item() for group in opt.param_groups]
    fused = FusedOptimizer(opt)
    sources = random_grads(params, 0)
    counter = torch.zeros(1, device="cuda")

    def fill_grads(ps, k):
        for p, s in zip(ps, sources):
            p.grad.copy_(torch.sin(s * k))

    def schedule(o, s):  # in place, as torch's schedulers fill a tensor lr
        for group, lr in zip(o.param_groups, base):
            group["lr"].fill_(lr / (1 + 0.3 * s))

    def body():
        fused.zero_grad()
        counter.add_(1)
        fill_grads(params, counter)
        fused.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # an eager step, at the initial lr
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(1, 21):
            schedule(opt, s)
            fused.stage_host_values()
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert fused.staging_errors() == 0

    ref_counter = torch.zeros(1, device="cuda")
    for s in range(21):
        if s > 0:
            schedule(ref, s)
        ref_counter.add_(1)
        for p in ref_params:
            p.grad = torch.zeros_like(p)
        fill_grads(ref_params, ref_counter)
        ref.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    read = [t for _, t in fused.device_values()]
    assert len(read) == 2 and all(t is g["lr"] for t, g in zip(read, opt.param_groups))


def test_device_loss_scaler_is_capturable_and_follows_grad_scaler_semantics():
    params = make_params()
    fused = FusedOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9))
    scaler = DeviceLossScaler("cuda", init_scale=2.0**8, growth_interval=2)
    bad = torch.zeros(1, device="cuda")
    sources = random_grads(params, 0)

    def body():
        fused.zero_grad()
        for p, s in zip(params, sources):
            p.grad.copy_(torch.where(bad > 0, torch.full_like(s, float("inf")), s * scaler.scale))
        scaler.step(fused)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # clean: tracker 1
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    pattern = [0, 1, 0, 0, 0, 1]
    expected_scale, tracker = 2.0**8, 1
    for flag in pattern:
        bad.fill_(float(flag))
        fused.stage_host_values()
        graph.replay()
        if flag:
            expected_scale, tracker = expected_scale * 0.5, 0
        else:
            tracker += 1
            if tracker == 2:
                expected_scale, tracker = expected_scale * 2, 0
        assert scaler.scale.item() == expected_scale
        assert scaler.found_inf.item() == float(flag)
    assert fused.staging_errors() == 0


@pytest.mark.parametrize("clip", [None, 5.0])
def test_sharded_lamb_on_two_ranks_matches_lamb_whole(clip):
    # Two ranks (threads on one GPU) each update their half of the flat buffers: the cut falls
    # inside tensors (the largest spans many chunks), whose trust ratios need both halves'
    # norms, added through reduce_partials. Each rank's half must be as LAMB on the whole.
    ranks = 2

    def make(p):  # every tensor adapts: the one cut in two (the largest, last) too
        return LAMB(groups(p, dict(weight_decay=0.0)), lr=1e-2, weight_decay=0.01, eps=1e-4,
                    always_adapt=True)
    base = make_params()
    whole_params = clone_params(base)
    whole = FusedOptimizer(make(whole_params))
    params = [clone_params(base) for _ in range(ranks)]
    shards = [FusedOptimizer(make(p), shard_world=ranks) for p in params]
    n = whole.flat_params[torch.float32].numel()
    cuts = [_C.shard_slice(0, n, ranks, r) for r in range(ranks)]
    barrier, slots = threading.Barrier(ranks, timeout=60), [None] * ranks

    def summed(r):
        def reduce(t):  # an in-place sum over the ranks, as NCCL's all-reduce
            slots[r] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            t.copy_(total)
        return reduce

    for r, fused in enumerate(shards):
        fused.shard([(torch.float32, *cuts[r])])
        fused.reduce_partials = summed(r)
    for step in range(3):
        grads = random_grads(whole_params, step)
        for p in [whole_params, *params]:
            set_grads(p, grads)
        whole.step(max_grad_norm=clip)
        errors = []

        def run(r):
            try:
                shards[r].step(max_grad_norm=clip)
            except BaseException as exc:  # noqa: BLE001 - raised below
                errors.append(exc)
                barrier.abort()
        threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        torch.cuda.synchronize()
        flats = [f.flat_params[torch.float32] for f in shards]
        for r, (start, stop, _, _) in enumerate(cuts):  # the all-gather
            for q in range(ranks):
                if q != r:
                    flats[q][start:stop].copy_(flats[r][start:stop])
    assert not any(torch.equal(a, b) for a, b in zip(whole_params, base))
    for r in range(ranks):
        for i, (a, b) in enumerate(zip(params[r], whole_params)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=r, i=i: f"rank {r}, tensor {i}: {m}")


def test_stage_host_values_refuses_to_run_inside_a_capture():
    fused = FusedOptimizer(torch.optim.SGD(make_params(), lr=0.1))
    fused.step()  # warm-up
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="outside the captured graph"):
        with torch.cuda.graph(graph):
            fused.stage_host_values()
