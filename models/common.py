"""Pieces the model classes share."""

from __future__ import annotations

from torch import nn


def init_weights(module: nn.Module, std: float, norm_types: tuple[type, ...]) -> None:
    """transformers' `_init_weights` for a Llama-style model: linear and embedding weights ~ N(0, std), linear biases
    0, the weights of norms of `norm_types` 1."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, norm_types):
        nn.init.ones_(module.weight)
