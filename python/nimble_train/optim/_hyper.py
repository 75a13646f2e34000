"""The hyper-parameters a fused update reads on the device, staged from ``param_groups``.

Each step, every param group's row of staged columns (lr, weight decay, momentum, betas, ...)
is read from ``optimizer.param_groups`` on the host and goes through the step's staging ring
(src/capture/slot_ring.h) to the device, where prepare_step derives the rest (bias
corrections, the step count): schedulers that edit any of them need no recapture.
"""

from __future__ import annotations

import torch

from .._extension import _C

LAYOUT = _C.optim_layout()
HYPER = LAYOUT["hyper"]           # column of each hyper-parameter in a row
STAGED = LAYOUT["staged_columns"]  # columns staged per group
CONTROL = LAYOUT["control"]


def staged_row(algorithm: str, group: dict) -> list[float]:
    """The staged columns of one param group, as float32-bound Python floats. A value held as
    a tensor on the device (a CUDA tensor lr) is not read here, which would wait for the
    device: its column holds 0 and the update copies the tensor over it (device_values)."""
    row = [0.0] * STAGED
    for name, value in _columns(algorithm, group):
        if not _on_device(value):
            row[HYPER[name]] = float(value)
    return row


def device_values(algorithm: str, groups: list[dict]) -> list[tuple[int, torch.Tensor]]:
    """(index in the staged values, tensor) per hyper-parameter a param group holds as a tensor
    on the device: the update reads it there, by a copy into the staged values, in order on
    the stream after their fetch (no host sync; in a graph, from the tensor it was captured
    with)."""
    return [(g * STAGED + HYPER[name], value) for g, group in enumerate(groups)
            for name, value in _columns(algorithm, group) if _on_device(value)]


# The keys of a param group that may hold a number as a tensor, per algorithm (betas: a pair).
_TENSOR_KEYS = {"sgd": ("lr", "weight_decay", "momentum", "dampening"),
                "adam": ("lr", "weight_decay", "eps", "betas"),
                "lamb": ("lr", "weight_decay", "eps", "betas")}


def any_on_device(algorithm: str, groups: list[dict]) -> bool:
    """Whether device_values would find any: its check on a step's fast path, where floats
    are the rule (a few hundred ns a group)."""
    keys = _TENSOR_KEYS[algorithm]
    for group in groups:
        for key in keys:
            value = group[key]
            if type(value) is float:
                continue
            if key == "betas":
                if any(_on_device(beta) for beta in value):
                    return True
            elif _on_device(value):
                return True
    return False


def _columns(algorithm: str, group: dict) -> list[tuple[str, object]]:
    """(column, value) per staged hyper-parameter of a param group; flags as bools."""
    out = [("lr", group["lr"]), ("weight_decay", group["weight_decay"])]
    if algorithm == "sgd":
        out += [("momentum", group["momentum"]), ("dampening", group["dampening"]),
                ("nesterov", bool(group["nesterov"]))]
    else:
        beta1, beta2 = group["betas"]
        out += [("beta1", beta1), ("beta2", beta2), ("eps", group["eps"])]
    if algorithm in ("sgd", "adam"):
        out.append(("maximize", bool(group.get("maximize", False))))
    if algorithm == "adam":
        out.append(("decoupled_weight_decay", bool(group.get("decoupled_weight_decay", False))))
    if algorithm == "lamb":
        out += [("bias_correction", bool(group["bias_correction"])),
                ("always_adapt", bool(group["always_adapt"]))]
    return out


def _on_device(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


class Structure:
    """What the flat buffers were built for, which a change of param_groups would invalidate."""

    def __init__(self, optimizer: torch.optim.Optimizer, algorithm: str):
        groups = optimizer.param_groups
        self.algorithm = algorithm
        self.sizes = [len(group["params"]) for group in groups]
        self.amsgrad = algorithm == "adam" and bool(groups[0]["amsgrad"])
        self.momentum_on = [algorithm == "sgd" and group["momentum"] != 0 for group in groups]

    def state_keys(self) -> list[str]:
        """The state buffers the update keeps (torch's names)."""
        from ._flat import STATE_KEYS

        keys = list(STATE_KEYS[self.algorithm])
        if self.amsgrad:
            keys.append("max_exp_avg_sq")
        return keys if self.algorithm != "sgd" or any(self.momentum_on) else []

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        sizes = [len(group["params"]) for group in groups]
        if sizes != self.sizes:
            raise ValueError(
                f"FusedOptimizer: the parameter groups changed (sizes {self.sizes} -> {sizes}); "
                "the flat buffers hold the old parameters. Build a new FusedOptimizer.")
        for g, group in enumerate(groups):
            if self.algorithm == "adam" and bool(group["amsgrad"]) != self.amsgrad:
                raise ValueError(
                    f"FusedOptimizer: param_groups[{g}]['amsgrad'] changed to {group['amsgrad']}; "
                    "it decides which state buffers exist. Build a new FusedOptimizer.")
            if self.algorithm == "sgd" and (group["momentum"] != 0) != self.momentum_on[g]:
                raise ValueError(
                    f"FusedOptimizer: param_groups[{g}]['momentum'] changed between zero and "
                    f"non-zero (now {group['momentum']}); that creates or drops momentum buffers. "
                    "Build a new FusedOptimizer.")

    def values(self, optimizer: torch.optim.Optimizer) -> list[float]:
        """Every group's staged row, concatenated: one step's values for the staging ring."""
        self.check(optimizer)
        out: list[float] = []
        for group in optimizer.param_groups:
            out += staged_row(self.algorithm, group)
        return out


def make_tables(staged: torch.Tensor, flats: list, num_groups: int, num_params: int,
                device: torch.device):
    """The fused update's device tables (src/optim/device_tables.h): `staged`, the float32
    [num_groups * STAGED] tensor the staging ring fetches each step's rows into; the hyper
    table prepare_step fills from it; each parameter's step count and group; the control block."""
    if staged.dtype != torch.float32 or staged.numel() != num_groups * STAGED or \
            staged.device != device:
        raise ValueError(f"FusedOptimizer: staged must be float32 [{num_groups * STAGED}] on "
                         f"{device}; got {staged.dtype} [{staged.numel()}] on {staged.device}")
    param_group = torch.empty(num_params, dtype=torch.int64)
    for flat in flats:
        for index, g in zip(flat.param_index, flat.groups):
            param_group[index] = g
    return _C.OptimStepTables(
        staged=staged,
        hyper=torch.zeros(num_groups, LAYOUT["hyper_columns"], device=device),
        param_steps=torch.zeros(num_params, device=device),
        param_group=param_group.to(device),
        control=torch.zeros(LAYOUT["control_size"], device=device))
