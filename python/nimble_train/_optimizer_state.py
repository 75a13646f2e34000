"""What the step() of an optimizer captured as it is does outside the device, checked at capture.

A CUDA graph replays the kernels its capture launched; the Python of ``optimizer.step()`` ran
once, inside the capture. An optimizer whose step() advances values on the host -- a step count
held as a Python int or a CPU tensor (torch's Adagrad; many third-party optimizers, which compute
their bias corrections from it), a running value kept in a param group -- would have every replay
compute the update from the capture's values and leave them as the capture did: training that
quietly differs from eager steps, and a state_dict whose step counts never move. One whose step()
assigns a state tensor anew (``state["m"] = beta * state["m"] + g``) would have every replay read
the tensor the capture began with, never the one the last replay wrote.

HostState takes, before a capture, every value of the optimizer's state and param groups and the
numbers it keeps in its own attributes; once the captured step() has run, check_and_keep():

- a device tensor assigned anew, in the same shape, dtype and device: its new values are copied
  in the graph into the tensor the capture began with, which goes back in the state, so that
  each replay leaves them where the next one reads them, as eager steps do;
- anything else changed (a host value, a key added or removed, a tensor that no longer fits):
  HostStateError, which fails the capture, naming the first change; restore() puts back the
  values as they were before it (a CPU tensor incremented in place too).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .errors import NimbleError

_NUMBERS = (bool, int, float)


class HostStateError(NimbleError):
    """The captured optimizer step changed state a replay cannot carry (the user's to fix:
    capturing again on one stream would meet it again)."""


def _picture(value: Any, depth: int = 0) -> Any:
    """A comparable picture of a value as it is now: host values by value (CPU tensors cloned),
    device tensors and other objects by identity."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return ("cpu tensor", value.detach().clone())
        return ("device tensor", id(value))
    if value is None or isinstance(value, (*_NUMBERS, complex, str, bytes)):
        return value
    if depth < 4 and isinstance(value, (tuple, list)):
        return (type(value), tuple(_picture(v, depth + 1) for v in value))
    if depth < 4 and isinstance(value, dict):
        return (dict, tuple((k, _picture(v, depth + 1)) for k, v in value.items()))
    return ("object", id(value))


def same(a: Any, b: Any) -> bool:
    """Two values alike in value and type, a tuple's or list's items each (an int is not a
    float), NaN alike; tensors in dtype, shape and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.eq(a, b).logical_or(a.ne(a).logical_and(b.ne(b))).all()))
    if (isinstance(a, tuple) and isinstance(b, tuple)
            or type(a) is list and type(b) is list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN stays NaN
    return type(a) is type(b) and a == b


def shown(value: Any) -> str:
    """A value for a message; a device tensor's values are not read (inside a capture a read
    would synchronise)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.numel() == 1:
            return f"a CPU tensor {value.item()!r}"
        where = "a CPU tensor" if value.device.type == "cpu" else f"a {value.device.type} tensor"
        return f"{where} of shape {tuple(value.shape)} ({str(value.dtype).replace('torch.', '')})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Held:
    """One dict of the optimizer's (a param group, a parameter's state, its attributes): the
    objects it held and their pictures, before the capture."""

    def __init__(self, label: str, values: dict, keys: list, ignored: frozenset = frozenset(),
                 *, every_key: bool = True, dotted: bool = False):
        self.label, self.values, self.dotted = label, values, dotted
        self.ignored = ignored  # keys not watched: a group's params, its lr while staged
        self.every_key = every_key  # False: only `keys` are watched (an object's numbers)
        self.before = {key: (values[key], _picture(values[key])) for key in keys}

    def name(self, key) -> str:
        return f"{self.label}.{key}" if self.dotted else f"{self.label}[{key!r}]"

    def added(self) -> list:
        """Keys made since, where every key is watched."""
        if not self.every_key:
            return []
        return [k for k in self.values if k not in self.before and k not in self.ignored]


