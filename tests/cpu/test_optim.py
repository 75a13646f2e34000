"""FusedOptimizer on the CPU (the C++ reference path) against torch.optim, and LAMB,
DeviceLossScaler and the staging protocol.

float32: compared with torch directly. Bitwise equality is impossible: torch's CPU kernels are
vectorised with FMAs in places where the reference multiplies and adds, so results differ in
the last bit or two; the tolerances below are a few float32 ulps over a few steps.
float16/bfloat16: torch computes op by op in the parameter dtype (every intermediate rounded),
we compute in float32 and round once; both are judged against a float64 run of the same
optimizer, and ours must be within 2x of torch's error (plus a tiny floor).
"""

import copy
import io

import pytest
import torch

from nimble_train import _C
from nimble_train.optim import LAMB, DeviceLossScaler, FusedOptimizer
from optim_reference import (clone_params, groups, make_params, max_error, random_grads,
                             set_grads)

# name -> factory(params); several groups with their own hyper-parameters in each.
OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(
        groups(p, dict(lr=0.05, momentum=0.8, dampening=0.1)), lr=0.1, momentum=0.9,
        weight_decay=0.01),
    "sgd-nesterov": lambda p: torch.optim.SGD(
        groups(p, dict(weight_decay=0.0)), lr=0.1, momentum=0.9, nesterov=True,
        weight_decay=0.01),
    "sgd-plain-maximize": lambda p: torch.optim.SGD(
        groups(p, dict(lr=0.02)), lr=0.1, maximize=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(
        groups(p, dict(betas=(0.8, 0.99), weight_decay=0.0)), lr=1e-2, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(
        groups(p, dict(lr=3e-3, weight_decay=0.0)), lr=1e-2, weight_decay=0.1),
    "adam-amsgrad-maximize": lambda p: torch.optim.Adam(
        groups(p, dict(eps=1e-6)), lr=1e-2, amsgrad=True, maximize=True),
    "lamb": lambda p: LAMB(groups(p, dict(weight_decay=0.0)), lr=1e-2, weight_decay=0.01),
    "lamb-no-bias-correction": lambda p: LAMB(
        groups(p, dict(always_adapt=True, weight_decay=0.0)), lr=1e-2, bias_correction=False),
}


def state_tensors(optimizer):
    return {(i, k): v for i, p in enumerate(p for g in optimizer.param_groups
                                              for p in g["params"])
            for k, v in optimizer.state[p].items() if torch.is_tensor(v)}


def assert_same_params_and_state(params, opt, ref_params, ref):
    """float32 parameters and optimizer state as torch.optim's, to rounding."""
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ours, theirs = state_tensors(opt), state_tensors(ref)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(ours[key].cpu(), theirs[key].cpu().to(ours[key].dtype),
                                   rtol=1e-5, atol=1e-6, msg=f"state {key}")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_float32_matches_torch(name):
    make = OPTIMIZERS[name]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    fused = FusedOptimizer(opt)
    for step in range(4):
        grads = random_grads(params, step)
        set_grads(ref_params, grads)
        set_grads(params, grads)
        ref.step()
        fused.step()
    assert_same_params_and_state(params, opt, ref_params, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["sgd-nesterov", "sgd-momentum", "adamw", "adam", "lamb"])
def test_low_precision_error_within_twice_torch(name, dtype):
    make = OPTIMIZERS[name]
    base = make_params(dtype)
    exact, torch_params, params = (clone_params(base, torch.float64), clone_params(base),
                                   clone_params(base))
    opt_exact, opt_torch, opt = make(exact), make(torch_params), make(params)
    if dtype == torch.float16:
        # torch's float16 Adam rounds eps = 1e-8 to 0 and divides by a sqrt(v) that underflows:
        # NaN. 1e-4 is representable, so torch gives an error to compare with.
        for o in (opt_exact, opt_torch, opt):
            for group in o.param_groups:
                if "eps" in group:
                    group["eps"] = max(group["eps"], 1e-4)
    fused = FusedOptimizer(opt)
    for step in range(5):
        grads = random_grads(params, step, dtype)  # the same low-precision gradients for all
        set_grads(exact, [g.double() for g in grads])
        set_grads(torch_params, grads)
        set_grads(params, grads)
        opt_exact.step()
        opt_torch.step()
        fused.step()
    err_ours, err_torch = max_error(params, exact), max_error(torch_params, exact)
    assert err_ours <= 2 * err_torch + 1e-6, (err_ours, err_torch)


def test_mixed_dtypes_make_one_flat_buffer_each():
    params = make_params()
    params[1] = params[1].detach().to(torch.bfloat16).requires_grad_()
    params[4] = params[4].detach().to(torch.float16).requires_grad_()
    fused = FusedOptimizer(torch.optim.AdamW(params, lr=1e-2))
    flats = fused.flat_params
    assert set(flats) == {torch.float32, torch.bfloat16, torch.float16}
    for dtype, flat in flats.items():
        assert flat.data_ptr() % 16 == 0
        for p, offset, numel in fused.segments(dtype):
            assert p.data_ptr() == flat.data_ptr() + offset * flat.element_size()
            assert (offset * flat.element_size()) % 16 == 0
            assert p.grad.data_ptr() == (fused.flat_grads[dtype].data_ptr()
                                         + offset * flat.element_size())
    exact = clone_params(params, torch.float64)
    ref = torch.optim.AdamW(exact, lr=1e-2)
    for step in range(3):
        grads = random_grads(params, step)
        set_grads(params, grads)
        set_grads(exact, [g.double() for g in grads])
        fused.step()
        ref.step()
    for p, e in zip(params, exact):
        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[p.dtype]
        torch.testing.assert_close(p.double(), e, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov", "lamb"])
def test_skipped_overflow_step_changes_nothing(name):
    """A float16 step with inf/NaN gradients leaves parameters, state and step count as they
    were, so the run equals, bit for bit, a twin run that never saw the bad step."""
    make = OPTIMIZERS[name]
    base = make_params(torch.float16)
    twin_params, params = clone_params(base), clone_params(base)
    opt = make(params)
    fused, twin = FusedOptimizer(opt), FusedOptimizer(make(twin_params))
    inv_scale = torch.tensor([1 / 512.0])
    found_inf = torch.full((1,), -1.0)

    def clean_step(seed):
        grads = [g * 512 for g in random_grads(params, seed, torch.float16)]  # "scaled"
        set_grads(params, grads)
        set_grads(twin_params, grads)
        fused.step(inv_scale=inv_scale, found_inf=found_inf)
        assert found_inf.item() == 0.0
        twin.step(inv_scale=inv_scale)

    clean_step(0)
    before = [p.detach().clone() for p in params]
    state_before = {k: v.clone() for k, v in state_tensors(opt).items()}
    grads = random_grads(params, 1, torch.float16)
    grads[2][0] = float("inf")
    grads[4][1, 1] = float("nan")
    set_grads(params, grads)
    fused.step(inv_scale=inv_scale, found_inf=found_inf)
    assert found_inf.item() == 1.0
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    for key, value in state_tensors(opt).items():
        assert torch.equal(value, state_before[key]), f"state {key} changed"  # step count too
    clean_step(2)
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)
    for (key, a), b in zip(state_tensors(opt).items(), state_tensors(twin.optimizer).values()):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("max_norm", [0.5, 1e4], ids=["clipping", "below-max"])
@pytest.mark.parametrize("name", ["adamw", "sgd-momentum", "lamb"])
def test_clipping_matches_clip_grad_norm(name, max_norm):
    make = OPTIMIZERS[name]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    fused = FusedOptimizer(opt)
    inv_scale = torch.tensor([0.25])
    for step in range(3):
        grads = random_grads(params, step)
        set_grads(params, grads)
        set_grads(ref_params, [g * 0.25 for g in grads])  # unscaled by hand for torch
        expected = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
        norm = fused.step(inv_scale=inv_scale, max_grad_norm=max_norm)
        ref.step()
        assert norm.shape == ()
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum", "adam-amsgrad-maximize", "lamb"])
def test_state_dict_round_trip_through_plain_torch(name):
    make = OPTIMIZERS[name]
    params, twin_params = make_params(), make_params()
    opt = make(params)
    fused = FusedOptimizer(opt)
    for step in range(3):
        set_grads(params, random_grads(params, step))
        fused.step()
    # Save from the fused optimizer, as a checkpoint would, and load into a plain one.
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for t, p in zip(twin_params, params):
            t.copy_(p)
    plain = make(twin_params)
    plain.load_state_dict(torch.load(buffer))
    for step in range(3, 5):
        grads = random_grads(params, step)
        set_grads(params, grads)
        set_grads(twin_params, grads)
        fused.step()
        plain.step()
    for a, b in zip(params, twin_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # And back: the plain optimizer's state into the fused one (refresh_state runs by hook).
    opt.load_state_dict(plain.state_dict())
    with torch.no_grad():
        for t, p in zip(twin_params, params):
            p.copy_(t)
    for key, value in state_tensors(opt).items():
        flat_ptrs = [b.data_ptr() for b in fused._flats[0].state.values()]
        flat_ptrs.append(fused._tables.param_steps.data_ptr())
        assert any(value.untyped_storage().data_ptr() == ptr for ptr in flat_ptrs), key
    for step in range(5, 7):
        grads = random_grads(params, step)
        set_grads(params, grads)
        set_grads(twin_params, grads)
        fused.step()
        plain.step()
    for a, b in zip(params, twin_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_scheduler_changes_reach_the_update():
    ref_params, params = make_params(), make_params()
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    fused = FusedOptimizer(opt)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ref, opt)]
    for step in range(5):
        grads = random_grads(params, step)
        set_grads(ref_params, grads)
        set_grads(params, grads)
        ref.step()
        fused.step()
        for s in scheds:
            s.step()
        if step == 2:  # an edit by hand, of a value that is not the lr
            for o in (ref, opt):
                o.param_groups[0]["betas"] = (0.5, 0.9)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_staging_twice_before_a_step_uses_the_latest_values():
    params = make_params()
    opt = torch.optim.SGD(params, lr=0.1)
    fused = FusedOptimizer(opt, ring_slots=3)
    for step in range(7):  # wraps the ring twice
        opt.param_groups[0]["lr"] = 123.0
        fused.stage_host_values()
        opt.param_groups[0]["lr"] = 0.1 * (step + 1)
        fused.stage_host_values()
        before = params[0].detach().clone()
        set_grads(params, random_grads(params, step))
        fused.step()
        torch.testing.assert_close(params[0].detach(), before - 0.1 * (step + 1) * params[0].grad)
    assert fused.staging_errors() == 0


def test_zero_grad_zeroes_the_flat_buffer_and_keeps_views():
    params = make_params()
    fused = FusedOptimizer(torch.optim.SGD(params, lr=0.1))
    set_grads(params, random_grads(params, 0))
    views = [p.grad for p in params]
    fused.zero_grad()
    assert all(p.grad is v for p, v in zip(params, views))
    assert all(torch.count_nonzero(flat) == 0 for flat in fused.flat_grads.values())
    with pytest.raises(ValueError, match="cannot be set to None"):
        fused.zero_grad(set_to_none=True)


def test_torch_zero_grad_and_backward_are_repaired_into_the_flat_buffer():
    params = make_params()
    ref_params = make_params()
    opt, ref = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref_params, lr=0.1)
    fused = FusedOptimizer(opt)
    for ps, o in ((params, opt), (ref_params, ref)):
        o.zero_grad()  # set_to_none=True: our views are dropped
        sum(p.double().sum() * (i + 1) for i, p in enumerate(ps)).backward()
    fused.step()
    ref.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b)
    flat = fused.flat_grads[torch.float32]
    assert all(p.grad.untyped_storage().data_ptr() == flat.data_ptr() for p in params)


