"""Step's semantics on the CPU (the eager path runs the same code as the captured body)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import nimble_train as nt
from step_reference import (MLP, OwnLoss, SmallCNN, TwoInputs, assert_same_training,
                            classification_batches, eager_loop, grad_scaler_loop, twin)

per_sample = torch.nn.CrossEntropyLoss(reduction="none")


def run_step(model, optimizer, loss_fn, batches, **options):
    step = nt.Step(model, optimizer, loss_fn, warmup=2, **options)
    return step, [step(b).clone() for b in batches]


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
], ids=["sgd-nesterov", "adamw", "adam-amsgrad"])
def test_steps_equal_the_eager_loop(make_opt):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(MLP(), make_opt)
    batches = classification_batches(6, 16)
    _, losses = run_step(m1, o1, per_sample, batches)
    expected = eager_loop(m2, o2, per_sample, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    assert_same_training(m1, o1, m2, o2)


def test_scalar_loss_and_bf16_autocast_and_clipping():
    torch.manual_seed(1)
    (m1, o1), (m2, o2) = twin(MLP(), lambda p: torch.optim.SGD(p, lr=0.5))
    batches = classification_batches(5, 8)
    _, losses = run_step(m1, o1, F.cross_entropy, batches, amp="bf16", grad_clip=0.05)
    expected = eager_loop(m2, o2, F.cross_entropy, batches, amp=torch.bfloat16, grad_clip=0.05)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    assert_same_training(m1, o1, m2, o2)


def test_learning_rate_schedule_is_followed():
    torch.manual_seed(2)
    (m1, o1), (m2, o2) = twin(MLP(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    s1 = torch.optim.lr_scheduler.OneCycleLR(o1, max_lr=0.3, total_steps=8)
    s2 = torch.optim.lr_scheduler.OneCycleLR(o2, max_lr=0.3, total_steps=8)
    batches = classification_batches(8, 8)
    step = nt.Step(m1, o1, per_sample, warmup=1)
    for b in batches:
        step(b)
        s1.step()
    eager_loop(m2, o2, per_sample, batches, scheduler=s2)
    assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"]
    assert_same_training(m1, o1, m2, o2)


def test_short_last_batch_is_padded_and_equals_eager_on_the_real_samples():
    torch.manual_seed(3)
    (m1, o1), (m2, o2) = twin(MLP(), lambda p: torch.optim.Adam(p, lr=1e-2))
    batches = classification_batches(4, 16) + classification_batches(1, 5, seed=9)
    step, losses = run_step(m1, o1, per_sample, batches)
    expected = eager_loop(m2, o2, per_sample, batches)
    # The masked mean sums 16 rows (11 of them zero) where eager sums 5: same up to rounding.
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    assert_same_training(m1, o1, m2, o2)


def test_short_batch_through_batchnorm_runs_eagerly_and_matches():
    torch.manual_seed(4)
    (m1, o1), (m2, o2) = twin(SmallCNN(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    batches = (classification_batches(3, 8, image=True)
               + classification_batches(1, 3, image=True, seed=5))
    step, losses = run_step(m1, o1, per_sample, batches)
    expected = eager_loop(m2, o2, per_sample, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    assert_same_training(m1, o1, m2, o2)  # running statistics included


@pytest.mark.parametrize("loss_fn", [F.cross_entropy, per_sample], ids=["scalar", "per-sample"])
def test_partial_batch_eager_and_error(loss_fn):
    torch.manual_seed(5)
    (m1, o1), (m2, o2) = twin(MLP(), lambda p: torch.optim.SGD(p, lr=0.1))
    batches = classification_batches(3, 8) + classification_batches(1, 3, seed=7)
    _, losses = run_step(m1, o1, loss_fn, batches, partial_batch="eager")
    expected = eager_loop(m2, o2, loss_fn, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    assert_same_training(m1, o1, m2, o2)

    model = MLP()
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                   partial_batch="error")
    step(batches[0])
    with pytest.raises(nt.ShapeError, match=r"3 samples, fewer than the 8 .*\(drop_last=True\)"):
        step(batches[-1])


def test_tuple_inputs_and_dict_batches():
    torch.manual_seed(6)
    (m1, o1), (m2, o2) = twin(TwoInputs(), lambda p: torch.optim.SGD(p, lr=0.1))
    g = torch.Generator().manual_seed(0)
    batches = [((torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)),
                torch.randn(8, 4, generator=g)) for _ in range(4)]
    mse = torch.nn.MSELoss()
    _, losses = run_step(m1, o1, mse, batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_loop(m2, o2, mse, batches)))

    (m1, o1), (m2, o2) = twin(OwnLoss(), lambda p: torch.optim.AdamW(p, lr=1e-2))
    dicts = [{"input_ids": torch.randint(0, 11, (4, 7), generator=g),
              "labels": torch.randint(0, 11, (4, 7), generator=g)} for _ in range(4)]
    _, losses = run_step(m1, o1, None, dicts)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_loop(m2, o2, None, dicts)))
    assert_same_training(m1, o1, m2, o2)


def test_state_dict_resume_equals_an_uninterrupted_run():
    torch.manual_seed(7)
    batches = classification_batches(8, 8)
    make = lambda p: torch.optim.AdamW(p, lr=5e-3)  # noqa: E731
    (m1, o1), (m2, o2) = twin(MLP(), make)
    run_step(m1, o1, per_sample, batches)

    _, _ = run_step(m2, o2, per_sample, batches[:4])
    saved = copy.deepcopy({"model": m2.state_dict(), "optim": o2.state_dict()})
    m3 = MLP()
    o3 = make(m3.parameters())
    m3.load_state_dict(saved["model"])
    o3.load_state_dict(saved["optim"])
    run_step(m3, o3, per_sample, batches[4:])
    assert_same_training(m1, o1, m3, o3)


def test_batch_mismatches_raise_shape_error_saying_expected_and_got():
    model = MLP()
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample)
    x, y = classification_batches(1, 8)[0]
    step((x, y))
    cases = [
        ((x.double(), y), r"batch\[0\] must be a tensor of shape \(N<=8, 12\), torch.float32.*"
                          r"got a tensor of shape \(8, 12\), torch.float64"),
        ((x[:, :10], y), r"batch\[0\] must be .*got a tensor of shape \(8, 10\)"),
        ((torch.cat([x, x]), torch.cat([y, y])), "16 samples, more than the 8"),
        ((x, y[:4]), "4 samples but an earlier entry of the batch has 8"),
        ({"x": x, "y": y}, "structure differs"),
    ]
    for batch, message in cases:
        with pytest.raises(nt.ShapeError, match=message):
            step(batch)


def test_bad_arguments_are_rejected_with_the_fix():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        nt.Step("model", opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        nt.Step(model, "sgd")
    with pytest.raises(ValueError, match='streams must be "auto" or an int >= 1; got 0'):
        nt.Step(model, opt, per_sample, streams=0)
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        nt.Step(model, opt, per_sample, warmup=0)
    with pytest.raises(ValueError, match='amp must be None, "bf16" or "fp16"; got \'fp8\''):
        nt.Step(model, opt, per_sample, amp="fp8")
    with pytest.raises(ValueError, match="grad_clip must be None or a positive number"):
        nt.Step(model, opt, per_sample, grad_clip=-1.0)
    with pytest.raises(ValueError, match='partial_batch must be "pad", "eager" or "error"'):
        nt.Step(model, opt, per_sample, partial_batch="drop")
    step = nt.Step(model, opt, per_sample)
    with pytest.raises(TypeError, match=r"must be \(inputs, target\); got 3 items"):
        step((torch.randn(4, 12), torch.randn(4), torch.randn(4)))


def test_fp16_on_an_eager_step_uses_torch_grad_scaler():
    torch.manual_seed(8)
    (m1, o1), (m2, o2) = twin(MLP(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    batches = classification_batches(4, 8)
    _, losses = run_step(m1, o1, per_sample, batches, amp="fp16", grad_clip=1.0)
    expected = grad_scaler_loop(m2, o2, per_sample, batches, grad_clip=1.0)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    assert_same_training(m1, o1, m2, o2)


def test_loss_of_the_wrong_shape_is_rejected():
    model = MLP()
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   lambda out, y: F.cross_entropy(out, y, reduction="none").reshape(2, -1))
    with pytest.raises(ValueError,
                       match=r"one loss per sample \(shape \[8\]\); got shape \(2, 4\)"):
        step(classification_batches(1, 8)[0])


def test_stats_report_the_lifecycle():
    model = MLP()
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1), per_sample, warmup=2)
    assert step.stats()["warmup_left"] == 2 and step.stats()["phase"] == "template"
    for b in classification_batches(3, 8):
        step(b)
    stats = step.stats()
    assert stats["warmup_left"] == 0 and stats["steps"] == 3 and stats["eager_steps"] == 3
    assert stats["phase"] == "eager"  # the CPU: every step eager
    step.close()
    assert step.stats()["phase"] == "closed"
    assert stats["captured"] is False  # a CPU model runs eagerly
    for key in ("streams", "syncs", "graph_nodes", "pool_bytes"):
        assert key in stats


@pytest.mark.parametrize("off", [torch.no_grad, torch.inference_mode])
def test_a_call_with_autograd_off_is_refused_and_runs_nothing(off):
    """A step called inside torch.no_grad() (an evaluation loop calling the training step by
    mistake) is refused before anything runs, at its first call or later, where an eager
    loop's backward would raise torch's "does not require grad"; the steps after train as
    the eager loop."""
    torch.manual_seed(5)
    (m1, o1), (m2, o2) = twin(MLP(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    batches = classification_batches(4, 8)
    step = nt.Step(m1, o1, per_sample, warmup=2)
    for first in (True, False):
        before = copy.deepcopy((m1.state_dict(), o1.state_dict()))
        with off(), pytest.raises(nt.NimbleError, match=r"called with autograd off \(inside "
                                                        r"torch.no_grad\(\).*step.evaluator"
                                                        r".*Nothing was run"):
            step(batches[0])
        torch.testing.assert_close((m1.state_dict(), o1.state_dict()), before, rtol=0, atol=0)
        assert step.stats()["steps"] == (0 if first else 2)
        if first:
            assert step.stats()["phase"] == "template"
            step(batches[0])
            step(batches[1])
    for b in batches[2:]:
        step(b)
    eager_loop(m2, o2, per_sample, batches)
    assert_same_training(m1, o1, m2, o2)


def test_a_closed_step_refuses_to_run():
    model = MLP()
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   torch.nn.CrossEntropyLoss())
    batch = classification_batches(1, 4)[0]
    step(batch)
    step.close()
    with pytest.raises(nt.NimbleError, match="this Step was closed"):
        step(batch)


def test_a_compiled_module_that_replays_cuda_graphs_of_its_own_is_refused_by_name():
    from nimble_train._options import check_compiled_graphs
    holder = torch.nn.Sequential(torch.nn.Linear(4, 4),
                                 torch.compile(torch.nn.Linear(4, 2), mode="reduce-overhead"))
    with pytest.raises(ValueError, match=r"model\.1 was compiled to replay CUDA graphs") as info:
        check_compiled_graphs(holder)
    assert 'mode="max-autotune-no-cudagraphs"' in str(info.value)
    assert "capture=False" in str(info.value)
    with pytest.raises(ValueError, match="the model was compiled to replay CUDA graphs"):
        check_compiled_graphs(torch.compile(MLP(), mode="max-autotune"))
    in_place = MLP()
    in_place.compile(options={"triton.cudagraphs": True})
    with pytest.raises(ValueError, match=r"model\.0 was compiled to replay CUDA graphs"):
        check_compiled_graphs(torch.nn.Sequential(in_place))
    check_compiled_graphs(torch.compile(MLP()))  # inductor without its CUDA graphs: fine
    check_compiled_graphs(torch.nn.Sequential(torch.compile(MLP(), backend="eager"), MLP()))


def _running_expression():
    """What the caller is running while it waits for this call (as a host sync's caller is)."""
    import sys
    from nimble_train._sync import expression
    return expression(sys._getframe(1))


def test_host_syncs_are_named_by_the_expression_that_ran():
    # Step names a host sync by the running expression of the user's frame (no torch-function
    # mode, which would make torch.compile compile the warm-up's code again inside the capture).
    found = [_running_expression(), None][0]
    assert found == "_running_expression()"
    found = (_running_expression
             ())
    assert found == "an operation"  # the call spans two lines


def test_a_warning_raised_deep_in_nimble_train_names_the_users_line():
    # Step's warnings (one stream, an optimizer captured as it is, an evaluator left eager) are
    # raised several calls deep; they name the line that called into nimble_train.
    import os
    import sys
    import warnings

    import nimble_train._sync as sync
    inner = os.path.join(os.path.dirname(sync.__file__), "_deep.py")  # frames inside the package
    code = compile("def deep(warn):\n    return warn('deep')\n"
                   "def outer(warn):\n    return deep(warn)\n", inner, "exec")
    scope = {}
    exec(code, scope)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        scope["outer"](sync.warn_at_user)
    assert [(w.filename, w.lineno, str(w.message)) for w in caught] == [(__file__, line, "deep")]


def test_static_inputs_keep_the_first_batch_layout():
    # A captured graph reads the static buffers: channels_last inputs stay channels_last (as
    # warm-up saw them), a non-dense first batch gets contiguous buffers, short batches fill
    # the leading rows.
    from nimble_train import _C
    from nimble_train._batch import BatchTemplate

    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    y = torch.arange(4)
    static = _C.StaticInputs(BatchTemplate((x, y)).specs())
    static.copy_in([x, y], 4)
    buffers = static.buffers
    assert buffers[0].stride() == x.stride() != torch.randn(4, 3, 8, 8).stride()
    assert torch.equal(buffers[0], x) and torch.equal(buffers[1], y)
    short = torch.randn(3, 3, 8, 8)  # contiguous: copied into the channels_last buffer
    assert static.check([short, y[:3]]) == 3
    static.copy_in([short, y[:3]], 3)
    assert torch.equal(buffers[0][:3], short) and torch.equal(buffers[0][3], x[3])

    gaps = torch.randn(4, 3, 8, 16)[..., ::2]
    static = _C.StaticInputs(BatchTemplate((gaps, y)).specs())
    static.copy_in([gaps, y], 4)
    assert static.buffers[0].is_contiguous() and torch.equal(static.buffers[0], gaps)


@pytest.mark.parametrize("batch", [
    (torch.randn(4, 3), torch.arange(4)),
    [(torch.randn(4, 3), torch.randn(4, 2)), torch.arange(4)],
    {"input_ids": torch.zeros(4, 5, dtype=torch.long), "labels": torch.ones(4, 5)},
    {"x": (torch.randn(4, 1), 7), "y": [torch.arange(4), "tag"]},
], ids=["pair", "nested", "dict", "constants"])
def test_the_fast_flatten_agrees_with_pytree(batch):
    from nimble_train._batch import BatchTemplate
    from nimble_train._torch_private import pytree

    template = BatchTemplate(batch)
    assert template._fast is not None
    fresh = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)
    leaves = template.flatten(fresh)
    expected = pytree.tree_flatten(fresh)[0]
    assert len(leaves) == len(expected)
    assert all(a is b for a, b in zip(leaves, expected))
    assert template.unflatten(template.tensors(fresh)).__class__ is batch.__class__


def test_a_batch_of_another_structure_is_refused_by_either_path():
    import collections

    from nimble_train._batch import BatchTemplate

    Pair = collections.namedtuple("Pair", "x y")
    x, y = torch.randn(4, 3), torch.arange(4)
    for first, other in [((x, y), [x, y]), ((x, y), (x, y, y)), ({"a": x, "b": y}, {"a": x}),
                         ({"a": x, "b": y}, {"a": x, "c": y}), ((x, y), ((x,), y)),
                         (Pair(x, y), (x, y))]:
        template = BatchTemplate(first)
        with pytest.raises(nt.ShapeError, match="structure differs"):
            template.flatten(other)
    template = BatchTemplate(Pair(x, y))  # pytree flattens named tuples: no fast path
    assert template._fast is None and len(template.flatten(Pair(x, y))) == 2
    constants = BatchTemplate(((x, 3), y))
    with pytest.raises(nt.ShapeError, match=r"batch\[0\]\[1\] was 3 in the first batch and is 4"):
        constants.tensors(((x, 4), y))
