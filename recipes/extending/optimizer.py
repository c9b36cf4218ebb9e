"""Optimizer plugin: `fn(params, *, lr, weight_decay, **params) -> torch.optim.Optimizer` (set
`forward_only = True` on an optimizer that steps from a loss closure without gradients, as MeZO does).
Recipe: `learner.optimizer: {name: recipes/extending/optimizer.py:sgd, params: {momentum: 0.9}}`."""

import torch


def sgd(params, *, lr: float, weight_decay: float = 0.0, momentum: float = 0.0, nesterov: bool = False):
    """torch SGD with (Nesterov) momentum."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
