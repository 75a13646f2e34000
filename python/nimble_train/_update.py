"""How a Step's optimizer update runs, and the values it stages for every launch.

A captured step fuses SGD, Adam, AdamW and LAMB (FusedOptimizer, from the end of warm-up on:
warm-up shows which parameters get gradients): every hyper-parameter is then read on the
device, staged per launch. Other optimizers are captured as they are, with the learning rate
of each param group that allows it staged (``staged_lr``) and everything else baked into the
graph, so a change of those captures again. Eager steps (capture=False, CPU) run the
optimizer as it is.
"""

from __future__ import annotations

import contextlib

import torch

from . import _capturable, _torch_private
from ._extension import _C
from ._optimizer_state import HostState
from ._sync import warn_at_user
from .errors import NimbleError


class Update:
    """The update of one Step: which kind, its fused optimizer and loss scalers."""

    def __init__(self, optimizer: torch.optim.Optimizer, amp: str | None, will_capture: bool,
                 device: torch.device):
        from .optim import FusedOptimizer

        self.optimizer = optimizer
        self.device = device
        self.will_capture = will_capture
        self.fused = None         # FusedOptimizer, from the end of warm-up on (fuse())
        self.scaler = None        # fp16 with the fused update: DeviceLossScaler
        self.grad_scaler = None   # fp16 in eager steps: torch's GradScaler
        self.staged_lr: list[bool] = []
        self._baked: list[dict] | None = None
        self._read_on_device: list[torch.Tensor] | None = None  # fused: bake()
        # Captured as it is: the state tensors the graphs read, as (group, index, key, tensor),
        # and whether optimizer.load_state_dict replaced them since (settle_state).
        self._state_read: list[tuple[int, int, str, torch.Tensor]] = []
        self._load_hook = None
        self.host_state: HostState | None = None  # captured as it is: HostState
        self._hooks: tuple | None = None  # captured as it is: the step hooks its graphs ran
        self.loaded = False
        # Each param group's tensors as built: the flat buffers, graphs and gradient averaging
        # are planned over these (check_groups).
        self._groups = [tuple(group["params"]) for group in optimizer.param_groups]
        if amp == "fp16":
            self.grad_scaler = torch.amp.GradScaler(device.type)
        self.fuse_reason = FusedOptimizer.why_unsupported(optimizer) if will_capture else None
        if not will_capture:
            return
        if self.fuse_reason is None:
            self.staged_lr = [False] * len(optimizer.param_groups)
            return
        if amp == "fp16":
            raise NotImplementedError(
                'amp="fp16" in a captured step needs a fused optimizer for its device-side loss '
                f"scale, and this one cannot be fused: {self.fuse_reason}. Use amp=\"bf16\", SGD, "
                "Adam, AdamW or nimble_train.optim.LAMB, or capture=False.")
        warn_at_user(
            f"nimble_train.Step captures the optimizer's own step(), which is slower than the "
            f"fused update (one kernel per tensor group, hyper-parameters other than lr baked "
            f"into the graph): {self.fuse_reason}.")
        self.staged_lr = _capturable.make_capturable(optimizer)
        # what its step() does outside the device, checked at each capture of it
        self.host_state = HostState(optimizer, self.staged_lr)

    @property
    def kind(self) -> str:
        if self.fused is not None:
            return "fused"
        return "captured as-is" if self.fuse_reason else "eager"

    @property
    def needs_fusing(self) -> bool:
        return self.will_capture and self.fused is None and self.fuse_reason is None

    def num_values(self) -> int:
        """Values this update stages per launch (after the valid-sample count)."""
        if self.fuse_reason is None and self.will_capture:
            from .optim import FusedOptimizer
            return FusedOptimizer.num_staged_values(self.optimizer)
        return sum(self.staged_lr)

    def fuse(self, params: list[torch.Tensor], staged: torch.Tensor, shards: int,
             used: list[bool]) -> None:
        """Moves the update to FusedOptimizer (before the last warm-up step).

        Parameters that got no gradient in warm-up (`used` is False: on any rank) are left
        out, as torch.optim skips them;
        state made by the eager warm-up steps is carried into the flat buffers, and the fp16
        loss scale from torch's GradScaler into the device-side scaler. `staged` is the device
        tensor the step's staging ring fetches this update's values into.
        """
        from .optim import DeviceLossScaler, FusedOptimizer

        unused = frozenset(id(p) for p, u in zip(params, used) if not u)
        self.fused = FusedOptimizer(self.optimizer, exclude=unused, shard_world=shards,
                                    staged=staged)
        if self.grad_scaler is not None:
            self.scaler = DeviceLossScaler(self.device)
            self.scaler.load_state_dict(self.grad_scaler.state_dict())
            self.grad_scaler = None

    def host_values(self) -> list[float]:
        """This launch's staged values, read from param_groups now (no device sync)."""
        if self.fused is not None:
            return self.fused.host_values()
        if self.needs_fusing:  # not fused yet: the slots the fused update will read
            return [0.0] * self.num_values()
        return [_capturable.host_lr(group)
                for group, staged in zip(self.optimizer.param_groups, self.staged_lr) if staged]

    @contextlib.contextmanager
    def lr_on_device(self, values: torch.Tensor):
        """While capturing an optimizer as it is: each staged group's lr is the device scalar
        its launches fetch (values[k] for the k-th staged group); the floats come back after."""
        groups = self.optimizer.param_groups
        saved = [group["lr"] for group in groups]
        k = 0
        for group, staged in zip(groups, self.staged_lr):
            if staged:
                group["lr"] = values[k]
                k += 1
        try:
            yield
        finally:
            for group, lr in zip(groups, saved):
                group["lr"] = lr

    def bake(self) -> None:
        """After capturing an optimizer as it is: what the graph baked in, and the state
        tensors it reads (a load_state_dict since replaces them: settle_state)."""
        if self.fused is not None:
            # the tensors on the device its graphs copy hyper-parameters from (kept alive:
            # the graphs read them)
            self._read_on_device = [t for _, t in self.fused.device_values()]
            return
        self._baked = _capturable.hyperparameters(self.optimizer, self.staged_lr)
        self._hooks = self._hook_keys()
        state = self.optimizer.state
        self._state_read = [(g, i, key, value)
                            for g, group in enumerate(self.optimizer.param_groups)
                            for i, p in enumerate(group["params"])
                            for key, value in state.get(p, {}).items()
                            if isinstance(value, torch.Tensor)]
        if self._load_hook is None:
            self._load_hook = self.optimizer.register_load_state_dict_post_hook(self._on_load)

    def _on_load(self, _optimizer: torch.optim.Optimizer) -> None:
        self.loaded = True

    def settle_state(self) -> None:
        """After optimizer.load_state_dict, for an optimizer captured as it is: the loaded
        values go into the state tensors the graphs read, which optimizer.state holds again,
        and the loaded param groups get their capturable form back. A loaded state without a
        tensor the graphs read, or with another shape, is refused before anything changes."""
        if not self.loaded:
            return
        groups, state = self.optimizer.param_groups, self.optimizer.state
        for g, i, key, read in self._state_read:
            new = state.get(groups[g]["params"][i], {}).get(key)
            if new is read:
                continue
            if not isinstance(new, torch.Tensor) or new.shape != read.shape:
                seen = ("none" if not isinstance(new, torch.Tensor) else
                        f"one of shape {tuple(new.shape)}")
                raise NimbleError(
                    f"nimble_train.Step: optimizer.load_state_dict gave param_groups[{g}]"
                    f"['params'][{i}] the state {key!r} {seen}, where the captured step reads "
                    f"one of shape {tuple(read.shape)}. Load a state_dict saved from this "
                    "optimizer (the same parameters and options), or build a new Step for the "
                    "loaded one: step.close(), then nt.Step(model, optimizer, ...). Nothing was "
                    "run for this call.")
        with torch.no_grad():
            for g, i, key, read in self._state_read:
                p_state = state[groups[g]["params"][i]]
                if p_state[key] is not read:
                    read.copy_(p_state[key])
                    p_state[key] = read
        _capturable.make_capturable(self.optimizer)  # same groups: the same staged lr
        self.loaded = False

    def _same_groups(self) -> bool:
        """Whether every param group holds the tensors it held at build, in order (identity:
        `is`, which a Tensor's == is not; in C++, as every replay asks)."""
        return _C.same_param_groups(self.optimizer.param_groups, self._groups)

    def check_groups(self) -> None:
        """The optimizer's parameters are those the Step was built for: a param group added
        since, or a tensor added to a group, removed, moved to another or replaced by another,
        would be left out of the all-reduce, clipping, the flat buffers and the graphs, or
        updated as its old group's."""
        if self._same_groups():
            return
        groups = self.optimizer.param_groups
        sizes = [len(group["params"]) for group in groups]
        built = [len(kept) for kept in self._groups]
        if sizes != built:
            seen = f"its param groups held {built} tensors, now {sizes}"
        else:
            g, i = next((g, i) for g, (group, kept) in enumerate(zip(groups, self._groups))
                        for i, (p, q) in enumerate(zip(group["params"], kept)) if p is not q)
            seen = (f"param group {g}'s tensor {i} is another tensor than the one it held "
                    f"(shape {tuple(groups[g]['params'][i].shape)}, was "
                    f"{tuple(self._groups[g][i].shape)})")
        raise ValueError(
            f"the optimizer's parameters changed after nt.Step was built: {seen} "
            "(add_param_group, or a group's 'params' edited). Step plans gradient averaging, "
            "clipping, its flat buffers and its graphs once; add every parameter to its group "
            "before building the Step, or build a new Step (step.close() first). Nothing was "
            "run for this call.")

    def _hook_keys(self) -> tuple:
        return tuple((kind, key) for kind, key, _ in
                     _torch_private.optimizer_step_hooks(self.optimizer))

    def check_step_hooks(self, fusing: bool = False) -> None:
        """The fused update is not optimizer.step(): the hooks step() would run are refused,
        before anything runs for the call (at fusing, and on the slow path after)."""
        if not (fusing or self.fused is not None):
            return
        hooks = _torch_private.optimizer_step_hooks(self.optimizer)
        if not hooks:
            return
        names = ", ".join(f"{getattr(hook, '__qualname__', type(hook).__name__)} (a step "
                          f"{kind})" for kind, _, hook in hooks[:3])
        more = f" and {len(hooks) - 3} more" if len(hooks) > 3 else ""
        name = type(self.optimizer).__name__
        raise NimbleError(
            f"nimble_train.Step: {name} has hooks that its step() runs: {names}{more}. A "
            f"captured step runs {name}'s update as a fused kernel of its own over the flat "
            "buffers, not optimizer.step(), so they would stop running after warm-up. Do their "
            "work in the loop after each call (it runs eagerly there, between the graph's "
            "launches), or use nt.Step(..., capture=False), whose steps call "
            "optimizer.step(). Nothing was run for this call.")

    def changed(self) -> bool:
        """Whether a hyper-parameter the graph baked in changed since (a recapture is due), a
        param group was added or its tensors changed, or a loaded state awaits
        settle_state (the slow path sees to each)."""
        if self.loaded or not self._same_groups():
            return True
        if self.fused is not None:
            # It reads every hyper-parameter on the device: staged, or copied from a tensor
            # there (a CUDA lr), which must be the one its graphs were captured with.
            read = self._read_on_device
            if read is None or not (read or self.fused.any_on_device()):
                return False  # none read there, none now (floats: the fast path's check)
            return not _same_objects([t for _, t in self.fused.device_values()], read)
        if self._baked is None:
            return False
        if self._hook_keys() != self._hooks:
            return True  # a step hook registered or removed: the graphs ran the old ones
        now = _capturable.hyperparameters(self.optimizer, self.staged_lr)
        return not _capturable.same_hyperparameters(now, self._baked)

    def warn_if_recapturing_often(self, recaptures: int, steps: int, warmup: int) -> None:
        if recaptures == 3 and steps < 4 * (warmup + 20) and self._read_on_device:
            warn_at_user(
                f"Step has captured its graph {recaptures + 1} times in {steps} steps: a param "
                "group was given another device tensor as a hyper-parameter (group['lr'] = "
                "torch.tensor(..., device='cuda')), and the graph reads the tensor it was "
                "captured with. Change the tensor in place (group['lr'].fill_(v), as torch's "
                "schedulers do); each new tensor costs a capture.")
        elif recaptures == 3 and steps < 4 * (warmup + 20):
            warn_at_user(
                f"Step has captured its graph {recaptures + 1} times in {steps} steps: optimizer "
                "hyper-parameters other than lr (momentum, betas, weight decay, ...) changed "
                f"between steps, and {type(self.optimizer).__name__} bakes them into the graph. "
                "Keep them fixed (e.g. OneCycleLR(cycle_momentum=False)); each change costs a "
                "capture.")

    def close(self) -> None:
        if self.fused is not None:
            self.fused.close()
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
