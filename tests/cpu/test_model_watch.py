"""The model as a captured step's graphs hold it: modules' modes, child modules, parameter
objects and buffers (ModelWatch over _C.EntryWatch). User code that assigns new ones between
calls changes a module's dicts, not what the graphs read: a mode, a module or a parameter is
refused, naming it; a buffer's new values go where the graphs read them. The GPU tests train
through these against the eager loop; these check the mechanics."""

import copy
import dataclasses
import functools
import gc
import logging
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nimble_train as nt
from nimble_train import NimbleError, _C
from nimble_train._model_watch import (ModelWatch, ScopeWatch, _reach, hidden_modules,
                                      named_scope_modules, reads_mode, refuse_scope_object,
                                      warn_replays_keep)
from nimble_train.optim import FusedOptimizer
from nimble_train.optim.fused import in_flat_buffers
from step_reference import Tempered


def captured_watch(model, loss_fn=None):
    """A ModelWatch as a step holds it once a graph was captured with the model's values."""
    watch = ModelWatch(model, loss_fn)
    watch.captured = True
    return watch


def test_numbers_changed_before_the_first_capture_are_taken():
    """Between warm-up (where the watch is made) and the first capture a number or constant
    may change: the capture bakes the new value, so nothing is refused; from then on it is."""
    model = nn.Sequential(DropPath(0.1), nn.Dropout(0.2))
    watch = ModelWatch(model)
    model[0].drop_prob, model[1].p = 0.3, 0.4
    assert watch.first_changed() >= 0
    watch.refuse_replaced_objects()  # taken
    assert watch.first_changed() == -1
    watch.captured = True
    model[1].p = 0.5
    with pytest.raises(NimbleError, match=r"'1.p' \(Dropout\) changed from 0.4 to 0.5 after "
                                          r"capture"):
        watch.refuse_replaced_objects()
    model[1].p, model[0].drop_prob = 0.4, 0.0
    with pytest.raises(NimbleError, match=r"'0.drop_prob' \(DropPath\) changed from 0.3"):
        watch.check_constants()
    model.add_module("2", nn.ReLU())  # an object, not a number: refused before capture too
    model[0].drop_prob, model[1].p = 0.3, 0.4
    watch.captured = False
    with pytest.raises(NimbleError, match=r"module '2' \(a ReLU\) was added"):
        watch.refuse_replaced_objects()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def test_an_untouched_model_and_values_changed_in_place_are_intact():
    model = _model()
    watch = captured_watch(model)
    assert watch.first_changed() == -1 and not watch.objects_changed()
    with torch.no_grad():
        model[0].weight.mul_(2)
        model[1].running_mean.add_(1)
    model[4].weight.data = torch.randn(5, 144)  # the same Parameter: ParamWatch's to see
    model.train()  # the same mode again
    assert watch.first_changed() == -1
    watch.check_modes()
    watch.refuse_replaced_objects()
    assert watch.replaced_tensors() == []


def test_a_mode_changed_is_seen_and_refused_naming_the_module():
    model = _model()
    watch = captured_watch(model)
    model[1].eval()
    assert watch.first_changed() >= 0 and not watch.objects_changed()
    with pytest.raises(NimbleError, match=r"module '1' \(BatchNorm2d\) is in eval mode.*captured "
                                          r"with it in training mode \(1 module\(s\) changed\)"):
        watch.check_modes()
    model.eval()
    with pytest.raises(NimbleError, match=r"the model is in eval mode.*\(6 module\(s\) changed\)"
                                          r".*call model.train\(\)"):
        watch.check_modes()
    model.train()
    assert watch.first_changed() == -1
    model[2].training = 1  # equal to True: taken as the captured mode, the fast path again
    assert watch.first_changed() >= 0
    watch.check_modes()
    assert watch.first_changed() == -1


def test_a_replaced_buffer_goes_back_with_its_new_values():
    model = _model()
    watch = captured_watch(model)
    read = model[1].running_var
    new = torch.rand(4) + 0.5
    model[1].running_var = new.clone()  # assigned: the module's _buffers entry
    assert watch.objects_changed()
    watch.refuse_replaced_objects()  # buffers are not refused
    buffers = watch.replaced_tensors()
    assert [(table, name) for table, name, _, _ in buffers] == [(model[1]._buffers,
                                                                 "running_var")]
    watch.put_back(buffers)
    assert model[1].running_var is read and torch.equal(read, new)
    assert watch.first_changed() == -1


@pytest.mark.parametrize("key, change, said", [
    ("running_mean", lambda m: setattr(m[1], "running_mean", torch.zeros(5)),
     r"the buffer '1.running_mean' was replaced.*now torch.float32 \[5\] on cpu where the "
     r"graphs read torch.float32 \[4\] on cpu"),
    ("num_batches_tracked", lambda m: setattr(m[1], "num_batches_tracked", None),
     r"the buffer '1.num_batches_tracked' was replaced.*it is removed where the graphs read "
     r"torch.int64 \[\]"),
], ids=["other-shape", "removed"])
def test_a_buffer_that_cannot_go_back_is_refused_and_nothing_changes(key, change, said):
    model = _model()
    watch = captured_watch(model)
    read = model[1]._buffers[key]
    before = read.clone()
    change(model)
    with pytest.raises(NimbleError, match=said):
        watch.replaced_tensors()
    assert torch.equal(read, before) and model[1]._buffers[key] is not read


def test_a_replaced_module_is_refused_naming_it_and_its_type():
    model = _model()
    watch = captured_watch(model)
    old = model[4]
    model[4] = nn.Linear(144, 5)
    with pytest.raises(NimbleError, match=r"module '4' \(Linear\) was replaced by another Linear "
                                          r"after capture.*build a new Step"):
        watch.refuse_replaced_objects()
    model[4] = nn.Identity()
    with pytest.raises(NimbleError, match=r"replaced by a Identity"):
        watch.refuse_replaced_objects()
    model[4] = old
    assert watch.first_changed() == -1


def test_parameters_loaded_by_assignment_are_refused_naming_the_first():
    model = _model()
    watch = captured_watch(model)
    originals = dict(model.named_parameters())
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(NimbleError, match=r"parameter '0.weight' was replaced by another tensor "
                                          r"after capture \(load_state_dict\(\.\.\., "
                                          r"assign=True\).*load_state_dict without assign=True"):
        watch.refuse_replaced_objects()
    for name, p in originals.items():
        module_name, key = name.rsplit(".", 1)
        setattr(model.get_submodule(module_name), key, p)
    watch.refuse_replaced_objects()  # the parameters are the captured ones again
    assert len(watch.replaced_tensors()) == 3  # the BatchNorm's three, loaded anew


def test_a_parameter_set_where_the_graphs_read_none_is_refused():
    model = _model()
    watch = captured_watch(model)
    model[0].bias = nn.Parameter(torch.zeros(4))
    with pytest.raises(NimbleError, match=r"parameter '0.bias' was set where the graphs read none"):
        watch.refuse_replaced_objects()


class Blocks(nn.Module):
    """A model that runs whatever its ModuleList and ParameterList hold, with a plain child."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(4))])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block, scale in zip(self.blocks, self.scales):
            x = block(x) * scale
        return self.head(x)


def test_a_module_or_parameter_added_to_a_container_is_refused_naming_it():
    model = Blocks()
    watch = captured_watch(model)
    model.blocks.append(nn.Linear(4, 4))  # the forward would run it; the graphs do not
    assert watch.first_changed() >= 0 and watch.objects_changed()
    with pytest.raises(NimbleError, match=r"module 'blocks.2' \(a Linear\) was added to 'blocks' "
                                          r"\(ModuleList\) after capture \(1 module\(s\) added\)"
                                          r".*Nothing was run"):
        watch.refuse_replaced_objects()
    del model.blocks[2]
    assert watch.first_changed() == -1
    model.scales.append(nn.Parameter(torch.ones(4)))
    with pytest.raises(NimbleError, match=r"parameter 'scales.1' \(torch.float32 \[4\] on cpu\) "
                                          r"was added to 'scales' \(ParameterList\)"):
        watch.refuse_replaced_objects()
    seq = _model()
    seq_watch = captured_watch(seq)
    seq.append(nn.ReLU())
    with pytest.raises(NimbleError, match=r"module '5' \(a ReLU\) was added to the model "
                                          r"\(Sequential\)"):
        seq_watch.refuse_replaced_objects()


def test_an_attribute_added_outside_a_container_is_left_alone():
    """A module made after capture outside a container (a metric made in a validation step),
    or a buffer registered on a module, is nothing the forward's code reads."""
    model = Blocks()
    watch = captured_watch(model)
    model.metric = nn.Linear(2, 2)
    model.head.register_buffer("seen", torch.zeros(2))
    assert watch.first_changed() == -1 and not watch.objects_changed()
    watch.refuse_replaced_objects()


def test_what_the_steps_own_forwards_add_to_a_container_is_taken():
    model = Blocks()
    watch = captured_watch(model)
    model.blocks.append(nn.Linear(4, 4))  # as a forward that grows its container would
    watch.after_forward()
    assert watch.first_changed() == -1
    model.blocks.append(nn.Linear(4, 4))  # user code's, between calls: refused again
    with pytest.raises(NimbleError, match=r"module 'blocks.3' \(a Linear\) was added"):
        watch.refuse_replaced_objects()


def _record(module, args, out):
    pass


def test_a_hook_registered_or_removed_after_capture_is_refused_naming_it():
    """A replay runs no Python: a hook registered after capture (on a module, on the loss
    module, or on every module) would never run, one removed would run on; each is refused,
    naming it and where, before anything runs. Before the first capture, and by the step's
    own calls, a change is taken (the capture runs the hooks in place)."""
    from torch.nn.modules import module as nn_module
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    kept = model[4].register_forward_pre_hook(lambda m, args: None)
    watch = captured_watch(model, loss_fn)
    cases = [
        (lambda: model[1].register_forward_hook(_record),
         r"a forward hook \(_record\) was registered on '1' \(BatchNorm2d\) after capture; "
         r"a replay runs no Python, so the step's graphs run without it"),
        (lambda: model[0].register_full_backward_hook(lambda m, gi, go: None),
         r"a backward hook \(.*<lambda>\) was registered on '0' \(Conv2d\)"),
        (lambda: loss_fn.register_forward_pre_hook(lambda m, args: None),
         r"a forward pre-hook .* was registered on 'loss_fn' \(CrossEntropyLoss\)"),
        (lambda: nn_module.register_module_forward_hook(_record),
         r"a global forward hook \(_record\) was registered on every module"),
    ]
    for register, said in cases:
        handle = register()
        assert watch.objects_changed()
        try:
            with pytest.raises(NimbleError, match=said + r".*Nothing was run"):
                watch.refuse_replaced_objects()
        finally:
            handle.remove()
        # torch's count of hooks moved: the slow path finds nothing changed and takes it
        assert watch.first_changed() >= 0
        watch.refuse_replaced_objects()
        assert watch.first_changed() == -1
    kept.remove()
    with pytest.raises(NimbleError, match=r"a forward pre-hook was removed from '4' \(Linear\) "
                                          r"after capture.*run it as they captured it"):
        watch.refuse_replaced_objects()
    watch.after_forward()  # as if the step's own call had removed it: taken
    assert watch.first_changed() == -1
    fresh = ModelWatch(model, loss_fn)  # not yet captured: a hook is taken
    handle = model[2].register_forward_hook(_record)
    fresh.refuse_replaced_objects()
    fresh.after_forward()
    fresh.captured = True
    assert fresh.first_changed() == -1
    handle.remove()
    with pytest.raises(NimbleError, match=r"a forward hook was removed from '2' \(ReLU\)"):
        fresh.refuse_replaced_objects()


def test_a_hook_on_a_parameters_gradient_or_one_in_place_of_another_is_refused_naming_it():
    """A hook registered on a parameter's gradient after capture (register_hook, or
    register_post_accumulate_grad_hook) would never run in a replay, one removed would run
    on, and a module's hook removed with another registered in its place would leave the old
    one running: each is refused, naming it and the parameter or module. A hook registered on
    a tensor the model does not hold is taken on the slow path, and so is any change before
    the first capture or made by the step's own calls."""
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    kept = model[0].weight.register_hook(lambda g: g * 2)  # in place at capture: stays
    watch = captured_watch(model, loss_fn)
    cases = [
        (lambda: model[4].bias.register_hook(_scale),
         r"a gradient hook \(_scale\) was registered on parameter '4.bias' \(register_hook\) "
         r"after capture; a replay runs no Python, so the step's graphs run without it"),
        (lambda: model[1].weight.register_post_accumulate_grad_hook(_record),
         r"a post-accumulate-grad hook \(_record\) was registered on parameter '1.weight' "
         r"\(register_post_accumulate_grad_hook\)"),
        (lambda: model[0].weight.register_hook(_scale),  # a second one: its dict's size grows
         r"a gradient hook \(_scale\) was registered on parameter '0.weight'"),
    ]
    for register, said in cases:
        handle = register()
        assert watch.first_changed() >= 0 and watch.objects_changed()
        with pytest.raises(NimbleError, match=said + r".*Nothing was run"):
            watch.refuse_replaced_objects()
        handle.remove()
        watch.refuse_replaced_objects()  # as captured again: taken
        assert watch.first_changed() == -1
    kept.remove()
    assert watch.first_changed() >= 0  # the dict's number of keys, on the fast path
    with pytest.raises(NimbleError, match=r"a gradient hook was removed from parameter "
                                          r"'0.weight' \(register_hook\) after capture.*run "
                                          r"it as they captured it"):
        watch.refuse_replaced_objects()
    kept = model[0].weight.register_hook(lambda g: g * 2)  # in place of the one removed
    with pytest.raises(NimbleError, match=r"a gradient hook \(.*<lambda>\) was registered on "
                                          r"parameter '0.weight'"):
        watch.refuse_replaced_objects()
    kept.remove()
    watch.after_forward()  # as if the step's own call had removed it: taken
    assert watch.first_changed() == -1
    module_hook = model[2].register_forward_hook(_record)
    watch.after_forward()
    module_hook.remove()
    module_hook = model[2].register_forward_hook(_record)  # as many hooks as before
    assert watch.first_changed() >= 0
    with pytest.raises(NimbleError, match=r"a forward hook \(_record\) was registered on "
                                          r"'2' \(ReLU\) after capture"):
        watch.refuse_replaced_objects()
    module_hook.remove()
    watch.after_forward()
    elsewhere = torch.zeros(3, requires_grad=True).register_hook(_scale)  # not the model's
    assert watch.first_changed() >= 0
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    elsewhere.remove()
    fresh = ModelWatch(model, loss_fn)  # not yet captured: a hook is taken
    handle = model[4].weight.register_post_accumulate_grad_hook(_record)
    fresh.refuse_replaced_objects()
    fresh.captured = True
    assert fresh.first_changed() == -1
    handle.remove()
    with pytest.raises(NimbleError, match=r"a post-accumulate-grad hook was removed from "
                                          r"parameter '4.weight'"):
        fresh.refuse_replaced_objects()
    # A module removed from a container, refused while a hook elsewhere moved torch's count,
    # then put back: the container as captured again, not one with a module added.
    watch = captured_watch(model, loss_fn)
    gone = model._modules.pop("4")
    elsewhere = torch.zeros(3, requires_grad=True).register_hook(_scale)
    with pytest.raises(NimbleError, match=r"module '4' \(Linear\) was removed after capture"):
        watch.refuse_replaced_objects()
    model._modules["4"] = gone
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    elsewhere.remove()


