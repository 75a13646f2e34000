"""DeviceLossScaler: fp16 dynamic loss scaling kept on the device, capturable."""

from __future__ import annotations

import torch

from .. import _torch_private


class DeviceLossScaler:
    """Dynamic loss scale for float16 training, with ``torch.amp.GradScaler``'s semantics and no
    host synchronisation: the scale, the growth tracker and the overflow flag live on the device.

    After a step with a non-finite gradient the scale is multiplied by ``backoff_factor`` (and the
    optimizer step is skipped by FusedOptimizer); after ``growth_interval`` consecutive clean steps
    it is multiplied by ``growth_factor``. The update is ``torch._amp_update_scale_``, the op
    GradScaler itself runs, so both follow the same sequence of scales. Per step::

        scaler.scale_loss(loss).backward()
        fused.step(inv_scale=scaler.inv_scale(), found_inf=scaler.found_inf)
        scaler.update()

    or ``scaler.step(fused)`` for the last two lines. Every call is capturable.
    """

    def __init__(self, device: torch.device | str = "cuda", init_scale: float = 2.0**16, *,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not init_scale > 0:
            raise ValueError(f"DeviceLossScaler: init_scale must be > 0; got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"DeviceLossScaler: growth_factor must be > 1; got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"DeviceLossScaler: backoff_factor must be in (0, 1); got "
                             f"{backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(f"DeviceLossScaler: growth_interval must be a positive int; got "
                             f"{growth_interval!r}")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.scale = torch.full((1,), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._inv_scale = torch.ones(1, dtype=torch.float32, device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * scale (GradScaler.scale)."""
        return loss * self.scale.to(loss.device)

    def inv_scale(self) -> torch.Tensor:
        """1 / scale, computed on the device into a fixed buffer (float32 [1]); as GradScaler,
        the reciprocal is taken in double."""
        self._inv_scale.copy_(self.scale.double().reciprocal())
        return self._inv_scale

    def update(self) -> None:
        """Grows or backs off the scale from ``found_inf``, on the device."""
        _torch_private.amp_update_scale_(self.scale, self.growth_tracker, self.found_inf,
                                         self.growth_factor, self.backoff_factor,
                                         self.growth_interval)

    def step(self, fused, *, max_grad_norm: float | None = None,
             grad_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``fused.step`` with this scaler's inverse scale and overflow flag, then ``update``.
        Returns the global norm of the unscaled gradients (0-dim device tensor)."""
        norm = fused.step(inv_scale=self.inv_scale(), found_inf=self.found_inf,
                          max_grad_norm=max_grad_norm, grad_scale=grad_scale)
        self.update()
        return norm

    def state_dict(self) -> dict:
        """GradScaler's format (synchronises: for checkpoints)."""
        return {"scale": float(self.scale), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["_growth_tracker"]))
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
