"""step.evaluator(fn): an evaluation step, captured into the Step's pool and replayed.

``ev = step.evaluator(fn)``; ``out = ev(batch)`` runs ``fn(model, batch)`` with the model in
eval mode (every module's own mode restored after), autograd off and the Step's autocast, and
returns its tensor or dict of tensors. Once the Step replays its training graphs (its
parameters then keep their addresses: flat buffers or the user's tensors), the evaluator
captures ``fn`` into the Step's private pool, a graph per bucket (all of them at its first
call, largest first, as training does), and each later full batch is a copy-in and one replay.
The graph reads the weights where training writes them: no copies, and inside
``step.ema_weights()`` it evaluates the EMA weights.

The outputs are fresh device tensors (copies of the graph's outputs, which the next replay
overwrites), so they can be summed on the device or kept; nothing waits for the device. A
batch with fewer samples than the evaluator's first (the last one of a validation set), the
calls before the Step replays, and the CPU run eagerly with the same semantics (with buckets,
on the batch padded to its bucket). A bucket whose capture fails runs eagerly once (cuDNN or a
compiler meets its shapes) and is captured again; failing then, it stays eager, with a warning.
With a compiled model each bucket runs eagerly once before its capture (dynamo compiles the
model anew for eval mode), on static inputs like the graph's. The numbers ``fn`` reads by name
from its closure or its module's globals (a threshold) are baked into its graphs: from its
first capture on, another value is refused (_model_watch.ScopeWatch), and so is another tensor
or module under a name it reads one by. The modules it reads there besides the model (an
averaged copy the user keeps, ``lambda m, b: ema(b[0])``; a teacher) are run by its graphs as
they were at capture (ScopeModules): a mode or a number changed (one its code reads from a
config it holds too), a child module, parameter or buffer replaced, a module added to a
container, a forward hook registered or removed, or a number their classes' own code reads
from its scope (a global), is refused; a parameter's or buffer's data replaced (``p.data =
t``) goes back where the graphs read it, its values copied there.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from . import _options
from ._batch import BatchTemplate
from ._buckets import BucketLayout
from ._extension import _C
from ._iteration import autocast_name
from ._model_watch import (_CONTAINERS, _HOOKS, _MISSING, ScopeWatch, _held_numbers, _now,
                           _own_code, _put_back, _same_value, describe, hook_change,
                           kept_entries, named_scope_modules, number_table, replaced_holder,
                           retarget, take, warn_replays_keep, watched_attributes)
from ._optimizer_state import shown
from ._padding import BucketPadding
from ._sync import warn_at_user
from .errors import NimbleError
from .optim.fused import in_flat_buffers


class Evaluator:
    """An evaluation step of a Step's model (see the module's docstring)."""

    def __init__(self, step, fn: Callable[[torch.nn.Module, Any], Any]):
        if not callable(fn):
            raise TypeError(f"step.evaluator(fn): fn must be callable as fn(model, batch) and "
                            f"return a tensor or a dict of tensors; got {fn!r}")
        self._step, self.fn = step, fn
        self._template: BatchTemplate | None = None
        self._layout: BucketLayout | None = None
        self._inputs: list | None = None   # per bucket _C.StaticInputs for eager calls
        self._entries: list[int | None] = []  # per bucket its graph's entry in the Step's graph
        self._met: set[int] = set()          # buckets an eager call ran on
        self._deferred: set[int] = set()     # capture failed unmet: an eager call, then again
        self._eager_only: dict[int, str] = {}  # capture failed once met too: why
        self.counts = {"replays": 0, "eager": 0, "captures": 0}
        self._scope: ScopeWatch | None = None  # fn's numbers, from its first capture on
        self._reads: ScopeModules | None = None  # and the modules it reads from its scope
        self._autocast: tuple | None = None  # the autocast its graphs were captured under
        # With buckets: the first padded batch's outputs with and without the padding
        # (_padding.BucketPadding, made with the layout).
        self._padding: BucketPadding | None = None

    def __call__(self, batch: Any) -> Any:
        step = self._step
        step._require_open("evaluator")
        step._check_kernel_settings()  # its graphs' kernels were chosen by them too
        self._check_autocast()
        # Data replaced since capture goes where the graphs (this one's too) read it first.
        step._settle_model(training=False)
        if self._scope is not None:
            self._scope.check()
        if self._reads is not None and self._reads.settle():
            self._drop_graphs()  # they read tensors another step's update moved, where they were
        if self._template is None:
            self._start(batch)
        template = self._template
        tensors = template.tensors(batch)
        bucket = self._layout.bucket(tensors)
        samples = self._check(tensors, bucket)
        if self._padding is not None and not self._padding.settled:
            self._padding.check(self._run, step.model, self._layout, tensors, bucket,
                                step.amp is not None)
        graph = step._replaying_graph()
        if graph is not None and samples == template.batch_size:
            entry = self._captured_entry(graph, bucket)
            if entry is not None:
                graph.graph.launch(entry, tensors, [])
                self.counts["replays"] += 1
                return _copied(graph.outputs[entry])
        return self._eager(batch, tensors, bucket, samples)

    def stats(self) -> dict:
        sizes = self._layout.sizes if self._layout else ()
        graph = self._step._graph
        captured = [sizes[b] for b, e in enumerate(self._entries)
                    if e is not None and graph is not None and graph.graph.captured(e)]
        return {**self.counts, "graphs": len(captured), "captured_buckets": captured,
                "eager_buckets": {sizes[b]: why for b, why in self._eager_only.items()},
                "bucket_padding": self._padding and self._padding.verdict}

    # ------------------------------------------------------------------ internals

    def _start(self, batch: Any) -> None:
        if not isinstance(batch, (tuple, list, dict)):
            raise TypeError("an evaluation batch must be a tuple/list or a dict of tensors, "
                            f"as fn(model, batch) takes it; got {type(batch).__name__}")
        template = _options.check_devices(BatchTemplate(batch), self._step._device)
        layout = BucketLayout(template, self._step.buckets)
        self._template, self._layout = template, layout
        self._inputs = [_C.StaticInputs(layout.specs(b)) for b in range(len(layout.sizes))]
        self._entries = [None] * len(layout.sizes)
        if layout.buckets is not None:
            self._padding = BucketPadding(
                layout.buckets, "step.evaluator",
                "fn or the model does not ignore the padded positions, so every padded "
                "evaluation would differ from fn on the batches as given.",
                "Name values fn and the attention ignore (labels -100, counted only where "
                "labels != -100; attention mask 0), or nt.Buckets(..., exact=False) to evaluate "
                "the padded batches as they are.", what="fn's output")

    def _check_autocast(self) -> None:
        """While its graphs may run, a call is made under the autocast they were captured
        under: a replay runs the precision of its capture. Raised before anything runs."""
        step = self._step
        if self._autocast is None or step._replaying_graph() is None:
            return
        now = step._autocast_now()
        if now != self._autocast:
            device = step._device_type
            raise NimbleError(
                f"step.evaluator: called {autocast_name(device, *now)}, where its graphs were "
                f"captured {autocast_name(device, *self._autocast)}; a replay runs the "
                "precision it was captured with. Evaluate under the same autocast at every "
                "call, or make another evaluator for the other (step.evaluator(fn): its graphs "
                "join the Step's pool). Nothing was run for this call.")

    def _check(self, tensors: list, bucket: int) -> int:
        try:
            return self._inputs[bucket].check(tensors)
        except TypeError:
            self._template.explain_non_tensors(tensors)
            raise

    def _eager(self, batch: Any, tensors: list, bucket: int, samples: int) -> Any:
        """fn on the batch copied into static inputs like the graph's (with buckets, padded to
        its bucket): a compiled model compiles here for tensors the capture's will match.
        Given the user's own (a slice of a held-out set, v[i:i + b], a view), dynamo may guard
        on the view's base, which the graph's inputs lack, and would compile again inside the
        capture, which cannot be done."""
        inputs = self._inputs[bucket]
        inputs.copy_in(tensors, samples)
        out = self._run(self._template.unflatten_rows(inputs.buffers, samples))
        self.counts["eager"] += 1
        self._met.add(bucket)
        return out

    def _run(self, batch: Any, capturing: bool = False) -> Any:
        """fn, eagerly or captured (a replay runs no forward)."""
        step = self._step
        try:
            with step._compiling(), evaluating(step.model), torch.no_grad(), \
                    step._iteration._autocast():
                out = self.fn(step.model, batch)
        finally:
            if not capturing:
                self._took_changes()
        return _checked(out)

    def _took_changes(self) -> list[tuple[str, object, object]]:
        """What fn's forwards changed themselves is not the user's change (a capture's: once
        it succeeded; a failed one's are undone); returns the numbers changed."""
        changed = []
        if self._step._model is not None:
            changed += self._step._model.after_forward()
        if self._scope is not None:
            changed += self._scope.after_call()
        if self._reads is not None:
            self._reads.take()
        return changed

    def _captured_entry(self, graph, bucket: int) -> int | None:
        """The bucket's captured graph, capturing every bucket's not yet tried (largest
        first) when this one has none; None when the bucket runs eagerly for now."""
        entry = self._entries[bucket]
        if entry is not None and graph.graph.captured(entry):
            return entry
        sizes = self._layout.sizes
        # A compiled model compiles for eval mode at its first call in it, which cannot be
        # inside a capture: an eager call on each bucket first.
        compiled = self._step._compiled_masks is not None
        for b in sorted(range(len(sizes)), key=lambda b: -(sizes[b] or 0)):
            e = self._entries[b]
            captured = e is not None and graph.graph.captured(e)
            unmet = b not in self._met
            waiting = (b in self._deferred and (b != bucket or unmet)) or (compiled and unmet)
            if captured or waiting or b in self._eager_only:
                continue
            self._capture(graph, b)
        entry = self._entries[bucket]
        return entry if entry is not None and graph.graph.captured(entry) else None

    def _capture(self, graph, bucket: int) -> None:
        step = self._step
        if self._entries[bucket] is None:
            self._entries[bucket] = graph.add_unplanned_entry(self._layout.specs(bucket))
        entry = self._entries[bucket]
        static = self._template.unflatten(graph.graph.inputs(entry))
        # fn's numbers from before its first capture: what that capture changes is seen too
        scope = self._scope or ScopeWatch(self.fn, "the evaluator's fn",
                                          "make a new evaluator for each new value "
                                          "(step.evaluator(fn); its graphs join the Step's pool)")
        reads = self._reads or ScopeModules(self.fn, step)  # as they are for this capture

        def captured():
            out = self._run(static, capturing=True)
            step._model.keep_assigned_tensors()  # a forward's `self.avg = ...`: read by the next
            step._keep_moved_data()  # and its `self.avg.data = ...`
            return out

        try:
            graph.capture_unplanned(entry, captured, step._stream, step._sync.records)
        except NimbleError as failure:
            step._undo_forwards()  # what fn's forwards assigned, changed or gave new data
            scope.put_back()
            reads.undo_capture()  # in the modules fn reads from its scope too
            cause = str(failure).splitlines()[0]
            if bucket in self._met:  # it failed after an eager call met its shapes too
                self._deferred.discard(bucket)
                self._eager_only[bucket] = cause
                size = self._layout.sizes[bucket]
                warn_at_user(
                    "step.evaluator: capturing fn failed" + (f" for bucket {size}" if size
                                                             else "") +
                    f", so it runs eagerly (correct, at eager speed). Keep fn free of host "
                    f"synchronisations (.item(), printing) to have it captured. {cause}")
            else:
                self._deferred.add(bucket)
            return
        self._scope = scope  # from its first capture on, fn's numbers are the graphs'
        self._reads = reads
        if self._autocast is None:
            self._autocast = step._autocast_now()  # and the autocast they run
        step._model.captured = True  # and the model's
        warn_replays_keep(self._took_changes(), step._warned_numbers, "an evaluator's capture")
        self._deferred.discard(bucket)
        self.counts["captures"] += 1

    def _drop_graphs(self) -> None:
        """This evaluator's graphs dropped: each is captured again at its bucket's next call."""
        graph = self._step._graph
        for entry in self._entries:
            if entry is not None and graph is not None and graph.graph.captured(entry):
                graph.graph.drop(entry)
                graph.outputs.pop(entry, None)


class ScopeModules:
    """The modules an evaluator's fn reads from its scope besides the Step's model (an averaged
    copy of the model the user keeps, a teacher), as its graphs run them: their modes and
    numbers (those of the configs their code reads too: ``self.cfg.scale``), and the
    attributes where a number would be watched that held None (a mask), by value; child
    modules, parameters and buffers by identity (another one is refused: the graphs run the
    old); the keys of their containers (a module appended to a Sequential) and of their forward
    hooks (a hook registered or removed: the graphs run those of the capture); and the data of
    their parameters and buffers where it was at capture (ParamWatch: replaced data goes back
    there, its values copied; data another step's fused update moved into its flat buffers is
    read there, the graphs captured again). The model's own modules are the Step's to watch
    (and the evaluator puts them in eval mode itself), and so are the tensors the Step's graphs
    read; the numbers, tensors and modules their classes' own code reads from its scope (a
    global of its module) are watched as an evaluator's fn's are (ScopeWatch), those of the
    model's classes by the Step. Backward hooks do not run under no_grad, and are not
    watched."""

    def __init__(self, fn: Callable, step) -> None:
        seen = {id(m) for m in step.model.modules()}
        named = []
        for prefix, top in named_scope_modules(fn):
            for name, module in top.named_modules(prefix=prefix):
                if id(module) not in seen:
                    seen.add(id(module))
                    named.append((name, module))
        self._what, entries = [], []  # per entry (kind, name)
        # per dict whose keys must stay: (kind, module's name, the dict, its keys at capture)
        self._tables: list[tuple[str, str, dict, frozenset]] = []
        holders = []  # (module's name, its attributes, the holder's key, the numbers read)

        def watch(kind: str, name: str, table: dict, key: str) -> None:
            entries.append((table, key, _now(table, key)))
            self._what.append((kind, name))

        for name, module in named:
            attributes = vars(module)
            if "training" in attributes:
                watch("mode", name, attributes, "training")
            # as the Step's ModelWatch picks them; those that hold None by value too
            for key in (key for keys in watched_attributes(module) for key in keys):
                watch("number", f"{name}.{key}", attributes, key)
            holders += [(name, attributes, key, held) for key, value in attributes.items()
                        if (held := _held_numbers(module, key, value))]
            for kind, table in (("module", module._modules), ("parameter", module._parameters),
                                ("buffer", module._buffers)):
                for key in table:
                    watch(kind, f"{name}.{key}", table, key)
                if isinstance(module, _CONTAINERS[kind]):
                    self._tables.append((kind, name, table, frozenset(table)))
            for key, label in _HOOKS[:2]:  # forward pre-hooks and forward hooks
                if isinstance(table := attributes.get(key), dict):
                    self._tables.append((label, name, table, frozenset(table)))
        # An object holding numbers the module's code reads (self.cfg): by identity, then its
        # numbers by value (per holder's entry, its numbers' entries).
        self._held: dict[int, list[int]] = {}
        for name, attributes, key, numbers in holders:
            holder = len(entries)
            watch("holder", f"{name}.{key}", attributes, key)
            for number in numbers:
                watch("number", f"{name}.{key}.{number}", vars(attributes[key]), number)
            self._held[holder] = list(range(holder + 1, len(entries)))
        # Torch's count of the hooks ever registered: a hook removed and another registered
        # in its place leave a dict's number of keys as it was, not the count.
        self._hook_count = len(entries)
        watch("hook count", "", RemovableHandle, "next_id")
        # the numbers' entries: a list there is compared by its items, from a copy
        self._items = frozenset(e for e, (kind, _) in enumerate(self._what) if kind == "number")
        self._entries = kept_entries(entries, self._items)
        self._watch = _C.EntryWatch(entries, [table for _, _, table, _ in self._tables],
                                    sorted(self._items))
        known = {id(t) for t in step._watched}
        self._names, self._tensors = [], []
        for name, module in named:
            for key, t in (*module.named_parameters(recurse=False),
                           *module.named_buffers(recurse=False)):
                if id(t) not in known:
                    known.add(id(t))
                    self._names.append(f"{name}.{key}")
                    self._tensors.append(t)
        self._storage = _C.ParamWatch(self._tensors, 0)
        self._storage.fix_storage()
        # The numbers, tensors and modules their classes' own code reads from its scope (a
        # global of its module), where the Step's watch of its model's classes does not.
        known = {type(m) for m in step.model.modules()}
        classes = [cls for cls in dict.fromkeys(type(m) for _, m in named)
                   if cls not in known and _own_code(cls)[1]]  # torch's code: none of its own
        code = tuple(f for cls in classes for f in _own_code(cls)[1])
        self._code = ScopeWatch(
            code, "the code of " + ", ".join(cls.__name__ for cls in classes) + " (modules the "
            "evaluator's fn reads)", "make a new evaluator (step.evaluator(fn))") if code else None

    def settle(self) -> bool:
        """Before anything runs: a mode changed or an object replaced is refused; replaced data
        goes back where the graphs read it. Returns whether the graphs must be captured again
        (data another step's update moved into its flat buffers is read there from now on)."""
        if self._code:
            self._code.check()
        if self._watch.first_changed() >= 0:
            self._refuse_changed()
        storage = self._storage
        if not storage.changed():
            return False
        moved = storage.moved()
        taken = [i for i in moved if in_flat_buffers(self._tensors[i])]
        for i in moved:
            why = storage.why_not_restorable(i) if i not in taken else ""
            if why:
                raise NimbleError(
                    f"step.evaluator: the data of {self._names[i]!r}, in a module fn reads from "
                    f"its scope, was replaced after the evaluator's capture (p.data = ..., "
                    f"module.to(...)), and {why}. Change values in place (with torch.no_grad(): "
                    "p.copy_(t)), or make a new evaluator for the new module "
                    "(step.evaluator(fn)). Nothing was run for this call.")
        if taken:
            storage.adopt(taken)
        storage.restore()
        return bool(taken)

    def undo_capture(self) -> None:
        """After a failed capture: what fn's forwards changed in these modules (a number they
        count calls in, a buffer assigned anew: a tensor with no values, a capture runs
        nothing), and the data they gave, as before it; and so are the numbers their classes'
        code changed in its scope."""
        for e in self._watch.changed():
            if e != self._hook_count:  # torch's count goes on: handles' ids are never reused
                _put_back(self._entries[e], e in self._items)
        self._storage.undo_moves()
        if self._code:
            self._code.put_back()

    def take(self) -> None:
        """After a call that ran fn (eagerly, or its capture): what its forwards assigned or
        registered themselves (a buffer a forward sets anew) is what the graphs read, not a
        change of the user's."""
        if self._code:
            self._code.after_call()
        if self._watch.first_changed() < 0:
            return
        for e in self._watch.changed():
            table, key, _ = self._entries[e]
            now = _now(table, key)
            if now is not _MISSING:
                self._take(e)
                if e in self._held:
                    self._retarget_held(e, now)
        self._take_tables()

    def _take(self, e: int) -> None:
        take(self._watch, self._entries, self._items, e)

    def _retarget_held(self, holder: int, now: object) -> None:
        """The numbers of the holder entry's object are watched in `now` from now on."""
        held = number_table(now)
        for n in self._held[holder]:
            self._entries[n] = retarget(self._watch, n, self._entries[n][1], held)

    def _take_tables(self) -> None:
        """The containers' keys and the hooks in place now become the watched ones."""
        self._tables = [(kind, name, table, frozenset(table))
                        for kind, name, table, _ in self._tables]
        self._watch.take_sizes()
        self._take(self._hook_count)

    def _refuse_changed(self) -> None:
        for e in self._watch.changed():
            kind, name = self._what[e]
            table, key, old = self._entries[e]
            now = _now(table, key)
            if kind == "hook count":
                continue  # a hook registered anywhere: the dicts of hooks say whether on these
            if kind == "holder":
                self._settle_holder(e, name, now)
                continue
            if kind in ("number", "mode") and _same_value(now, old, same_type=kind == "number"):
                self._take(e)  # an equal value in another object (training = 1)
                continue
            if kind == "number":
                seen = ("was deleted" if now is _MISSING else
                        f"changed from {shown(old)} to {shown(now)}")
                what = "an attribute" if old is None else "a number"
                raise NimbleError(
                    f"step.evaluator: {name!r}, {what} of a module fn reads from its scope, "
                    f"{seen} after the evaluator's capture; its graphs run the value they were "
                    "captured with (the Python numbers a forward reads, and the code it ran "
                    "for None, are baked into a CUDA graph). Set it back, or make a new "
                    "evaluator for the new value (step.evaluator(fn)). Nothing was run for "
                    "this call.")
            if kind == "mode":
                mode = lambda training: "training" if training else "eval"  # noqa: E731
                raise NimbleError(
                    f"step.evaluator: module {name!r}, which fn reads from its scope, is in "
                    f"{mode(now)} mode, and the evaluator's graphs were captured with it in "
                    f"{mode(old)} mode; a replay runs the modes it was captured with. Put the "
                    "mode back, or make a new evaluator for the new one (step.evaluator(fn)). "
                    "Nothing was run for this call.")
            seen = ("removed" if now is _MISSING or now is None else
                    "set where the graphs read none" if old is None else
                    f"replaced by another {type(now).__name__}" if kind == "module" else
                    "replaced by another tensor")
            raise NimbleError(
                f"step.evaluator: {kind} {name!r}, in a module fn reads from its scope, was "
                f"{seen} after the evaluator's capture (module.{key} = ..., or "
                "load_state_dict(..., assign=True)); its graphs run the one they were captured "
                "with. Load new values in place (load_state_dict without assign=True, or with "
                "torch.no_grad(): p.copy_(t)), or make a new evaluator for the new module "
                "(step.evaluator(fn)). Nothing was run for this call.")
        self._refuse_tables()
        self._take_tables()

    def _settle_holder(self, e: int, name: str, now: object) -> None:
        """An object holding numbers a module's code reads (self.cfg) replaced: its numbers are
        watched in the new one, when each equals the captured one (a config loaded again);
        else refused."""
        unequal = replaced_holder(now, [self._entries[n][1:] for n in self._held[e]])
        if unequal:
            seen, number, was = unequal
            raise NimbleError(
                f"step.evaluator: {name!r}, in a module fn reads from its scope, was {seen} "
                f"after the evaluator's capture, where its graphs were captured with "
                f"{number!r} {was!r} (the Python numbers a forward reads are baked into a "
                "CUDA graph). Set it back, or make a new evaluator for the new values "
                "(step.evaluator(fn)). Nothing was run for this call.")
        self._take(e)
        self._retarget_held(e, now)

    def _refuse_tables(self) -> None:
        """A module or parameter added to a container, or a forward hook registered or
        removed, since capture (keys replaced or removed from a container are the entries'
        to name)."""
        for kind, name, table, keys in self._tables:
            if keys == table.keys():
                continue
            added = [key for key in table if key not in keys]
            owner = f"{name!r}, a module fn reads from its scope,"
            if kind in _CONTAINERS:
                if not added:
                    continue
                value = table[added[0]]
                what = (f"a {type(value).__name__}" if kind == "module" else
                        "none" if value is None else describe(value))
                raise NimbleError(
                    f"step.evaluator: {kind} {name}.{added[0]} ({what}) was added to {owner} "
                    "after the evaluator's capture; a forward that runs the container's "
                    "contents would run it, and the evaluator's graphs run the container as "
                    "it was captured. Add to containers before the evaluator's first call, or "
                    "make a new evaluator (step.evaluator(fn)). Nothing was run for this call.")
            seen, effect = hook_change(kind, table, keys)
            raise NimbleError(
                f"step.evaluator: {seen} {owner} after the evaluator's capture; a replay runs "
                f"no Python, so its graphs {effect}. Register and remove hooks before the "
                "evaluator's first call, or make a new evaluator (step.evaluator(fn)). Nothing "
                "was run for this call.")


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """The model in eval mode for the block; every module's own mode back after it."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _checked(out: Any) -> Any:
    tensors = out.values() if isinstance(out, dict) else [out]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(
            "step.evaluator(fn): fn(model, batch) must return a tensor or a dict of tensors "
            f"(e.g. {{'correct': ..., 'loss_sum': ...}}); got {_kind(out)}")
    return out


def _kind(out: Any) -> str:
    if isinstance(out, dict):
        return "a dict with " + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in out.items())
    return type(out).__name__


def _copied(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    return {key: value.clone() for key, value in out.items()}