def _scale(grad):
    return grad * 0.5


def test_entry_watch_counts_the_keys_of_closed_dicts():
    a, closed = {"x": 1}, {"y": 2}
    watch = _C.EntryWatch([(a, "x", a["x"])], [closed])
    assert watch.first_changed() == -1 and watch.resized() == []
    a["z"] = 3  # not closed: left alone
    assert watch.first_changed() == -1
    closed["w"] = 4
    assert watch.first_changed() == 1 and watch.first_changed(1) == 1 and watch.resized() == [0]
    assert watch.changed() == []  # the entries themselves are intact
    watch.take_sizes()
    assert watch.first_changed() == -1
    with pytest.raises(TypeError, match=r"closed dict 0 must be a dict or a list; got tuple"):
        _C.EntryWatch([], [()])


def test_entry_watch_reads_a_lists_items_by_index_and_counts_a_closed_lists():
    """The modules a function reads through a list: each item by identity, the length closed."""
    first, second = object(), object()
    items = [first, second]
    watch = _C.EntryWatch([(items, 0, first), (items, 1, second)], [items])
    assert watch.first_changed() == -1
    items[1] = object()
    assert watch.first_changed() == 1 and watch.changed() == [1]
    watch.update(1)
    assert watch.first_changed() == -1
    items.append(object())  # a third: the length says it
    assert watch.first_changed() == 2 and watch.resized() == [0] and watch.changed() == []
    watch.take_sizes()
    items[:] = [first]  # the second gone: its entry says it, and the length
    assert watch.changed() == [1] and watch.resized() == [0]
    with pytest.raises(KeyError, match=r"entry 1's list holds no item 1 to update it to"):
        watch.update(1)
    with pytest.raises(TypeError, match=r"entry 0 watches a list, not a dict"):
        watch.retarget(0, {0: first})
    with pytest.raises(TypeError, match=r"entry 0 holds a list, so its key must be an index "
                                        r"\(an int >= 0\); got -1"):
        _C.EntryWatch([(items, -1, first)])


def test_entry_watch_compares_a_list_value_of_an_items_entry_by_its_items():
    """A list of numbers changes in place, which its identity does not show: an entry named in
    items keeps a copy and compares the items (by identity) and their number; any other entry
    compares the list itself by identity."""
    weights = [0.5, 2.0]
    a, b = {"w": weights}, {"w": weights}
    watch = _C.EntryWatch([(a, "w", weights), (b, "w", weights)], [], [0])
    assert watch.first_changed() == -1
    weights[1] = 3.0
    assert watch.changed() == [0]  # entry 1: the same list, by identity
    watch.update(0)  # the copy is taken again
    assert watch.first_changed() == -1
    weights.append(1.0)
    assert watch.changed() == [0]
    weights.pop()
    assert watch.first_changed() == -1  # the same items again
    a["w"] = list(weights)  # another list holding the same objects: the same value
    assert watch.changed() == []
    a["w"] = 1.0  # no list at all
    assert watch.changed() == [0]
    watch.update(0)
    a["w"] = [1.0]
    assert watch.changed() == [0]
    other = {"w": [4.0, 5.0]}
    watch.retarget(0, other)  # a config replaced: its list, by its items from now on
    assert watch.first_changed() == -1
    other["w"][0] = 4.5
    assert watch.changed() == [0]
    with pytest.raises(IndexError, match=r"items must hold entry indices in \[0, 2\); got 2"):
        _C.EntryWatch([(a, "w", a["w"]), (b, "w", weights)], [], [2])


def test_buffers_a_forward_assigned_in_a_capture_go_where_the_graphs_read_them():
    """Inside a capture the forward's `self.avg = ...` gets a copy into the buffer the graphs
    read; after a failed capture the assignment is undone with the values untouched."""
    from step_reference import RunningMean
    model = nn.Sequential(RunningMean(), nn.ReLU())
    watch = captured_watch(model)
    avg, calls = model[0].avg, model[0].calls
    model(torch.randn(4, 12))  # as the forward runs in a capture
    new_avg = model[0].avg
    assert new_avg is not avg and watch.objects_changed()
    watch.keep_assigned_tensors()
    assert model[0].avg is avg and torch.equal(avg, new_avg) and model[0].calls is calls
    assert calls.item() == 1 and watch.first_changed() == -1
    before = avg.clone()
    model(torch.randn(4, 12))  # a capture that fails after its forward
    watch.undo_capture()
    assert model[0].avg is avg and torch.equal(avg, before) and calls.item() == 1
    fits = torch.randn(12)
    model[0].avg, model[0].calls = fits, torch.zeros(3)
    with pytest.raises(NimbleError, match=r"the forward assigned buffer '0.calls' anew "
                                          r"\(torch.float32 \[3\] on cpu\) where the graph reads "
                                          r"torch.int64 \[\] on cpu.*Update it in place"):
        watch.keep_assigned_tensors()
    assert model[0].avg is fits and torch.equal(avg, before)  # refused before any copy


class Caching(Tempered):
    """Tempered with a private cache its forward makes anew in other shapes."""

    def __init__(self):
        super().__init__(6)
        self._cache = torch.zeros(0)

    def forward(self, x):
        y = super().forward(x)
        self._cache = torch.cat([self._cache, y.detach().sum(0)])
        return y


def test_a_tensor_attribute_replaced_goes_back_and_one_that_cannot_is_refused_or_taken():
    model = Caching()
    watch = captured_watch(model)
    read = model.temperature
    # what ParamWatch watches the data of, besides parameters and buffers, named
    assert [(name, t is getattr(model, name)) for name, t in watch.tensor_attributes()] == [
        ("temperature", True), ("state", True), ("last", True), ("_cache", True)]
    model.temperature = torch.tensor(0.5)  # a schedule: the graphs read `read`
    assert watch.objects_changed()
    watch.refuse_replaced_objects()
    tensors = watch.replaced_tensors()
    assert [(table, name) for table, name, _, _ in tensors] == [(vars(model), "temperature")]
    watch.put_back(tensors)
    assert model.temperature is read and read.item() == 0.5 and watch.first_changed() == -1
    model.temperature = torch.tensor([0.5, 0.5])
    with pytest.raises(NimbleError, match=r"the tensor attribute 'temperature' was replaced.*"
                                          r"now torch.float32 \[2\] on cpu where the graphs read "
                                          r"torch.float32 \[\] on cpu.*leading underscore "
                                          r"\(_temperature\)"):
        watch.replaced_tensors()
    assert read.item() == 0.5  # refused before any copy
    model.temperature = 0.5
    with pytest.raises(NimbleError, match=r"'temperature' was replaced.*now a float"):
        watch.replaced_tensors()
    model.temperature = read
    model._cache = torch.ones(3)  # private: the module's own business, taken as it is
    assert watch.replaced_tensors() == [] and watch.first_changed() == -1


def test_tensor_attributes_a_forward_assigns_in_a_capture_are_kept_or_taken():
    """Inside a capture the forward's `self.state = ...` and `self.last = ...` get a copy into
    the tensors the graphs read; a private cache that grew is taken as the forward left it
    (after_forward); after a failed capture every assignment is undone."""
    model = Caching()
    model(torch.randn(4, 6))  # warm-up: `last` and the cache take their shapes
    watch = captured_watch(model)
    state, last, cache = model.state, model.last, model._cache
    model(torch.randn(4, 6))  # as the forward runs in a capture
    new_state, new_last, new_cache = model.state, model.last, model._cache
    watch.keep_assigned_tensors()
    assert model.state is state and torch.equal(state, new_state)
    assert model.last is last and torch.equal(last, new_last)
    assert model._cache is new_cache and cache.shape == (6,) and new_cache.shape == (12,)
    watch.after_forward()
    assert watch.first_changed() == -1
    before = [t.clone() for t in (state, last)]
    model(torch.randn(4, 6))  # a capture that fails after its forward
    watch.undo_capture()
    assert model.state is state and model.last is last and model._cache is new_cache
    assert all(torch.equal(t, b) for t, b in zip((state, last), before))
    assert watch.first_changed() == -1


def test_numbers_a_failed_captures_forwards_changed_go_back():
    """A module counting its calls: a capture that fails leaves the count as after the last
    completed call; one that succeeds has it taken (after_forward)."""
    model = nn.Sequential(Counting(), nn.ReLU())
    model(torch.randn(2, 4))
    watch = captured_watch(model)
    model(torch.randn(2, 4))  # a capture that fails after its forward
    assert model[0].calls == 2
    watch.undo_capture()
    assert model[0].calls == 1 and watch.first_changed() == -1
    model(torch.randn(2, 4))  # one that succeeds
    assert watch.after_forward() == [("'0.calls' (Counting)", 1, 2)]
    assert model[0].calls == 2 and watch.first_changed() == -1
    model[0].calls = int("2")  # equal, another object: taken, not a change
    assert watch.after_forward() == []


def test_numbers_a_capture_changed_are_warned_of_once_each():
    warned = set()
    with pytest.warns(UserWarning, match=r"the step's capture changed '0.calls' \(Counting\) "
                                         r"from 1 to 2; 'x' from 0.5 to 0.25; a replay runs no "
                                         r"Python.*add_\(1\)"):
        warn_replays_keep([("'0.calls' (Counting)", 1, 2), ("'x'", 0.5, 0.25)], warned,
                          "the step's capture")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_replays_keep([("'0.calls' (Counting)", 2, 3)], warned, "the step's capture")
        warn_replays_keep([], warned, "the step's capture")
    with pytest.warns(UserWarning, match=r"fn changed 'y' from 1 to 2; a replay"):
        warn_replays_keep([("'x'", 0.25, 0.5), ("'y'", 1, 2)], warned, "fn")


RATE = 0.5  # a global the loss function below reads


def _scheduled_loss():
    smoothing, weights = 0.1, torch.ones(5)  # a tensor in the closure is not a number

    def loss_fn(out, y):
        return RATE * F.cross_entropy(out, y, weight=weights, label_smoothing=smoothing)

    def set_smoothing(value):
        nonlocal smoothing
        smoothing = value
    return loss_fn, set_smoothing


def test_numbers_a_loss_function_reads_from_its_scope_are_watched_as_numbers():
    global RATE
    loss_fn, set_smoothing = _scheduled_loss()
    watch = captured_watch(_model(), loss_fn)
    assert [w for w in watch._what if w[0] in ("closure", "global")] == [
        ("closure", -1, "smoothing"), ("global", -1, "RATE")]
    set_smoothing(0.05)
    assert watch.first_changed() >= 0 and watch.objects_changed()
    with pytest.raises(NimbleError, match=r"loss_fn's closure variable 'smoothing' changed from "
                                          r"0.1 to 0.05 after capture.*t.fill_\(v\)"):
        watch.refuse_replaced_objects()
    set_smoothing(float("0.1"))  # equal, another object: taken
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    RATE = 0.25
    try:
        with pytest.raises(NimbleError, match=r"the global 'RATE' that loss_fn reads changed "
                                              r"from 0.5 to 0.25"):
            watch.refuse_replaced_objects()
        # as if loss_fn had changed it itself during a call: taken, and said
        assert watch.after_forward() == [("the global 'RATE' that loss_fn reads", 0.5, 0.25)]
        assert watch.first_changed() == -1 and watch.after_forward() == []
    finally:
        RATE = 0.5
    bound = functools.partial(loss_fn)  # through a partial, the same function's scope
    assert len([w for w in ModelWatch(_model(), bound)._what
                if w[1] == -1 and w[0] in ("closure", "global")]) == 2
    assert [w for w in ModelWatch(_model(), F.cross_entropy)._what
            if w[1] == -1 and w[0] in ("closure", "global")] == []


def test_a_scope_watch_refuses_another_number_and_takes_an_equal_one():
    from nimble_train._model_watch import ScopeWatch
    threshold = 0.5

    def fn(model, batch):
        return (model(batch[0]) > threshold).sum()

    watch = ScopeWatch(fn, "the evaluator's fn", "make a new evaluator")
    watch.check()
    threshold = 0.75
    with pytest.raises(NimbleError, match=r"the evaluator's fn's closure variable 'threshold' "
                                          r"changed from 0.5 to 0.75 after capture.*or make a "
                                          r"new evaluator. Nothing was run"):
        watch.check()
    threshold = float("0.5")  # equal, another object: taken
    watch.check()
    threshold = 2.0
    # as fn would change it itself: taken, and said
    assert watch.after_call() == [("the evaluator's fn's closure variable 'threshold'", 0.5, 2.0)]
    watch.check()
    assert watch.after_call() == []
    assert threshold == 2.0
    threshold = 3.0  # as fn would change it in a capture that then fails
    watch.put_back()
    assert threshold == 2.0
    watch.check()


def test_a_scope_watch_refuses_another_tensor_or_module_under_a_name_fn_reads():
    """An evaluator's fn reading a mask and an averaged copy of the model by name: its graphs
    read those objects, so another one under the name is refused; one fn assigns itself is
    taken."""
    from nimble_train._model_watch import ScopeWatch
    mask, averaged = torch.ones(4), nn.Linear(4, 2)

    def fn(model, batch):
        return averaged(batch[0] * mask)

    watch = ScopeWatch(fn, "the evaluator's fn", "make a new evaluator")
    mask.mul_(2)  # in place: what the graphs read
    watch.check()
    mask = torch.ones(1)  # a one-element tensor: compared by identity, not by value
    with pytest.raises(NimbleError, match=r"the evaluator's fn's closure variable 'mask' was "
                                          r"given another tensor after capture, where it held a "
                                          r"tensor \(torch.float32 \[4\] on cpu\).*or make a new "
                                          r"evaluator. Nothing was run"):
        watch.check()
    watch.put_back()  # as after a failed capture: the tensor the graphs read
    assert mask.shape == (4,)
    kept = averaged
    averaged = nn.Linear(4, 2)
    with pytest.raises(NimbleError, match=r"closure variable 'averaged' was given another Linear "
                                          r"after capture, where it held a Linear; the graphs run "
                                          r"the module they were captured with.*averaged."
                                          r"load_state_dict\(state\)"):
        watch.check()
    assert watch.after_call() == []  # as fn would assign it itself: taken, no number said
    watch.check()
    averaged = kept
    with pytest.raises(NimbleError, match=r"'averaged' was given another Linear"):
        watch.check()


def scope_modules(fn):
    return [module for _, module in named_scope_modules(fn)]


class _Stub:
    """What ScopeModules reads of a Step: its model and the tensors its graphs read."""

    def __init__(self, model, watched=()):
        self.model, self._watched = model, list(watched)


