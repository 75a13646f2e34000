"""What a captured step's graphs hold of the model: each module's training mode, its constants,
child modules, parameters and buffers, as they were when the graphs were first captured.

A graph runs the modules, parameters and buffers it was captured with. User code that assigns
new ones between calls (``model.fc = nn.Linear(...)``, ``load_state_dict(sd, assign=True)``,
``model.bn.running_mean = t``, ``model.eval()``) changes an entry of a module's dicts, not what
the graph reads. ModelWatch holds those entries and checks them all in one C++ pass
(``_C.EntryWatch``, a few ns an entry) on every call; the slow path says what changed:

- a training mode: refused (check_modes) -- the model's modules', and those of a loss
  module's whose code reads it (reads_mode: a perceptual loss's dropout, not the loss);
- a constant (an attribute the module's class lists in ``__constants__``: a dropout's ``p``,
  BatchNorm's ``momentum`` and ``eps``, a loss module's ``label_smoothing``), or a number of a
  leaf module's (a public bool, int, float or str attribute of a module without children:
  timm's ``DropPath.drop_prob``, torchvision's ``StochasticDepth.p``, a focal loss's
  ``gamma``; a tuple of them, or a list, whose items are watched: is_number), or one of a
  module with children that its own code names (names_read: a model's
  ``self.mask_ratio`` its forward reads, not a counter user code keeps on it): the graphs run
  the Python value they were captured with, so another value is refused (before the first
  capture any value is taken: the capture bakes it); an equal one in a new object is taken as
  it is. A value the step's own forwards change (a module counting its calls) is taken after
  each call (after_forward); the replays, running no Python, leave it as the capture did,
  which warns of it (warn_replays_keep);
- a number held in a plain object a user's module holds and its code reads through it
  (``self.cfg.drop_rate``: a dataclass, a SimpleNamespace, a transformers config; a module of
  an installed package's reads its config as it was built), or that the methods of an object
  of the user's that its code calls read (``self.noise(x)``, whose ``__call__`` reads
  ``self.sigma``; ``self.noise.scaled(x)``): as a number; the object
  replaced by one holding the captured values (a config loaded again) is watched from then
  on, by one holding others refused (_settle_holders);
- a child module or a parameter object: refused (refuse_replaced_objects) -- the graphs and
  the optimizer hold the old one, so the new one would never train;
- a module or parameter added to a container (``model.blocks.append(block)`` on an
  ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``; an ``nn.ParameterList`` or
  ``nn.ParameterDict``): refused the same way, since a forward that runs the container's
  contents would run it, the graphs do not. Anywhere else an attribute added after capture
  (a metric module made in a validation step) is not something the forward's code reads, and
  is left alone. What the step's own forwards add is taken (after_forward);
- a hook registered on a module (forward, forward pre-, backward or backward pre-hook; the
  loss module's, or one every module runs) or removed: refused (_refuse_hooks) -- a replay
  runs no Python, so the graphs run the hooks in place at capture, which ran in it (what they
  do to tensors is replayed). So is a hook registered on a parameter's gradient
  (``p.register_hook``, ``p.register_post_accumulate_grad_hook``) or removed. The dicts of
  hooks are watched by their numbers of keys, and torch's count of the hooks ever registered
  (``RemovableHandle.next_id``) by identity: a hook registered anywhere moves it, so one
  removed and another registered between two calls is seen too, on the slow path, which takes
  a hook registered on anything else. What the step's own calls add or remove is taken
  (after_forward), as is any change before the first capture;
- a buffer: its values copied into the tensor the graphs read, which goes back in the module
  (replaced_tensors, then put_back), or refused when it no longer fits (another shape, dtype
  or device);
- a tensor a module holds in a plain attribute (``self.temperature = torch.tensor(...)``, or a
  mask, that user code sets anew): as a buffer; except that one named with a leading
  underscore that no longer fits is taken as it is (a module's private cache);
- an attribute that held None at capture, where a number would be watched (a focal loss's
  ``self.alpha = None``, a head's optional class weights): the graphs ran the forward's
  branch for None, so anything set there after capture is refused (check_constants); what
  the step's own forwards set there is taken, and watched from then on as what it is (a
  tensor, a number).

A loss function given as a function reads numbers from the scope it was made in: a closure
variable (``lambda out, y: F.cross_entropy(out, y, label_smoothing=smoothing)`` made inside a
function) or a global of its module. Those it names directly, those the modules' own code
(names_read's) reads from its scope (a global of its module, ``F.dropout(x, DROP)`` in a
forward; a closure variable of a class made in a function, ``def make_block(p): class
Block(nn.Module): ...``), and those of the plain functions either calls by a global name (a
helper of the user's, ``return _jitter(x)``, or one a factory made, closure and all; not an
installed package's) are watched as numbers are: the graphs run the value captured, so
another value is refused (check_constants); so are those the user's own code (a module
class's, the loss function's) reads through a config it names (code_holders, scope_holders:
``args.smoothing``, ``weights["aux"]``), the config under its name by identity (another with
equal numbers is taken, as a module's ``self.cfg``). A tensor either reads there by name (class
weights a loss function reads as a global) is watched by identity: another tensor under the
name after capture is refused, an in-place change is what the graphs read; one the step's own
forwards assign is taken. The modules it reads there (named_scope_modules: a GAN's
discriminator in its generator's loss, a perceptual loss's network) are run by the graphs
too: they are watched as the model's modules are, named as the loss function names them
(``'critic.1'``), their parameters and buffers as the model's frozen ones (ParamWatch), and the
names it reads them by by identity (scope_module_names); but not the hooks on their
parameters' gradients, which the step that trains them may register (its buckets) and these
graphs do not run. So are the modules it reads through a dict, list, tuple or config it
names (``losses[1]``, ``nets["vgg"]``; ``cfg.critic`` of a namespace, a dataclass or an object
of the user's, the attributes its code names; ``self.nets.critic`` of the plain object it is a
method of; followed three levels down: ``nets["gan"]["critic"]``, ``cfg.nets.critic``;
_reach), each step below the name by identity and the number of items each dict or list on
the way holds (scope_reach; EntryWatch reads a list by index, its length closed), the name
by identity too (scope_module_names). The modules a model's (or the loss module's) module of
the user's holds without registering them, under attributes its code names (hidden_modules:
``self._teacher = [teacher]``, one set by ``object.__setattr__``, a config's
``self.nets.aux``), are watched the same way, named from the model; the attribute by identity
(kind "member module").

A forward may assign its buffers or tensor attributes anew itself (``self.avg = 0.9 *
self.avg + 0.1 * m``, an out-of-place running average; ``self.state = f(self.state)``): a graph
captured from it reads the tensor the call began with and writes a new one that the next replay
never reads. Inside each capture the new values are copied back into the tensor the graph
reads, which goes back in the module (keep_assigned_tensors), so that every replay leaves them
where the next one reads them, as eager steps leave them in the module, whichever of the
step's graphs ran last. A tensor attribute the forward assigns in another shape, dtype or
device (a cache of its last output, ``self.last_attention = a``) is taken as it is: the
graph's output, which the replays of that graph write. A capture that fails puts the tensors
back untouched (the one the forward assigned holds no values: a capture runs nothing), and
the numbers its forwards changed (a module counting its calls) back to their values after
the last completed call (undo_capture).

A parameter's, buffer's or tensor attribute's data replaced in place of its object
(``p.data = t``, ``bn.running_mean.data = t``, ``module.temperature.data = t``) is ParamWatch's
(src/optim/fused_step.h) to see.
"""

from __future__ import annotations

import argparse
import dataclasses
import dis
import functools
import inspect
import os
import site
import sys
import sysconfig
import types
from typing import Callable, Container, Iterator, NamedTuple

import torch
from torch.utils.hooks import RemovableHandle

from . import _torch_private
from ._extension import _C
from ._optimizer_state import same, shown
from ._sync import warn_at_user
from .errors import NimbleError


def describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}"


def refuse_replaced(what: str, why: str) -> None:
    raise NimbleError(
        f"nimble_train.Step: {what} was replaced after capture (p.data = ..., "
        f"module.to(...)), and {why}. Change values in place (with torch.no_grad(): "
        "p.copy_(t)), or build a new Step for the new model: step.close(), then "
        "nt.Step(model, optimizer, ...) again. Nothing was run for this call.")


_MISSING = object()
_NUMBERS = (bool, int, float, str)  # the attributes watched as numbers (and tuples of them)


def is_number(value: object) -> bool:
    """A value a graph bakes in as it is: a bool, int, float or str, or a tuple of them (a
    kernel size, a pair of scales); or a list of them, not empty (per-stage widths, a list of
    loss weights), which may change in place: the watch compares its items (EntryWatch's
    items; kept holds a copy to compare with). An empty list is an accumulator as often as not
    (of tensors a forward appends), and is not watched."""
    return _frozen_number(value) or (type(value) is list and bool(value)
                                     and all(map(_frozen_number, value)))


def _frozen_number(value: object) -> bool:
    return type(value) in _NUMBERS or (type(value) is tuple and all(map(_frozen_number, value)))


def kept(value: object) -> object:
    """A watched number as the watch keeps it to compare with: a list as a copy (the list
    itself may change in place); anything else as it is."""
    return list(value) if type(value) is list else value


def kept_entries(entries: list[tuple], numbers: frozenset[int]) -> list[tuple]:
    """EntryWatch entries as their watch's owner keeps them to compare with: the value of each
    numbers' entry (its index in `numbers`, the EntryWatch's items) as kept's."""
    return [(table, key, kept(value)) if e in numbers else (table, key, value)
            for e, (table, key, value) in enumerate(entries)]