def test_module_state_dict_and_backward_use_the_flat_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    twin.load_state_dict(model.state_dict())
    fused = FusedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    x, y = torch.randn(16, 7), torch.randn(16, 3)
    for _ in range(3):
        fused.zero_grad()
        ref.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        fused.step()
        ref.step()
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)


def test_lamb_matches_a_float64_transcription():
    """nimble_train.optim.LAMB against the algorithm written out plainly in float64."""
    params = make_params(torch.float64)
    lamb = LAMB(groups(params, dict(weight_decay=0.0)), lr=0.02, weight_decay=0.01)
    copies = [p.detach().clone() for p in params]
    m = [torch.zeros_like(c) for c in copies]
    v = [torch.zeros_like(c) for c in copies]
    b1, b2, eps = 0.9, 0.999, 1e-6
    for step in range(1, 4):
        grads = random_grads(params, step, torch.float64)
        set_grads(params, grads)
        lamb.step()
        for i, g in enumerate(grads):
            wd = 0.01 if i < 3 else 0.0
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**step)) / ((v[i] / (1 - b2**step)).sqrt() + eps) + wd * copies[i]
            w_norm, u_norm = copies[i].norm(), u.norm()
            trust = (w_norm / u_norm).item() if wd != 0 and w_norm > 0 and u_norm > 0 else 1.0
            copies[i] = copies[i] - 0.02 * trust * u
    for p, c in zip(params, copies):
        torch.testing.assert_close(p.detach(), c, rtol=1e-12, atol=1e-12)