def _averaging_evaluator():
    torch.manual_seed(0)
    model = _model()
    averaged = _model()

    def fn(m, batch):
        return averaged(batch[0])
    return model, averaged, fn


def test_the_modules_an_evaluators_fn_reads_are_run_as_captured():
    """An evaluator reading an averaged copy of the model: a mode changed, a module, parameter
    or buffer replaced is refused, naming it; a parameter's replaced data goes back where the
    graphs read it, its values copied there; the Step's model and tensors are not its."""
    from nimble_train._evaluator import ScopeModules
    model, averaged, fn = _averaging_evaluator()
    reads = ScopeModules(fn, _Stub(model, [averaged[0].weight]))
    assert "averaged.0.weight" not in reads._names  # the Step's graphs read it: the Step's
    assert reads._names[:3] == ["averaged.1.weight", "averaged.1.bias", "averaged.1.running_mean"]
    assert not reads.settle()
    read = averaged[4].weight.data
    new = torch.randn(5, 144)
    averaged[4].weight.data = new
    assert not reads.settle()
    assert averaged[4].weight.data_ptr() == read.data_ptr()
    assert torch.equal(averaged[4].weight, new)
    averaged[4].weight.data = torch.randn(5, 7)
    with pytest.raises(NimbleError, match=r"the data of 'averaged.4.weight', in a module fn reads "
                                          r"from its scope, was replaced.*its data is now Float "
                                          r"\[5, 7\].*make a new evaluator"):
        reads.settle()
    averaged[4].weight.data = new
    reads.settle()
    averaged[1].eval()
    with pytest.raises(NimbleError, match=r"module 'averaged.1', which fn reads from its scope, is "
                                          r"in eval mode, and the evaluator's graphs were captured "
                                          r"with it in training mode"):
        reads.settle()
    averaged[1].training = 1  # the same mode: taken
    reads.settle()
    assert reads._watch.first_changed() == -1
    averaged[4] = nn.Linear(144, 5)
    with pytest.raises(NimbleError, match=r"module 'averaged.4', in a module fn reads from its "
                                          r"scope, was replaced by another Linear after the "
                                          r"evaluator's capture"):
        reads.settle()
    averaged[4] = reads._entries[reads._what.index(("module", "averaged.4"))][2]
    averaged[1].running_mean = torch.zeros(4)
    with pytest.raises(NimbleError, match=r"buffer 'averaged.1.running_mean', in a module fn "
                                          r"reads from its scope, was replaced by another tensor"):
        reads.settle()
    model.eval()  # the Step's model: the evaluator puts it in eval mode itself
    assert ScopeModules(lambda m, b: m(b[0]), _Stub(model))._names == []


def test_a_number_of_a_module_an_evaluators_fn_reads_is_watched_by_value():
    """A dropout's p, a leaf's public number: baked into the evaluator's graphs, so another
    value is refused, an equal one taken; one fn's forwards change themselves is taken."""
    from nimble_train._evaluator import ScopeModules
    torch.manual_seed(0)
    averaged = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), Counting())
    reads = ScopeModules(lambda m, b: averaged(b[0]), _Stub(nn.Linear(2, 2)))
    averaged[1].p = 0.3
    with pytest.raises(NimbleError, match=r"'averaged.1.p', a number of a module fn reads from "
                                          r"its scope, changed from 0.1 to 0.3 after the "
                                          r"evaluator's capture.*Nothing was run"):
        reads.settle()
    averaged[1].p = float("0.1")  # equal, another object: taken
    reads.settle()
    assert reads._watch.first_changed() == -1
    averaged(torch.randn(2, 4))  # Counting counts its calls: fn's own change
    reads.take()
    reads.settle()
    averaged[2].calls = 7
    with pytest.raises(NimbleError, match=r"'averaged.2.calls'.*changed from 1 to 7"):
        reads.settle()


def test_a_list_of_numbers_of_a_module_an_evaluators_fn_reads_is_watched_by_its_items():
    """A leaf's list of scales changed in place after the evaluator's capture: refused; an
    equal item taken. One fn's forwards append to is taken (take), and put back in place after
    a failed capture (undo_capture)."""
    from nimble_train._evaluator import ScopeModules
    averaged = nn.Sequential(Staged(), Appending())
    reads = ScopeModules(lambda m, b: averaged(b[0]), _Stub(nn.Linear(2, 2)))
    averaged[0].scales[0] = 0.75
    with pytest.raises(NimbleError, match=r"'averaged.0.scales', a number of a module fn reads "
                                          r"from its scope, changed from \[0.5, 2.0\] to "
                                          r"\[0.75, 2.0\] after the evaluator's capture"):
        reads.settle()
    averaged[0].scales[0] = float("0.5")  # equal, another object: taken
    reads.settle()
    assert reads._watch.first_changed() == -1
    sizes = averaged[1].sizes
    averaged(torch.randn(2, 4))  # a capture that fails after its forward
    reads.undo_capture()
    assert averaged[1].sizes is sizes and sizes == [0] and reads._watch.first_changed() == -1
    averaged(torch.randn(3, 4))  # fn's own change
    reads.take()
    reads.settle()
    assert sizes == [0, 3]
    sizes.append(5)
    with pytest.raises(NimbleError, match=r"'averaged.1.sizes'.*changed from \[0, 3\] to "
                                          r"\[0, 3, 5\]"):
        reads.settle()


def test_an_attribute_that_held_none_in_a_module_an_evaluators_fn_reads_is_watched():
    """A teacher's mask, None when the evaluator captured: set after, refused (the graphs ran
    the code for None); None again passes; set by fn's own forwards, taken."""
    from nimble_train._evaluator import ScopeModules
    teacher = Gated()
    reads = ScopeModules(lambda m, b: teacher(b[0]), _Stub(nn.Linear(2, 2)))
    teacher.mask = torch.ones(4)
    with pytest.raises(NimbleError, match=r"'teacher.mask', an attribute of a module fn reads "
                                          r"from its scope, changed from None to a CPU tensor "
                                          r"of shape \(4,\) \(float32\) after the evaluator's "
                                          r"capture.*the code it ran for None"):
        reads.settle()
    teacher.mask = None
    reads.settle()
    teacher.note, teacher._cache = 1.0, 2.0  # not read, private
    assert reads._watch.first_changed() == -1
    teacher.mask = torch.ones(4)  # as fn's forward sets it
    reads.take()
    reads.settle()


class Smoothing(nn.Module):
    """Keeps a running mean of its input, assigned anew at each call (out of place)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        return x - self.mean


def test_a_failed_evaluator_capture_leaves_the_modules_fn_reads_as_before():
    """A capture runs fn's Python once and its kernels never: what the forwards of the modules
    fn reads changed (a call counter, a buffer assigned anew holding no values, data given
    anew) is put back as before the capture, as an eager loop that never made that call
    would have it."""
    from nimble_train._evaluator import ScopeModules
    torch.manual_seed(0)
    averaged = nn.Sequential(Counting(), Smoothing(), nn.Linear(4, 4))
    averaged(torch.randn(3, 4))  # an eager call before: its changes are the values now
    reads = ScopeModules(lambda m, b: averaged(b[0]), _Stub(nn.Linear(2, 2)))
    reads.take()
    calls, mean, weight = averaged[0].calls, averaged[1].mean, averaged[2].weight.data
    values = mean.clone()
    averaged(torch.randn(3, 4))  # as a capture runs it
    averaged[2].weight.data = torch.empty(4, 4)  # data a forward gave anew
    assert averaged[0].calls == calls + 1 and averaged[1].mean is not mean
    reads.undo_capture()
    assert averaged[0].calls == calls and averaged[1].mean is mean
    assert torch.equal(averaged[1].mean, values)
    assert averaged[2].weight.data_ptr() == weight.data_ptr()
    reads.settle()
    assert reads._watch.first_changed() == -1


def test_a_hook_on_a_module_an_evaluators_fn_reads_changed_after_capture_is_refused():
    """A replay runs no Python: a forward hook registered on (or removed from) a module fn
    reads from its scope after capture would silently not run (or still run), so it is
    refused, naming the module; one in place at capture is the graphs' own; a backward hook
    runs nothing under no_grad and is let be; a hook registered elsewhere is not these."""
    from nimble_train._evaluator import ScopeModules
    model, averaged, fn = _averaging_evaluator()
    kept = averaged[1].register_forward_hook(lambda m, i, o: o * 2)  # at capture: the graphs'
    reads = ScopeModules(fn, _Stub(model))
    handle = averaged[2].register_forward_hook(lambda m, i, o: o.clamp(max=0.5))
    with pytest.raises(NimbleError, match=r"step.evaluator: a forward hook \(.*<lambda>\) was "
                                          r"registered on 'averaged.2', a module fn reads from "
                                          r"its scope, after the evaluator's capture; a replay "
                                          r"runs no Python, so its graphs run without it.*make a "
                                          r"new evaluator.*Nothing was run"):
        reads.settle()
    handle.remove()
    reads.settle()
    assert reads._watch.first_changed() == -1
    kept.remove()
    kept = averaged[1].register_forward_hook(lambda m, i, o: o * 3)  # another in its place
    with pytest.raises(NimbleError, match=r"a forward hook \(.*<lambda>\) was registered on "
                                          r"'averaged.1'"):
        reads.settle()
    kept.remove()
    with pytest.raises(NimbleError, match=r"a forward hook was removed from 'averaged.1'.*run it "
                                          r"as they captured it"):
        reads.settle()
    kept = averaged[1].register_forward_pre_hook(lambda m, i: None)  # in its place: one key
    with pytest.raises(NimbleError, match=r"a forward pre-hook \(.*<lambda>\) was registered on "
                                          r"'averaged.1'"):
        reads.settle()
    kept.remove()
    reads = ScopeModules(fn, _Stub(model))
    averaged[4].register_full_backward_hook(lambda m, gi, go: None)
    model.register_forward_hook(lambda m, i, o: o)  # the Step's model: the Step's to refuse
    nn.Linear(2, 2).register_forward_hook(lambda m, i, o: o)
    reads.settle()
    assert reads._watch.first_changed() == -1
    averaged[3].register_forward_pre_hook(lambda m, i: None)
    with pytest.raises(NimbleError, match=r"a forward pre-hook \(.*\) was registered on "
                                          r"'averaged.3'"):
        reads.settle()


def test_a_module_added_to_a_container_an_evaluators_fn_reads_is_refused():
    from nimble_train._evaluator import ScopeModules
    model, averaged, fn = _averaging_evaluator()
    reads = ScopeModules(fn, _Stub(model))
    averaged.append(nn.Identity())
    with pytest.raises(NimbleError, match=r"step.evaluator: module averaged.5 \(a Identity\) was "
                                          r"added to 'averaged', a module fn reads from its "
                                          r"scope, after the evaluator's capture.*Nothing was run"):
        reads.settle()
    del averaged[5]
    reads.settle()
    assert reads._watch.first_changed() == -1
    averaged(torch.randn(2, 3, 8, 8))
    averaged.append(nn.ReLU())  # as fn's own forward would: taken after its call
    reads.take()
    reads.settle()
    assert reads._watch.first_changed() == -1


def test_numbers_a_config_of_a_module_an_evaluators_fn_reads_holds_are_watched():
    """self.cfg.scale of a module fn reads from its scope is baked into the evaluator's graphs:
    changed after capture it is refused; the config replaced by an equal one is watched from
    then on; by one with another number, refused."""
    from nimble_train._evaluator import ScopeModules
    teacher = Configured(config(scale=2.0))
    reads = ScopeModules(lambda m, b: teacher(b[0]), _Stub(nn.Linear(2, 2)))
    assert ("number", "teacher.cfg.scale") in reads._what
    assert ("number", "teacher.cfg.width") not in reads._what  # no code reads it
    assert ("number", "teacher._cache_cfg.scale") not in reads._what  # private
    teacher.cfg.scale = 3.0
    with pytest.raises(NimbleError, match=r"'teacher.cfg.scale', a number of a module fn reads "
                                          r"from its scope, changed from 2.0 to 3.0"):
        reads.settle()
    teacher.cfg.scale = 2.0
    reads.settle()
    teacher.cfg = config(scale=2.0)  # loaded again: equal numbers, watched in the new one
    reads.settle()
    assert reads._watch.first_changed() == -1
    teacher.cfg.drop = 0.5
    with pytest.raises(NimbleError, match=r"'teacher.cfg.drop'.*changed from 0.0 to 0.5"):
        reads.settle()
    teacher.cfg = config(scale=5.0)
    with pytest.raises(NimbleError, match=r"'teacher.cfg', in a module fn reads from its scope, "
                                          r"was replaced by a SimpleNamespace whose 'scale' is "
                                          r"5.0 after the evaluator's capture, where its graphs "
                                          r"were captured with 'scale' 2.0"):
        reads.settle()
    teacher.cfg = config(scale=2.0)
    reads.settle()
    teacher(torch.randn(2, 4))  # its state counts its calls: fn's own change, taken
    reads.take()
    reads.settle()
    assert reads._watch.first_changed() == -1


def test_what_an_evaluators_own_forwards_assign_in_its_scope_modules_is_taken():
    from nimble_train._evaluator import ScopeModules
    model, averaged, fn = _averaging_evaluator()
    reads = ScopeModules(fn, _Stub(model))
    averaged[1].running_mean = torch.zeros(4)  # as a forward of fn's would assign it
    reads.take()
    assert reads._watch.first_changed() == -1
    reads.settle()
    averaged[1].running_mean = torch.ones(4)  # the user's, between calls: refused
    with pytest.raises(NimbleError, match=r"buffer 'averaged.1.running_mean'"):
        reads.settle()


def test_data_another_steps_update_moved_has_the_evaluators_graphs_captured_again():
    from nimble_train._evaluator import ScopeModules
    model, averaged, fn = _averaging_evaluator()
    reads = ScopeModules(fn, _Stub(model))
    fused = FusedOptimizer(torch.optim.SGD(averaged[4].parameters(), lr=0.1))
    assert reads.settle()  # read where the update writes them, by graphs captured again
    assert in_flat_buffers(averaged[4].weight)
    assert not reads.settle()
    del fused


def test_entry_watch_reads_a_closure_cell():
    def make():
        x = 1.5
        return lambda: x
    fn = make()
    cell = fn.__closure__[0]
    watch = _C.EntryWatch([(cell, None, cell.cell_contents)])
    assert watch.first_changed() == -1
    cell.cell_contents = 2.5
    assert watch.first_changed() == 0
    watch.update(0)
    assert watch.first_changed() == -1
    del cell.cell_contents
    assert watch.first_changed() == 0
    with pytest.raises(KeyError, match=r"entry 0's cell is empty"):
        watch.update(0)


def test_entry_watch_compares_by_identity_from_a_start():
    a, b = {"x": object()}, {"y": 1.5}
    watch = _C.EntryWatch([(a, "x", a["x"]), (b, "y", b["y"])])
    assert len(watch) == 2 and watch.first_changed() == -1 and watch.changed() == []
    a["x"] = object()
    b["y"] = 1.5 + 0.0 * len(a)  # equal, but another object
    assert watch.first_changed() == 0 and watch.first_changed(1) == 1
    assert watch.changed() == [0, 1] and watch.changed(2) == []
    del a["x"]
    assert watch.first_changed() == 0
    with pytest.raises(IndexError, match=r"start must be in \[0, 2\]; got 3"):
        watch.first_changed(3)
    with pytest.raises(TypeError, match=r"entry 0 must hold a dict, a cell, a list or a class "
                                        r"of Python code's first; got tuple"):
        _C.EntryWatch([((), "x", 1)])
    with pytest.raises(TypeError, match=r"entry 0 holds a list, so its key must be an index"):
        _C.EntryWatch([([], "x", 1)])
    with pytest.raises(TypeError, match=r"entry 0 must hold .*; got type"):
        _C.EntryWatch([(int, "real", 1)])  # a builtin class: its dict is not kept there
    with pytest.raises(TypeError, match=r"entry 1 must be a \(dict, key, value\) tuple; got int"):
        _C.EntryWatch([(a, "x", 1), 3])


def test_entry_watch_reads_a_class_attribute_and_sizes_dicts_set_anew():
    class Counter:
        next_id = 0
    watch = _C.EntryWatch([(Counter, "next_id", Counter.next_id)])
    assert watch.first_changed() == -1
    Counter.next_id += 1  # a class attribute set anew: another object in the class's dict
    assert watch.first_changed() == 0 and watch.changed() == [0]
    watch.update(0)
    assert watch.first_changed() == -1
    hooks, later = {1: None}, {}
    watch.set_sized([hooks])
    later[2] = None  # not sized: left alone
    assert watch.first_changed() == -1
    del hooks[1]
    assert watch.first_changed() == 1 and watch.first_changed(1) == 1
    watch.set_sized([hooks, later])  # in place of those set before, as they are now
    assert watch.first_changed() == -1
    later.clear()
    assert watch.first_changed() == 2
    with pytest.raises(TypeError, match=r"sized dict 0 must be a dict or a list; got tuple"):
        watch.set_sized([()])


def test_entry_watch_retargets_an_entry_to_another_dict():
    a, b, cell = {"x": 1.5}, {"x": 2.5, "y": 0}, (lambda: a).__closure__[0]
    watch = _C.EntryWatch([(a, "x", a["x"]), (cell, None, a)])
    watch.retarget(0, b)  # watches b["x"] from now on, as it is now
    assert watch.first_changed() == -1
    a["x"] = 3.5
    assert watch.first_changed() == -1
    b["x"] = 4.5
    assert watch.changed() == [0]
    with pytest.raises(KeyError, match=r"the dict entry 0 is to watch holds no 'x'"):
        watch.retarget(0, {"y": 1})
    assert watch.changed() == [0]  # unchanged by the failed retarget
    with pytest.raises(TypeError, match=r"entry 1 watches a closure cell, not a dict"):
        watch.retarget(1, b)
    with pytest.raises(IndexError, match=r"no entry 2 of 2"):
        watch.retarget(2, b)


def test_a_constant_changed_is_refused_and_an_equal_one_in_a_new_object_is_taken():
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.1), nn.LayerNorm(8, eps=1e-5))
    watch = captured_watch(model)
    model[1].p = 0.25  # a dropout schedule: the graphs would run 0.1
    assert watch.first_changed() >= 0 and watch.objects_changed()
    with pytest.raises(NimbleError, match=r"'1.p' \(Dropout\) changed from 0.1 to 0.25 after "
                                          r"capture; the step's graphs run the value they were "
                                          r"captured with.*build a new Step"):
        watch.refuse_replaced_objects()
    model[1].p = float("0.1")  # equal, another object
    assert watch.first_changed() >= 0
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1  # taken as the captured value: the fast path again
    model[2].eps = 1  # an int where the graphs read a float 1e-5
    with pytest.raises(NimbleError, match=r"'2.eps' \(LayerNorm\) changed from 1e-05 to 1"):
        watch.refuse_replaced_objects()
    del model[2].eps
    with pytest.raises(NimbleError, match=r"'2.eps' \(LayerNorm\) was deleted after capture"):
        watch.refuse_replaced_objects()


def test_a_loss_module_is_watched_under_its_own_name_and_not_for_its_mode():
    model = _model()
    loss_fn = nn.CrossEntropyLoss(weight=torch.rand(5), label_smoothing=0.1)
    watch = captured_watch(model, loss_fn)
    loss_fn.eval()  # a loss's mode changes nothing it computes
    assert watch.first_changed() == -1
    read = loss_fn.weight
    loss_fn.weight = torch.rand(5)  # class weights replaced: they go where the graphs read them
    buffers = watch.replaced_tensors()
    assert [name for _, name, _, _ in buffers] == ["weight"]
    watch.put_back(buffers)
    assert loss_fn.weight is read and watch.first_changed() == -1
    loss_fn.label_smoothing = 0.0
    with pytest.raises(NimbleError, match=r"'loss_fn.label_smoothing' \(CrossEntropyLoss\) "
                                          r"changed from 0.1 to 0.0"):
        watch.refuse_replaced_objects()
    assert ModelWatch(model, lambda out, y: out.sum()).names == watch.names[:-1]


class PerceptualLoss(nn.Module):
    """A loss module running a frozen network with dropout in it, and a flag of its own code's
    read in each mode."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), nn.Linear(8, 5))
        self.ce = nn.CrossEntropyLoss()

    def forward(self, out, target):
        return self.ce(self.net(out), target)


