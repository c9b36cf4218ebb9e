"""Loss-surface curvature: the top eigenvalue of the Hessian of a loss in a set of parameters, by power iteration
with Hessian-vector products (double backward; the Hessian is never formed). Used to compare architectures'
sharpness (SimpleGPT against pre-norm, `benchmarks/training_components.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def top_hessian_eigenvalue(loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.nn.Parameter],
                           iters: int = 20, seed: int = 0) -> float:
    """The Hessian eigenvalue of largest magnitude of `loss_fn()` (a scalar that depends on `params`; a fixed
    batch) by `iters` power-iteration steps from a seeded Gaussian start; returns the last Rayleigh quotient vᵀHv."""
    params = [p for p in params if p.requires_grad]
    grads = torch.autograd.grad(loss_fn(), params, create_graph=True)
    g = torch.Generator().manual_seed(seed)
    v = [torch.randn(p.shape, generator=g).to(p) for p in params]
    eig = 0.0
    for _ in range(iters):
        norm = torch.sqrt(sum((x * x).sum() for x in v))
        v = [x / norm for x in v]
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
        eig = float(sum((a * b).sum() for a, b in zip(hv, v)))
        v = [h.detach() for h in hv]
    return eig