def take(watch, entries: list[tuple], numbers: frozenset[int], e: int) -> None:
    """EntryWatch entry e's value becomes what its dict holds now, in the watch and in its
    owner's entries (kept's, for a numbers' entry)."""
    table, key, _ = entries[e]
    watch.update(e)
    now = _now(table, key)
    entries[e] = (table, key, kept(now) if e in numbers else now)


# entries compared by value, not identity
_BY_VALUE = ("mode", "constant", "number", "held", "closure", "global", "scope held")
# A config a function reads numbers through, by the name it reads it under (scope_holders)
_SCOPE_HOLDERS = ("closure holder", "global holder")
# tensors and modules read by name from a function's scope: by identity
_SCOPE_TENSORS = ("closure tensor", "global tensor")
_SCOPE_MODULES = ("closure module", "global module", "attribute module", "item module",
                  "member module")
# A module's dicts of the hooks that run around its forward and backward, and their kinds.
_HOOKS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
          ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))
# The hooks on a parameter's gradient, in gradient_hook_dicts' order: (kind, how registered)
_GRAD_HOOKS = (("gradient hook", "register_hook"),
               ("post-accumulate-grad hook", "register_post_accumulate_grad_hook"))
# The modules whose forward, or their parent's, runs whatever the table holds: their tables
# keep their keys.
_CONTAINERS = {"module": (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict),
               "parameter": (torch.nn.ParameterList, torch.nn.ParameterDict),
               "buffer": ()}