class NoisyLoss(nn.Module):
    """A loss module whose own forward reads its mode (noise in training only)."""

    def forward(self, out, target):
        if self.training:
            out = out + 0.1 * torch.randn_like(out)
        return F.cross_entropy(out, target)


class PlainLoss(nn.Module):
    def forward(self, out, target):
        return F.cross_entropy(out, target)


def test_reads_mode_finds_the_classes_whose_code_reads_their_training_flag():
    assert reads_mode(nn.Dropout) and reads_mode(nn.BatchNorm2d) and reads_mode(NoisyLoss)
    assert reads_mode(nn.MultiheadAttention) and reads_mode(nn.InstanceNorm1d)
    assert not any(reads_mode(cls) for cls in (nn.CrossEntropyLoss, nn.Sequential, nn.Linear,
                                               nn.ReLU, PlainLoss, PerceptualLoss))


def test_the_loss_modules_modules_whose_code_reads_their_mode_are_watched_for_it():
    """The graphs run a loss module's dropout, or its own noise, as captured: another mode is
    refused, naming the module; the mode of a module whose code reads none (the loss itself,
    its container) is not watched, so an evaluation loop leaving it in eval mode is fine."""
    model = _model()
    loss_fn = PerceptualLoss().eval()
    watch = captured_watch(model, loss_fn)
    loss_fn.ce.train()
    loss_fn.net[0].train()  # a linear layer computes the same in either mode
    assert watch.first_changed() == -1
    loss_fn.net.train()
    with pytest.raises(NimbleError, match=r"module 'loss_fn.net.1' \(Dropout\) is in training "
                                          r"mode.*captured with it in eval mode \(1 module\(s\) "
                                          r"changed\).*put the modes back"):
        watch.check_modes()
    loss_fn.eval()
    watch.check_modes()
    assert watch.first_changed() == -1
    noisy = NoisyLoss()
    watch = captured_watch(model, noisy)
    noisy.eval()
    with pytest.raises(NimbleError, match=r"module 'loss_fn' \(NoisyLoss\) is in eval mode.*"
                                          r"captured with it in training mode"):
        watch.check_modes()
    noisy.train()
    assert watch.first_changed() == -1
    plain = PlainLoss()
    watch = captured_watch(model, plain)
    plain.eval()
    assert watch.first_changed() == -1


def test_entry_watch_update_takes_the_value_now():
    a = {"x": 1.5}
    watch = _C.EntryWatch([(a, "x", a["x"])])
    a["x"] = float("1.5")
    assert watch.first_changed() == 0
    watch.update(0)
    assert watch.first_changed() == -1
    del a["x"]
    with pytest.raises(KeyError, match=r"entry 0's dict holds no 'x'"):
        watch.update(0)
    with pytest.raises(IndexError, match=r"no entry 1 of 1"):
        watch.update(1)


class DropPath(nn.Module):
    """timm's stochastic depth: a leaf whose rate is a plain attribute, not a constant."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob, self.scale_by_keep, self._calls = drop_prob, True, 0

    def forward(self, x):
        self._calls += 1
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], 1).bernoulli_(1 - self.drop_prob)
        return x * keep / (1 - self.drop_prob)


class Counting(nn.Linear):
    """A leaf that counts its calls in a public attribute: its own forwards change it."""

    def __init__(self):
        super().__init__(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_a_leaf_modules_number_changed_is_refused_and_a_parents_or_private_one_is_not():
    model = nn.Sequential(nn.Linear(4, 4), DropPath(0.1))
    model.epoch = 0  # the model's own, not a leaf's: user code keeps counters there
    watch = captured_watch(model)
    model[1].drop_prob = 0.2  # a stochastic-depth schedule: the graphs would run 0.1
    assert watch.first_changed() >= 0 and watch.objects_changed()
    with pytest.raises(NimbleError, match=r"'1.drop_prob' \(DropPath\) changed from 0.1 to 0.2 "
                                          r"after capture.*build a new Step.*can be named with a "
                                          r"leading underscore \(_drop_prob\)"):
        watch.refuse_replaced_objects()
    model[1].drop_prob = float("0.1")  # equal, another object: taken
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    model[1].scale_by_keep = False
    with pytest.raises(NimbleError, match=r"'1.scale_by_keep' \(DropPath\) changed from True "
                                          r"to False"):
        watch.refuse_replaced_objects()
    model[1].scale_by_keep = True
    model.epoch, model[1]._calls = 3, 7  # neither a leaf's number nor public
    model[1].note = "added later"  # not there when captured: nothing the graphs read
    assert watch.first_changed() == -1


class Scaled(nn.Module):
    """A leaf of the user's whose forward scales its input's channels by a pair of numbers."""

    def __init__(self):
        super().__init__()
        self.scales = (0.5, 2.0)

    def forward(self, x):
        return torch.cat([x[:, :2] * self.scales[0], x[:, 2:] * self.scales[1]], dim=1)


CROP = (1, 3)  # a global tuple Cropped's code reads


class Cropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)[:, CROP[0]:CROP[1]]


def test_a_tuple_of_numbers_a_forward_reads_is_watched_as_a_number():
    """A tuple cannot change in place, so one given anew is what changes: refused with its old
    and new values, as a number is; an equal tuple passes, one whose items changed type (an
    int where a float was) does not. A global tuple is watched as a global number is."""
    global CROP
    model = nn.Sequential(Scaled(), Cropped())
    watch = captured_watch(model)
    assert ("number", 1, "scales") in watch._what and ("global", 2, "CROP") in watch._what
    model[0].scales = (0.5, 3.0)
    with pytest.raises(NimbleError, match=r"'0.scales' \(Scaled\) changed from \(0.5, 2.0\) "
                                          r"to \(0.5, 3.0\) after capture.*build a new Step"):
        watch.refuse_replaced_objects()
    model[0].scales = (0.5, 2)  # equal, but an int where the graphs baked a float
    with pytest.raises(NimbleError, match=r"changed from \(0.5, 2.0\) to \(0.5, 2\)"):
        watch.refuse_replaced_objects()
    model[0].scales = tuple([0.5, float("2")])  # equal, another object: taken
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    CROP = (0, 2)
    try:
        with pytest.raises(NimbleError, match=r"the global 'CROP' that '1' \(Cropped\) reads "
                                              r"changed from \(1, 3\) to \(0, 2\)"):
            watch.refuse_replaced_objects()
    finally:
        CROP = (1, 3)
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    x = torch.randn(3, 4)
    assert torch.equal(model[0](x), x * torch.tensor([0.5, 0.5, 2.0, 2.0]))


class Staged(nn.Module):
    """A leaf of the user's whose forward scales its input's channels by a list of numbers;
    an empty list it keeps is not one (an accumulator, say)."""

    def __init__(self):
        super().__init__()
        self.scales, self.seen = [0.5, 2.0], []

    def forward(self, x):
        return torch.cat([x[:, :2] * self.scales[0], x[:, 2:] * self.scales[1]], dim=1)


TERMS = [1.0, 0.25]  # a global list of loss weights the loss function below reads


def _terms_loss(out, y):
    return TERMS[0] * F.cross_entropy(out, y) + TERMS[1] * out.square().mean()


def test_a_list_of_numbers_a_forward_reads_is_watched_by_its_items():
    """A list changes in place, which its identity does not show: its items are compared with
    a copy taken at capture. An item changed, added or of another type (an int where a float
    was) is refused with the list's old and new values, as a number is; an equal item passes.
    A global list a loss function reads is watched as a global number is."""
    model = nn.Sequential(Staged(), nn.Flatten())
    watch = captured_watch(model, _terms_loss)
    assert ("number", 1, "scales") in watch._what and ("global", -1, "TERMS") in watch._what
    assert not any(key == "seen" for _, _, key in watch._what)
    model[0].scales[1] = 3.0
    with pytest.raises(NimbleError, match=r"'0.scales' \(Staged\) changed from \[0.5, 2.0\] "
                                          r"to \[0.5, 3.0\] after capture.*build a new Step"):
        watch.refuse_replaced_objects()
    model[0].scales[1] = 2  # equal, but an int where the graphs baked a float
    with pytest.raises(NimbleError, match=r"changed from \[0.5, 2.0\] to \[0.5, 2\]"):
        watch.refuse_replaced_objects()
    model[0].scales.append(1.0)
    with pytest.raises(NimbleError, match=r"changed from \[0.5, 2.0\] to \[0.5, 2, 1.0\]"):
        watch.refuse_replaced_objects()
    model[0].scales[1:] = [float("2")]  # equal, another object: taken
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    model[0].scales = [0.5, 2.0]  # another list, equal: taken, and watched from now on
    watch.refuse_replaced_objects()
    model[0].scales[0] = 1.0
    with pytest.raises(NimbleError, match=r"changed from \[0.5, 2.0\] to \[1.0, 2.0\]"):
        watch.refuse_replaced_objects()
    model[0].scales[0] = 0.5
    model[0].seen.append(torch.zeros(1))  # not watched
    TERMS[1] = 0.5
    try:
        with pytest.raises(NimbleError, match=r"the global 'TERMS' that loss_fn reads changed "
                                              r"from \[1.0, 0.25\] to \[1.0, 0.5\]"):
            watch.refuse_replaced_objects()
    finally:
        TERMS[1] = 0.25
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    x = torch.randn(3, 4)
    assert torch.equal(model[0](x), x * torch.tensor([0.5, 0.5, 2.0, 2.0]))


class Appending(nn.Module):
    """A forward that changes a list of numbers in place as it runs (a log of its inputs'
    batch sizes)."""

    def __init__(self):
        super().__init__()
        self.sizes = [0]

    def forward(self, x):
        self.sizes.append(x.shape[0])
        return x


def test_a_list_a_failed_captures_forward_changed_in_place_goes_back_in_place():
    """A forward that appends to a watched list: a capture that fails leaves the list as after
    the last completed call, the same list object (others may hold it); one that succeeds has
    it taken and said (after_forward)."""
    model = nn.Sequential(Appending(), nn.ReLU())
    sizes = model[0].sizes
    watch = captured_watch(model)
    model(torch.randn(2, 4))  # a capture that fails after its forward
    assert sizes == [0, 2]
    watch.undo_capture()
    assert model[0].sizes is sizes and sizes == [0] and watch.first_changed() == -1
    model(torch.randn(3, 4))  # one that succeeds
    assert watch.after_forward() == [("'0.sizes' (Appending)", [0], [0, 3])]
    assert watch.first_changed() == -1 and watch.after_forward() == []


def test_a_scope_watch_watches_a_list_of_numbers_by_its_items():
    from nimble_train._model_watch import ScopeWatch
    thresholds = [0.25, 0.75]

    def fn(model, batch):
        out = model(batch[0])
        return (out > thresholds[0]).sum() + (out > thresholds[1]).sum()

    watch = ScopeWatch(fn, "the evaluator's fn", "make a new evaluator")
    watch.check()
    thresholds[0] = 0.5
    with pytest.raises(NimbleError, match=r"closure variable 'thresholds' changed from "
                                          r"\[0.25, 0.75\] to \[0.5, 0.75\] after capture"):
        watch.check()
    thresholds[0] = float("0.25")  # equal, another object: taken
    watch.check()
    held = thresholds
    thresholds.append(1.0)  # as fn would change it in a capture that then fails
    watch.put_back()
    assert thresholds is held and thresholds == [0.25, 0.75]
    watch.check()


class Focal(nn.Module):
    """A loss module of the user's (a leaf) whose optional class weights are None unless set."""

    def __init__(self):
        super().__init__()
        self.alpha, self.gamma = None, 2.0

    def forward(self, out, y):
        ce = F.cross_entropy(out, y, reduction="none")
        weight = 1.0 if self.alpha is None else self.alpha[y]
        return (weight * (1 - torch.exp(-ce)) ** self.gamma * ce).mean()