class HostState:
    """Snapshot, check and rollback of an optimizer's values around a capture of its step()."""

    def __init__(self, optimizer: torch.optim.Optimizer, staged_lr: list[bool]):
        self.optimizer = optimizer
        self.staged_lr = staged_lr  # those groups' lr is the graphs' device value while capturing
        self._held: list[_Held] | None = None
        self._stateful: set[int] = set()

    @property
    def taken(self) -> bool:
        return self._held is not None

    def take(self, name: Callable[[int], str]) -> None:
        """Before a capture: every value step() may change. `name(k)` names the k-th parameter
        of the param groups, in their order."""
        opt, held, k = self.optimizer, [], 0
        for g, group in enumerate(opt.param_groups):
            staged = g < len(self.staged_lr) and self.staged_lr[g]
            ignored = frozenset(("params", "lr") if staged else ("params",))
            held.append(_Held(f"param_groups[{g}]", group,
                              [k for k in group if k not in ignored], ignored))
            for p in group["params"]:
                state = opt.state.get(p)
                if state is not None:
                    held.append(_Held(f"the state of {name(k)}", state, list(state)))
                k += 1
        # state kept under keys of its own (optimizer.state["step"], a dict of global values)
        params = {id(p) for group in opt.param_groups for p in group["params"]}
        own = [k for k in opt.state if id(k) not in params]
        for key in own:
            if isinstance(opt.state[key], dict):
                held.append(_Held(f"optimizer.state[{key!r}]", opt.state[key],
                                  list(opt.state[key])))
        held.append(_Held("optimizer.state", opt.state,
                          [k for k in own if not isinstance(opt.state[k], dict)],
                          every_key=False))
        attributes = vars(opt)
        held.append(_Held(type(opt).__name__, attributes,
                          [k for k, v in attributes.items() if isinstance(v, _NUMBERS)],
                          every_key=False, dotted=True))
        self._held = held
        self._stateful = {id(p) for p in opt.state}

    def check_and_keep(self) -> None:
        """Inside the capture, after the optimizer's step(): device tensors it assigned anew are
        copied back into the ones the capture began with (in the graph); any other change raises
        HostStateError."""
        changes = []
        with torch.no_grad():
            for held in self._held:
                changes += self._check(held)
        added = [p for p in self.optimizer.state if id(p) not in self._stateful]
        if added:
            changes.append(f"optimizer.state was given {len(added)} new entries")
        if changes:
            more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
            raise HostStateError(
                f"nimble_train.Step: {type(self.optimizer).__name__}.step() changed what a CUDA "
                f"graph cannot carry from one replay to the next: {changes[0]}{more}. A replay "
                "runs the update's kernels, not its Python: every replay would compute the update "
                "from the values this capture saw (a step count, a bias correction, a decay) and "
                "leave them as they are, training otherwise than eager steps. Keep such values in "
                "device tensors changed in place (torch.optim's optimizers do with "
                "capturable=True), use an optimizer Step fuses (torch.optim.SGD, Adam, AdamW, "
                "nimble_train.optim.LAMB), or nt.Step(..., capture=False).")

    def _check(self, held: _Held) -> list[str]:
        values, changes = held.values, []
        for key, (obj, picture) in held.before.items():
            if key not in values:
                changes.append(f"{held.name(key)} was removed")
                continue
            new = values[key]
            if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
                if new is obj:
                    continue
                if (isinstance(new, torch.Tensor) and new.shape == obj.shape
                        and new.dtype == obj.dtype and new.device == obj.device):
                    obj.copy_(new)  # in the graph: the replays carry it to the next step
                    values[key] = obj
                    continue
                changes.append(f"{held.name(key)} went from {shown(obj)} to {shown(new)}")
            elif not same(picture, _picture(new)):
                was = picture[1] if isinstance(obj, torch.Tensor) else obj  # a CPU tensor's copy
                changes.append(f"{held.name(key)} went from {shown(was)} to {shown(new)}")
        for key in held.added():
            changes.append(f"{held.name(key)} was added ({shown(values[key])})")
        return changes

    def restore(self) -> None:
        """After a failed capture: every value as before it (kept for a capture tried again)."""
        if self._held is None:
            return
        with torch.no_grad():
            for held in self._held:
                values = held.values
                for key in held.added():
                    del values[key]
                for key, (obj, picture) in held.before.items():
                    if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu"
                            and obj.shape == picture[1].shape):
                        obj.copy_(picture[1])  # a count incremented in place
                    values[key] = obj
        for p in [p for p in self.optimizer.state if id(p) not in self._stateful]:
            del self.optimizer.state[p]

    def release(self) -> None:
        self._held = None
        self._stateful = set()
