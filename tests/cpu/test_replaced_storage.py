"""Data a captured step reads, replaced by user code between calls: parameters given new
storage (``p.data = t``) and an optimizer's state replaced by ``load_state_dict``. The graphs go
on reading the old tensors, so Step puts the new values where they read (ParamWatch, and
Update.settle_state for an optimizer captured as it is), or refuses what cannot go there.
The GPU tests train through both against the eager loop; these check the mechanics."""

import copy
import warnings

import pytest
import torch

import nimble_train as nt
from nimble_train import _C
from nimble_train._update import Update


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in ((4, 3), (3,), (3, 3))]


def test_flags_are_watched_from_the_start_and_storage_only_once_fixed():
    params = _params()
    watch = _C.ParamWatch(params, 2)  # the third: read by the graphs, outside the optimizer
    assert not watch.changed() and watch.first_flag_changed() == -1
    params[2].requires_grad_(False)  # not the optimizer's: its flag is not the step's concern
    assert not watch.changed()
    params[1].requires_grad_(False)
    assert watch.changed() and watch.first_flag_changed() == 1
    assert watch.was_trainable(1)
    params[1].requires_grad_(True)
    params[0].data = torch.zeros(4, 3)  # before capture: the graphs will read it there
    assert not watch.changed() and watch.moved() == []


@pytest.mark.parametrize("index", [0, 2])
def test_replaced_data_goes_back_where_the_graphs_read_it_with_the_new_values(index):
    params = _params(1)
    watch = _C.ParamWatch(params, 2)
    watch.fix_storage()
    p = params[index]
    where, others = p.data_ptr(), [q.detach().clone() for q in params]
    new = torch.randn(p.shape)
    p.data = new
    assert watch.changed() and watch.moved() == [index]
    assert watch.why_not_restorable(index) == ""
    watch.restore()
    assert not watch.changed() and watch.moved() == []
    assert p.data_ptr() == where and torch.equal(p.detach(), new)
    assert p.data_ptr() != new.data_ptr() and p.requires_grad
    for k, (q, before) in enumerate(zip(params, others)):
        if k != index:
            assert torch.equal(q.detach(), before)


def test_undo_moves_puts_each_tensor_back_on_the_storage_the_graphs_read_untouched():
    """After a failed capture: the data a forward gave holds no values (a capture runs
    nothing), so each moved tensor views the storage the graphs read again, as it was."""
    params = _params(2)
    watch = _C.ParamWatch(params, 2)
    watch.fix_storage()
    where = [p.data_ptr() for p in params]
    before = [p.detach().clone() for p in params]
    params[0].data = torch.full((4, 3), float("nan"))
    params[2].data = torch.empty(5)  # another shape too
    assert watch.moved() == [0, 2]
    watch.undo_moves()
    assert not watch.changed() and watch.moved() == []
    for p, ptr, values in zip(params, where, before):
        assert p.data_ptr() == ptr and torch.equal(p.detach(), values)
    assert params[0].requires_grad
    watch.undo_moves()  # nothing moved: nothing to do


def test_adopt_takes_an_untrained_parameters_new_storage_and_refuses_a_trained_one():
    """Another step's update moved a parameter this step reads but does not train into its
    flat buffers: the graphs captured next read it there, and the rest stays watched."""
    params = _params(3)
    watch = _C.ParamWatch(params, 2)
    with pytest.raises(ValueError, match="fix_storage first"):
        watch.adopt([2])
    watch.fix_storage()
    flat = torch.zeros(20)
    params[2].data = flat[4:13].view(3, 3)
    params[0].data = torch.zeros(4, 3)
    assert watch.moved() == [0, 2]
    with pytest.raises(ValueError, match=r"0 is not the index of a parameter outside the "
                                           r"trained ones \[2, 3\)"):
        watch.adopt([2, 0])
    assert watch.moved() == [0, 2]  # nothing adopted
    watch.adopt([2])
    assert watch.moved() == [0]
    assert params[2].data_ptr() == flat.data_ptr() + 4 * flat.element_size()
    watch.restore()  # the trained one goes back; the adopted one stays where it is now
    assert not watch.changed()
    assert params[2].data_ptr() == flat.data_ptr() + 4 * flat.element_size()


def test_tensors_given_at_fix_storage_take_the_place_of_the_untrained_ones():
    # Warm-up fixed the trained parameters (and a frozen one); capture reads a buffer too, and
    # the frozen one's replacement: those are watched from then on, the one they replace not.
    params = _params(4)
    stale, buffer = params[2], torch.randn(5)
    frozen = torch.nn.Parameter(torch.randn(3, 3), requires_grad=False)
    watch = _C.ParamWatch(params, 2)
    watch.fix_storage([frozen, buffer])
    stale.data = torch.zeros(3, 3)
    assert not watch.changed()  # no longer the graphs'
    new = torch.randn(5)
    where = buffer.data_ptr()
    buffer.data = new
    assert watch.moved() == [3] and watch.first_flag_changed() == -1
    watch.restore()
    assert buffer.data_ptr() == where and torch.equal(buffer, new) and not watch.changed()
    params[1].requires_grad_(False)  # the trained ones' flags are still watched
    assert watch.first_flag_changed() == 1