class Gated(nn.Module):
    """A parent whose forward applies a mask when one is set; a note user code keeps on it is
    not read, nor is a private cache."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mask, self.note, self._cache = None, None, None

    def forward(self, x):
        y = self.lin(x)
        return y if self.mask is None else y * self.mask


def test_an_attribute_the_forward_reads_that_held_none_at_capture_is_refused_when_set():
    """The graphs ran the forward's code for None (no mask, no class weights): a tensor, a
    number or anything else set there after capture would never be read, so it is refused,
    naming it; None again is what they read. An attribute the code does not name, or a
    private one, is left alone."""
    model, loss_fn = Gated(), Focal()
    watch = captured_watch(model, loss_fn)
    assert [(what, key) for what, _, key in watch._what if what == "unset"] == [
        ("unset", "mask"), ("unset", "alpha")]
    model.mask = torch.zeros(4)
    assert watch.first_changed() >= 0 and watch.objects_changed()
    with pytest.raises(NimbleError, match=r"'mask' \(Gated\) held None when the step's graphs "
                                          r"were captured and is now a CPU tensor of shape "
                                          r"\(4,\) \(float32\); the graphs run what the forward "
                                          r"did.*"
                                          r"the forward's code for the new value never runs.*"
                                          r"build a new Step.*leading underscore \(_mask\)"):
        watch.refuse_replaced_objects()
    model.mask = None
    watch.refuse_replaced_objects()
    loss_fn.alpha = 0.25
    with pytest.raises(NimbleError, match=r"'loss_fn.alpha' \(Focal\) held None when .* and "
                                          r"is now 0.25"):
        watch.refuse_replaced_objects()
    del loss_fn.alpha
    with pytest.raises(NimbleError, match=r"'loss_fn.alpha' \(Focal\) held None .* and was "
                                          r"deleted"):
        watch.refuse_replaced_objects()
    loss_fn.alpha = None
    model.note, model._cache = "new", torch.ones(2)  # not read, private
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    out, y = model(torch.randn(3, 4)), torch.tensor([0, 1, 2])
    assert torch.equal(loss_fn(out, y), Focal()(out, y))  # the reference: None's branch


def test_an_attribute_that_held_none_set_before_capture_or_by_a_forward_is_watched_as_it_is():
    """Set before the first capture: the capture reads it, so it is taken, and watched from
    then on as the tensor it is (new values in the same shape go where the graphs read them,
    another shape is refused). Set by the step's own forwards: taken, a number reported as
    one a capture changed; a failed capture puts None back."""
    model = Gated()
    watch = ModelWatch(model)
    mask = torch.ones(4)
    model.mask = mask
    watch.refuse_replaced_objects()  # before capture: taken
    watch.captured = True
    assert ("tensor", 0, "mask") in watch._what and watch.first_changed() == -1
    model.mask = torch.full((4,), 2.0)
    (table, key, read, now), = watch.replaced_tensors()
    assert read is mask and key == "mask" and torch.equal(now, torch.full((4,), 2.0))
    watch.put_back([(table, key, read, now)])
    assert model.mask is mask and torch.equal(mask, torch.full((4,), 2.0))
    model.mask = torch.ones(5)
    with pytest.raises(NimbleError, match=r"tensor attribute 'mask' was replaced"):
        watch.replaced_tensors()
    model.mask = mask

    focal = Focal()
    watch = captured_watch(nn.Linear(4, 3), focal)
    focal.alpha = 0.5  # as a forward of the step's sets it
    assert watch.after_forward() == [("'loss_fn.alpha' (Focal)", None, 0.5)]
    assert ("number", 1, "alpha") in watch._what and watch.first_changed() == -1
    focal.alpha = 0.75
    with pytest.raises(NimbleError, match=r"'loss_fn.alpha' \(Focal\) changed from 0.5 to "
                                          r"0.75"):
        watch.refuse_replaced_objects()

    model = Gated()
    watch = captured_watch(model)
    model.mask = torch.ones(4)  # a capture's forward that fails
    watch.undo_capture()
    assert model.mask is None and watch.first_changed() == -1


class Masked(nn.Module):
    """A module with children whose own code reads numbers: its forward one, a method it calls
    another, a comprehension in that method a third; a counter user code keeps on it is read
    by none."""

    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(4, 4), nn.ReLU()
        self.mask_ratio, self.temperature, self.heads = 0.5, 2.0, 2
        self.epoch = 0

    def forward(self, x):
        return self._scaled(self.act(self.lin(x))) * self.mask_ratio

    def _scaled(self, y):
        return torch.cat([part / self.temperature for part in y.chunk(self.heads, -1)], -1)


SHIFT = 0.5  # a global Shifted's code reads
mask_ratio = 0.9  # a global named as Masked's attribute, which its code does not read


class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self._shift(self.lin(x))

    def _shift(self, y):
        return y + SHIFT


def test_numbers_a_modules_own_code_reads_as_globals_are_watched():
    global SHIFT
    model = nn.Sequential(Shifted(), Masked(), nn.Linear(4, 2))
    watch = captured_watch(model)
    assert [w for w in watch._what if w[0] == "global"] == [("global", 1, "SHIFT")]
    SHIFT = 0.25
    try:
        with pytest.raises(NimbleError, match=r"the global 'SHIFT' that '0' \(Shifted\) reads "
                                              r"changed from 0.5 to 0.25 after capture"):
            watch.refuse_replaced_objects()
        # as if Shifted's code had changed it itself during a call: taken, and said
        assert watch.after_forward() == [("the global 'SHIFT' that '0' (Shifted) reads", 0.5,
                                          0.25)]
        assert watch.first_changed() == -1
    finally:
        SHIFT = 0.5
    # read by the loss function too: watched once, as the module's
    both = captured_watch(model, lambda out, y: out.sum() * SHIFT)
    assert [w for w in both._what if w[0] == "global"] == [("global", 1, "SHIFT")]


JITTER, SPREAD = 0.1, 2  # globals read only by the helpers below, not by a class's code


def _spread(y):
    return y * SPREAD


def _noisy(y):
    return _spread(y + JITTER)


def _jittered(y, module):
    return _spread(y + JITTER * module.noise_scale)


class Jittered(nn.Module):
    """A module with children whose forward calls a plain function of its module, which reads
    a global and an attribute of the module and calls another such function."""

    def __init__(self):
        super().__init__()
        self.lin, self.noise_scale, self.epoch = nn.Linear(4, 4), 0.5, 0

    def forward(self, x):
        return _jittered(self.lin(x), self)


def test_numbers_the_helpers_a_modules_code_calls_read_are_watched():
    """The plain functions a module's code calls by a global name are its own code too: the
    globals they read, through further helpers, are watched as the module's, and the attributes
    they name are numbers the module's code reads; torch's functions are not followed."""
    global JITTER, SPREAD
    from nimble_train._model_watch import _helpers, _own_code, names_read
    assert "noise_scale" in names_read(Jittered) and "epoch" not in names_read(Jittered)
    assert _own_code(Jittered)[1] == (Jittered.forward, _jittered, _spread)
    model = nn.Sequential(Jittered(), nn.Linear(4, 2))
    watch = captured_watch(model)
    assert [w for w in watch._what if w[0] == "global"] == [("global", 1, "JITTER"),
                                                            ("global", 1, "SPREAD")]
    for name, value in (("JITTER", 0.2), ("SPREAD", 3)):
        old = globals()[name]
        globals()[name] = value
        try:
            with pytest.raises(NimbleError, match=rf"the global '{name}' that '0' \(Jittered\) "
                                                  rf"reads changed from {old} to {value} after"):
                watch.refuse_replaced_objects()
        finally:
            globals()[name] = old
        assert watch.first_changed() == -1
    model[0].noise_scale = 0.25
    with pytest.raises(NimbleError, match=r"'0.noise_scale' \(Jittered\) changed from 0.5"):
        watch.refuse_replaced_objects()
    model[0].noise_scale = 0.5
    model[0].epoch = 3  # read by no code of the step's
    assert watch.first_changed() == -1
    dropout = F.dropout

    def through_torch(x):
        return dropout(x, 0.5) + F_relu(x)

    assert _helpers(through_torch) == []  # F_relu is torch's: not followed


F_relu = F.relu  # torch's function, named as a global of this module


def _clamp_at(limit):
    def clamped(y):
        return y.clamp(-limit, limit)
    return clamped


_clamped = _clamp_at(5.0)  # a helper with a number in its closure


def test_numbers_the_helpers_a_loss_function_calls_read_are_watched():
    """A loss function calling helpers of its module: their globals and closure variables are
    watched as the loss function's (once each, though two read one)."""
    global JITTER
    from nimble_train._model_watch import scope_numbers

    def loss_fn(out, y):
        return F.cross_entropy(_clamped(_noisy(out)), y) * SPREAD

    assert [(kind, name) for kind, _, name in scope_numbers(loss_fn)] == [
        ("global", "SPREAD"), ("closure", "limit"), ("global", "JITTER")]
    model = nn.Linear(4, 2)
    loss_fn(model(torch.randn(3, 4)), torch.tensor([0, 1, 1])).backward()
    watch = captured_watch(model, loss_fn)
    JITTER = 0.3
    try:
        with pytest.raises(NimbleError, match=r"the global 'JITTER' that loss_fn reads changed "
                                              r"from 0.1 to 0.3 after capture"):
            watch.refuse_replaced_objects()
    finally:
        JITTER = 0.1
    assert watch.first_changed() == -1


