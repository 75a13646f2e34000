"""Makes a user's torch.optim optimizer capturable, with learning rates read on the device.

A captured graph bakes Python floats into its kernels. Learning rates that a scheduler changes
between steps must instead be device tensors the graph reads: torch's fused SGD and its
capturable Adam/AdamW accept a tensor `lr`, so Step puts a device scalar in `group["lr"]`
while capturing and the user's float back afterwards; before each replay the float is staged
for the graph to read (through the step's staging ring, nimble_train._C.StepGraph).

Other hyper-parameters (momentum, betas, weight decay, ...) stay baked in: Step notices a
change and captures again. Optimizers without a tensor-lr path keep lr baked in as well.
"""

from __future__ import annotations

import torch

from . import _torch_private

# Classes whose param groups take a device `lr` in a captured step, and how to enable it.
_FUSED_LR = (torch.optim.SGD,)
_CAPTURABLE_LR = (torch.optim.Adam, torch.optim.AdamW)


def _all_cuda_float(group: dict) -> bool:
    return all(p.is_cuda and p.is_floating_point() for p in group["params"])


def make_capturable(optimizer: torch.optim.Optimizer) -> list[bool]:
    """Switches each param group to its capturable form; returns which groups need their float
    lr staged to the device before each replay.

    Numerically this changes nothing but rounding: fused SGD and capturable Adam compute the
    same update as the default foreach paths.
    """
    staged_lr = []
    for group in optimizer.param_groups:
        tensor_lr_ok = _all_cuda_float(group) and not group.get("differentiable", False)
        if tensor_lr_ok and isinstance(optimizer, _FUSED_LR):
            group["foreach"] = False
            group["fused"] = True
            _torch_private.declare_amp_scaling(optimizer)  # GradScaler reads it
        elif tensor_lr_ok and isinstance(optimizer, _CAPTURABLE_LR):
            if not group.get("fused"):
                group["capturable"] = True
        else:
            tensor_lr_ok = False
            if "capturable" in group:
                group["capturable"] = True
        if group.get("capturable"):
            _move_step_counters(optimizer, group)
        # A CUDA tensor lr is read on the device already: the graph sees in-place updates.
        cuda_lr = isinstance(group["lr"], torch.Tensor) and group["lr"].is_cuda
        staged_lr.append(tensor_lr_ok and not cuda_lr)
    return staged_lr


def _move_step_counters(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Capturable optimizers keep `step` on the parameter's device, as float32."""
    for p in group["params"]:
        state = optimizer.state.get(p)
        if state and "step" in state and isinstance(state["step"], torch.Tensor):
            if state["step"].device != p.device:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def hyperparameters(optimizer: torch.optim.Optimizer, staged_lr: list[bool]) -> list[dict]:
    """What a captured step bakes in, per group: everything but params and the staged lr. A
    device tensor (a CUDA lr) is read by the graph where it is, so it is kept as itself: a
    scheduler's fill_ reaches the graph, another tensor put in its place does not (a
    recapture is due); a CPU tensor by its value."""
    snapshot = []
    for group, on_device in zip(optimizer.param_groups, staged_lr):
        baked = {}
        for key, value in group.items():
            if key == "params" or key == "initial_lr" or (on_device and key == "lr"):
                continue
            on_cpu = isinstance(value, torch.Tensor) and value.device.type == "cpu"
            baked[key] = value.clone() if on_cpu else value
        snapshot.append(baked)
    return snapshot


def same_hyperparameters(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.keys() != y.keys():
            return False
        for key in x:
            u, v = x[key], y[key]
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)):
                    return False
                if u.device.type == "cpu" and v.device.type == "cpu":
                    if not torch.equal(u, v):
                        return False
                elif u is not v:  # the graph reads the tensor it was captured with
                    return False
            elif u != v:
                return False
    return True


def host_lr(group: dict) -> float:
    """The learning rate a scheduler last wrote, as a float (no device sync: CPU values only)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.is_cuda:
            raise TypeError(
                "a CUDA tensor learning rate cannot be staged without a host sync; give the "
                "optimizer a float (or CPU tensor) lr and let Step put it on the device"
            )
        return float(lr)
    return float(lr)