class ModelWatch:
    """`model`'s modules (modules()'s order), their modes and their dicts' entries (their
    tensor attributes among them), as now, and those of the modules the graphs run besides
    (read_modules: the loss function's scope's, the unregistered ones of the model's and the
    loss module's modules; their modes, not their gradients' hooks); and those of `loss_fn`
    when it is a module of its own (its constants and buffers: a loss's ``label_smoothing``,
    its class ``weight``; the modes of its modules whose code reads theirs), named from
    ``loss_fn``."""

    def __init__(self, model: torch.nn.Module, loss_fn: object = None):
        named = list(model.named_modules())
        seen = {id(module) for _, module in named}
        # The modules the loss function reads from its scope (a GAN's discriminator, a
        # perceptual loss's network), named as it names them: the graphs run them in the mode
        # they are in now, as the model's. The hooks on their parameters' gradients are not
        # watched: the step that trains them may hook them (its buckets), which this step's
        # graphs do not run.
        scope_start = len(named)
        loss_named = (list(loss_fn.named_modules(prefix="loss_fn"))
                      if isinstance(loss_fn, torch.nn.Module) else [])
        # And those the model's and the loss module's modules hold without registering them
        # and their code reads (self._teacher = [teacher], kept out of the state_dict; a
        # perceptual loss's network so kept), likewise, named from them: per attribute (the
        # module holding it, the attribute, what it holds: hidden_modules).
        hidden, readers = [], set()
        for name, module in named + loss_named:
            if id(module) not in readers:
                readers.add(id(module))
                hidden += [(module, key, found) for key, found in hidden_modules(module)]
        paths = {id(module): name for name, module in reversed(named + loss_named)}
        reached = [*named_scope_modules(loss_fn),
                   *[(_join(paths[id(reader)], label), module) for reader, _, found in hidden
                     for label, module in found.modules]]
        for prefix, scoped in reached:
            for name, module in scoped.named_modules(prefix=prefix):
                if id(module) not in seen:
                    seen.add(id(module))
                    named.append((name, module))
        scope_end = len(named)
        self._scope = (scope_start, scope_end)
        named += [(name, module) for name, module in loss_named if id(module) not in seen]
        self.names = [name for name, _ in named]
        self.modules = [module for _, module in named]
        index = {}  # a module's index: where modules() first holds it
        for i, module in enumerate(self.modules):
            index.setdefault(id(module), i)
        entries, self._what = [], []  # per entry (kind, module index, key)
        # per container's table (kind, module index, the table, its keys): a key added is refused
        self._tables: list[tuple[str, int, dict, frozenset]] = []
        # as tables: per dict of hooks (its kind, module index or -1 for every module's, the
        # dict, its keys); a hook added or removed is refused
        hooks: list[tuple[str, int, dict, frozenset]] = []
        # (module index, name, parameter) per parameter, where modules() first holds it: the
        # hooks on its gradient are watched
        self._params: list[tuple[int, str, torch.Tensor]] = []
        seen_params: set[int] = set()
        # (module index, name, the numbers its code reads) per object holding numbers
        holders: list[tuple[int, str, list[str]]] = []

        def watch(kind: str, i: int, table: dict, key: str, name: str | None = None) -> None:
            entries.append((table, key, table[key]))
            self._what.append((kind, i, name or key))

        # The modes: the model's and its scope's modules', and those of the loss module's
        # whose code reads theirs (a perceptual loss's dropout; a loss's own mode changes
        # nothing it computes, and an eval loop may leave it so).
        for i, module in enumerate(self.modules):
            attributes = vars(module)
            if "training" in attributes and (i < scope_end or reads_mode(type(module))):
                watch("mode", i, attributes, "training")  # not a property (a compiled model's)
        self._modes_end = len(entries)
        for i, module in enumerate(self.modules):
            attributes = vars(module)
            constants, numbers, unset = watched_attributes(module)
            for key in constants:
                watch("constant", i, attributes, key)
            numbers, unset = set(numbers), set(unset)
            for key, value in attributes.items():
                if isinstance(value, torch.Tensor):
                    watch("tensor", i, attributes, key)
                elif key in numbers:
                    watch("number", i, attributes, key)
                elif key in unset:
                    watch("unset", i, attributes, key)
            holders += [(i, key, numbers) for key, value in attributes.items()
                        if (numbers := _held_numbers(module, key, value))]
            for key, p in module._parameters.items():
                if p is not None and id(p) not in seen_params and not (
                        scope_start <= i < scope_end):
                    seen_params.add(id(p))
                    self._params.append((i, key, p))
            for kind, table in (("module", module._modules), ("parameter", module._parameters),
                                ("buffer", module._buffers)):
                for key in table:
                    watch(kind, i, table, key)
                if isinstance(module, _CONTAINERS[kind]):
                    self._tables.append((kind, i, table, frozenset(table)))
            for key, label in _HOOKS:
                if isinstance(table := attributes.get(key), dict):
                    hooks.append((label, i, table, frozenset(table)))
        # After the containers, the hooks: each module's, then those every module runs.
        hooks += [(f"global {label}", -1, table, frozenset(table))
                  for label, table in _torch_private.global_module_hook_dicts()]
        self._hooks_start = len(self._tables)
        self._tables += hooks
        # The objects a user's module holds numbers its code reads in (self.cfg.drop_rate):
        # each held by identity, then its numbers (per holder's entry, its numbers' entries).
        self._held: dict[int, list[int]] = {}
        for i, key, numbers in holders:
            attributes, holder = vars(self.modules[i]), len(entries)
            watch("holder", i, attributes, key)
            for name in numbers:
                watch("held", i, vars(attributes[key]), name, f"{key}.{name}")
            self._held[holder] = list(range(holder + 1, len(entries)))
        # Torch's count of the hooks ever registered (a class attribute set anew by each): a
        # hook registered on a parameter's gradient, or one in place of one removed, moves it.
        self._hook_count = len(entries)
        entries.append((RemovableHandle, "next_id", RemovableHandle.next_id))
        self._what.append(("hook count", -1, "next_id"))
        # Numbers the modules' own code reads from its scope (its closures, the globals of its
        # module), then the loss function's (one both read: watched once, as the module's).
        scope, watched = [], set()
        for i, module in enumerate(self.modules):
            scope += [(kind, i, table, key) for kind, table, key in code_numbers(type(module))]
        scope += [(kind, -1, table, key) for kind, table, key in scope_numbers(loss_fn)]
        # And the tensors they read there (a class weight a loss function reads as a global),
        # by identity: the graphs read the tensor itself (kinds "closure tensor", "global
        # tensor"; check_constants).
        for i, module in enumerate(self.modules):
            scope += [(kind + " tensor", i, table, key)
                      for kind, table, key in code_tensors(type(module))]
        scope += [(kind + " tensor", -1, table, key)
                  for kind, table, key in scope_tensors(loss_fn)]
        # And the names it reads its modules under, by identity (another module there would
        # not be the one the graphs run).
        scope += [(kind + " module", -1, table, key)
                  for kind, table, key in scope_module_names(loss_fn)]
        for kind, i, table, key in scope:
            if (id(table), key) not in watched:
                watched.add((id(table), key))
                entries.append(scope_entry(kind.split()[0], table, key))
                self._what.append((kind, i, key))
        # And the configs the modules' code and the loss function read numbers through
        # (args.smoothing, cfg["alpha"]), from their scope: each by identity under its name,
        # then its numbers by value (kind "scope held"), as a module's held config's.
        configs, seen_configs, classes = [], set(), set()
        for i, module in enumerate(self.modules):
            if type(module) not in classes:  # named as the first of its class that reads it
                classes.add(type(module))
                configs += [(i, *config) for config in code_holders(type(module))]
        configs += [(-1, *config) for config in scope_holders(loss_fn)]
        for i, kind, table, name, numbers in configs:
            if (id(table), name) in seen_configs:
                continue
            seen_configs.add((id(table), name))
            holder = len(entries)
            entries.append(scope_entry(kind, table, name))
            self._what.append((kind + " holder", i, name))
            for held, key, label in numbers:
                entries.append((held, key, held[key]))
                self._what.append(("scope held", i, label))
            self._held[holder] = list(range(holder + 1, len(entries)))
        # And what the loss function reads modules through, below their names (losses[1],
        # cfg.critic, nets["gan"]["critic"]: scope_reach), by identity, and the number of
        # items each dict or list on the way holds (after the hooks' dicts: kind "scope
        # container").
        reach = scope_reach(loss_fn)
        self._containers = list(reach.containers)  # (the dict or list, its name) each
        for table, key, name in reach.edges:
            entries.append((table, key, table[key]))
            self._what.append(("item module", -1, name))
        # The module reading each container: the loss function's (-1), then the model's that
        # hide modules (their attributes by identity, then what each holds on the way).
        self._readers = [-1] * len(self._containers)
        for reader, key, found in hidden:
            i = index[id(reader)]
            watch("member module", i, vars(reader), key)
            for table, k, label in found.edges:
                entries.append((table, k, table[k]))
                self._what.append(("item module", i, label))
            self._containers += found.containers
            self._readers += [i] * len(found.containers)
        self._containers_start = len(self._tables)
        self._tables += [("scope container", -1, container, frozenset())
                         for container, _ in self._containers]
        self._sizes = [len(container) for container, _ in self._containers]
        # the numbers' entries: a list there is compared by its items, from a copy
        self._items = frozenset(e for e, (what, _, _) in enumerate(self._what)
                                if what in _BY_VALUE + ("unset",))
        self._entries = kept_entries(entries, self._items)
        self._watch = _C.EntryWatch(entries, [table for _, _, table, _ in self._tables],
                                    sorted(self._items))
        # per parameter, the keys of each kind of hook on its gradient (_GRAD_HOOKS); the
        # dicts' numbers of keys are watched (a parameter has none until its first hook)
        self._grad_hooks: list[tuple[frozenset, ...]] = []
        self._take_grad_hooks()
        # Whether a graph was captured with the values: until then another one is taken.
        self.captured = False
        # The whole check on a step's fast path: -1 when nothing changed.
        self.first_changed = self._watch.first_changed

    def read_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """(name, module) per module the graphs run besides the model's and the loss module's:
        those the loss function reads from its scope, and those the model's modules hold
        without registering them (hidden_modules), their children included."""
        start, end = self._scope
        return list(zip(self.names[start:end], self.modules[start:end]))

    def objects_changed(self) -> bool:
        """A constant or number, child module, parameter, buffer or tensor attribute is not the
        one captured, or one was added (modes aside: an evaluator's graphs run in eval mode
        whatever the flags say)."""
        return self._watch.first_changed(self._modes_end) >= 0

    def after_forward(self) -> list[tuple[str, object, object]]:
        """The constants and numbers as the step's own forwards left them (a capture's, an
        eager step's, an evaluator's; a module that counts its calls changes one), and the
        tensor attributes they assigned in another shape, dtype or device, become the watched
        values: called at the end of each call whose checks passed, so that what is refused is
        what user code changed between calls. (A tensor they assigned that fits goes where the
        graphs read it: keep_assigned_tensors in a capture, put_back at the next call.)
        Returns the numbers that took another value: (name, was, now) each."""
        changed = self._take_numbers()
        for e, what, _, _, _, read, now in self._tensors_changed():
            if what == "tensor" and not _fits(now, read):
                self._take(e)  # a tensor that fits goes back where the graphs read it
        if self._tables_changed():
            self._take_tables()
        return changed

    def _tables_changed(self) -> bool:
        """A hook was registered anywhere (torch's count moved), or a container, a dict of
        hooks or one on a parameter's gradient holds another number of keys."""
        return (self._entries[self._hook_count][2] is not RemovableHandle.next_id
                or self._watch.first_changed(len(self._entries)) >= 0)

    def _take_tables(self) -> None:
        """The containers' keys and the hooks in place now become the watched ones."""
        for k, (kind, i, table, _) in enumerate(self._tables[:self._containers_start]):
            self._tables[k] = (kind, i, table, frozenset(table))
        self._sizes = [len(container) for container, _ in self._containers]
        self._watch.take_sizes()
        self._take_grad_hooks()
        self._take(self._hook_count)

    def _take_grad_hooks(self) -> None:
        tables = [_torch_private.gradient_hook_dicts(p) for _, _, p in self._params]
        self._grad_hooks = [tuple(frozenset(table or ()) for table in hooks) for hooks in tables]
        self._watch.set_sized([table for hooks in tables for table in hooks if table is not None])

    def _take_numbers(self) -> list[tuple[str, object, object]]:
        """Each constant and number (a scope's too) that changed, and is still there, becomes
        the watched value; returns those that took another value: (name, was, now) each."""
        changed = []
        for e in self._watch.changed(self._modes_end):
            what, i, key = self._what[e]
            table, entry_key, was = self._entries[e]
            now = _now(table, entry_key)
            if what in _BY_VALUE and now is not _MISSING:
                if not _same_value(now, was):
                    changed.append((self._entry_name(what, i, key), was, now))
                self._take(e)
            elif what in _SCOPE_TENSORS + _SCOPE_MODULES and now is not _MISSING:
                self._take(e)  # a tensor the step's own forwards assigned: their output
            elif what == "unset" and now is not _MISSING:
                # set by the step's own forwards (or before capture): watched as what it is
                if is_number(now):
                    self._what[e] = ("number", i, key)
                    changed.append((self._entry_name("number", i, key), was, now))
                elif isinstance(now, torch.Tensor):
                    self._what[e] = ("tensor", i, key)
                self._take(e)
        return changed

    def _take(self, e: int) -> None:
        take(self._watch, self._entries, self._items, e)

    def _path(self, i: int, key: str | None = None) -> str:
        """Module i's attribute `key` as named from the model (``'0.temperature'``'s path)."""
        return ".".join(part for part in (self.names[i], key) if part)

    def _name(self, i: int, key: str | None = None) -> str:
        name = self._path(i, key)
        return f"'{name}'" if name else "the model"

    def _entry_name(self, what: str, i: int, key: str) -> str:
        if what in ("closure", "global", "scope held"):  # a number read from a function's scope
            return scope_name(self._reader(i), what.split()[-1], key)
        return f"{self._name(i, key)} ({type(self.modules[i]).__name__})"

    def _reader(self, i: int) -> str:
        """Whose code reads a scope's number: module i's, or the loss function's (i < 0)."""
        return "loss_fn" if i < 0 else f"{self._name(i)} ({type(self.modules[i]).__name__})"

    def check_modes(self) -> None:
        """The modules' training modes are those the graphs were captured with: a graph runs
        BatchNorm's batch statistics and dropout as it was captured, whatever the flags say
        now. Raised before anything runs."""
        changed = self._unequal("mode")
        if not changed:
            return
        i, _, was, now = changed[0]
        module = self.modules[i]
        where = (f"module {self._name(i)} ({type(module).__name__})" if self.names[i]
                 else "the model")
        mode = lambda training: "training" if training else "eval"  # noqa: E731
        if i == 0 and was and not now:  # the model itself: modules() lists it first
            fix = ("call model.train() before the next step (after an evaluation; "
                   "step.evaluator(fn) switches to eval mode and back by itself)")
        else:
            fix = ("put the modes back, or, to train on with the new ones (BatchNorm's "
                   "statistics frozen, say), step.close() and build a new nt.Step")
        raise NimbleError(
            f"nimble_train.Step: {where} is in {mode(now)} mode, and the step's graphs were "
            f"captured with it in {mode(was)} mode ({len(changed)} module(s) changed); a "
            f"captured graph runs the modes it was captured with. To train as the modes say, "
            f"{fix}. Nothing was run for this call.")

    def _unequal(self, kind: str) -> list[tuple[int, str, object, object]]:
        """(module index, key, value captured, value now or _MISSING) per entry of kind that
        changed. A mode, constant or number equal to the captured one in a new object (a mode
        set to 1, a float parsed again) is taken as the captured one, so that the fast path
        holds again; a module, parameter or buffer must be the very object the graphs read."""
        by_value = kind in _BY_VALUE
        out = []
        for e in self._watch.changed():
            what, i, key = self._what[e]
            if what != kind:
                continue
            table, entry_key, old = self._entries[e]
            now = _now(table, entry_key)
            if by_value and _same_value(now, old, same_type=kind != "mode"):
                self._take(e)
            else:
                out.append((i, key, old, now))
        return out

    def check_constants(self) -> None:
        """A module constant, or a watched number, other than the one captured is
        refused (the graphs run the value they were captured with); an equal value in a new
        object is taken as the captured one, and so is any value before the first capture
        (set after warm-up: the capture bakes it). Raised before anything runs."""
        self._settle_holders()
        if not self.captured:
            self._take_numbers()
        for kind in ("closure", "global", "scope held"):
            for i, key, old, now in self._unequal(kind):
                refuse_scope_change(self._reader(i), kind.split()[-1], key, old, now,
                                    "build a new Step for each new value: step.close(), then "
                                    "nt.Step(model, optimizer, loss_fn) again (the optimizer's "
                                    "state carries over)")
        rebuild = ("build a new Step: step.close(), then nt.Step(model, optimizer, loss_fn) "
                   "again (the optimizer's state carries over)")
        for kind in _SCOPE_TENSORS + _SCOPE_MODULES:
            for i, key, old, now in self._unequal(kind):
                refuse_scope_object(self._reader(i), kind, key, old, now, rebuild)
        for k in self._watch.resized():
            if k >= self._containers_start and self.captured:
                k -= self._containers_start
                container, name = self._containers[k]
                refuse_resized_container(self._reader(self._readers[k]), container, name,
                                         self._sizes[k], rebuild)
        for i, key, old, now in self._unequal("unset"):
            seen = "was deleted" if now is _MISSING else f"is now {shown(now)}"
            raise NimbleError(
                f"nimble_train.Step: {self._name(i, key)} ({type(self.modules[i]).__name__}) "
                f"held {shown(old)} when the step's graphs "
                f"were captured and {seen}; the graphs run what the forward did with it then (a "
                "replay runs no Python, so the forward's code for the new value never runs). "
                "Set it before the Step's first call, or build a new Step to train with it: "
                "step.close(), then nt.Step(model, optimizer, ...) again (the optimizer's state "
                "carries over). Nothing was run for this call. An attribute the forward does "
                f"not read can be named with a leading underscore (_{key}): those are not "
                "watched.")
        for kind in ("constant", "number", "held"):
            for i, key, old, now in self._unequal(kind):
                seen = ("was deleted" if now is _MISSING else
                        f"changed from {shown(old)} to {shown(now)}")
                unread = ("" if kind != "number" else
                          f" An attribute the forward does not read can be named with a leading "
                          f"underscore (_{key}): those are not watched.")
                raise NimbleError(
                    f"nimble_train.Step: {self._name(i, key)} ({type(self.modules[i]).__name__})"
                    f" {seen} after capture; the step's graphs run the value they were captured "
                    "with (the Python numbers a forward reads are baked into a CUDA graph). Set "
                    "it before the Step's first call, or build a new Step to train with the new "
                    "value: step.close(), then nt.Step(model, optimizer, ...) again (the "
                    "optimizer's state carries over). Nothing was run for this call." + unread)

    def _settle_holders(self) -> None:
        """An object holding numbers the module's code reads (self.cfg) replaced by another, or
        a config the user's code reads numbers through (args, a dict) under its name: its
        numbers are watched in the new one from now on, after capture only when each is equal
        to the captured one (a config loaded again), else refused. Raised before anything
        runs."""
        for e in self._watch.changed(self._modes_end):
            what, i, key = self._what[e]
            if what != "holder" and what not in _SCOPE_HOLDERS:
                continue
            table = self._entries[e][0]
            now = _now(table, key)
            unequal = replaced_holder(now, [self._entries[n][1:] for n in self._held[e]])
            if self.captured and unequal and what in _SCOPE_HOLDERS:
                refuse_replaced_config(self._reader(i), what.split()[0], key, *unequal,
                                       "build a new Step to train with the new values: "
                                       "step.close(), then nt.Step(model, optimizer, loss_fn) "
                                       "again (the optimizer's state carries over)")
            if self.captured and unequal:
                seen, name, was = unequal
                raise NimbleError(
                    f"nimble_train.Step: {self._name(i, key)} "
                    f"({type(self.modules[i]).__name__}) was {seen} after capture, where "
                    f"the step's graphs were captured with {name!r} {was!r} "
                    "(the Python numbers a forward reads are baked into a CUDA graph). Set "
                    "it before the Step's first call, or build a new Step to train with the "
                    "new values: step.close(), then nt.Step(model, optimizer, ...) again "
                    "(the optimizer's state carries over). Nothing was run for this call.")
            held = number_table(now)
            for n in self._held[e]:
                # one the new object lacks (before capture: the capture reads none) is left
                self._retarget(n, held)
            if now is not _MISSING:
                self._take(e)
            elif not isinstance(table, types.CellType):  # deleted before capture: none to watch
                self._retarget(e, {})

    def _retarget(self, e: int, table: dict) -> None:
        self._entries[e] = retarget(self._watch, e, self._entries[e][1], table)

    def refuse_replaced_objects(self) -> None:
        """A changed constant, and a child module or a parameter object other than the one
        captured, are refused: the graphs run the old one and the optimizer updates it, so
        the new one would never train (an eager loop would train nothing of it either).
        Raised before anything runs."""
        self.check_constants()
        self._refuse_added()
        self._refuse_hooks()
        for i, key, old, now in self._unequal("module"):
            now = None if now is _MISSING else now
            seen = ("removed" if now is None else
                    f"replaced by another {type(now).__name__}" if type(now) is type(old) else
                    f"replaced by a {type(now).__name__}")
            raise NimbleError(
                f"nimble_train.Step: module {self._name(i, key)} ({type(old).__name__}) was "
                f"{seen} after capture; the step's graphs run the module they were captured "
                "with, and the optimizer holds its parameters. Assign new modules before the "
                "Step's first call, or build a new Step (and an optimizer over the new "
                "parameters): step.close(), then nt.Step(model, optimizer, ...) again. Nothing "
                "was run for this call.")
        for i, key, old, now in self._unequal("parameter"):
            now = None if now is _MISSING else now
            seen = ("removed" if now is None else "set where the graphs read none" if old is None
                    else "replaced by another tensor")
            raise NimbleError(
                f"nimble_train.Step: parameter {self._name(i, key)} was {seen} after capture "
                "(load_state_dict(..., assign=True), or module."
                f"{key} = nn.Parameter(...)); the optimizer and the step's graphs hold the old "
                "one, so the new one would never train. Load values into the parameters in "
                "place (load_state_dict without assign=True, or with torch.no_grad(): "
                "p.copy_(t)), or build a new optimizer and Step over the new parameters: "
                "step.close(), then nt.Step(model, optimizer, ...) again. Nothing was run for "
                "this call.")

    def _refuse_added(self) -> None:
        """A module or parameter added to a container since capture (keys replaced or removed
        are the entries' to name). Raised before anything runs."""
        for k in self._watch.resized():
            if k >= self._hooks_start:
                break  # a dict of hooks
            kind, i, table, keys = self._tables[k]
            added = [key for key in table if key not in keys]
            if not added:
                continue  # keys removed: the entries name them
            key = added[0]
            value = table[key]
            what = (f"a {type(value).__name__}" if kind == "module" else
                    "none" if value is None else describe(value))
            raise NimbleError(
                f"nimble_train.Step: {kind} {self._name(i, key)} ({what}) was added to "
                f"{self._name(i)} ({type(self.modules[i]).__name__}) after capture "
                f"({len(added)} {kind}(s) added); a forward that runs the container's contents "
                "would run it, the step's graphs run the model as it was captured, and the "
                "optimizer does not hold it. Add modules and parameters to containers before "
                "the Step's first call, or build a new Step (and "
                "an optimizer over the new model's parameters): step.close(), then "
                "nt.Step(model, optimizer, ...) again. Nothing was run for this call.")

    def tensor_attributes(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) per tensor the modules hold in a plain attribute now."""
        out = []
        for e, (what, i, key) in enumerate(self._what):
            now = _now(self._entries[e][0], key) if what == "tensor" else None
            if isinstance(now, torch.Tensor):
                out.append((self._path(i, key), now))
        return out

    def _refuse_hooks(self) -> None:
        """A hook registered on a module (or on every module) or on a parameter's gradient, or
        removed, since capture: a replay runs no Python, so the graphs run the hooks they were
        captured with. Raised before anything runs; before the first capture, taken (that
        capture runs them), and so is a hook registered on anything else."""
        if not self._tables_changed():
            return
        if self.captured:
            for label, i, table, keys in self._tables[self._hooks_start:self._containers_start]:
                if keys != table.keys():
                    where = (f"{self._name(i)} ({type(self.modules[i]).__name__})" if i >= 0
                             else "every module (torch.nn.modules.module.register_module_*)")
                    _refuse_hook_change(label, where, table, keys)
            for (i, key, p), was in zip(self._params, self._grad_hooks):
                for (label, how), keys, table in zip(_GRAD_HOOKS, was,
                                                     _torch_private.gradient_hook_dicts(p)):
                    table = table or {}
                    if keys != table.keys():
                        _refuse_hook_change(label, f"parameter {self._name(i, key)} ({how})",
                                            table, keys)
        containers = [k for k in self._watch.resized() if k < self._hooks_start]
        if not (self.captured and containers):  # else a key removed: its entry refuses it next
            self._take_tables()

    def replaced_tensors(self) -> list[tuple[dict, str, torch.Tensor, torch.Tensor]]:
        """(module's dict, name, tensor the graphs read, tensor now) for each buffer or tensor
        attribute replaced since capture; refused, before anything changes, when one cannot go
        back there -- except a private tensor attribute, taken as it is."""
        out = []
        for e, what, i, table, key, read, now in self._tensors_changed():
            if _fits(now, read):
                out.append((table, key, read, now))
            elif what == "tensor" and key.startswith("_"):
                self._take(e)
            else:
                seen = ("removed" if now is _MISSING or now is None else
                        f"now {_description(now)}")
                captured = "none" if read is None else describe(read)
                unread = ("" if what == "buffer" else
                          " An attribute the forward does not read can be named with a leading "
                          f"underscore (_{key}): those are taken as they are.")
                refuse_replaced(f"the {what if what == 'buffer' else 'tensor attribute'} "
                                f"{self._name(i, key)}",
                                f"it is {seen} where the graphs read {captured}{unread}")
        return out

    def _tensors_changed(self):
        """(entry, kind, module index, module's dict, name, tensor the graphs read, what the
        dict holds now) per buffer or tensor attribute entry that changed."""
        for e in self._watch.changed(self._modes_end):
            what, i, key = self._what[e]
            if what in ("buffer", "tensor"):
                table, _, read = self._entries[e]
                yield e, what, i, table, key, read, _now(table, key)

    def keep_assigned_tensors(self) -> None:
        """Inside a capture, after the step's forwards: each buffer or tensor attribute they
        assigned anew has its new values copied into the tensor the graphs read (the copy is
        part of the graph), which goes back in its module. A tensor attribute assigned in
        another shape, dtype or device stays as the forward left it; a buffer is an error (the
        capture fails, and undo_capture undoes the assignments)."""
        assigned = []
        for _, what, i, table, key, read, now in self._tensors_changed():
            if _fits(now, read):
                assigned.append((table, key, read, now))
            elif what == "buffer":
                seen = "removed" if now is _MISSING or now is None else _description(now)
                raise NimbleError(
                    f"nimble_train.Step: the forward assigned buffer {self._name(i, key)} anew "
                    f"({seen}) where the graph reads "
                    f"{'none' if read is None else describe(read)}; a captured graph can keep a "
                    "buffer a forward assigns anew only in the same shape, dtype and device. "
                    "Update it in place (self.avg.mul_(0.9).add_(...)), or keep its shape.")
        self.put_back(assigned)

    def undo_capture(self) -> None:
        """After a failed capture: every entry its forwards changed holds its value after the
        last completed call again -- a buffer or tensor attribute assigned anew (a tensor with
        no values: a capture runs nothing) the one the graphs read, untouched; a number its
        value."""
        for e in self._watch.changed(self._modes_end):
            if e != self._hook_count:  # torch's count goes on: handles' ids are never reused
                _put_back(self._entries[e], e in self._items)

    @staticmethod
    def put_back(tensors) -> None:
        """Each replaced tensor's new values go into the tensor the graphs read, which goes
        back in its module."""
        with torch.no_grad():
            for table, key, read, now in tensors:
                read.copy_(now)
                table[key] = read


def hook_change(label: str, table: dict, keys: frozenset) -> tuple[str, str]:
    """What changed in a dict of hooks since capture (`table` now, `keys` its keys then), as
    a refusal says it: what was seen ("a forward hook (f) was registered on"; or removed
    from), and what the graphs do instead."""
    added = [key for key in table if key not in keys]
    if added:
        hook = table[added[0]]
        name = getattr(hook, "__qualname__", type(hook).__name__)
        return f"a {label} ({name}) was registered on", "run without it"
    return (f"a {label} was removed from",
            "run it as they captured it (what it did to tensors, in every replay)")


def retarget(watch, e: int, key: str, table: dict) -> tuple:
    """EntryWatch `watch`'s entry e watches `table` under `key` from now on (one it lacks, a
    table of its own that never changes: the number a config no longer holds); returns the
    entry, (table, key, value)."""
    table = table if key in table else {key: _MISSING}
    watch.retarget(e, table)
    return (table, key, kept(table[key]))


def _refuse_hook_change(label: str, where: str, table: dict, keys: frozenset) -> None:
    """Raises the refusal of a hook registered on (or removed from) `where` since capture:
    `table` the dict of its hooks now, `keys` its keys then."""
    seen, effect = hook_change(label, table, keys)
    raise NimbleError(
        f"nimble_train.Step: {seen} {where} after capture; a replay runs no Python, so the step's "
        f"graphs {effect}. Register and remove hooks before the Step's first call (a hook in "
        "place then runs in the capture, and the graphs replay what it does to tensors), or "
        "build a new Step: step.close(), then nt.Step(model, optimizer, ...) again. Nothing "
        "was run for this call.")


def _put_back(entry: tuple, numbers: bool = False) -> None:
    """The dict or closure cell of an EntryWatch entry holds its value again; for a numbers'
    entry (`numbers`: its value a copy of a list, kept's) a list there takes the copy's items
    in place (the same list, which others may hold)."""
    table, key, value = entry
    if numbers and type(value) is list and type(now := _now(table, key)) is list:
        now[:] = value
    elif isinstance(table, types.CellType):
        table.cell_contents = value
    else:
        table[key] = value


def _holds_numbers(value: object) -> bool:
    """A plain object whose attributes code reads numbers from: a config (a dataclass, a
    SimpleNamespace, argparse's Namespace, a transformers config), or an object of a class of
    the user's that may be callable (``self.noise(x)``, its ``__call__`` reading its
    ``sigma``); not a module or tensor, nor a function or method (whose classes are Python's;
    a class's __dict__ is no dict)."""
    return (isinstance(getattr(value, "__dict__", None), dict)
            and not isinstance(value, (torch.Tensor, torch.nn.Module, types.ModuleType))
            and (not callable(value) or not _installed(type(value).__module__)))


def replaced_holder(now: object, held: list[tuple[str, object]]
                    ) -> tuple[str, str, object] | None:
    """An object holding numbers a module's code reads replaced by `now`: (what was seen, the
    number's name, its captured value) for the first of `held` ((name, captured value) each)
    that `now` does not hold equal; None when it holds them all."""
    numbers = number_table(now)
    for name, was in held:
        value = numbers.get(name, _MISSING)
        if not _same_value(value, was):
            return ("removed" if now is _MISSING or now is None else
                    f"replaced by a {type(now).__name__} " + (
                        f"whose {name!r} is {value!r}" if value is not _MISSING else
                        f"that holds no number {name!r}"), name, was)
    return None


def _held_numbers(module: torch.nn.Module, key: str, value: object) -> list[str]:
    """The public numbers held in `value`, the module's attribute `key`, that the module's
    class's own code names (names_read: ``self.cfg.drop_rate``), or, `value`'s class being
    the user's, that its methods the module's code calls name (``self.noise(x)``: its
    ``__call__``; ``self.noise.scaled(x)``), when the module's class is the user's (an
    installed package's modules read their configs as they were built)."""
    if key.startswith("_") or not _holds_numbers(value) or _installed(type(module).__module__):
        return []
    names = names_read(type(module))
    if key not in names:
        return []
    held = type(value)
    if not _installed(held.__module__):
        called = tuple(sorted(name for name in names
                              if isinstance(inspect.getattr_static(held, name, None),
                                            types.FunctionType)))
        names = names | _own_code(held, ("__call__",) * callable(value) + called)[0]
    return [name for name, number in vars(value).items()
            if name in names and not name.startswith("_") and is_number(number)]


def _fits(now: object, read: object) -> bool:
    """`now` can go where the graphs read `read`: a tensor of its shape, dtype and device."""
    return (isinstance(now, torch.Tensor) and isinstance(read, torch.Tensor)
            and (now.shape, now.dtype, now.device) == (read.shape, read.dtype, read.device))


def _description(value: object) -> str:
    return describe(value) if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"


def _now(table, key):
    """What a dict (a class's own) holds under key, a list at index key, or a closure cell
    holds; _MISSING when none."""
    if isinstance(table, type):
        return vars(table).get(key, _MISSING)
    if isinstance(table, types.CellType):
        try:
            return table.cell_contents
        except ValueError:  # an empty cell: the variable was deleted
            return _MISSING
    if isinstance(table, list):
        return table[key] if key < len(table) else _MISSING
    return table.get(key, _MISSING)


# The methods of a module's that run in a step: its forward, and a LightningModule's steps.
_ROOTS = ("forward", "training_step", "validation_step")
# Library code: the methods of these packages' classes are not followed (Module.__call__ or
# LightningModule.log name attributes of their own).
_LIBRARIES = ("torch.", "lightning.", "pytorch_lightning.")
# Where installed packages and the standard library live: a plain function defined there is
# library code, whose globals user code does not set.
_INSTALLED = tuple({os.path.join(os.path.realpath(path), "") for path in (
    *(sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    *getattr(site, "getsitepackages", list)(), site.getusersitepackages()) if path})


@functools.cache
def _installed(module_name: str | None) -> bool:
    """Whether a module is an installed package's or the standard library's."""
    path = getattr(sys.modules.get(module_name or ""), "__file__", None)
    if path is None:  # a notebook's __main__ is user code; a frozen module the standard library's
        return (module_name or "").partition(".")[0] in sys.stdlib_module_names
    return os.path.realpath(path).startswith(_INSTALLED)


def _ours(module_name: str | None) -> bool:
    """Whether a module is nimble_train's own (its integrations' wrappers: the drop-in
    Trainer's loss module holding the Trainer), a library to the code it runs, wherever it is
    installed from."""
    return (module_name or "").partition(".")[0] == __name__.partition(".")[0]


def _helpers(fn: types.FunctionType) -> list[types.FunctionType]:
    """The plain functions fn's code (nested functions included) names as globals of its
    module (helpers it calls: ``return _scaled(x)``), those of installed packages aside."""
    out = []
    for name in global_names(fn.__code__):
        helper = fn.__globals__.get(name)
        if isinstance(helper, types.FunctionType):
            helper = inspect.unwrap(helper)
            if isinstance(helper, types.FunctionType) and not _installed(helper.__module__):
                out.append(helper)
    return out


@functools.cache
def _own_code(cls: type, roots: tuple[str, ...] = _ROOTS
              ) -> tuple[frozenset[str], tuple[types.FunctionType, ...]]:
    """The names a module class's own code run in a step names, and those functions: its
    forward (and a LightningModule's training_step and validation_step; or other `roots`),
    the methods of the class those call by name and the plain functions they call as globals
    (_helpers), followed through, with the functions nested in them (comprehensions,
    closures); library classes' methods not followed."""
    names: set[str] = set()
    todo, seen = [getattr(cls, name, None) for name in roots], {}
    while todo:
        fn = todo.pop()
        fn = inspect.unwrap(fn) if callable(fn) else fn
        if (not isinstance(fn, types.FunctionType) or fn in seen
                or (fn.__module__ or "").startswith(_LIBRARIES)):
            continue
        seen[fn] = None
        found = code_names(fn.__code__).keys()
        todo += [getattr(cls, name, None) for name in found - names] + _helpers(fn)
        names |= found
    return frozenset(names), tuple(seen)


@functools.cache
def reads_mode(cls: type) -> bool:
    """Whether a module class's forward may compute otherwise in another training mode: the
    code of its class's methods and its bases' (torch's included, nn.Module's own aside) or
    the user functions it calls (_own_code) names ``training`` (a dropout, a batch norm,
    ``F.dropout(x, p, self.training)``); a loss's, a container's or a linear layer's does not."""
    for klass in cls.__mro__:
        if klass in (torch.nn.Module, object):
            continue
        for value in vars(klass).values():
            value = value.fget if isinstance(value, property) else getattr(
                value, "__func__", value)
            if (isinstance(value, types.FunctionType)
                    and "training" in code_names(value.__code__)):
                return True
    return "training" in names_read(cls)


def watched_attributes(module: torch.nn.Module) -> tuple[list[str], list[str], list[str]]:
    """The keys of a module's attributes a graph bakes in as they are: its constants (those of
    its class's ``__constants__`` it holds); then, of the plain attributes its forward reads (a
    leaf's public ones, or a parent's that its own code names: names_read; a counter user code
    keeps on the model is not), its numbers, and those that hold None (an optional class
    weight, a focal loss's ``alpha``: the graphs run the forward's code for None)."""
    attributes = vars(module)
    constants = [key for key in getattr(type(module), "__constants__", ()) if key in attributes]
    named = None if not module._modules else names_read(type(module))
    read = [key for key, value in attributes.items()
            if not key.startswith("_") and key != "training" and key not in constants
            and (named is None or key in named)]
    return (constants, [key for key in read if is_number(attributes[key])],
            [key for key in read if attributes[key] is None])


def names_read(cls: type) -> frozenset[str]:
    """The attribute names a module class's own code names (_own_code): the numbers of a
    module with children that are watched."""
    return _own_code(cls)[0]


def code_numbers(cls: type) -> list[tuple[str, object, str]]:
    """("closure", cell, name) and ("global", globals, name) for each number a module class's
    own code (_own_code) reads from its closure (a class made in a function: ``def
    make(p): class Block(nn.Module): ...``, its forward reading p) or as a global of its
    module."""
    return [entry for fn in _own_code(cls)[1] for entry in _numbers_in_scope(fn)]


def code_tensors(cls: type) -> list[tuple[str, object, str]]:
    """The same for each tensor (a mask its forward reads as a global)."""
    return [entry for fn in _own_code(cls)[1] for entry in _tensors_in_scope(fn)]


def _in_scope(fn: types.FunctionType) -> list[tuple[str, object, str]]:
    """("closure", cell, name) and ("global", globals, name) for each name fn reads from its
    closure or its module's globals."""
    code = fn.__code__
    scope = [("closure", cell, name)
             for name, cell in zip(code.co_freevars, fn.__closure__ or ())]
    return scope + [("global", fn.__globals__, name) for name in global_names(code)]


def _numbers_in_scope(fn: types.FunctionType) -> list[tuple[str, object, str]]:
    """Those of _in_scope that hold a number (is_number: a bool, int, float or str, or a tuple
    or list of them)."""
    return [(kind, table, name) for kind, table, name in _in_scope(fn)
            if is_number(_now(table, name))]


def _tensors_in_scope(fn: types.FunctionType) -> list[tuple[str, object, str]]:
    """Those of _in_scope that hold a tensor (not a parameter: a module's, watched as such)."""
    return [(kind, table, name) for kind, table, name in _in_scope(fn)
            if _is_plain_tensor(_now(table, name))]


def _is_plain_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """A function's code and its nested functions' (comprehensions, lambdas, closures)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def code_names(code: types.CodeType) -> dict[str, None]:
    """The names a function's code, nested functions included, reads as attributes or globals
    (co_names), in order."""
    return dict.fromkeys(name for c in _codes(code) for name in c.co_names)


_GLOBAL_OPS = ("LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL")


@functools.cache
def global_names(code: types.CodeType) -> dict[str, None]:
    """The names a function's code, nested functions included, uses as globals (not an
    attribute of the same name), in order."""
    return dict.fromkeys(op.argval for c in _codes(code) for op in dis.get_instructions(c)
                         if op.opname in _GLOBAL_OPS)


def scope_numbers(fn: object) -> list[tuple[str, object, str]]:
    """("closure", cell, name) and ("global", globals, name) for each number (bool, int,
    float, str) a function (a loss function, an evaluator's fn) reads by name from its closure
    or its module's globals, and the plain functions it calls as globals (_helpers, followed
    through) from theirs; none for a module (watched as one) or any other callable."""
    return _scope_of(fn, _numbers_in_scope)


def scope_tensors(fn: object) -> list[tuple[str, object, str]]:
    """The same for each tensor (a class weight a loss function reads as a global)."""
    return _scope_of(fn, _tensors_in_scope)


def _scope_of(fn: object, found: Callable) -> list[tuple[str, object, str]]:
    out, watched = [], set()
    for fn in _scope_functions(fn):
        for kind, table, name in found(fn):
            if (id(table), name) not in watched:
                watched.add((id(table), name))
                out.append((kind, table, name))
    return out


def _scope_functions(fn: object) -> list[types.FunctionType]:
    """A function (a partial's, a bound method's; or each of a tuple of them) and the helpers
    it calls (_helpers), followed through: the code whose scope the graphs read."""
    todo, seen = [], {}
    for root in fn if isinstance(fn, tuple) else (fn,):
        root = root.func if isinstance(root, functools.partial) else root
        root = getattr(root, "__func__", root)  # a bound method: its function
        if isinstance(root, types.FunctionType):
            todo.append(root)
    while todo:
        fn = todo.pop(0)
        if fn not in seen:
            seen[fn] = None
            todo += _helpers(fn)
    return list(seen)


def scope_holders(fn: object) -> list[tuple[str, object, str, list[tuple[dict, str, str]]]]:
    """The configs a function of the user's reads numbers through, by name from its scope (as
    scope_numbers, helpers followed): a dict (``cfg["alpha"]``: the string keys its code holds
    as constants) or a plain object (_holds_numbers: ``args.smoothing``, the attributes its
    code names). Per config: ("closure" or "global", the cell or globals, its name, and per
    number read (the dict holding it, its key, its name: ``cfg['alpha']``, ``args.smoothing``))."""
    # the user's code: an installed package's function's globals are its own business
    return _holders([f for f in _scope_functions(fn) if not _installed(f.__module__)])


def code_holders(cls: type) -> list[tuple[str, object, str, list[tuple[dict, str, str]]]]:
    """The same for a module class's own code (_own_code), when the class is the user's:
    ``F.dropout(x, CFG["p"])`` in its forward, ``CFG`` a global of its module."""
    if _installed(cls.__module__):
        return []
    return _holders([f for f in _own_code(cls)[1] if not _installed(f.__module__)])


def _holders(functions: list[types.FunctionType]
             ) -> list[tuple[str, object, str, list[tuple[dict, str, str]]]]:
    codes = [code for f in functions for code in _codes(f.__code__)]
    attributes = {name for code in codes for name in code.co_names}
    keys = {c for code in codes for c in code.co_consts if isinstance(c, str)}
    scope = {(id(table), name): (kind, table, name) for f in functions
             for kind, table, name in _in_scope(f)}
    out = []
    for kind, table, name in scope.values():
        holder = _now(table, name)
        if isinstance(holder, dict):
            numbers = [(holder, key, item_name(name, key)) for key, value in holder.items()
                       if isinstance(key, str) and key in keys and is_number(value)]
        elif _holds_numbers(holder) and _config_like(holder):
            numbers = [(vars(holder), key, f"{name}.{key}") for key, value in vars(holder).items()
                       if key in attributes and not key.startswith("_")
                       and is_number(value)]
        else:
            continue
        if numbers:
            out.append((kind, table, name, numbers))
    return out


def _config_like(holder: object) -> bool:
    """An object read by name whose attributes may be a config's: a namespace (argparse's,
    SimpleNamespace), a dataclass, or an object of a class of the user's -- not another
    installed package's object (a logger), whose attributes are its own business."""
    return (isinstance(holder, (argparse.Namespace, types.SimpleNamespace))
            or dataclasses.is_dataclass(holder) or not _installed(type(holder).__module__))