def _make_block(drop, scale):
    """A class made in a function: its forward reads `drop` from its closure, and calls a
    factory-made helper of this module (_clamped) that reads `limit` from its own."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return _clamped(F.dropout(self.lin(x), drop, self.training)) * scale

    return Block


def test_numbers_a_modules_code_reads_from_its_closures_are_watched():
    """A module class made in a function reads numbers from its closure, and a helper a factory
    made reads them from its own: watched as the module's, a change after capture refused
    naming the variable and the module, an equal value taken."""
    model = nn.Sequential(_make_block(0.1, 2.0)(), nn.Linear(4, 2))
    watch = captured_watch(model)
    assert [w for w in watch._what if w[0] == "closure"] == [
        ("closure", 1, "drop"), ("closure", 1, "scale"), ("closure", 1, "limit")]
    forward = type(model[0]).forward
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__))
    limit = _clamped.__closure__[0]
    for cell, name, old, value in ((cells["drop"], "drop", 0.1, 0.3),
                                   (cells["scale"], "scale", 2.0, 1.5),
                                   (limit, "limit", 5.0, 1.0)):
        cell.cell_contents = value
        try:
            with pytest.raises(NimbleError, match=rf"'0' \(Block\)'s closure variable '{name}' "
                                                  rf"changed from {old} to {value} after capture"):
                watch.refuse_replaced_objects()
        finally:
            cell.cell_contents = old
        assert watch.first_changed() == -1
    cells["drop"].cell_contents = float("0.1")  # equal: taken
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1


class Configured(nn.Module):
    """A user's module reading numbers from a config object it holds; its state object counts
    its calls."""

    def __init__(self, cfg):
        super().__init__()
        self.lin, self.cfg = nn.Linear(4, 4), cfg
        self.state = types.SimpleNamespace(calls=0)
        self._cache_cfg = types.SimpleNamespace(scale=1.0)  # private: not watched

    def forward(self, x):
        self.state.calls += 1
        return F.dropout(self.lin(x), self.cfg.drop) * self.cfg.scale


def config(drop=0.0, scale=2.0):
    return types.SimpleNamespace(drop=drop, scale=scale, width=4)  # width: read by no code


def test_numbers_a_user_modules_config_object_holds_are_watched():
    """A number read through an object the user's module holds (self.cfg.scale) is baked into
    the graphs as its own numbers are: changed after capture it is refused, naming it; the
    object replaced by one with equal numbers is watched from then on, with other numbers
    refused; before the first capture anything is taken; the forward's own counter is taken
    and said."""
    model = nn.Sequential(Configured(config()), nn.Linear(4, 2))
    watch = ModelWatch(model)
    held = [w for w in watch._what if w[0] in ("holder", "held")]
    assert held == [("holder", 1, "cfg"), ("held", 1, "cfg.drop"), ("held", 1, "cfg.scale"),
                    ("holder", 1, "state"), ("held", 1, "state.calls")]
    model[0].cfg = config(scale=3.0)  # before the first capture: taken
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    model[0].cfg.scale = 4.0
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    watch.captured = True
    model(torch.randn(2, 4))
    assert watch.after_forward() == [("'0.state.calls' (Configured)", 0, 1)]
    model[0].cfg.drop = 0.5
    with pytest.raises(NimbleError, match=r"'0.cfg.drop' \(Configured\) changed from 0.0 to "
                                          r"0.5 after capture.*Nothing was run"):
        watch.refuse_replaced_objects()
    model[0].cfg.drop = 0.0
    model[0].cfg.width, model[0]._cache_cfg.scale = 8, 5.0  # read by no code; private
    assert watch.first_changed() == -1
    old = model[0].cfg
    model[0].cfg = config(scale=4.0)  # loaded again, equal: watched from now on
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    old.scale = 9.0  # the object the module no longer holds
    assert watch.first_changed() == -1
    model[0].cfg.scale = 5.0
    with pytest.raises(NimbleError, match=r"'0.cfg.scale' \(Configured\) changed from 4.0 to "
                                          r"5.0 after capture"):
        watch.refuse_replaced_objects()
    model[0].cfg.scale = 4.0
    model[0].cfg = config(scale=6.0)
    with pytest.raises(NimbleError, match=r"'0.cfg' \(Configured\) was replaced by a "
                                          r"SimpleNamespace whose 'scale' is 6.0 after capture, "
                                          r"where the step's graphs were captured with 'scale' "
                                          r"4.0.*Nothing was run"):
        watch.refuse_replaced_objects()
    model[0].cfg = types.SimpleNamespace(scale=4.0)
    with pytest.raises(NimbleError, match=r"replaced by a SimpleNamespace that holds no number "
                                          r"'drop' after capture"):
        watch.refuse_replaced_objects()
    del model[0].cfg
    with pytest.raises(NimbleError, match=r"'0.cfg' \(Configured\) was removed after capture"):
        watch.refuse_replaced_objects()


class Noise:
    """A user's callable object a module calls: its methods read its own numbers, and count
    its calls."""

    def __init__(self, sigma):
        self.sigma, self.gain, self.calls, self.log_every = sigma, 2.0, 0, 10

    def __call__(self, x):
        self.calls += 1
        return self._add(x)

    def _add(self, x):
        return x + self.sigma * torch.ones_like(x)

    def scaled(self, x):
        return x * self.gain

    def report(self):  # called by no code of the step's
        return self.log_every


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.noise, self.act = nn.Linear(4, 4), Noise(0.1), functools.partial(F.relu)

    def forward(self, x):
        return self.act(self.noise.scaled(self.noise(self.lin(x))))


def test_numbers_the_methods_of_a_users_object_a_module_calls_read_are_watched():
    """An object of a class of the user's that a module's forward calls (self.noise(x), and
    a method of it): the numbers its methods reached from there read are watched as the
    module's, a change after capture refused, naming it; its own counter is taken; a number
    only another method reads, and a library's callable (a partial), are not watched."""
    import copy
    model = nn.Sequential(Noisy(), nn.Linear(4, 2))
    watch = captured_watch(model)
    assert [w for w in watch._what if w[0] in ("holder", "held")] == [
        ("holder", 1, "noise"), ("held", 1, "noise.sigma"), ("held", 1, "noise.gain"),
        ("held", 1, "noise.calls")]
    model(torch.randn(2, 4))
    assert watch.after_forward() == [("'0.noise.calls' (Noisy)", 0, 1)]
    for name, value in (("sigma", 0.3), ("gain", 1.0)):
        old = getattr(model[0].noise, name)
        setattr(model[0].noise, name, value)
        with pytest.raises(NimbleError, match=rf"'0.noise.{name}' \(Noisy\) changed from "
                                              rf"{old} to {value} after capture"):
            watch.refuse_replaced_objects()
        setattr(model[0].noise, name, old)
    model[0].noise.log_every = 100
    assert watch.first_changed() == -1
    model[0].noise = copy.copy(model[0].noise)  # equal numbers: watched from now on
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    model[0].noise = Noise(0.3)
    with pytest.raises(NimbleError, match=r"'0.noise' \(Noisy\) was replaced by a Noise "
                                          r"whose 'sigma' is 0.3 after capture, where the "
                                          r"step's graphs were captured with 'sigma' 0.1"):
        watch.refuse_replaced_objects()


def test_an_installed_packages_modules_configs_are_not_watched():
    """A config an installed package's module reads (a transformers model's self.config) was
    copied into its modules when they were built; only a user's module's is watched."""
    from nimble_train._model_watch import _held_numbers
    Installed = type("Installed", (Configured,), {"__module__": "torch.nn.modules.linear"})
    assert _held_numbers(Configured(config()), "cfg", config()) == ["drop", "scale"]
    assert _held_numbers(Installed(config()), "cfg", config()) == []
    assert [w for w in ModelWatch(Installed(config()))._what if w[0] == "holder"] == []


def test_a_parents_numbers_its_own_code_names_are_watched_and_others_are_not():
    from nimble_train._model_watch import names_read
    assert {"mask_ratio", "temperature", "heads", "_scaled"} <= names_read(Masked)
    assert "epoch" not in names_read(Masked)
    assert names_read(nn.Sequential) == frozenset()  # torch's code: not followed
    model = nn.Sequential(Masked(), nn.Linear(4, 2))
    watch = captured_watch(model)
    model[0].epoch = 3  # user code's counter: nothing the forward reads
    assert watch.first_changed() == -1
    for key, value in (("mask_ratio", 0.75), ("temperature", 1.0), ("heads", 4)):
        old = getattr(model[0], key)
        setattr(model[0], key, value)
        with pytest.raises(NimbleError, match=rf"'0.{key}' \(Masked\) changed from {old} to "
                                              rf"{value} after capture.*leading underscore"):
            watch.refuse_replaced_objects()
        setattr(model[0], key, old)
    assert watch.first_changed() == -1


def test_what_the_steps_own_forwards_change_is_taken_and_a_change_of_the_users_is_not():
    model = nn.Sequential(Counting(), nn.ReLU())
    watch = captured_watch(model)
    model(torch.randn(2, 4))  # a capture's or an eager step's forward
    assert model[0].calls == 1 and watch.first_changed() >= 0
    watch.after_forward()
    assert watch.first_changed() == -1
    model[0].calls = 5  # the user's, between calls: refused before the next call runs
    with pytest.raises(NimbleError, match=r"'0.calls' \(Counting\) changed from 1 to 5"):
        watch.refuse_replaced_objects()
    model[0].weight = nn.Parameter(torch.randn(4, 4))  # after_forward takes numbers only
    watch.after_forward()
    with pytest.raises(NimbleError, match=r"parameter '0.weight' was replaced"):
        watch.refuse_replaced_objects()


ARGS = types.SimpleNamespace(smoothing=0.1, lr=0.5, _seen=0)  # a script's parsed arguments


def _smoothed(out, y):  # a helper reading the arguments
    return F.cross_entropy(out, y, label_smoothing=ARGS.smoothing)


LOGGER = logging.getLogger("nimble_train.tests")  # an installed package's object: not a config
STEPS = dataclasses.make_dataclass("Steps", [("warmup", int)])(warmup=10)


def _logging_loss(out, y):
    if LOGGER.level > STEPS.warmup:  # a logger's number and a dataclass's
        return F.cross_entropy(out, y)
    return F.mse_loss(out, torch.zeros_like(out))


def test_a_logger_a_loss_function_reads_is_no_config_and_a_dataclass_is():
    from nimble_train._model_watch import scope_holders
    assert [(name, [label for *_, label in numbers])
            for _, _, name, numbers in scope_holders(_logging_loss)] == [
        ("STEPS", ["STEPS.warmup"])]


def _config_reading_loss():
    weights = {"aux": 0.5, "unused": 1.0, 3: 2.0}

    def loss_fn(out, y):
        return _smoothed(out, y) + weights["aux"] * out.square().mean()

    def set_weights(new):
        nonlocal weights
        weights = new
    return loss_fn, weights, set_weights


def test_numbers_a_loss_function_reads_through_a_config_are_watched_by_value():
    """A loss function reading its numbers through a config (a script's arguments read by a
    helper, args.smoothing; a dict of loss weights, weights["aux"]): the graphs bake them, so
    another value is refused after capture, naming it; the config replaced by one with equal
    numbers is watched from then on, by one with another number refused; numbers its code
    does not read (args.lr, weights["unused"]) are not watched; before capture all is taken."""
    global ARGS
    loss_fn, weights, set_weights = _config_reading_loss()
    watch = captured_watch(nn.Linear(3, 5), loss_fn)
    held = [key for what, _, key in watch._what if what == "scope held"]
    assert sorted(held) == ["ARGS.smoothing", "weights['aux']"], held
    ARGS.lr = 0.1  # not read by loss_fn's code
    weights["unused"] = 3.0
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    kept = ARGS
    try:
        ARGS.smoothing = 0.2
        with pytest.raises(NimbleError, match=r"the number ARGS.smoothing that loss_fn reads "
                                              r"changed from 0.1 to 0.2 after capture.*keep it in "
                                              r"a tensor.*Nothing was run"):
            watch.refuse_replaced_objects()
        ARGS.smoothing = 0.1
        weights["aux"] = 0.7
        with pytest.raises(NimbleError, match=r"the number weights\['aux'\] that loss_fn reads "
                                              r"changed from 0.5 to 0.7"):
            watch.refuse_replaced_objects()
        weights["aux"] = 0.5
        ARGS = types.SimpleNamespace(smoothing=0.1, lr=0.3)  # parsed again: equal, taken
        watch.refuse_replaced_objects()
        assert watch.first_changed() == -1
        ARGS.smoothing = 0.3  # the new one is watched
        with pytest.raises(NimbleError, match=r"ARGS.smoothing that loss_fn reads changed"):
            watch.refuse_replaced_objects()
        ARGS.smoothing = 0.1
        set_weights({"aux": 0.9})
        with pytest.raises(NimbleError, match=r"loss_fn's closure variable 'weights' was replaced "
                                              r"by a dict whose 'aux' is 0.9 after capture, where "
                                              r"the graphs were captured with 'aux' 0.5.*Nothing "
                                              r"was run"):
            watch.refuse_replaced_objects()
        set_weights(weights)
        watch.refuse_replaced_objects()
        assert watch.first_changed() == -1
        fresh = ModelWatch(nn.Linear(3, 5), loss_fn)  # before the first capture: taken
        ARGS.smoothing = 0.25
        set_weights({"aux": 0.9})
        fresh.refuse_replaced_objects()
        assert fresh.first_changed() == -1
    finally:
        ARGS = kept
        ARGS.smoothing = 0.1


BLOCK_CFG = {"p": 0.1, "name": "block", "unread": 3}  # a global config a forward reads


class ConfigDropout(nn.Module):
    def forward(self, x):
        return F.dropout(x, BLOCK_CFG["p"], self.training) * ARGS.smoothing


def test_numbers_a_modules_forward_reads_through_a_global_config_are_watched_by_value():
    """``F.dropout(x, BLOCK_CFG["p"])`` in a user's forward: baked into the graphs as a global
    number is, so another value is refused, naming the first module of the class that reads
    it; a config of an installed package's class is not looked into."""
    global BLOCK_CFG
    model = nn.Sequential(ConfigDropout(), nn.Linear(4, 4), ConfigDropout())
    watch = captured_watch(model)
    held = [(i, key) for what, i, key in watch._what if what == "scope held"]
    assert held == [(1, "BLOCK_CFG['p']"), (1, "ARGS.smoothing")], held
    kept = BLOCK_CFG
    try:
        BLOCK_CFG["p"] = 0.5
        with pytest.raises(NimbleError, match=r"the number BLOCK_CFG\['p'\] that '0' "
                                              r"\(ConfigDropout\) reads changed from 0.1 to 0.5 "
                                              r"after capture"):
            watch.refuse_replaced_objects()
        BLOCK_CFG["p"] = 0.1
        BLOCK_CFG = {"p": 0.2}
        with pytest.raises(NimbleError, match=r"the global 'BLOCK_CFG' that '0' \(ConfigDropout\) "
                                              r"reads was replaced by a dict whose 'p' is 0.2"):
            watch.refuse_replaced_objects()
    finally:
        BLOCK_CFG = kept
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    assert ModelWatch(nn.Sequential(nn.Dropout(0.1)))._held == {}  # torch's: not looked into


def test_the_globals_the_code_of_modules_an_evaluators_fn_reads_reads_are_watched():
    """A teacher of a class of the user's whose forward reads a global config: baked into the
    evaluator's graphs, so another value is refused, naming the class; a class of the Step's
    model is the Step's to watch."""
    from nimble_train._evaluator import ScopeModules
    teacher = nn.Sequential(ConfigDropout(), nn.Linear(4, 4))
    reads = ScopeModules(lambda m, b: teacher(b[0]), _Stub(nn.Linear(2, 2)))
    BLOCK_CFG["p"] = 0.5
    try:
        with pytest.raises(NimbleError, match=r"the number BLOCK_CFG\['p'\] that the code of "
                                              r"ConfigDropout \(modules the evaluator's fn "
                                              r"reads\) reads changed from 0.1 to 0.5.*make a new "
                                              r"evaluator"):
            reads.settle()
    finally:
        BLOCK_CFG["p"] = 0.1
    reads.settle()
    assert ScopeModules(lambda m, b: teacher(b[0]), _Stub(nn.Sequential(ConfigDropout())))._code \
        is None


def test_numbers_an_evaluators_fn_reads_through_a_config_are_watched_by_value():
    loss_fn, weights, set_weights = _config_reading_loss()
    watch = ScopeWatch(loss_fn, "the evaluator's fn", "make a new evaluator")
    weights["aux"] = 0.6
    with pytest.raises(NimbleError, match=r"the number weights\['aux'\] that the evaluator's fn "
                                          r"reads changed from 0.5 to 0.6"):
        watch.check()
    weights["aux"] = 0.5
    set_weights(dict(weights))  # equal: taken, the new one watched
    watch.check()
    assert watch._watch.first_changed() == -1
    set_weights({"aux": 0.5, "unused": 1.0})
    watch.check()
    set_weights({})
    with pytest.raises(NimbleError, match=r"'weights' was replaced by a dict that holds no "
                                          r"number 'aux'"):
        watch.check()
    current = {"aux": 0.5}
    set_weights(current)
    watch.check()
    assert watch.after_call() == []
    current["aux"] = 0.8  # as fn would change it itself: taken, named
    assert watch.after_call() == [("the number weights['aux'] that the evaluator's fn reads",
                                   0.5, 0.8)]


CRITIC = nn.Linear(4, 1)  # a global a loss function reads


def _critic_score(x):  # a helper of the user's, called as a global
    return CRITIC(x).mean()


class _Perceptual:
    def __init__(self):
        self.features = nn.Conv2d(3, 4, 3)
        self.meter = nn.Identity()  # held, not read by loss()

    def loss(self, out, target):
        return F.mse_loss(self.features(out), self.features(target))


class _Terms:
    """A loss object summing the terms it holds in a list; its meters are not read."""

    def __init__(self):
        self.terms = [nn.L1Loss(), nn.SmoothL1Loss(beta=0.5)]
        self.meters = [nn.Identity()]

    def loss(self, out, target):
        return sum(term(out, target) for term in self.terms)