def test_views_of_one_flat_buffer_get_their_segment_back():
    # The fused optimizer's parameters are views of one buffer; one of them reassigned gets its
    # values copied into its segment, and the others' segments stay as they were.
    flat = torch.randn(21)
    params = [torch.nn.Parameter(torch.empty(0)) for _ in range(3)]
    for p, (start, shape) in zip(params, ((0, (4, 3)), (12, (3,)), (15, (2, 3)))):
        p.data = flat[start:start + torch.Size(shape).numel()].view(shape)
    watch = _C.ParamWatch(params, 3)
    watch.fix_storage()
    before = flat.clone()
    new = torch.randn(3)
    params[1].data = new
    watch.restore()
    assert torch.equal(flat[12:15], new)
    assert torch.equal(flat[:12], before[:12]) and torch.equal(flat[15:], before[15:])
    assert params[1].data_ptr() == flat[12:].data_ptr()


def test_new_data_overlapping_the_old_is_copied_from_a_snapshot():
    # p.data = p.data.t(): the new values are the old storage, read in another order.
    p = torch.nn.Parameter(torch.arange(9.0).view(3, 3))
    watch = _C.ParamWatch([p], 1)
    watch.fix_storage()
    expected = p.detach().t().clone()
    p.data = p.data.t()
    assert watch.moved() == [0] and watch.why_not_restorable(0) == ""
    watch.restore()
    assert torch.equal(p.detach(), expected) and p.is_contiguous()


def test_new_data_that_is_storage_another_restore_writes_is_read_before_it_is_written():
    # b takes a's old storage and a new data: a's restore (first) writes where b's values are.
    a, b = (torch.nn.Parameter(torch.randn(3, 3)) for _ in range(2))
    watch = _C.ParamWatch([a, b], 2)
    watch.fix_storage()
    a_old, new = a.detach().clone(), torch.randn(3, 3)
    b.data = a.data
    a.data = new
    assert watch.moved() == [0, 1] and watch.shares_memory_with(1) == -1
    watch.restore()
    assert torch.equal(a.detach(), new) and torch.equal(b.detach(), a_old)
    assert not watch.changed()


def test_one_that_cannot_go_back_leaves_the_others_unrestored_too():
    params = _params(3)
    watch = _C.ParamWatch(params, 3)
    watch.fix_storage()
    new = torch.randn(4, 3)
    params[0].data = new
    params[1].data = params[1].data.double()
    with pytest.raises(ValueError, match="parameter 1 cannot go back"):
        watch.restore()
    assert params[0].data_ptr() == new.data_ptr() and watch.moved() == [0, 1]


@pytest.mark.parametrize("change, said", [
    (lambda ps: setattr(ps[0], "data", ps[0].data.double()), r"Double \[4, 3\].*Float \[4, 3\]"),
    (lambda ps: setattr(ps[0], "data", torch.zeros(2, 6)), r"\[2, 6\] on cpu where the graphs "
                                                           r"read Float \[4, 3\]"),
    (lambda ps: setattr(ps[2], "data", ps[0].data[:3]), "shares memory with parameter 0"),
], ids=["dtype", "shape", "tied"])
def test_data_that_cannot_go_back_is_said_why_and_nothing_changes(change, said):
    params = _params(2)
    watch = _C.ParamWatch(params, 3)
    watch.fix_storage()
    change(params)
    (i,) = watch.moved()
    assert watch.why_not_restorable(i) != ""
    assert watch.shares_memory_with(i) == (0 if i == 2 and "shares" in said else -1)
    with pytest.raises(ValueError, match=said):
        watch.restore()


