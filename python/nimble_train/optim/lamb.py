"""LAMB as a plain ``torch.optim.Optimizer``: the reference semantics of the fused LAMB."""

from __future__ import annotations

import torch


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al., 2020) as MLPerf's BERT runs it.

    Per parameter, with AdamW's moments (m, v) and step t::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)      (bias_correction=True)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p          (decay inside the update)
        trust = ||p|| / ||u||   if both norms are non-zero, else 1
        p = p - lr * trust * u

    The trust ratio applies only where weight_decay != 0 (MLPerf excludes biases and LayerNorm
    from both decay and layer adaptation), unless ``always_adapt=True`` (apex's ``use_nvlamb``).
    The math runs in float32 for float16/bfloat16 parameters (state keeps the parameter's dtype),
    as the fused kernels do. Gradient clipping is not part of the optimizer: use
    ``torch.nn.utils.clip_grad_norm_`` or ``FusedOptimizer.step(max_grad_norm=...)``.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, *, bias_correction: bool = True,
                 always_adapt: bool = False):
        if not 0.0 <= float(lr):
            raise ValueError(f"LAMB: lr must be >= 0; got {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"LAMB: eps must be >= 0; got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"LAMB: betas must each be in [0, 1); got {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"LAMB: weight_decay must be >= 0; got {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, always_adapt=always_adapt)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = float(group["lr"]), group["eps"], group["weight_decay"]
            adapt = decay != 0 or group["always_adapt"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                if group["bias_correction"]:
                    inv_bc1, inv_bc2 = 1 / (1 - beta1**step), 1 / (1 - beta2**step)
                else:
                    inv_bc1 = inv_bc2 = 1.0
                # float32 math for float16/bfloat16 storage (float64 stays float64), rounded
                # once into each stored tensor.
                acc = torch.promote_types(p.dtype, torch.float32)
                g, w = p.grad.to(acc), p.to(acc, copy=True)
                m, v = state["exp_avg"].to(acc, copy=True), state["exp_avg_sq"].to(acc, copy=True)
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                # The update from the stored moments, as the fused kernels compute it.
                m, v = state["exp_avg"].to(acc), state["exp_avg_sq"].to(acc)
                update = (m * inv_bc1) / ((v * inv_bc2).sqrt_().add_(eps))
                if decay != 0:
                    update.add_(w, alpha=decay)
                if adapt:
                    w_norm, u_norm = w.norm(), update.norm()
                    trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                                        torch.ones_like(w_norm))
                    update.mul_(trust)
                p.copy_(w.add_(update, alpha=-lr))
        return loss
