"""Parameters, gradients and optimizers that the fused-optimizer tests compare with torch.optim."""

import torch

# Awkward sizes: a 2-D tensor, a prime, tiny ones, and 64 x 33 across chunk boundaries.
SHAPES = [(37, 5), (113,), (3,), (1,), (8, 8), (64, 33)]


def make_params(dtype=torch.float32, device="cpu", seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
            for s in shapes]


def clone_params(params, dtype=None, device=None):
    return [p.detach().to(device or p.device, dtype or p.dtype, copy=True).requires_grad_()
            for p in params]


def groups(params, second):
    """Two parameter groups: the first three tensors with the defaults, the rest with `second`."""
    return [{"params": params[:3]}, {"params": params[3:], **second}]


def random_grads(params, seed, dtype=None):
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, dtype or p.dtype)
            for p in params]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.to(p.device, copy=True)
        else:
            p.grad.copy_(g)


def max_error(tensors, reference):
    return max((a.double().cpu() - b.double().cpu()).abs().max().item()
               for a, b in zip(tensors, reference))