def test_lamb_zero_norms_give_a_trust_ratio_of_one():
    p = torch.zeros(10, requires_grad=True)
    lamb = LAMB([p], lr=0.1, weight_decay=0.01)
    p.grad = torch.ones(10)
    lamb.step()  # ||p|| = 0: trust 1, the plain Adam-like step of lr * 1/(1+eps)
    torch.testing.assert_close(p.detach(), torch.full((10,), -0.1 / (1 + 1e-6)))
    fused_p = torch.zeros(10, requires_grad=True)
    fused = FusedOptimizer(LAMB([fused_p], lr=0.1, weight_decay=0.01))
    fused_p.grad.fill_(1.0)
    fused.step()
    torch.testing.assert_close(fused_p.detach(), p.detach())


def test_device_loss_scaler_follows_grad_scaler():
    """The same sequence of clean and overflowing steps: the same scales, the same weights."""
    overflow = [False, True, False, False, False, True, True, False, False, False, False]
    torch.manual_seed(0)
    ref_params, params = make_params(), make_params()
    ref = torch.optim.SGD(ref_params, lr=0.01, momentum=0.9)
    fused = FusedOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9))
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    scaler = DeviceLossScaler("cpu", init_scale=2.0**10, growth_interval=3)
    x = torch.randn(4096, dtype=torch.float64)
    for step, bad in enumerate(overflow):
        for ps, scale_loss in ((ref_params, grad_scaler.scale), (params, scaler.scale_loss)):
            for p in ps:
                if p.grad is not None:
                    p.grad.zero_()
            loss = sum((p.double().flatten() * x[: p.numel()].roll(step)).sum() for p in ps)
            scale_loss(loss.float()).backward()
            if bad:
                ps[1].grad[5] = float("inf")
        grad_scaler.step(ref)
        grad_scaler.update()
        scaler.step(fused)
        assert scaler.scale.item() == grad_scaler.get_scale(), f"step {step}"
        assert scaler.found_inf.item() == float(bad)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    state = scaler.state_dict()
    assert state["scale"] == grad_scaler.state_dict()["scale"]
    assert state["_growth_tracker"] == grad_scaler.state_dict()["_growth_tracker"]