def test_scope_modules_finds_the_modules_a_loss_function_reads():
    """A GAN generator's loss reads the discriminator, a perceptual loss its network: from a
    closure, a global (through a helper too), a partial's argument, a bound method's object
    or that object's attribute."""
    d = nn.Linear(4, 1)
    features = nn.Conv2d(3, 4, 3)
    assert scope_modules(lambda out, y: F.binary_cross_entropy_with_logits(d(out), y)) == [d]
    assert scope_modules(lambda out, y: _critic_score(out)) == [CRITIC]
    assert scope_modules(functools.partial(lambda net, out, y: net(out).sum(), features)) == [
        features]
    assert scope_modules(nn.MSELoss().forward)[0].__class__ is nn.MSELoss
    perceptual = _Perceptual()
    assert scope_modules(perceptual.loss) == [perceptual.features]
    terms = _Terms()
    assert named_scope_modules(terms.loss) == [("terms[0]", terms.terms[0]),
                                              ("terms[1]", terms.terms[1])]
    assert scope_modules(functools.partial(lambda nets, out, y: nets[0](out), [features])) == [
        features]
    assert scope_modules(F.cross_entropy) == []

    def late(out, y):
        return net(out).sum()  # noqa: F821 -- assigned after this function is made
    assert scope_modules(late) == []
    net = nn.Linear(2, 2)
    assert scope_modules(late) == [net]


def _gan_parts():
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.1), nn.BatchNorm1d(8), nn.Linear(8, 1))
    generator = nn.Sequential(nn.Linear(3, 5))

    def loss_fn(out, y):
        return F.binary_cross_entropy_with_logits(critic(out), y)

    def set_critic(module):
        nonlocal critic
        critic = module
    return generator, critic, loss_fn, set_critic


def test_the_modules_a_loss_function_reads_are_watched_as_the_models_are():
    """A GAN generator's loss runs the critic: the graphs run it in the mode, with the
    constants, children and parameters it had at capture, so a change of those is refused,
    naming it as the loss function names it; the name itself is watched by identity."""
    generator, critic, loss_fn, set_critic = _gan_parts()
    watch = captured_watch(generator, loss_fn)
    assert watch.names[len(list(generator.modules())):] == ["critic", "critic.0", "critic.1",
                                                              "critic.2", "critic.3"]
    with torch.no_grad():
        critic[0].weight.mul_(2)  # in place: what the graphs read
    critic.train()
    assert watch.first_changed() == -1
    critic[2].eval()
    with pytest.raises(NimbleError, match=r"module 'critic.2' \(BatchNorm1d\) is in eval mode"):
        watch.check_modes()
    critic.train()
    critic[1].p = 0.5
    with pytest.raises(NimbleError, match=r"'critic.1.p' \(Dropout\) changed from 0.1 to 0.5"):
        watch.refuse_replaced_objects()
    critic[1].p = 0.1
    old = critic[3]
    critic[3] = nn.Linear(8, 1)
    with pytest.raises(NimbleError, match=r"module 'critic.3' \(Linear\) was replaced by another "
                                          r"Linear after capture"):
        watch.refuse_replaced_objects()
    critic[3] = old
    weight = critic[0].weight
    critic[0].weight = nn.Parameter(weight.detach().clone())
    with pytest.raises(NimbleError, match=r"parameter 'critic.0.weight' was replaced"):
        watch.refuse_replaced_objects()
    critic[0].weight = weight
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    set_critic(nn.Sequential(nn.Linear(5, 1)))
    with pytest.raises(NimbleError, match=r"loss_fn's closure variable 'critic' was given another "
                                          r"Sequential after capture, where it held a Sequential; "
                                          r"the graphs run the module they were captured with.*"
                                          r"critic.load_state_dict\(state\).*Nothing was run"):
        watch.refuse_replaced_objects()
    set_critic(critic)
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    fresh = ModelWatch(generator, loss_fn)  # before the first capture: taken
    set_critic(nn.Sequential(nn.Linear(5, 1)))
    fresh.refuse_replaced_objects()
    assert fresh.first_changed() == -1


def _losses_in_a_list():
    torch.manual_seed(0)
    losses = [nn.CrossEntropyLoss(label_smoothing=0.1), nn.Sequential(nn.Linear(5, 5),
                                                                    nn.Dropout(0.2))]
    nets = {"critic": nn.Linear(5, 1)}

    def loss_fn(out, y):
        return (losses[0](out, y) + losses[1](out).square().mean()
                + nets["critic"](out).mean())

    def set_losses(new):
        nonlocal losses
        losses = new
    return nn.Linear(3, 5), losses, nets, loss_fn, set_losses


def test_modules_a_loss_function_reads_through_a_list_or_dict_are_watched_as_the_models_are():
    """A loss function summing the losses of a list (a perceptual term among them) or running
    a dict's networks: each module there is watched as the model's (its mode, its constants,
    its children), named as the function reaches it (losses[1]); another module in the list
    or dict, another number of them, or another list under the name, is refused after
    capture, taken before."""
    model, losses, nets, loss_fn, set_losses = _losses_in_a_list()
    assert [name for name, _ in named_scope_modules(loss_fn)] == [
        "losses[0]", "losses[1]", "nets['critic']"]
    watch = captured_watch(model, loss_fn)
    assert "losses[1].1" in watch.names and "nets['critic']" in watch.names
    losses[0].label_smoothing = 0.2
    with pytest.raises(NimbleError, match=r"'losses\[0\].label_smoothing' \(CrossEntropyLoss\) "
                                          r"changed from 0.1 to 0.2"):
        watch.refuse_replaced_objects()
    losses[0].label_smoothing = 0.1
    losses[1][1].eval()
    with pytest.raises(NimbleError, match=r"module 'losses\[1\].1' \(Dropout\) is in eval mode"):
        watch.check_modes()
    losses[1][1].train()
    kept = losses[1]
    losses[1] = nn.Sequential(nn.Linear(5, 5))
    with pytest.raises(NimbleError, match=r"the module at losses\[1\] that loss_fn reads was "
                                          r"given another Sequential after capture.*"
                                          r"losses\[1\].load_state_dict\(state\).*Nothing was "
                                          r"run"):
        watch.refuse_replaced_objects()
    losses[1] = kept
    critic = nets["critic"]
    nets["critic"] = nn.Linear(5, 1)
    with pytest.raises(NimbleError, match=r"the module at nets\['critic'\] that loss_fn reads"):
        watch.refuse_replaced_objects()
    nets["critic"] = critic
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    losses.append(nn.L1Loss())
    with pytest.raises(NimbleError, match=r"the list 'losses' that loss_fn reads holds 3 item\(s\) "
                                          r"after capture, where it held 2; the graphs run the "
                                          r"modules it held then.*Nothing was run"):
        watch.refuse_replaced_objects()
    losses.pop()
    nets["extra"] = nn.Linear(5, 1)
    with pytest.raises(NimbleError, match=r"the dict 'nets' that loss_fn reads holds 2 item"):
        watch.refuse_replaced_objects()
    del nets["extra"]
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    set_losses(list(losses))
    with pytest.raises(NimbleError, match=r"loss_fn's closure variable 'losses' was given another "
                                          r"list after capture, where it held a list of modules; "
                                          r"the graphs run the modules it held then.*"
                                          r"losses\[0\].load_state_dict\(state\)"):
        watch.refuse_replaced_objects()
    set_losses(losses)
    fresh = ModelWatch(model, loss_fn)  # before the first capture: taken
    losses.append(nn.L1Loss())
    losses[1] = nn.Sequential(nn.Linear(5, 5))
    fresh.refuse_replaced_objects()
    assert fresh.first_changed() == -1


def test_an_evaluators_fn_reading_modules_through_a_list_or_dict_is_run_as_captured():
    """ScopeWatch: another module in the list or dict fn reads, another number of them, or
    another dict under the name, is refused; fn's own additions are taken. ScopeModules:
    their modes and numbers are the graphs'."""
    from nimble_train._evaluator import ScopeModules
    torch.manual_seed(0)
    averages = {"ema": _model(), "swa": _model()}
    heads = [nn.Linear(5, 2)]

    def fn(m, batch):
        return heads[0](averages["ema"](batch[0]) + averages["swa"](batch[0]))
    watch = ScopeWatch(fn, "the evaluator's fn", "make a new evaluator")
    reads = ScopeModules(fn, _Stub(nn.Linear(2, 2)))
    assert ("mode", "heads[0]") in reads._what and ("mode", "averages['swa'].1") in reads._what
    averages["swa"][1].eval()
    with pytest.raises(NimbleError, match=r"module \"averages\['swa'\].1\", which fn reads from "
                                          r"its scope, is in eval mode"):
        reads.settle()
    averages["swa"][1].train()
    reads.settle()
    swa = averages["swa"]
    averages["swa"] = _model()
    with pytest.raises(NimbleError, match=r"the module at averages\['swa'\] that the evaluator's "
                                          r"fn reads was given another Sequential"):
        watch.check()
    averages["swa"] = swa
    heads.append(nn.Linear(5, 2))
    with pytest.raises(NimbleError, match=r"the list 'heads' that the evaluator's fn reads holds "
                                          r"2 item\(s\) after capture, where it held 1"):
        watch.check()
    watch.after_call()  # as fn would have appended it itself: taken
    watch.check()
    assert watch._watch.first_changed() == -1
    odd = {"a[0]": nn.Linear(2, 2)}  # a key that reads like an index: the dict named as read
    watch = ScopeWatch(lambda m, b: odd["a[0]"](b[0]), "the evaluator's fn", "make a new one")
    odd["b"] = nn.Linear(2, 2)
    with pytest.raises(NimbleError, match=r"the dict 'odd' that the evaluator's fn reads holds 2 "):
        watch.check()