def number_table(holder: object) -> dict:
    """Where a config holds its numbers: a dict itself, a plain object's attributes; none for
    anything else."""
    return holder if isinstance(holder, dict) else vars(holder) if _holds_numbers(holder) else {}


def named_scope_modules(fn: object) -> list[tuple[str, torch.nn.Module]]:
    """The modules a function (a loss function) reads by name from its scope (as
    scope_numbers finds numbers, helpers followed), or holds as a partial's argument, a bound
    method's object or that object's attribute (``self.features`` in a method of a plain
    object): a GAN's discriminator in its generator's loss, the frozen network a perceptual
    loss runs; their parameters and buffers are tensors the graphs read. Each with the name
    the function reads it under (a partial's argument: ``args[0]``, or its keyword; a bound
    method's module: ``self``; one held deeper: ``nets['gan']['critic']``, ``cfg.critic``:
    _reach)."""
    owner = getattr(fn, "__self__", None)
    found = [("self", owner)] if isinstance(owner, torch.nn.Module) else []
    names = _reading_names(fn)
    if isinstance(fn, functools.partial):
        args = [(f"args[{i}]", value) for i, value in enumerate(fn.args)]
        for name, value in args + list(fn.keywords.items()):
            found += _reach(value, name, names).modules
    for _, table, name, depth in _name_roots(fn):
        found += _reach(_now(table, name), name, names, depth).modules
    modules = {}
    for label, module in found:
        modules.setdefault(id(module), (label, module))
    return list(modules.values())