def test_parameters_without_grad_are_left_alone():
    params = make_params()
    params[2].requires_grad_(False)
    frozen = params[2].detach().clone()
    fused = FusedOptimizer(torch.optim.AdamW(params, lr=0.1, weight_decay=0.5))
    trainable = [p for p in params if p.requires_grad]
    set_grads(trainable, random_grads(trainable, 0))
    fused.step()
    assert torch.equal(params[2], frozen)
    assert params[2].grad is None


def test_a_parameter_frozen_after_fusing_leaves_the_old_buffers_when_fused_anew():
    """A Step rebuilt for a new set of trainable parameters fuses the optimizer anew: the
    parameters it leaves out get their own copies (values kept), so that the earlier flat
    buffers are not kept alive by their views, and the rest train on as torch's optimizer."""
    params = make_params()
    ref_params = clone_params(params)
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)
    ref = torch.optim.AdamW(ref_params, lr=0.1, weight_decay=0.5)
    fused = FusedOptimizer(opt)
    for i in range(2):
        for ps in (params, ref_params):
            set_grads(ps, random_grads(ps, i))
        fused.step()
        ref.step()
    first = fused._flats[0].param.untyped_storage()
    assert params[2].untyped_storage().data_ptr() == first.data_ptr()  # a view, so far
    fused.close()
    for p in (params[2], ref_params[2]):
        p.requires_grad_(False)
        p.grad = None
    frozen = params[2].detach().clone()
    fused = FusedOptimizer(opt)
    frozen_state = [opt.state[params[2]][k] for k in ("exp_avg", "exp_avg_sq")]
    for t in [params[2]] + frozen_state:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert t.untyped_storage().data_ptr() != first.data_ptr()
    assert torch.equal(params[2], frozen)
    for i in range(2, 4):
        for ps in (params, ref_params):
            trainable = [p for p in ps if p.requires_grad]
            set_grads(trainable, random_grads(trainable, i))
        fused.step()
        ref.step()
    assert torch.equal(params[2], frozen)
    assert_same_params_and_state(params, opt, ref_params, ref)