def _as_is_update(optimizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # captured as it is: slower, it says
        return Update(optimizer, None, True, torch.device("cpu"))


def _train(model, optimizer, steps, seed):
    torch.manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()


def test_a_loaded_optimizer_state_goes_into_the_tensors_the_graphs_read():
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    twin = copy.deepcopy(model)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)  # no fused form: captured as it is
    twin_opt = torch.optim.Adagrad(twin.parameters(), lr=0.1)
    update = _as_is_update(opt)
    assert update.fuse_reason is not None
    _train(model, opt, 2, seed=4)
    update.bake()  # after a capture: these tensors are what the graphs read
    read = [opt.state[p]["sum"] for p in model.parameters()]
    saved = copy.deepcopy(opt.state_dict())
    _train(model, opt, 2, seed=5)
    assert not update.changed()
    opt.load_state_dict(copy.deepcopy(saved))
    assert update.changed() and opt.state[next(model.parameters())]["sum"] is not read[0]
    update.settle_state()
    assert not update.changed()
    for p, tensor, key in zip(model.parameters(), read, saved["state"]):
        assert opt.state[p]["sum"] is tensor
        assert torch.equal(tensor, saved["state"][key]["sum"])
    # It trains on from the checkpoint as the same optimizer loaded plainly does.
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(saved))
    _train(model, opt, 3, seed=6)
    _train(twin, twin_opt, 3, seed=6)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_loaded_state_that_does_not_fit_is_refused_before_anything_changes():
    torch.manual_seed(7)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    update = _as_is_update(opt)
    _train(model, opt, 2, seed=8)
    update.bake()
    read = [opt.state[p]["sum"] for p in model.parameters()]
    values = [t.clone() for t in read]
    wrong = copy.deepcopy(opt.state_dict())
    wrong["state"][0]["sum"] = torch.zeros(2, 2)
    opt.load_state_dict(wrong)
    with pytest.raises(nt.NimbleError, match=r"param_groups\[0\]\['params'\]\[0\] the state "
                                             r"'sum' one of shape \(2, 2\).*reads one of shape "
                                             r"\(3, 4\).*build a new Step"):
        update.settle_state()
    for tensor, value in zip(read, values):
        assert torch.equal(tensor, value)
    assert update.changed()  # the next call says so again


def test_a_closed_update_leaves_no_hook_on_the_optimizer():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    update = _as_is_update(opt)
    _train(model, opt, 1, seed=9)
    update.bake()
    update.close()
    opt.load_state_dict(opt.state_dict())
    assert not update.loaded


def test_a_device_tensor_hyper_parameter_is_held_as_itself_and_a_cpu_one_by_value():
    """What an optimizer captured as it is bakes in: a device tensor (a CUDA lr; a meta one
    here) is read by the graph where it is, so a new tensor in its place is a change (a
    recapture) and an in-place update is not; a CPU tensor's value is baked, so its in-place
    update is a change."""
    from nimble_train import _capturable
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1, momentum=0.9)
    group = opt.param_groups[0]
    lr = group["lr"] = torch.tensor(1e-3, device="meta")
    group["weight_decay"] = torch.tensor(0.01)
    baked = _capturable.hyperparameters(opt, [False])
    assert baked[0]["lr"] is lr and baked[0]["weight_decay"] is not group["weight_decay"]
    assert _capturable.same_hyperparameters(_capturable.hyperparameters(opt, [False]), baked)
    group["weight_decay"].fill_(0.02)
    assert not _capturable.same_hyperparameters(_capturable.hyperparameters(opt, [False]), baked)
    group["weight_decay"].fill_(0.01)
    assert _capturable.same_hyperparameters(_capturable.hyperparameters(opt, [False]), baked)
    group["lr"] = torch.tensor(1e-3, device="meta")  # another tensor, though equal
    assert not _capturable.same_hyperparameters(_capturable.hyperparameters(opt, [False]), baked)


def test_a_fused_update_stages_no_host_value_for_a_device_tensor_hyper_parameter():
    """The fused update's staged row never reads a hyper-parameter held on the device (a CUDA
    lr; a meta one here), which would wait for the device at every step: its column holds 0
    and device_values names the tensor to copy over it; a CPU tensor is read as a float."""
    from nimble_train.optim._hyper import HYPER, STAGED, any_on_device, device_values, staged_row
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=0.1,
                            betas=(0.8, 0.99), weight_decay=0.05)
    assert not any_on_device("adam", opt.param_groups)
    opt.param_groups[0]["betas"] = (torch.tensor(0.8, device="meta"), 0.99)
    assert any_on_device("adam", opt.param_groups)
    assert [i for i, _ in device_values("adam", opt.param_groups)] == [HYPER["beta1"]]
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    lr = torch.tensor(1e-3, device="meta")
    opt.param_groups[1]["lr"] = lr
    opt.param_groups[0]["weight_decay"] = torch.tensor(0.02, dtype=torch.float64)
    rows = [staged_row("adam", group) for group in opt.param_groups]
    assert rows[0][HYPER["lr"]] == pytest.approx(0.1)
    assert rows[0][HYPER["weight_decay"]] == pytest.approx(0.02)
    assert rows[1][HYPER["lr"]] == 0.0 and rows[1][HYPER["beta1"]] == pytest.approx(0.8)
    found = device_values("adam", opt.param_groups)
    assert len(found) == 1 and found[0][0] == STAGED + HYPER["lr"] and found[0][1] is lr
    assert any_on_device("adam", opt.param_groups)