def test_a_hook_another_step_puts_on_the_loss_functions_modules_parameters_is_left_alone():
    """The step that trains a GAN's critic may hook its parameters' gradients (its buckets);
    the generator's graphs do not run those hooks, so its step does not refuse them. A hook on
    one of the critic's modules runs in its forward, which the generator's graphs do run."""
    generator, critic, loss_fn, _ = _gan_parts()
    watch = captured_watch(generator, loss_fn)
    handle = critic[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    handle.remove()
    critic[0].register_forward_hook(_record)
    with pytest.raises(NimbleError, match=r"forward hook.*'critic.0' \(Linear\)"):
        watch.refuse_replaced_objects()


def test_modules_a_loss_function_reads_as_globals_or_a_plain_objects_attributes_are_watched():
    global CRITIC
    watch = captured_watch(nn.Linear(3, 4), lambda out, y: _critic_score(out))
    assert ("global module", -1, "CRITIC") in watch._what and "CRITIC" in watch.names
    critic = CRITIC
    try:
        CRITIC = nn.Linear(4, 1)
        with pytest.raises(NimbleError, match=r"the global 'CRITIC' that loss_fn reads was given "
                                              r"another Linear after capture"):
            watch.refuse_replaced_objects()
        CRITIC = None
        with pytest.raises(NimbleError, match=r"'CRITIC' that loss_fn reads was given a NoneType"):
            watch.refuse_replaced_objects()
    finally:
        CRITIC = critic
    watch.refuse_replaced_objects()
    perceptual = _Perceptual()
    watch = captured_watch(nn.Conv2d(3, 3, 1), perceptual.loss)
    assert "features" in watch.names and "meter" not in watch.names
    perceptual.meter = nn.Identity()  # what loss() does not read: left alone
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    perceptual.features = nn.Conv2d(3, 4, 3)
    with pytest.raises(NimbleError, match=r"the attribute 'features' of the object loss_fn is a "
                                          r"method of was given another Conv2d"):
        watch.refuse_replaced_objects()
    del perceptual.features
    with pytest.raises(NimbleError, match=r"'features' of the object loss_fn is a method of was "
                                          r"deleted"):
        watch.refuse_replaced_objects()


NETS = types.SimpleNamespace(critic=nn.Linear(4, 1), logger=nn.Identity(), scale=0.5)


class _Trainer:
    """A plain object whose loss method reads its critic through a config it holds."""

    def __init__(self):
        self.nets = types.SimpleNamespace(critic=nn.Sequential(nn.Linear(4, 2), nn.Dropout(0.1)),
                                          unused=nn.Identity())

    def loss(self, out, target):
        return self.nets.critic(out).mean()


def test_modules_a_loss_function_reads_as_a_configs_attributes_are_watched_as_the_models():
    """A loss function reading its critic as a config's attribute (a namespace of the user's
    networks, as a global, or held by the object it is a method of): the critic is one of the
    modules the graphs run -- its parameters read where they are, its modes and children
    watched, named as the function names it -- and the config's attribute and the config
    under its name by identity; the config's other modules, which the code does not name,
    are left alone."""
    global NETS
    watch = captured_watch(nn.Linear(3, 4), lambda out, y: NETS.critic(out).mean() * NETS.scale)
    assert "NETS.critic" in watch.names and "NETS.logger" not in watch.names
    assert named_scope_modules(lambda out, y: NETS.critic(out))[0] == ("NETS.critic",
                                                                         NETS.critic)
    NETS.logger = nn.Linear(2, 2)  # not read: left alone
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    critic = NETS.critic
    NETS.critic = nn.Linear(4, 1)
    with pytest.raises(NimbleError, match=r"the module at NETS.critic that loss_fn reads was "
                                          r"given another Linear after capture"):
        watch.refuse_replaced_objects()
    NETS.critic = critic
    watch.refuse_replaced_objects()
    nets = NETS
    try:
        NETS = types.SimpleNamespace(critic=critic, scale=0.5)
        with pytest.raises(NimbleError, match=r"the global 'NETS' that loss_fn reads was given "
                                              r"another SimpleNamespace after capture, where it "
                                              r"held a SimpleNamespace holding modules.*"
                                              r"NETS.critic.load_state_dict"):
            watch.refuse_replaced_objects()
    finally:
        NETS = nets
    watch.refuse_replaced_objects()
    trainer = _Trainer()
    watch = captured_watch(nn.Linear(3, 4), trainer.loss)
    assert "nets.critic.1" in watch.names and "nets.unused" not in watch.names
    trainer.nets.critic.train(False)
    with pytest.raises(NimbleError, match=r"module 'nets.critic' \(Sequential\) is in eval"):
        watch.check_modes()
    trainer.nets.critic.train()
    trainer.nets.critic[1] = nn.Identity()
    with pytest.raises(NimbleError, match=r"'nets.critic.1' \(Dropout\) was replaced"):
        watch.refuse_replaced_objects()


def test_modules_a_loss_function_reads_deeper_in_dicts_and_configs_are_watched():
    """``nets["gan"]["critic"]`` and ``cfg.nets.critic``: the module is run by the graphs (its
    mode watched, named as the function reads it), and each step on the way is watched by
    identity, the dicts' numbers of items too."""
    nets = {"gan": {"critic": nn.Sequential(nn.Linear(4, 1), nn.Dropout(0.1))}, "lr": 0.1}
    cfg = types.SimpleNamespace(nets=types.SimpleNamespace(aux=nn.Linear(4, 4)), epochs=3)
    watch = captured_watch(nn.Linear(3, 4), lambda out, y: (
        nets["gan"]["critic"](cfg.nets.aux(out)).mean()))
    assert sorted(name for name, _ in watch.read_modules()) == [
        "cfg.nets.aux", "nets['gan']['critic']", "nets['gan']['critic'].0",
        "nets['gan']['critic'].1"]
    nets["gan"]["critic"].train(False)
    with pytest.raises(NimbleError, match=r"module 'nets\['gan'\]\['critic'\]' "
                                          r"\(Sequential\) is in eval mode"):
        watch.check_modes()
    nets["gan"]["critic"].train()
    gan = nets["gan"]
    for change, said in [
            (lambda: gan.__setitem__("critic", nn.Linear(4, 1)),
             r"the module at nets\['gan'\]\['critic'\] that loss_fn reads was given a Linear"),
            (lambda: nets.__setitem__("gan", {"critic": gan["critic"]}),
             r"the module at nets\['gan'\] that loss_fn reads was given another dict after "
             r"capture, where it held a dict of modules.*nets\['gan'\]\['critic'\]"
             r".load_state_dict"),
            (lambda: gan.__setitem__("other", nn.Linear(4, 1)),
             r"the dict \"nets\['gan'\]\" that loss_fn reads holds 2 item"),
            (lambda: setattr(cfg.nets, "aux", nn.Linear(4, 4)),
             r"the module at cfg.nets.aux that loss_fn reads was given another Linear"),
            (lambda: setattr(cfg, "nets", types.SimpleNamespace(aux=cfg.nets.aux)),
             r"the module at cfg.nets that loss_fn reads was given another SimpleNamespace "
             r"after capture, where it held a SimpleNamespace holding modules.*"
             r"cfg.nets.aux.load_state_dict")]:
        kept = (dict(nets), dict(gan), cfg.nets, cfg.nets.aux)
        change()
        with pytest.raises(NimbleError, match=said):
            watch.refuse_replaced_objects()
        nets.clear(), nets.update(kept[0]), gan.clear(), gan.update(kept[1])
        cfg.nets = kept[2]
        cfg.nets.aux = kept[3]
        watch.refuse_replaced_objects()
        assert watch.first_changed() == -1
    nets["lr"] = 0.2  # not a step to a module: left alone
    cfg.epochs = 4
    watch.refuse_replaced_objects()


def test_reach_stops_at_its_depth_and_looks_through_no_large_container_below_its_modules():
    deep = {"a": {"b": {"c": {"d": nn.Linear(2, 2)}}}}
    assert _reach(deep, "deep", ()).modules == []  # four levels: past the depth
    assert [name for name, _ in _reach(deep["a"], "a", ()).modules] == ["a['b']['c']['d']"]
    many = [[nn.Linear(2, 2)]] + [[i] for i in range(5000)]
    assert _reach(many, "many", ()).modules == []
    assert len(_reach([nn.Identity()] * 5000, "many", ()).modules) == 5000
    table = {i: list(range(4000)) for i in range(4000)}  # 16M numbers: the search stops early
    table[3999] = [nn.Identity()]
    assert _reach(table, "table", ()).modules == []
    table[0] = [nn.Identity()]
    assert [name for name, _ in _reach(table, "table", ()).modules] == ["table[0][0]"]
    found = _reach((nn.Identity(), [nn.Identity()]), "pair", ())
    assert [name for _, _, name in found.edges] == ["pair[1][0]"]  # a tuple's items stay
    assert [name for _, name in found.containers] == ["pair[1]"]


def test_an_evaluators_fn_reading_a_configs_module_watches_it_by_identity():
    nets = types.SimpleNamespace(teacher=nn.Linear(3, 3))
    fn = lambda model, batch: nets.teacher(model(batch[0]))  # noqa: E731
    watch = ScopeWatch(fn, "the evaluator's fn", "make a new evaluator")
    watch.check()
    teacher = nets.teacher
    nets.teacher = nn.Linear(3, 3)
    with pytest.raises(NimbleError, match=r"the module at nets.teacher that the evaluator's fn "
                                          r"reads was given another Linear after capture"):
        watch.check()
    nets.teacher = teacher
    watch.check()


class Distiller(nn.Module):
    """A student that runs modules it holds without registering them: a teacher kept in a list
    (out of its state_dict and parameters()), a critic set past registration, a config's
    network; and modules its forward does not read."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(4, 3)
        self._teacher = [nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.1)).eval()]
        object.__setattr__(self, "critic", nn.Linear(3, 3))
        self.nets = types.SimpleNamespace(aux=nn.Linear(3, 3), unused=nn.Identity())
        self.meters = [nn.Identity()]  # held, not read by forward

    def forward(self, x):
        out = self.student(x) + self._teacher[0](x)
        return self.nets.aux(out) + self.critic(out)


def test_modules_a_model_holds_without_registering_them_are_watched_as_its_own():
    """The graphs run the modules a model's forward reads from its unregistered attributes:
    they are watched as the model's are (modes, children), named from the model, and their
    parameters are tensors the graphs read (read_modules); the attribute, each module in it and
    the number of modules a list holds are watched by identity. What the forward does not
    read is left alone."""
    model = Distiller()
    watch = captured_watch(model)
    teacher = model._teacher[0]
    assert [name for name, _ in watch.read_modules()] == [
        "_teacher[0]", "_teacher[0].0", "_teacher[0].1", "critic", "nets.aux"]
    assert watch.read_modules()[1][1] is teacher[0]
    model.meters.append(nn.Identity())
    model.nets.unused = nn.Linear(2, 2)
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    teacher.train()
    with pytest.raises(NimbleError, match=r"module '_teacher\[0\]' \(Sequential\) is in "
                                          r"training mode.*captured with it in eval mode"):
        watch.check_modes()
    teacher.eval()
    teacher[1] = nn.Identity()
    with pytest.raises(NimbleError, match=r"module '_teacher\[0\].1' \(Dropout\) was "
                                          r"replaced by a Identity"):
        watch.refuse_replaced_objects()
    teacher[1] = watch.modules[watch.names.index("_teacher[0].1")]
    for change, said in [
            (lambda: model._teacher.__setitem__(0, copy.deepcopy(teacher)),
             r"the module at _teacher\[0\] that the model \(Distiller\) reads was given "
             r"another Sequential after capture"),
            (lambda: model._teacher.append(nn.Linear(4, 3)),
             r"the list '_teacher' that the model \(Distiller\) reads holds 2 item\(s\) "
             r"after capture, where it held 1"),
            (lambda: setattr(model, "_teacher", [teacher]),
             r"the attribute '_teacher' that the model \(Distiller\) reads was given another "
             r"list after capture, where it held a list of modules"),
            (lambda: (model._teacher.clear(), setattr(model, "_teacher", [teacher])),
             r"the module at _teacher\[0\] that the model \(Distiller\) reads was deleted "
             r"after capture"),  # the old list emptied in place, then another given
            (lambda: object.__setattr__(model, "critic", nn.Linear(3, 3)),
             r"the attribute 'critic' that the model \(Distiller\) reads was given another "
             r"Linear after capture"),
            (lambda: setattr(model.nets, "aux", nn.Linear(3, 3)),
             r"the module at nets.aux that the model \(Distiller\) reads was given another "
             r"Linear")]:
        kept = (model._teacher, list(model._teacher), model.critic, model.nets.aux)
        change()
        with pytest.raises(NimbleError, match=said):
            watch.refuse_replaced_objects()
        model._teacher, model.nets.aux = kept[0], kept[3]
        model._teacher[:] = kept[1]
        object.__setattr__(model, "critic", kept[2])
        watch.refuse_replaced_objects()
        assert watch.first_changed() == -1


class HiddenPerceptualLoss(nn.Module):
    """A perceptual loss keeping its frozen network out of its state_dict, in a list."""

    def __init__(self):
        super().__init__()
        self._net = [nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.2)).eval()]

    def forward(self, out, target):
        return F.mse_loss(self._net[0](out), self._net[0](F.one_hot(target, 5).float()))


def test_a_network_a_loss_module_holds_unregistered_is_watched_as_the_models():
    loss_fn = HiddenPerceptualLoss()
    watch = captured_watch(_model(), loss_fn)
    net = loss_fn._net[0]
    names = [name for name, _ in watch.read_modules()]
    assert names == ["loss_fn._net[0]", "loss_fn._net[0].0", "loss_fn._net[0].1"]
    net.train()
    with pytest.raises(NimbleError, match=r"module 'loss_fn._net\[0\]' \(Sequential\) is in "
                                          r"training mode"):
        watch.check_modes()
    net.eval()
    loss_fn._net[0] = copy.deepcopy(net)
    with pytest.raises(NimbleError, match=r"the module at _net\[0\] that 'loss_fn' "
                                          r"\(HiddenPerceptualLoss\) reads was given another "
                                          r"Sequential after capture"):
        watch.refuse_replaced_objects()
    loss_fn._net[0] = net
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1


def test_a_replaced_holder_of_modules_is_said_whatever_it_holds_now():
    for old, said in [([], r"a list holding modules"),
                      (types.SimpleNamespace(aux=nn.Linear(2, 2)), r"nets.aux.load_state_dict")]:
        with pytest.raises(NimbleError, match=r"the attribute 'nets' that the model reads was "
                                              r"given a int after capture.*" + said):
            refuse_scope_object("the model", "member module", "nets", old, 1, "rebuild")


def test_the_step_reads_the_data_of_unregistered_and_scope_modules_besides_its_own():
    """The tensors a Step watches where its graphs read them, besides the optimizer's: the
    hidden teacher's and a loss function's critic's parameters and buffers among them, each
    once, and none of the trained ones."""
    model = Distiller()
    critic = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    loss_fn = lambda out, y: critic(out).mean()  # noqa: E731
    params = list(model.parameters())
    step = types.SimpleNamespace(model=model, loss_fn=loss_fn, _params=params,
                                 _model=ModelWatch(model, loss_fn))
    read = nt.Step._read_besides(step)
    expected = [*model._teacher[0].parameters(), *model.critic.parameters(),
                *model.nets.aux.parameters(), *critic.parameters(), *critic.buffers()]
    assert {id(t) for t in read} == {id(t) for t in expected}
    assert len(read) == len(expected)
    assert not {id(p) for p in params} & {id(t) for t in read}
    named = types.SimpleNamespace(**vars(step), _watched=[*params, *read])
    at = [i for i, t in enumerate(named._watched) if t is model._teacher[0][0].weight]
    assert nt.Step._param_name(named, at[0]) == "_teacher[0].0.weight"
    at = [i for i, t in enumerate(named._watched) if t is critic[1].running_mean]
    assert nt.Step._param_name(named, at[0]) == "the buffer critic.1.running_mean"


def test_hidden_modules_are_those_of_the_users_classes_its_code_reads():
    model = Distiller()
    assert [key for key, _ in hidden_modules(model)] == ["_teacher", "critic", "nets"]
    assert hidden_modules(nn.Sequential(nn.Linear(2, 2))) == []  # a library's: not looked into
    assert hidden_modules(model.student) == []
    model._teacher = {"teachers": [model._teacher[0]]}  # deeper: followed as a loss's are
    [(key, found)] = [item for item in hidden_modules(model) if item[0] == "_teacher"]
    assert [name for name, _ in found.modules] == ["_teacher['teachers'][0]"]
    assert [name for _, name in found.containers] == ["_teacher", "_teacher['teachers']"]
    # nimble_train's own wrappers hold what they run unregistered (the drop-in Trainer's loss
    # module holds the Trainer, and it the model): a library's, not looked into
    wrapper = type("_Wrapper", (Distiller,), {"__module__": "nimble_train.integrations.x"})
    assert hidden_modules(wrapper()) == []


def test_in_flat_buffers_tells_parameters_a_fused_optimizer_moved():
    torch.manual_seed(0)
    moved, kept = nn.Linear(4, 3), nn.Linear(4, 3)
    assert not in_flat_buffers(moved.weight)
    fused = FusedOptimizer(torch.optim.SGD(moved.parameters(), lr=0.1))
    assert in_flat_buffers(moved.weight) and in_flat_buffers(moved.bias)
    assert not in_flat_buffers(kept.weight)
    del fused
    gc.collect()
    assert not in_flat_buffers(moved.weight)  # no optimizer writes it there any more


CLASS_WEIGHT = torch.ones(5)  # a global tensor a loss function reads


def _weighted_loss():
    shift = torch.zeros(5)

    def loss_fn(out, target):
        return F.cross_entropy(out + shift, target, weight=CLASS_WEIGHT)

    def set_shift(value):
        nonlocal shift
        shift = value
    return loss_fn, set_shift


def test_tensors_a_loss_function_reads_from_its_scope_are_watched_by_identity():
    """The graphs read the tensor a name held at capture: changed in place it is what they
    read; another tensor under the name after capture is refused, naming it, before anything
    runs (before the first capture, or assigned by the step's own forwards, it is taken)."""
    global CLASS_WEIGHT
    loss_fn, set_shift = _weighted_loss()
    watch = captured_watch(_model(), loss_fn)
    assert [w for w in watch._what if w[0].endswith(" tensor")] == [
        ("closure tensor", -1, "shift"), ("global tensor", -1, "CLASS_WEIGHT")]
    CLASS_WEIGHT.mul_(2.0)  # in place: what the graphs read
    assert watch.first_changed() == -1
    shift = dict(zip(loss_fn.__code__.co_freevars, loss_fn.__closure__))["shift"].cell_contents
    set_shift(torch.ones(5))
    with pytest.raises(NimbleError, match=r"loss_fn's closure variable 'shift' was given another "
                                          r"tensor after capture, where it held a tensor "
                                          r"\(torch.float32 \[5\] on cpu\).*shift.copy_\(new\).*"
                                          r"Nothing was run"):
        watch.refuse_replaced_objects()
    set_shift(shift)
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
    weight = CLASS_WEIGHT
    try:
        CLASS_WEIGHT = None
        with pytest.raises(NimbleError, match=r"the global 'CLASS_WEIGHT' that loss_fn reads was "
                                              r"given a NoneType after capture"):
            watch.refuse_replaced_objects()
        CLASS_WEIGHT = torch.ones(5)
        assert watch.after_forward() == []  # as if loss_fn had assigned it itself: taken
        assert watch.first_changed() == -1
        fresh = ModelWatch(_model(), loss_fn)  # before the first capture: taken
        CLASS_WEIGHT = torch.zeros(5)
        fresh.refuse_replaced_objects()
        assert fresh.first_changed() == -1
    finally:
        CLASS_WEIGHT = weight


MASK = torch.ones(4)  # a global tensor a forward reads


class _Masked(nn.Module):
    def forward(self, x):
        return x * MASK


def test_a_tensor_a_forward_reads_as_a_global_is_watched_by_identity():
    global MASK
    watch = captured_watch(nn.Sequential(_Masked(), nn.Linear(4, 2)))
    assert ("global tensor", 1, "MASK") in watch._what
    mask = MASK
    try:
        MASK = torch.zeros(4)
        with pytest.raises(NimbleError, match=r"the global 'MASK' that '0' \(_Masked\) reads was "
                                              r"given another tensor after capture"):
            watch.refuse_replaced_objects()
    finally:
        MASK = mask
    watch.refuse_replaced_objects()
    assert watch.first_changed() == -1