def test_why_unsupported_says_why():
    params = make_params()
    assert FusedOptimizer.why_unsupported(torch.optim.AdamW(params)) is None
    assert "RMSprop is not torch.optim.SGD" in FusedOptimizer.why_unsupported(
        torch.optim.RMSprop(params))
    double = [torch.zeros(3, dtype=torch.float64, requires_grad=True)]
    assert "torch.float64" in FusedOptimizer.why_unsupported(torch.optim.SGD(double, lr=0.1))
    mixed = torch.optim.Adam([{"params": params[:2], "amsgrad": True}, {"params": params[2:]}])
    assert "amsgrad differs" in FusedOptimizer.why_unsupported(mixed)
    with pytest.raises(ValueError, match="cannot fuse this optimizer: .*RMSprop"):
        FusedOptimizer(torch.optim.RMSprop(params))


def test_structural_changes_are_refused():
    params = make_params()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    fused = FusedOptimizer(opt)
    opt.param_groups[0]["momentum"] = 0.0
    with pytest.raises(ValueError, match="between zero and non-zero"):
        fused.step()
    adam = torch.optim.Adam(make_params(), lr=0.1)
    fused = FusedOptimizer(adam)
    adam.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        fused.stage_host_values()


def test_step_argument_errors():
    fused = FusedOptimizer(torch.optim.SGD(make_params(), lr=0.1))
    with pytest.raises(ValueError, match="inv_scale must be a one-element float32"):
        fused.step(inv_scale=torch.ones(2))
    with pytest.raises(ValueError, match="max_grad_norm must be a positive finite"):
        fused.step(max_grad_norm=-1.0)


def test_boundary_errors_name_what_was_wrong():
    p, g = torch.zeros(8), torch.zeros(9)
    chunks, _ = _C.optim_build_chunk_table(torch.tensor([0, 8]), torch.tensor([0]))
    hyper = torch.zeros(1, _C.optim_layout()["hyper_columns"])
    control = torch.zeros(_C.optim_layout()["control_size"])
    with pytest.raises(ValueError, match=r"grads must match params \(8 elements of Float\); "
                                         r"got 9 elements of Float"):
        _C.optim_sgd_update_(p, g, None, chunks, hyper, control)
    with pytest.raises(ValueError, match="chunk_elems must be a positive multiple of 8"):
        _C.optim_build_chunk_table(torch.tensor([0, 8]), torch.tensor([0]), 12)
    with pytest.raises(ValueError, match="must be float32, float16 or bfloat16; got Double"):
        _C.optim_grad_stats_(torch.zeros(4, dtype=torch.float64), None, torch.zeros(1, 2))