def _module_items(value: object) -> list[tuple[object, torch.nn.Module]]:
    """(key or index, module) per module a dict, list or tuple holds itself; none for anything
    else."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return []
    return [(key, item) for key, item in items if isinstance(item, torch.nn.Module)]


def item_name(name: str, key: object) -> str:
    return f"{name}[{key!r}]"


# How far a value read by name is followed to the modules it holds, through dicts, lists,
# tuples and configs (nets["gan"]["critic"], cfg.nets.critic); how many items of one are
# looked into below its own modules (a dataset's samples, a vocabulary: no modules there), and
# how many in all below one name.
_REACH_DEPTH = 3
_REACH_ITEMS = 4096
_REACH_VISITS = 1 << 16


class Reach(NamedTuple):
    """What a value read by name holds that the graphs run (_reach): the modules, (their name
    from it: ``nets['gan']['critic']``, the module) each; each step below the name on the way
    to one, (the dict or list, or the config's attributes; the key there; its name) each; and
    the dicts and lists on the way, (it, its name) each, whose numbers of items are watched."""

    modules: list[tuple[str, torch.nn.Module]]
    edges: list[tuple[object, object, str]]
    containers: list[tuple[object, str]]


def _reach(value: object, name: str, names: Container[str] | None,
           depth: int = _REACH_DEPTH) -> Reach:
    """The value itself when a module; else the modules a dict, list or tuple holds (every
    item: a loop runs them all) or a config (_config_items) holds under the attributes in
    `names` (those the reading code names; None: every one), followed through such holders
    `depth` levels down (_REACH_ITEMS, _REACH_VISITS bound the search). A tuple's items cannot
    be replaced: no step into one is an edge."""
    visits = [_REACH_VISITS]

    def reach(value: object, name: str, depth: int) -> Reach:
        out = Reach([], [], [])
        if isinstance(value, torch.nn.Module):
            out.modules.append((name, value))
            return out
        if depth == 0 or visits[0] <= 0:
            return out
        if isinstance(value, (dict, list, tuple)):
            table, label = value, lambda key: item_name(name, key)
            items = list(value.items() if isinstance(value, dict) else enumerate(value))
        elif (items := _config_items(value, names)) is not None:
            table, label = vars(value), lambda key: f"{name}.{key}"
        else:
            return out
        deep = len(items) <= _REACH_ITEMS
        for key, item in items:
            if not (deep or isinstance(item, torch.nn.Module)):
                continue
            visits[0] -= 1
            found = reach(item, label(key), depth - 1)
            if found.modules:
                if not isinstance(value, tuple):
                    out.edges.append((table, key, label(key)))
                for part, more in zip(out, found):
                    part.extend(more)
        if out.modules and isinstance(value, (dict, list)):
            out.containers.insert(0, (value, name))
        return out

    return reach(value, name, depth)


def _config_items(value: object, names: Container[str] | None
                  ) -> list[tuple[str, object]] | None:
    """The attributes in `names` (None: every one) of a config (a namespace, a dataclass, an
    object of the user's: _config_like; not a module, dict, list or tuple, nor an object of
    nimble_train's), as (key, value) each; None for anything else."""
    if (isinstance(value, (torch.nn.Module, dict, list, tuple)) or not _holds_numbers(value)
            or not _config_like(value) or _ours(type(value).__module__)):
        return None
    return [(key, item) for key, item in vars(value).items() if names is None or key in names]


def scope_reach(fn: object) -> Reach:
    """What the names a function reads modules under (scope_module_names) hold on the way to
    them (_reach): the steps below each name, and the dicts and lists, once each."""
    names, out, edges, containers = _reading_names(fn), Reach([], [], []), set(), set()
    for _, table, name, depth in _name_roots(fn):
        found = _reach(_now(table, name), name, names, depth)
        out.edges.extend(e for e in found.edges if (id(e[0]), e[1]) not in edges)
        edges.update((id(e[0]), e[1]) for e in found.edges)
        out.containers.extend(c for c in found.containers if id(c[0]) not in containers)
        containers.update(id(c[0]) for c in found.containers)
    return out


# What every module holds in its __dict__ (its dicts of children, parameters and hooks): never
# a hidden module's holder.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def hidden_modules(module: torch.nn.Module) -> list[tuple[str, Reach]]:
    """The modules a module of the user's holds without registering them, under attributes its
    own code names (names_read): one set past registration (``object.__setattr__``), a list,
    tuple or dict of them (``self._teacher = [teacher]``, kept out of the state_dict), or a
    config holding them under names the code reads; followed as _reach follows. Per
    attribute: (its key, what it holds on the way to them, named from the attribute:
    ``_teacher[0]``)."""
    cls = type(module)
    if _installed(cls.__module__) or _ours(cls.__module__):
        return []
    names, out = names_read(cls), []
    for key, value in vars(module).items():
        if key not in _MODULE_INTERNALS and key in names:
            found = _reach(value, key, names)
            if found.modules:
                out.append((key, found))
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def scope_module_names(fn: object) -> list[tuple[str, object, str]]:
    """("closure", cell, name), ("global", globals, name) and ("attribute", the object's
    dict, name) for each name a function reads a module under, or a dict, list, tuple or
    config holding modules (_reach): from its scope (helpers followed), or as an attribute of
    the plain object it is a method of."""
    names = _reading_names(fn)
    return [(kind, table, name) for kind, table, name, depth in _name_roots(fn)
            if _reach(_now(table, name), name, names, depth).modules]


def _name_roots(fn: object) -> list[tuple[str, object, str, int]]:
    """(kind, table, name, how deep _reach follows it) per name a function reads from: the
    attributes of the plain object it is a method of that its code names (every one, one level
    deep, when that code is a library's), and the names it reads from its scope, helpers
    followed (one level deep for an installed package's function: its globals are its own)."""
    out, seen = [], set()
    owner, names = _owner_code(fn)
    if owner is not None:
        out += [("attribute", vars(owner), key, _REACH_DEPTH if names is not None else 1)
                for key in vars(owner) if names is None or key in names]
    for f in _scope_functions(fn):
        depth = 1 if _installed(f.__module__) else _REACH_DEPTH
        for kind, table, name in _in_scope(f):
            if (id(table), name) not in seen:
                seen.add((id(table), name))
                out.append((kind, table, name, depth))
    return out


def _reading_names(fn: object) -> frozenset[str]:
    """The attribute names the user's code a function runs names (its helpers', and the
    methods' of the plain object it is a method of): the configs' attributes _reach follows."""
    names = {name for f in _scope_functions(fn) if not _installed(f.__module__)
             for name in code_names(f.__code__)}
    return frozenset(names | (_owner_code(fn)[1] or set()))


def _owner_code(fn: object) -> tuple[object | None, frozenset[str] | None]:
    """The plain object (not a module, class or Python module) a bound method belongs to, and
    the names the method's code (and the methods of its class it calls, _own_code) names;
    None for those names when that code is a library's, which is not looked into."""
    owner = getattr(fn, "__self__", None)
    if (not hasattr(owner, "__dict__") or isinstance(owner, (types.ModuleType, type))
            or isinstance(owner, torch.nn.Module)):
        return None, None
    method = getattr(fn, "__func__", None)
    names, followed = (_own_code(type(owner), (method.__name__,))
                       if isinstance(method, types.FunctionType) else (frozenset(), ()))
    return owner, names if followed else None


def scope_entry(kind: str, table: object, key: str) -> tuple:
    """The EntryWatch entry of one of scope_numbers: (cell, None, value) or (globals, name,
    value); or of a step below a name (scope_reach): (the dict or list, key or index,
    value)."""
    return (table, None if kind == "closure" else key, _now(table, key))


def scope_name(owner: str, kind: str, key: str) -> str:
    return (f"{owner}'s closure variable {key!r}" if kind == "closure" else
            f"the attribute {key!r} of the object {owner} is a method of"
            if kind == "attribute" else f"the attribute {key!r} that {owner} reads"
            if kind == "member" else f"the module at {key} that {owner} reads"
            if kind == "item" else f"the number {key} that {owner} reads"
            if kind == "held" else f"the global {key!r} that {owner} reads")


def warn_replays_keep(changed: list[tuple[str, object, object]], warned: set[str],
                      where: str) -> None:
    """Warns, once per number, that a capture's forwards changed numbers (a module counting its
    calls, `changed` from after_forward or after_call) which the replays, running no Python,
    leave as they are; `warned` holds the names warned of."""
    new = [(name, was, now) for name, was, now in changed if name not in warned]
    if not new:
        return
    warned.update(name for name, _, _ in new)
    listed = "; ".join(f"{name} from {was!r} to {now!r}" for name, was, now in new)
    warn_at_user(
        f"nimble_train.Step: {where} changed {listed}; a replay runs no Python, so the "
        "replays leave it as it is now, where eager calls would change it at every call (it "
        "changes only in calls that run eagerly or capture). To have it change at every step, "
        "keep it in a tensor the forward updates in place (a buffer: self.calls.add_(1)), or "
        "change it outside the model, after each call.")


def refuse_scope_object(owner: str, kind: str, key: str, old: object, now: object,
                        rebuild: str) -> None:
    """Raises the error for a name `owner` reads a tensor or a module under (kind: one of
    _SCOPE_TENSORS or _SCOPE_MODULES; a dict, list or tuple of modules too, or an item of
    one) that holds another object after capture."""
    where = scope_name(owner, kind.split()[0], key)
    if kind in _SCOPE_TENSORS:
        seen = ("was deleted" if now is _MISSING else
                "was given another tensor" if isinstance(now, torch.Tensor) else
                f"was given a {type(now).__name__}")
        held, fix = (f"a tensor ({_description(old)}); the graphs read the tensor they were "
                     "captured with", f"Change its values in place (with torch.no_grad(): "
                     f"{key}.copy_(new))")
    else:
        seen = ("was deleted" if now is _MISSING else
                f"was given another {type(now).__name__}" if type(now) is type(old) else
                f"was given a {type(now).__name__}")
        if isinstance(old, torch.nn.Module):
            held, fix = (f"a {type(old).__name__}; the graphs run the module they were "
                         f"captured with", f"Load new weights into that module in place "
                         f"({key}.load_state_dict(state))")
        else:  # a dict, list or tuple of modules, or a config holding them
            labels = [label for label, _ in _reach(old, key, None).modules]
            held = (f"a {type(old).__name__} "
                    f"{'of modules' if _module_items(old) else 'holding modules'}; the graphs "
                    f"run the modules it held then")
            fix = ("Load new weights into its modules in place"
                   + (f" ({labels[0]}.load_state_dict(state))" if labels else ""))
    raise NimbleError(
        f"nimble_train.Step: {where} {seen} after capture, where it held {held}, whatever the "
        f"name holds now. {fix}, or {rebuild}. Nothing was run for this call.")


def refuse_resized_container(owner: str, container: object, name: str, size: int,
                             rebuild: str) -> None:
    """Raises the error for a dict or list `owner` reads modules through (scope_reach) that
    holds another number of items than at capture (`size`)."""
    now = len(container)
    raise NimbleError(
        f"nimble_train.Step: the {type(container).__name__} {name!r} that {owner} reads holds "
        f"{now} item(s) after capture, where it held {size}; the graphs run the modules it held "
        f"then, whatever it holds now. Fill such a {type(container).__name__} before the first "
        f"capture, or {rebuild}. Nothing was run for this call.")


def refuse_replaced_config(owner: str, kind: str, key: str, seen: str, name: str, was: object,
                           rebuild: str) -> None:
    """Raises the error for a config `owner` reads numbers through (scope_holders) that its
    name holds anew after capture, with another value of a number read (replaced_holder's
    `seen`, `name`, `was`)."""
    raise NimbleError(
        f"nimble_train.Step: {scope_name(owner, kind, key)} was {seen} after capture, where the "
        f"graphs were captured with {name!r} {was!r} (the Python numbers a function reads are "
        f"baked into a CUDA graph). Set it back, or {rebuild}. Nothing was run for this call.")


def refuse_scope_change(owner: str, kind: str, key: str, old: object, now: object,
                        rebuild: str) -> None:
    """Raises the error for a number `owner` reads from its scope that changed after capture."""
    where = scope_name(owner, kind, key)
    seen = "was deleted" if now is _MISSING else f"changed from {old!r} to {now!r}"
    raise NimbleError(
        f"nimble_train.Step: {where} {seen} after capture; the graphs run the value they were "
        "captured with (the Python numbers a function reads are baked into a CUDA graph). To "
        "change it as training goes (a schedule), keep it in a tensor the function reads and "
        f"update that in place (t.fill_(v)), or {rebuild}. Nothing was run for this call.")


class ScopeWatch:
    """The numbers a function (or each of a tuple of functions: a module class's own code)
    reads from its scope (scope_numbers), as when its graphs were
    captured: another value is refused, an equal one taken, one the function changes itself
    taken after each call (after_call). And the tensors and modules it reads there by name
    (scope_tensors, scope_module_names), by identity: another object under the name is
    refused, one the function assigns itself taken; so is another object at a step below a
    name it reads modules through (scope_reach: losses[1], cfg.critic), or another number of
    items in a dict or list on the way; and the numbers it
    reads through a config (scope_holders: ``args.smoothing``, ``cfg["alpha"]``) by value,
    the config under its name by identity (another one with equal numbers is taken)."""

    def __init__(self, fn: object, owner: str, rebuild: str):
        self._owner, self._rebuild = owner, rebuild
        reach = scope_reach(fn)
        self._containers, items = reach.containers, reach.edges
        self._what = [*scope_numbers(fn),
                      *[(kind + " tensor", table, key) for kind, table, key in scope_tensors(fn)],
                      *[(kind + " module", table, key)
                        for kind, table, key in scope_module_names(fn)]]
        # per entry, the name it is said by: an item's losses[1], a config's number's
        # args.smoothing
        self._labels = [key for _, _, key in self._what]
        self._what += [("item module", container, key) for container, key, _ in items]
        self._labels += [name for _, _, name in items]
        self._held: dict[int, list[int]] = {}  # per config's entry, its numbers' entries
        for kind, table, name, numbers in scope_holders(fn):
            holder = len(self._what)
            self._what.append((kind + " holder", table, name))
            self._labels.append(name)
            self._what += [("held", held, key) for held, key, _ in numbers]
            self._labels += [label for _, _, label in numbers]
            self._held[holder] = list(range(holder + 1, len(self._what)))
        entries = [scope_entry(kind.split()[0], table, key) for kind, table, key in self._what]
        # the numbers' entries: a list there is compared by its items, from a copy
        self._items = frozenset(e for e, (kind, _, _) in enumerate(self._what)
                                if kind in ("closure", "global", "held"))
        self._entries = kept_entries(entries, self._items)
        self._sizes = [len(container) for container, _ in self._containers]
        self._watch = _C.EntryWatch(entries, [c for c, _ in self._containers],
                                    sorted(self._items))

    def check(self) -> None:
        """Raised before anything runs."""
        if self._watch.first_changed() < 0:
            return
        for e in self._watch.changed():
            kind, table, key = self._what[e]
            old, now = self._entries[e][2], _now(table, key)
            if kind in _SCOPE_HOLDERS:
                unequal = replaced_holder(now, [self._entries[n][1:] for n in self._held[e]])
                if unequal:
                    refuse_replaced_config(self._owner, kind.split()[0], key, *unequal,
                                           self._rebuild)
                continue  # an equal config: taken below
            if kind in _SCOPE_TENSORS + _SCOPE_MODULES:
                refuse_scope_object(self._owner, kind, self._labels[e], old, now, self._rebuild)
            if not _same_value(now, old):
                refuse_scope_change(self._owner, kind.split()[0], self._labels[e], old, now,
                                    self._rebuild)
        for k in self._watch.resized():
            container, name = self._containers[k]
            refuse_resized_container(self._owner, container, name, self._sizes[k], self._rebuild)
        self.after_call()  # equal values in new objects: the fast path again

    def _retarget(self, holder: int, numbers: dict) -> None:
        """The numbers of config entry `holder` are watched in `numbers` from now on."""
        for n in self._held[holder]:
            self._entries[n] = retarget(self._watch, n, self._what[n][2], numbers)
            self._what[n] = ("held", self._entries[n][0], self._what[n][2])

    def put_back(self) -> None:
        """After a failed capture: the numbers the function changed itself, as after the last
        completed call."""
        for e in self._watch.changed():
            _put_back(self._entries[e], e in self._items)

    def after_call(self) -> list[tuple[str, object, object]]:
        """The numbers the function changed itself are taken; returns those that took another
        value: (name, was, now) each."""
        changed = []
        for e in self._watch.changed():
            kind, table, key = self._what[e]
            now = _now(table, key)
            if now is not _MISSING:
                was = self._entries[e][2]
                if (kind not in _SCOPE_TENSORS + _SCOPE_MODULES + _SCOPE_HOLDERS
                        and not _same_value(now, was)):
                    changed.append((scope_name(self._owner, kind.split()[0], self._labels[e]),
                                    was, now))
                self._watch.update(e)
                entry = scope_entry(kind.split()[0], table, key)
                self._entries[e] = (*entry[:2], kept(now)) if e in self._items else entry
                if e in self._held:  # its numbers, in the config it holds now
                    self._retarget(e, number_table(now))
        self._watch.take_sizes()  # modules the function put in its dicts or lists itself
        self._sizes = [len(container) for container, _ in self._containers]
        return changed


def _same_value(now: object, old: object, same_type: bool = True) -> bool:
    """A watched number (or mode) set again to an equal value in a new object: taken as the
    captured one. A number must keep its type too, a tuple's or list's items theirs (an int where
    a float was is another value for the graphs' kernels); a mode need not (training = 1)."""
    return now is not _MISSING and _equal(now, old) and (not same_type or same(now, old))


def _equal(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- a value whose == is not a truth (an array): not equal
        return False