def test_channels_last_weights_keep_their_layout_and_update_like_torch():
    torch.manual_seed(11)
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    twin = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    twin.load_state_dict(conv.state_dict())
    opt = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    ref = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    fused = FusedOptimizer(opt)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    for _ in range(3):
        x = torch.randn(4, 3, 10, 10).to(memory_format=torch.channels_last)
        fused.zero_grad()
        conv(x).square().mean().backward()
        fused.step()
        ref.zero_grad()
        twin(x).square().mean().backward()
        ref.step()
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert conv.weight.grad.stride() == conv.weight.stride()
    torch.testing.assert_close(conv.weight, twin.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[conv.weight]["momentum_buffer"],
                               ref.state[twin.weight]["momentum_buffer"], rtol=1e-5, atol=1e-6)


def test_close_removes_the_hooks_and_the_optimizer_trains_on_eagerly():
    params = make_params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    fused = FusedOptimizer(opt)
    set_grads(params, random_grads(params, 0))
    fused.step()
    fused.close()
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = torch.optim.AdamW(twin_params, lr=1e-2)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    # No hook copies the loaded state into the flat buffers any more: it stays the tensors
    # load_state_dict made, and plain torch steps go on from it.
    flat_storage = {t.untyped_storage().data_ptr()
                    for f in fused._flats for t in f.state.values()}
    opt.load_state_dict(copy.deepcopy(twin.state_dict()))
    for state in opt.state.values():
        assert state["exp_avg"].untyped_storage().data_ptr() not in flat_storage
    for step in (1, 2):
        grads = random_grads(params, step)
        set_grads(params, grads)
        set_grads(twin_params, grads)
        opt.step()
        twin.step()
    for a, b in zip(params, twin_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _random_slices(fused, seed):
    """The flat buffers cut into runs of whole segments at random, as buckets cut them."""
    g = torch.Generator().manual_seed(seed)
    slices = []
    for dtype, flat in fused.flat_grads.items():
        offsets = [offset for _, offset, _ in fused.segments(dtype)] + [flat.numel()]
        cuts = sorted({0, len(offsets) - 1, *torch.randint(1, len(offsets) - 1, (2,),
                                                           generator=g).tolist()})
        slices += [(dtype, offsets[a], offsets[b]) for a, b in zip(cuts, cuts[1:])]
    return slices


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_in_parts_matches_torch(name):
    """begin_update, then each part (in any order), then end_update: torch.optim's step, with
    accumulation's gradient factor too (LAMB: each part's trust ratios from its own whole
    tensors)."""
    make = OPTIMIZERS[name]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    fused = FusedOptimizer(opt)
    fused.split(_random_slices(fused, seed=len(name)))
    assert fused.num_parts >= 2
    order = torch.Generator().manual_seed(7)
    for step in range(4):
        grads = random_grads(params, step)
        factor = 0.25 + step / 4
        set_grads(ref_params, [g * factor for g in grads])
        set_grads(params, grads)
        ref.step()
        fused.begin_update(grad_scale=torch.tensor([factor]))
        for index in torch.randperm(fused.num_parts, generator=order).tolist():
            fused.update_part(index)
        fused.end_update()
    assert_same_params_and_state(params, opt, ref_params, ref)


@pytest.mark.parametrize("max_norm", [0.5, 1e4], ids=["clipping", "below-max"])
@pytest.mark.parametrize("name", ["adamw", "sgd-momentum", "adam-amsgrad-maximize", "lamb"])
def test_a_step_in_parts_with_statistics_matches_clip_grad_norm(name, max_norm):
    """Unscaling and clipping in parts: each part's share of the norm (in any order), then
    end_update's one update with the global norm, as clip_grad_norm_ and torch.optim."""
    make = OPTIMIZERS[name]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    fused = FusedOptimizer(opt)
    fused.split(_random_slices(fused, seed=3))
    assert fused.num_parts >= 2
    inv_scale, found_inf = torch.tensor([0.25]), torch.full((1,), -1.0)
    order = torch.Generator().manual_seed(5)
    for step in range(3):
        grads = random_grads(params, step)
        factor = 0.5 + step / 4  # accumulation's factor on top of the loss scale's
        set_grads(params, grads)
        set_grads(ref_params, [g * 0.25 * factor for g in grads])
        expected = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
        ref.step()
        before = [p.detach().clone() for p in params]
        fused.begin_update(inv_scale=inv_scale, found_inf=found_inf, max_grad_norm=max_norm,
                           grad_scale=torch.tensor([factor]))
        assert fused.update_waits_for_all_parts
        for index in torch.randperm(fused.num_parts, generator=order).tolist():
            fused.update_part(index)
            assert all(torch.equal(p, b) for p, b in zip(params, before))  # nothing updated yet
        norm = fused.end_update()
        assert not fused.update_waits_for_all_parts and found_inf.item() == 0.0
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert_same_params_and_state(params, opt, ref_params, ref)


def test_a_step_in_parts_skips_every_part_on_an_overflow_in_one():
    """An inf in one part's gradients: no part is updated, the step count stays, found_inf
    says so; the next clean step equals a twin's that never saw the bad one."""
    make = OPTIMIZERS["adamw"]
    base = make_params()
    params, twin_params = clone_params(base), clone_params(base)
    opt = make(params)
    fused, twin = FusedOptimizer(opt), FusedOptimizer(make(twin_params))
    fused.split(_random_slices(fused, seed=1))
    inv_scale, found_inf = torch.tensor([1 / 64.0]), torch.full((1,), -1.0)

    def in_parts(grads):
        set_grads(params, grads)
        fused.begin_update(inv_scale=inv_scale, found_inf=found_inf, max_grad_norm=1.0)
        for index in range(fused.num_parts):
            fused.update_part(index)
        return fused.end_update()

    def clean(seed):
        grads = [g * 64 for g in random_grads(params, seed)]
        in_parts(grads)
        assert found_inf.item() == 0.0
        set_grads(twin_params, grads)
        twin.step(inv_scale=inv_scale, max_grad_norm=1.0)

    clean(0)
    before = [p.detach().clone() for p in params]
    state_before = {k: v.clone() for k, v in state_tensors(opt).items()}
    grads = random_grads(params, 1)
    grads[-1].view(-1)[0] = float("inf")  # in the last part only
    norm = in_parts(grads)
    assert found_inf.item() == 1.0 and not torch.isfinite(norm)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    for key, value in state_tensors(opt).items():
        assert torch.equal(value, state_before[key]), f"state {key} changed"
    clean(2)
    assert_same_params_and_state(params, opt, twin_params, twin.optimizer)


def test_a_step_in_parts_abandoned_before_its_end_changes_nothing():
    """A backward that raises after some parts took their statistics: the step is abandoned,
    and the next one (in parts) is torch's first step."""
    make = OPTIMIZERS["adamw"]
    ref_params, params = make_params(), make_params()
    ref, opt = make(ref_params), make(params)
    fused = FusedOptimizer(opt)
    fused.split(_random_slices(fused, seed=2))
    before = [p.detach().clone() for p in params]
    set_grads(params, random_grads(params, 9))
    fused.begin_update(max_grad_norm=0.5)
    fused.update_part(0)
    fused.abandon_update()
    assert not fused.update_waits_for_all_parts
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    grads = random_grads(params, 0)
    set_grads(params, grads)
    set_grads(ref_params, grads)
    torch.nn.utils.clip_grad_norm_(ref_params, 0.5)
    ref.step()
    fused.begin_update(max_grad_norm=0.5)
    for index in range(fused.num_parts):
        fused.update_part(index)
    fused.end_update()
    assert_same_params_and_state(params, opt, ref_params, ref)


def test_a_step_in_parts_is_refused_where_it_cannot_be_right():
    params = make_params()
    fused = FusedOptimizer(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(RuntimeError, match="split"):
        fused.begin_update()
    lamb = FusedOptimizer(LAMB(make_params(), lr=1e-2))
    _, _, numel = lamb.segments(torch.float32)[0]
    assert numel > 4  # a part that ends inside a parameter would cut its trust ratio
    with pytest.raises(ValueError, match=r"whole parameters.*got \(torch.float32, 0, 4\)"):
        lamb.split([(torch.float32, 0, 4)])
    fused.split(_random_slices(fused, seed=0))
    with pytest.raises(ValueError, match="grad_scale must be a one-element float32"):
        fused.begin_update(grad_scale=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="begin_update: max_grad_norm must be a positive"):
        fused.begin_update(max_grad_norm=-1.0)
    assert not fused.update_waits_for_all_parts
